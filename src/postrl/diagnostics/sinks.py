"""Metric sinks besides run_dir/metrics.jsonl (always written): TensorBoard, Weights & Biases, MLflow.

One interface, :class:`Sink` (``log(metrics, step)``, ``log_alarms(alarms, step)``, ``close()``); each backend is
imported only when its sink is configured (``logging.sinks: [tensorboard, wandb, mlflow]``), and a missing
package is a one-line ConfigError naming the extra to install. W&B runs in offline mode (files under
run_dir/wandb, ``wandb sync`` uploads them later); MLflow writes a local file store under run_dir/mlruns
(or to ``logging.mlflow_uri``);
TensorBoard event files go to run_dir/tensorboard.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
import re
from pathlib import Path
from typing import Any

from postrl.errors import ConfigError

SINKS = ("tensorboard", "wandb", "mlflow")
_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def _scalars(metrics: dict) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if math.isfinite(float(v)):
            out[k] = float(v)
    return out


def _require(module: str, sink: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"logging.sinks: '{sink}' needs the {_EXTRA[sink]} package "
                          f"(pip install 'postrl[{_EXTRA[sink]}]')") from None


class Sink(ABC):
    """A destination for per-step metrics and alarms."""

    name = ""

    @abstractmethod
    def log(self, metrics: dict, step: int) -> None:
        """Write one step's metrics."""

    def log_alarms(self, alarms: list[dict], step: int) -> None:
        """Default: each alarm as a 0/1 scalar ``alarm/<name>`` (its text is in metrics.jsonl and the report)."""
        if alarms:
            self.log({f"alarm/{a['name']}": 1.0 for a in alarms}, step)

    def close(self) -> None:
        pass


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, run_dir: Path, config: dict, run_name: str, project: str):
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + _yaml(config) + "\n```", 0)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in _scalars(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_alarms(self, alarms: list[dict], step: int) -> None:
        super().log_alarms(alarms, step)
        for a in alarms:
            self.writer.add_text(f"alarm/{a['name']}", a["message"], step)

    def close(self) -> None:
        self.writer.close()


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, run_dir: Path, config: dict, run_name: str, project: str):
        wandb = _require("wandb", "wandb")
        (run_dir / "wandb").parent.mkdir(parents=True, exist_ok=True)
        settings = {"console": "off", "silent": True, "disable_git": True, "save_code": False,
                    "x_disable_stats": True, "x_disable_meta": True, "x_disable_machine_info": True}
        known = getattr(wandb.Settings, "model_fields", settings)
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config, mode="offline",
                              reinit="create_new" if _wandb_new(wandb) else True,
                              settings=wandb.Settings(**{k: v for k, v in settings.items() if k in known}))

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        if hasattr(wandb, "teardown"):  # stop the background service now rather than at interpreter exit
            wandb.teardown()


def _wandb_new(wandb) -> bool:
    try:
        major, minor = (int(x) for x in wandb.__version__.split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= (0, 19)


_MLFLOW_BAD = re.compile(r"[^0-9A-Za-z_\-. /:]")


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, run_dir: Path, config: dict, run_name: str, project: str, uri: str | None = None):
        import os

        mlflow = _require("mlflow", "mlflow")
        if uri is None:  # the local file store: MLflow 3 keeps it behind an opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        flat = flatten(config)
        from mlflow.entities import Param

        params = [Param(k[:250], str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    @staticmethod
    def key(k: str) -> str:
        """MLflow metric names allow letters, digits, _ - . space / : only ('pass@4' -> 'pass_at_4')."""
        return _MLFLOW_BAD.sub("_", k.replace("@", "_at_"))

    def log(self, metrics: dict, step: int) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(self.key(k), v, ts, step) for k, v in _scalars(metrics).items()]
        for i in range(0, len(ms), 500):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 500])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_CLASSES = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}


def make_sinks(names: list[str], run_dir: str | Path, config: dict, *, run_name: str | None = None,
               project: str = "postrl", mlflow_uri: str | None = None) -> list[Sink]:
    """The configured sinks (``logging.sinks``), each writing under ``run_dir`` (MLflow: ``mlflow_uri`` when
    given, e.g. ``sqlite:///mlflow.db`` or a tracking server)."""
    run_dir = Path(run_dir)
    out = []
    for n in names:
        if n not in _CLASSES:
            raise ConfigError(f"logging.sinks: unknown sink '{n}'; valid: {', '.join(SINKS)}")
        extra = {"uri": mlflow_uri} if n == "mlflow" else {}
        out.append(_CLASSES[n](run_dir, config, run_name or run_dir.name, project, **extra))
    return out


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as one level of dotted keys (``{'loss': {'name': 'x'}}`` -> ``{'loss.name': 'x'}``; a list
    of dicts by index: ``rewards.0.name``)."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = d
    return out


def _yaml(config: dict) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)
