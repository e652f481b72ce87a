"""The step's training batch: prompts -> rollout -> rewards and shaping -> expansions -> keep-mask filters (refill).

:class:`BatchSource` runs the batch-selection stages of the step (:class:`postrl.step.Step`, the config's
``filters`` list), each by its own protocol (:mod:`postrl.selection`; kinds ``selector``, ``sampling``,
``expansion``, ``filter``), for a driver that owns generation (postrl's trainer; engines that generate themselves,
TRL and verl, use only the step's scoring and keep masks):

* a prompt **selector** picks the step's prompts from a pool of ``pool_factor`` x prompts_per_step rows (every
  process makes the same choice and takes its share) and records the outcome of every group generated that step
  (``observe``; every process's records reach it at the end of the step);
* a **sampling** plan generates the groups its own way (each completion's temperature; each completion's prompt
  template, so a group's rows may have different prompts: ``prompt_ids`` are per row);
* **expansions** (cure_branching, retry_from_failure) append scored groups made from the scored batch; those that
  ``join`` (demonstrations, teacher_hint) append scored rows to the batch's own groups;
* **keep-mask filters** drop groups; with ``max_attempts`` > 1 (the filter entry's), fresh prompts (seed derived from (seed, step,
  attempt)) are generated, scored and filtered until the batch holds as many groups as the unfiltered first round,
  or the cap is hit: the shortfall is filled with dropped groups masked out of the loss (``valid`` False), a
  warning is logged and ``filter/cap_hit`` is 1.

Under DDP every process ends with the same number of rows (masked copies pad the shorter ones). All randomness
of step s derives from (seed, s, rank, attempt). Nothing here holds the trainer: the model is reached through a
:class:`~postrl.context.ModelContext`, processes through ``gather`` / ``max_over_processes``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable

import torch

from postrl import stages
from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.seeding import derive_seed
from postrl.selection.expansions import ExpandContext
from postrl.selection.sampling import PlanContext
from postrl.environments import make as make_environment
from postrl.fields import produce
from postrl.generation import encode_prompt, fit_prompts
from postrl.environments import episodes

def concat(batches: list[RolloutBatch], pad_id: int = 0) -> RolloutBatch:
    """``RolloutBatch.concat`` of the step's batches, after giving each batch the per-row ``extra`` fields that only
    some of them carry (an expansion's row flags, e.g. ``branch``, ``demonstration``, ``guided``, ``hint``: rows
    without one get zeros / False, or None in a list), which ``concat`` would otherwise drop."""
    keys: dict[str, Any] = {}
    for b in batches:
        for k, v in b.extra.items():
            if (isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == len(b)) or \
                    (isinstance(v, list) and len(v) == len(b)):
                keys.setdefault(k, v)
    for b in batches:
        for k, v in keys.items():
            if k in b.extra:
                continue
            if isinstance(v, torch.Tensor):
                b.extra[k] = torch.zeros((len(b), *v.shape[1:]), dtype=v.dtype)
            else:
                b.extra[k] = [None] * len(b)
    return RolloutBatch.concat(batches, pad_id)


class BatchSource:
    """Builds each step's training batch (see the module docstring). ``step``: the run's :class:`Step` (scoring,
    selection stages, refill attempts); ``source``: the prompt source; ``ctx``: the model context (generation);
    ``rollout``: the config's rollout section; ``environment``: its environment section (None: single turns)."""

    def __init__(self, step: Any, source: Any, ctx: ModelContext, *, seed: int, prompts_per_step: int,
                 rollout: Any, chat_template: str = "auto", environment: Any = None, rank: int = 0, world: int = 1,
                 max_over_processes: Callable[[int], int] = lambda n: n,
                 log: Callable[[str], None] | None = None, notice: Any = None):
        self.step, self.source, self.ctx, self.scorer = step, source, ctx, step.scorer
        self.seed, self.prompts_per_step, self.rollout_cfg = seed, prompts_per_step, rollout
        self.chat_template, self.environment = chat_template, environment
        self.rank, self.world, self.max_over_processes = rank, world, max_over_processes
        self.log = log
        self.notice = notice  # run_state.Notices: what changes the run, in every mode (the first time)
        self.stages = step.selection
        by_kind = {k: [s for s in self.stages if s.kind == k] for k in stages.FILTER_KINDS}
        self.keepers = by_kind["filter"]
        self.expansions = [e for e in by_kind["expansion"] if getattr(e.fn, "scored", True)]
        self.unscored = [e for e in by_kind["expansion"] if not getattr(e.fn, "scored", True)]
        self.selector = by_kind["selector"][0] if by_kind["selector"] else None
        self.plan = by_kind["sampling"][0] if by_kind["sampling"] else None
        self.max_attempts = step.attempts
        self.metrics: dict[str, float] = {}
        self.max_steps = 0
        self.generation_time = 0.0
        self.prompts_over = 0  # prompts over rollout.max_prompt_length in the step's rounds

    # ------------------------------------------------------------------------------------------ rollout
    def rollout(self, step: int, attempt: int = 0) -> RolloutBatch:
        """G completions for each of this process's prompts; ``attempt`` > 0 (a refill) draws fresh prompts."""
        ctx, rc = self.ctx, self.rollout_cfg
        P, G = self.prompts_per_step, rc.group_size
        per_rank = P // self.world
        seed = self.seed if attempt == 0 else derive_seed(self.seed, step, attempt, "refill")
        sel = self.selector.fn if self.selector is not None else None
        rows = self.source.train_rows(step, P * (sel.pool_factor if sel else 1), seed)
        if sel is not None:
            feats = ctx.prompt_hidden([r["prompt"] for r in rows]) if sel.needs_prompt_features else None
            pick = sel.select(rows, P, seed=derive_seed(seed, step, attempt, "select"), group_size=G, features=feats)
            rows = [rows[i] for i in pick]
        rows = rows[self.rank * per_rank:(self.rank + 1) * per_rank]
        prompt_ids, over = fit_prompts([encode_prompt(ctx.tokenizer, r["prompt"], self.chat_template)
                                        for r in rows], rc.max_prompt_length)
        self.prompts_over += sum(over)
        first = self.rank * per_rank  # global index of this process's first prompt
        seeds = [derive_seed(self.seed, step, first + i, "rollout", *([attempt] if attempt else []))
                 for i in range(len(rows))]
        extra: dict[str, Any] = {"step": step, "attempt": attempt, "max_steps": self.max_steps}
        group_ids = torch.arange(len(rows)).repeat_interleave(G) + step * P + self.rank * per_rank
        if self.environment is not None:  # episodes with an environment: one row per episode (environments/episodes.py)
            env = self.environment
            return episodes.rollout(ctx, rows, G, seeds, lambda: make_environment(env.name, env.params),
                                     max_turns=env.max_turns, max_total_tokens=env.max_total_tokens,
                                     group_ids=group_ids, chat_template=self.chat_template, extra=extra,
                                     step_timeout=env.step_timeout, purify=env.purify,
                                     purify_similarity=env.purify_similarity)
        row_over = [o for o in over for _ in range(G)]
        plan_columns: dict[str, list] = {}
        if self.plan is None:
            gen = ctx.generate(prompt_ids, G, ctx.sampling, seeds)
        else:  # a sampling plan (postrl.selection.sampling): temperatures, prompt templates ...
            planned = self.plan.fn.rollout(PlanContext(
                rows=rows, prompt_ids=prompt_ids, generate=ctx.generate, params=ctx.sampling, seeds=seeds,
                group_size=G, pad_id=ctx.pad_id, encode=lambda p: encode_prompt(ctx.tokenizer, p, self.chat_template),
                encode_text=lambda text: list(ctx.tokenizer(text, add_special_tokens=False)["input_ids"]),
                fit=lambda ids: fit_prompts(ids, rc.max_prompt_length)))
            gen, plan_columns = planned.generation, planned.columns
            extra.update(planned.extra)
            if planned.over is not None:  # the plan encoded each row's own prompt: count those
                self.prompts_over += sum(planned.over) - sum(over)
                row_over = list(planned.over)
        if gen.kept_logmass is not None:  # top-p / top-k: per-token kept log-mass (sampler/kept_mass_* metrics)
            extra["sampler_kept_logmass"] = gen.kept_logmass
        keys = [k for k in rows[0] if k != "prompt"] if rows else []
        batch = RolloutBatch(
            prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, completion_ids=gen.completion_ids,
            completion_mask=gen.completion_mask.float(), group_ids=group_ids, sampler_logprobs=gen.logprobs,
            truncated=gen.truncated, prompts=[r["prompt"] for r in rows for _ in range(G)], completions=gen.texts,
            columns={**{k: [r.get(k) for r in rows for _ in range(G)] for k in keys}, **plan_columns}, extra=extra)
        if rc.prompt_overflow == "drop" and any(row_over):  # generated from the cut prompt, masked once scored
            batch.extra["prompt_dropped"] = torch.tensor(row_over)
        return batch

    def _score(self, batch: RolloutBatch) -> dict:
        """``Scorer.score``, then the groups of prompts over ``rollout.max_prompt_length`` with
        ``prompt_overflow=drop`` masked out (``valid`` False: no statistic, advantage 0, no loss)."""
        info = self.scorer.score(batch)
        dropped = batch.extra.pop("prompt_dropped", None)
        if dropped is not None:
            batch.valid = batch.valid & ~dropped
        return info

    # ------------------------------------------------------------------------------------------ the step's batch
    def next_batch(self, step: int, max_steps: int = 0) -> tuple[RolloutBatch, dict]:
        """The scored, filtered training batch of ``step`` (of ``max_steps``: what a TRL-style reward's
        ``trainer_state`` says) and the first round's reward outcome."""
        self.max_steps = max_steps
        t0 = time.perf_counter()
        self.prompts_over = 0
        batch = self.rollout(step)
        self.generation_time = time.perf_counter() - t0  # the first round's generation (time/generation)
        info = self._score(batch)
        batch = self.filter(batch)
        if self.rollout_cfg.max_prompt_length is not None:
            name = {"truncate": "prompts/truncated", "drop": "prompts/dropped"}[self.rollout_cfg.prompt_overflow]
            self.metrics[name] = float(self.prompts_over)
        return batch, info

    def filter(self, batch: RolloutBatch) -> RolloutBatch:
        """The filters, selectors and expansions on the scored first round of a step (``extra['step']``)."""
        self.metrics = {}
        if not self.stages:
            return batch
        step = int(batch.extra.get("step", 0))
        failures = 0

        def prepare(b: RolloutBatch, attempt: int) -> RolloutBatch:
            b = self._expand(b, step, attempt)
            if self.selector is not None:  # every generated group, kept or not: the selector learns from all
                self.selector.observe(b)
            return b

        def split(b: RolloutBatch) -> tuple[RolloutBatch, RolloutBatch]:
            keep = self.step.keep(b)
            return b.select(torch.nonzero(keep).flatten()), b.select(torch.nonzero(~keep).flatten())

        batch = prepare(batch, 0)
        target = batch.num_groups
        kept, dropped = split(batch)
        attempts, pad = 1, self.ctx.pad_id
        n_dropped = dropped.num_groups
        while kept.num_groups < target and attempts < self.max_attempts:
            more = self.rollout(step, attempt=attempts)
            failures += sum(self._score(more)["failures"].values())
            k, d = split(prepare(more, attempts))
            kept, dropped = concat([kept, k], pad), concat([dropped, d], pad)
            n_dropped += d.num_groups
            attempts += 1
        short = target - kept.num_groups
        if short < 0:  # more than needed: the first target groups (verl: batch[:train_batch_size])
            kept = kept.take_groups(kept.group_order()[:target])
        elif short > 0:  # cap hit: fill with dropped groups that take no part in the update
            fill = dropped.take_groups(dropped.group_order()[:short]).masked()
            kept = concat([kept, fill], pad) if len(kept) else fill
            msg = (f"step {step + 1}: filters kept {target - short} of {target} groups after {attempts} generation "
                   f"rounds (max_attempts={self.max_attempts}); the other {short} groups are masked out of the "
                   f"update")
            logging.getLogger("postrl.filters").warning(msg)
            if self.notice is not None and self.notice.once("filters_cap_hit", msg, step=step + 1, kind="warning"):
                pass
            elif self.log is not None:
                self.log(f"warning: {msg}")
        batch = kept
        if self.world > 1:
            batch = batch.pad_rows(self.max_over_processes(len(batch)))
        batch = self._unscored(batch, step)
        for e in self.stages:  # a stateful expansion (avatar_replay) records the step's final batch
            if e.kind == "expansion":
                e.observe(batch)
        if self.keepers:
            self.metrics.update({"filter/attempts": float(attempts), "filter/target_groups": float(target),
                                 "filter/dropped_groups": float(n_dropped), "filter/padded_groups": float(max(short, 0)),
                                 "filter/cap_hit": float(short > 0), "filter/refill_reward_failures": float(failures)})
        return batch

    def _context(self, e: Any, step: int, attempt: int) -> ExpandContext:
        ctx = self.ctx
        teacher = None
        if ctx.teacher_generate is not None:
            def teacher(ids, n, seeds, max_new_tokens):
                return ctx.teacher_generate(ids, n, replace(ctx.sampling, max_new_tokens=max_new_tokens), seeds)
        return ExpandContext(generate=lambda ids, n, seeds: ctx.generate(ids, n, ctx.sampling, seeds),
                             decode=lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=True),
                             encode=lambda text: list(ctx.tokenizer(text, add_special_tokens=False)["input_ids"]),
                             group_size=self.rollout_cfg.group_size, pad_id=ctx.pad_id,
                             seed=derive_seed(self.seed, step, attempt, self.rank, e.name),
                             score=lambda b: self.scorer.score(b, observe=False),
                             logprobs=lambda b: ctx.logprobs(b)[0], teacher_generate=teacher,
                             eos_id=ctx.tokenizer.eos_token_id)

    def _unscored(self, batch: RolloutBatch, step: int) -> RolloutBatch:
        """Append the rows of the expansions that are not rollouts (``scored`` False, e.g. ``rehearsal``), once,
        after the keep filters and the DDP row padding (every process appends as many): a per-row field they
        carry is 0 (None) on the batch's own rows. An expansion with ``mode = "replace"`` (``avatar_replay``)
        returns the batch itself with some groups swapped for as many rows (so DDP's row counts stay equal)."""
        for e in self.unscored:
            more = e.fn.expand(batch, self._context(e, step, 0))
            if getattr(e.fn, "mode", "append") == "replace":  # the batch itself, groups swapped (same row count)
                batch = more if more is not None else batch
                continue
            if more is None or not len(more):
                continue
            batch = concat([batch, more], self.ctx.pad_id)
        return batch

    def _expand(self, batch: RolloutBatch, step: int, attempt: int) -> RolloutBatch:
        """Append the scored rows of the expansions: new groups (cure_branching, retry_from_failure), or rows that
        join the batch's groups (``joins``: demonstrations, teacher_hint), which keep their group ids."""
        ctx = self.ctx
        for e in self.expansions:
            produce(ctx, batch, e)
            ectx = self._context(e, step, attempt)
            more = e.fn.expand(batch, ectx)
            if more is None or not len(more):
                continue
            self.scorer.score(more)
            batch.extra.setdefault("completion_prefix", [""] * len(batch))
            gids = torch.cat([batch.group_ids, more.group_ids]) if getattr(e.fn, "joins", False) else None
            batch = concat([batch, more], ctx.pad_id)
            if gids is not None:
                batch.group_ids = gids
        return batch
