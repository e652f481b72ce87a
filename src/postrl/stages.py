"""The stage protocol: one way to build a configured stage of any kind, call it, and keep its state.

A stage is a plain function or a small class, registered by name (:mod:`postrl.registry`):

* a **function**'s positional parameters name the batch fields it reads; its keyword-only parameters are its
  configuration, passed at every call;
* a **class** is a stage with state: ``__init__`` takes the configuration (keyword-only), ``__call__``'s positional
  parameters name the fields it reads. It derives from :class:`Stateful`.

:func:`build` makes a :class:`Stage` from a config entry (kind, name, parameters): the class is instantiated once
per run; the stage knows its kind, its name, the fields it reads and its parameters. The same ``Stage`` is called
by postrl's trainer, by the integrations and by a test on hand-built tensors (``stage(fields)`` with a
``RolloutBatch`` or a plain dict).

State changes once per step. A stateful stage's ``__call__`` reads its state and never changes it, however many
times a step calls it (refill rounds of dynamic sampling, a greedy baseline, expansions); what it must learn
from the step's data it records in ``observe`` (called by the pipeline on the batches that train, with the same
fields); ``end_step`` applies everything recorded, once, at the end of the step, and returns metrics.
``state_dict`` / ``load_state_dict`` carry the state through checkpoints.

Kinds (``registry.KINDS``): reward, shaping, filter (keep mask), selector (prompt choice), sampling (a plan of
per-completion sampling temperatures), expansion (new groups from existing completions), advantage, loss,
regularizer, aggregation, task. The config's ``filters`` list names stages of the four batch-selection kinds
(:data:`FILTER_KINDS`).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from postrl import registry
from postrl.pipeline import call_stage, signature

FILTER_KINDS = ("filter", "selector", "sampling", "expansion")


@dataclass
class StepEnd:
    """What ``Stateful.end_step`` receives: the step's metrics (reduced over processes) and ``all_reduce_mean``,
    which averages a tensor in place over processes (a no-op on one process)."""

    metrics: Mapping[str, Any] = field(default_factory=dict)
    all_reduce_mean: Callable[[Any], None] = lambda t: None


class Stateful:
    """Base of the stages that keep state across steps (see the module docstring for the protocol).

    Subclasses list the attribute names of their JSON-serialisable state in ``_state`` (or override
    ``state_dict`` / ``load_state_dict``), record in ``observe`` (positional parameters = fields, like
    ``__call__``) and apply in ``end_step``.
    """

    _state: tuple[str, ...] = ()

    def observe(self) -> None:
        """Record what the state must learn from a batch that trains (default: nothing)."""

    def end_step(self, step: StepEnd) -> dict:
        """Apply what was recorded this step, once; returns metrics (default: nothing to do)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {k: copy.deepcopy(getattr(self, k)) for k in self._state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in self._state:
            if k in state:
                setattr(self, k, copy.deepcopy(state[k]))


class Expansion:
    """Protocol of kind ``expansion``: ``expand(batch, ctx)`` returns new groups made from the scored batch
    (``postrl.data.rollout_options``) or None; ``reads`` names the batch fields it reads beyond the batch's own
    (produced first when missing, like any stage's positional fields)."""

    reads: tuple[str, ...] = ()

    def expand(self, batch: Any, ctx: Any) -> Any:
        return None


def reads(fn: Any) -> tuple[str, ...]:
    """The batch fields a stage (function or instance) reads: its positional parameters (an expansion's
    ``reads``; nothing for a stage that is not called on the batch, such as a prompt selector)."""
    if isinstance(fn, Expansion) or (inspect.isclass(fn) and issubclass(fn, Expansion)):
        return tuple(fn.reads)
    if not callable(fn):
        return ()
    params = list(signature(fn.__call__ if inspect.isclass(fn) else fn).parameters.values())
    return tuple(p.name for p in params[inspect.isclass(fn):]
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


@dataclass
class Stage:
    """A configured stage: ``kind``/``name`` as configured, ``fn`` the function (or the stateful instance),
    ``params`` the keywords passed at each call, ``reads`` the fields it reads, ``needs`` what it declared at
    registration (e.g. ``groups``: a group baseline; ``sandbox``: the code sandbox), ``label`` its metric name."""

    kind: str
    name: str
    fn: Any
    params: dict
    reads: tuple[str, ...]
    needs: tuple[str, ...] = ()
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or self.name

    @property
    def stateful(self) -> bool:
        return isinstance(self.fn, Stateful)

    def __call__(self, source: Any, **extra: Any) -> Any:
        """Call the stage with its fields taken from ``source`` (a RolloutBatch or a dict) by name."""
        return call_stage(self.fn, source, {**self.params, **extra}, what=f"{self.kind} '{self.label}'")

    def observe(self, source: Any) -> None:
        if self.stateful:
            call_stage(self.fn.observe, source, {}, what=f"{self.kind} '{self.label}'")

    def end_step(self, step: StepEnd) -> dict:
        return self.fn.end_step(step) if self.stateful else {}

    def param(self, key: str, default: Any = None) -> Any:
        """The value of parameter ``key``: the configured one, else the stage's declared default."""
        if key in self.params:
            return self.params[key]
        target = type(self.fn).__init__ if self.stateful else self.fn
        p = signature(target).parameters.get(key)
        return p.default if p is not None and p.default is not p.empty else default

    def state_dict(self) -> dict | None:
        return self.fn.state_dict() if self.stateful else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.stateful and state is not None:
            self.fn.load_state_dict(state)


def build(kind: str | tuple[str, ...], name: str, params: Mapping[str, Any] | None = None,
          label: str = "") -> Stage:
    """The configured stage ``name`` of ``kind`` (or of the first of several kinds that has it) with ``params``.

    A class is instantiated once with the parameters; a function keeps them for every call."""
    entry = registry.find(kind, name)
    params = dict(params or {})
    fn = entry.fn
    if inspect.isclass(fn):
        fn, params = fn(**params), {}
    return Stage(entry.kind, name, fn, params, reads(fn), entry.needs, label)


def build_all(kind: str | tuple[str, ...], specs: list) -> list[Stage]:
    """One stage per config entry (objects with ``name`` and ``params``); a name used twice is labelled
    ``name.i`` (its position) in metrics and checkpoints."""
    names = [s.name for s in specs]
    return [build(kind, s.name, s.params, label=s.name if names.count(s.name) == 1 else f"{s.name}.{i}")
            for i, s in enumerate(specs)]


def state_of(stages: list[Stage]) -> dict:
    """JSON-serialisable state of the stateful stages, keyed '<position>:<name>'."""
    return {f"{i}:{s.name}": s.state_dict() for i, s in enumerate(stages) if s.stateful}


def load_state(stages: list[Stage], state: dict | None) -> None:
    for i, s in enumerate(stages):
        s.load_state_dict((state or {}).get(f"{i}:{s.name}"))


_PREFIX = {"regularizer": "reg"}


def end_step(stages: list[Stage], step: StepEnd) -> dict:
    """Every stage's end-of-step update, once; their metrics, a name without '/' prefixed with
    '<kind>/<label>/' (``reg/`` for regularizers)."""
    out: dict = {}
    for s in stages:
        for k, v in s.end_step(step).items():
            out[k if "/" in k else f"{_PREFIX.get(s.kind, s.kind)}/{s.label}/{k}"] = v
    return out
