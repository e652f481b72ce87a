"""Adapters: environments written for TRL (``environment_factory``) or verifiers (``MultiTurnEnv``) run in postrl.

The ``verifiers`` adapter follows the legacy ``MultiTurnEnv`` interface (verifiers before v1, the one prime-rl
dropped); verifiers v1 tasksets and envs run through :mod:`postrl.environments.verifiers_v1`, OpenEnv environments
through :mod:`postrl.environments.openenv_env`.

Both are environments registered under the kind ``environment`` that take the user's object as an import path
parameter, so a config names them like any other environment:

    environment: {name: trl, factory: my_pkg.envs:WordleEnv, max_turns: 6}
    environment: {name: verifiers, env: my_pkg.envs:load_environment, args: {difficulty: 2}, max_turns: 6}

:class:`TRLEnvironment` follows TRL 1.16's ``GRPOTrainer(environment_factory=...)`` contract: ``factory()`` makes one
instance per episode; its public methods (every function of its class except ``reset``, ``get_reward`` and names
starting with ``_``) are the model's tools; ``reset(**row)`` returns None or a string appended to the user message;
the optional ``get_reward()`` scores the finished episode. Episodes then run as :class:`ToolEnvironment` episodes
(tool calls executed with a timeout, results as ``tool`` turns; the turn without a tool call ends the episode and
gets ``get_reward()``, or no reward when the class has none). Async methods (tools, ``reset``, ``get_reward``) are
awaited.

:class:`VerifiersEnvironment` follows verifiers' ``MultiTurnEnv`` interface: after each model turn (appended to
``messages`` as an assistant message) ``is_completed(messages, state)`` decides whether the episode ends; if not,
``env_response(messages, state)`` returns ``(new messages, state)`` (older verifiers) or the new messages alone (a
list, one message dict, or a string), appended to the conversation and shown to the model as the next observation.
The finished episode is scored by ``env.rubric``: sum_f w_f f(**kwargs) over ``rubric.get_reward_funcs()`` and
``rubric.get_reward_weights()``, each function called with the keywords it declares among ``prompt``,
``completion``, ``answer``, ``state``, ``task``, ``info``, ``parser`` (all of them when it takes ``**kwargs``).
``env.max_turns`` (> 0) ends the episode like ``is_completed``. The verifiers object is built once per
(``env``, ``args``) and shared by the episodes (verifiers keeps per-rollout data in ``state``).

An episode postrl's rollout cuts (``environment.max_turns`` or ``max_total_tokens`` reached first) gets no reward
from either adapter (the reward source ``environment`` reads 0).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from typing import Annotated, Any, Callable

from annotated_types import Ge, Gt

from postrl.environments import Environment, call
from postrl.environments.tools import ToolEnvironment
from postrl.errors import ConfigError
from postrl.registry import register
from postrl import registry

SCORE_KEYS = ("prompt", "completion", "answer", "state", "task", "info", "parser")


def resolve(path: str, field: str) -> Any:
    """The object at import path ``module:attr`` (``field`` names the config field in errors)."""
    if not isinstance(path, str) or ":" not in path:
        raise ConfigError(f"environment.{field}: expected an import path 'module:name', got {path!r}")
    return registry.find("environment", path).fn


def _sync_tool(fn: Callable) -> Callable:
    """``fn`` itself, or for an async method a sync function of the same name, signature and docstring."""
    if not inspect.iscoroutinefunction(fn):
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return run


@register("environment", "trl", source="TRL GRPOTrainer environment_factory (1.16): reset, tool methods, get_reward")
class TRLEnvironment(ToolEnvironment):
    """A TRL ``environment_factory`` class run as a postrl tool environment (see the module docstring).

    ``factory``: import path of the factory (usually the class); ``timeout``: seconds per tool call (5);
    ``max_calls``: tool calls per episode (8); ``result_format``: how a tool's result is shown
    (``<result>{}</result>``).
    """

    def __init__(self, *, factory: str, timeout: Annotated[float, Gt(0)] = 5.0, max_calls: Annotated[int, Ge(0)] = 8,
                 result_format: str = "<result>{}</result>"):
        make = resolve(factory, "factory")
        if not callable(make):
            raise ConfigError(f"environment.factory: '{factory}' is not callable (expected a class or function)")
        self.env = make()
        members = dict(inspect.getmembers(type(self.env), predicate=inspect.isfunction))
        if "reset" not in members:
            raise ConfigError(f"environment.factory: the instances of '{factory}' have no reset method (TRL's "
                              f"environment_factory requires one)")
        self.has_reward = "get_reward" in members
        methods = [getattr(self.env, n) for n in sorted(members) if n not in ("reset", "get_reward")
                   and not n.startswith("_")]
        super().__init__([_sync_tool(m) for m in methods], timeout=timeout, max_calls=max_calls,
                         result_format=result_format)

    def reset(self, row: dict) -> str:
        super().reset(row)
        extra = call(lambda: self.env.reset(**row))
        return str(row["prompt"]) + ("" if extra is None else str(extra))

    def verify(self, answer: str, row: dict) -> float | None:
        return float(call(self.env.get_reward)) if self.has_reward else None


_LOADED: dict[tuple[str, str], Any] = {}


def load_verifiers_env(path: str, args: dict) -> Any:
    """The verifiers environment ``path(**args)`` (a class or a ``load_environment`` function), built once."""
    key = (path, json.dumps(args, sort_keys=True, default=str))
    if key not in _LOADED:
        make = resolve(path, "env")
        if not callable(make):
            raise ConfigError(f"environment.env: '{path}' is not callable (expected a class or load_environment)")
        try:
            _LOADED[key] = make(**args)
        except TypeError as e:
            raise ConfigError(f"environment.args: {path}: {e}") from None
    return _LOADED[key]


def _messages(out: Any) -> list[dict]:
    if isinstance(out, str):
        return [{"role": "user", "content": out}]
    if isinstance(out, dict):
        return [out]
    return [dict(m) for m in (out or [])]


def score(rubric: Any, **available: Any) -> float:
    """sum_f w_f f(...) over the rubric's reward functions, each given the keywords it declares."""
    total = 0.0
    for fn, w in zip(rubric.get_reward_funcs(), rubric.get_reward_weights()):
        params = inspect.signature(fn).parameters
        if any(p.kind == p.VAR_KEYWORD for p in params.values()):
            kw = dict(available)
        else:
            kw = {k: v for k, v in available.items() if k in params}
        total += float(w) * float(call(lambda: fn(**kw)))
    return total


