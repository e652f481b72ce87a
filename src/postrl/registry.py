"""Named registries, one per stage kind.

A stage is a plain function (or a small class when it keeps state) registered under a name::

    from postrl import registry

    @registry.register("reward", "my_reward", source="my paper")
    def my_reward(prompts, completions, **columns):
        return [float(len(c) < 10) for c in completions]

Config names the stage (``rewards: [{name: my_reward}]``) or gives an import path
(``my_pkg.rewards:my_reward``), which is imported on first use. ``names(kind)`` lists what is registered,
``get(kind, name)`` returns the callable, ``info(kind, name)`` its description and source.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from postrl.errors import ConfigError
from postrl.io import load_object

KINDS = ("reward", "shaping", "filter", "selector", "sampling", "expansion", "advantage", "loss", "regularizer",
         "aggregation", "kl", "preference", "task", "environment", "field")


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    fn: Any
    description: str
    source: str
    needs: tuple[str, ...] | Callable = ()
    check: Any = None


_REGISTRY: dict[str, dict[str, Entry]] = {k: {} for k in KINDS}
_LOADED = False


def _first_line(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _check_kind(kind: str) -> None:
    if kind not in _REGISTRY:
        raise ConfigError(f"unknown stage kind '{kind}'; valid kinds: {', '.join(KINDS)}")


def register(kind: str, name: str | None = None, *, source: str = "", description: str | None = None,
             needs: tuple[str, ...] | Callable = (), check: Callable | None = None) -> Callable:
    """Decorator registering ``fn`` under ``kind``/``name`` (default: the function's name).

    ``source`` names the paper or anchor the method comes from; ``description`` defaults to the docstring's
    first line; ``needs`` declares what the stage requires of the run, checked at start-up
    (``postrl.step``): ``groups`` (a group of several completions per prompt), ``sandbox`` (the code
    sandbox), ``reference_reset`` (the driver copies the policy into its reference model when the stage asks, through
    ``StepEnd.reset_reference``), ``teacher`` (the teacher model, ``model.teacher.path``: the trainer loads it only for
    such a stage); a function of the validated parameters when that depends on them
    (``needs=lambda params: ...``). ``check(params, run, where) -> params``: a rule over several parameters or over the run's settings
    (``run``: the config being read, or None; ``where``: the config key), called when the config is read; it raises ``ConfigError`` naming the keys and returns
    the parameters with what it derived from the run filled in. Registering a name twice replaces the earlier entry
    only if it is the same object (re-import).
    """
    _check_kind(kind)

    def deco(fn: Any) -> Any:
        key = name or fn.__name__
        old = _REGISTRY[kind].get(key)
        if old is not None and getattr(old.fn, "__qualname__", None) != getattr(fn, "__qualname__", None):
            raise ValueError(f"{kind} '{key}' is already registered by {old.fn!r}")
        _REGISTRY[kind][key] = Entry(kind, key, fn, description or _first_line(fn), source,
                                     needs if callable(needs) else tuple(needs), check)
        return fn

    return deco


def _load_builtins() -> None:
    """Import the modules that register postrl's own stages (once)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for mod in ("postrl.fields", "postrl.rewards", "postrl.shaping", "postrl.advantages", "postrl.losses", "postrl.data", "postrl.selection",
                "postrl.environments"):
        importlib.import_module(mod)


def _import_path(kind: str, path: str) -> Entry:
    fn = load_object(path, kind)
    return Entry(kind, path, fn, _first_line(fn), path.partition(":")[0])


def names(kind: str) -> list[str]:
    """Sorted names registered for ``kind``."""
    _check_kind(kind)
    _load_builtins()
    return sorted(_REGISTRY[kind])


def entry(kind: str, name: str) -> Entry:
    """The registry entry for ``name``; ``module.path:attr`` imports a user's stage."""
    return find(kind, name)


def find(kinds: str | tuple[str, ...], name: str) -> Entry:
    """The entry for ``name`` in the first of ``kinds`` that registers it (an import path resolves in the first
    kind); the error lists the names of every kind."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    for k in kinds:
        _check_kind(k)
    _load_builtins()
    for k in kinds:
        if name in _REGISTRY[k]:
            return _REGISTRY[k][name]
    if ":" in name:
        return _import_path(kinds[0], name)
    valid = ", ".join(sorted(n for k in kinds for n in _REGISTRY[k])) or "(none)"
    raise ConfigError(f"unknown {'/'.join(kinds)} '{name}'; valid: {valid} (or an import path 'module:function')")


def get(kind: str, name: str) -> Any:
    """The callable registered as ``kind``/``name`` (or imported from ``module:attr``)."""
    return entry(kind, name).fn


def all_entries() -> list[Entry]:
    _load_builtins()
    return [e for k in KINDS for e in sorted(_REGISTRY[k].values(), key=lambda e: e.name)]
