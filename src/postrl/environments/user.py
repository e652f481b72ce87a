"""UserRL: a simulated user (a language model) the agent talks to, and trajectory scores over its turn rewards.

The environment ``simulated_user`` plays the user: the row's ``prompt`` is the user's opening message; after each
agent turn the turn is scored and, unless the episode ends, the user model replies (the next observation, role
``user``). The user model is one of: an OpenAI-compatible endpoint (``base_url``, ``model``), a local HF folder
(``user_model``) or a Python callable (``user_fn``, an import path ``module:function`` taking ``(messages, row)``).
The shaping stage ``trajectory_score`` turns the episode's turn rewards into its scalar reward (sum, discounted,
final).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
from annotated_types import Ge, Gt, Le

from postrl.environments import Environment
from postrl.environments.chat import ChatError, LocalChat, call_with_timeout, endpoint_chat
from postrl.environments.turns import taken_turn_rewards
from postrl.errors import ConfigError
from postrl.registry import register
from postrl.data import verify_row
from postrl.io import load_object

DEFAULT_PERSONA = ("You are a user talking to an assistant. Your goal: {goal}. Reply with one short message; reveal "
                   "what the assistant asks for, one thing at a time. When your goal is met, reply {stop}.")


def _one_user(params: dict, run: Any, where: str) -> dict:
    given = [k for k in ("base_url", "user_model", "user_fn") if params.get(k)]
    if len(given) != 1:
        raise ConfigError(f"{where}: set exactly one of base_url (an OpenAI-compatible endpoint), user_model (a local "
                          f"model folder) or user_fn (module:function), got {', '.join(given) or 'none'}")
    return params


@register("environment", "simulated_user", source="UserRL: Training Interactive User-Centric Agent via "
          "Reinforcement Learning", check=_one_user)
class SimulatedUser(Environment):
    """A conversation with a simulated user (an LLM); each agent turn is scored, the user replies until done.

    reset(row): the user's opening message ``row['prompt']``. step(agent text):
      r_k = ``reward_fn(text, row)`` (an import path) when set, else the row's task verifier (``postrl.data.verify_row``),
            else None (no reward this turn);
      done when r_k >= ``success`` (1.0), at the user's ``stop`` marker (``###STOP###``) or when the user fails;
      otherwise the user model's reply is the next observation. Its messages: a system message ``persona``
      (``{goal}`` = the row's ``goal_column``, default ``user_goal``, else its prompt; ``{stop}`` = the marker) and
      the conversation from the user's side (its own messages as ``assistant``, the agent's as ``user``).
    Fault isolation: a user call that raises, runs past ``timeout`` seconds (30), or returns something that is not
    non-empty text ends the episode with reward NaN for the turn (the episode's reward fails: it is excluded, not
    scored 0) and ``user_errors`` = 1 in the turn's info (``turns/user_errors``); the run goes on.
    ``max_tokens`` (128) and ``temperature`` (0: greedy) go to the user model; ``api_key_env`` names the endpoint's
    bearer-token variable. After UserRL (assumed: the abstract gives no protocol): the stop marker, the persona
    text, the verifier as the turn reward, the episode ending at the first success.
    """

    observation_role = "user"

    def __init__(self, *, base_url: str | None = None, model: str = "user", user_model: str | None = None,
                 user_fn: str | None = None, persona: str = DEFAULT_PERSONA, goal_column: str = "user_goal",
                 reward_fn: str | None = None, success: float = 1.0, stop: str = "###STOP###",
                 timeout: Annotated[float, Gt(0)] = 30.0, max_tokens: Annotated[int, Ge(1)] = 128,
                 temperature: Annotated[float, Ge(0)] = 0.0, api_key_env: str = "OPENAI_API_KEY"):
        self.base_url, self.model, self.timeout = base_url, model, float(timeout)
        self.max_tokens, self.temperature, self.api_key_env = max_tokens, temperature, api_key_env
        self.local = LocalChat(user_model, max_tokens=max_tokens, temperature=temperature) if user_model else None
        self.user_fn = load_object(user_fn, "environment.user_fn") if user_fn else None
        self.reward_fn = load_object(reward_fn, "environment.reward_fn") if reward_fn else None
        self.persona, self.goal_column, self.success, self.stop = persona, goal_column, float(success), stop
        self.row: dict = {}
        self.messages: list[dict] = []
        self.turn = 0

    def reset(self, row: dict) -> str:
        self.row, self.turn = dict(row), 0
        goal = row.get(self.goal_column) or row["prompt"]
        self.messages = [{"role": "system", "content": self.persona.format(goal=goal, stop=self.stop)},
                         {"role": "assistant", "content": str(row["prompt"])}]
        return str(row["prompt"])

    def score(self, text: str) -> float | None:
        """The agent turn's reward (``reward_fn``, else the row's verifier, else None)."""
        if self.reward_fn is not None:
            r = self.reward_fn(text, self.row)
        else:
            r = verify_row(text, self.row)
        return None if r is None else float(r)

    def reply(self) -> str:
        """The user model's next message (raises ChatError / what the user callable raised)."""
        if self.user_fn is not None:
            fn = lambda: self.user_fn([dict(m) for m in self.messages], dict(self.row))  # noqa: E731
        elif self.local is not None:
            fn = lambda: self.local(self.messages, seed=self.turn)  # noqa: E731
        else:
            fn = lambda: endpoint_chat(self.base_url, self.model, self.messages, timeout=self.timeout,  # noqa: E731
                                       temperature=self.temperature, max_tokens=self.max_tokens,
                                       api_key_env=self.api_key_env)
        out = call_with_timeout(fn, self.timeout)
        if not isinstance(out, str) or not out.strip():
            raise ChatError(f"the user model returned {type(out).__name__} {str(out)[:40]!r}, expected text")
        return out

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        self.turn += 1
        reward = self.score(action)
        if reward is not None and reward >= self.success:
            return "", reward, True, {"user_errors": 0}
        self.messages.append({"role": "user", "content": action})
        try:
            text = self.reply()
        except Exception:  # noqa: BLE001 - a failing user ends the episode, counted, never the run
            return "", math.nan, True, {"user_errors": 1}
        self.messages.append({"role": "assistant", "content": text})
        done = self.stop in text
        return text.replace(self.stop, "").strip(), reward, done, {"user_errors": 0}