@register("environment", "verifiers", source="verifiers MultiTurnEnv: env_response, is_completed, Rubric")
class VerifiersEnvironment(Environment):
    """A verifiers ``MultiTurnEnv`` run as a postrl environment (see the module docstring).

    ``env``: import path of the environment class or of a function returning one; ``args``: its keyword
    arguments; ``observation_role``: the chat role the environment's messages are rendered with (``user``).
    """

    def __init__(self, *, env: str, args: dict[str, Any] | None = None, observation_role: str = "user"):
        self.vf = load_verifiers_env(env, dict(args or {}))
        self.observation_role = observation_role
        self.messages: list[dict] = []
        self.state: dict = {}

    def reset(self, row: dict) -> str:
        self.row = dict(row)
        self.messages = [{"role": "user", "content": str(row["prompt"])}]
        self.state = {"prompt": list(self.messages), "completion": [], "answer": row.get("answer", ""),
                      "task": row.get("task", "default"), "info": row.get("info") or {}, "responses": [], "turn": 0}
        return str(row["prompt"])

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        msg = {"role": "assistant", "content": action}
        self.messages.append(msg)
        self.state["completion"].append(msg)
        self.state["turn"] += 1
        limit = int(getattr(self.vf, "max_turns", -1) or -1)
        if call(lambda: self.vf.is_completed(self.messages, self.state)) or 0 < limit <= self.state["turn"]:
            return "", self.reward(), True, {}
        out = call(lambda: self.vf.env_response(self.messages, self.state))
        if isinstance(out, tuple) and len(out) == 2:
            out, self.state = out
        new = _messages(out)
        self.messages += new
        self.state["completion"] += new
        return "\n".join(str(m.get("content", "")) for m in new), None, False, {}

    def reward(self) -> float:
        return score(self.vf.rubric, prompt=self.state["prompt"], completion=self.state["completion"],
                     answer=self.state["answer"], state=self.state, task=self.state["task"],
                     info=self.state["info"], parser=getattr(self.vf, "parser", None))
