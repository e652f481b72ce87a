"""TraPO (kind ``filter``): unlabeled prompts train only when their learning trajectory follows the labeled ones'.

A stateful keep-mask filter: it keeps every labeled group and the unlabeled groups judged reliable, records the
pass rate of every group it judged (``observe``, every generated group, kept or not) and extends the prompts'
trajectories once per step (``end_step``, with every process's records, in rank order, so every process holds the
same trajectories and judges the same way).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Le

from postrl.errors import ConfigError
from postrl.groups import group_first_rows
from postrl.io import column_flag
from postrl.registry import register
from postrl.selection.filters import raw_column
from postrl.selection.selectors import prompt_key
from postrl.stages import StepEnd, Stateful

TRAPO = "TraPO: A Semi-Supervised Reinforcement Learning Framework for Boosting LLM Reasoning"


def zscore(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / (std + 1e-8) along the last dimension (unbiased std), TraPO's normalisation of a trajectory."""
    return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-8)


def trajectory_similarity(query: list[float], reference: list[list[float]], min_len: int,
                          aggregate: str = "mean") -> float:
    """Aggregate cosine similarity of the z-scored ``query`` trajectory with each ``reference`` trajectory.

    For each reference r: L = min(len(query), len(r)); when L >= ``min_len`` (and >= 2),
    s_r = cos(z(query[:L]), z(r[:L])) (``zscore``; a constant trajectory is the zero vector and scores 0, so the
    value is the Pearson correlation of the two first-L visits). Returns mean_r s_r (``aggregate='mean'``) or
    max_r s_r over the references long enough; NaN when none is."""
    sims = []
    q = torch.tensor(query, dtype=torch.float64)
    for r in reference:
        L = min(len(query), len(r))
        if L < max(min_len, 2):
            continue
        a, b = zscore(q[:L]), zscore(torch.tensor(r[:L], dtype=torch.float64))
        sims.append(float(torch.nn.functional.cosine_similarity(a, b, dim=0, eps=1e-8)))
    if not sims:
        return math.nan
    return sum(sims) / len(sims) if aggregate == "mean" else max(sims)


