"""Advantage estimators that condition on a per-completion metric or weight by policy entropy: CANON, GTPO, GRPO-S.

Where an abstract leaves the formula open, the docstring says "after <paper>" and states what was assumed.
``token_entropy`` [N, T] is produced by :mod:`postrl.fields` (a no-grad forward of the policy at the rollout
temperature) when an estimator names it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge

from postrl.groups import group_index, group_stats, group_sum, valid_mask
from postrl.advantages import Eps, grpo
from postrl.registry import register


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of x [N, T] over the mask (0 for rows without tokens), float64."""
    m = mask.to(torch.float64)
    return (torch.nan_to_num(x.to(torch.float64)) * m).sum(-1) / m.sum(-1).clamp(min=1.0)


# ------------------------------------------------------------------------------------------------------ CANON
_CANON_SRC = "Conditional Advantage Estimation for Reinforcement Learning in Large Reasoning Models (CANON)"


def canon(reward: torch.Tensor, group_ids: torch.Tensor, metric: torch.Tensor, valid: torch.Tensor | None = None,
          *, between: Annotated[float, Ge(0)] = 1.0, scale: Literal["group", "none"] = "group",
          eps: Eps = 1e-6) -> torch.Tensor:
    """CANON on a per-completion ``metric`` [N] (see :func:`canon_entropy`, :func:`canon_length`)."""
    v = valid_mask(reward, valid) & torch.isfinite(metric)
    m_mean, _, _ = group_stats(metric, group_ids, v)
    high = metric.to(torch.float64) > m_mean
    inv, ng = group_index(group_ids)
    half = inv * 2 + high.long()  # (group, half) cells
    r0 = torch.where(v, reward.to(torch.float64), torch.zeros_like(reward, dtype=torch.float64))
    s = group_sum(r0, half, 2 * ng)
    c = group_sum(v.to(torch.float64), half, 2 * ng)
    own = s[half] / c[half].clamp(min=1.0)
    other_cell = inv * 2 + (~high).long()
    n_other = c[other_cell]
    other = s[other_cell] / n_other.clamp(min=1.0)
    within = r0 - own
    btw = torch.where(n_other > 0, own - other, torch.zeros_like(own))
    adv = within + between * btw
    if scale == "group":
        _, std, _ = group_stats(reward, group_ids, v)
        adv = adv / (std + eps)
    return torch.where(v, adv, torch.zeros_like(adv)).to(torch.float32)


_CANON_DOC = """

    After "Conditional Advantage Estimation for Reinforcement Learning in Large Reasoning Models" (CANON): the
    group is regrouped into two halves by the metric, without presuming which direction is better; the
    comparison between the halves says which trend earns more reward, the comparison within a half says which
    response is better among those with the same trend:
      high_i   = m_i > mean_g m                 (the half h(i); the other half h'(i))
      within_i = r_i - mean_{h(i)} r
      btw_i    = mean_{h(i)} r - mean_{h'(i)} r  (0 when the other half is empty: all metrics equal)
      A_i      = (within_i + between * btw_i) / (std_g r + eps)
    with between = 1 (default) A_i = r_i - mean_{h'(i)} r: the response against the other trend's mean.
    Assumed (the abstract gives no formula): the split at the group's mean metric (ties go to the low half), the
    sum of the two terms with weight ``between`` (default 1.0), and the GRPO scaling by the group's unbiased
    reward std (scale='group', eps 1e-6; scale='none' leaves it out). Rows with ``valid`` False or a NaN reward
    are left out of every statistic and get 0; a group whose rewards are all equal gets 0."""


def canon_entropy(reward: torch.Tensor, group_ids: torch.Tensor, token_entropy: torch.Tensor,
                  completion_mask: torch.Tensor, valid: torch.Tensor | None = None, *,
                  between: Annotated[float, Ge(0)] = 1.0, scale: Literal["group", "none"] = "group",
                  eps: Eps = 1e-6) -> torch.Tensor:
    return canon(reward, group_ids, _row_mean(token_entropy, completion_mask), valid, between=between,
                 scale=scale, eps=eps)


def canon_length(reward: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor,
                 valid: torch.Tensor | None = None, *, between: Annotated[float, Ge(0)] = 1.0,
                 scale: Literal["group", "none"] = "group", eps: Eps = 1e-6) -> torch.Tensor:
    return canon(reward, group_ids, lengths.to(torch.float64), valid, between=between, scale=scale, eps=eps)


canon_entropy.__doc__ = ("Conditional advantage (CANON): halves of a group split by mean token entropy; between-half "
                         "plus within-half advantage." + _CANON_DOC + """
    m_i = mean over the completion's tokens of the policy's entropy (``token_entropy``).
    Shapes: reward [N], group_ids [N], token_entropy [N, T], completion_mask [N, T], valid [N] -> [N].
    """)
canon_length.__doc__ = ("Conditional advantage (CANON): halves of a group split by response length; between-half "
                        "plus within-half advantage." + _CANON_DOC + """
    m_i = the completion's length in tokens (``lengths``).
    Shapes: reward [N], group_ids [N], lengths [N], valid [N] -> [N].
    """)
register("advantage", "canon_entropy", source=_CANON_SRC + ", metric = entropy", needs=("groups",))(canon_entropy)
register("advantage", "canon_length", source=_CANON_SRC + ", metric = response length", needs=("groups",))(canon_length)


# ------------------------------------------------------------------------------------------------------ GTPO / GRPO-S
_GTPO_SRC = "GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy"


