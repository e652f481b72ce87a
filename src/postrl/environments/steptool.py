"""StepTool: step-grained rewards for tool use (tool-invocation success and judged contribution per turn)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import torch
from annotated_types import Ge, Gt

from postrl.environments.chat import endpoint_chat
from postrl.errors import ConfigError
from postrl.registry import register
from postrl.io import load_object
from postrl.rewards.judge import parse_score

CONTRIBUTION_PROMPT = (
    "Task:\n{prompt}\n\nThe assistant's steps so far:\n{history}\n\nStep {k}:\n{action}\nResult:\n{observation}\n\n"
    "Final answer:\n{final}\n\nHow much did step {k} contribute to the final answer? Reply with JSON only: "
    '{{"score": <0 to 10>}}')


def _judge_one(base_url: str, model: str, text: str, timeout: float, api_key_env: str) -> float:
    reply = endpoint_chat(base_url, model, [{"role": "user", "content": text}], timeout=timeout, max_tokens=64,
                          api_key_env=api_key_env)
    return parse_score(reply, 10.0)


def _check(params: dict, run: Any, where: str) -> dict:
    if params.get("contribution") and params.get("judge_url"):
        raise ConfigError(f"{where}: set contribution (module:function) or judge_url, not both")
    return params


@register("shaping", "steptool", source="StepTool: A Step-grained Reinforcement Learning Framework for Tool Learning "
          "in LLMs", check=_check)
def steptool(reward: torch.Tensor, turn_ends: torch.Tensor, turn_tool_calls: torch.Tensor,
             turn_tool_errors: torch.Tensor, turn_malformed_calls: torch.Tensor, prompts: list,
             turn_actions: list, turn_observations: list, *, alpha: Annotated[float, Ge(0)] = 1.0,
             contribution: str | None = None, judge_url: str | None = None, judge_model: str = "judge",
             judge_timeout: Annotated[float, Gt(0)] = 30.0, judge_concurrency: Annotated[int, Ge(1)] = 8,
             api_key_env: str = "OPENAI_API_KEY") -> dict:
    """StepTool's per-turn rewards: r_{i,k} = alpha * SC_{i,k} + C_{i,k} for the turns before the last, r_{i,K_i-1}
    = R_i (the episode's outcome ``reward``); they replace ``turn_rewards`` (``turn_mapo`` reads them).

    SC_{i,k} (tool-invocation success) = (calls executed without error) / (calls made, malformed ones included) of
    turn k (``turn_tool_calls`` - ``turn_tool_errors`` over ``turn_tool_calls`` + ``turn_malformed_calls``; 0 for a
    turn without a call). C_{i,k} in [0, 1] (contribution of turn k to the final answer): ``contribution``, an
    import path of ``fn(prompt, actions, observations) -> list[float]`` (one per turn), or an LLM judge at
    ``judge_url`` (OpenAI-compatible; one request per turn asking for a 0-10 score, divided by 10), else 0. A judge
    or function that raises, times out or answers outside [0, 1] fails that episode: its ``reward`` is NaN
    (excluded from the advantage) and ``turn_judge_errors`` counts it (``turns/judge_errors``). Put it after
    ``weighted_sum`` (it reads ``reward``). alpha 1.0 (assumed: the abstract gives no constant; StepTool weighs
    success against contribution with a factor). After StepTool (assumed: the success rate of the turn's calls as
    SuccCalling, the final turn rewarded by the outcome alone).
    Shapes: reward [N], turn_ends / turn_tool_* [N, K] -> turn_rewards [N, K], reward [N], turn_judge_errors [N].
    """
    N, K = turn_ends.shape
    has = turn_ends >= 0
    last = has & ~torch.cat([has[:, 1:], torch.zeros((N, 1), dtype=torch.bool)], 1)
    made = (turn_tool_calls + turn_malformed_calls).double()
    ok = (turn_tool_calls - turn_tool_errors).clamp(min=0).double()
    sc = torch.where(made > 0, ok / made.clamp(min=1), torch.zeros_like(made))
    contrib = torch.zeros((N, K), dtype=torch.float64)
    errors = torch.zeros(N, dtype=torch.long)
    if contribution or judge_url:
        fn = None
        if contribution:
            fn = load_object(contribution, "shaping.steptool.contribution")

        def one(i: int) -> list[float] | None:
            n = int(has[i].sum())
            acts, obs = list(turn_actions[i])[:n], list(turn_observations[i])[:n]
            try:
                if fn is not None:
                    vals = [float(v) for v in fn(prompts[i], acts, obs)]
                else:
                    final = acts[-1] if acts else ""
                    vals = [_judge_one(judge_url, judge_model, CONTRIBUTION_PROMPT.format(
                        prompt=prompts[i], history="\n".join(acts[:k]), k=k + 1, action=acts[k],
                        observation=obs[k] if k < len(obs) else "", final=final), judge_timeout, api_key_env)
                        for k in range(n - 1)] + [0.0]
            except Exception:  # noqa: BLE001 - a failing judge fails this episode's reward, counted
                return None
            if len(vals) < n - 1 or any(not (math.isfinite(v) and 0.0 <= v <= 1.0) for v in vals[:n - 1]):
                return None
            return vals[:n] + [0.0] * (K - min(n, K))

        with ThreadPoolExecutor(max_workers=max(1, min(judge_concurrency, N))) as pool:
            results = list(pool.map(one, range(N)))
        for i, vals in enumerate(results):
            if vals is None:
                errors[i] = 1
            else:
                contrib[i] = torch.tensor(vals[:K], dtype=torch.float64)
    R = reward.double()
    r = alpha * sc + contrib
    r = torch.where(last, R[:, None].expand(N, K), r)
    r = torch.where(has, r, torch.full_like(r, math.nan))
    failed = errors > 0
    return {"turn_rewards": r.float(), "reward": torch.where(failed, torch.full_like(R, math.nan), R).float(),
            "turn_judge_errors": errors}
