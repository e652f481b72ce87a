"""Prompt sources: built-in procedural tasks, data files, Hugging Face datasets, reasoning-gym.

``load_source({"name": "arithmetic", "digits": 3})`` builds a source from its config; ``name`` is a registered
task, ``file`` (:class:`FileSource`) or ``dataset`` (:class:`DatasetSource`). Every source also takes the
prior-prompt options (:func:`prior_prompt`: ``system_prompt``, ``prompt_prefix``, ``prompt_suffix``,
``eval_prior``). ``verify_row(completion, row)`` scores a completion with the verifier of the task named by the
row's ``task`` column.
"""

from __future__ import annotations

from typing import Any

from postrl import registry, stages
from postrl.data.base import PriorPrompt, PromptSource, prior_prompt
from postrl.seeding import stable_hash
from postrl.data.files import DatasetSource, FileSource, RowsSource, read_rows
from postrl.data.reasoning_gym import ReasoningGymSource
from postrl.data.tasks import ArithmeticTask, CountdownTask, ProceduralTask, is_held_out
from postrl.errors import ConfigError

__all__ = [
    "ArithmeticTask",
    "CountdownTask",
    "DatasetSource",
    "FileSource",
    "PriorPrompt",
    "ProceduralTask",
    "PromptSource",
    "ReasoningGymSource",
    "RowsSource",
    "is_held_out",
    "load_source",
    "prior_prompt",
    "read_rows",
    "stable_hash",
    "verify_row",
]


def load_source(spec: dict[str, Any]) -> PromptSource:
    """The prompt source described by ``spec = {"name": ..., **params}``.

    An unknown name raises the registry's ConfigError listing the valid tasks; an unknown parameter raises a
    ConfigError naming it and the valid ones. The prior-prompt options (:func:`prior_prompt`'s keyword
    parameters) are every source's: validated here (``task.<option>``) and applied around the source.
    """
    if not isinstance(spec, dict):
        raise ConfigError(f"task: expected a mapping with a 'name' key, got {spec!r}")
    params = dict(spec)
    name = params.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"task: missing 'name' (one of: {', '.join(registry.names('task'))})")
    options = {k: params.pop(k) for k in list(params) if k in stages.parameters(prior_prompt)}
    options = stages.validate_params(prior_prompt, options, "task", what="task options")
    return prior_prompt(stages.build("task", name, params, where="task").fn, **options)


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

