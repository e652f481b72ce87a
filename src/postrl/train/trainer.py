"""The RL trainer: orders the stages, owns the model, optimizer and checkpoints, and nothing else.

One step (see ARCHITECTURE.md):
  prompts -> rollout -> rewards -> shaping -> filters -> advantages -> (old / reference log-probs)
  -> loss (+ KL) over epochs x mini-batches x micro-batches -> optimizer -> metrics, samples, checkpoint.

All randomness of step s derives from (seed, s, rank): prompts, sampling and mini-batch shuffling. A resumed run
therefore only needs the weights, optimizer and scheduler state to continue exactly as the uninterrupted run.
Built on Accelerate: ``accelerate launch --cpu --num_processes 2 -m postrl train ...`` runs DDP over gloo; each
process takes its share of the step's prompts, gradients are averaged, metrics reduced across processes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch

from postrl import registry
from postrl.batch import RolloutBatch
from postrl.config import Config, dump_yaml
from postrl.data import load_source
from postrl.data.base import stable_hash
from postrl.errors import ConfigError, PostrlError
from postrl.evaluate import evaluate
from postrl.losses import KLController, check_aggregation, kl_reward_penalty, make_stage, stage_fields, tis_weights
from postrl import accel
from postrl.models import encode_prompt, load_model_and_tokenizer
from postrl.pipeline import call_stage
from postrl.rewards import RewardContext, score_batch
from postrl.rewards.core import wants
from postrl.rewards.steps import split_steps, step_token_ends
from postrl.rollout.base import SamplingParams
from postrl.shaping import build_stage, load_stages_state, stages_state
from postrl.train import checkpoint as ckpt
from postrl.data.rollout_options import ExpandContext
from postrl.train import stage_ops

_HASH_MOD = 2**62
_reward_log = logging.getLogger("postrl.rewards")


def _seed(*parts: Any) -> int:
    return stable_hash(*parts) % _HASH_MOD


def make_scheduler(optimizer, warmup: int, total: int, schedule: str):
    """Linear warmup over ``warmup`` optimizer steps, then constant / linear decay to 0 / cosine decay to 0."""

    def factor(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (s - warmup) / max(1, total - warmup))
        return 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_into_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` folded into the next step of a fused Adam/AdamW
    ``optimizer``: returns the gradients' total 2-norm ``n`` and sets the optimizer's ``grad_scale`` to
    ``max(1, (n + 1e-6) / max_norm)``, by which the fused kernel divides each gradient as it reads it. The step is
    that of clipping (``g * min(1, max_norm / (n + 1e-6))``) up to float rounding, without a pass that rewrites the
    gradients (1M parameters on a 2-core Zen 5: the clip 0.22 vs 0.13 ms, with the step 0.56-0.62 vs 0.52 ms).
    The caller sets ``grad_scale`` back to None after the step; a non-finite ``n`` is the caller's to handle (the
    step must not run)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    return norm


def resolve_model_path(cfg: Config, log: Callable[[str], None] = print) -> Path:
    if cfg.model.path == "builtin":
        from postrl.models.builtin import ensure_builtin

        return ensure_builtin(cfg, log=log)
    return Path(cfg.model.path)


def _jsonl_truncate(path: Path, max_step: int) -> None:
    """Keep only the lines of ``path`` whose step is <= max_step (a resumed run rewrites what follows)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= max_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)


