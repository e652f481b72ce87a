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

Parameters. A stage's keyword-only parameters (a class's: those of ``__init__``) are its whole schema: their
annotations (``float``, ``Literal["a", "b"]``, ``Annotated[float, Ge(0), Lt(1)]`` ...) are validated by
:func:`check_params` when the config is read (``postrl config show`` and ``postrl train`` refuse the same
values in the same one line: ``loss.eps_low: expected a value >= 0 and < 1, got -1``). A field producer
(:mod:`postrl.fields`, kind ``field``) declares its parameters the same way; a stage's config entry may set the
parameters of the producers of the fields it reads.

Kinds (``registry.KINDS``): reward, shaping, filter (keep mask), selector (prompt choice), sampling (a plan of
per-completion sampling temperatures), expansion (new groups from existing completions), advantage, loss,
regularizer, aggregation, kl, preference (an offline pairwise loss of ``postrl dpo``), task, environment, field (a
producer of a batch field). The config's ``filters`` list names stages of the four batch-selection kinds
(:data:`FILTER_KINDS`).
"""

from __future__ import annotations

import copy
import inspect
import re
import types
import typing
import weakref
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Mapping

from pydantic import AfterValidator

from postrl import registry
from postrl.batch import RolloutBatch
from postrl.errors import ConfigError


# ------------------------------------------------------------------------------------ shared parameter types


def _compiles(pattern: str) -> str:
    """a regular expression (Python re)"""
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"expected a valid regular expression ({e}), got {pattern!r}") from None
    return pattern


def _tag_name(tag: str) -> str:
    """a tag name (letters, digits, _ or -)"""
    if not re.fullmatch(r"[\w-]+", tag):
        raise ValueError(f"expected a tag name (letters, digits, _ or -) like 'think', got {tag!r}")
    return tag


Regex = Annotated[str, AfterValidator(_compiles)]  # a stage parameter that is a regular expression (Python re)
TagName = Annotated[str, AfterValidator(_tag_name)]  # a stage parameter that names a tag: <think>, <answer>, ...

FILTER_KINDS = ("filter", "selector", "sampling", "expansion")

# ------------------------------------------------------------------------------------------------ signatures
_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # callable -> its signature, while it lives


def signature(fn: Any) -> inspect.Signature:
    """``inspect.signature(fn)``, cached per callable while it lives (it costs about 8 us, several times a step);
    raises as ``inspect.signature`` does. The one signature reader of postrl."""
    try:
        hit = _SIGNATURES.get(fn)
    except TypeError:  # not weakly referenceable or not hashable
        return inspect.signature(fn)
    if hit is None:
        hit = _SIGNATURES[fn] = inspect.signature(fn)
    return hit


def field_values(source: RolloutBatch | Mapping[str, Any]) -> Mapping[str, Any]:
    """The fields of a batch by name (its attributes, ``extra`` and ``lengths``), or a mapping as it is."""
    if isinstance(source, RolloutBatch):
        values = {k: getattr(source, k) for k in source.__dataclass_fields__}
        values.update(source.extra)
        values["lengths"] = source.lengths
        return values
    return source


def call_stage(fn: Any, source: RolloutBatch | Mapping[str, Any], params: Mapping[str, Any], what: str = "stage"):
    """Call ``fn`` with its positional parameters taken from ``source`` by name and ``params`` as keywords."""
    values = field_values(source)
    args = []
    for p in signature(fn).parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            continue
        if p.name in values and values[p.name] is not None:
            args.append(values[p.name])
        elif p.default is not p.empty:
            args.append(p.default)
        else:
            raise ValueError(f"{what} needs batch field '{p.name}', which no earlier stage produced")
    return fn(*args, **params)


def reads(fn: Any) -> tuple[str, ...]:
    """The batch fields a stage (function or instance) reads: its positional parameters, or what it declares in a
    ``reads`` attribute (a stage that is not called on the batch itself, such as an expansion); nothing for a stage
    that is not callable (a prompt selector)."""
    declared = getattr(fn, "reads", None)
    if isinstance(declared, tuple):
        return declared
    if not callable(fn):
        return ()
    params = list(signature(fn.__call__ if inspect.isclass(fn) else fn).parameters.values())
    return tuple(p.name for p in params[inspect.isclass(fn):]
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


# ------------------------------------------------------------------------------------------------ parameters
def _config_target(fn: Any) -> Any:
    return fn.__init__ if inspect.isclass(fn) else fn


def takes_any_keyword(fn: Any) -> bool:
    """True when the stage's configuration ends in ``**kwargs`` (any key is accepted as a parameter)."""
    return any(p.kind is p.VAR_KEYWORD for p in signature(_config_target(fn)).parameters.values())


