"""Environments for multi-turn rollouts: the protocol, tools, and the built-in environments.

An environment is a class registered under the kind ``environment``; the rollout makes one instance per trajectory
(``cls(**params)``, the config's ``environment`` section minus ``name`` and the rollout's keys ``max_turns``,
``max_total_tokens``, ``step_timeout``, ``purify``, ``purify_similarity``) and
drives it:

    observation = env.reset(row)                          # the prompt row -> the first user message (text)
    observation, reward, done, info = env.step(action)    # the model's turn (decoded text) -> the next message

``reward`` is a float or None (no reward on this turn); ``done`` ends the episode; ``info`` is a dict whose
counters ``tool_calls``, ``tool_errors``, ``malformed_calls`` (ints) the rollout adds up per episode, and whose
``scores`` (a dict of named floats, e.g. the parts of a final score) the rollout keeps per episode (the latest value
of each name; ``postrl eval`` reports their means as ``env/<name>``). Both methods
may be ``async def`` (:class:`AsyncEnvironment`): the rollout awaits them. An environment that raises ends its
episode: the episode's reward is NaN (a failed reward entry, excluded from the advantage) and ``env_errors``
counts it. Environments written for other libraries run through :mod:`postrl.environments.adapters`: the
environments ``trl`` (a TRL ``environment_factory`` class: ``reset(**row)``, tool methods, ``get_reward``) and
``verifiers`` (a legacy verifiers ``MultiTurnEnv``: ``env_response``, ``is_completed``, its rubric), each taking the
user's class as an import path parameter; :mod:`postrl.environments.verifiers_v1` (``verifiers_v1``: a verifiers v1
taskset, optionally driven by its ``vf.Env``) and :mod:`postrl.environments.openenv_env` (``openenv``: an OpenEnv
environment, client or MCP tool environment). An environment's optional ``close()`` is called when the rollout is
over.

Modules: :mod:`postrl.environments.tools` (tool schemas, the tool-call format and execution with a timeout,
:class:`ToolEnvironment`), :mod:`postrl.environments.calculator` (the calculator-tool arithmetic task),
:mod:`postrl.environments.code_repair` (a buggy program, its tests run in the sandbox each turn),
:mod:`postrl.environments.adversarial` (a user who gaslights, escalates or presses for validation; the policy's
consistency as the reward), :mod:`postrl.environments.reward` (the reward source ``environment``). The agent methods (docs/agents.md):
:mod:`~postrl.environments.toolrl` (the reward ``tool_call``), :mod:`~postrl.environments.function_calling` (the
task ``tool_calls``), :mod:`~postrl.environments.steptool` (shaping ``steptool``),
:mod:`~postrl.environments.self_correct` (SCoRe: environment ``self_correct``, shaping ``score_bonus``, regulariser
``attempt_kl``), :mod:`~postrl.environments.user` (UserRL: environment ``simulated_user``, shaping
``trajectory_score``), :mod:`~postrl.environments.chat` (the models they talk to),
:mod:`~postrl.environments.cleaner` (CLEANER's purified episodes), :mod:`~postrl.environments.credit` (advantages
``spa``, ``archer``, ``oprl``), :mod:`~postrl.environments.topocurate` (selector ``topocurate``).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from postrl.errors import ConfigError
from postrl import stages


class Environment:
    """The synchronous protocol (subclass it, or write any class with these two methods)."""

    def reset(self, row: dict) -> str:
        """The first observation (the user message) of the episode for the prompt ``row``."""
        return str(row["prompt"])

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        """(observation, reward or None, done, info) after the model's turn ``action``."""
        return "", None, True, {}


class AsyncEnvironment:
    """The asynchronous protocol: ``async def reset(row)`` and ``async def step(action)``, awaited by the rollout."""

    async def reset(self, row: dict) -> str:
        return str(row["prompt"])

    async def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        return "", None, True, {}


def call(method: Any, *args: Any) -> Any:
    """Call a sync or async environment method and return its result."""
    out = method(*args)
    if inspect.isawaitable(out):
        return asyncio.run(_await(out))
    return out


async def _await(aw: Any) -> Any:
    return await aw


def make(name: str, params: dict | None = None) -> Any:
    """One instance of the environment registered as ``name`` (or ``module:Class``) with ``params``
    (``postrl.stages.build``: the parameters validated, the class instantiated)."""
    try:
        return stages.build("environment", name, dict(params or {}), where="environment").fn
    except (TypeError, ValueError) as e:
        raise ConfigError(f"environment '{name}': {e}") from None


# register the built-ins and the adapters
from postrl.environments import (adapters, adversarial, calculator, cleaner, code_repair,  # noqa: E402,F401
                                 credit, function_calling, openenv_env, reward, self_correct, steptool, tools,
                                 toolrl, topocurate, user, verifiers_v1)