@register("filter", "trapo", source=TRAPO, needs=("groups",))
class TraPO(Stateful):
    """Keep labeled groups, and unlabeled groups whose pass-rate trajectory correlates with the labeled prompts'.

    TraPO ("identifies reliable unlabeled samples by matching their learning trajectory similarity to labeled
    ones"), after its released code (``_compute_trajectory_cosine``). Rows are labeled or not by the column
    ``labeled_column`` (default ``labeled``: true / false; ``postrl.io.column_flag``; missing = unlabeled). Each time
    a prompt q is generated its group's pass rate joins its trajectory tau_q (one value per visit, in order):
      labeled q:   p_q = mean over the group of the raw ``reward`` column (default ``correct``, the verifier)
      unlabeled q: p_q = mean of the raw ``pseudo_reward`` column (default ``majority_vote``: agreement with the
                   group's voted answer, TTRL's reward; with ``only_unlabeled: true`` it scores only these rows)
    (values clipped to [0, 1], finite entries of valid rows; a group with none records nothing). An unlabeled group
    of this step is judged on its trajectory including this visit, Q = tau_q + [p_q], against the reference set R:
    every labeled prompt's trajectory (this step's visit included when it is in the batch) and, with
    ``grow_reference`` (default true, the released script's ``update_db``), every unlabeled prompt selected
    before:
      s_q = mean_{r in R} cos(z(Q[:L]), z(r[:L])),  L = min(|Q|, |r|),  over the r with L >= warmup_visits + 1
    (``trajectory_similarity``: z = per-trajectory z-score, so s is the mean Pearson correlation of the first L
    visits; ``aggregate: max`` takes the max). Kept: the unlabeled groups with s_q >= ``threshold`` (0.4), together
    with the top ``top_ratio`` (0.1) of the step's scored unlabeled groups by s (at least one when any is scored;
    ``top_ratio: 0`` none), as the released code's union of its threshold and top-k sets. An unlabeled prompt
    visited fewer than ``warmup_visits`` + 1 times (default 8: the released script's ``warm_up`` epochs, labeled
    data only) or without a reference long enough is dropped. Labeled groups are always kept.

    The rewards decide what trains: e.g. ``rewards: [correct, {name: majority_vote, only_unlabeled: true}]`` with
    unlabeled rows that carry no ``answer`` (the verifier gives them None), so labeled rows are paid by the
    verifier and unlabeled ones by the vote. Dropped groups are refilled like ``dynamic_sampling``'s (the entry's
    ``max_attempts``; 1: masked out instead).
    Assumed where the paper is silent: trajectories aligned by visit number (the paper by epoch, which is the same
    when every prompt is seen once per epoch), pairwise prefix alignment instead of truncating every trajectory to
    the shortest, and majority_vote's tie rule (the first answer seen) instead of "no majority". Metrics:
    ``filter/trapo/labeled``, ``unlabeled`` (prompts tracked), ``reference``, ``judged``, ``selected`` (unlabeled
    groups of the step). State: the trajectories and the reference set (checkpointed).
    """

    _state = ("trajectories", "labeled", "reliable")

    def __init__(self, *, reward: str = "correct", pseudo_reward: str = "majority_vote",
                 labeled_column: str = "labeled", warmup_visits: Annotated[int, Ge(1)] = 8,
                 threshold: Annotated[float, Ge(-1), Le(1)] = 0.4, top_ratio: Annotated[float, Ge(0), Le(1)] = 0.1,
                 aggregate: Literal["mean", "max"] = "mean", grow_reference: bool = True):
        self.reward, self.pseudo_reward, self.labeled_column = reward, pseudo_reward, labeled_column
        self.warmup_visits, self.threshold, self.top_ratio = warmup_visits, threshold, top_ratio
        self.aggregate, self.grow_reference = aggregate, grow_reference
        self.trajectories: dict[str, list[float]] = {}
        self.labeled: dict[str, bool] = {}
        self.reliable: dict[str, bool] = {}  # unlabeled prompts selected once (the reference, with grow_reference)

    # ------------------------------------------------------------------------------------------------ judging
    def judge(self, rewards, reward_names, group_ids, prompts, columns, valid=None, raw_rewards=None,
              raw_reward_names=None) -> tuple[list[dict], torch.Tensor]:
        """(one record per group: key, labeled, pass rate or None, score, kept; group number of each row)."""
        cols = columns or {}
        if self.labeled_column not in cols:
            raise ConfigError(f"filters.trapo: the rows have no '{self.labeled_column}' column; mark each row "
                              f"labeled (true) or not (false), or set labeled_column")
        first, inv = group_first_rows(group_ids)
        lab = [column_flag(cols[self.labeled_column][int(i)], f"filters.trapo: row {int(i)} column "
                                                                f"'{self.labeled_column}'") for i in first]
        ok = torch.ones(len(group_ids), dtype=torch.bool) if valid is None else valid.bool()
        rates = {}
        needed = ([self.reward] if any(lab) else []) + ([self.pseudo_reward] if not all(lab) else [])
        for name in dict.fromkeys(needed):
            x = raw_column(rewards, reward_names, name, "filters.trapo", raw_rewards, raw_reward_names)
            good = ok & torch.isfinite(x)
            s = torch.zeros(len(first), dtype=torch.float64).index_add_(0, inv, torch.where(
                good, x.double().clamp(0, 1), torch.zeros_like(x, dtype=torch.float64)))
            n = torch.zeros(len(first), dtype=torch.float64).index_add_(0, inv, good.double())
            rates[name] = [float(s[g] / n[g]) if n[g] > 0 else None for g in range(len(first))]
        recs = [{"key": prompt_key(prompts[int(i)]), "labeled": lab[g],
                 "rate": rates[self.reward if lab[g] else self.pseudo_reward][g], "score": math.nan, "kept": lab[g]}
                for g, i in enumerate(first)]
        current = {r["key"]: r["rate"] for r in recs if r["labeled"] and r["rate"] is not None}
        refs = [self.trajectories[k] + ([current[k]] if k in current else []) for k, is_lab in self.labeled.items()
                if is_lab and k in self.trajectories]
        if self.grow_reference:
            refs += [self.trajectories[k] for k in self.reliable if k in self.trajectories]
        scored = []
        for g, r in enumerate(recs):
            if r["labeled"] or r["rate"] is None:
                continue
            q = self.trajectories.get(r["key"], []) + [r["rate"]]
            if len(q) < self.warmup_visits + 1:
                continue
            r["score"] = trajectory_similarity(q, refs, self.warmup_visits + 1, self.aggregate)
            if math.isfinite(r["score"]):
                scored.append(g)
        if scored:
            k = max(1, int(len(scored) * self.top_ratio)) if self.top_ratio > 0 else 0
            order = sorted(scored, key=lambda g: -recs[g]["score"])  # stable: ties keep batch order
            for g in scored:
                recs[g]["kept"] = recs[g]["score"] >= self.threshold
            for g in order[:k]:
                recs[g]["kept"] = True
        return recs, inv

    def __call__(self, rewards, reward_names, group_ids, prompts, columns, valid=None, raw_rewards=None,
                 raw_reward_names=None) -> torch.Tensor:
        recs, inv = self.judge(rewards, reward_names, group_ids, prompts, columns, valid, raw_rewards,
                               raw_reward_names)
        return torch.tensor([r["kept"] for r in recs], dtype=torch.bool)[inv]

    # ------------------------------------------------------------------------------------------------ state
    def observe(self, rewards, reward_names, group_ids, prompts, columns, valid=None, raw_rewards=None,
                raw_reward_names=None) -> None:
        """Record (key, labeled, pass rate, selected) of every group judged (kept or not)."""
        recs, _ = self.judge(rewards, reward_names, group_ids, prompts, columns, valid, raw_rewards,
                             raw_reward_names)
        for r in recs:
            self.record((r["key"], r["labeled"], r["rate"], (not r["labeled"]) and r["kept"]))

    def end_step(self, step: StepEnd) -> dict:
        judged = selected = 0
        for key, is_lab, rate, sel in self.observed:
            if rate is not None:
                self.trajectories.setdefault(key, []).append(float(rate))
                self.labeled[key] = bool(is_lab)
            if not is_lab:
                judged += 1
                selected += bool(sel)
                if sel:
                    self.reliable[key] = True
        n_lab = sum(self.labeled.values())
        return {"labeled": float(n_lab), "unlabeled": float(len(self.labeled) - n_lab),
                "reference": float(n_lab + (len(self.reliable) if self.grow_reference else 0)),
                "judged": float(judged), "selected": float(selected)}
