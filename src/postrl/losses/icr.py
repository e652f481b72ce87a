"""ICR: a likelihood pull toward the shortest correct completions of each group, in the overthinking regime only.

"Implicit Compression Regularization: Concise Reasoning via Internal Shorter Distributions in RL Post-Training"
(arXiv 2605.07316). Two parts, configured as one regulariser entry (``regularizers: [{name: icr, coef: 0.1}]``;
the producer's parameters go in the same entry):

* the field ``icr_target`` [N] (a producer, kind ``field``): which completions are compression targets (1) and
  which are not (0), from the batch's correctness, lengths and groups (:func:`icr_targets`);
* the regulariser ``icr``: R_{i,t} = -icr_target_i * log pi_theta(o_{i,t} | q, o_{i,<t}) (:func:`icr`).

The statistic that gates it, the batch's length-accuracy correlation, is logged every step as
``length/accuracy_corr`` (:func:`postrl.diagnostics.metrics.batch_metrics`, the same formula on the ``correct``
column) so a run shows whether it is overthinking (< 0) or underthinking (> 0).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge, Le

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.errors import ConfigError
from postrl.groups import group_corr, group_index, group_stats
from postrl.registry import register

SOURCE = ("Implicit Compression Regularization: Concise Reasoning via Internal Shorter Distributions in RL "
          "Post-Training (arXiv 2605.07316)")


def length_accuracy_corr(lengths: torch.Tensor, correct: torch.Tensor, group_ids: torch.Tensor,
                         valid: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(rho_B, rho_g per row [N], defined per row [N]): the within-group Pearson correlation of completion length
    and correctness (1/0) over the ``valid`` rows, and rho_B its mean over the groups where it is defined (both
    vary: at least one correct and one wrong completion, two different lengths); NaN when no group has one."""
    rho, defined = group_corr(lengths, correct.to(torch.float64), group_ids, valid)
    inv, ng = group_index(group_ids)
    per_group = torch.full((ng,), float("nan"), dtype=torch.float64)
    per_group[inv[defined]] = rho[defined]
    ok = torch.isfinite(per_group)
    return (float(per_group[ok].mean()) if bool(ok.any()) else float("nan")), rho, defined


def icr_targets(rewards: torch.Tensor, reward_names: list, lengths: torch.Tensor, group_ids: torch.Tensor,
                valid: torch.Tensor | None = None, *, source: str = "correct", correct_threshold: float = 1.0,
                top: int = 1, gate: str = "batch", max_corr: float = 0.0,
                shorter_than_mean: bool = True) -> tuple[torch.Tensor, float]:
    """(z [N] float32 in {0, 1}, rho_B): ICR's compression targets and the batch correlation that gated them.

    Over the rows that are ``valid`` and whose correctness is known (column ``source`` of ``rewards`` finite):
      c_i    = 1[r_i^source >= correct_threshold], L_i = the completion's token count
      rho_g  = Pearson(L, c) within group g; rho_B = mean of the defined rho_g (:func:`length_accuracy_corr`)
      on_g   = rho_B < max_corr (gate 'batch'), or rho_g < max_corr (gate 'group'; a group whose rho_g is undefined,
               e.g. all correct, takes the batch's gate)
      S_g    = correct rows i of g with #{correct j in g : L_j < L_i} < top (the ``top`` shortest correct lengths,
               ties included), and with ``shorter_than_mean`` also L_i < mean_g L (the rows' group-mean length)
      z_i    = 1[i in S_g and on_g]
    """
    names = list(reward_names)
    if source not in names:
        raise ConfigError(f"regularizer icr: source '{source}' is not a reward column; rewards: "
                          f"{', '.join(names) or '(none)'}")
    r = rewards[:, names.index(source)].to(torch.float64)
    ok = torch.isfinite(r) if valid is None else (torch.isfinite(r) & valid.bool())
    c = ok & (r >= correct_threshold)
    L = lengths.to(torch.float64)
    rho_b, rho_g, defined = length_accuracy_corr(L, c, group_ids, ok)
    batch_on = rho_b < max_corr  # False when rho_B is NaN
    if gate == "group":
        on = torch.where(defined, rho_g < max_corr, torch.full_like(defined, batch_on))
    else:
        on = torch.full_like(ok, batch_on)
    inv, _ = group_index(group_ids)
    same = inv[:, None] == inv[None, :]
    shorter = c[None, :] & same & (L[None, :] < L[:, None])  # [i, j]: correct j of i's group is shorter than i
    target = c & (shorter.sum(-1) < top)
    if shorter_than_mean:
        mean_len, _, _ = group_stats(L, group_ids, ok)
        target &= L < mean_len
    return (target & on).to(torch.float32), rho_b