class Trainer:
    """Runs ``cfg.train.steps`` RL steps and writes the run directory."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False,
                 reporter: Any | None = None):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.acc = Accelerator(cpu=not torch.cuda.is_available(),
                               kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)])
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.main = self.acc.is_main_process
        if cfg.train.prompts_per_step % self.world:
            raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be divisible by the "
                              f"number of processes ({self.world})")
        self.reporter = reporter
        log = reporter.log if reporter is not None else print
        self.source = load_source(cfg.task.model_dump())
        path = resolve_model_path(cfg, log=log if self.main else (lambda s: None))
        self.model_path = path
        model, self.tokenizer = load_model_and_tokenizer(path, cfg.model.dtype)
        model.config.use_cache = False
        # the CPU speed layer (postrl.accel), applied to the model once: threads, generator and log-prob paths
        self.accel = accel.prepare(model, cfg.accel, self.acc.device)
        self.ref_model = None
        self._setup_losses()
        if "ref_logp" in self.loss_fields:
            self.ref_model, _ = load_model_and_tokenizer(path, cfg.model.dtype)
            self.ref_model.requires_grad_(False).eval().to(self.acc.device)
            self.accel.apply(self.ref_model)
        # stages
        self.reward_specs = cfg.rewards
        self.reward_fns = [build_stage("reward", r.name, r.params)[:2] for r in cfg.rewards]  # classes keep state
        if any(getattr(fn, "__module__", "") == "postrl.rewards.code" or
               type(fn).__module__ == "postrl.rewards.code" for fn, _ in self.reward_fns):
            from postrl.sandbox import capabilities

            caps = capabilities()  # at start-up: a limit this machine cannot enforce is said now, not mid-run
            if caps.get("warning") and reporter is not None and self.main:
                reporter.log(f"warning: {caps['warning']}")
        self.reward_weights = torch.tensor(cfg.reward.weights if cfg.reward.weights is not None
                                           else [r.weight for r in cfg.rewards], dtype=torch.float32)
        self.shaping = [build_stage("shaping", s.name, s.params) for s in cfg.shaping]  # classes keep state
        self.filters = [build_stage("filter", s.name, s.params) for s in cfg.filters]  # classes keep state
        self.advantage_fn, self.advantage_params, _ = build_stage("advantage", cfg.advantage.name,
                                                                  cfg.advantage.params)
        self.stage_metrics: dict[str, float] = {}  # filter / value-head metrics of the current step
        for msg in stage_ops.check_stages(cfg, self.filters):
            warnings.warn(msg, stacklevel=2)
        # optimisation
        torch.manual_seed(cfg.seed)
        decay, no_decay = [], []
        for n, p in model.named_parameters():
            (no_decay if p.dim() < 2 else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
            fused=True)  # one kernel per parameter group (CPU and CUDA); the same update as the per-tensor loop
        total = cfg.train.steps * cfg.train.epochs * cfg.train.mini_batches
        self.scheduler = make_scheduler(self.optimizer, cfg.optim.warmup_steps, total, cfg.optim.schedule)
        self.model, self.optimizer = self.acc.prepare(model, self.optimizer)
        self.params = list(self.model.parameters())
        from accelerate.utils import DistributedType

        # the gradient clip folded into the fused AdamW step (clip_into_step), where nothing else scales gradients
        self.clip_opt = self.optimizer.optimizer if self.acc.scaler is None and self.acc.distributed_type in (
            DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU) else None
        self.backend = self._make_backend()
        self.start_step = 0
        self.eval_before: dict | None = None
        if resume:
            self._resume()
        elif self.main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
            for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
                (self.run_dir / name).write_text("")
        # diagnostics: metrics beyond the batch, monitors and alarms, sinks (postrl/diagnostics/hooks.py)
        from postrl.diagnostics.hooks import Diagnostics

        self.diag = Diagnostics(self)
        if resume:
            self.diag.load_state_dict(self._resumed_state.get("diagnostics"))

    # ------------------------------------------------------------------------------------------------ set-up
    @property
    def policy(self):
        # Unwrapped once per wrapped module: accelerate's unwrap_model walks every submodule and looks up optional
        # packages at each call (about 0.3 ms, several times a step).
        if getattr(self, "_unwrapped", (None, None))[0] is not self.model:
            self._unwrapped = (self.model, self.acc.unwrap_model(self.model))
        return self._unwrapped[1]

    def _make_backend(self):
        if self.cfg.rollout.backend == "vllm":
            raise ConfigError("rollout.backend: 'vllm' is not available in this version; use 'hf'")
        return self.accel.generator(self.policy, self.tokenizer, batch_size=self.cfg.rollout.batch_size)

    def _reward_stages(self) -> list[tuple[Any, dict, str]]:
        return [(fn, params, r.name) for (fn, params), r in zip(self.reward_fns, self.reward_specs)]

    def _resume(self) -> None:
        last = ckpt.latest_checkpoint(self.run_dir)
        if last is None:
            raise PostrlError(f"--resume {self.run_dir}: no complete checkpoint in {self.run_dir / 'checkpoints'}")
        state = ckpt.load_checkpoint(last, self.policy, self.optimizer, self.scheduler)
        self.start_step = int(state["step"])
        self._resumed_state = state
        self.eval_before = state.get("eval_before")
        load_stages_state(self._reward_stages(), state.get("rewards"))
        load_stages_state(self.shaping, state.get("shaping"))
        load_stages_state(self.filters, state.get("filters"))
        load_stages_state([(self.advantage_fn, {}, self.cfg.advantage.name)], state.get("advantage"))
        self._load_loss_state(state.get("losses"))
        if self.main:
            for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
                _jsonl_truncate(self.run_dir / name, self.start_step)

    # ------------------------------------------------------------------------------------------------ stages
    def rollout(self, step: int, attempt: int = 0) -> RolloutBatch:
        """G completions for each of this process's prompts. ``attempt`` > 0 (a refill, see ``filter``) draws fresh
        prompts with a seed derived from (seed, step, attempt). A prompt selector (pass_rate_curriculum, insight,
        pcl) picks the step's prompts from a pool of pool_factor x prompts_per_step rows (every process makes the
        same choice and takes its share); multi_temperature samples each group across its temperatures."""
        cfg = self.cfg
        P, G = cfg.train.prompts_per_step, cfg.rollout.group_size
        per_rank = P // self.world
        seed = cfg.seed if attempt == 0 else _seed(cfg.seed, step, attempt, "refill")
        selector = next((fn for fn, _, _ in self.filters if hasattr(fn, "select")), None)
        rows = self.source.train_rows(step, P * (selector.pool_factor if selector else 1), seed)
        if selector is not None:
            feats = stage_ops.prompt_features(self, rows) if selector.needs_prompt_features else None
            pick = selector.select(rows, P, seed=_seed(seed, step, attempt, "select"), group_size=G, features=feats)
            rows = [rows[i] for i in pick]
        rows = rows[self.rank * per_rank:(self.rank + 1) * per_rank]
        prompt_ids = [encode_prompt(self.tokenizer, r["prompt"], cfg.model.chat_template) for r in rows]
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, stop=list(cfg.rollout.stop),
                                ignore_eos=cfg.rollout.ignore_eos)
        first = self.rank * per_rank  # global index of this process's first prompt
        seeds = [_seed(cfg.seed, step, first + i, "rollout", *([attempt] if attempt else [])) for i in range(len(rows))]
        multi = next((fn for fn, _, _ in self.filters if hasattr(fn, "plan")), None)
        extra: dict[str, Any] = {"step": step, "attempt": attempt}
        if multi is None:
            gen = self.backend.generate(prompt_ids, G, params, seeds)
        else:
            gen, extra["temperature"] = stage_ops.generate_multi_temperature(self.backend, prompt_ids, params,
                                                                            multi.plan(G), seeds)
        keys = [k for k in rows[0] if k != "prompt"] if rows else []
        columns = {k: [r.get(k) for r in rows for _ in range(G)] for k in keys}
        group_ids = torch.arange(len(rows)).repeat_interleave(G) + step * cfg.train.prompts_per_step \
            + self.rank * per_rank
        return RolloutBatch(
            prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, completion_ids=gen.completion_ids,
            completion_mask=gen.completion_mask.float(), group_ids=group_ids, sampler_logprobs=gen.logprobs,
            truncated=gen.truncated, prompts=[r["prompt"] for r in rows for _ in range(G)], completions=gen.texts,
            columns=columns, extra=extra)

    def score(self, batch: RolloutBatch) -> dict:
        """Rewards, then shaping. Every source scores every completion (parallel, per-call timeout, failures
        isolated as NaN and counted; ``cfg.reward``); step texts / step ends are computed when a source or stage
        asks for them; the shaping stages run in config order; ``valid`` marks the completions with a finite
        reward. A source failing on more than ``reward.alarm_rate`` of the batch logs a warning."""
        rc = self.cfg.reward
        columns = {**batch.columns, "group_ids": batch.group_ids.tolist()}
        if any(wants(registry.get("reward", r.name), "steps") for r in self.reward_specs):
            columns["steps"] = [split_steps(c, rc.step_delimiter) for c in batch.completions]
        ctx = RewardContext(model=self.policy, tokenizer=self.tokenizer, device=self.acc.device,
                            chat_template=self.cfg.model.chat_template)
        outcome = score_batch(batch.prompts, batch.completions, columns, self.reward_specs, built=self.reward_fns,
                              context=ctx,
                              strict=rc.strict, timeout=rc.timeout, workers=rc.workers, chunk_size=rc.chunk_size)
        batch.reward_names = [r.name for r in self.reward_specs]
        batch.rewards = outcome.matrix
        batch.reward_weights = self.reward_weights
        batch.raw_rewards = outcome.matrix.clone()  # before shaping (metrics, filters on raw rewards)
        batch.extra["raw_reward_names"] = tuple(batch.reward_names)
        batch.step_rewards = outcome.step_rewards
        if outcome.step_source is not None:
            batch.extra["step_reward_source"] = outcome.step_source
        if outcome.step_rewards is not None or any(wants(fn, "step_ends") for fn, _, _ in self.shaping):
            batch.step_ends = step_token_ends(batch.completion_ids, batch.lengths, batch.completions,
                                              self.tokenizer, rc.step_delimiter)
        for fn, params, name in self.shaping:
            out = call_stage(fn, batch, params, what=f"shaping '{name}'")
            for k, v in out.items():
                if k in RolloutBatch.__dataclass_fields__:
                    setattr(batch, k, v)
                else:  # e.g. min_form's step_returns
                    batch.extra[k] = v
        if batch.reward is None:
            raise ConfigError("shaping: no stage produced the scalar reward; add {name: weighted_sum}")
        batch.valid = torch.isfinite(batch.reward)
        for r in self.reward_specs:
            rate = outcome.failure_rate(r.name)
            if rate > rc.alarm_rate:
                msg = (f"reward '{r.name}' failed on {rate:.0%} of the batch (reward.alarm_rate={rc.alarm_rate:g});"
                       f" first failure: {outcome.first_failure.get(r.name)}")
                _reward_log.warning(msg)
                if self.reporter is not None and self.main:
                    self.reporter.log(f"warning: {msg}")
        return {"failures": outcome.failures, "first_failure": outcome.first_failure,
                "failure_rate": {r.name: outcome.failure_rate(r.name) for r in self.reward_specs}}

    def filter(self, batch: RolloutBatch) -> RolloutBatch:
        """Filters and rollout options on the scored batch (``postrl.data.filters`` describes the protocol).

        Expanding options (cure_branching, retry_from_failure) append scored groups; keep-mask filters drop groups
        and, when one has ``max_attempts``, new prompts are generated (``rollout(step, attempt)``), scored and
        filtered until the batch holds as many groups as the unfiltered first round, or the cap is hit: then the
        shortfall is filled with dropped groups masked out of the loss (``valid`` False), a warning is logged and
        ``filter/cap_hit`` is 1. Prompt selectors then observe every group generated this step, from every process.
        Under DDP every process ends with the same number of rows (masked copies pad the shorter ones)."""
        self.stage_metrics = {}
        if not self.filters:
            return batch
        step = int(batch.extra.get("step", 0))
        keepers = [(fn, p, n) for fn, p, n in self.filters if stage_ops.is_keep_mask(fn)]
        selectors = [(i, fn) for i, (fn, _, _) in enumerate(self.filters) if hasattr(fn, "observe")]
        summaries: list = []
        failures = 0

        def prepare(b: RolloutBatch, attempt: int) -> RolloutBatch:
            b = self._expand(b, step, attempt)
            for i, sel in selectors:
                summaries.append((i, sel.summarize(b)))
            return b

        def split(b: RolloutBatch) -> tuple[RolloutBatch, RolloutBatch]:
            keep = torch.ones(len(b), dtype=torch.bool)
            for fn, params, name in keepers:
                keep &= call_stage(fn, b, params, what=f"filter '{name}'").bool()
            return b.select(torch.nonzero(keep).flatten()), b.select(torch.nonzero(~keep).flatten())

        batch = prepare(batch, 0)
        target = batch.num_groups
        kept, dropped = split(batch)
        attempts, cap = 1, stage_ops.max_attempts(self.filters)
        n_dropped = dropped.num_groups
        pad = self.backend.pad_id
        while kept.num_groups < target and attempts < cap:
            more = self.rollout(step, attempt=attempts)
            failures += sum(self.score(more)["failures"].values())
            k, d = split(prepare(more, attempts))
            kept, dropped = RolloutBatch.concat([kept, k], pad), RolloutBatch.concat([dropped, d], pad)
            n_dropped += d.num_groups
            attempts += 1
        short = target - kept.num_groups
        if short < 0:  # more than needed: the first target groups (verl: batch[:train_batch_size])
            kept = stage_ops.take_groups(kept, stage_ops.groups_in_order(kept)[:target])
        elif short > 0:  # cap hit: fill with dropped groups that take no part in the update
            fill = stage_ops.mask_rows(stage_ops.take_groups(dropped, stage_ops.groups_in_order(dropped)[:short]))
            kept = RolloutBatch.concat([kept, fill], pad) if len(kept) else fill
            msg = (f"step {step + 1}: filters kept {target - short} of {target} groups after {attempts} generation "
                   f"rounds (max_attempts={cap}); the other {short} groups are masked out of the update")
            logging.getLogger("postrl.filters").warning(msg)
            if self.reporter is not None and self.main:
                self.reporter.log(f"warning: {msg}")
        batch = kept
        if selectors:  # every process's outcomes, so every process keeps the same selector state
            gathered = self._gather(summaries)
            for i, sel in selectors:
                sel.observe([row for part in gathered for key, rows in part if key == i for row in rows])
        if self.world > 1:
            import torch.distributed as dist

            n = torch.tensor([len(batch)], device=self.acc.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            batch = stage_ops.pad_rows(batch, int(n))
        m = self.stage_metrics
        if keepers:
            m.update({"filter/attempts": float(attempts), "filter/target_groups": float(target),
                      "filter/dropped_groups": float(n_dropped), "filter/padded_groups": float(max(short, 0)),
                      "filter/cap_hit": float(short > 0), "filter/refill_reward_failures": float(failures)})
        for fn, _, _ in self.filters:
            if hasattr(fn, "metrics"):
                m.update(fn.metrics())
        return batch

    def _expand(self, batch: RolloutBatch, step: int, attempt: int) -> RolloutBatch:
        """Append the scored groups of the expanding options (cure_branching, retry_from_failure)."""
        cfg = self.cfg
        for fn, _, name in self.filters:
            if not hasattr(fn, "expand"):
                continue
            stage_ops.produce(self, batch, list(getattr(fn, "needs", ())), {})
            params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                    top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, stop=list(cfg.rollout.stop),
                                    ignore_eos=cfg.rollout.ignore_eos)
            ctx = ExpandContext(generate=lambda ids, n, seeds: self.backend.generate(ids, n, params, seeds),
                                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                                group_size=cfg.rollout.group_size, pad_id=self.backend.pad_id,
                                seed=_seed(cfg.seed, step, attempt, self.rank, name))
            more = fn.expand(batch, ctx)
            if more is None or not len(more):
                continue
            self.score(more)
            batch.extra.setdefault("branch", torch.zeros(len(batch), dtype=torch.bool))
            batch.extra.setdefault("completion_prefix", [""] * len(batch))
            batch = RolloutBatch.concat([batch, more], self.backend.pad_id)
        return batch

    def _gather(self, obj: Any) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def _all_reduce_mean(self, t: torch.Tensor) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
            t /= self.world

    def advantages(self, batch: RolloutBatch) -> None:
        """The advantage stage. Inputs it names that the batch lacks (greedy_reward, token_entropy, prompt_logprob,
        info_gain) are produced first (``postrl.train.stage_ops``); an estimator with a value head (gae) gets
        ``values`` from the policy's hidden states and then fits the head on this batch's returns."""
        fn = self.advantage_fn
        stage_ops.produce(self, batch, stage_ops.positional_fields(fn), self.cfg.advantage.params)
        hidden = None
        if hasattr(fn, "fit"):
            hidden = stage_ops.completion_hidden(self, batch)
            batch.extra["values"] = fn.values(hidden)
        batch.advantages = call_stage(fn, batch, self.advantage_params, what=f"advantage '{self.cfg.advantage.name}'")
        if hidden is not None:
            self.stage_metrics.update(fn.fit(hidden, batch.reward, batch.completion_mask, batch.valid,
                                             batch.extra["values"], all_reduce=self._all_reduce_mean))

    # ------------------------------------------------------------------------------------------------ update
    def _setup_losses(self) -> None:
        """Policy loss, aggregation, KL (estimator, placement, controller) and regularisers from cfg.loss / cfg.kl /
        cfg.regularizers; ``loss_fields`` = the per-token fields they read (a reference model is loaded when it
        holds ``ref_logp``; logits are kept only when it holds ``logits``; the entropy is differentiated only when
        a stage reads it without listing it in its ``no_grad_fields``)."""
        cfg = self.cfg
        self.loss_fn = registry.get("loss", cfg.loss.name)
        self.agg_fn = registry.get("aggregation", cfg.loss.agg)
        self.kl_fn = registry.get("regularizer", f"kl_{cfg.kl.estimator}") if cfg.kl.coef > 0 else None
        self.kl_ctrl = KLController(cfg.kl.coef, adaptive=cfg.kl.controller == "adaptive", target=cfg.kl.target,
                                    horizon=cfg.kl.horizon)
        self.regularizers = []  # (callable, call params, coef, metric name: the stage name, ".i" when repeated)
        names = [s.name for s in cfg.regularizers]
        for i, spec in enumerate(cfg.regularizers):
            fn, params = make_stage(registry.get("regularizer", spec.name), spec.params)
            label = spec.name if names.count(spec.name) == 1 else f"{spec.name}.{i}"
            self.regularizers.append((fn, params, spec.coef, label))
        stages = [self.loss_fn] + [r[0] for r in self.regularizers]
        self.loss_fields = set().union(*(stage_fields(f) for f in stages))
        if self.kl_fn is not None:
            self.loss_fields.add("ref_logp")
        self.entropy_grad = any("entropy" in stage_fields(f) and "entropy" not in getattr(f, "no_grad_fields", ())
                                for f in stages)
        msg = check_aggregation(cfg.loss.name, self.loss_fn, cfg.loss.agg)
        if msg:
            warnings.warn(msg, stacklevel=2)
            if self.reporter is not None and self.main:
                self.reporter.log(f"warning: {msg}")

    def _logprobs(self, model, batch: RolloutBatch, idx: torch.Tensor, with_entropy: bool = False,
                  entropy_grad: bool = False, with_logits: bool = False):
        """(logp [n, T], entropy [n, T] or None, temperature-scaled logits [n, T, V] or None) for rows ``idx``."""
        dev = self.acc.device
        out = self.accel.logprobs(model, batch.prompt_ids[idx].to(dev), batch.prompt_mask[idx].to(dev),
                                  batch.completion_ids[idx].to(dev), self.cfg.rollout.temperature or 1.0,
                                  with_entropy=with_entropy, entropy_grad=entropy_grad, return_logits=with_logits)
        return out if with_logits else (*out, None)

    @torch.no_grad()
    def _frozen_logprobs(self, model, batch: RolloutBatch) -> torch.Tensor:
        mbs = self.cfg.train.micro_batch_size
        outs = [self._logprobs(model, batch, torch.arange(i, min(i + mbs, len(batch))))[0].cpu()
                for i in range(0, len(batch), mbs)]
        return torch.cat(outs)

    def kl_in_reward(self, batch: RolloutBatch) -> None:
        """``kl.placement=reward``: r_i <- r_i - coef * sum_t m_it KL_it before the advantages (verl
        ``use_kl_in_reward``); KL from the policy that generated the batch and the reference model. The per-token
        values go to ``batch.extra['kl_token']``."""
        if self.kl_fn is None or self.cfg.kl.placement != "reward" or len(batch) == 0:
            return
        batch.old_logprobs = self._frozen_logprobs(self.policy, batch)
        batch.ref_logprobs = self._frozen_logprobs(self.ref_model, batch)
        seq, tok, _ = kl_reward_penalty(batch.old_logprobs, batch.ref_logprobs, batch.completion_mask, self.kl_fn)
        batch.reward = batch.reward - self.kl_ctrl.value * seq
        batch.extra["kl_token"] = tok

    def _loss_inputs(self, batch: RolloutBatch, idx: torch.Tensor, logp, old, ent, logits, m) -> dict:
        """The per-token fields losses and regularisers read by name, for the micro-batch rows ``idx``; per-row
        tensors earlier stages put in ``batch.extra`` are sliced along."""
        dev = logp.device
        fields = {"logp": logp, "old_logp": old, "advantages": batch.advantages[idx].to(dev), "mask": m,
                  "entropy": ent, "logits": logits, "lengths": m.sum(-1),
                  "sampler_logp": batch.sampler_logprobs[idx].to(dev),
                  "ref_logp": batch.ref_logprobs[idx].to(dev) if batch.ref_logprobs is not None else None}
        for k, v in batch.extra.items():
            if k not in fields and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == len(batch):
                fields[k] = v[idx].to(dev)
        return fields

    def update(self, batch: RolloutBatch, step: int) -> dict:
        """Epochs x mini-batches x micro-batches of: policy loss (x TIS weight x regulariser masks), aggregated
        with the mini-batch's weights, + KL + regularisers; one optimizer step per mini-batch."""
        cfg = self.cfg
        multi_pass = cfg.train.epochs > 1 or cfg.train.mini_batches > 1
        t0 = time.perf_counter()
        if multi_pass and batch.old_logprobs is None:  # the policy that generated the batch
            batch.old_logprobs = self._frozen_logprobs(self.policy, batch)
        if self.ref_model is not None and batch.ref_logprobs is None:
            batch.ref_logprobs = self._frozen_logprobs(self.ref_model, batch)
        t_ref = time.perf_counter() - t0
        loss_mask = batch.completion_mask * batch.valid.unsqueeze(-1).float()
        n = len(batch)
        kl_in_loss = self.kl_fn is not None and cfg.kl.placement == "loss"
        tis = cfg.loss.tis
        gen = torch.Generator().manual_seed(_seed(cfg.seed, step, self.rank, "shuffle"))
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        if not (self.model.training and self.policy.training):  # (a walk over every module: 0.1 ms)
            self.model.train()
        for _ in range(cfg.train.epochs):
            order = torch.randperm(n, generator=gen) if cfg.train.mini_batches > 1 else torch.arange(n)
            for mb in order.chunk(cfg.train.mini_batches):
                weights = self.agg_fn(loss_mask[mb], max_len=cfg.rollout.max_new_tokens)
                micro = list(torch.arange(len(mb)).split(cfg.train.micro_batch_size))
                for j, sel in enumerate(micro):
                    idx = mb[sel]
                    sync = j == len(micro) - 1
                    with (nullcontext() if sync else self.acc.no_sync(self.model)):
                        logp, ent, logits = self._logprobs(self.model, batch, idx, with_entropy=True,
                                                           entropy_grad=self.entropy_grad,
                                                           with_logits="logits" in self.loss_fields)
                        old = batch.old_logprobs[idx].to(logp.device) if multi_pass else logp.detach()
                        m = loss_mask[idx].to(logp.device)
                        w = weights[sel].to(logp.device)
                        fields = self._loss_inputs(batch, idx, logp, old, ent, logits, m)
                        loss_mat, info = call_stage(self.loss_fn, fields, cfg.loss.params,
                                                    what=f"loss '{cfg.loss.name}'")
                        stats: dict[str, float] = {}
                        if tis.level != "none":
                            tw = tis_weights(old.detach(), fields["sampler_logp"], m, level=tis.level, mode=tis.mode,
                                             cap=tis.cap)
                            loss_mat = loss_mat * tw
                            stats["tis/weight"] = float((w * tw).sum())
                            stats["tis/capped"] = float((w * (tw >= tis.cap).float()).sum()) if tis.mode == "truncate" \
                                else float((w * (tw == 0).float()).sum())
                        reg_loss = 0.0
                        for fn, params, coef, name in self.regularizers:
                            out = call_stage(fn, fields, params, what=f"regularizer '{name}'")
                            term = out.get("loss") if isinstance(out, dict) else out
                            if isinstance(out, dict) and out.get("pg_mask") is not None:
                                loss_mat = loss_mat * out["pg_mask"]
                                stats[f"reg/{name}/kept"] = float((w * out["pg_mask"].detach()).sum())
                            if term is not None:
                                agg = (w * term).sum()
                                reg_loss = reg_loss + coef * agg
                                stats[f"reg/{name}"] = agg.item()
                        pg = (w * loss_mat).sum()
                        loss = pg + reg_loss
                        stats["pg_loss"] = pg.item()
                        stats["entropy"] = float((w * ent.detach()).sum())
                        if kl_in_loss:
                            kl = self.kl_fn(logp, fields["ref_logp"])
                            kl_term = (w * kl).sum()
                            loss = loss + self.kl_ctrl.value * kl_term
                            stats["kl"] = kl_term.item()
                        for key, val in info.items():
                            if val.dtype == torch.bool:
                                stats[key] = float((w * val.float()).sum())
                        stats["ratio_max"] = float((info["ratio"] * m).max()) if "ratio" in info else 1.0
                        self.acc.backward(loss)
                        self.diag.observe_micro(batch, idx, logp, old, info, first_pass=not multi_pass)  # diagnostics
                    for k, v in stats.items():
                        sums[k] = max(sums.get(k, v), v) if k == "ratio_max" else sums.get(k, 0.0) + v
                max_norm = cfg.optim.max_grad_norm or float("inf")
                gn = clip_into_step(self.params, self.clip_opt, max_norm) if self.clip_opt is not None \
                    else self.acc.clip_grad_norm_(self.params, max_norm)
                grad_norms.append(float(gn))
                if self.diag.nan_guard(gn, batch, step):  # diagnostics: a non-finite gradient never reaches the
                    self.optimizer.zero_grad(set_to_none=True)  # optimizer; the step is skipped, counted, saved
                    if self.clip_opt is not None:
                        self.clip_opt.grad_scale = None
                    continue
                self.optimizer.step()
                if self.clip_opt is not None:
                    self.clip_opt.grad_scale = None
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        steps_taken = cfg.train.epochs * cfg.train.mini_batches
        out = {k: (v if k == "ratio_max" else v / steps_taken) for k, v in sums.items()}
        if "kl_token" in batch.extra:  # kl.placement=reward: mean over rows of the per-token mean (verl current_kl)
            lens = loss_mask.sum(-1)
            has = lens > 0
            out["kl_reward"] = float((batch.extra["kl_token"].sum(-1)[has] / lens[has]).mean()) if has.any() else 0.0
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["time/ref"] = t_ref
        return out

    def _end_step(self, metrics: dict, n_seq: int) -> None:
        """After a step, with the metrics reduced over processes: adapt the KL coefficient (measured ``kl`` or
        ``kl_reward``, over ``n_seq`` sequences) and the stateful regularisers; log their values."""
        if self.kl_fn is not None:
            metrics["kl_coef"] = self.kl_ctrl.value  # the value this step used
            current = metrics.get("kl_reward" if self.cfg.kl.placement == "reward" else "kl")
            if current is not None:
                self.kl_ctrl.update(current, n_seq)
        for fn, _, _, name in self.regularizers:
            if hasattr(fn, "state_dict"):  # the values this step used
                for k, v in fn.state_dict().items():
                    if isinstance(v, (int, float)):
                        metrics[f"reg/{name}/{k}"] = float(v)
            if hasattr(fn, "end_step"):
                fn.end_step(metrics)

    def _loss_state(self) -> dict:
        """JSON state of the KL controller and stateful regularisers (saved in trainer_state.json)."""
        return {"kl": self.kl_ctrl.state_dict(),
                "regularizers": [fn.state_dict() if hasattr(fn, "state_dict") else None
                                 for fn, *_ in self.regularizers]}

    def _load_loss_state(self, state: dict | None) -> None:
        if not state:
            return
        self.kl_ctrl.load_state_dict(state["kl"])
        for (fn, *_), s in zip(self.regularizers, state.get("regularizers", [])):
            if s is not None and hasattr(fn, "load_state_dict"):
                fn.load_state_dict(s)

    # ------------------------------------------------------------------------------------------------ metrics
    def batch_metrics(self, batch: RolloutBatch, reward_info: dict) -> dict:
        """Per-step metrics of the batch (rewards, accuracy, groups, advantages, lengths, tokens): see
        ``postrl.diagnostics.metrics.batch_metrics`` and docs/metrics.md."""
        from postrl.diagnostics.metrics import batch_metrics

        m = batch_metrics(batch, reward_info, low_prob=self.cfg.diagnostics.entropy_collapse.low_prob)
        for name, rate in reward_info.get("failure_rate", {}).items():  # of the scored batch (before filters)
            m[f"reward/{name}/failure_rate"] = rate
        return m

    def _reduce(self, metrics: dict) -> dict:
        """Average metrics over processes; keys ending in min / max are reduced as min / max."""
        if self.world == 1:
            return metrics
        import torch.distributed as dist

        out = {}
        for op, pick in ((dist.ReduceOp.MAX, lambda k: k.endswith("max")),
                         (dist.ReduceOp.MIN, lambda k: k.endswith("min")),
                         (dist.ReduceOp.SUM, lambda k: not k.endswith(("max", "min")))):
            keys = sorted(k for k in metrics if pick(k))
            t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.acc.device)
            dist.all_reduce(t, op=op)
            if op == dist.ReduceOp.SUM:
                t = t / self.world
            out.update(zip(keys, t.tolist()))
        return out

    def _write_samples(self, step: int, batch: RolloutBatch, k: int = 2) -> None:
        G = self.cfg.rollout.group_size
        lines = []
        for i in range(min(len(batch), k * G)):
            lines.append(json.dumps({
                "step": step, "prompt": batch.prompts[i], "completion": batch.completions[i],
                "rewards": {n: _f(batch.rewards[i, j]) for j, n in enumerate(batch.reward_names)},
                "reward": _f(batch.reward[i]), "advantage": _f(batch.advantages[i].mean()),
                "truncated": bool(batch.truncated[i]), "valid": bool(batch.valid[i]),
            }))
        with open(self.run_dir / "samples.jsonl", "a") as f:
            f.write("".join(line + "\n" for line in lines))

    # ------------------------------------------------------------------------------------------------ run
    def evaluate(self, tag: str, step: int) -> dict:
        cfg = self.cfg
        rows = self.source.eval_rows(cfg.train.eval_size, cfg.seed)
        res = evaluate(self.backend, self.tokenizer, self.source, rows, max_new_tokens=cfg.rollout.max_new_tokens,
                       k=cfg.train.eval_k, temperature=cfg.rollout.temperature or 1.0, seed=_seed(cfg.seed, "eval"),
                       chat_template=cfg.model.chat_template, stop=cfg.rollout.stop)
        res = {"step": step, "tag": tag, **res}
        if self.main:
            with open(self.run_dir / "eval.jsonl", "a") as f:
                f.write(json.dumps(res) + "\n")
            self.diag.on_eval(res)  # diagnostics
        return res

    def save(self, step: int) -> None:
        self.acc.wait_for_everyone()
        if self.main:
            ckpt.save_checkpoint(self.run_dir, step, self.policy, self.tokenizer, self.optimizer, self.scheduler,
                                 {"seed": self.cfg.seed, "eval_before": self.eval_before,
                                  "rewards": stages_state(self._reward_stages()),
                                  "shaping": stages_state(self.shaping),
                                  "filters": stages_state(self.filters),
                                  "advantage": stages_state([(self.advantage_fn, {}, self.cfg.advantage.name)]),
                                  "losses": self._loss_state(), "diagnostics": self.diag.state_dict()},
                                 keep_last=self.cfg.train.keep_last)
        self.acc.wait_for_everyone()

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        batch = self.rollout(step)
        t1 = time.perf_counter()
        info = self.score(batch)
        batch = self.filter(batch)
        self.kl_in_reward(batch)
        self.advantages(batch)
        t2 = time.perf_counter()
        metrics = self.batch_metrics(batch, info)
        metrics.update(self.stage_metrics)  # filters, prompt selectors, value head
        rows = min(len(batch), self.cfg.train.micro_batch_size) * (batch.prompt_ids.shape[1]
                                                                   + batch.completion_ids.shape[1])
        with self.accel.use("update", rows=rows, work=len(batch) * batch.completion_ids.shape[1]):
            metrics.update(self.update(batch, step))
        t3 = time.perf_counter()
        ntok = float(batch.lengths.sum())
        metrics.update({"time/generation": t1 - t0, "time/reward": t2 - t1,
                        "time/update": t3 - t2 - metrics["time/ref"], "time/step": t3 - t0,
                        "time/tokens_per_s": ntok * self.world / max(t3 - t0, 1e-9)})
        metrics.update(self.diag.step_metrics(batch, metrics))  # diagnostics: throughput, memory, mismatch...
        metrics = self._reduce(metrics)
        self._end_step(metrics, len(batch) * self.world)
        metrics["step"] = step + 1
        if self.main:
            metrics = self.diag.after_reduce(step, batch, metrics)  # diagnostics: sharpness, alarms, sinks
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if (step + 1) % self.cfg.train.samples_every == 0 or step == 0:
                self._write_samples(step + 1, batch)
            for name, n in info["failures"].items():
                if self.reporter is not None:
                    self.reporter.log(f"reward '{name}' failed on {n} completions: {info['first_failure'][name]}")
        return metrics

    def train(self) -> dict:
        cfg = self.cfg
        if self.eval_before is None:
            self.eval_before = self.evaluate("before", 0)
        if self.reporter is not None:
            self.reporter.start(cfg.train.steps, self.start_step, self.eval_before)
        for step in range(self.start_step, cfg.train.steps):
            metrics = self.train_step(step)
            if self.reporter is not None:
                self.reporter.step(metrics)
            done = step + 1
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps:
                self.evaluate("periodic", done)
            if cfg.train.save_every and done % cfg.train.save_every == 0 and done < cfg.train.steps:
                self.save(done)
        after = self.evaluate("after", cfg.train.steps)
        self.backend.close()  # what the backend holds besides the model
        self.save(cfg.train.steps)
        summary = {"steps": cfg.train.steps, "before": self.eval_before, "after": after,
                   "model_path": str(self.model_path), "run_dir": str(self.run_dir),
                   "processes": self.world}
        if self.main:
            summary["alarms"] = self.diag.finish()  # diagnostics: every alarm raised, with first/last step
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if self.reporter is not None:
            self.reporter.finish(summary)
        return summary


def _f(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None
