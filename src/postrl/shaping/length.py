"""Length control: reward terms and transforms that depend on the completion length L (tokens, ``lengths``).

Stages that *add* a term append a named column to the reward matrix (``name``, default the stage name; weight
``weight``, default 1.0), so every completion keeps its vector of named rewards and the weighted sum adds the
term. Stages that *replace* a reward (cosine_length, truncation_penalty) rewrite their ``source`` column.
Correctness is read from the column ``source`` (default 'correct'): correct = r >= ``correct_threshold``
(default 1.0, the trainer's accuracy rule). A completion whose correctness failed (NaN) gets NaN.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from annotated_types import Ge, Gt, Interval, Le

from postrl.errors import ConfigError
from postrl.registry import register
from postrl.groups import group_index, group_minmax, group_stats
from postrl.shaping._util import NAN, append_column, col, cols, correctness, with_column
from postrl.stages import StepEnd, Stateful, parameters


def _nan_where(x: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.float32)
    return torch.where(known, x, torch.full_like(x, NAN))


_OVERLONG_BUFFER_FRACTION = 4096 / 20480  # DAPO: buffer Lc = 4096 of Lmax = 20480 (a fifth)


def _overlong_lengths(params: dict, run: Any, where: str) -> dict:
    """``overlong_soft``'s lengths against the run (checked when the config is read).

    DAPO's Lmax is the maximum response length, so in a config ``max_length`` defaults to
    ``rollout.max_new_tokens`` and ``buffer`` to a fifth of ``max_length`` (DAPO: 4096 of 20480), at least 1.
    The punishment starts above ``max_length - buffer`` tokens; a stage that starts at or beyond
    ``max_new_tokens`` can never apply and is an error, as is a buffer outside [1, max_length]. Outside a config
    (``run`` None) the stage's own defaults apply and only ``buffer`` <= ``max_length`` is checked.
    """
    if run is None:
        p = {**{k: d for k, (_, d) in parameters(overlong_soft).items()}, **params}
        max_length, buffer = p["max_length"], p["buffer"]
        if buffer > max_length:
            raise ConfigError(f"{where}.buffer: expected an integer in [1, max_length = {max_length}], got {buffer!r}")
        return params
    max_new_tokens = run.rollout.max_new_tokens
    max_length = params.get("max_length", max_new_tokens)
    buffer = params.get("buffer", max(1, round(max_length * _OVERLONG_BUFFER_FRACTION)))
    if not 1 <= buffer <= max_length:
        raise ConfigError(f"{where}.buffer: expected an integer in [1, max_length = {max_length}], got {buffer!r}")
    if max_length - buffer >= max_new_tokens:
        raise ConfigError(f"{where}: overlong_soft never applies: it punishes completions longer than max_length - "
                          f"buffer = {max_length - buffer} tokens and rollout.max_new_tokens is {max_new_tokens} "
                          f"(leave out {where}.max_length and {where}.buffer to derive them from max_new_tokens)")
    return {**params, "max_length": max_length, "buffer": buffer}


@register("shaping", "overlong_soft", source="DAPO soft overlong punishment; verl reward_model.overlong_buffer",
          check=_overlong_lengths)
def overlong_soft(rewards, reward_names, reward_weights, lengths, *, max_length: Annotated[int, Ge(1)] = 20480,
                  buffer: Annotated[int, Ge(1)] = 4096, penalty: float = 1.0, name: str = "overlong_soft",
                  weight: float = 1.0):
    """DAPO soft overlong punishment, appended as a column:

        R(L) = 0                                   if L <= Lmax - Lc
        R(L) = (Lmax - Lc - L) / Lc * penalty      if Lmax - Lc < L <= Lmax
        R(L) = -penalty                            if L > Lmax

    Lmax = ``max_length`` (DAPO: 20480), Lc = ``buffer`` (DAPO: 4096), penalty 1.0. Anchor: verl
    ``reward_model.overlong_buffer.{enable: true, len: Lc, penalty_factor: penalty}`` with
    ``data.max_response_length = Lmax`` (identical for L <= Lmax; verl never sees L > Lmax). In a config,
    ``max_length`` defaults to ``rollout.max_new_tokens`` and ``buffer`` to a fifth of it (a stage that could never
    apply is an error); ``buffer`` <= ``max_length``.
    """
    L = lengths.to(torch.float64)
    start = max_length - buffer
    r = torch.where(L <= start, torch.zeros_like(L), (start - L) / buffer * penalty)
    r = torch.where(L > max_length, torch.full_like(L, -penalty), r)
    return append_column(rewards, reward_names, reward_weights, r, name, weight, "overlong_soft")


@register("shaping", "truncation_penalty", source="DLER: Doing Length pEnalty Right")
def truncation_penalty(rewards, reward_names, lengths, truncated, *, max_length: int | None = None,
                       sources: list[str] | None = None, include_truncated: bool = True):
    """DLER truncation penalty: r' = 0 for a completion longer than the cap, r' = r otherwise.

    Over the cap: L > ``max_length`` (when set) or, with ``include_truncated`` (default), the completion hit the
    generation limit without finishing. ``sources``: the columns zeroed (default all). A failed entry stays NaN.
    DLER pairs this with batch-wise reward normalisation (``advantage.scale: batch``), clip-higher (loss
    ``eps_high``) and dynamic sampling (``filters: [{name: dynamic_sampling}]``); those are separate stages.
    """
    over = truncated.bool() if include_truncated else torch.zeros_like(truncated, dtype=torch.bool)
    if max_length is not None:
        over = over | (lengths > max_length)
    out = rewards.clone()
    for k in cols(reward_names, sources, "truncation_penalty"):
        r = out[:, k]
        out[:, k] = torch.where(over & torch.isfinite(r), torch.zeros_like(r), r)
    return {"rewards": out}


def _difficulty_lengths(params: dict, run: Any, where: str) -> dict:
    """``difficulty_truncation``'s base cap against the run: ``max_length`` defaults to ``rollout.max_new_tokens``;
    ``min_length`` must not exceed it."""
    if run is not None and params.get("max_length") is None:
        params = {**params, "max_length": run.rollout.max_new_tokens}
    ml, lo = params.get("max_length"), params.get("min_length", 1)
    if ml is not None and lo > ml:
        raise ConfigError(f"{where}: expected min_length <= max_length, got min_length={lo}, max_length={ml}")
    return params


@register("shaping", "difficulty_truncation", source="DLER: Doing Length pEnalty Right (Difficulty-Aware DLER)",
          needs=("groups",), check=_difficulty_lengths)
def difficulty_truncation(rewards, reward_names, lengths, truncated, group_ids, *, max_length: Annotated[int, Ge(1)]
                          | None = None, tighten: Annotated[float, Interval(ge=0, lt=1)] = 0.5,
                          min_length: Annotated[int, Ge(1)] = 1, source: str = "correct",
                          correct_threshold: float = 1.0, sources: list[str] | None = None,
                          include_truncated: bool = True):
    """Difficulty-aware DLER truncation: each prompt's length cap tightens with its group's accuracy; r' = 0 over it.

    After "DLER: Doing Length pEnalty Right" ("Difficulty-Aware DLER, which adaptively tightens truncation on
    easier questions"; the abstract gives no formula). The group's accuracy is the difficulty signal:
        acc_g = mean_{j in g} 1[r_j^source >= correct_threshold]     (finite entries of the ``source`` column)
        L_g   = max(min_length, floor(max_length * (1 - tighten * acc_g)))
        r'_i  = 0 on the ``sources`` columns (default all) if L_i > L_g(i) or (``include_truncated`` and the
                completion hit the generation limit), else r_i
    so an all-correct (easy) prompt is cut at (1 - tighten) * max_length and an all-wrong one at max_length, the
    plain ``truncation_penalty``. Assumed: the linear map from accuracy to cap and defaults tighten 0.5,
    min_length 1; ``max_length`` defaults to ``rollout.max_new_tokens`` in a config (required when called
    directly). Accuracy is read before truncation (a long correct answer still marks its prompt easy); a failed
    entry stays NaN; a group without a finite ``source`` value keeps the full cap. Combine as the DLER recipe:
    ``advantage.scale: batch``, clip-higher, ``dynamic_sampling``. Adds ``truncation_cap`` [N] to the batch.
    Shapes: rewards [N, K], lengths [N], truncated [N], group_ids [N] -> {rewards, truncation_cap}.
    """
    if max_length is None:
        raise ConfigError("shaping.difficulty_truncation.max_length: required outside a config (a config derives "
                          "it from rollout.max_new_tokens)")
    c, known = correctness(rewards, reward_names, source, correct_threshold, "difficulty_truncation")
    inv, ng = group_index(group_ids)
    hits = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, c.to(torch.float64))
    n = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, known.to(torch.float64))
    acc = torch.where(n > 0, hits / n.clamp(min=1.0), torch.zeros_like(n))
    cap = torch.floor(max_length * (1.0 - tighten * acc)).clamp(min=min_length)[inv]
    over = lengths.to(torch.float64) > cap
    if include_truncated:
        over = over | truncated.bool()
    out = rewards.clone()
    for k in cols(reward_names, sources, "difficulty_truncation"):
        r = out[:, k]
        out[:, k] = torch.where(over & torch.isfinite(r), torch.zeros_like(r), r)
    return {"rewards": out, "truncation_cap": cap.to(torch.float32)}


_LASER = "Learn to Reason Efficiently with Adaptive Length-based Reward Shaping"


@register("shaping", "laser", source=_LASER + " (LASER)")
def laser(rewards, reward_names, reward_weights, lengths, *, target_length: int = 4096, alpha: float = 0.5,
          source: str = "correct", correct_threshold: float = 1.0, name: str = "laser", weight: float = 1.0):
    """LASER step reward, appended as a column: S_i = alpha * 1[correct_i] * 1[L_i <= L_T].

    The total C(y) + S(y) pays a bonus for being correct AND within the target length L_T (``target_length``).
    Defaults: target_length=4096, alpha=0.5.
    """
    c, known = correctness(rewards, reward_names, source, correct_threshold, "laser")
    s = alpha * (c & (lengths <= target_length)).to(torch.float32)
    return append_column(rewards, reward_names, reward_weights, _nan_where(s, known), name, weight, "laser")


def _difficulty(c: torch.Tensor, known: torch.Tensor, group_ids: torch.Tensor, cuts: tuple[float, float]):
    """Per row: 0 easy (group accuracy >= cuts[1]), 1 medium, 2 hard (< cuts[0])."""
    inv, ng = group_index(group_ids)
    s = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, (c & known).to(torch.float64))
    n = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, known.to(torch.float64))
    acc = (s / n.clamp(min=1))[inv]
    return torch.where(acc >= cuts[1], 0, torch.where(acc >= cuts[0], 1, 2))


@register("shaping", "laser_d", source=_LASER + " (LASER-D: dynamic and difficulty-aware)")
class LaserD(Stateful):
    """LASER-D: the LASER bonus with a target length per difficulty level, adapted during training.

    S_i = alpha * 1[correct_i] * 1[L_i <= L_A(d_i)]. Difficulty d_i from the group's accuracy: easy (>= 2/3),
    medium, hard (< 1/3) (``difficulty_cuts``). Every ``update_every`` steps, each level's target becomes the
    smallest length L such that the expected-correct-response ratio ExCR(L) = P(correct and length <= L) over the
    level's completions seen since the last update reaches ``coverage`` (default 0.3); a level whose accuracy
    stays below ``coverage`` gets ``max_length`` (no pressure on hard questions). Before the first update every
    level uses ``initial_target`` (default = max_length). After LASER-D: the paper computes ExCR on a monitoring
    set at fixed intervals; here the training batches since the last update play that role (assumption).
    Defaults: alpha=0.5, max_length=4096, update_every=10, coverage=0.3. State (targets, collected statistics,
    call count) is saved with the checkpoint.
    """

    _state = ("targets", "seen", "calls")

    def __init__(self, *, alpha: float = 0.5, max_length: int = 4096, initial_target: int | None = None,
                 update_every: Annotated[int, Ge(1)] = 10, coverage: Annotated[float, Gt(0), Le(1)] = 0.3, difficulty_cuts: tuple[float, float] = (1 / 3, 2 / 3),
                 source: str = "correct", correct_threshold: float = 1.0, name: str = "laser_d",
                 weight: float = 1.0):
        self.alpha, self.max_length, self.update_every, self.coverage = alpha, max_length, update_every, coverage
        self.cuts = tuple(difficulty_cuts)
        self.source, self.thr, self.name, self.weight = source, correct_threshold, name, weight
        t0 = int(initial_target if initial_target is not None else max_length)
        self.targets: list[int] = [t0, t0, t0]
        self.seen: list[list[list[float]]] = [[], [], []]  # per level: [length, correct] pairs
        self.calls = 0  # steps seen

    def _update(self) -> None:
        for d in range(3):
            pairs = self.seen[d]
            if not pairs:
                continue
            n = len(pairs)
            ok = sorted(L for L, c in pairs if c)
            need = math.ceil(self.coverage * n - 1e-9)
            self.targets[d] = int(ok[need - 1]) if len(ok) >= need and need >= 1 else int(self.max_length)
        self.seen = [[], [], []]

    def __call__(self, rewards, reward_names, reward_weights, group_ids, lengths):
        c, known = correctness(rewards, reward_names, self.source, self.thr, "laser_d")
        d = _difficulty(c, known, group_ids, self.cuts)
        target = torch.tensor(self.targets, dtype=lengths.dtype)[d]
        s = self.alpha * (c & (lengths <= target)).to(torch.float32)
        out = append_column(rewards, reward_names, reward_weights, _nan_where(s, known), self.name, self.weight,
                            "laser_d")
        return out

    def observe(self, rewards, reward_names, group_ids, lengths) -> None:
        c, known = correctness(rewards, reward_names, self.source, self.thr, "laser_d")
        d = _difficulty(c, known, group_ids, self.cuts)
        for lvl in range(3):
            sel = known & (d == lvl)
            self.record((lvl, [[float(L), float(x)] for L, x in zip(lengths[sel].tolist(), c[sel].tolist())]))

    def end_step(self, step: StepEnd) -> dict:
        for lvl, pairs in self.observed:  # every process's pairs of this step
            self.seen[lvl].extend(pairs)
        self.calls += 1
        if self.calls % self.update_every == 0:
            self._update()
        return {f"target_{level}": float(t) for level, t in zip(("easy", "medium", "hard"), self.targets)}


def _kimi_lambda(lengths, group_ids, known):
    lo, hi = group_minmax(lengths, group_ids, known)
    L = lengths.to(torch.float64)
    lam = 0.5 - (L - lo) / (hi - lo)
    return torch.where(hi > lo, lam, torch.zeros_like(lam))


@register("shaping", "kimi_length", source="Kimi k1.5 length reward; open-r1 len_reward")
def kimi_length(rewards, reward_names, reward_weights, group_ids, lengths, *, source: str = "correct",
                correct_threshold: float = 1.0, name: str = "kimi_length", weight: float = 1.0):
    """Kimi k1.5 length reward, appended as a column:

        lambda_i = 0.5 - (L_i - Lmin) / (Lmax - Lmin)   (Lmin, Lmax over the completion's group)
        r_i = lambda_i if correct, min(0, lambda_i) if wrong; 0 for the whole group when Lmax = Lmin.

    Lengths are tokens; the min/max are taken over the group's completions whose correctness is known. Anchor:
    open-r1 ``len_reward`` (same formula; it takes character lengths over the batch it is given).
    """
    c, known = correctness(rewards, reward_names, source, correct_threshold, "kimi_length")
    lam = _kimi_lambda(lengths, group_ids, known)
    r = torch.where(c, lam, lam.clamp(max=0.0))
    return append_column(rewards, reward_names, reward_weights, _nan_where(r, known), name, weight, "kimi_length")


def _one_selection(params: dict, run: Any, where: str) -> dict:
    """``grpo_lambda``: exactly one of ``threshold`` (default 0.8) and ``top_fraction`` (default None)."""
    p = {**{k: d for k, (_, d) in parameters(grpo_lambda).items()}, **params}
    threshold, top_fraction = p["threshold"], p["top_fraction"]
    if (threshold is None) == (top_fraction is None):
        raise ConfigError(f"{where}: set exactly one of {where}.threshold and {where}.top_fraction (the other null; "
                          f"got threshold={threshold}, top_fraction={top_fraction})")
    return params


@register("shaping", "grpo_lambda", source="Stable Reinforcement Learning for Efficient Reasoning (GRPO-lambda)",
          check=_one_selection)
def grpo_lambda(rewards, reward_names, reward_weights, group_ids, lengths, *, threshold: float | None = 0.8,
                top_fraction: Annotated[float, Gt(0), Le(1)] | None = None, source: str = "correct", correct_threshold: float = 1.0,
                name: str = "grpo_lambda", weight: float = 1.0):
    """GRPO-lambda: a length penalty only for groups with a high correct ratio; plain 0/1 reward elsewhere.

    A group g is penalised when its correct ratio acc_g >= ``threshold`` (default 0.8), or, with
    ``top_fraction`` = lambda instead (threshold None), when it is among the ceil(lambda * #groups) groups with the
    highest acc_g (the paper's batch-wise top-lambda selection; ties by group order). The appended column is the
    Kimi length reward (see ``kimi_length``) in penalised groups and 0 elsewhere, so the total is the 0/1
    correctness plus the length term only where the group is mostly right. After GRPO-lambda: the abstract does
    not fix the penalty's form; the Kimi-style group length reward is assumed.
    """
    c, known = correctness(rewards, reward_names, source, correct_threshold, "grpo_lambda")
    inv, ng = group_index(group_ids)
    s = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, (c & known).to(torch.float64))
    n = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, known.to(torch.float64))
    acc = s / n.clamp(min=1)
    if threshold is not None:
        sel = acc >= threshold
    else:
        kq = math.ceil(top_fraction * ng - 1e-9)
        order = sorted(range(ng), key=lambda g: (-float(acc[g]), g))
        sel = torch.zeros(ng, dtype=torch.bool)
        sel[order[:kq]] = True
    lam = _kimi_lambda(lengths, group_ids, known)
    r = torch.where(c, lam, lam.clamp(max=0.0))
    r = torch.where(sel[inv], r, torch.zeros_like(r))
    return append_column(rewards, reward_names, reward_weights, _nan_where(r, known), name, weight, "grpo_lambda")


@register("shaping", "cosine_length", source="Demystifying Long Chain-of-Thought Reasoning in LLMs (cosine reward)")
def cosine_length(rewards, reward_names, lengths, *, max_length: int = 1000, min_value_correct: float = 0.5,
                  max_value_correct: float = 1.0, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                  exceed_length: float | None = None, source: str = "correct", correct_threshold: float = 1.0):
    """Cosine length-scaled reward, replacing the ``source`` column:

        r = r_min + 0.5 (r_max - r_min) (1 + cos(pi * min(L, Lmax) / Lmax))
        correct: r_min = min_value_correct, r_max = max_value_correct  (shorter correct -> higher)
        wrong:   r_min = max_value_wrong,   r_max = min_value_wrong    (shorter wrong -> more negative)
        L >= Lmax: exceed_length instead, when set (default None: the formula's end value)

    Defaults are open-r1's ``get_cosine_scaled_reward`` (max_len 1000, correct 0.5..1.0, wrong -1.0..-0.5);
    lengths are tokens (the Demystify paper's; open-r1 counts characters and does not clamp L at Lmax, where its
    cosine turns back up).
    """
    k = col(reward_names, source, "cosine_length")
    c, known = correctness(rewards, reward_names, source, correct_threshold, "cosine_length")
    L = lengths.to(torch.float64)
    cosv = torch.cos(math.pi * L.clamp(max=max_length) / max_length)
    lo = torch.where(c, torch.full_like(L, min_value_correct), torch.full_like(L, max_value_wrong))
    hi = torch.where(c, torch.full_like(L, max_value_correct), torch.full_like(L, min_value_wrong))
    r = lo + 0.5 * (hi - lo) * (1.0 + cosv)
    if exceed_length is not None:
        r = torch.where(L >= max_length, torch.full_like(r, exceed_length), r)
    return {"rewards": with_column(rewards, k, _nan_where(r, known))}


@register("shaping", "conciseness_gated", source="Conciseness Reward Model / Conciseness Reward Function (CRM/CRF)")
def conciseness_gated(rewards, reward_names, reward_weights, group_ids, lengths, *, score_source: str | None = None,
                      source: str = "correct", correct_threshold: float = 1.0, name: str = "conciseness_gated",
                      weight: float = 1.0):
    """Conciseness bonus paid only to correct completions (CRF): b_i = 1[correct_i] * s_i.

    s_i = the conciseness score of column ``score_source`` (a conciseness reward model listed as a reward
    source); that column is then gated in place. Without one (default), s_i = (Lmax - L_i) / (Lmax - Lmin) over
    the correct completions of the group (1 when they all have the same length), appended as column ``name``.
    After CRM/CRF: the abstract fixes the dependency on the outcome (gating by correctness); the length-based
    fallback score is an assumption.
    """
    c, known = correctness(rewards, reward_names, source, correct_threshold, "conciseness_gated")
    if score_source is not None:
        k = col(reward_names, score_source, "conciseness_gated", "score_source")
        s = rewards[:, k]
        b = torch.where(c, s, torch.zeros_like(s))
        return {"rewards": with_column(rewards, k, _nan_where(b, known & torch.isfinite(s)))}
    lo, hi = group_minmax(lengths, group_ids, c)
    L = lengths.to(torch.float64)
    s = torch.where(hi > lo, (hi - L) / (hi - lo), torch.ones_like(L))
    b = torch.where(c, s, torch.zeros_like(s))
    return append_column(rewards, reward_names, reward_weights, _nan_where(b, known), name, weight,
                         "conciseness_gated")


@register("shaping", "adaptive_length_coef", source="Thinking Fast and Right: Balancing Accuracy and Reasoning "
                                                  "Length with Adaptive Rewards")
class AdaptiveLengthCoef(Stateful):
    """Length penalty whose weight rises while accuracy is high and relaxes when it drops.

    Appended column: p_i = -lambda_t * L_i / max_length. After each step,
    lambda_{t+1} = clip(lambda_t + lr * (acc_t - target_accuracy), 0, lambda_max), acc_t = the step's accuracy
    (correct rate over the completions with a known outcome of the batches the step trained on). After "Thinking Fast and Right" (the abstract gives the
    direction, not the rule): the additive update toward a target accuracy is an assumption. Defaults:
    max_length=4096, lambda_init=0.0, lr=0.05, target_accuracy=0.7, lambda_max=1.0. State (lambda) is saved with
    the checkpoint.
    """

    _state = ("lam",)

    def __init__(self, *, max_length: Annotated[int, Ge(1)] = 4096, lambda_init: float = 0.0, lr: float = 0.05,
                 target_accuracy: float = 0.7, lambda_max: float = 1.0, source: str = "correct",
                 correct_threshold: float = 1.0, name: str = "adaptive_length", weight: float = 1.0):
        self.max_length, self.lr, self.target, self.lam_max = max_length, lr, target_accuracy, lambda_max
        self.source, self.thr, self.name, self.weight = source, correct_threshold, name, weight
        self.lam = float(lambda_init)

    def __call__(self, rewards, reward_names, reward_weights, lengths):
        c, known = correctness(rewards, reward_names, self.source, self.thr, "adaptive_length_coef")
        p = -self.lam * lengths.to(torch.float64) / self.max_length
        return append_column(rewards, reward_names, reward_weights, _nan_where(p, known), self.name, self.weight,
                             "adaptive_length_coef")

    def observe(self, rewards, reward_names) -> None:
        c, known = correctness(rewards, reward_names, self.source, self.thr, "adaptive_length_coef")
        self.record((float((c & known).sum()), float(known.sum())))

    def end_step(self, step: StepEnd) -> dict:
        right = sum(r for r, _ in self.observed)  # every process's counts of this step
        known = sum(k for _, k in self.observed)
        used = {"lambda": self.lam}  # the value this step used
        if known:
            self.lam = min(self.lam_max, max(0.0, self.lam + self.lr * (right / known - self.target)))
        return used


def _grsp_clusters(params: dict, run: Any, where: str) -> dict:
    """``grsp``: ``edges`` strictly increasing and one weight per cluster (len(edges) + 1)."""
    p = {**{k: d for k, (_, d) in parameters(grsp).items()}, **params}
    edges, weights = tuple(p["edges"]), tuple(p["cluster_weights"])
    if any(b <= a for a, b in zip(edges, edges[1:])):
        raise ConfigError(f"{where}.edges: expected strictly increasing segment lengths, got {list(edges)}")
    if len(weights) != len(edges) + 1:
        raise ConfigError(f"{where}.cluster_weights: expected {len(edges) + 1} weights (one per cluster: "
                          f"len({where}.edges) + 1), got {len(weights)}")
    return params


@register("shaping", "grsp", source="Mitigating Overthinking through Reasoning Shaping (GRSP: Group Relative "
                                    "Segment Penalization)", needs=("groups",), check=_grsp_clusters)
def grsp(rewards, reward_names, reward_weights, group_ids, step_ends, *,
         edges: tuple[Annotated[int, Ge(1)], ...] = (32, 128),
         cluster_weights: tuple[Annotated[float, Ge(0)], ...] = (1.0, 0.5, 0.25),
         coef: Annotated[float, Ge(0)] = 0.1, eps: Annotated[float, Ge(0)] = 1e-6, source: str | None = None,
         correct_threshold: float = 1.0, name: str = "grsp", weight: float = 1.0):
    """GRSP: a penalty on the number of reasoning segments relative to the group, segments weighted by length.

    After "Mitigating Overthinking through Reasoning Shaping" (the abstract: "Group Relative Segment
    Penalization", a step-level penalty, with "a length-aware weighting mechanism across segment clusters"; no
    formula). Segments are the reasoning steps (``step_ends``, split at ``reward.step_delimiter``: e.g. a
    delimiter such as "\\n\\n" or a reflection keyword). For completion i with segments of l_s tokens:

        c(l)  = the cluster of a segment of l tokens: 0 if l <= edges[0], 1 if l <= edges[1], ..., K-1 beyond
        S_i   = sum_s cluster_weights[c(l_s)]                      the length-weighted segment count
        z_i   = (S_i - mean_g S) / (std_g S + eps)                 over the rows of i's group g (unbiased std;
                                                                  z = 0 in a group whose S are all equal)
        column = -coef * z_i                                       (appended as ``name``, weight ``weight``)

    so a completion with more (weighted) segments than its group's average loses, one with fewer gains, and the
    term sums to zero over a group. Default weights descend with the segment length (1.0 for segments of <= 32
    tokens, 0.5 up to 128, 0.25 beyond): many short segments (the hesitant "wait, ..." steps of overthinking) are
    penalised most, long substantive ones least. Assumed (the abstract names only "length-aware weighting across
    segment clusters"): the fixed length clusters, the descending weights, the group z-score, and coef 0.1.
    ``source`` (default None: every row) restricts the penalty to the correct completions (``source`` >=
    ``correct_threshold``): the statistics are then over the group's correct rows, the others get 0, a failed
    correctness NaN. Completions without segments count S = 0. ``edges`` strictly increasing, one weight per
    cluster (checked when the config is read).
    Shapes: step_ends [N, S] (-1 padded), group_ids [N] -> an appended column [N].
    """
    has = step_ends >= 0
    prev = torch.cat([torch.full_like(step_ends[:, :1], -1), step_ends[:, :-1]], dim=1)
    lens = torch.where(has, (step_ends - prev).to(torch.float64), torch.zeros(step_ends.shape, dtype=torch.float64))
    e = torch.tensor(list(edges), dtype=torch.float64)
    cluster = torch.bucketize(lens.contiguous(), e, right=False)  # l <= edges[0] -> 0
    w = torch.tensor(list(cluster_weights), dtype=torch.float64)[cluster]
    S = torch.where(has, w, torch.zeros_like(w)).sum(-1)
    if source is not None:
        ok, known = correctness(rewards, reward_names, source, correct_threshold, "grsp")
        rows = ok & known
    else:
        ok = known = rows = torch.ones(S.shape[0], dtype=torch.bool)
    mean, std, _ = group_stats(S, group_ids, rows)
    z = (S - mean) / (std + eps)
    z = torch.where(rows & (std > 0), z, torch.zeros_like(z))
    return append_column(rewards, reward_names, reward_weights, _nan_where(-coef * z, known), name, weight, "grsp")
