"""Token-level advantages from process (per-step) rewards: each token gets the return of the step it belongs to
(``step_return``, PURE), or its trajectory's GRPO advantage weighted by its step's process score
(``process_weighted``, Signal Reshaping).

The process shaping stages (``clip_prm``, ``delta_prm``, ``min_form``, ``gated``, ``potential``) rewrite the step
scores ``step_rewards`` [N, S] so that their undiscounted sum from step s is the return the method defines
(min-form: min_{k >= s} r_k; clip: sum of clipped rewards; delta: r_s); ``step_ends`` [N, S] gives the last token
of each step. Without a shaping stage the raw step scores give the canonical sum-form return.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Interval

from postrl.errors import ConfigError
from postrl.groups import group_index, group_sum, valid_mask
from postrl.advantages import Eps, grpo, masked_whiten
from postrl.advantages.turns import turn_of_token
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


_RESHAPING = "Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair"


@register("advantage", "process_weighted", source=_RESHAPING, needs=("groups",))
def process_weighted(reward: torch.Tensor, group_ids: torch.Tensor, completion_mask: torch.Tensor,
                     valid: torch.Tensor | None = None, turn_scores: torch.Tensor | None = None,
                     turn_ends: torch.Tensor | None = None, step_rewards: torch.Tensor | None = None,
                     step_ends: torch.Tensor | None = None, *, steps: Literal["turns", "steps"] = "turns",
                     beta: Annotated[float, Interval(ge=0, le=1)] = 0.5, normalize: bool = True,
                     scale: Literal["group", "none"] = "group", eps: Eps = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised outcome advantage, spread over a trajectory's steps by their process scores.

    "Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair": GRPO's group-normalised advantage is left
    unchanged and "step-level process scores outside group reward normalization reshape within-trajectory update
    strength". So the process scores never enter the group statistics: they only decide how the trajectory's
    advantage is distributed over its steps.
        A_i      = (r_i - mean_g r) / (std_g r + eps)      (GRPO on the outcome ``reward``, e.g. the layered
                                                             compile/semantic reward; scale='none': centred only)
        q_{i,k}  = p_{i,k} if A_i >= 0 else 1 - p_{i,k}    (p = the step's process score in [0, 1], clipped; a
                                                             missing score is neutral, 0.5)
        u_{i,k}  = 1 + beta (2 q_{i,k} - 1)                 (in [1 - beta, 1 + beta]; beta 0.5)
        w_{i,t}  = u_{i,k(t)} / mean_{t' in i} u_{i,k(t')}  (``normalize``, default: the mean over the row's
                                                             trained tokens is 1, so each trajectory's total update
                                                             is GRPO's and only its distribution changes)
        A_{i,t}  = A_i w_{i,t} on the row's trained tokens (``completion_mask``)
    A successful trajectory pushes hardest on its high-scoring steps, a failed one hardest on its low-scoring
    steps. Steps (``steps``): 'turns' (default) = the model turns of a multi-turn episode, scores ``turn_scores``
    (the environment's ``info['process_score']``, e.g. ``code_repair``'s per-attempt layered score), k(t) from
    ``turn_ends``; 'steps' = the reasoning steps of a single completion, scores ``step_rewards`` (a process reward
    source's step scores, e.g. a PRM's), each token in the first step whose end ``step_ends`` is >= t (tokens past
    the last step: the last step). Assumed (the abstract gives no formula): this linear weight, its sign flip for
    negative advantages, beta 0.5 and the per-trajectory normalisation. beta = 0 is GRPO. A row without any step
    score keeps weight 1. Rows with ``valid`` False or a NaN reward get 0.
    Shapes: reward [N], group_ids [N], completion_mask [N, T], turn_scores / turn_ends [N, K] or step_rewards /
    step_ends [N, S] -> [N, T].
    """
    N, T = completion_mask.shape
    if steps == "turns":
        if turn_scores is None or turn_ends is None:
            raise ConfigError("advantage.steps: 'turns' reads the episodes' turn_scores (an environment that gives "
                              "info['process_score'], e.g. code_repair); for a single completion use steps: steps")
        scores, ends = turn_scores, turn_ends
    else:
        if step_rewards is None or step_ends is None:
            raise ConfigError("advantage.steps: 'steps' reads step_rewards (a process reward source, e.g. a PRM)")
        S = max(step_rewards.shape[1], step_ends.shape[1])
        scores = torch.nn.functional.pad(step_rewards.float(), (0, S - step_rewards.shape[1]), value=float("nan"))
        ends = torch.nn.functional.pad(step_ends.long(), (0, S - step_ends.shape[1]), value=-1)
    v = valid_mask(reward, valid)
    A = grpo(reward, group_ids, v, scale=scale, eps=eps).to(torch.float64)
    has = ends >= 0
    p = torch.nan_to_num(scores.to(torch.float64), nan=0.5).clamp(0.0, 1.0)
    p = torch.where(has & torch.isfinite(scores), p, torch.full_like(p, 0.5))
    q = torch.where((A >= 0)[:, None], p, 1.0 - p)
    u = 1.0 + beta * (2.0 * q - 1.0)  # [N, K]
    if steps == "turns":
        k_t = turn_of_token(ends, T)
    else:
        key = torch.where(has, ends, torch.full_like(ends, T + 1)).contiguous()
        tok = torch.arange(T, dtype=torch.long).expand(N, T).contiguous()
        n_steps = has.sum(-1, keepdim=True)
        k_t = torch.minimum(torch.searchsorted(key, tok, side="left"), (n_steps - 1).clamp(min=0))
    w = u.gather(1, k_t) if u.shape[1] else torch.ones((N, T), dtype=torch.float64)
    m = completion_mask.to(torch.float64)
    scored = (has & torch.isfinite(scores)).any(-1)
    w = torch.where(scored[:, None], w, torch.ones_like(w))
    if normalize:
        mean_w = (w * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        w = w / torch.where(mean_w > 0, mean_w, torch.ones_like(mean_w))[:, None]
    out = A[:, None] * w * m
    return torch.where(v[:, None], out, torch.zeros_like(out)).to(torch.float32)