def parameters(fn: Any) -> dict[str, tuple[Any, Any]]:
    """{name: (annotation, default)} of the stage's keyword-only parameters, in declaration order; the annotation
    resolved (``Any`` when it cannot be), the default ``inspect.Parameter.empty`` when it is required."""
    target = _config_target(fn)
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # noqa: BLE001 - a name only defined under TYPE_CHECKING: those parameters are not typed
        hints = {}
    return {p.name: (hints.get(p.name, Any), p.default) for p in signature(target).parameters.values()
            if p.kind is p.KEYWORD_ONLY}


_MODELS: dict[Any, Any] = {}


def _params_model(fn: Any):
    """The pydantic model of a stage's keyword-only parameters (cached per callable)."""
    key = _config_target(fn)
    try:
        return _MODELS[key]
    except (KeyError, TypeError):
        pass
    from pydantic import ConfigDict, create_model

    fields = {name: (ann, ... if default is inspect.Parameter.empty else default)
              for name, (ann, default) in parameters(fn).items()}
    model = create_model(f"Params_{getattr(key, '__qualname__', 'stage')}".replace(".", "_").replace("<", "_")
                         .replace(">", "_"), __config__=ConfigDict(strict=True, extra="ignore",
                                                                   arbitrary_types_allowed=True), **fields)
    try:
        _MODELS[key] = model
    except TypeError:
        pass
    return model


_TYPE_WORDS = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
               "bool_type": "true or false", "string_type": "a string", "list_type": "a list",
               "tuple_type": "a list", "dict_type": "a mapping", "finite_number": "a finite number"}
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _bounds_text(ann: Any) -> str:
    """'>= 0 and < 1' from an ``Annotated[..., Ge(0), Lt(1)]`` annotation (also inside ``X | None``)."""
    out = []
    for arg in (typing.get_args(ann) if typing.get_origin(ann) is not typing.Annotated else (ann,)):
        if typing.get_origin(arg) is typing.Annotated:
            for meta in arg.__metadata__:
                for attr, op in _BOUNDS:
                    v = getattr(meta, attr, None)
                    if v is not None:
                        out.append(f"{op} {v:g}" if isinstance(v, (int, float)) else f"{op} {v}")
    return " and ".join(out)


def _error_text(err: dict, where: str, annotations: dict) -> str:
    loc = [str(p) for p in err["loc"]]
    key = f"{where}.{'.'.join(loc)}" if loc else where
    got = err.get("input")
    got_s = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and loc:
        bounds = _bounds_text(annotations.get(loc[0], (None,))[0])
        if bounds:
            return f"{key}: expected a value {bounds}, got {got_s}"
    if err["type"] == "literal_error":
        return f"{key}: expected {err['ctx']['expected']}, got {got_s}"
    if err["type"] == "missing":
        return f"{key}: required parameter missing"
    if err["type"] in _TYPE_WORDS:
        return f"{key}: expected {_TYPE_WORDS[err['type']]}, got {got_s}"
    msg = err["msg"]
    if msg.startswith("Value error, "):
        return f"{key}: {msg[len('Value error, '):]}"
    return f"{key}: {msg[0].lower()}{msg[1:]}, got {got_s}"


