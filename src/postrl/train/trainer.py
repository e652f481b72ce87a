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
import math
import os
import time
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
from postrl.models import completion_logprobs, encode_prompt, load_model_and_tokenizer
from postrl.pipeline import call_stage
from postrl.rewards import score_batch
from postrl.rollout.base import SamplingParams
from postrl.train import checkpoint as ckpt

_HASH_MOD = 2**62


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
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
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
        self.ref_model = None
        if cfg.kl.coef > 0:
            self.ref_model, _ = load_model_and_tokenizer(path, cfg.model.dtype)
            self.ref_model.requires_grad_(False).eval().to(self.acc.device)
        # stages
        self.reward_specs = cfg.rewards
        self.reward_weights = torch.tensor([r.weight for r in cfg.rewards], dtype=torch.float32)
        self.shaping = [(registry.get("shaping", s.name), s.params, s.name) for s in cfg.shaping]
        self.filters = [(registry.get("filter", s.name), s.params, s.name) for s in cfg.filters]
        self.advantage_fn = registry.get("advantage", cfg.advantage.name)
        self.loss_fn = registry.get("loss", cfg.loss.name)
        self.agg_fn = registry.get("aggregation", cfg.loss.agg)
        self.kl_fn = registry.get("regularizer", f"kl_{cfg.kl.estimator}") if cfg.kl.coef > 0 else None
        # optimisation
        torch.manual_seed(cfg.seed)
        decay, no_decay = [], []
        for n, p in model.named_parameters():
            (no_decay if p.dim() < 2 else decay).append(p)
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
        total = cfg.train.steps * cfg.train.epochs * cfg.train.mini_batches
        self.scheduler = make_scheduler(self.optimizer, cfg.optim.warmup_steps, total, cfg.optim.schedule)
        self.model, self.optimizer = self.acc.prepare(model, self.optimizer)
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

    # ------------------------------------------------------------------------------------------------ set-up
    @property
    def policy(self):
        return self.acc.unwrap_model(self.model)

    def _make_backend(self):
        if self.cfg.rollout.backend == "vllm":
            raise ConfigError("rollout.backend: 'vllm' is not available in this version; use 'hf'")
        from postrl.rollout.hf import HFGenerator

        return HFGenerator(self.policy, self.tokenizer, batch_size=self.cfg.rollout.batch_size)

    def _resume(self) -> None:
        last = ckpt.latest_checkpoint(self.run_dir)
        if last is None:
            raise PostrlError(f"--resume {self.run_dir}: no complete checkpoint in {self.run_dir / 'checkpoints'}")
        state = ckpt.load_checkpoint(last, self.policy, self.optimizer, self.scheduler)
        self.start_step = int(state["step"])
        self.eval_before = state.get("eval_before")
        if self.main:
            for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
                _jsonl_truncate(self.run_dir / name, self.start_step)

    # ------------------------------------------------------------------------------------------------ stages
    def rollout(self, step: int) -> RolloutBatch:
        cfg = self.cfg
        per_rank = cfg.train.prompts_per_step // self.world
        rows = self.source.train_rows(step, cfg.train.prompts_per_step, cfg.seed)[self.rank * per_rank:
                                                                                     (self.rank + 1) * per_rank]
        G = cfg.rollout.group_size
        prompt_ids = [encode_prompt(self.tokenizer, r["prompt"], cfg.model.chat_template) for r in rows]
        params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                                top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, stop=list(cfg.rollout.stop))
        first = self.rank * per_rank  # global index of this process's first prompt
        seeds = [_seed(cfg.seed, step, first + i, "rollout") for i in range(len(rows))]
        gen = self.backend.generate(prompt_ids, G, params, seeds)
        keys = [k for k in rows[0] if k != "prompt"] if rows else []
        columns = {k: [r.get(k) for r in rows for _ in range(G)] for k in keys}
        group_ids = torch.arange(len(rows)).repeat_interleave(G) + step * cfg.train.prompts_per_step \
            + self.rank * per_rank
        return RolloutBatch(
            prompt_ids=gen.prompt_ids, prompt_mask=gen.prompt_mask, completion_ids=gen.completion_ids,
            completion_mask=gen.completion_mask.float(), group_ids=group_ids, sampler_logprobs=gen.logprobs,
            truncated=gen.truncated, prompts=[r["prompt"] for r in rows for _ in range(G)], completions=gen.texts,
            columns=columns)

    def score(self, batch: RolloutBatch) -> dict:
        outcome = score_batch(batch.prompts, batch.completions, batch.columns, self.reward_specs)
        batch.reward_names = [r.name for r in self.reward_specs]
        batch.rewards = outcome.matrix
        batch.reward_weights = self.reward_weights
        for fn, params, name in self.shaping:
            out = call_stage(fn, batch, params, what=f"shaping '{name}'")
            for k, v in out.items():
                setattr(batch, k, v)
        if batch.reward is None:
            raise ConfigError("shaping: no stage produced the scalar reward; add {name: weighted_sum}")
        batch.valid = torch.isfinite(batch.reward)
        return {"failures": outcome.failures, "first_failure": outcome.first_failure}

    def filter(self, batch: RolloutBatch) -> RolloutBatch:
        for fn, params, name in self.filters:
            keep = call_stage(fn, batch, params, what=f"filter '{name}'")
            batch = batch.select(torch.nonzero(keep, as_tuple=False).flatten())
        return batch

    def advantages(self, batch: RolloutBatch) -> None:
        batch.advantages = call_stage(self.advantage_fn, batch, self.cfg.advantage.params,
                                      what=f"advantage '{self.cfg.advantage.name}'")

    # ------------------------------------------------------------------------------------------------ update
    def _logprobs(self, model, batch: RolloutBatch, idx: torch.Tensor, with_entropy: bool = False):
        dev = self.acc.device
        return completion_logprobs(model, batch.prompt_ids[idx].to(dev), batch.prompt_mask[idx].to(dev),
                                   batch.completion_ids[idx].to(dev), self.cfg.rollout.temperature or 1.0,
                                   with_entropy=with_entropy)

    @torch.no_grad()
    def _frozen_logprobs(self, model, batch: RolloutBatch) -> torch.Tensor:
        mbs = self.cfg.train.micro_batch_size
        outs = [self._logprobs(model, batch, torch.arange(i, min(i + mbs, len(batch))))[0].cpu()
                for i in range(0, len(batch), mbs)]
        return torch.cat(outs)

    def update(self, batch: RolloutBatch, step: int) -> dict:
        cfg = self.cfg
        multi_pass = cfg.train.epochs > 1 or cfg.train.mini_batches > 1
        t0 = time.perf_counter()
        if multi_pass:  # stored old log-probs: the policy that generated the batch
            batch.old_logprobs = self._frozen_logprobs(self.policy, batch)
        if self.ref_model is not None:
            batch.ref_logprobs = self._frozen_logprobs(self.ref_model, batch)
        t_ref = time.perf_counter() - t0
        loss_mask = batch.completion_mask * batch.valid.unsqueeze(-1).float()
        adv = batch.advantages
        n = len(batch)
        gen = torch.Generator().manual_seed(_seed(cfg.seed, step, self.rank, "shuffle"))
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
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
                        logp, ent = self._logprobs(self.model, batch, idx, with_entropy=True)
                        old = batch.old_logprobs[idx].to(logp.device) if multi_pass else logp.detach()
                        a = adv[idx].to(logp.device)
                        loss_mat, info = call_stage(self.loss_fn, {"logp": logp, "old_logp": old, "advantages": a},
                                                    cfg.loss.params, what=f"loss '{cfg.loss.name}'")
                        m = loss_mask[idx].to(logp.device)
                        w = weights[sel].to(logp.device)
                        pg = (w * loss_mat).sum()
                        loss = pg
                        stats = {"pg_loss": pg.item(), "entropy": float((w * ent).sum())}
                        if self.kl_fn is not None:
                            kl = self.kl_fn(logp, batch.ref_logprobs[idx].to(logp.device))
                            kl_term = (w * kl).sum()
                            loss = loss + cfg.kl.coef * kl_term
                            stats["kl"] = kl_term.item()
                        for key, val in info.items():
                            if val.dtype == torch.bool:
                                stats[key] = float((w * val.float()).sum())
                        stats["ratio_max"] = float((info["ratio"] * m).max()) if "ratio" in info else 1.0
                        self.acc.backward(loss)
                    for k, v in stats.items():
                        sums[k] = max(sums.get(k, v), v) if k == "ratio_max" else sums.get(k, 0.0) + v
                gn = self.acc.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm or float("inf"))
                grad_norms.append(float(gn))
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
        steps_taken = cfg.train.epochs * cfg.train.mini_batches
        out = {k: (v if k == "ratio_max" else v / steps_taken) for k, v in sums.items()}
        out["grad_norm"] = sum(grad_norms) / len(grad_norms)
        out["lr"] = self.scheduler.get_last_lr()[0]
        out["time/ref"] = t_ref
        return out

    # ------------------------------------------------------------------------------------------------ metrics
    def batch_metrics(self, batch: RolloutBatch, reward_info: dict) -> dict:
        m: dict[str, float] = {}
        valid = batch.valid
        r = batch.reward[valid]
        m["reward/mean"] = float(r.mean()) if r.numel() else float("nan")
        m["reward/std"] = float(r.std()) if r.numel() > 1 else 0.0
        for k, name in enumerate(batch.reward_names):
            col = batch.rewards[:, k]
            ok = torch.isfinite(col)
            m[f"reward/{name}/mean"] = float(col[ok].mean()) if ok.any() else float("nan")
            m[f"reward/{name}/failures"] = float(reward_info["failures"].get(name, 0))
        if "correct" in batch.reward_names:
            col = batch.rewards[:, batch.reward_names.index("correct")]
            m["accuracy"] = float((col[torch.isfinite(col)] >= 1.0).float().mean()) if torch.isfinite(col).any() \
                else float("nan")
        lens = batch.lengths
        m["length/mean"], m["length/min"], m["length/max"] = float(lens.mean()), float(lens.min()), float(lens.max())
        m["truncated"] = float(batch.truncated.float().mean())
        m["valid"] = float(valid.float().mean())
        # groups whose (valid) rewards are all equal carry no learning signal under group normalisation
        _, inv = torch.unique(batch.group_ids, return_inverse=True)
        ng = int(inv.max()) + 1
        rr = torch.where(valid, batch.reward, torch.zeros_like(batch.reward)).double()
        big = torch.full((ng,), -math.inf, dtype=torch.float64).scatter_reduce(0, inv, rr, "amax")
        small = torch.full((ng,), math.inf, dtype=torch.float64).scatter_reduce(0, inv, rr, "amin")
        m["zero_variance_groups"] = float(((big - small) <= 1e-12).float().mean())
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
        return res

    def save(self, step: int) -> None:
        self.acc.wait_for_everyone()
        if self.main:
            ckpt.save_checkpoint(self.run_dir, step, self.policy, self.tokenizer, self.optimizer, self.scheduler,
                                 {"seed": self.cfg.seed, "eval_before": self.eval_before},
                                 keep_last=self.cfg.train.keep_last)
        self.acc.wait_for_everyone()

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        batch = self.rollout(step)
        t1 = time.perf_counter()
        info = self.score(batch)
        batch = self.filter(batch)
        self.advantages(batch)
        t2 = time.perf_counter()
        metrics = self.batch_metrics(batch, info)
        metrics.update(self.update(batch, step))
        t3 = time.perf_counter()
        ntok = float(batch.lengths.sum())
        metrics.update({"time/generation": t1 - t0, "time/reward": t2 - t1,
                        "time/update": t3 - t2 - metrics["time/ref"], "time/step": t3 - t0,
                        "time/tokens_per_s": ntok * self.world / max(t3 - t0, 1e-9)})
        metrics = self._reduce(metrics)
        metrics["step"] = step + 1
        if self.main:
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
        self.save(cfg.train.steps)
        summary = {"steps": cfg.train.steps, "before": self.eval_before, "after": after,
                   "model_path": str(self.model_path), "run_dir": str(self.run_dir)}
        if self.main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if self.reporter is not None:
            self.reporter.finish(summary)
        return summary


def _f(x: torch.Tensor) -> float | None:
    v = float(x)
    return v if math.isfinite(v) else None
