"""Reading a run directory (finished, crashed or still being written) without changing it.

A run directory holds config.yaml, metrics.jsonl (one line per step, with its ``alarms``), samples.jsonl,
eval.jsonl, summary.json (only once finished), checkpoints/step-N/, final/ (the trained model), bad_batches/,
run.lock (the process writing it) and status.json (how a process that did not finish ended); see
``postrl.train.run_state``. Lines cut by a crash or by a writer in progress are skipped.

:func:`load_run` also reads runs postrl did not train (:mod:`postrl.report.foreign`: a TRL / transformers Trainer
output folder, verl's file-logger metrics, a W&B offline run): their metrics are translated to postrl's keys
(:func:`postrl.diagnostics.engines.translate`), their settings to postrl's config keys where they mean the same
(``Run.config``; the engine's own in ``Run.settings``), and ``Run.engine`` says whose options the alarms name.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from postrl.io import read_jsonl
from postrl.errors import PostrlError
from postrl.config import yaml_load
from postrl.diagnostics.engines import settings_config, translate
from postrl.diagnostics.monitors import replay
from postrl.report.foreign import read
from postrl.train.run_state import read_holder, read_status


@dataclass
class Run:
    path: Path
    config: dict
    metrics: list[dict]
    evals: list[dict]
    samples: list[dict]
    summary: dict | None
    engine: str = "postrl"  # who trained it: postrl, trl, verl
    source: Path | None = None  # another engine's run: the file its metrics were read from
    settings: dict = field(default_factory=dict)  # another engine's run: its own settings (flat)
    foreign: object | None = field(default=None, repr=False)  # the postrl.report.foreign.Foreign it was read from
    _alarms: tuple | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def steps_planned(self) -> int | None:
        if self.foreign is not None and self.foreign.steps_planned is not None:
            return self.foreign.steps_planned
        v = (self.config.get("train") or {}).get("steps")
        return int(v) if isinstance(v, int) else None

    @property
    def steps_done(self) -> int:
        return max((int(m.get("step", 0)) for m in self.metrics), default=0)

    @property
    def finished(self) -> bool:
        """summary.json is there and covers the planned steps (a run extended after it finished is not)."""
        if self.summary is None:
            return False
        done, planned = self.summary.get("steps"), self.steps_planned
        return not (isinstance(done, int) and planned is not None and done < planned)

    def holder(self) -> dict | None:
        """The process that holds (or, killed, last held) the run's lock: {pid, host, started}, or None."""
        return read_holder(self.path)

    def end_status(self) -> dict | None:
        """status.json: how the last process ended without finishing (stopped / aborted / failed), or None."""
        return read_status(self.path)

    def quarantined(self) -> list[Path]:
        """Checkpoints found unusable on resume and moved aside (``step-N.corrupt``)."""
        root = self.path / "checkpoints"
        return sorted(root.glob("step-*.corrupt*")) if root.is_dir() else []

    def seconds_since_write(self) -> float | None:
        f = self.source if self.source is not None else self.path / "metrics.jsonl"
        return time.time() - f.stat().st_mtime if f.is_file() else None

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (``step-N`` with trainer_state.json; a TRL run's ``checkpoint-N``), oldest first;
        read-only."""
        if self.foreign is not None:
            return list(self.foreign.checkpoints)
        root = self.path / "checkpoints"
        out = []
        if root.is_dir():
            for d in root.iterdir():
                m = re.fullmatch(r"step-(\d+)", d.name)
                if m and d.is_dir() and (d / "trainer_state.json").is_file():
                    out.append((int(m.group(1)), d))
        return sorted(out)

    def bad_batches(self) -> list[Path]:
        d = self.path / "bad_batches"
        return sorted(d.glob("*.pt")) if d.is_dir() else []

    def series(self, key: str) -> tuple[list[int], list[float]]:
        xs, ys = [], []
        for m in self.metrics:
            v = m.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                xs.append(int(m.get("step", 0)))
                ys.append(float(v))
        return xs, ys

    def alarms(self) -> tuple[list[list[dict]], list[dict], dict[str, dict]]:
        """(alarms active at each metrics row, final alarms, summary per alarm name).

        The monitors are replayed over the logged metrics with the run's own thresholds (so a run written before
        a monitor existed is diagnosed too), and merged with the alarms recorded in metrics.jsonl.
        """
        if self._alarms is None:
            replayed, final = replay(self.metrics, self.evals, self.config, engine=self.engine)
            per_step: list[list[dict]] = []
            for m, rep in zip(self.metrics, replayed):
                seen: dict[str, dict] = {a["name"]: a for a in (m.get("alarms") or []) if isinstance(a, dict)}
                for a in rep:
                    seen.setdefault(a.name, a.to_dict())
                per_step.append(list(seen.values()))
            final_d = [a.to_dict() for a in final]
            summary: dict[str, dict] = {}
            for m, alarms in zip(self.metrics, per_step):
                for a in alarms:
                    rec = summary.setdefault(a["name"], {"name": a["name"], "first_step": int(m.get("step", 0)),
                                                         "steps": 0, "severity": a.get("severity", "warn")})
                    rec.update(last_step=int(m.get("step", 0)), message=a["message"], cause=a["cause"], fix=a["fix"])
                    rec["steps"] += 1
            for a in final_d:
                rec = summary.setdefault(a["name"], {"name": a["name"], "first_step": a["step"], "steps": 0,
                                                     "severity": a.get("severity", "warn")})
                rec.update(last_step=a["step"], message=a["message"], cause=a["cause"], fix=a["fix"])
                rec["steps"] += 1
            self._alarms = (per_step, final_d, summary)
        return self._alarms


def load_run(path: str | Path) -> Run:
    """The run at ``path``: a postrl run directory, or a run of another engine (:mod:`postrl.report.foreign`)."""
    p = Path(path)
    if not p.exists():
        raise PostrlError(f"'{p}': no such run directory or file")
    if not (p.is_dir() and ((p / "config.yaml").is_file() or (p / "metrics.jsonl").is_file())):
        other = read(p)
        if other is None:
            raise PostrlError(f"'{p}': not a run postrl reads (a postrl run directory: config.yaml, metrics.jsonl; "
                              "a TRL / transformers output folder: trainer_state.json; verl's file-logger JSON lines; "
                              "a W&B offline run folder)")
        return _foreign_run(p, other)
    config: dict = {}
    if (p / "config.yaml").is_file():
        try:
            config = yaml_load((p / "config.yaml").read_text()) or {}
        except Exception:  # noqa: BLE001 - a damaged config must not stop the diagnosis
            config = {}
    summary = None
    if (p / "summary.json").is_file():
        try:
            summary = json.loads((p / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = None
    return Run(p, config if isinstance(config, dict) else {}, read_jsonl(p / "metrics.jsonl"),
               read_jsonl(p / "eval.jsonl"), read_jsonl(p / "samples.jsonl"), summary)


def _foreign_run(path: Path, other) -> Run:
    metrics = [translate(other.engine, r) for r in other.rows]
    evals = [translate(other.engine, e) for e in other.evals]
    if other.engine == "postrl":  # postrl's own W&B sink: its config is postrl's
        config = other.settings if isinstance(other.settings, dict) else {}
    else:
        config = settings_config(other.engine, other.settings)
    done = max((int(m.get("step", 0)) for m in metrics), default=0)
    summary = {"steps": done} if other.finished else None
    return Run(path, config, metrics, evals, [], summary, engine=other.engine, source=other.source,
               settings=dict(other.settings), foreign=other)
