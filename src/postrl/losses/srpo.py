"""SRPO: role-aware positive token weights on the policy-gradient term, for structured text responses.

"Structured Role-Aware Policy Optimization for Multimodal Reasoning" (arXiv 2605.07274), for text. A response is
structured in sections (tags, configurable): *perception* tokens extract evidence from the input, *reasoning*
tokens derive the answer from that evidence. Two parts, configured as one regulariser entry
(``regularizers: [{name: srpo, evidence_tag: evidence, corruption: mask}]``; the producer's parameters go in the
same entry):

* the field ``srpo_contrast`` [N, T] (a producer, kind ``field``, three no-grad forward passes of the policy through
  :class:`~postrl.context.ModelContext`): each role token's self-distilled on-policy contrast
  (:func:`srpo_contrast`);
* the stage ``srpo``: positive token weights from the contrasts, through a shared trajectory baseline, multiplying
  the policy-loss matrix (:func:`srpo`).

How it composes with "any advantage estimator": the weights multiply each token's policy-loss term through the
objective's ``pg_mask`` (the route a token-selection stage such as ``top_entropy_tokens`` takes), so the advantage
stage stays whatever the config names (stateful or not, [N] or [N, T], reading any produced field) and the reward is
untouched. For every loss that is positively homogeneous in A per token (``ppo_clip`` with or without dual clip,
``gspo``, ``gmpo``, ``cispo``, ``gpg``, ``sapo``, ``dispo``; tested) w_t * loss_t(A) = loss_t(w_t A): exactly the
paper's token-level advantage A_{i,t} = w_{i,t} A_i, with the sign (the update direction) of A unchanged since
w > 0 (``clip_cov`` / ``kl_cov`` select tokens by a covariance that reads |A|: there the weight scales the loss
only). An advantage stage
``srpo`` wrapping a ``base`` estimator would have to forward that estimator's fields, producers, state and needs;
the loss-side weight needs none of that.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Lt

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.errors import DataError
from postrl.reasoning_steps import token_char_ends
from postrl.registry import register
from postrl.seeding import derive_seed

SOURCE = "Structured Role-Aware Policy Optimization for Multimodal Reasoning (arXiv 2605.07274)"


def section_span(text: str, tag: str) -> tuple[int, int] | None:
    """(start, end) characters of the content of the first ``<tag>...</tag>`` of ``text`` (an unclosed section runs
    to the end of the text); None without an opening tag."""
    opening = f"<{tag}>"
    a = text.find(opening)
    if a < 0:
        return None
    a += len(opening)
    b = text.find(f"</{tag}>", a)
    return a, (len(text) if b < 0 else b)


def span_tokens(ids: list[int], tokenizer, tag: str) -> tuple[list[int], bool]:
    """(positions in ``ids`` of the tokens overlapping the content of the first ``<tag>`` section, whether the
    section exists), on the text ``ids`` decode to (special tokens skipped)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    span = section_span(text, tag)
    if span is None:
        return [], False
    a, b = span
    ends = token_char_ends(ids, tokenizer, text)
    out, prev = [], 0
    for t, e in enumerate(ends):
        if e > prev and prev < b and e > a:
            out.append(t)
        prev = e
    return out, True


def corrupt(ids: list[int], positions: list[int], mode: str, mask_id: int, seed: int) -> list[int]:
    """``ids`` with the tokens at ``positions`` replaced by ``mask_id`` (``mask``) or permuted among themselves by a
    permutation drawn from ``seed`` (``shuffle``); the length never changes, so per-token log-probs stay aligned."""
    out = list(ids)
    if mode == "mask":
        for p in positions:
            out[p] = mask_id
        return out
    perm = torch.randperm(len(positions), generator=torch.Generator().manual_seed(seed)).tolist()
    for p, q in zip(positions, perm):
        out[p] = ids[positions[q]]
    return out


