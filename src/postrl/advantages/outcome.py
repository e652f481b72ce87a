"""Outcome-reward advantage estimators that anchors ship (verl ``compute_*_outcome_advantage``).

Each matches its verl function numerically on groups of two or more valid completions (tests re-implement
verl's loop-based formula and compare on random inputs). Differences, all deliberate and shared by every
estimator of this package: rows with ``valid`` False or a NaN reward are excluded from every statistic and get
advantage 0; a group with a single valid completion gets 0 (``singleton='zero'``, default) or, with
``singleton='raw'``, verl's convention (group mean 0 and std 1: the raw reward), which makes every estimator here
match its verl function for any group size.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Le

from postrl.advantages import Eps, Singleton, grpo, masked_whiten, singleton_stats, token_whiten
from postrl.groups import group_index, group_stats, group_sum, valid_mask
from postrl.registry import register


def _out(adv: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if adv.dim() == 2:
        v = v.unsqueeze(-1)
    return torch.where(v, adv, torch.zeros_like(adv)).to(torch.float32)


@register("advantage", "dr_grpo", source="Understanding R1-Zero-Like Training (Dr. GRPO); verl "
          "norm_adv_by_std_in_grpo=False; TRL scale_rewards='none'", needs=("groups",))
def dr_grpo(reward: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
            singleton: Singleton = "zero") -> torch.Tensor:
    """A_i = r_i - mean_g r (no division by the group std); a group of one: 0, or r with ``singleton='raw'`` (verl).

    "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO): removing the std removes the
    question-difficulty bias; pair it with the ``dr_grpo`` loss aggregation (sum / (B * L_max)) to remove the
    length bias too. Same as ``grpo`` with ``scale='none'``; anchors verl ``norm_adv_by_std_in_grpo=False``,
    TRL ``scale_rewards='none'``. Shapes: reward [N], group_ids [N], valid [N] -> [N].
    """
    return grpo(reward, group_ids, valid, scale="none", singleton=singleton)


@register("advantage", "rloo", source="Back to Basics: REINFORCE-style optimization (RLOO, Ahmadian et al. 2024); "
          "verl adv_estimator=rloo", needs=("groups",))
def rloo(reward: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
         singleton: Singleton = "zero") -> torch.Tensor:
    """A_i = r_i - (sum_{j != i} r_j) / (n - 1) = n / (n - 1) * (r_i - mean_g r), n = valid rows of the group.

    Leave-one-out baseline (Kool et al. 2019; "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs"). Matches verl ``compute_rloo_outcome_advantage`` for n >= 2.
    n = 1: no other completion to form the baseline, A = 0; ``singleton='raw'``: A = r (verl, which leaves a
    group of one's score unchanged). Sums to zero within every group of n >= 2.
    Shapes: reward [N], group_ids [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    mean, _, n = group_stats(reward, group_ids, v)
    r = reward.to(torch.float64)
    adv = (r - mean) * n / (n - 1).clamp(min=1)
    return _out(torch.where(n > 1, adv, r if singleton == "raw" else torch.zeros_like(adv)), v)


@register("advantage", "reinforce_pp", source="REINFORCE++ (Hu et al. 2025); verl adv_estimator=reinforce_plus_plus")
def reinforce_pp(reward: torch.Tensor, completion_mask: torch.Tensor, valid: torch.Tensor | None = None, *,
                 gamma: Annotated[float, Ge(0), Le(1)] = 1.0) -> torch.Tensor:
    """Token returns G_{i,t} = gamma^(l_i - t) r_i (t <= l_i, l_i = last completion token), whitened over all
    valid tokens of the batch: A_{i,t} = (G_{i,t} - mean) / sqrt(var + 1e-8), unbiased var.

    "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models": no critic, no group
    baseline; the outcome reward sits on the last token and is discounted backwards. gamma default 1.0 (verl
    ``algorithm.gamma``). Matches verl ``compute_reinforce_plus_plus_outcome_advantage`` (its reverse loop with
    reset after EOS) for right-padded masks. The KL penalty that REINFORCE++ puts in the reward is postrl's
    ``kl`` section (in the loss). Works with any group size (G = 1 included).
    Shapes: reward [N], completion_mask [N, T], valid [N] -> [N, T].
    """
    v = valid_mask(reward, valid)
    mask = completion_mask.to(torch.float32) * v.unsqueeze(-1)
    r = torch.where(v, reward.to(torch.float32), torch.zeros_like(reward, dtype=torch.float32))
    if gamma == 1.0:  # every token of a row holds r_i: the token statistics come from [N] sums
        L = mask.sum(-1).to(torch.float64)
        r64 = r.to(torch.float64)
        n = float(L.sum())
        if n < 1:
            return torch.zeros_like(mask)
        mean = float((L * r64).sum()) / n
        var = max(float((L * r64 * r64).sum()) - n * mean * mean, 0.0) / (n - 1) if n > 1 else None
        scale = (r64 - mean) * ((var + 1e-8) ** -0.5 if var is not None else 1.0)
        return scale.to(torch.float32).unsqueeze(-1) * mask
    else:
        T = mask.shape[-1]
        pos = torch.arange(T, dtype=torch.float32)
        last = torch.where(mask > 0, pos, torch.full_like(mask, -1.0)).amax(-1, keepdim=True)  # [N, 1]
        returns = r.unsqueeze(-1) * torch.pow(gamma, (last - pos).clamp(min=0)) * mask
    return masked_whiten(returns, mask)  # rows with valid False are all-masked: 0


@register("advantage", "reinforce_pp_baseline", source="REINFORCE++ (Hu et al. 2025), group-baseline variant; "
          "verl adv_estimator=reinforce_plus_plus_baseline", needs=("groups",))
def reinforce_pp_baseline(reward: torch.Tensor, group_ids: torch.Tensor, completion_mask: torch.Tensor,
                          valid: torch.Tensor | None = None, *, singleton: Singleton = "zero") -> torch.Tensor:
    """c_i = r_i - mean_g r, then whitened over all valid tokens of the batch (each row weighs its length):
    A_i = (c_i - mu) / sqrt(var + 1e-8), mu and the unbiased var over tokens.

    "REINFORCE++" with a group-mean baseline ("REINFORCE++-baseline"). Matches verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (group mean, tile over tokens, masked_whiten) for
    groups of n >= 2; singleton groups are excluded from the whitening and get 0 (``singleton='zero'``), or
    (``singleton='raw'``, verl for any group size) enter it with c_i = r_i (verl's group mean 0).
    Shapes: reward [N], group_ids [N], completion_mask [N, T], valid [N] -> [N] (constant over a row's tokens).
    """
    v = valid_mask(reward, valid)
    mean, std, n = group_stats(reward, group_ids, v)
    mean, _ = singleton_stats(mean, std, n, singleton)
    if singleton == "zero":
        v = v & (n > 1)
    c = reward.to(torch.float64) - mean
    return _out(token_whiten(c, completion_mask.sum(-1), v), v)



@register("advantage", "remax", source="ReMax (Li et al. 2023); verl adv_estimator=remax")
def remax(reward: torch.Tensor, greedy_reward: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """A_i = r_i - r(greedy completion of the same prompt).

    "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning LLMs": the baseline is
    the reward of the greedy (temperature 0) completion, which the trainer generates and scores with the same
    rewards and shaping (``batch.extra['greedy_reward']``, one value per row). Matches verl
    ``compute_remax_outcome_advantage`` (outcome reward, so the token return is r_i on every token). A row whose
    greedy reward is NaN (its reward failed) is excluded. Works with any group size.
    Shapes: reward [N], greedy_reward [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid) & torch.isfinite(greedy_reward)
    adv = reward.to(torch.float64) - greedy_reward.to(torch.float64)
    return _out(torch.where(v, adv, torch.zeros_like(adv)), v)


@register("advantage", "opo", source="On-Policy RL with Optimal Reward Baseline (OPO, Hao et al. 2025); "
          "verl adv_estimator=opo", needs=("groups",))
def opo(reward: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor,
        valid: torch.Tensor | None = None, *, singleton: Singleton = "zero") -> torch.Tensor:
    """A_i = r_i - b_g, b_g = sum_j |o_j| r_j / sum_j |o_j| over the valid completions of the group.

    "On-Policy RL with Optimal Reward Baseline": the length-weighted mean is the variance-minimising baseline
    under a sequence-level gradient whose norm grows with length. Matches verl ``compute_opo_outcome_advantage``
    for n >= 2 (lengths = completion-mask row sums). n = 1: b = r, so A = 0; ``singleton='raw'``: b = 0, A = r
    (verl). Shapes: reward [N], group_ids [N], lengths [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    inv, ng = group_index(group_ids)
    L = torch.where(v, lengths.to(torch.float64), torch.zeros_like(lengths, dtype=torch.float64))
    r = torch.where(v, reward.to(torch.float64), torch.zeros_like(reward, dtype=torch.float64))
    sl = group_sum(L, inv, ng)
    mean, _, n = group_stats(reward, group_ids, v)
    b = torch.where(sl[inv] > 0, group_sum(L * r, inv, ng)[inv] / sl[inv].clamp(min=1e-300), mean)
    adv = torch.where(n > 1, r - b, r if singleton == "raw" else torch.zeros_like(r))
    return _out(adv, v)


@register("advantage", "gpg", source="GPG: A Simple and Strong Reinforcement Learning Baseline (Chu et al. 2025); "
          "verl adv_estimator=gpg", needs=("groups",))
def gpg(reward: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
        f_norm: Annotated[float, Gt(0)] = 1.0, count: Literal["nonzero_reward", "informative"] = "nonzero_reward",
        singleton: Singleton = "zero") -> torch.Tensor:
    """A_i = alpha * (r_i - mean_g r) / f_norm, alpha = B / max(1, M).

    "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning": a group-mean advantage
    rescaled so that the samples that carry signal keep their weight when many rows have none. B = valid rows
    of the batch. M: ``count='nonzero_reward'`` (default) counts valid rows with r != 0, exactly verl
    ``compute_gpg_outcome_advantage`` (``torch.count_nonzero(scores)``); ``count='informative'`` counts the rows
    of groups whose rewards are not all equal (the paper's "valid samples", those with a non-zero advantage).
    f_norm default 1.0 (verl). Singleton groups get 0, or alpha * r / f_norm with ``singleton='raw'`` (verl).
    Shapes: reward [N], group_ids [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    mean, std, n = group_stats(reward, group_ids, v)
    B = v.sum().to(torch.float64)
    if count == "nonzero_reward":
        M = (v & (reward != 0)).sum().to(torch.float64)
    else:
        M = (v & (std > 0)).sum().to(torch.float64)
    alpha = B / M.clamp(min=1)
    mean, _ = singleton_stats(mean, std, n, singleton)
    adv = alpha * (reward.to(torch.float64) - mean) / f_norm
    return _out(torch.where((n > 1) | (singleton == "raw"), adv, torch.zeros_like(adv)), v)


@register("advantage", "pass_at_k", source="Pass@k Training (Chen et al. 2025, arXiv:2503.19595); "
          "verl adv_estimator=grpo_passk", needs=("groups",))
def pass_at_k(reward: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
              scale: Literal["group", "none"] = "group", eps: Eps = 1e-6) -> torch.Tensor:
    """Only the best completion of each group gets a non-zero advantage: A_best = (r_max - r_second) / (std_g + eps)
    (scale='group', default; verl ``norm_adv_by_std_in_grpo=True``) or r_max - r_second (scale='none').

    Optimises pass@k (the best of the group) rather than the mean. Matches verl
    ``compute_grpo_passk_outcome_advantage``; with ties for the maximum r_max - r_second = 0, so which tied row
    is "best" does not matter (postrl takes the first). verl raises for groups of fewer than 2 samples; postrl
    gives them 0 (no ``singleton`` option: verl has no value to reproduce). eps 1e-6 (verl).
    Shapes: reward [N], group_ids [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    inv, ng = group_index(group_ids)
    _, std, n = group_stats(reward, group_ids, v)
    r = reward.to(torch.float64)
    neg = torch.full_like(r, -torch.inf)
    rv = torch.where(v, r, neg)
    gmax = torch.full((ng,), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, rv, "amax")
    rows = torch.arange(len(r))
    is_max = v & (rv == gmax[inv])
    first = torch.full((ng,), len(r), dtype=torch.long).scatter_reduce(
        0, inv, torch.where(is_max, rows, torch.full_like(rows, len(r))), "amin")
    best = rows == first[inv]
    second = torch.full((ng,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(best, neg, rv), "amax")
    gap = gmax[inv] - second[inv]
    if scale == "group":
        gap = gap / (std + eps)
    adv = torch.where(best & (n > 1), gap, torch.zeros_like(r))
    return _out(adv, v)
