"""Evaluation of reward models, and the aggregation of an ensemble's K scores.

* pairwise accuracy: mean_i [r(c_i) > r(r_i)] (a tie counts 1/2) -- RewardBench-style.
* one-correct-versus-many-wrong accuracy (RewardMATH, "Evaluating Robustness of Reward Models for Mathematical
  Reasoning"): a prompt counts as solved when r(correct) > max_j r(wrong_j) (strictly; a tie fails).
* preference ECE: P(c > r) = sigmoid(beta (r(c) - r(r))) (beta = 1 by default), symmetrised: both orderings are
  scored, (p, 1) and (1 - p, 0), and :func:`postrl.calibration.ece` is taken over the 2N predictions.
* STARC-style distance between reward functions r1, r2 on the same (prompt, completion) set (after "STARC: A
  General Framework For Quantifying Differences Between Reward Functions"): canonicalise c(r) = r - mean of r over
  the completions of the same prompt (removes per-prompt shifts, the bandit analogue of potential shaping);
  normalise n(r) = c(r) / ||c(r)||_2 over all entries (0 stays 0); distance = ||n(r1) - n(r2)||_2 in [0, 2]
  (0: same preferences up to per-prompt shift and positive scale; 2: opposite). Assumed: the L2 norm for both the
  normalisation and the metric, and the per-prompt mean as the canonicalisation (uniform distribution over the
  completions at hand).
* teacher variance ("What Makes a Reward Model a Good Teacher? An Optimization Perspective": however accurate, a
  reward model that induces low reward variance under the policy makes the RLHF objective flat): on completions
  sampled from the policy, several per prompt, ``teacher/variance`` = mean over prompts of the unbiased
  within-prompt variance of r (prompts with at least 2 completions), and ``teacher/variance_share`` = within-prompt
  sum of squares / total sum of squares around the overall mean, in [0, 1] (the part of the reward's variance that
  tells the completions of a prompt apart, the only part a group baseline can learn from). The same quantity is
  watched during training by the ``teacher_variance`` alarm (``reward/group_std``).
* ensemble aggregation (for the ``model`` reward source's ``aggregate``; "Reward Model Ensembles Help Mitigate
  Overoptimization"): mean; worst-case (WCO) min_k r_k; uncertainty-weighted (UWO) mean_k r_k - lambda Var_k r_k
  (population variance over the K members; lambda default ``UWO_LAMBDA`` = 0.5, the one default of every UWO in
  postrl: this function, the ``model`` reward source's ``uwo_lambda`` and the ``ensemble_uwo`` shaping stage).
"""

from __future__ import annotations

from typing import Sequence

import torch

from postrl.calibration import ece
from postrl.errors import ConfigError

__all__ = ["pairwise_accuracy", "best_of_many_accuracy", "preference_ece", "starc_distance", "aggregate_ensemble",
           "canonicalise", "teacher_variance", "UWO_LAMBDA"]

# The UWO penalty's default, shared by every UWO aggregation (aggregate_ensemble, rewards.model's uwo_lambda,
# shaping's ensemble_uwo). The paper tunes lambda per setting and reports UWO robust to it; 0.5 is postrl's choice.
UWO_LAMBDA = 0.5


def pairwise_accuracy(r_chosen, r_rejected) -> float:
    """mean of [r_c > r_r] + 0.5 [r_c == r_r]."""
    c, r = torch.as_tensor(r_chosen, dtype=torch.float64), torch.as_tensor(r_rejected, dtype=torch.float64)
    return float(((c > r).double() + 0.5 * (c == r).double()).mean())


def best_of_many_accuracy(r_correct, r_wrong: Sequence[Sequence[float]]) -> float:
    """Fraction of prompts whose correct completion scores strictly above every wrong one."""
    c = torch.as_tensor(r_correct, dtype=torch.float64)
    wins = [float(ci > max(w)) for ci, w in zip(c.tolist(), r_wrong)]
    return sum(wins) / len(wins) if wins else float("nan")


def preference_ece(r_chosen, r_rejected, beta: float = 1.0, n_bins: int = 10) -> float:
    """ECE of sigmoid(beta (r_c - r_r)), symmetrised over both orderings."""
    d = beta * (torch.as_tensor(r_chosen, dtype=torch.float64) - torch.as_tensor(r_rejected, dtype=torch.float64))
    p = torch.sigmoid(d)
    return ece(torch.cat([p, 1 - p]).numpy(), torch.cat([torch.ones_like(p), torch.zeros_like(p)]).numpy(), n_bins)


def canonicalise(r, groups: Sequence) -> torch.Tensor:
    """r minus the mean of r over the entries of the same group (prompt)."""
    r = torch.as_tensor(r, dtype=torch.float64)
    ids: dict = {}
    gid = torch.as_tensor([ids.setdefault(g, len(ids)) for g in groups], dtype=torch.long)
    sums = torch.zeros(int(gid.max()) + 1, dtype=torch.float64).index_add_(0, gid, r)
    cnt = torch.zeros_like(sums).index_add_(0, gid, torch.ones_like(r))
    return r - (sums / cnt)[gid]


def starc_distance(r1, r2, groups: Sequence) -> float:
    """STARC-style distance (module docstring) between two reward vectors over the same entries."""
    def norm(r):
        c = canonicalise(r, groups)
        n = c.norm()
        return c / n if n > 0 else c

    return float((norm(r1) - norm(r2)).norm())


def teacher_variance(r, groups: Sequence) -> dict[str, float]:
    """{'teacher/variance', 'teacher/variance_share', 'teacher/prompts'} of rewards r [n] of completions grouped by
    prompt (module docstring); prompts with one completion are left out. NaN when no prompt has two."""
    r = torch.as_tensor(r, dtype=torch.float64)
    ids: dict = {}
    gid = torch.as_tensor([ids.setdefault(g, len(ids)) for g in groups], dtype=torch.long)
    ng = len(ids)
    cnt = torch.zeros(ng, dtype=torch.float64).index_add_(0, gid, torch.ones_like(r))
    keep = (cnt >= 2)[gid]
    if not bool(keep.any()):
        return {"teacher/variance": float("nan"), "teacher/variance_share": float("nan"), "teacher/prompts": 0}
    dev = canonicalise(r, groups)
    ss = torch.zeros(ng, dtype=torch.float64).index_add_(0, gid, torch.where(keep, dev * dev, 0.0))
    has = cnt >= 2
    var = ss[has] / (cnt[has] - 1)
    rk = r[keep]
    total = float(((rk - rk.mean()) ** 2).sum())
    share = float(ss.sum()) / total if total > 0 else float("nan")
    return {"teacher/variance": float(var.mean()), "teacher/variance_share": share, "teacher/prompts": int(has.sum())}


def aggregate_ensemble(scores: torch.Tensor, how: str = "mean", uwo_lambda: float = UWO_LAMBDA) -> torch.Tensor:
    """[N, K] -> [N]: mean, min (WCO) or uwo = mean - lambda * population variance (lambda default UWO_LAMBDA)."""
    if how == "mean":
        return scores.mean(-1)
    if how == "min":
        return scores.min(-1).values
    if how == "uwo":
        return scores.mean(-1) - uwo_lambda * scores.var(-1, unbiased=False)

    raise ConfigError(f"ensemble aggregate '{how}': valid: mean, min, uwo")
