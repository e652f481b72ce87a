"""Fields a stage may read that the rollout batch does not hold: the one mechanism that produces them.

A stage names the fields it reads (its positional parameters, :func:`postrl.stages.reads`). Before a stage runs,
:func:`produce` computes each of those that the batch lacks and a producer makes, from the model through a
:class:`~postrl.context.ModelContext` (never the trainer), and stores it in ``batch.extra``. A producer is a
function ``fn(ctx, batch, *, <params>) -> tensor`` registered as kind ``field`` under the field's name
(``@register("field", "token_entropy")``); its keyword-only parameters are set in the config entry of the stage
that reads the field (e.g. ``advantage: {name: information_gain, answer_column: solution}``) and validated with
the stage's own (:func:`postrl.stages.check_params`). Built in:

    token_entropy      [N, T]    the policy's token entropy at the rollout temperature (rl_zvp, cure_branching)
    prompt_logprob     [N]       mean log-prob of the prompt tokens, -log perplexity (confidence_scaled)
    info_gain          [N]       log pi(answer | q, o) - log pi(answer | q), answer tokens summed (information_gain)
    turn_info_gain     [N, K]    pi(answer | q, h_k) - pi(answer | q, h_{k-1}), turn k of an episode (turn_igpo)
    greedy_reward      [N]       reward (same rewards and shaping) of the greedy completion of the row's prompt (remax)
    completion_hidden  [N, T, H] last hidden state at each completion position (gae's value head)
    token_hidden       [N, T, H] last hidden state after each completion token (chi2_occupancy's discriminator)
    red_token_reward       [N, T] RM(q, o_<=t) - RM(q, o_<t) of the stage's ``reward_model`` (red)
    attention_token_reward [N, T] the stage's ``reward_model`` score spread by its last-layer attention
                                  (attention_credit)
    critic_token_reward    [N, T] an LLM critic's span scores spread over the spans' tokens (critic_dense)
    mle_token_reward       [N, T] log p_MLE(y_t | x, y_<t) of the stage's ``mle_model`` (teacher_forcing)
    occlusion_token_reward [N, T] the run's reward attributed to the tokens by occlusion, re-scoring copies
                                  through ``ctx.score`` (occlusion_credit)

The next four (registered in :mod:`postrl.rewards.dense`, :mod:`postrl.rewards.critic` and
:mod:`postrl.rewards.teacher`) use a model that is the stage's own (a ``reward_model`` folder, a critic, an
``mle_model`` folder), not the policy: of the context they use only the policy's tokenizer (and chat template).
``occlusion_token_reward`` (:mod:`postrl.shaping.attribution`) uses the context's tokenizer and ``score``.
The regularisers' fields are produced the same way, once per step before the update (``Step.advantages``):
``icr_target`` [N] (:mod:`postrl.losses.icr`, no model call) and ``srpo_contrast`` [N, T]
(:mod:`postrl.losses.srpo`, three no-grad forwards of the policy).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal


import torch

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.groups import group_first_rows
from postrl.generation import SamplingParams
from postrl import registry
from postrl.registry import register
from postrl.stages import Stage, parameters


def prompt_tokens(batch: RolloutBatch, i: int) -> list[int]:
    return batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()


@register("field", "token_entropy", source="the policy's token entropy at the rollout temperature")
def token_entropy(ctx: ModelContext, batch: RolloutBatch) -> torch.Tensor:
    """Token entropy [N, T] of the policy at the rollout temperature (0 on padding)."""
    return ctx.logprobs(batch, with_entropy=True)[1] * batch.completion_mask


@register("field", "prompt_logprob", source="-log perplexity of the prompt under the policy")
def prompt_logprob(ctx: ModelContext, batch: RolloutBatch) -> torch.Tensor:
    """Mean log-prob of the prompt tokens [N] (-log perplexity), at temperature 1."""
    first, inv = group_first_rows(batch.group_ids)
    prompts = [prompt_tokens(batch, int(i)) for i in first]
    # log pi(q_t | q_<t) for t >= 1: context = the first token, target = the rest
    tgt = [p[1:] for p in prompts]
    lp = ctx.sequence_logprob([p[:1] for p in prompts], tgt, mean=True)
    lp = torch.where(torch.tensor([len(t) > 0 for t in tgt]), lp, torch.zeros_like(lp))
    return lp[inv]


@register("field", "info_gain", source="information gain of the completion about the answer")
def info_gain(ctx: ModelContext, batch: RolloutBatch, *, answer_column: str = "answer") -> torch.Tensor:
    """log pi(a* | q, o) - log pi(a* | q) [N], a* = the tokens of the row's ``answer_column`` (summed), at
    temperature 1; NaN for a row without an answer."""
    column = answer_column
    if column not in batch.columns:
        raise ValueError(f"advantage.answer_column: the batch has no column '{column}'; columns: "
                         f"{', '.join(sorted(batch.columns)) or '(none)'}")
    ans = [ctx.tokenizer(str(a), add_special_tokens=False)["input_ids"] if a is not None else []
           for a in batch.columns[column]]
    lens = batch.completion_mask.sum(-1).long().tolist()
    with_o = [prompt_tokens(batch, i) + batch.completion_ids[i, :lens[i]].tolist() for i in range(len(batch))]
    first, inv = group_first_rows(batch.group_ids)
    lp1 = ctx.sequence_logprob(with_o, ans, mean=False)
    lp0 = ctx.sequence_logprob([prompt_tokens(batch, int(i)) for i in first], [ans[int(i)] for i in first],
                               mean=False)
    ig = lp1 - lp0[inv]
    return torch.where(torch.tensor([len(a) > 0 for a in ans]), ig, torch.full_like(ig, math.nan))


@register("field", "turn_info_gain", source="Information Gain-based Policy Optimization (IGPO)")
def turn_info_gain(ctx: ModelContext, batch: RolloutBatch, *, answer_column: str = "answer",
                   answer_prob: Literal["joint", "per_token"] = "joint") -> torch.Tensor:
    """IGPO's per-turn information gain [N, K] of a multi-turn batch (``turn_ends`` [N, K] in ``batch.extra``).

    h_k = the episode's completion up to the end of turn k: the model turn's tokens and the environment's
    observation after it (everything before the first token of turn k+1; the last turn ends at its last token);
    h_{-1} = nothing (the prompt alone). With a* = the tokens of the row's ``answer_column`` (default ``answer``):
        p_k = pi(a* | q, h_k) = exp(sum_t log pi(a*_t | q, h_k, a*_<t))      (``answer_prob: joint``, default)
           or exp(mean_t log pi(a*_t | ...))   (``answer_prob: per_token``, the geometric mean per answer token)
        turn_info_gain_{i,k} = p_k - p_{k-1}
    at temperature 1 (``ctx.sequence_logprob``). A probability, not a log-probability: the abstract's "marginal
    increase in the policy's probability of producing the correct answer". NaN beyond the episode's turns and for
    a row without an answer. Source: Information Gain-based Policy Optimization (IGPO)."""
    column, mode = answer_column, answer_prob
    if column not in batch.columns:
        raise ValueError(f"advantage.answer_column: the batch has no column '{column}'; columns: "
                         f"{', '.join(sorted(batch.columns)) or '(none)'}")
    if "turn_ends" not in batch.extra:
        raise ValueError("advantage turn_info_gain: the batch has no turn_ends (a multi-turn rollout: set "
                         "environment in the config)")
    ends = batch.extra["turn_ends"].long()
    N, K = ends.shape
    ans = [ctx.tokenizer(str(a), add_special_tokens=False)["input_ids"] if a is not None else []
           for a in batch.columns[column]]
    model_tok = batch.completion_mask.bool()
    T = model_tok.shape[1]
    after = torch.arange(T)[None, None, :] > ends[:, :, None]                                  # [N, K, T]
    first_next = torch.where(after & model_tok[:, None, :], torch.arange(T), T).amin(-1)       # [N, K]
    has = ends >= 0
    nxt_has = torch.cat([has[:, 1:], torch.zeros((N, 1), dtype=torch.bool)], 1)
    stop = torch.where(nxt_has, first_next, ends + 1)                                          # h_k = o[:stop]
    contexts, targets, where = [], [], []
    for i in range(N):
        if not ans[i] or not bool(has[i].any()):
            continue
        p = prompt_tokens(batch, i)
        cuts = [0] + stop[i][has[i]].tolist()
        for j, c in enumerate(cuts):
            contexts.append(p + batch.completion_ids[i, :c].tolist())
            targets.append(ans[i])
            where.append((i, j))
    out = torch.full((N, K + 1), math.nan)
    if contexts:
        lp = ctx.sequence_logprob(contexts, targets, mean=mode == "per_token")
        rows, cols = torch.tensor(where).T
        out[rows, cols] = lp.exp().float()
    return out[:, 1:] - out[:, :-1]


@register("field", "greedy_reward", source="ReMax (the greedy completion's reward as the baseline)")
def greedy_reward(ctx: ModelContext, batch: RolloutBatch) -> torch.Tensor:
    """Greedy completion of each group's context, scored with the run's rewards and shaping (one row per group)."""
    first, inv = group_first_rows(batch.group_ids)
    rows = first.tolist()
    sp = replace(ctx.sampling or SamplingParams(), temperature=0.0, top_p=1.0, top_k=0)
    gen = ctx.generate([prompt_tokens(batch, i) for i in rows], 1, sp, [0] * len(rows))
    prefix = batch.extra.get("completion_prefix")
    g = RolloutBatch(prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, completion_ids=gen.completion_ids,
                     completion_mask=gen.completion_mask.float(), group_ids=torch.arange(len(rows)),
                     sampler_logprobs=gen.logprobs, truncated=gen.truncated, prompts=[batch.prompts[i] for i in rows],
                     completions=[((prefix[i] or "") if prefix else "") + t for i, t in zip(rows, gen.texts)],
                     columns={k: [v[i] for i in rows] for k, v in batch.columns.items()})
    ctx.score(g)
    return g.reward.float()[inv]


@register("field", "completion_hidden", source="the policy's last hidden state (a value head's input)")
def completion_hidden(ctx: ModelContext, batch: RolloutBatch) -> torch.Tensor:
    """Last hidden state [N, T, H] at the position that predicts each completion token."""
    return ctx.completion_hidden(batch)


@register("field", "token_hidden", source="the policy's last hidden state after each completion token")
def token_hidden(ctx: ModelContext, batch: RolloutBatch) -> torch.Tensor:
    """Last hidden state [N, T, H] at each completion token's own position (after reading it).

    The features of the (prefix, token) pair, a sample of the state-action occupancy (chi2_occupancy)."""
    return ctx.completion_hidden(batch, after=True)


def produce(ctx: ModelContext, batch: RolloutBatch, stage: Stage) -> None:
    """Fill ``batch.extra`` with every field the stage reads that the batch lacks and a registered producer makes,
    with the producer's parameters from the stage's config entry (``stage.field_params``)."""
    made = registry.names("field")
    for name in stage.reads:
        if name in made and name not in batch.extra and getattr(batch, name, None) is None:
            fn = registry.get("field", name)
            keys = parameters(fn)
            batch.extra[name] = fn(ctx, batch, **{k: v for k, v in stage.field_params.items() if k in keys})
