"""Token-level advantages from process (per-step) rewards: each token gets the return of the step it belongs to.

The process shaping stages (``clip_prm``, ``delta_prm``, ``min_form``, ``gated``, ``potential``) rewrite the step
scores ``step_rewards`` [N, S] so that their undiscounted sum from step s is the return the method defines
(min-form: min_{k >= s} r_k; clip: sum of clipped rewards; delta: r_s); ``step_ends`` [N, S] gives the last token
of each step. Without a shaping stage the raw step scores give the canonical sum-form return.
"""

from __future__ import annotations

from typing import Literal

import torch

from postrl.groups import group_index, group_sum
from postrl.advantages import masked_whiten
from postrl.registry import register

_PURE = ("Stop Summation: Min-Form Credit Assignment Is All Process Reward Model Needs for Reasoning (PURE); "
         "PURE's code: rloo with --reward_baseline token|step, verifiable reward added at the last token")


def _loo_mean(x: torch.Tensor, inv: torch.Tensor, ng: int, v: torch.Tensor) -> torch.Tensor:
    """Per-row mean of ``x`` over the other valid rows of its group: (sum_g x - x_i) / (n_g - 1) (0 when n_g < 2)."""
    x = torch.where(v, x.to(torch.float64), torch.zeros_like(x, dtype=torch.float64))
    s, n = group_sum(x, inv, ng)[inv], group_sum(v.to(torch.float64), inv, ng)[inv]
    return torch.where(n > 1, (s - x) / (n - 1).clamp(min=1.0), torch.zeros_like(s))


