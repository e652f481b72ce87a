"""postrl's monitors live over another engine's logged metrics (TRL's, verl's), one row at a time.

:class:`ForeignWatchdog` translates each row to postrl's keys (:func:`postrl.diagnostics.engines.translate`), runs
the :class:`~postrl.diagnostics.monitors.Watchdog` with that engine's names in its alarms, and says once (at the
first row with training metrics) which monitors the run's metrics cannot feed. The TRL callback and the verl hook
(:mod:`postrl.integrations.alarms`) are thin wrappers around it.
"""

from __future__ import annotations

import logging
from typing import Callable

from postrl.config.diagnostics import DiagnosticsConfig
from postrl.diagnostics.engines import ENGINES, flatten, settings_config, translate
from postrl.diagnostics.monitors import MONITORS, Alarm, Watchdog, unread, unread_text

_log = logging.getLogger("postrl.alarms")
_ALTS = [alt for spec in MONITORS for e in spec.reads for alt in e.split("|")]
_EXACT = {a for a in _ALTS if "*" not in a}
_PREFIXES = tuple(a.split("*")[0] for a in _ALTS if "*" in a)


def _trains(row: dict) -> bool:
    """A row with at least one metric a monitor reads (not an evaluation-only or summary row)."""
    return any(k in _EXACT or k.startswith(_PREFIXES) for k in row)


class ForeignWatchdog:
    """postrl's monitors over ``engine``'s (``trl``, ``verl``) logged rows.

    ``settings``: the engine's own settings (TRL: ``GRPOConfig`` fields; verl: its config, nested or dotted), for
    the values the alarms quote; ``diagnostics``: postrl's ``diagnostics`` section (thresholds, patience), default
    postrl's defaults; ``say``: where an alarm's first step and the skipped-monitor line go (default: a warning of
    the ``postrl.alarms`` logger)."""

    def __init__(self, engine: str, settings: dict | None = None,
                 diagnostics: DiagnosticsConfig | dict | None = None, say: Callable[[str], None] | None = None):
        if engine not in ENGINES or engine == "postrl":
            raise ValueError(f"engine: expected one of trl, verl, got {engine!r}")
        self.engine = engine
        self.settings = flatten(settings) if engine == "verl" else dict(settings or {})
        self.watchdog = Watchdog(settings_config(engine, self.settings), diagnostics or {}, engine=engine)
        self.say = say or _log.warning
        self.skipped: str | None = None  # the skipped-monitor line, once said
        self.alarms: list[Alarm] = []  # every alarm at every step it was active
        self._active: set[str] = set()

    def step(self, raw: dict, step: int) -> list[Alarm]:
        """The alarms active at ``step`` for one logged row (the engine's names); a row without training metrics
        (an evaluation, the end-of-training summary) is skipped. An alarm is said at the first step of each
        streak; the skipped monitors once, at the first training row."""
        row = translate(self.engine, raw)
        if not _trains(row):
            return []
        row["step"] = int(step)
        if self.skipped is None:
            self.skipped = unread_text(unread(row), self.engine)
            if self.skipped:
                self.say(f"postrl: {self.skipped}")
        alarms = self.watchdog.step(row)
        now = {a.name for a in alarms}
        for a in alarms:
            if a.name not in self._active:
                self.say(f"postrl alarm (step {a.step}) {a.text()}")
        self._active = now
        self.alarms += alarms
        return alarms

    @staticmethod
    def flags(alarms: list[Alarm]) -> dict[str, float]:
        """``postrl/alarm/<name>`` = 1 per active alarm (how the alarms are logged beside the engine's metrics)."""
        return {f"postrl/alarm/{a.name}": 1.0 for a in alarms}