def validate_params(fn: Any, params: Mapping[str, Any], where: str, *, what: str = "stage",
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Check ``params`` against the stage's keyword-only parameters (names, types, ranges, choices) and return the
    validated values (a list given for a tuple becomes a tuple). ``extra``: names accepted besides them (e.g. a
    producer's parameters). One-line :class:`ConfigError` naming ``where.key``."""
    from pydantic import ValidationError

    declared = parameters(fn)
    own = {k: v for k, v in params.items() if k in declared}
    unknown = [k for k in params if k not in declared and k not in (extra or {})]
    if unknown and not takes_any_keyword(fn):
        valid = [*declared, *(extra or {})]
        raise ConfigError(f"{where}: unknown parameter '{unknown[0]}' for {what}; valid: {', '.join(valid) or '(none)'}")
    for k, v in own.items():  # YAML has no tuples: a list stands for one
        if isinstance(v, list) and typing.get_origin(_strip(declared[k][0])) is tuple:
            own[k] = tuple(v)
    try:
        model = _params_model(fn).model_validate(own)
    except ValidationError as e:
        raise ConfigError(_error_text(e.errors()[0], where, declared)) from None
    return {**params, **{k: getattr(model, k) for k in own}}


def _strip(ann: Any) -> Any:
    """``X`` of ``Annotated[X, ...]`` and of ``X | None``."""
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(ann) in (typing.Union, types.UnionType):
        return _strip(args[0])
    return ann


def producer_parameters(fn: Any) -> dict[str, Any]:
    """{name: entry} of the parameters of the field producers (kind ``field``) of the fields ``fn`` reads."""
    out: dict[str, Any] = {}
    fields_kind = registry.names("field")
    for f in reads(fn):
        if f in fields_kind:
            out.update({k: f for k in parameters(registry.get("field", f))})
    return out


def check_params(kinds: str | tuple[str, ...], name: str, params: Mapping[str, Any], where: str, *,
                 any_keyword: bool | None = None, run: Any = None) -> dict[str, Any]:
    """Validate the config entry ``params`` of stage ``name`` (the first of ``kinds`` that registers it): its own
    parameters and those of the producers of the fields it reads, each by its annotation. Returns the validated
    parameters. ``any_keyword=False`` refuses unknown keys even when the stage takes ``**kwargs`` (whose keys are
    then not parameters, e.g. the columns a TRL-style reward receives). ``run``: the config being read, given to
    the stage's registered ``check`` (a rule over several parameters or over the run's settings), whose result is
    returned."""
    entry = registry.find(kinds, name)
    fn = entry.fn
    prod = producer_parameters(fn)
    own = {k: v for k, v in params.items() if k not in prod or k in parameters(fn)}
    if any_keyword is False and takes_any_keyword(fn):
        declared = parameters(fn)
        bad = [k for k in own if k not in declared]
        if bad:
            raise ConfigError(f"{where}: unknown parameter '{bad[0]}' for {entry.kind} '{name}'; valid: "
                              f"{', '.join([*declared, *prod]) or '(none)'}")
    out = validate_params(fn, own, where, what=f"{entry.kind} '{name}'", extra=prod)
    for f in dict.fromkeys(prod.values()):
        keys = {k: v for k, v in params.items() if prod.get(k) == f and k not in parameters(fn)}
        out.update(validate_params(registry.get("field", f), keys, where, what=f"field '{f}'"))
    if entry.check is not None:
        out = dict(entry.check(out, run, where))
    return out


def _no_reset() -> None:
    raise ConfigError("a stage asked for a reference reset, which this driver does not offer (a stage that needs it "
                      "declares needs=('reference_reset',) and the driver refuses it at start-up)")


@dataclass
class StepEnd:
    """What ``Stateful.end_step`` receives: the step's metrics (reduced over processes), ``all_reduce_mean``, which
    averages a tensor in place over processes, ``gather``, which returns every process's picklable object in
    rank order (both no-ops on one process), and ``reset_reference``, which copies the policy into the driver's
    reference model (offered only by a driver that owns one; a stage that may call it declares
    ``needs=('reference_reset',)``, which a driver without it refuses when the stage is built)."""

    metrics: Mapping[str, Any] = field(default_factory=dict)
    all_reduce_mean: Callable[[Any], None] = lambda t: None
    gather: Callable[[Any], list] = lambda obj: [obj]
    reset_reference: Callable[[], None] = _no_reset


class Stateful:
    """Base of the stages that keep state across steps (see the module docstring for the protocol).

    ``observe(<fields>)`` (positional parameters = fields, like ``__call__``) records what the state must learn with
    ``self.record(item)`` (any picklable item); :func:`end_step` gathers the recorded items of every stateful stage
    from every process in one collective, so ``end_step(step)`` finds in ``self.observed`` the items of the whole
    step, in rank order, and every process applies the same update. A stage whose recorded data is too large to
    gather (a value head's hidden states) sets ``gather_observed = False`` and reduces in ``end_step`` itself
    (``step.all_reduce_mean``). Subclasses list the attribute names of their JSON-serialisable state in
    ``_state`` (or override ``state_dict`` / ``load_state_dict``).
    """

    _state: tuple[str, ...] = ()
    gather_observed = True

    @property
    def observed(self) -> list:
        """What ``observe`` recorded this step (in ``end_step``: of every process)."""
        return self.__dict__.setdefault("_observed", [])

    def record(self, item: Any) -> None:
        self.observed.append(item)

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


@dataclass
class Stage:
    """A configured stage: ``kind``/``name`` as configured, ``fn`` the function (or the stateful instance),
    ``params`` the keywords passed at each call, ``reads`` the fields it reads, ``needs`` what it declared at
    registration (e.g. ``groups``: a group baseline; ``sandbox``: the code sandbox), ``label`` its metric name,
    ``field_params`` the parameters of the producers of the fields it reads (``postrl.fields.produce``)."""

    kind: str
    name: str
    fn: Any
    params: dict
    reads: tuple[str, ...]
    needs: tuple[str, ...] = ()
    label: str = ""
    field_params: dict = field(default_factory=dict)

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
        """Apply what the stage recorded this step (then forget it); its metrics."""
        if not self.stateful:
            return {}
        try:
            return self.fn.end_step(step)
        finally:
            self.fn.__dict__["_observed"] = []

    def state_dict(self) -> dict | None:
        return self.fn.state_dict() if self.stateful else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.stateful and state is not None:
            self.fn.load_state_dict(state)


def build(kind: str | tuple[str, ...], name: str, params: Mapping[str, Any] | None = None,
          label: str = "", where: str | None = None) -> Stage:
    """The configured stage ``name`` of ``kind`` (or of the first of several kinds that has it) with ``params``,
    validated by :func:`check_params` (``where``: the config key named in an error, default the kind).

    A class is instantiated once with its parameters; a function keeps them for every call. The parameters of the
    producers of the fields it reads go to ``field_params``. ``needs`` registered as a function of the parameters
    (``needs=lambda params: ...``) is resolved here."""
    entry = registry.find(kind, name)
    params = check_params(entry.kind, name, dict(params or {}), where or entry.kind)
    needs = tuple(entry.needs(params)) if callable(entry.needs) else entry.needs
    fn = entry.fn
    prod = producer_parameters(fn)
    own_names = parameters(fn)
    field_params = {k: v for k, v in params.items() if k in prod and k not in own_names}
    params = {k: v for k, v in params.items() if k not in field_params}
    if inspect.isclass(fn):
        fn, params = fn(**params), {}
    return Stage(entry.kind, name, fn, params, reads(fn), needs, label, field_params)


def build_all(kind: str | tuple[str, ...], specs: list, section: str | None = None) -> list[Stage]:
    """One stage per config entry (objects with ``name`` and ``params``) of the config list ``section`` (named in
    errors as ``section.i``); a name used twice is labelled ``name.i`` (its position) in metrics and checkpoints."""
    names = [s.name for s in specs]
    return [build(kind, s.name, s.params, label=s.name if names.count(s.name) == 1 else f"{s.name}.{i}",
                  where=f"{section}.{i}" if section else None) for i, s in enumerate(specs)]


def state_of(stages: list[Stage]) -> dict:
    """JSON-serialisable state of the stateful stages, keyed '<position>:<name>'."""
    return {f"{i}:{s.name}": s.state_dict() for i, s in enumerate(stages) if s.stateful}


def load_state(stages: list[Stage], state: dict | None) -> None:
    for i, s in enumerate(stages):
        s.load_state_dict((state or {}).get(f"{i}:{s.name}"))


_PREFIX = {"regularizer": "reg"}


def end_step(stages: list[Stage], step: StepEnd) -> dict:
    """Every stage's end-of-step update, once: what the stateful stages recorded is first gathered from every
    process (one ``step.gather`` for all of them), then each applies it. Returns their metrics, a name without '/'
    prefixed with '<kind>/<label>/' (``reg/`` for regularizers)."""
    gathering = [s.fn for s in stages if s.stateful and s.fn.gather_observed]
    if gathering:
        per_rank = step.gather([list(fn.observed) for fn in gathering])
        for j, fn in enumerate(gathering):
            fn.__dict__["_observed"] = [item for rank in per_rank for item in rank[j]]
    out: dict = {}
    for s in stages:
        for k, v in s.end_step(step).items():
            out[k if "/" in k else f"{_PREFIX.get(s.kind, s.kind)}/{s.label}/{k}"] = v
    return out