@register("advantage", "step_return", source=_PURE, needs=("groups",))
def step_return(step_rewards: torch.Tensor, step_ends: torch.Tensor, rewards: torch.Tensor, reward_names: list,
                reward_weights: torch.Tensor, group_ids: torch.Tensor, completion_mask: torch.Tensor,
                step_reward_source: str | None = None, valid: torch.Tensor | None = None, *,
                source: str | None = None, baseline: Literal["token", "step"] = "token",
                whiten: bool = False) -> torch.Tensor:
    """Token advantages [N, T]: the return of the token's step minus a leave-one-out baseline, plus the outcome's.

    Usable with every policy loss.

    For completion i with steps s = 0..S_i-1 (shaped step rewards r'_{i,s}, last tokens e_{i,s}, e_{i,-1} = -1) and
    token t in step s(t) (the first step with e_{i,s} >= t):
      G_{i,s}  = sum_{k >= s} r'_{i,k}                      (the step's return; G_{i,0} = P_i, the row's total)
      m_{i,s}  = e_{i,S_i-1} - e_{i,s-1}                    (tokens from the start of step s to the end)
      baseline='token' (default; PURE's scripts): b_i = sum_{j != i} P_j / sum_{j != i} L_j, L_j = e_{j,S_j-1} + 1,
          process part = G_{i,s} - b_i m_{i,s}   (PURE subtracts b_i * (tokens of step k) from every step reward k)
      baseline='step': b_i = mean_{j != i} P_j / S_j, process part = G_{i,s} - b_i (S_i - s)
      O_i = sum_{k != p} w_k r_{i,k}                        (the other reward columns, e.g. the verifiable reward)
      A_{i,t} = w_p (G_{i,s(t)} - baseline) + O_i - mean_{j != i} O_j
    j runs over the valid rows of i's group, p is the process column (``source``, default the source that returned
    the step scores) and w its ``reward_weights``: PURE's ``verifiable_reward_coef`` is the verifier's weight
    relative to the PRM's. PURE's code (OpenRLHF, ``process_experiences``) places r'_{i,s} - b_i n_{i,s} on step
    ends and the outcome's RLOO advantage on the last token and takes reverse cumulative sums over tokens, which is
    this formula. ``whiten=True`` also whitens the token advantages over the batch's valid tokens (verl
    ``masked_whiten``, as PURE's verl branch with ``adv_norm``); default False (PURE's OpenRLHF code: no whitening).
    Not reproduced: PURE's approximate min-form weights (``min_form``'s ``temperature``) are a shaping option; its
    zero advantage on step-separator tokens (postrl's steps end on their delimiter token, and the last on EOS).
    Rows without steps, with a step without a score, a NaN reward column or ``valid`` False, and groups with one
    valid row get 0.
    Shapes: step_rewards [N, S] (NaN padded), step_ends [N, S] (-1 padded), rewards [N, K], reward_weights [K],
    group_ids [N], completion_mask [N, T], valid [N] -> [N, T].
    """
    name = source or step_reward_source
    if name is None or name not in reward_names:
        raise ValueError(f"advantage.source: expected the process reward column (one of {', '.join(reward_names)}),"
                         f" got {name!r}")
    p = list(reward_names).index(name)
    N, T = completion_mask.shape
    S = max(step_rewards.shape[1], step_ends.shape[1])
    sr = torch.nn.functional.pad(step_rewards.to(torch.float64), (0, S - step_rewards.shape[1]), value=float("nan"))
    ends = torch.nn.functional.pad(step_ends.long(), (0, S - step_ends.shape[1]), value=-1)
    has = ends >= 0
    n_steps = has.sum(-1)
    r = torch.where(has, torch.nan_to_num(sr, nan=0.0), torch.zeros_like(sr))
    G = torch.flip(torch.cumsum(torch.flip(r, [1]), 1), [1])  # [N, S]
    last = ends.max(-1).values if S else torch.full((N,), -1, dtype=torch.long)
    prev = torch.cat([torch.full_like(ends[:, :1], -1), ends[:, :-1]], dim=1)
    rem = (last.unsqueeze(-1) - prev).to(torch.float64)  # tokens from the start of each step to the end

    w = reward_weights.to(torch.float64)
    others = torch.ones(len(reward_names), dtype=torch.bool)
    others[p] = False
    O = (rewards.to(torch.float64)[:, others] * w[others]).sum(-1)
    v = (n_steps > 0) & torch.isfinite(O) & torch.isfinite(rewards[:, p]) & (torch.isfinite(sr) | ~has).all(-1)
    if valid is not None:
        v = v & valid.bool()
    inv, ng = group_index(group_ids)
    if baseline == "token":
        P, L = G[:, 0] if S else torch.zeros(N, dtype=torch.float64), (last + 1).to(torch.float64)
        vv = v.to(torch.float64)
        num = group_sum(P * vv, inv, ng)[inv] - P * vv
        den = group_sum(L * vv, inv, ng)[inv] - L * vv
        b = torch.where(den > 0, num / den.clamp(min=1.0), torch.zeros_like(num))
        proc = G - b.unsqueeze(-1) * rem
    else:
        P = G[:, 0] if S else torch.zeros(N, dtype=torch.float64)
        b = _loo_mean(P / n_steps.clamp(min=1).to(torch.float64), inv, ng, v)
        proc = G - b.unsqueeze(-1) * (n_steps.unsqueeze(-1) - torch.arange(S)).to(torch.float64)
    proc = torch.where(has, proc, torch.zeros_like(proc))
    a_out = O - _loo_mean(O, inv, ng, v)

    # the step of each token: the first step whose last token is >= t (S when past the last step)
    key = torch.where(has, ends, torch.full_like(ends, T + 1)).contiguous()
    tok = torch.arange(T, dtype=torch.long).expand(N, T).contiguous()
    s_of_t = torch.searchsorted(key, tok, side="left")
    proc_t = torch.cat([proc, torch.zeros(N, 1, dtype=torch.float64)], dim=1).gather(1, s_of_t)
    n_valid = group_sum(v.to(torch.float64), inv, ng)[inv]
    keep = (v & (n_valid > 1)).unsqueeze(-1)
    m = completion_mask.to(torch.float64) * keep
    adv = torch.where(keep, w[p] * proc_t + a_out.unsqueeze(-1), torch.zeros_like(proc_t)) * m
    if whiten:
        adv = masked_whiten(adv, m)
    return adv.to(torch.float32)
