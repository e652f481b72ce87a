"""ARES (text part): window-entropy exploration triggers and a difficulty-aware entropy reward (stateful).

"ARES: Multimodal Adaptive Reasoning via Difficulty-Aware Token-Level Entropy Shaping", its Adaptive Entropy Policy
Optimization (AEPO): high window-entropy (HWE) tokens (token entropies averaged under a sliding window) trigger
exploration; a hierarchical entropy reward, by task difficulty, decides how much; a dynamic KL relaxes inside the
HWE windows (the regulariser ``ares_kl``, which reads the windows and difficulties this estimator hands on).
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from annotated_types import Ge, Gt, Lt

from postrl.advantages import Eps, grpo
from postrl.groups import group_stats, valid_mask
from postrl.registry import register
from postrl.stages import StepEnd, Stateful

ARES_SOURCE = "ARES: Multimodal Adaptive Reasoning via Difficulty-Aware Token-Level Entropy Shaping"
EASY, MEDIUM, HARD = 0, 1, 2


def window_entropy(token_entropy: torch.Tensor, completion_mask: torch.Tensor, window: int) -> torch.Tensor:
    """W_{i,t} = mean of H_{i,t+1} .. H_{i,t+window} (the entropies of the tokens that follow t) where that window
    lies inside the completion (t + window <= L_i - 1, L_i = its last loss token + 1) and t is a loss token; NaN
    elsewhere. [N, T] float64."""
    m = completion_mask > 0
    H = torch.where(m, torch.nan_to_num(token_entropy.to(torch.float64)), torch.zeros((), dtype=torch.float64))
    N, T = H.shape
    S = torch.cat([torch.zeros(N, 1, dtype=torch.float64), H.cumsum(-1)], -1)  # S[:, k] = sum H[:, :k]
    pos = torch.arange(T)
    hi = (pos + window + 1).clamp(max=T)
    W = (S[:, hi] - S[:, (pos + 1).clamp(max=T)]) / window
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(-1, keepdim=True)  # [N, 1]
    ok = m & (pos + window <= last)
    return torch.where(ok, W, torch.full_like(W, math.nan))


def hwe_windows(hwe: torch.Tensor, window: int) -> torch.Tensor:
    """bool [N, T]: tokens t with an HWE token s, s <= t <= s + window (the trigger and the window after it)."""
    c = torch.cat([torch.zeros(hwe.shape[0], 1), hwe.float().cumsum(-1)], -1)  # c[:, k] = HWE tokens before k
    T = hwe.shape[1]
    pos = torch.arange(T)
    return (c[:, pos + 1] - c[:, (pos - window).clamp(min=0)]) > 0


@register("advantage", "ares", source=ARES_SOURCE, needs=("groups",))
class Ares(Stateful):
    """GRPO on r + a difficulty-aware reward on the count of high window-entropy tokens (after ARES, text part).

    Hands on its HWE windows and difficulties to the ``ares_kl`` regulariser (ARES's dynamic KL).

    Window entropy (H = the policy's token entropy, ``token_entropy``; w = ``window``, default 4):
      W_{i,t} = (1/w) sum_{k=t+1}^{t+w} H_{i,k}, for t with a whole window inside the completion.
    HWE trigger: token t is an HWE token when W_{i,t} >= tau. tau (state): per row the ``quantile`` (0.98) of its
    window entropies, the median of those over the batch, smoothed over steps tau <- m tau + (1 - m) tau_batch
    (``momentum`` m = 0.99; the first step's batch value starts it; the step's batch uses the tau of the steps
    before, the first step its own). n_i = number of HWE tokens of completion i.
    Difficulty of a group from its pass rate p_g (correct = r >= ``threshold``, 1.0): easy p_g >= 2/3, medium
    p_g >= 1/3, hard otherwise. Per bucket d over the batch: target T_d = mean n_i, margin m_d = max(1, f_d T_d)
    (``margins`` f = (0.15, 0.25, 0.35)), scale s_d = max(T_d, 1), delta_i = n_i - T_d:
      easy, correct:    e_i = -alpha min(1, relu(delta_i - m_d) / s_d)     (too much exploration on an easy task)
      medium, correct:  e_i = -alpha min(1, relu(|delta_i| - m_d) / s_d)   (stay near the batch's target)
      hard (any):       e_i = +alpha min(1, relu(delta_i + m_d) / s_d)     (explore more on a hard task)
      otherwise e_i = 0;  A_i = GRPO(r_i + e_i) = (r'_i - mean_g r') / (std_g r' + eps)   (alpha 0.5, eps 1e-6).
    Returns the advantages [N] and, for ``ares_kl``, ``ares_hwe`` [N, T] (1 on the tokens of a validated HWE window:
    an HWE token and the w tokens after it) and ``ares_difficulty`` [N] (0 easy, 1 medium, 2 hard; 0 on invalid
    rows). The difficulty buckets, thresholds 2/3 and 1/3, the following-token window (4), the 98th percentile, the
    median over rows with 0.99 smoothing, the margins and alpha 0.5 follow the authors' released code; assumed
    where the abstract gives no formula (their released reward is a Huber / sigmoid variant of the same shape and
    also rewards incorrect easy and medium answers for exploring): the piecewise-linear, capped entropy reward above,
    no bonus for incorrect easy / medium answers, targets as the batch's bucket means and no restriction of HWE
    triggers to a list of reasoning words. Rows with ``valid`` False or a NaN reward get 0.
    Shapes: reward [N], group_ids [N], token_entropy [N, T], completion_mask [N, T], valid [N] -> dict.
    """

    _state = ("tau",)

    def __init__(self, *, window: Annotated[int, Ge(1)] = 4, quantile: Annotated[float, Gt(0), Lt(1)] = 0.98,
                 momentum: Annotated[float, Ge(0), Lt(1)] = 0.99, threshold: float = 1.0,
                 alpha: Annotated[float, Ge(0)] = 0.5,
                 margins: tuple[Annotated[float, Ge(0)], Annotated[float, Ge(0)], Annotated[float, Ge(0)]] =
                 (0.15, 0.25, 0.35), eps: Eps = 1e-6):
        self.window, self.quantile, self.momentum = int(window), float(quantile), float(momentum)
        self.threshold, self.alpha, self.margins, self.eps = float(threshold), float(alpha), tuple(margins), eps
        self.tau: float | None = None

    def batch_threshold(self, W: torch.Tensor) -> float:
        """Median over rows of each row's ``quantile`` of its window entropies (NaN when no row has a window)."""
        if not bool(torch.isfinite(W).any()):
            return math.nan
        per_row = torch.nanquantile(W, self.quantile, dim=-1)
        return float(torch.quantile(per_row[torch.isfinite(per_row)], 0.5))  # (an even count: the middle two's mean)

    def difficulty(self, reward: torch.Tensor, group_ids: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bucket per row [N] long: 0 easy (pass rate >= 2/3), 1 medium (>= 1/3), 2 hard."""
        correct = (reward.to(torch.float64) >= self.threshold).to(torch.float64)
        p, _, _ = group_stats(correct, group_ids, v)
        return torch.where(p >= 2 / 3 - 1e-12, EASY, torch.where(p >= 1 / 3 - 1e-12, MEDIUM, HARD))

    def __call__(self, reward: torch.Tensor, group_ids: torch.Tensor, token_entropy: torch.Tensor,
                 completion_mask: torch.Tensor, valid: torch.Tensor | None = None) -> dict:
        v = valid_mask(reward, valid)
        W = window_entropy(token_entropy, completion_mask * v.unsqueeze(-1), self.window)
        tau = self.tau if self.tau is not None else self.batch_threshold(W)
        hwe = torch.isfinite(W) & (W >= tau) if tau == tau else torch.zeros_like(W, dtype=torch.bool)
        n = hwe.sum(-1).to(torch.float64)
        diff = self.difficulty(reward, group_ids, v)
        correct = reward.to(torch.float64) >= self.threshold
        e = torch.zeros_like(n)
        for d in (EASY, MEDIUM, HARD):
            rows = v & (diff == d)
            if not bool(rows.any()):
                continue
            target = float(n[rows].mean())
            margin = max(1.0, self.margins[d] * target)
            scale = max(target, 1.0)
            delta = n - target
            if d == EASY:
                val = -self.alpha * (torch.relu(delta - margin) / scale).clamp(max=1.0)
                on = rows & correct
            elif d == MEDIUM:
                val = -self.alpha * (torch.relu(delta.abs() - margin) / scale).clamp(max=1.0)
                on = rows & correct
            else:
                val = self.alpha * (torch.relu(delta + margin) / scale).clamp(max=1.0)
                on = rows
            e = torch.where(on, val, e)
        shaped = torch.where(v, reward.to(torch.float64) + e, reward.to(torch.float64))
        adv = grpo(shaped, group_ids, v, eps=self.eps)
        return {"advantages": adv, "ares_hwe": hwe_windows(hwe, self.window).float() * completion_mask,
                "ares_difficulty": torch.where(v, diff, torch.zeros_like(diff)).float()}

    def observe(self, token_entropy: torch.Tensor, completion_mask: torch.Tensor, reward: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
        v = valid_mask(reward, valid)
        tau_b = self.batch_threshold(window_entropy(token_entropy, completion_mask * v.unsqueeze(-1), self.window))
        if tau_b == tau_b:
            self.record(tau_b)

    def end_step(self, step: StepEnd) -> dict:
        if self.observed:  # every process's batch values of this step, in rank order
            tau_b = sum(self.observed) / len(self.observed)
            self.tau = tau_b if self.tau is None else self.momentum * self.tau + (1.0 - self.momentum) * tau_b
        return {"hwe_threshold": self.tau} if self.tau is not None else {}
