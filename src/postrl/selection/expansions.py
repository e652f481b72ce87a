"""Expansions (kind ``expansion``; config ``filters: [...]``): new groups made from the scored batch.

* ``cure_branching`` / ``retry_from_failure`` (protocol :class:`Expansion`): after
  scoring, ``expand(batch, ctx)`` returns new groups that are
  generated from a prefix of existing completions (the prefix becomes part of the prompt, so only the continuation
  is trained on); the trainer scores them and appends them to the batch. ``ctx`` (:class:`ExpandContext`) gives
  the stage a generation callback with the run's sampling parameters; the stage never touches the trainer.

The completion text given to the rewards is prefix + continuation, so verifiers judge the whole answer. The
continuation has the run's full ``max_new_tokens`` budget (prefix + continuation can be longer than an ordinary
completion). Rows made this way carry ``extra['branch'] = True`` (selectors do not count them as fresh attempts
of the prompt) and ``extra['completion_prefix']`` (the prefix text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable

import torch
from annotated_types import Ge

from postrl.batch import RolloutBatch
from postrl.generation import left_pad
from postrl.groups import group_index
from postrl.registry import register
from postrl.selection.filters import raw_column


class Expansion:
    """Protocol of kind ``expansion``: ``expand(batch, ctx)`` returns new groups made from the scored batch
     or None; ``reads`` names the batch fields it reads beyond the batch's own
    (produced first when missing, like any stage's positional fields)."""

    reads: tuple[str, ...] = ()

    def expand(self, batch: Any, ctx: Any) -> Any:
        return None



@dataclass
class ExpandContext:
    """What an expanding stage may use: ``generate(prompt_token_lists, n, seeds)`` -> ``Generation`` with the run's
    sampling parameters; ``decode(token_ids)`` -> text (special tokens skipped); the run's group size and a seed
    for this step and attempt."""

    generate: Callable
    decode: Callable[[list[int]], str]
    group_size: int
    seed: int
    pad_id: int = 0


def _prompt_tokens(batch: RolloutBatch, i: int) -> list[int]:
    return batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()


def branch_batch(parent: RolloutBatch, rows: list[int], cuts: list[int], n: int, ctx: ExpandContext,
                 keep_original: bool = False) -> RolloutBatch | None:
    """New groups: for each (row, cut), ``n`` continuations of prompt + completion[:cut] (one group per row);
    ``keep_original`` puts the row's own suffix completion[cut:] first in its group."""
    if not rows:
        return None
    prefixes = [parent.completion_ids[i, :t].tolist() for i, t in zip(rows, cuts)]
    new_prompts = [_prompt_tokens(parent, i) + p for i, p in zip(rows, prefixes)]
    seeds = [(ctx.seed + 7919 * j) % (2**62) for j in range(len(rows))]
    gen = ctx.generate(new_prompts, n, seeds)
    texts = [ctx.decode(p) for p in prefixes]
    cols = {k: [v[i] for i in rows for _ in range(n)] for k, v in parent.columns.items()}
    gids = torch.arange(len(rows)).repeat_interleave(n)
    out = RolloutBatch(
        prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, completion_ids=gen.completion_ids,
        completion_mask=gen.completion_mask.float(), group_ids=gids, sampler_logprobs=gen.logprobs,
        truncated=gen.truncated, prompts=[parent.prompts[i] for i in rows for _ in range(n)],
        completions=[texts[j] + gen.texts[j * n + c] for j in range(len(rows)) for c in range(n)], columns=cols,
        extra={"branch": torch.ones(len(gids), dtype=torch.bool),
               "completion_prefix": [texts[j] for j in range(len(rows)) for _ in range(n)],
               **({} if gen.kept_logmass is None else {"sampler_kept_logmass": gen.kept_logmass})})
    if not keep_original:
        return out
    # the original suffixes, one per new group, with the same (prompt + prefix) context
    lens = parent.completion_mask[rows].sum(-1).long().tolist()
    suffix = [parent.completion_ids[i, t:L].tolist() for i, t, L in zip(rows, cuts, lens)]
    width = max(max((len(s) for s in suffix), default=1), 1)
    comp = torch.full((len(rows), width), ctx.pad_id, dtype=torch.long)
    lp = torch.zeros((len(rows), width))
    mask = torch.zeros((len(rows), width))
    for j, (i, t, L) in enumerate(zip(rows, cuts, lens)):
        comp[j, :L - t] = parent.completion_ids[i, t:L]
        lp[j, :L - t] = parent.sampler_logprobs[i, t:L]
        mask[j, :L - t] = 1.0
    pids, pmask = left_pad(new_prompts, ctx.pad_id)
    orig = RolloutBatch(
        prompt_ids=pids, prompt_mask=pmask, completion_ids=comp, completion_mask=mask,
        group_ids=torch.arange(len(rows)), sampler_logprobs=lp, truncated=parent.truncated[rows],
        prompts=[parent.prompts[i] for i in rows], completions=[parent.completions[i] for i in rows],
        columns={k: [v[i] for i in rows] for k, v in parent.columns.items()},
        extra={"branch": torch.ones(len(rows), dtype=torch.bool), "completion_prefix": texts})
    both = RolloutBatch.concat([orig, out], pad_id=ctx.pad_id)
    both.group_ids = torch.cat([torch.arange(len(rows)), gids])
    return both


def _first_per_group(candidate: torch.Tensor, group_ids: torch.Tensor, k: int) -> list[int]:
    """The first ``k`` candidate rows of every group (rows in batch order)."""
    inv, ng = group_index(group_ids)
    idx = torch.nonzero(candidate.bool()).flatten()
    if not len(idx):
        return []
    order = torch.sort(inv[idx], stable=True).indices  # candidates by group, batch order within a group
    g = inv[idx][order]
    counts = torch.bincount(g, minlength=ng)
    rank = torch.arange(len(g)) - (torch.cumsum(counts, 0) - counts)[g]
    return sorted(idx[order][rank < k].tolist())


@register("expansion", "cure_branching", source="CURE: Critical-Token-Guided Re-Concatenation for Entropy-Collapse "
          "Prevention")
class CureBranching(Expansion):
    """Re-generate from the highest-entropy token of completions and train on the original and the branched groups.

    "CURE" (stage 1): for the first ``branches`` (default 1) completions of every group, the critical token is the
    one with the highest policy entropy (``token_entropy``, from the trainer's no-grad forward; the last token is
    excluded so something is regenerated); prompt + completion[:t*] becomes a new prompt and ``group_size``
    continuations (default: the run's G) form a new group, trained jointly with the original groups.
    Assumed: one critical token per branched completion (the argmax), branching the first completions of a group.
    CURE's second stage (plain DAPO training) is a second run without this option.
    """

    reads = ("token_entropy",)

    def __init__(self, *, branches: Annotated[int, Ge(1)] = 1, group_size: Annotated[int, Ge(1)] | None = None):
        self.branches, self.group_size = branches, group_size

    def expand(self, batch: RolloutBatch, ctx: ExpandContext) -> RolloutBatch | None:
        ok = batch.valid if batch.valid is not None else torch.ones(len(batch), dtype=torch.bool)
        if "branch" in batch.extra:
            ok = ok & ~batch.extra["branch"].bool()
        rows = _first_per_group(ok, batch.group_ids, self.branches)
        H = batch.extra["token_entropy"]
        lens = batch.completion_mask.sum(-1).long()
        T = H.shape[-1]
        pos = torch.arange(T)
        allowed = pos.unsqueeze(0) < (lens - 1).clamp(min=1).unsqueeze(-1)  # not the last token (unless L = 1)
        cut = torch.where(allowed, H.float(), torch.full_like(H.float(), -torch.inf)).argmax(-1)
        return branch_batch(batch, rows, [int(cut[i]) for i in rows], self.group_size or ctx.group_size, ctx)


@register("expansion", "retry_from_failure", source="R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided "
          "Exploration, Pivotal Credit, and Positive Amplification")
class RetryFromFailure(Expansion):
    """Restart sampling from the step where a failed completion went wrong; train only on the diverging suffix.

    After "R^3L: Reflect-then-Retry RL" (restart from identified failure points; Pivotal Credit Assignment trains
    only the suffix after the shared prefix). For up to ``max_per_group`` (1) failed completions per group (raw
    ``reward`` < ``threshold``, default 'correct' < 1.0), the failure point is the step holding the completion's
    most surprising token (max -log pi_old; steps split after tokens containing ``delimiter``, default newline, so
    the restart is the start of that step; ``delimiter: ''``: restart at that token itself). A new group = the
    failed suffix + ``retries`` (default G - 1) fresh continuations of prompt + prefix; the prefix is part of the
    prompt, so only the diverging suffixes get gradient.
    Assumed / not implemented: the failure point is located by surprisal instead of language-model reflection
    (no feedback model), and R^3L's positive amplification (up-weighting successes) is not applied.
    """

    def __init__(self, *, reward: str = "correct", threshold: float = 1.0, retries: Annotated[int, Ge(1)] | None = None,
                 max_per_group: Annotated[int, Ge(1)] = 1, delimiter: str = "\n"):
        self.reward, self.threshold, self.retries = reward, threshold, retries
        self.max_per_group, self.delimiter = max_per_group, delimiter

    def expand(self, batch: RolloutBatch, ctx: ExpandContext) -> RolloutBatch | None:
        x = raw_column(batch.rewards, batch.reward_names, self.reward, "filters.retry_from_failure",
                       getattr(batch, "raw_rewards", None), batch.extra.get("raw_reward_names"))
        failed = torch.isfinite(x) & (x < self.threshold)
        if batch.valid is not None:
            failed = failed & batch.valid
        if "branch" in batch.extra:
            failed = failed & ~batch.extra["branch"].bool()
        rows = _first_per_group(failed, batch.group_ids, self.max_per_group)
        if not rows:
            return None
        mask = batch.completion_mask[rows] > 0
        surprisal = torch.where(mask, -batch.sampler_logprobs[rows].float(), torch.full_like(mask, -torch.inf,
                                                                                             dtype=torch.float32))
        t_max = surprisal.argmax(-1)
        ids = batch.completion_ids[rows]
        vocab = {int(t): self.delimiter in ctx.decode([int(t)]) for t in torch.unique(ids).tolist()} \
            if self.delimiter else {}
        is_delim = torch.tensor([[vocab.get(int(t), False) for t in row] for row in ids.tolist()],
                                dtype=torch.bool).reshape(ids.shape) & mask
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        before = is_delim & (pos < t_max.unsqueeze(-1))
        last_delim = torch.where(before, pos, torch.full_like(pos, -1)).amax(-1)
        cuts = torch.where(last_delim >= 0, last_delim + 1, t_max if not self.delimiter else torch.zeros_like(t_max))
        retries = self.retries or max(ctx.group_size - 1, 1)
        return branch_batch(batch, rows, cuts.tolist(), retries, ctx, keep_original=True)