@register("shaping", "trajectory_score", source="UserRL: Training Interactive User-Centric Agent via Reinforcement "
          "Learning (trajectory-level scores)")
def trajectory_score(turn_rewards: torch.Tensor, turn_ends: torch.Tensor, env_errors: torch.Tensor | None = None, *,
                     mode: Literal["sum", "discounted", "final"] = "sum",
                     gamma: Annotated[float, Ge(0), Le(1)] = 0.9) -> dict:
    """The episode's scalar reward from its turn rewards: R_i = sum_k r_{i,k} ('sum'), sum_k gamma^k r_{i,k}
    ('discounted', gamma 0.9) or r_{i,K_i-1} ('final': the last turn's).

    r_{i,k}: ``turn_rewards`` over the episode's turns k = 0..K_i-1 (``turn_ends`` >= 0; a turn the environment
    did not reward counts 0). An episode with a NaN turn reward (its environment or user failed) or an environment
    error (``env_errors`` > 0) gets NaN (excluded from the advantage). Sets ``reward`` (use it in place of
    ``weighted_sum``); ``turn_rewards`` stay the per-turn rewards (``turn_mapo`` reads them). After UserRL's
    trajectory-level scoring (its abstract names the study, not the formulas: the three forms are assumed).
    Shapes: turn_rewards [N, K], turn_ends [N, K], env_errors [N] -> reward [N].
    """
    r, has, failed = taken_turn_rewards(turn_rewards, turn_ends, env_errors)
    K = r.shape[1]
    if mode == "sum":
        out = r.sum(-1)
    elif mode == "discounted":
        out = (r * gamma ** torch.arange(K, dtype=torch.float64)).sum(-1)
    else:
        last = (has.long().sum(-1) - 1).clamp(min=0)
        out = torch.where(has.any(-1), r.gather(1, last[:, None]).squeeze(1), torch.zeros_like(r[:, 0]))
    return {"reward": torch.where(failed, torch.full_like(out, math.nan), out).float()}
