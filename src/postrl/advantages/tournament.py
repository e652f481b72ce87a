"""ArenaRL's tournament ranking as an advantage estimator."""

from __future__ import annotations

import math
from typing import Annotated, Callable

import torch
from annotated_types import Ge

from postrl.errors import ConfigError
from postrl.groups import group_index, valid_mask
from postrl.advantages import Eps, grpo
from postrl.io import load_object
from postrl.registry import register


def bracket_order(size: int) -> list[int]:
    """Standard seeded bracket of ``size`` (a power of two) slots: the seed (0-based) in each slot, so that seed 0
    meets seed size-1 first and the two best seeds can only meet in the final: 4 -> [0, 3, 1, 2]."""
    order = [0]
    while len(order) < size:
        m = 2 * len(order)
        order = [x for s in order for x in (s, m - 1 - s)]
    return order


BUILTIN_JUDGES = ("reward", "rubric")


def _load_judge(judge: str) -> Callable:
    return load_object(judge, "advantage.judge")


def rubric_matrix(rewards: torch.Tensor, reward_names: list, rubric: list[str] | None) -> torch.Tensor:
    """The rubric's levels [N, L] (float64): the reward columns named in ``rubric``, in order (all when None); a
    NaN entry (a failed source) ranks below every value."""
    names = list(reward_names)
    levels = names if rubric is None else list(rubric)
    missing = [c for c in levels if c not in names]
    if missing or not levels:
        raise ConfigError(f"advantage.rubric: expected reward columns of this run, got {missing or levels}; "
                          f"columns: {', '.join(names) or '(none)'}")
    X = rewards[:, [names.index(c) for c in levels]].to(torch.float64)
    return torch.nan_to_num(X, nan=-math.inf)