def _signs(reward: torch.Tensor, group_ids: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """+1 for a completion above its group's mean reward, -1 below, 0 otherwise (and for invalid rows)."""
    mean, _, _ = group_stats(reward, group_ids, v)
    r = reward.to(torch.float64)
    s = torch.where(r > mean, 1.0, torch.where(r < mean, -1.0, 0.0)).to(torch.float64)
    return torch.where(v, s, torch.zeros_like(s))


@register("advantage", "gtpo", source=_GTPO_SRC + " (GTPO)", needs=("groups",))
def gtpo(reward: torch.Tensor, group_ids: torch.Tensor, token_entropy: torch.Tensor, completion_mask: torch.Tensor,
         valid: torch.Tensor | None = None, *, alpha: Annotated[float, Ge(0)] = 0.1, eps: Eps = 1e-6) -> torch.Tensor:
    """Group Token Policy Optimization: each token gets an entropy-weighted reward, then group-normalised.

    After "GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with Policy Entropy" (Dynamic Entropy
    Weighting; high entropy marks the pivotal tokens of a reasoning path). Per group g, completions above the
    group's mean reward are positive (P, sign +1), those below negative (N, sign -1); at every position t:
      w_{i,t} = H_{i,t} / mean_{k in P alive at t} H_{k,t}                       for i in P
      w_{i,t} = (1 / (H_{i,t} + eps)) / mean_{k in N alive at t} 1 / (H_{k,t} + eps)  for i in N
      r~_{i,t} = r_i + alpha * sign_i * w_{i,t}      (a completion at the mean: r~ = r_i)
      A_{i,t} = (r~_{i,t} - mean_g r~) / (std_g r~ + eps), mean and unbiased std over the group's valid tokens.
    So a correct path's high-entropy tokens get the most extra credit and a wrong path's confident (low-entropy)
    tokens the most extra blame; the mean bonus over the alive members of a set at t is alpha. H is the policy's
    token entropy (``token_entropy``). Assumed (the abstract gives no formula): the split at the group mean,
    the inverse entropy for negatives, normalisation by the set's mean at each position, alpha 0.1, eps 1e-6.
    A group whose rewards are all equal gets 0. Rows with ``valid`` False or a NaN reward get 0.
    Shapes: reward [N], group_ids [N], token_entropy [N, T], completion_mask [N, T], valid [N] -> [N, T].
    """
    v = valid_mask(reward, valid)
    sign = _signs(reward, group_ids, v)
    inv, ng = group_index(group_ids)
    m = completion_mask.to(torch.float64) * v.to(torch.float64).unsqueeze(-1)
    H = torch.nan_to_num(token_entropy.to(torch.float64)).clamp(min=0.0)
    x = torch.where(sign.unsqueeze(-1) < 0, 1.0 / (H + eps), H) * m  # the weighted quantity per set
    cell = inv * 3 + (sign + 1).long()  # (group, sign) cells
    T = m.shape[-1]
    S = torch.zeros(3 * ng, T, dtype=torch.float64).index_add_(0, cell, x)
    C = torch.zeros(3 * ng, T, dtype=torch.float64).index_add_(0, cell, m)
    w = x / (S[cell] / C[cell].clamp(min=1.0)).clamp(min=eps)
    rt = (torch.where(v, reward.to(torch.float64), 0.0).unsqueeze(-1) + alpha * sign.unsqueeze(-1) * w) * m
    n = group_sum(m.sum(-1), inv, ng)
    mean = group_sum(rt.sum(-1), inv, ng) / n.clamp(min=1.0)
    dev = (rt - mean[inv].unsqueeze(-1)) * m
    var = group_sum((dev * dev).sum(-1), inv, ng) / (n - 1).clamp(min=1.0)
    adv = dev / (var.sqrt()[inv].unsqueeze(-1) + eps)
    return adv.to(torch.float32)


@register("advantage", "grpo_s", source=_GTPO_SRC + " (GRPO-S)", needs=("groups",))
def grpo_s(reward: torch.Tensor, group_ids: torch.Tensor, token_entropy: torch.Tensor, completion_mask: torch.Tensor,
           valid: torch.Tensor | None = None, *, alpha: Annotated[float, Ge(0)] = 0.1, eps: Eps = 1e-6) -> torch.Tensor:
    """Sequence-level GRPO (GRPO-S): each completion's reward gets an entropy-weighted bonus, then GRPO.

    After "GTPO and GRPO-S" (the sequence-level analogue of ``gtpo``): with Hbar_i the completion's mean token
    entropy and P / N the completions above / below their group's mean reward,
      w_i = Hbar_i / mean_{k in P} Hbar_k                       for i in P
      w_i = (1 / (Hbar_i + eps)) / mean_{k in N} 1 / (Hbar_k + eps)  for i in N
      r^_i = r_i + alpha * sign_i * w_i;   A_i = (r^_i - mean_g r^) / (std_g r^ + eps)   (``grpo``, unbiased std)
    Assumed as in ``gtpo``: alpha 0.1, eps 1e-6, the split at the group mean and the inverse entropy for
    negatives. A group whose rewards are all equal gets 0.
    Shapes: reward [N], group_ids [N], token_entropy [N, T], completion_mask [N, T], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    sign = _signs(reward, group_ids, v)
    hbar = _row_mean(token_entropy, completion_mask).clamp(min=0.0)
    x = torch.where(sign < 0, 1.0 / (hbar + eps), hbar)
    inv, ng = group_index(group_ids)
    cell = inv * 3 + (sign + 1).long()
    on = v.to(torch.float64)
    set_mean = group_sum(x * on, cell, 3 * ng) / group_sum(on, cell, 3 * ng).clamp(min=1.0)
    w = x / set_mean[cell].clamp(min=eps)
    shaped = torch.where(v, reward.to(torch.float64) + alpha * sign * w, reward.to(torch.float64))
    return grpo(shaped, group_ids, v, eps=eps)
