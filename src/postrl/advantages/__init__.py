"""Advantage estimators.

Each estimator reads batch fields by its positional parameter names and returns advantages ``[N]`` (one per
completion, broadcast over its tokens) or ``[N, T]``. Group statistics are vectorised with scatter-adds over
``group_ids`` (no Python loop over groups); rows where ``valid`` is False (or whose reward is NaN) take no part
in any statistic and get advantage 0 (the trainer also masks them out of the loss).

Conventions shared by every estimator here:
- groups may have unequal sizes; a group with a single valid completion has no baseline other than its own
  reward, so its advantage is 0 by default (``singleton='zero'``: postrl does not train on an unnormalised raw
  reward silently). The estimators whose docstring claims a verl anchor take ``singleton='raw'``: verl's
  convention, group mean 0 and group std 1 for a group of one (``compute_grpo_outcome_advantage``: A = r / (1 +
  eps); rloo, opo, gpg, reinforce_pp_baseline: the raw reward enters as the centred one);
- statistics are computed in float64 and returned as float32;
- inputs an estimator needs beyond the rollout batch (``greedy_reward``, ``token_entropy``, ``completion_hidden``,
  ``prompt_logprob``, ``info_gain``) are made by field producers through a model context (:mod:`postrl.fields`)
  when the configured estimator names them as positional parameters.

Modules: ``outcome`` (anchor-matched outcome estimators: dr_grpo, rloo, reinforce_pp(_baseline), remax, opo, gpg,
pass_at_k), ``gae`` (GAE with a value head), ``shaped`` (gdpo, mapo, rl_zvp, confidence_scaled,
riskpo, aem, information_gain), ``tournament`` (rank_tournament), ``process`` (step_return: token advantages from
process step rewards, PURE), ``adora`` (adora: GRPO reweighted per group by a per-prompt utility), ``ares`` (ares:
window-entropy triggers and a difficulty-aware entropy reward).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge

from postrl.groups import group_stats
from postrl.registry import register


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the entries where ``mask`` is 1; unbiased var (verl ``masked_whiten``,
    ``verl.utils.torch_functional``, eps 1e-8). Fewer than 2 masked entries: only centred. Masked-out entries: 0.
    Sums are taken per row, then over rows in float64; the result has x's dtype."""
    m = mask.to(x.dtype)
    xm = x * m

    def total(t: torch.Tensor) -> float:
        return float((t.sum(-1) if t.dim() > 1 else t).sum(dtype=torch.float64))

    n = total(m)
    if n < 1:
        return torch.zeros_like(x)
    mean = total(xm) / n
    if n < 2:
        return (x - mean) * m
    var = max(total(xm * x) - n * mean * mean, 0.0) / (n - 1)  # sum over masked (x - mean)^2 = sum x^2 - n mean^2
    return (x - mean).mul_(m).mul_((var + eps) ** -0.5)


def token_whiten(x: torch.Tensor, lengths: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """verl ``masked_whiten`` of a per-row value broadcast over its tokens: (x_i - mu) / sqrt(var + 1e-8), mu and
    the unbiased var over all tokens of the rows ``v`` (each row weighs its length |o_i|), without building the
    [N, T] tensor. x [N], lengths [N], v [N] bool -> [N] float64 (0 outside ``v``; 0 when no token)."""
    x = torch.where(v, x.to(torch.float64), torch.zeros_like(x, dtype=torch.float64))
    w = lengths.to(torch.float64) * v
    total = w.sum()
    if total < 1:
        return torch.zeros_like(x)
    mu = (w * x).sum() / total
    d = x - mu
    var = (w * d * d).sum() / total * (total / (total - 1)) if total > 1 else torch.zeros((), dtype=torch.float64)
    return torch.where(v, d * torch.rsqrt(var + 1e-8), torch.zeros_like(d))


Singleton = Literal["zero", "raw"]  # a group of one valid completion: advantage 0, or verl's raw reward
Eps = Annotated[float, Ge(0)]  # an ``eps`` added to a std (0 allowed: exact arithmetic in tests)


def singleton_stats(mean: torch.Tensor, std: torch.Tensor, n: torch.Tensor, singleton: Singleton):
    """(mean, std) with verl's group-of-one convention applied when ``singleton='raw'``: mean 0, std 1 where the
    group has one valid row (verl ``compute_grpo_outcome_advantage``: ``id2mean = 0, id2std = 1``)."""
    if singleton == "zero":
        return mean, std
    one = n == 1
    return torch.where(one, torch.zeros_like(mean), mean), torch.where(one, torch.ones_like(std), std)


@register("advantage", "grpo", source="DeepSeekMath (GRPO); verl adv_estimator=grpo; TRL scale_rewards", needs=("groups",))
def grpo(reward: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
         scale: Literal["group", "batch", "none"] = "group", eps: Eps = 1e-6,
         singleton: Singleton = "zero") -> torch.Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps), with the unbiased std of the completion's group g.

    scale='group' (default; verl ``norm_adv_by_std_in_grpo=True``, TRL ``scale_rewards='group'``);
    scale='batch': divide by the unbiased std of all valid rewards of the batch (TRL ``scale_rewards='batch'``);
    scale='none': A_i = r_i - mean_g r (verl ``norm_adv_by_std_in_grpo=False``, TRL ``scale_rewards='none'``).
    eps: verl 1e-6 (default), TRL 1e-4, OpenRLHF 1e-9. A group of one valid completion: A = 0
    (``singleton='zero'``, default) or verl's mean 0 / std 1 (``singleton='raw'``: A = r / (1 + eps) with
    scale='group', r with 'none', r / (std_B + eps) with 'batch').
    Shapes: reward [N], group_ids [N], valid [N] bool -> [N].
    """
    v = torch.isfinite(reward) if valid is None else (valid.bool() & torch.isfinite(reward))
    mean, std, n = group_stats(reward, group_ids, v)
    mean, std = singleton_stats(mean, std, n, singleton)
    adv = reward.to(torch.float64) - mean
    if scale == "group":
        adv = adv / (std + eps)
    elif scale == "batch":
        rv = reward[v].to(torch.float64)
        bstd = rv.std() if rv.numel() > 1 else torch.zeros((), dtype=torch.float64)
        adv = adv / (bstd + eps)
    return torch.where(v, adv, torch.zeros_like(adv)).to(torch.float32)


# Estimators in submodules register themselves on import.
from postrl.advantages import (  # noqa: E402,F401
    adora, ares, entropy, gae, outcome, process, shaped, token_rewards, tournament, turns,
)
from postrl.advantages import flow  # noqa: E402,F401  (issue 31: RLFR)