@register("field", "srpo_contrast", source=SOURCE)
def srpo_contrast(ctx: ModelContext, batch: RolloutBatch, *, perception_tag: str = "perception",
                  reasoning_tag: str = "reasoning", evidence_tag: str = "evidence",
                  corruption: Literal["mask", "shuffle"] = "mask", seed: int = 0) -> torch.Tensor:
    """SRPO's per-token contrasts [N, T] (NaN on tokens of neither role), from the policy's own forward passes.

    With lp(o_t | x, o_<t) the policy's log-prob at the rollout temperature (``ctx.logprobs``):
      perception token t (content of the response's first ``<perception_tag>`` section):
          s_t = lp(o_t | x, o_<t) - lp(o_t | x~, o_<t)          x~ = the prompt with its evidence corrupted
      reasoning token t (content of the first ``<reasoning_tag>`` section):
          s_t = lp(o_t | x, o_<t) - lp(o_t | x, o~_<t)          o~ = the response with its perception corrupted
    The evidence is the content of the prompt's first ``<evidence_tag>`` section (a prompt without one is a
    DataError naming the row); ``corruption`` 'mask' replaces its tokens by the tokenizer's unknown token (the pad
    token when it has none), 'shuffle' permutes them (seeded by ``seed`` and the prompt, so the completions of one
    prompt see the same corruption); the same corruption applies to the perception tokens for the reasoning
    contrast. Token counts never change, so positions stay aligned. A response without a section (the policy did
    not follow the format) has no tokens of that role; without a perception section its reasoning tokens have no
    contrast either. Three forward passes of the rows that have role tokens.
    """
    tok = ctx.tokenizer
    mask_id = tok.unk_token_id if tok.unk_token_id is not None else ctx.pad_id
    N, T = batch.completion_ids.shape
    out = torch.full((N, T), float("nan"))
    pid, cid = batch.prompt_ids.clone(), batch.completion_ids.clone()
    perception = torch.zeros((N, T), dtype=torch.bool)
    reasoning = torch.zeros((N, T), dtype=torch.bool)
    model_tok = batch.completion_mask > 0
    for i in range(N):
        n = int(model_tok[i].nonzero().max()) + 1 if bool(model_tok[i].any()) else 0
        comp = batch.completion_ids[i, :n].tolist()
        per, _ = span_tokens(comp, tok, perception_tag)
        rea, _ = span_tokens(comp, tok, reasoning_tag)
        perception[i, per] = True
        if per and rea:  # consistency with the generated perception: only where there is one
            reasoning[i, rea] = True
            cid[i, :n] = torch.tensor(corrupt(comp, per, corruption, mask_id, derive_seed(seed, "perception", comp)))
        if per:
            where = batch.prompt_mask[i].nonzero().flatten()
            prompt = batch.prompt_ids[i, where].tolist()
            ev, found = span_tokens(prompt, tok, evidence_tag)
            if not found:
                raise DataError(f"srpo: row {i}: the prompt has no <{evidence_tag}>...</{evidence_tag}> section "
                                f"(regularizers.srpo.evidence_tag) to corrupt")
            pid[i, where] = torch.tensor(corrupt(prompt, ev, corruption, mask_id, derive_seed(seed, "evidence", prompt)))
    perception &= model_tok
    reasoning &= model_tok
    any_role = (perception | reasoning).any(-1).nonzero().flatten()
    if not len(any_role):
        return out
    lp0 = ctx.logprobs(batch.select(any_role))[0]
    out[any_role] = torch.where(perception[any_role] | reasoning[any_role], lp0, out[any_role])
    for role, rows_mask, field, value in ((perception, perception.any(-1), "prompt_ids", pid),
                                          (reasoning, reasoning.any(-1), "completion_ids", cid)):
        rows = rows_mask.nonzero().flatten()
        if not len(rows):
            continue
        sub = batch.select(rows)
        setattr(sub, field, value[rows])
        lp = ctx.logprobs(sub)[0]
        out[rows] = torch.where(role[rows], out[rows] - lp, out[rows])
    return out


@register("regularizer", "srpo", source=SOURCE)
def srpo(srpo_contrast: torch.Tensor, mask: torch.Tensor, *, strength: Annotated[float, Ge(0), Lt(1)] = 0.5,
         scale: Annotated[float, Gt(0)] = 1.0) -> dict:
    """SRPO: role-aware positive token weights on the policy-gradient term (perception: input dependency,
    reasoning: consistency with the generated perception).

    With s_{i,t} = ``srpo_contrast`` (the field's producer, :func:`postrl.losses.srpo.srpo_contrast`: for a
    perception token the policy's log-prob under the original minus under the evidence-corrupted prompt; for a
    reasoning token under the response as generated minus with its perception corrupted) and R_i the role tokens
    of trajectory i (perception and reasoning, loss tokens only):
      b_i     = mean_{t in R_i} s_{i,t}                          the shared trajectory-level baseline
      w_{i,t} = 1 + strength * tanh((s_{i,t} - b_i) / scale)    for t in R_i;  1 on every other token
    w lies in (1 - strength, 1 + strength), so it is positive: it multiplies each token's policy-loss term
    (``pg_mask``), which for the per-token losses equals training with A_{i,t} = w_{i,t} A_i (module docstring):
    role tokens that depend more than the trajectory's average on the evidence (perception) or on the generated
    perception (reasoning) get larger updates, the others smaller, the reward and every token's update direction
    unchanged. Defaults: strength 0.5, scale 1.0 (nats). Logged: ``reg/srpo/kept`` = the aggregated mean weight.
    Producer parameters (set in this entry): ``perception_tag`` 'perception', ``reasoning_tag`` 'reasoning',
    ``evidence_tag`` 'evidence', ``corruption`` 'mask' | 'shuffle', ``seed`` 0.
    After SRPO (arXiv 2605.07274), for text: the abstract gives the two signals (dependency on the original vs a
    corrupted input, consistency with the generated perception), the shared trajectory baseline and the positive
    weights, not the formulas. Assumed: log-prob differences as the contrasts (the reasoning one by corrupting the
    generated perception), one baseline b_i shared by both roles (the mean contrast of the trajectory's role
    tokens), the bounded tanh map to weights, weight 1 outside the two sections (tags, answer), the weights
    computed once per step from the policy that generated the batch (no gradient through them).
    Shapes: srpo_contrast [n, T], mask [n, T] -> {"pg_mask": [n, T]}.
    """
    s = srpo_contrast.to(torch.float64)
    role = torch.isfinite(s) & (mask > 0)
    s0 = torch.where(role, s, torch.zeros_like(s))
    b = s0.sum(-1, keepdim=True) / role.sum(-1, keepdim=True).clamp(min=1)
    w = 1.0 + strength * torch.tanh((s0 - b) / scale)
    return {"pg_mask": torch.where(role, w, torch.ones_like(w)).to(mask.dtype)}