def rubric_judge(X: torch.Tensor, ia: torch.Tensor, ib: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """P(first wins) of each match (ia[m] vs ib[m]) under a multi-level rubric: the first level (column of ``X``)
    on which the two differ by more than ``margin`` decides (1.0 or 0.0); 0.5 when no level does."""
    d = X[ia] - X[ib]
    same_inf = torch.isinf(X[ia]) & torch.isinf(X[ib]) & (X[ia] == X[ib])
    d = torch.where(same_inf, torch.zeros_like(d), d)
    decisive = d.abs() > margin
    has = decisive.any(-1)
    first = torch.argmax(decisive.to(torch.int8), dim=-1)
    dd = d.gather(1, first[:, None])[:, 0]
    return torch.where(has, torch.where(dd > 0, 1.0, 0.0), torch.full_like(dd, 0.5)).to(torch.float64)


def _rubric_with_judge(params: dict, run, where: str) -> dict:
    """``rank_tournament``: ``rubric`` only with ``judge: rubric``."""
    if params.get("rubric") is not None and params.get("judge") != "rubric":
        raise ConfigError(f"{where}.rubric: only used with judge: rubric, got judge={params.get('judge')!r}")
    return params


@register("advantage", "rank_tournament", source="ArenaRL: Scaling RL for Open-Ended Agents via Tournament-based "
          "Relative Ranking", needs=("groups",), check=_rubric_with_judge)
def rank_tournament(reward: torch.Tensor, group_ids: torch.Tensor, prompts: list, completions: list,
                    valid: torch.Tensor | None = None, rewards: torch.Tensor | None = None,
                    reward_names: list | None = None, *, judge: str | None = None, rubric: list[str] | None = None,
                    margin: Annotated[float, Ge(0)] = 0.0, seed: int = 0, eps: Eps = 1e-6) -> torch.Tensor:
    """Seeded single-elimination tournament inside each group; the round reached is ranked, then GRPO-normalised.

    "ArenaRL: Scaling RL for Open-Ended Agents via Tournament-based Relative Ranking": pairwise comparisons in a
    seeded single-elimination bracket (n - 1 judge calls per group) replace pointwise scores. Seeding: by the
    pointwise ``reward`` (ties broken by a permutation drawn from ``seed``), placed in the standard bracket (best
    seed meets worst; byes, for groups that are not a power of two, go to the best seeds). Each match gives
    P(first wins); P > 0.5: first wins, P = 0.5: the better seed. Judges (``judge``):

    * ``None`` / ``'reward'`` (default): the higher scalar reward wins;
    * ``'rubric'``: a multi-level rubric over the run's named reward columns (ArenaRL's "process-aware pairwise
      evaluation ... multi-level rubrics", read as a verifier-based comparison): ``rubric`` lists the reward
      columns from the most to the least important (default: every column, in the run's order); the first level
      on which the two completions differ by more than ``margin`` (default 0) decides the match, so a lower level
      (format, length, a process reward such as a PRM's step-score sum) only breaks ties of the higher ones
      (correctness first), whatever the columns' weights; a failed (NaN) entry loses its level;
    * an import path 'module:function': ``judge(prompts, first, second) -> list[P(first wins)]`` (an LLM judge, a
      reward model prompted pairwise ...), called once per round with every match of every group.

    The built-in judges cannot tell completions with identical judged values apart (equal rewards; equal rubric
    vectors), so those share the mean of their scores (all-equal gives 0). Score u_i = number of rounds
    survived (champion = log2(bracket size)); completions eliminated in the same round tie.
    A_i = (u_i - mean_g u) / (std_g u + eps) (unbiased std). Assumed (the abstract leaves it open): ranks map to
    advantages through this round count and group z-score; the rubric's lexicographic order. Invalid rows do not
    play and get 0.
    Shapes: reward [N], group_ids [N], prompts / completions [N] lists, valid [N], rewards [N, K],
    reward_names [K] -> [N].
    """
    v = valid_mask(reward, valid)
    builtin = judge is None or judge in BUILTIN_JUDGES
    judge_fn = None if builtin else _load_judge(judge)
    N = len(reward)
    if N == 0:
        return torch.zeros(0)
    X = None
    if judge == "rubric":
        if rewards is None or reward_names is None:
            raise ConfigError("advantage.judge 'rubric' needs the batch's reward matrix (rewards, reward_names)")
        X = rubric_matrix(rewards, reward_names, rubric)
    elif rubric is not None:
        raise ConfigError("advantage.rubric: only used with judge: rubric")
    inv, ng = group_index(group_ids)
    # seed rank within each group: by reward (desc), ties by a seeded random permutation; invalid rows last
    gen = torch.Generator().manual_seed(int(seed))
    tie = torch.randperm(N, generator=gen)
    r = torch.where(v, reward.to(torch.float64), torch.full((N,), -math.inf, dtype=torch.float64))
    order = torch.argsort(tie)  # random base order, then stable sorts: reward desc, group
    order = order[torch.sort(-r[order], stable=True).indices]
    order = order[torch.sort(inv[order], stable=True).indices]
    size = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, torch.ones_like(inv))
    start = torch.cumsum(size, 0) - size
    rank = torch.empty(N, dtype=torch.long)
    rank[order] = torch.arange(N) - start[inv[order]]
    n_valid = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, v.long())
    S = 1 << max(0, math.ceil(math.log2(max(int(n_valid.max()), 1))))
    slot_of_seed = torch.empty(S, dtype=torch.long)
    slot_of_seed[torch.tensor(bracket_order(S))] = torch.arange(S)
    slots = torch.full((ng, S), -1, dtype=torch.long)
    rows = torch.nonzero(v).flatten()
    slots[inv[rows], slot_of_seed[rank[rows]]] = rows
    survived = torch.zeros(N, dtype=torch.float64)
    cur = slots
    while cur.shape[1] > 1:
        a, b = cur[:, 0::2], cur[:, 1::2]
        both = (a >= 0) & (b >= 0)
        a_wins = b < 0  # a bye (or two) advances the other side
        if both.any():
            ia, ib = a[both], b[both]
            if X is not None:
                p = rubric_judge(X, ia, ib, margin)
            elif judge_fn is None:
                p = torch.where(reward[ia] > reward[ib], 1.0, torch.where(reward[ia] < reward[ib], 0.0, 0.5))
            else:
                out = judge_fn([prompts[i] for i in ia.tolist()], [completions[i] for i in ia.tolist()],
                               [completions[i] for i in ib.tolist()])
                p = torch.as_tensor([float(x) for x in out], dtype=torch.float64)
                if p.numel() != ia.numel():
                    raise ValueError(f"advantage.judge returned {p.numel()} values for {ia.numel()} matches")
            win = (p > 0.5) | ((p == 0.5) & (rank[ia] < rank[ib]))
            a_wins = a_wins.clone()
            a_wins[both] = win
        winner = torch.where(a_wins, a, b)
        adv_rows = winner[winner >= 0]
        survived[adv_rows] += 1
        cur = winner
    if judge_fn is None:  # a built-in judge cannot tell equal judged values apart: they share their mean score
        judged = X if X is not None else reward.to(torch.float64)[:, None]
        key = torch.cat([inv.to(torch.float64)[:, None],
                         torch.where(v[:, None], judged, torch.zeros_like(judged))], 1)
        _, tie = torch.unique(key, dim=0, return_inverse=True)
        nt = int(tie.max()) + 1
        tot = torch.zeros(nt, dtype=torch.float64).index_add_(0, tie, survived)
        cnt = torch.zeros(nt, dtype=torch.float64).index_add_(0, tie, torch.ones(N, dtype=torch.float64))
        survived = (tot / cnt)[tie]
    return grpo(survived, group_ids, v, eps=eps)