@register("field", "icr_target", source=SOURCE)
def icr_target(ctx: ModelContext, batch: RolloutBatch, *, source: str = "correct", correct_threshold: float = 1.0,
               top: Annotated[int, Ge(1)] = 1, gate: Literal["batch", "group"] = "batch",
               max_corr: Annotated[float, Ge(-1), Le(1)] = 0.0, shorter_than_mean: bool = True) -> torch.Tensor:
    """ICR's compression targets [N] (1 = one of its group's shortest correct completions, while the
    length-accuracy correlation says the policy overthinks); see :func:`icr_targets`. Reads the batch's reward
    matrix (after shaping, the ``accuracy`` metric's rule), lengths, groups and ``valid``; no model call."""
    if batch.rewards is None:
        raise ConfigError("regularizer icr: the batch has no reward matrix (icr needs a correctness column)")
    return icr_targets(batch.rewards, batch.reward_names, batch.lengths, batch.group_ids, batch.valid,
                       source=source, correct_threshold=correct_threshold, top=top, gate=gate, max_corr=max_corr,
                       shorter_than_mean=shorter_than_mean)[0]


@register("regularizer", "icr", source=SOURCE)
def icr(logp: torch.Tensor, icr_target: torch.Tensor) -> torch.Tensor:
    """ICR: pull the policy toward the shortest correct completions of each group while it overthinks.

    R_{i,t} = -z_i log pi_theta(o_{i,t} | q, o_{i,<t}), loss += coef * sum(w R) (w the aggregation's weights),
    z_i = ``icr_target`` (the field's producer, :func:`postrl.losses.icr.icr_targets`):
      c_i = 1[r_i^source >= correct_threshold]; rho_g = Pearson(length, c) within group g over its valid rows;
      rho_B = mean of the defined rho_g (logged every step as ``length/accuracy_corr``);
      on_g = rho_B < max_corr (gate 'batch', default) or rho_g < max_corr (gate 'group'; undefined rho_g: the
      batch's gate); S_g = the correct completions among the ``top`` shortest correct lengths of g (ties
      included) and shorter than the group's mean length (``shorter_than_mean``); z_i = 1[i in S_g and on_g].
    Reading of the paper: the "virtual shorter distribution" of group g is the policy restricted to S_g,
    q_g(y) = pi_theta(y | q) 1[y in S_g] / pi_theta(S_g | q); KL(q_g || pi_theta) = -log pi_theta(S_g | q), whose
    gradient -E_{y ~ q_g} grad log pi_theta(y | q) is estimated by the on-policy members of S_g: the likelihood
    (negative log-likelihood) term above on their tokens. Overthinking regime only: a negative length-accuracy
    correlation (shorter completions more often correct) switches it on; a positive one (underthinking) off.
    Shapes: logp [n, T], icr_target [n] -> [n, T]. Producer parameters (set in this entry) and defaults:
    ``source`` 'correct', ``correct_threshold`` 1.0, ``top`` 1, ``gate`` 'batch', ``max_corr`` 0.0,
    ``shorter_than_mean`` true; ``coef`` is the entry's (no value in the abstract; 0.1 is a reasonable start
    under token_mean). The targets are marked once per step on the training batch (under DDP, "batch" is this
    process's rows, whole groups).
    After ICR (arXiv 2605.07316): the abstract gives the signal (the shortest correct responses of each rollout
    group, the sign of the length-accuracy correlation) but no loss. Assumed: the KL-to-the-restricted-policy
    reading above (a likelihood term, not a reward), Pearson correlation within groups averaged over the groups
    where it is defined (between prompts, hard prompts are both longer and less often right), a hard gate at
    ``max_corr`` = 0, the single shortest correct completion per group (``top`` 1, ties kept), and the
    shorter-than-the-group-mean requirement (a target must compress).
    """
    return -icr_target.to(logp.dtype).unsqueeze(-1) * logp
