"""The RL trainer: drives the one step (:class:`postrl.step.Step`), owns the model, optimizer, processes and
checkpoints, and nothing else.

One step (docs/DEVELOPING.md, "One step"): the step's batch (``step/sampling.py``: prompts -> rollout -> rewards
and shaping -> expansions and filters) -> KL in the reward -> advantages -> (old log-probs; the frozen models'
log-probs the stages read: the reference's, the teacher's, train/policy.py) -> the objective
(``losses/objective.py``) over epochs x mini-batches x micro-batches -> optimizer -> the step's end (every stateful
stage, once) -> metrics, alarms, samples, checkpoint. The trainer names no stage and asks none what it is.

All randomness of step s derives from (seed, s, rank): prompts, sampling and mini-batch shuffling. A resumed run
therefore only needs the weights, optimizer and scheduler state to continue exactly as the uninterrupted run.
Built on Accelerate: ``accelerate launch --cpu --num_processes 2 -m postrl train ...`` runs DDP over gloo; each
process takes its share of the step's prompts, gradients are averaged, metrics reduced across processes.
"""

from __future__ import annotations

import json
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from postrl import accel
from postrl.batch import RolloutBatch
from postrl.config import Config, dump_yaml
from postrl.context import ModelContext
from postrl.data import load_source
from postrl.diagnostics.hooks import Diagnostics
from postrl.errors import ConfigError, PostrlError
from postrl.evaluate import episode_runner, evaluate
from postrl.generation import SamplingParams
from postrl.rewards import RewardContext
from postrl.seeding import derive_seed as _seed
from postrl.step import Step
from postrl.step.sampling import BatchSource
from postrl.train import checkpoint as ckpt
from postrl.train import run_state
from postrl.train.optim import clip_into_step, clip_target, make_optimizer, make_scheduler
from postrl.train.policy import FROZEN, load_policy, reference_model, teacher_model
from postrl.train.processes import Processes

