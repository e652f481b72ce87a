"""The step's training batch: prompts -> rollout -> rewards and shaping -> expansions -> keep-mask filters (refill).

:class:`BatchSource` runs the batch-selection stages of the config's ``filters`` list, each by its own protocol
(``postrl.stages``; kinds ``selector``, ``sampling``, ``expansion``, ``filter``):

* a prompt **selector** picks the step's prompts from a pool of ``pool_factor`` x prompts_per_step rows (every
  process makes the same choice and takes its share) and learns, once per step, from the outcome of every group
  generated that step on every process (``update``);
* a **sampling** plan gives each completion of a group its temperature;
* **expansions** (cure_branching, retry_from_failure) append scored groups made from the scored batch;
* **keep-mask filters** drop groups; when one has ``max_attempts``, fresh prompts (seed derived from (seed, step,
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
from typing import Any, Callable

import torch

from postrl import stages
from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.data.base import stable_hash
from postrl.data.rollout_options import ExpandContext, generate_multi_temperature
from postrl.environments import make as make_environment
from postrl.errors import ConfigError
from postrl.fields import produce
from postrl.models import encode_prompt, fit_prompts
from postrl.rollout import multiturn
from postrl.train.scoring import Scorer

_HASH_MOD = 2**62


def derive_seed(*parts: Any) -> int:
    return stable_hash(*parts) % _HASH_MOD


def check(cfg: Any, all_stages: list[stages.Stage]) -> list[str]:
    """What the stages declared they need of the run: a ConfigError for a filter or a selection that cannot
    work, warnings for a dubious combination (returned)."""
    warn = []
    G = cfg.rollout.group_size
    selectors = [s.name for s in all_stages if s.kind == "selector"]
    if len(selectors) > 1:
        raise ConfigError(f"filters: at most one prompt selector per run, got {', '.join(selectors)}")
    for s in all_stages:
        if "groups" in s.needs and G < 2:
            if s.kind == "advantage":
                warn.append(f"advantage '{s.name}' uses the group as its baseline and rollout.group_size=1: every "
                            f"advantage is 0 (use reinforce_pp, remax or gae for one completion per prompt)")
            else:
                raise ConfigError(f"filters.{s.name}: rollout.group_size must be >= 2 (a group of one completion "
                                  f"has no reward variance, so every group would be dropped)")
        if s.kind == "sampling":
            s.fn.plan(G)  # raises when the group cannot hold the plan
    return warn


class BatchSource:
    """Builds each step's training batch (see the module docstring)."""

    def __init__(self, cfg: Any, source: Any, ctx: ModelContext, scorer: Scorer, *, rank: int = 0, world: int = 1,
                 gather: Callable[[Any], list] = lambda obj: [obj],
                 max_over_processes: Callable[[int], int] = lambda n: n,
                 log: Callable[[str], None] | None = None, notice: Any = None):
        self.cfg, self.source, self.ctx, self.scorer = cfg, source, ctx, scorer
        self.rank, self.world, self.gather, self.max_over_processes = rank, world, gather, max_over_processes
        self.log = log
        self.notice = notice  # run_state.Notices: what changes the run, in every mode (the first time)
        self.stages = stages.build_all(stages.FILTER_KINDS, cfg.filters)
        by_kind = {k: [s for s in self.stages if s.kind == k] for k in stages.FILTER_KINDS}
        self.keepers, self.expansions = by_kind["filter"], by_kind["expansion"]
        self.selector = by_kind["selector"][0] if by_kind["selector"] else None
        self.plan = by_kind["sampling"][0] if by_kind["sampling"] else None
        self.max_attempts = max([int(s.param("max_attempts", 1)) for s in self.keepers], default=1)
        self.metrics: dict[str, float] = {}
        self.generation_time = 0.0
        self.prompts_over = 0  # prompts over rollout.max_prompt_length in the step's rounds

    # ------------------------------------------------------------------------------------------ rollout
    def rollout(self, step: int, attempt: int = 0) -> RolloutBatch:
        """G completions for each of this process's prompts; ``attempt`` > 0 (a refill) draws fresh prompts."""
        cfg, ctx = self.cfg, self.ctx
        P, G = cfg.train.prompts_per_step, cfg.rollout.group_size
        per_rank = P // self.world
        seed = cfg.seed if attempt == 0 else derive_seed(cfg.seed, step, attempt, "refill")
        sel = self.selector.fn if self.selector is not None else None
        rows = self.source.train_rows(step, P * (sel.pool_factor if sel else 1), seed)
        if sel is not None:
            feats = ctx.prompt_hidden([r["prompt"] for r in rows]) if sel.needs_prompt_features else None
            pick = sel.select(rows, P, seed=derive_seed(seed, step, attempt, "select"), group_size=G, features=feats)
            rows = [rows[i] for i in pick]
        rows = rows[self.rank * per_rank:(self.rank + 1) * per_rank]
        prompt_ids, over = fit_prompts([encode_prompt(ctx.tokenizer, r["prompt"], cfg.model.chat_template)
                                        for r in rows], cfg.rollout.max_prompt_length)
        self.prompts_over += sum(over)
        first = self.rank * per_rank  # global index of this process's first prompt
        seeds = [derive_seed(cfg.seed, step, first + i, "rollout", *([attempt] if attempt else []))
                 for i in range(len(rows))]
        extra: dict[str, Any] = {"step": step, "attempt": attempt}
        group_ids = torch.arange(len(rows)).repeat_interleave(G) + step * P + self.rank * per_rank
        if cfg.environment is not None:  # episodes with an environment: one row per episode (rollout/multiturn.py)
            env = cfg.environment
            return multiturn.rollout(ctx, rows, G, seeds, lambda: make_environment(env.name, env.params),
                                     max_turns=env.max_turns, max_total_tokens=env.max_total_tokens,
                                     group_ids=group_ids, chat_template=cfg.model.chat_template, extra=extra)
        if self.plan is None:
            gen = ctx.generate(prompt_ids, G, ctx.sampling, seeds)
        else:
            gen, extra["temperature"] = generate_multi_temperature(ctx.generate, prompt_ids, ctx.sampling,
                                                                   self.plan.fn.plan(G), seeds, ctx.pad_id)
        if gen.kept_logmass is not None:  # top-p / top-k: per-token kept log-mass (sampler/kept_mass_* metrics)
            extra["sampler_kept_logmass"] = gen.kept_logmass
        keys = [k for k in rows[0] if k != "prompt"] if rows else []
        batch = RolloutBatch(
            prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, completion_ids=gen.completion_ids,
            completion_mask=gen.completion_mask.float(), group_ids=group_ids, sampler_logprobs=gen.logprobs,
            truncated=gen.truncated, prompts=[r["prompt"] for r in rows for _ in range(G)], completions=gen.texts,
            columns={k: [r.get(k) for r in rows for _ in range(G)] for k in keys}, extra=extra)
        if cfg.rollout.prompt_overflow == "drop" and any(over):  # generated from the cut prompt, masked once scored
            batch.extra["prompt_dropped"] = torch.tensor(over).repeat_interleave(G)
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
    def next_batch(self, step: int) -> tuple[RolloutBatch, dict]:
        """The scored, filtered training batch of ``step`` and the first round's reward outcome."""
        t0 = time.perf_counter()
        self.prompts_over = 0
        batch = self.rollout(step)
        self.generation_time = time.perf_counter() - t0  # the first round's generation (time/generation)
        info = self._score(batch)
        batch = self.filter(batch)
        if self.cfg.rollout.max_prompt_length is not None:
            name = {"truncate": "prompts/truncated", "drop": "prompts/dropped"}[self.cfg.rollout.prompt_overflow]
            self.metrics[name] = float(self.prompts_over)
        return batch, info

    def filter(self, batch: RolloutBatch) -> RolloutBatch:
        """The filters, selectors and expansions on the scored first round of a step (``extra['step']``)."""
        self.metrics = {}
        if not self.stages:
            return batch
        step = int(batch.extra.get("step", 0))
        summaries: list = []
        failures = 0

        def prepare(b: RolloutBatch, attempt: int) -> RolloutBatch:
            b = self._expand(b, step, attempt)
            if self.selector is not None:
                summaries.append(self.selector.fn.summarize(b))
            return b

        def split(b: RolloutBatch) -> tuple[RolloutBatch, RolloutBatch]:
            keep = torch.ones(len(b), dtype=torch.bool)
            for f in self.keepers:
                keep &= f(b).bool()
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
            kept, dropped = RolloutBatch.concat([kept, k], pad), RolloutBatch.concat([dropped, d], pad)
            n_dropped += d.num_groups
            attempts += 1
        short = target - kept.num_groups
        if short < 0:  # more than needed: the first target groups (verl: batch[:train_batch_size])
            kept = kept.take_groups(kept.group_order()[:target])
        elif short > 0:  # cap hit: fill with dropped groups that take no part in the update
            fill = dropped.take_groups(dropped.group_order()[:short]).masked()
            kept = RolloutBatch.concat([kept, fill], pad) if len(kept) else fill
            msg = (f"step {step + 1}: filters kept {target - short} of {target} groups after {attempts} generation "
                   f"rounds (max_attempts={self.max_attempts}); the other {short} groups are masked out of the "
                   f"update")
            logging.getLogger("postrl.filters").warning(msg)
            if self.notice is not None and self.notice.once("filters_cap_hit", msg, step=step + 1, kind="warning"):
                pass
            elif self.log is not None:
                self.log(f"warning: {msg}")
        batch = kept
        if self.selector is not None:  # every process's outcomes, so every process keeps the same state
            self.selector.fn.update([row for part in self.gather(summaries) for rows in part for row in rows])
            self.metrics.update(self.selector.fn.metrics())
        if self.world > 1:
            batch = batch.pad_rows(self.max_over_processes(len(batch)))
        if self.keepers:
            self.metrics.update({"filter/attempts": float(attempts), "filter/target_groups": float(target),
                                 "filter/dropped_groups": float(n_dropped), "filter/padded_groups": float(max(short, 0)),
                                 "filter/cap_hit": float(short > 0), "filter/refill_reward_failures": float(failures)})
        return batch

    def _expand(self, batch: RolloutBatch, step: int, attempt: int) -> RolloutBatch:
        """Append the scored groups of the expansions (cure_branching, retry_from_failure)."""
        ctx = self.ctx
        for e in self.expansions:
            produce(ctx, batch, e)
            ectx = ExpandContext(generate=lambda ids, n, seeds: ctx.generate(ids, n, ctx.sampling, seeds),
                                 decode=lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=True),
                                 group_size=self.cfg.rollout.group_size, pad_id=ctx.pad_id,
                                 seed=derive_seed(self.cfg.seed, step, attempt, self.rank, e.name))
            more = e.fn.expand(batch, ectx)
            if more is None or not len(more):
                continue
            self.scorer.score(more)
            batch.extra.setdefault("branch", torch.zeros(len(batch), dtype=torch.bool))
            batch.extra.setdefault("completion_prefix", [""] * len(batch))
            batch = RolloutBatch.concat([batch, more], ctx.pad_id)
        return batch
