"""The trainer's diagnostics: what it calls at each point of a step, in one object.

- ``observe_micro`` (in the update loop, after each backward): ratio statistics, the policy KL of the update
  (verl ``actor/ppo_kl``) and, on a single pass, the trainer's log-probs of the sampled tokens before any
  update (for the sampler-vs-trainer mismatch).
- ``nan_guard`` (before ``optimizer.step()``): a non-finite gradient norm skips the step; the step is counted and
  the batch saved to run_dir/bad_batches/step-N.pt.
- ``step_metrics`` (before metrics are reduced over processes): throughput per phase, memory, mismatch, ratio
  statistics, grad-norm max, skipped steps.
- ``after_reduce`` (main process): the sharpness every N steps, the alarms of every monitor, the sinks.
- ``on_eval`` / ``finish``: evaluations for the monitors that compare with held-out accuracy; final alarms.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from postrl.io import read_jsonl
from postrl.diagnostics.metrics import memory_metrics, mismatch_metrics
from postrl.diagnostics.monitors import Alarm, Watchdog
from postrl.diagnostics.sinks import make_sinks
from postrl.diagnostics.stability import adam_preconditioner, stability_threshold, top_eigenvalue
from postrl.generation import SamplingParams
from postrl.logprobs import completion_logprobs


class Diagnostics:
    """The run's diagnostics. ``cfg``: the run's config; ``objective``: the training objective
    (``postrl.losses.objective``), which the sharpness probe differentiates; ``watchdog``: the monitors (the step's,
    ``postrl.step.Step.watchdog``; a new one when None); ``main`` / ``rank`` / ``device``: this process. The model
    and optimizer reach the probe at each call (``after_reduce``); nothing holds the trainer."""

    def __init__(self, cfg, run_dir, objective=None, watchdog: Watchdog | None = None, *, main: bool = True,
                 rank: int = 0, device="cpu"):
        self.run_cfg, self.objective = cfg, objective
        self.main, self.rank, self.device = main, rank, device
        self.cfg = cfg.diagnostics
        self.run_dir = Path(run_dir)
        run_config = cfg.model_dump(mode="json")
        self.watch = watchdog if watchdog is not None else Watchdog(run_config, cfg.diagnostics)
        self.alarm_log: dict[str, dict] = {}
        # a resumed run replays its (already truncated) logs through the monitors, so that their windows and
        # patience counts continue exactly as in the uninterrupted run
        logged = read_jsonl(self.run_dir / "metrics.jsonl") if main else []
        evals = sorted(read_jsonl(self.run_dir / "eval.jsonl") if main else [],
                       key=lambda e: int(e.get("step", 0)))
        for m in logged:
            while evals and int(evals[0].get("step", 0)) < int(m.get("step", 0)):
                self.watch.observe_eval(evals.pop(0))
            self._record(self.watch.step(m))
        for e in evals:
            self.watch.observe_eval(e)
        self.skipped_total = int(sum(float(m.get("nan_guard/skipped", 0) or 0) for m in logged))
        self.sinks = []
        if main and cfg.logging.sinks:
            self.sinks = make_sinks(list(cfg.logging.sinks), self.run_dir, run_config,
                                    run_name=cfg.logging.run_name, project=cfg.logging.project,
                                    mlflow_uri=cfg.logging.mlflow_uri)
        self._fixed = None
        self._reset()

    def _reset(self) -> None:
        self._ratio_sum = self._ratio_n = self._ppo_kl_sum = 0.0
        self._ratio_min, self._ratio_max = math.inf, -math.inf
        self._trainer_lp: torch.Tensor | None = None
        self._gn_max = -math.inf
        self.skipped = 0
        self._saved: str | None = None

    # ------------------------------------------------------------------------------------------ in update()
    @torch.no_grad()
    def observe_micro(self, batch, idx: torch.Tensor, logp: torch.Tensor, old: torch.Tensor, info: dict,
                      first_pass: bool) -> None:
        m = (batch.completion_mask[idx] * batch.valid[idx].unsqueeze(-1).float()).to(logp.device) > 0
        if "ratio" in info and m.any():
            r = info["ratio"][m].double()
            self._ratio_sum += float(r.sum())
            self._ratio_n += r.numel()
            self._ratio_min = min(self._ratio_min, float(r.min()))
            self._ratio_max = max(self._ratio_max, float(r.max()))
            self._ppo_kl_sum += float((old.detach() - logp.detach())[m].double().sum())
        if first_pass:
            if self._trainer_lp is None:
                self._trainer_lp = torch.zeros_like(batch.sampler_logprobs, dtype=torch.float32)
            self._trainer_lp[idx] = logp.detach().float().cpu()

    def nan_guard(self, grad_norm, batch, step: int) -> bool:
        """True when this optimizer step must be skipped (non-finite gradient norm); saves the batch once."""
        gn = float(grad_norm)
        if math.isfinite(gn):
            self._gn_max = max(self._gn_max, gn)
            return False
        self.skipped += 1
        self.skipped_total += 1
        if self.cfg.nan_guard.save_batches and self._saved is None:
            d = self.run_dir / "bad_batches"
            d.mkdir(parents=True, exist_ok=True)
            name = f"step-{step + 1}.pt" if self.rank == 0 else f"step-{step + 1}-rank{self.rank}.pt"
            from dataclasses import fields

            torch.save({f.name: getattr(batch, f.name) for f in fields(batch)} | {"step": step + 1,
                                                                                    "grad_norm": gn}, d / name)
            self._saved = str(Path("bad_batches") / name)
        return True

    # ------------------------------------------------------------------------------------------ in train_step()
    def step_metrics(self, batch, metrics: dict) -> dict:
        out: dict[str, float] = {}
        ntok_c = float(batch.completion_mask.sum())
        ntok = ntok_c + float(batch.prompt_mask.sum())
        cfg = self.run_cfg
        frozen = (cfg.kl.coef > 0) + (cfg.train.epochs > 1 or cfg.train.mini_batches > 1)  # frozen forward passes
        phases = {"generation": ("time/generation", ntok_c), "reward": ("time/reward", ntok_c),
                  "update": ("time/update", ntok * cfg.train.epochs)}
        if frozen:
            phases["reference"] = ("time/ref", ntok * frozen)
        for name, (key, n) in phases.items():
            t = metrics.get(key)
            out[f"throughput/{name}"] = n / t if t and t > 0 and n > 0 else float("nan")
        # every process must report the same keys (they are all-reduced): NaN where there is nothing to report
        nan = float("nan")
        n = self._ratio_n
        out["ratio/mean"] = self._ratio_sum / n if n else nan
        out["ratio/min"] = self._ratio_min if n else nan
        out["ratio/max"] = self._ratio_max if n else nan
        out["ppo_kl"] = self._ppo_kl_sum / n if n else nan
        trainer_lp = batch.old_logprobs if batch.old_logprobs is not None else self._trainer_lp
        if trainer_lp is not None:
            out.update(mismatch_metrics(trainer_lp, batch.sampler_logprobs, batch.completion_mask))
        out["grad_norm_max"] = self._gn_max if self._gn_max > -math.inf else nan
        out["nan_guard/skipped"] = float(self.skipped)
        out["nan_guard/skipped_total"] = float(self.skipped_total)
        out.update(memory_metrics(self.device))
        # the step's accumulators are spent on every process (the non-main ones never reach after_reduce): the next
        # step's batch may be of another width
        saved = self._saved
        self._reset()
        self._saved = saved
        return out

    def after_reduce(self, step: int, batch, metrics: dict, model=None, optimizer=None) -> dict:
        """Main process only: sharpness (of ``model`` under ``optimizer``'s preconditioner), alarms
        (``metrics['alarms']``), sinks."""
        eos = self.cfg.edge_of_stability
        if self.cfg.enabled and eos.enabled and eos.every and (step + 1) % eos.every == 0 and len(batch):
            t0 = time.perf_counter()
            measured = self.sharpness(batch, model, optimizer)
            if measured:  # (none before Adam has seen a non-zero gradient)
                metrics.update(measured)
                metrics["time/sharpness"] = time.perf_counter() - t0  # not in time/step: the probe's own cost
        if self._saved:
            metrics["nan_guard/saved"] = self._saved
        alarms = self.watch.step(metrics)
        metrics["alarms"] = [a.to_dict() for a in alarms]
        self._record(alarms)
        for s in self.sinks:
            s.log(metrics, metrics["step"])
            s.log_alarms(metrics["alarms"], metrics["step"])
        self._reset()
        return metrics

    def _record(self, alarms: list[Alarm], final: bool = False) -> None:
        for a in alarms:
            rec = self.alarm_log.setdefault(a.name, {"first_step": a.step, "steps": 0, "severity": a.severity})
            rec.update(last_step=a.step, message=a.message, cause=a.cause, fix=a.fix)
            if final:
                rec["final"] = True
            rec["steps"] += 1

    def on_eval(self, res: dict) -> None:
        self.watch.observe_eval(res)
        for s in self.sinks:
            s.log({f"eval/{k}": v for k, v in res.items() if k not in ("step", "tag", "n")}, int(res.get("step", 0)))

    def finish(self) -> dict:
        """Final alarms (held-out comparisons), then close the sinks; returns the alarm summary."""
        self._record(self.watch.final(), final=True)
        for s in self.sinks:
            s.close()
        self.sinks = []
        return self.alarm_log

    # ------------------------------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """JSON state for a checkpoint: the sharpness probe's fixed batch, once chosen (a resumed run measures on
        the same rows as the uninterrupted one). The monitors need none: a resumed run replays its logs."""
        if self._fixed is None:
            return {}
        fx = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in self._fixed.items()}
        fx["dtypes"] = {k: str(v.dtype).removeprefix("torch.") for k, v in self._fixed.items()
                        if isinstance(v, torch.Tensor)}
        return {"sharpness_batch": fx}

    def load_state_dict(self, state: dict | None) -> None:
        fx = dict((state or {}).get("sharpness_batch") or {})
        if not fx:
            return
        dtypes = fx.pop("dtypes")
        self._fixed = {k: torch.tensor(v, dtype=getattr(torch, dtypes[k])) if k in dtypes else v
                       for k, v in fx.items()}

    # ------------------------------------------------------------------------------------------ sharpness
    def sharpness(self, batch, model, optimizer) -> dict:
        """Top eigenvalue of the (Adam-preconditioned) Hessian of the training objective on a small fixed batch.

        The batch is fixed at the first call: up to ``diagnostics.edge_of_stability.batch_size`` rows of that
        step, rows with a non-zero advantage first, with their advantages and every field the objective reads. The
        objective is the run's (``postrl.losses.objective``, the same object the update differentiates) as a
        single-pass update sees it, i.e. with the old policy = the current one (``old_logp = logp.detach()``,
        ratio 1 at the point of measurement); the negative log-likelihood of the completions when every advantage
        is zero (the objective is then flat).
        """
        p = self.cfg.edge_of_stability
        obj = self.objective
        temp = self.run_cfg.rollout.temperature or 1.0
        r = self.run_cfg.rollout
        filt = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              logprobs=r.logprobs).logprob_filter()  # the update's log-probs (rollout.logprobs)
        if self._fixed is None:
            adv = batch.advantages if batch.advantages.dim() == 1 else batch.advantages.mean(-1)
            score = adv.abs() * batch.valid.float()
            order = torch.argsort(score, descending=True, stable=True)[:p.batch_size]
            fx = {k: getattr(batch, k)[order] for k in ("prompt_ids", "prompt_mask", "completion_ids")}
            fx.update({k: v for k, v in obj.batch_fields(batch, order).items() if v is not None})
            fx["nll"] = bool(float(fx["advantages"].abs().max()) < 1e-8)
            self._fixed = fx
        fx = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in self._fixed.items()}
        params = [q for q in model.parameters() if q.requires_grad]
        opt = getattr(optimizer, "optimizer", optimizer)
        pre = adam_preconditioner(opt, params)
        if pre is not None:
            precond, beta1, lr = pre
        elif any("exp_avg_sq" in st for st in opt.state.values()):
            return {}  # Adam has only seen zero gradients: no preconditioner yet, nothing meaningful to measure
        else:
            precond, beta1, lr = None, None, float(opt.param_groups[0]["lr"])
        was_training = model.training
        model.train()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):  # fused attention kernels have no double backward
            out = completion_logprobs(model, fx["prompt_ids"], fx["prompt_mask"], fx["completion_ids"], temp,
                                      with_entropy=True, entropy_grad=obj.entropy_grad,
                                      return_logits="logits" in obj.reads, **filt)
        logp, ent = out[0], out[1]
        w = obj.weights(fx["mask"])
        if fx["nll"]:
            loss = -(w * logp).sum()
        else:
            fields = {k: v for k, v in fx.items() if k not in ("prompt_ids", "prompt_mask", "completion_ids", "nll")}
            fields.update(logp=logp, old_logp=logp.detach(), entropy=ent, logits=out[2] if len(out) > 2 else None)
            fields.setdefault("sampler_logp", logp.detach())
            loss = obj(fields, w)[0]
        lam = top_eigenvalue(loss, params, iters=p.iters, precond=precond, seed=self.run_cfg.seed)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        thr = stability_threshold(lr, beta1)
        return {"stability/sharpness": lam, "stability/threshold": thr, "stability/ratio": lam / thr,
                "stability/lr": lr, "stability/preconditioned": 1.0 if precond is not None else 0.0}
