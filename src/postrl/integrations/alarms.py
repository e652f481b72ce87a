"""postrl's alarms inside plain TRL and verl: no postrl stage, the engine's own trainer, postrl's monitors on the
metrics it logs (:class:`postrl.diagnostics.foreign.ForeignWatchdog`; names mapped by
:mod:`postrl.diagnostics.engines`). Each alarm names the engine's option that fixes it.

TRL (needs only transformers; importing this module imports neither TRL nor verl)::

    from postrl.integrations.alarms import AlarmCallback   # also postrl.integrations.trl.AlarmCallback
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), callbacks=[AlarmCallback()])

At each of TRL's logging steps the callback runs the monitors on the logged row (``frac_reward_zero_std``,
``completions/clipped_ratio``, ``entropy``, ``kl``, ``clip_ratio/*`` ...; the ``GRPOConfig`` gives the values the
alarms quote). An alarm is printed (a warning of the ``postrl.alarms`` logger: the console) at the first step of each
streak, and ``postrl/alarm/<name>`` = 1 is added to the row in ``trainer.state.log_history`` (so to
``trainer_state.json``) and to the logs the console printer shows. TRL calls the ``report_to`` integrations (W&B,
TensorBoard) before any user callback, so those do not receive the flags; ``postrl doctor OUTPUT_DIR`` (or the W&B
run folder) diagnoses the run afterwards. ``AlarmCallback(diagnostics={...})`` takes postrl's ``diagnostics``
section (thresholds, patience); ``callback.alarms`` lists every alarm raised.

verl: :func:`verl_step` is the function a trainer loop calls with each step's metrics dict (verl's names:
``critic/score/*``, ``response_length/clip_ratio``, ``actor/entropy``, ``actor/pg_clipfrac``, ``actor/ppo_kl``,
``actor/grad_norm`` ...); it returns the ``postrl/alarm/<name>`` flags to log with them. Without touching verl's code,
:func:`install_verl` wraps verl's ``Tracking.log`` (the one call through which verl's trainers log each step,
``verl.utils.tracking``) so every step's metrics pass through it and the flags reach every configured logger (file,
W&B, console ...); the config ``Tracking`` is given supplies the values the alarms quote. verl imports this module in
each of its processes and installs the hook with::

    VERL_USE_EXTERNAL_MODULES=postrl.integrations.alarms python -m verl.trainer.main_ppo ...

(set it for the Ray workers as well, ``ray_kwargs.ray_init.runtime_env.env_vars``, as for the plug-in). The verl
plug-in (:mod:`postrl.integrations.verl`) computes postrl's metrics from verl's batch instead; this needs no
plug-in and reads only what verl logs.
"""

from __future__ import annotations

import os
from typing import Any

from postrl.config.diagnostics import DiagnosticsConfig
from postrl.diagnostics.foreign import ForeignWatchdog

__all__ = ["AlarmCallback", "VerlAlarms", "verl_step", "install_verl"]  # noqa: F822 - AlarmCallback: __getattr__


# ------------------------------------------------------------------------------------------------ TRL


def _callback_class():
    from transformers import TrainerCallback

    class AlarmCallback(TrainerCallback):
        """postrl's monitors on TRL's logged metrics (see :mod:`postrl.integrations.alarms`)."""

        def __init__(self, diagnostics: DiagnosticsConfig | dict | None = None):
            self.diagnostics = diagnostics
            self.watchdog: ForeignWatchdog | None = None

        @property
        def alarms(self) -> list:
            return self.watchdog.alarms if self.watchdog is not None else []

        def _ensure(self, args) -> ForeignWatchdog:
            if self.watchdog is None:
                settings = args.to_dict() if hasattr(args, "to_dict") else dict(vars(args))
                self.watchdog = ForeignWatchdog("trl", settings, self.diagnostics)
            return self.watchdog

        def on_train_begin(self, args, state, control, **kwargs):
            self._ensure(args)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or not state.is_world_process_zero:
                return
            alarms = self._ensure(args).step(logs, state.global_step)
            if not alarms:
                return
            flags = ForeignWatchdog.flags(alarms)
            logs.update(flags)  # the console printer runs after user callbacks
            row = state.log_history[-1] if state.log_history else None
            if row is not None and row.get("step") == state.global_step:
                row.update(flags)  # trainer_state.json

    AlarmCallback.__module__ = __name__
    AlarmCallback.__qualname__ = "AlarmCallback"
    return AlarmCallback


def __getattr__(name: str):
    if name == "AlarmCallback":  # built on first use: transformers is imported only by a TRL user
        cls = _callback_class()
        globals()["AlarmCallback"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------------ verl


class VerlAlarms:
    """postrl's monitors on verl's per-step metrics dict: ``VerlAlarms(config)(metrics, step) -> flags``.
    ``config``: verl's config (a dict, nested or dotted; an OmegaConf ``DictConfig`` is converted) for the values
    the alarms quote; ``diagnostics``: postrl's ``diagnostics`` section."""

    def __init__(self, config: Any = None, diagnostics: DiagnosticsConfig | dict | None = None):
        self.watchdog = ForeignWatchdog("verl", _plain_config(config), diagnostics)

    @property
    def alarms(self) -> list:
        return self.watchdog.alarms

    def __call__(self, metrics: dict, step: int) -> dict[str, float]:
        return ForeignWatchdog.flags(self.watchdog.step(metrics, step))


def _plain_config(config: Any) -> dict:
    if config is None:
        return {}
    if not isinstance(config, dict):
        try:
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(config, resolve=True)
        except Exception:  # noqa: BLE001 - an unreadable config only loses the quoted values
            return {}
    return config if isinstance(config, dict) else {}


_DEFAULT: VerlAlarms | None = None


def verl_step(metrics: dict, step: int, config: Any = None) -> dict[str, float]:
    """The entry point for a verl trainer loop: postrl's alarms on one step's ``metrics`` (verl's names), as
    ``{'postrl/alarm/<name>': 1.0}`` to merge into the metrics before ``logger.log``. One watchdog per process,
    made at the first call (``config``: verl's config, read at that call)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = VerlAlarms(config)
    return _DEFAULT(metrics, step)


def install_verl() -> None:
    """Wrap ``verl.utils.tracking.Tracking`` (idempotent): its ``__init__`` keeps a :class:`VerlAlarms` made with the
    run's config, its ``log(data, step)`` adds that step's alarm flags to ``data`` before every backend logs it."""
    from verl.utils import tracking

    cls = tracking.Tracking
    if getattr(cls.log, "postrl_alarms", False):
        return
    init, log = cls.__init__, cls.log

    def __init__(self, project_name, experiment_name, default_backend="console", config=None):
        init(self, project_name, experiment_name, default_backend=default_backend, config=config)
        self.postrl_alarms = VerlAlarms(config)

    def log_with_alarms(self, data, step, backend=None):
        alarms = getattr(self, "postrl_alarms", None)
        if alarms is not None and isinstance(data, dict):
            try:
                data = {**data, **alarms(data, step)}
            except Exception as e:  # noqa: BLE001 - diagnostics must not stop training; the failure is reported
                alarms.watchdog.say(f"postrl alarms failed on verl's metrics: {type(e).__name__}: {e}")
        return log(self, data, step, backend=backend)

    __init__.__wrapped__ = init
    log_with_alarms.__wrapped__ = log
    log_with_alarms.postrl_alarms = True
    cls.__init__ = __init__
    cls.log = log_with_alarms


if __name__ in {m.strip() for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",")}:
    install_verl()  # imported by verl as an external module: hook its logger in this process
