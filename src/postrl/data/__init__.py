"""Prompt sources: built-in procedural tasks, data files, Hugging Face datasets, reasoning-gym.

``load_source({"name": "arithmetic", "digits": 3})`` builds a source from its config; ``name`` is a registered
task, ``file`` (:class:`FileSource`) or ``dataset`` (:class:`DatasetSource`). ``verify_row(completion, row)``
scores a completion with the verifier of the task named by the row's ``task`` column.
"""

from __future__ import annotations

from typing import Any

from postrl import registry
from postrl.data.base import PromptSource, stable_hash
from postrl.data.files import DatasetSource, FileSource, RowsSource, read_rows
from postrl.data.reasoning_gym import ReasoningGymSource
from postrl.data.tasks import ArithmeticTask, CountdownTask, ProceduralTask, is_held_out
from postrl.errors import ConfigError

__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "DatasetSource",
    "FileSource",
    "ProceduralTask",
    "PromptSource",
    "ReasoningGymSource",
    "RowsSource",
    "is_held_out",
    "load_source",
    "read_rows",
    "stable_hash",
    "verify_row",
]


def load_source(spec: dict[str, Any]) -> PromptSource:
    """The prompt source described by ``spec = {"name": ..., **params}``.

    An unknown name raises the registry's ConfigError listing the valid tasks; an unknown parameter raises a
    ConfigError naming it and the valid ones.
    """
    if not isinstance(spec, dict):
        raise ConfigError(f"task: expected a mapping with a 'name' key, got {spec!r}")
    params = dict(spec)
    name = params.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"task: missing 'name' (one of: {', '.join(registry.names('task'))})")
    cls = registry.get("task", name)
    registry.check_params("task", name, params, where="task")
    _check_required(cls, name, params)
    return cls(**params)


def _check_required(cls: Any, name: str, params: dict[str, Any]) -> None:
    """A required keyword-only parameter the spec lacks (``task.name=file`` without ``task.path``) is one
    ConfigError line naming it, not a TypeError from the constructor."""
    import inspect

    target = cls.__init__ if inspect.isclass(cls) else cls
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return
    missing = [p.name for p in sig.parameters.values()
               if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in params]
    if missing:
        keys = " and ".join(f"task.{m}" for m in missing)
        raise ConfigError(f"task '{name}' needs {keys} (e.g. task={{name: {name}, {missing[0]}: ...}})")


def verify_row(completion: str, row: dict) -> float | None:
    """Score ``completion`` with the verifier of ``row["task"]``; None when the row has no (known) task."""
    task = row.get("task")
    if not isinstance(task, str) or not task:
        return None
    # Only registered names: a data file's column must not trigger an import path ('module:attr').
    if task not in registry.names("task"):
        return None
    cls = registry.get("task", task)
    # Data sources delegate here; a row naming one would recurse.
    if not isinstance(cls, type) or not issubclass(cls, PromptSource) or issubclass(cls, RowsSource):
        return None
    return cls.verify(completion, row)


# Filters, prompt selectors and rollout options register themselves (kind "filter") on import.
from postrl.data import filters, rollout_options  # noqa: E402,F401