class Trainer:
    """Runs ``cfg.train.steps`` RL steps (more on a resume that extends the run) and writes the run directory."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, resume: bool = False,
                 reporter: Any | None = None, model: Any = None, tokenizer: Any = None):
        """``model`` / ``tokenizer``: a causal LM object and its tokenizer to train instead of loading
        ``cfg.model.path`` (the reference model, when one is needed, is a frozen copy of it; with ``model.lora`` the
        policy with its adapter disabled)."""
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.acc = Accelerator(cpu=not torch.cuda.is_available(),
                               kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)])
        # model.dtype=bfloat16: float32 master weights (the optimizer's) and the model's forward under bf16 autocast
        if cfg.model.dtype == "float16":
            raise ConfigError("model.dtype=float16 needs loss scaling, which postrl's trainer does not do; use "
                              "bfloat16 (float32 master weights, bf16 autocast)")
        self.mixed = cfg.model.dtype == "bfloat16"
        if self.acc.mixed_precision != "no":  # accelerate's state is per process: another trainer set it
            raise PostrlError(f"this process's accelerate state has mixed_precision={self.acc.mixed_precision} (set "
                              "by an earlier Accelerator, e.g. a TRL trainer); postrl's trainer sets its precision "
                              "with model.dtype: run it in a fresh process")
        self.procs = Processes(self.acc)
        self.rank, self.world, self.main = self.procs.rank, self.procs.world, self.procs.main
        if cfg.train.prompts_per_step % self.world:
            raise ConfigError(f"train.prompts_per_step={cfg.train.prompts_per_step} must be divisible by the "
                              f"number of processes ({self.world})")
        self.reporter = reporter
        log = reporter.log if reporter is not None else print
        self.log = log if self.main else (lambda s: None)
        # what changes what the run does: stderr in every mode (--quiet too) and RUN/notices.jsonl
        self.notice = run_state.Notices(self.run_dir, enabled=self.main)
        self.source = load_source(cfg.task.model_dump())
        model, self.tokenizer, self.model_path = load_policy(cfg, self.acc.device, self.log, model, tokenizer)
        # the CPU speed layer (postrl.accel), applied to the model once: threads, generator and log-prob paths. The
        # fused update runs on one process in float32 only (under DDP every process must run the same forwards,
        # chosen here from its own data; under bf16 autocast the model's own products, which autocast casts)
        acfg = cfg.accel.model_copy(update={"matmul": "torch"}) if self.mixed else cfg.accel
        self.accel = accel.prepare(model, acfg, self.acc.device)
        self.accel.fused = self.accel.fused and self.world == 1 and not self.mixed
        # the step: rewards + shaping, batch selection, advantage, objective (loss, KL, regularisers), monitors
        self.step = Step(cfg, context=RewardContext(model=model, tokenizer=self.tokenizer, device=self.acc.device,
                                                    chat_template=cfg.model.chat_template),
                         tokenizer=self.tokenizer, log=self.log, notice=self.notice)
        for msg in self.step.warnings:
            self._warn(msg)
        self.objective = self.step.objective
        # the frozen models whose per-token log-probs are batch fields a stage reads (train/policy.py FROZEN): the
        # reference (ref_logp; None with LoRA: the policy with its adapter disabled) and the teacher (teacher_logp)
        # the teacher (model.teacher.path) is loaded for the stages that declare they need it (distill, teacher_hint)
        uses_teacher = "teacher_logp" in self.objective.reads or any("teacher" in s.needs
                                                                     for s in self.step.all_stages)
        if cfg.model.teacher.path is not None and not uses_teacher:
            self._warn(f"model.teacher.path={cfg.model.teacher.path}: no configured stage uses a teacher (regularizer "
                       f"distill, expansion teacher_hint), so it is not loaded")
        self.teacher = teacher_model(cfg, self.tokenizer, self.acc.device, self.accel) if uses_teacher else None
        self.frozen: dict[str, Any] = {}
        if "ref_logp" in self.objective.reads:
            self.frozen["ref_logp"] = reference_model(cfg, model, self.model_path, self.acc.device, self.accel)
        if "teacher_logp" in self.objective.reads:
            if self.teacher is None:
                raise ConfigError("a loss or regularizer reads teacher_logp: set model.teacher.path (a model folder "
                                  "with the policy's vocabulary)")
            self.frozen["teacher_logp"] = self.teacher
        self.needs_ref = "ref_logp" in self.frozen
        self.ref_model = self.frozen.get("ref_logp")
        resetting = self.step.needing("reference_reset")
        if resetting and self.ref_model is None:
            s = resetting[0]
            raise ConfigError(f"{s.kind} '{s.name}' resets the reference model to the policy, which needs a separate "
                              "reference model: " + ("with model.lora the reference is the base weights (the "
                                                     "adapter disabled); train without LoRA" if self.needs_ref else
                                                     "set kl.coef > 0 or a stage that reads ref_logp"))
        self.ref_reset_step: int | None = None  # the step whose policy the reference holds (None: the initial one)
        self.steps = cfg.train.steps  # (a resume may extend it: run_state.resume_steps)
        # optimisation
        torch.manual_seed(cfg.seed)
        self.optimizer = make_optimizer(model, cfg.optim)  # with LoRA the adapters only (the trainable parameters)
        total = cfg.train.steps * cfg.train.epochs * cfg.train.mini_batches
        self.scheduler = make_scheduler(self.optimizer, cfg.optim.warmup_for(total), total, cfg.optim.schedule)
        self.model, self.optimizer = self.acc.prepare(model, self.optimizer)
        self.params = list(self.model.parameters())
        self.clip_opt = clip_target(self.acc, self.optimizer)  # the clip folded into the fused step, where it can be
        self.backend = self._make_backend()
        self.teacher_backend = None if self.teacher is None else \
            self.accel.generator(self.teacher, self.tokenizer, batch_size=cfg.rollout.batch_size)
        r = cfg.rollout
        self.ctx = ModelContext(self.policy, self.tokenizer, self.acc.device, temperature=r.temperature or 1.0,
                                micro_batch_size=cfg.train.micro_batch_size, chat_template=cfg.model.chat_template,
                                sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                                        top_p=r.top_p, top_k=r.top_k, stop=list(r.stop),
                                                        ignore_eos=r.ignore_eos, logprobs=r.logprobs),
                                generate=self.backend.generate, pad_id=self.backend.pad_id,
                                score=lambda b: self.step.score(b, observe=False), logprob_fn=self.accel.logprobs,
                                autocast=self.mixed, teacher=self.teacher,
                                teacher_generate=None if self.teacher_backend is None else self.teacher_backend.generate)
        self.batches = BatchSource(self.step, self.source, self.ctx, seed=cfg.seed,
                                   prompts_per_step=cfg.train.prompts_per_step, rollout=cfg.rollout,
                                   chat_template=cfg.model.chat_template, environment=cfg.environment,
                                   rank=self.rank, world=self.world, max_over_processes=self.procs.max, log=self.log,
                                   notice=self.notice)
        self.step.scorer.check_sandbox()  # at start-up: a limit this machine cannot enforce is said now, not mid-run
        self.start_step = 0
        self.eval_before: dict | None = None
        self._lock = None  # run_state.RunLock of the main process: one process writes a run directory
        self._eval_after: dict | None = None  # the final evaluation already logged (a resume at the last step)
        self._finished: dict | None = None  # summary.json of a finished run that was resumed: nothing to do
        if resume:
            self._resume()
        elif self.main:
            self._lock = run_state.open_new_run(self.run_dir, dump_yaml(cfg))
        self.notice.start(new=not resume)
        # diagnostics: metrics beyond the batch, the step's monitors and alarms, sinks (postrl/diagnostics/hooks.py)
        self.diag = Diagnostics(cfg, self.run_dir, self.objective, self.step.watchdog, main=self.main,
                                rank=self.rank, device=self.acc.device)
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

    def _warn(self, msg: str) -> None:
        warnings.warn(msg, stacklevel=3)  # the command line prints it as one "warning: ..." line
        self.notice(msg, kind="warning", echo=False)  # and RUN/notices.jsonl keeps it

    def _make_backend(self):
        return self.accel.generator(self.policy, self.tokenizer, batch_size=self.cfg.rollout.batch_size)

    def _resume(self) -> None:
        """Continue from the newest usable checkpoint (newer unusable ones are moved aside, saying so); decide
        ``train.steps`` (run_state.resume_steps) and whether the run already finished (then ``train`` does
        nothing); cut the logs back to the checkpoint's step."""
        say = self.notice  # what a resume decides changes the run: said in every mode, kept in notices.jsonl
        if self.main:
            self._lock = run_state.RunLock(self.run_dir)
        last, skipped = ckpt.resumable_checkpoint(self.run_dir)
        if last is None:
            if skipped:
                raise PostrlError(f"--resume {self.run_dir}: no usable checkpoint: " + "; ".join(
                    f"{p.name}/{problem}" for p, problem in skipped))
            raise PostrlError(f"--resume {self.run_dir}: no complete checkpoint in {self.run_dir / 'checkpoints'}")
        step = int(json.loads((last / ckpt.STATE_FILE).read_text())["step"])
        steps = run_state.resume_steps(self.run_dir, self.cfg.train.steps, step, say=say)
        if steps != self.steps:  # the scheduler's horizon follows (before its state is loaded)
            self.steps = steps
            total = steps * self.cfg.train.epochs * self.cfg.train.mini_batches
            self.scheduler = make_scheduler(self.optimizer.optimizer, self.cfg.optim.warmup_for(total), total,
                                            self.cfg.optim.schedule)
        self.acc.wait_for_everyone()  # every process has read config.yaml and chosen the same checkpoint
        if self.main:
            for path, problem in skipped:
                moved = ckpt.quarantine_checkpoint(path)
                say(f"checkpoint {path} is unusable ({problem}): moved to {moved.name}; resuming from {last.name}")
            run_state.record_config(self.run_dir, self.cfg.model_copy(update={
                "train": self.cfg.train.model_copy(update={"steps": steps})}))
        state = ckpt.load_checkpoint(last, self.policy, self.optimizer, self.scheduler, reference=self.ref_model)
        self.ref_reset_step = state.get("reference_reset")
        self.start_step = step
        self._resumed_state = state
        self.eval_before = state.get("eval_before")
        # a run resumed at its last step: the final evaluation a killed process already logged is reused, and a
        # finished run has nothing to do
        self._eval_after = run_state.after_eval(self.run_dir, steps) if step == steps else None
        self._finished = run_state.finished_summary(self.run_dir, steps) if step == steps else None
        self.step.load_state_dict(state.get("stages"))
        if self.main and self._finished is None:
            for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
                run_state.truncate_jsonl(self.run_dir / name, self.start_step)

    # ------------------------------------------------------------------------------------------------ log-probs
    def frozen_logprobs(self, batch: RolloutBatch, field: str) -> torch.Tensor:
        """[N, T] log-probs of the batch's completion tokens under the frozen model of ``field`` (``ref_logp``: the
        reference, the frozen copy's or with LoRA the policy's with its adapter disabled, the base weights, which
        LoRA never changes; ``teacher_logp``: the teacher), at the rollout temperature like the policy's."""
        model = self.frozen[field]
        if model is not None:
            return self.ctx.logprobs(batch, model=model)[0]
        with self.policy.disable_adapter():  # (reference_model gives None only with LoRA)
            return self.ctx.logprobs(batch)[0]

    def reset_reference(self, step: int) -> None:
        """Copy the policy's weights into the reference model (a stage that declared ``needs=('reference_reset',)``
        asks at the end of a step, on every process alike); checkpoints then carry the reference."""
        self.ref_model.load_state_dict(self.policy.state_dict())
        self.ref_reset_step = step

    def fill_frozen(self, batch: RolloutBatch) -> None:
        """Each frozen model's field the stages read that the batch lacks (``batch.ref_logprobs``,
        ``batch.teacher_logprobs``), computed once per batch."""
        for field, attr in FROZEN.items():
            if field in self.frozen and getattr(batch, attr) is None:
                setattr(batch, attr, self.frozen_logprobs(batch, field))

    # ------------------------------------------------------------------------------------------------ the step
    def kl_in_reward(self, batch: RolloutBatch) -> None:
        """``kl.placement=reward`` (``Step.kl_penalty``): the KL from the policy that generated the batch and the
        reference model, subtracted from the reward before the advantages."""
        if not self.objective.kl_in_reward or len(batch) == 0:
            return
        batch.old_logprobs = self.ctx.logprobs(batch)[0]
        batch.ref_logprobs = self.frozen_logprobs(batch, "ref_logp")
        self.step.kl_penalty(batch)


    def update(self, batch: RolloutBatch, step: int) -> dict:
        """Epochs x mini-batches x micro-batches of the objective (``postrl.losses.objective``); one optimizer
        step per mini-batch."""
        cfg, obj = self.cfg, self.objective
        multi_pass = cfg.train.epochs > 1 or cfg.train.mini_batches > 1
        t0 = time.perf_counter()
        if multi_pass and batch.old_logprobs is None:  # the policy that generated the batch
            batch.old_logprobs = self.ctx.logprobs(batch)[0]
        self.fill_frozen(batch)  # the reference's / teacher's log-probs the stages read
        self.step.observe_objective(batch)  # the stateful regularisers observe the batch (old / ref log-probs in place)
        t_ref = time.perf_counter() - t0
        loss_mask = batch.completion_mask * batch.valid.unsqueeze(-1).float()
        counted = obj.rows(batch)
        gen = torch.Generator().manual_seed(_seed(cfg.seed, step, self.rank, "shuffle"))
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        if not (self.model.training and self.policy.training):  # (a walk over every module: 0.1 ms)
            self.model.train()
        for _ in range(cfg.train.epochs):
            order = torch.randperm(len(batch), generator=gen) if cfg.train.mini_batches > 1 else \
                torch.arange(len(batch))
            for mb in order.chunk(cfg.train.mini_batches):
                weights = obj.weights(loss_mask[mb], counted[mb])
                micro = list(torch.arange(len(mb)).split(cfg.train.micro_batch_size))
                for j, sel in enumerate(micro):
                    idx = mb[sel]
                    with (nullcontext() if j == len(micro) - 1 else self.acc.no_sync(self.model)):
                        logp, ent, logits = self.ctx.token_logprobs(batch, idx, model=self.model, with_entropy=True,
                                                                    entropy_grad=obj.entropy_grad,
                                                                    with_logits="logits" in obj.reads)
                        old = batch.old_logprobs[idx].to(logp.device) if multi_pass else logp.detach()
                        fields = {**obj.batch_fields(batch, idx, logp.device), "logp": logp, "old_logp": old,
                                  "entropy": ent, "logits": logits}
                        loss, stats, info = obj(fields, weights[sel].to(logp.device))
                        self.acc.backward(loss)
                        self.diag.observe_micro(batch, idx, logp, old, info, first_pass=not multi_pass)
                    for k, v in stats.items():
                        sums[k] = max(sums.get(k, v), v) if k == "ratio_max" else sums.get(k, 0.0) + v
                gn = self._optimizer_step(step, batch)
                grad_norms.append(gn)
        steps_taken = cfg.train.epochs * cfg.train.mini_batches
        out = {k: (v if k == "ratio_max" else v / steps_taken) for k, v in sums.items()}
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["time/ref"] = t_ref
        return out

    def _optimizer_step(self, step: int, batch: RolloutBatch) -> float:
        """Clip, then step (skipped, counted and saved by the diagnostics' nan guard when the norm is not
        finite); returns the gradient norm."""
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        gn = clip_into_step(self.params, self.clip_opt, max_norm) if self.clip_opt is not None \
            else self.acc.clip_grad_norm_(self.params, max_norm)
        if not self.diag.nan_guard(gn, batch, step):
            self.optimizer.step()
            self.scheduler.step()
        if self.clip_opt is not None:
            self.clip_opt.grad_scale = None
        self.optimizer.zero_grad(set_to_none=True)
        return float(gn)

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        batch, info = self.batches.next_batch(step, self.steps)
        self.kl_in_reward(batch)
        self.step.advantages(self.ctx, batch)
        t2 = time.perf_counter()
        metrics = self.step.metrics(batch, info)
        metrics.update(self.batches.metrics)  # filters
        rows = min(len(batch), self.cfg.train.micro_batch_size) * (batch.prompt_ids.shape[1]
                                                                   + batch.completion_ids.shape[1])
        with self.accel.use("update", rows=rows, work=len(batch) * batch.completion_ids.shape[1]):
            metrics.update(self.update(batch, step))
        t3 = time.perf_counter()
        gen_time = self.batches.generation_time
        metrics.update({"time/generation": gen_time, "time/reward": t2 - t0 - gen_time,
                        "time/update": t3 - t2 - metrics["time/ref"], "time/step": t3 - t0,
                        "time/tokens_per_s": float(batch.lengths.sum()) * self.world / max(t3 - t0, 1e-9)})
        metrics.update(self.diag.step_metrics(batch, metrics))  # diagnostics: throughput, memory, mismatch...
        metrics = self.procs.reduce_metrics(metrics)
        # state changes once per step: every stateful stage (what it recorded, from every process), the KL controller
        metrics.update(self.step.end(metrics, len(batch) * self.world, all_reduce_mean=self.procs.all_reduce_mean,
                                     gather=self.procs.gather, reset_reference=lambda: self.reset_reference(step + 1)))
        metrics["step"] = step + 1
        if self.main:
            for name, rate in info["failure_rate"].items():  # a string: after the reduce, on the main process
                if rate > 0:
                    metrics[f"reward/{name}/first_failure"] = info["first_failure"][name]
            metrics = self.diag.after_reduce(step, batch, metrics, self.policy, self.optimizer)
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
            if (step + 1) % self.cfg.train.samples_every == 0 or step == 0:
                run_state.append_samples(self.run_dir / "samples.jsonl", step + 1, batch, 2 * self.cfg.rollout.group_size)
            for name, n in info["failures"].items():
                self.log(f"reward '{name}' failed on {n} completions: {info['first_failure'][name]}")
        return metrics

    # ------------------------------------------------------------------------------------------------ run
    def evaluate(self, tag: str, step: int) -> dict:
        cfg = self.cfg
        rows = self.source.eval_rows(cfg.train.eval_size, cfg.seed)
        res = evaluate(self.backend, self.tokenizer, self.source, rows, max_new_tokens=cfg.rollout.max_new_tokens,
                       k=cfg.train.eval_k, temperature=cfg.rollout.temperature or 1.0, seed=_seed(cfg.seed, "eval"),
                       chat_template=cfg.model.chat_template, stop=cfg.rollout.stop, reward=self.step.scorer.weighted,
                       max_prompt_length=cfg.rollout.max_prompt_length, prompt_overflow=cfg.rollout.prompt_overflow,
                       episodes=episode_runner(self.backend, self.tokenizer, cfg.environment, cfg.model.chat_template))
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
                                 {"seed": self.cfg.seed, "eval_before": self.eval_before, "stages": self.step.state_dict(),
                                  "diagnostics": self.diag.state_dict(), "reference_reset": self.ref_reset_step},
                                 keep_last=self.cfg.train.keep_last,
                                 reference=self.ref_model if self.ref_reset_step is not None else None)
        self.acc.wait_for_everyone()

    def train(self) -> dict:
        """Run the steps from ``start_step`` to ``train.steps``, then the final evaluation, checkpoint, ``final/``
        model folder and summary.json. SIGTERM / Ctrl-C stop at the end of the current step with a checkpoint
        and status.json (run_state.StopSignals); the run directory's lock is released on the way out."""
        cfg = self.cfg
        if self._finished is not None:  # resumed a finished run
            if self.main:
                (self.reporter.log if self.reporter is not None else print)(
                    f"{self.run_dir}: the run already finished at step {self.steps}: nothing to do "
                    f"(give train.steps=N to train further)")
            if self._lock is not None:
                self._lock.release()
            return self._finished
        done = self.start_step
        stop = run_state.StopSignals(announce=self.main)
        try:
            with stop:
                if self.main:
                    run_state.clear_status(self.run_dir)
                if self.eval_before is None:
                    self.eval_before = self.evaluate("before", 0)
                if self.reporter is not None:
                    self.reporter.start(self.steps, self.start_step, self.eval_before)
                saved = self.start_step  # the step of the latest checkpoint
                for step in range(self.start_step, self.steps):
                    metrics = self.train_step(step)
                    if self.reporter is not None:
                        self.reporter.step(metrics)
                    done = step + 1
                    if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < self.steps:
                        self.evaluate("periodic", done)
                    if cfg.train.save_every and done % cfg.train.save_every == 0 and done < self.steps:
                        self.save(done)
                        saved = done
                    signum = stop.requested(self.acc)
                    if signum:
                        if saved != done:
                            self.save(done)
                        raise stop.stop(self.run_dir, done, signum, self.main)
                after = self._eval_after or self.evaluate("after", self.steps)
                self.backend.close()  # what the backend holds besides the model
                if self.teacher_backend is not None:
                    self.teacher_backend.close()
                if saved != self.steps:
                    self.save(self.steps)
                if self.main:
                    ckpt.save_final_model(self.run_dir, self.policy, self.tokenizer, cfg.model.lora.save)
                summary = {"steps": self.steps, "before": self.eval_before, "after": after,
                           "model_path": str(self.model_path) if self.model_path else None, "run_dir": str(self.run_dir),
                           "final_model": str(self.run_dir / ckpt.FINAL_DIR), "processes": self.world}
                if self.main:
                    summary["alarms"] = self.diag.finish()  # diagnostics: every alarm raised, with first/last step
                    run_state.write_json_atomic(self.run_dir / "summary.json", summary)
        except BaseException as exc:
            self.backend.close()
            if self.teacher_backend is not None:
                self.teacher_backend.close()
            if self.main and run_state.read_status(self.run_dir) is None:
                run_state.record_end(self.run_dir, done, exc, stop)
            raise
        finally:
            if self._lock is not None:
                self._lock.release()
        if self.reporter is not None:
            self.reporter.finish(summary)
        return summary

