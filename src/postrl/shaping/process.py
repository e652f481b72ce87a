"""Process-reward shaping: transforms of the per-step scores ``step_rewards`` [N, S] (NaN padded).

A process reward source returns one score per reasoning step (steps: ``reward.step_delimiter``); its column of
the reward matrix holds the scalar that the stage derives (the sum of the shaped step rewards, or the min-form
return), and ``step_rewards`` holds the shaped per-step rewards, whose sum from step s is step s's return: the
``step_return`` advantage gives every token of step s (tokens up to ``step_ends``) that return. ``source``
(default: the source that returned the step scores) names that column. Rows without steps (a failed process
reward) stay NaN.
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge, Gt, Le

from postrl.registry import register
from postrl.shaping._util import NAN, col, process_column, with_column

_GAO = "On Designing Effective RL Reward at Training Time for LLM Reasoning"


def _finish(step_rewards: torch.Tensor, new_steps: torch.Tensor, rewards, k: int, total: torch.Tensor) -> dict:
    known = torch.isfinite(step_rewards).any(-1) & torch.isfinite(rewards[:, k])
    total = torch.where(known, total.to(rewards.dtype), torch.full_like(total, NAN, dtype=rewards.dtype))
    steps = torch.where(torch.isfinite(step_rewards), new_steps, torch.full_like(new_steps, NAN))
    return {"step_rewards": steps.to(step_rewards.dtype), "rewards": with_column(rewards, k, total)}


@register("shaping", "clip_prm", source=_GAO + " (Clip)")
def clip_prm(step_rewards, rewards, reward_names, step_reward_source=None, *, eta: float = 0.5,
             source: str | None = None):
    """Clip mechanism: r'_t = min(r_t - eta, 0) for every step; the column becomes sum_t r'_t <= 0.

    The summed process reward is bounded above by 0, so repeating steps (the reward hack the paper reports)
    cannot raise it. Default eta=0.5 (assumed: the abstract gives no value; take a score a good step reaches,
    e.g. 0.5 for a PRM that outputs P(step correct)). Shapes: step_rewards [N, S] -> [N, S].
    """
    k = process_column(reward_names, step_reward_source, source, "clip_prm")
    new = torch.clamp(step_rewards - eta, max=0.0)
    return _finish(step_rewards, new, rewards, k, torch.nan_to_num(new, nan=0.0).sum(-1))


@register("shaping", "delta_prm", source=_GAO + " (Delta)")
def delta_prm(step_rewards, rewards, reward_names, step_reward_source=None, *, source: str | None = None):
    """Delta mechanism: r'_t = r_t - r_{t+1} for t < T, r'_T = r_T (T = the row's last step).

    The sum over steps telescopes to r_1, so it is bounded whatever the number of steps; the return from step t
    is r_t. The column becomes sum_t r'_t (= r_1).
    """
    k = process_column(reward_names, step_reward_source, source, "delta_prm")
    nxt = torch.cat([step_rewards[:, 1:], torch.full_like(step_rewards[:, :1], NAN)], dim=1)
    new = torch.where(torch.isfinite(nxt), step_rewards - nxt, step_rewards)
    return _finish(step_rewards, new, rewards, k, torch.nan_to_num(new, nan=0.0).sum(-1))


@register("shaping", "min_form", source="Stop Summation: Min-Form Credit Assignment Is All Process Reward Model "
                                        "Needs for Reasoning (PURE)")
def min_form(step_rewards, rewards, reward_names, step_reward_source=None, *,
             temperature: Annotated[float, Ge(0)] = 0.0,
             source: str | None = None):
    """Min-form credit assignment (PURE): return_t = min_{k >= t} r_k instead of sum_{k >= t} gamma^(k-t) r_k.

    temperature = 0 (default, the paper's definition): ``step_rewards`` become r'_t = return_t - return_{t+1}
    (return_{T+1} = 0), so that their undiscounted sum from step t is the min-form return, and the column becomes
    return_1 = min_t r_t. The value is bounded by the worst step: return_t <= r_k for every k >= t.
    temperature = tau > 0 (PURE's code, ``turn_process_reward_logits_to_reward``, tau 0.1 there): the approximation
    r'_t = softmax_k(-r_k / tau)_t * r_t over the row's steps, so that sum_t r'_t -> min_t r_t as tau -> 0; the
    column becomes sum_t r'_t (and the sum from step t is the return of step t).
    The token-level credit assignment is the ``step_return`` advantage (each token gets its step's return). To mix
    in a verifiable reward (PURE's best setting), list it as another reward source: the weighted sum adds it to
    this column, and ``step_return`` adds its leave-one-out advantage to every token.
    """
    k = process_column(reward_names, step_reward_source, source, "min_form")
    valid = torch.isfinite(step_rewards)
    if temperature > 0:
        x = torch.where(valid, step_rewards.to(torch.float64), torch.full_like(step_rewards, float("inf"),
                                                                              dtype=torch.float64))
        wts = torch.softmax(-x / temperature, dim=-1)  # a row without steps: NaN, excluded by _finish
        new = torch.where(valid, wts * torch.nan_to_num(x, posinf=0.0), torch.full_like(x, NAN))
        return _finish(step_rewards, new.to(step_rewards.dtype), rewards, k, torch.nan_to_num(new, nan=0.0).sum(-1))
    x = torch.where(valid, step_rewards, torch.full_like(step_rewards, float("inf")))
    ret = torch.flip(torch.cummin(torch.flip(x, [1]), dim=1).values, [1])
    ret = torch.where(valid, ret, torch.full_like(ret, NAN))
    nxt = torch.cat([ret[:, 1:], torch.full_like(ret[:, :1], NAN)], dim=1)
    new = ret - torch.nan_to_num(nxt, nan=0.0)
    return _finish(step_rewards, new, rewards, k, ret[:, 0] if ret.shape[1] else torch.full_like(rewards[:, k], NAN))


@register("shaping", "gated", source="Stabilizing Long-term Multi-turn Reinforcement Learning with Gated Rewards "
                                     "(G-RA)")
def gated(step_rewards, rewards, reward_names, step_reward_source=None, *, outcome: str = "correct",
          threshold: float = 1.0, source: str | None = None):
    """Gated reward accumulation (G-RA): the step rewards count only when the outcome reward >= threshold.

    g_i = 1[r_i^outcome >= threshold]; r'_t = g_i r_t; the process column becomes g_i sum_t r_t, so the total is
    r^outcome + g sum_t r_t (with unit weights). Defaults: outcome='correct', threshold=1.0. A failed outcome
    makes the gate unknown: the column is NaN (excluded).
    """
    k = process_column(reward_names, step_reward_source, source, "gated")
    ro = rewards[:, col(reward_names, outcome, "gated", "outcome")]
    g = (ro >= threshold).to(step_rewards.dtype).unsqueeze(-1)
    new = step_rewards * g
    out = _finish(step_rewards, new, rewards, k, torch.nan_to_num(new, nan=0.0).sum(-1))
    out["rewards"][~torch.isfinite(ro), k] = NAN
    return out


@register("shaping", "potential", source="potential-based reward shaping (Ng, Harada & Russell 1999)")
def potential(step_rewards, rewards, reward_names, step_reward_source=None, *,
              gamma: Annotated[float, Gt(0), Le(1)] = 1.0,
              phi0: float = 0.0, source: str | None = None):
    """Potential-based shaping over steps: F_t = gamma * Phi(s_t) - Phi(s_{t-1}), t = 1..T.

    Phi(s_t) = the step score after step t (``step_rewards``, e.g. a PRM's value estimate), Phi(s_0) = phi0
    (default 0). The discounted sum telescopes: sum_{t=1..T} gamma^(t-1) F_t = gamma^T Phi(s_T) - Phi(s_0); this
    is the column's new value (added to the outcome reward by the weighted sum), and ``step_rewards`` becomes
    F [N, S]. Shaping of this form leaves the optimal policy unchanged. Default gamma=1.0.
    """
    k = process_column(reward_names, step_reward_source, source, "potential")
    phi = step_rewards.to(torch.float64)
    prev = torch.cat([torch.full_like(phi[:, :1], phi0), phi[:, :-1]], dim=1)
    F = gamma * phi - prev
    S = phi.shape[1]
    disc = gamma ** torch.arange(S, dtype=torch.float64)
    total = (torch.nan_to_num(F, nan=0.0) * disc).sum(-1)
    return _finish(step_rewards, F.to(step_rewards.dtype), rewards, k, total)

