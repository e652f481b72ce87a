"""Token credit by attribution: a sequence reward spread over the completion's tokens by occlusion.

The producer of the batch field ``occlusion_token_reward`` [N, T] (:mod:`postrl.fields`), which the advantage
estimator ``occlusion_credit`` (:mod:`postrl.advantages.token_rewards`) reads.

How the occluded scores are obtained: the reward of a completion with a piece left out is the run's own reward
(its reward sources and shaping) re-scored on an occluded copy of the row, through ``ModelContext.score`` (the
callback every driver sets to ``Step.score(batch, observe=False)``: stateful stages learn nothing from the copies),
as the ``greedy_reward`` producer scores greedy completions. This is why it is a field producer read by an
advantage and not a shaping stage: shaping stages run inside that scoring (a shaping stage that re-scored would
call itself), and producers run once the batch is scored, before the advantage.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Le

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.reasoning_steps import step_token_ends
from postrl.registry import register

_BO = "Learning Explainable Dense Reward Shapes via Bayesian Optimization"


def occlusion_units(length: int, ends: list[int] | None, span: int) -> list[tuple[int, int]]:
    """Token ranges [a, b) of the units of a completion of ``length`` tokens: the reasoning steps ending on
    ``ends`` (token indices), or, without them, consecutive spans of ``span`` tokens."""
    if ends is not None:
        out, a = [], 0
        for e in ends:
            if e >= a:
                out.append((a, e + 1))
                a = e + 1
        return out
    return [(a, min(a + span, length)) for a in range(0, length, span)]


def additive_credit(full: float, occluded: list[float], total: float) -> list[float]:
    """c_u = d_u + (total - sum_v d_v) / U with d_u = full - occluded_u: occlusion effects made additive, so that
    sum_u c_u = total exactly (the residual, i.e. the score of the empty completion and the interactions, spread
    evenly over the U units)."""
    d = [full - o for o in occluded]
    rest = (total - sum(d)) / len(d) if d else 0.0
    return [x + rest for x in d]


def _row_values(batch: RolloutBatch, source: str | None, what: str) -> torch.Tensor:
    """The reward the credit divides: the scalar ``reward`` (``source`` None) or the raw reward column ``source``."""
    if source is None:
        if batch.reward is None:
            raise ValueError(f"{what}: the batch has no scalar reward (score it first)")
        return batch.reward.to(torch.float64)
    names = list(batch.extra.get("raw_reward_names") or batch.reward_names)
    raw = batch.raw_rewards if batch.raw_rewards is not None else batch.rewards
    if raw is None or source not in names:
        raise ValueError(f"advantage.source: '{source}' is not a reward source of the run; sources: "
                         f"{', '.join(names) or '(none)'}")
    return raw[:, names.index(source)].to(torch.float64)


@register("field", "occlusion_token_reward", source=_BO)
def occlusion_token_reward(ctx: ModelContext, batch: RolloutBatch, *, unit: Literal["span", "step"] = "span",
                           span: Annotated[int, Ge(1)] = 1, delimiter: str = "\n\n", source: str | None = None,
                           beta: Annotated[float, Ge(0), Le(1)] = 0.5) -> torch.Tensor:
    """Token rewards [N, T] that sum to the completion's reward, by occlusion attribution.

    After "Learning Explainable Dense Reward Shapes via Bayesian Optimization" (the abstract: per-token rewards
    from the reward model by explainability methods (SHAP, LIME), blended by a shaping function whose weights a
    Bayesian optimisation learns in an outer loop; "feature additive attribution functions maintain the optimal
    policy"). For completion i with reward R_i (the run's scalar ``reward``, or the raw reward column ``source``)
    and units u = 1..U (``unit='span'``: consecutive spans of ``span`` tokens, span 1 = every token;
    ``unit='step'``: the reasoning steps split at ``delimiter``):

        d_u     = R~_i - R_i(-u)        R~_i: the re-scored completion, R_i(-u): re-scored without unit u's tokens
        c_u     = d_u + (R_i - sum_v d_v) / U      (occlusion made additive: sum_u c_u = R_i exactly)
        r_{i,t} = beta * c_{u(t)} / |u(t)| + (1 - beta) * R_i * 1[t = last token]     (sum_t r_{i,t} = R_i)

    Occlusion (leave one unit out) stands in for SHAP / LIME (assumed); the residual spread keeps it additive, so
    the token rewards sum to the sequence reward (the abstract: additive attributions keep the optimal policy).
    ``beta`` (0.5, assumed) mixes the attribution with the sparse reward on the last token, the role of the paper's
    shaping weights; the Bayesian optimisation of those weights over training runs is not reproduced (tune
    ``beta`` with ``postrl compare``).
    The occluded copies are scored through ``ModelContext.score`` (the run's reward sources and shaping, not
    observed by stateful stages), each copy's text the decoded tokens that remain (after the row's
    ``completion_prefix`` when there is one), with the row's prompt, data columns and group. Name a raw column in
    ``source`` (e.g. the reward model's) so that group-relative shaping of the copies does not enter. Cost:
    sum_i (U_i + 1) completions scored per batch. A row whose reward or any of its copies' failed is NaN.
    """
    if ctx.score is None:
        raise ValueError("advantage occlusion_credit: the model context has no score function (the run's rewards)")
    N, T = batch.completion_ids.shape
    lens = batch.completion_mask.sum(-1).long().tolist()
    R = _row_values(batch, source, "advantage occlusion_credit")
    ends = (step_token_ends(batch.completion_ids, batch.lengths, batch.completions, ctx.tokenizer, delimiter)
            if unit == "step" else None)
    units, rows, cut = [], [], []  # per row its units; per copy (row, unit index, -1 = the whole completion)
    for i in range(N):
        e = [int(x) for x in ends[i].tolist() if x >= 0] if ends is not None else None
        units.append(occlusion_units(lens[i], e, span) if lens[i] else [])
        if units[i]:
            for u in range(-1, len(units[i])):
                rows.append(i)
                cut.append(u)
    out = torch.zeros(N, T, dtype=torch.float64)
    v: list[float] = []
    if rows:
        prefix = batch.extra.get("completion_prefix")
        ids = []
        for i, u in zip(rows, cut):
            x = batch.completion_ids[i, :lens[i]].tolist()
            if u >= 0:
                a, b = units[i][u]
                x = x[:a] + x[b:]
            ids.append(x)
        W = max(1, max(len(x) for x in ids))
        cids = torch.full((len(ids), W), int(ctx.pad_id), dtype=torch.long)
        cmask = torch.zeros(len(ids), W)
        for j, x in enumerate(ids):
            if x:
                cids[j, :len(x)] = torch.tensor(x, dtype=torch.long)
                cmask[j, :len(x)] = 1.0
        idx = torch.tensor(rows, dtype=torch.long)
        texts = [ctx.tokenizer.decode(x, skip_special_tokens=True) for x in ids]
        copies = RolloutBatch(
            prompt_ids=batch.prompt_ids[idx], prompt_mask=batch.prompt_mask[idx], completion_ids=cids,
            completion_mask=cmask, group_ids=batch.group_ids[idx], sampler_logprobs=torch.zeros(len(ids), W),
            truncated=batch.truncated[idx], prompts=[batch.prompts[i] for i in rows],
            completions=[(prefix[i] if prefix else "") + t for i, t in zip(rows, texts)],
            columns={k: [v[i] for i in rows] for k, v in batch.columns.items()},
            extra={k: batch.extra[k] for k in ("step", "attempt", "max_steps") if k in batch.extra})
        ctx.score(copies)
        v = _row_values(copies, source, "advantage occlusion_credit").tolist()
    j = 0
    for i in range(N):
        if not lens[i]:
            continue
        total = float(R[i])
        full, occluded = (v[j], v[j + 1:j + 1 + len(units[i])]) if units[i] else (total, [])
        j += (1 + len(units[i])) if units[i] else 0
        if not all(math.isfinite(x) for x in (total, full, *occluded)):
            out[i, :lens[i]] = math.nan
            continue
        for (a, b), c in zip(units[i], additive_credit(full, occluded, total)):
            out[i, a:b] = beta * c / (b - a)
        # the sparse part, and the whole reward of a completion without units (e.g. a blank text split in steps)
        out[i, lens[i] - 1] += (1.0 - beta) * total if units[i] else total
    return out.to(torch.float32)


__all__ = ["occlusion_token_reward", "occlusion_units", "additive_credit"]
