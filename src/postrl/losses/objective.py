"""The training objective as one object: policy loss x multiplicative factors + additive terms, aggregated once.

For a micro-batch, with w the aggregation's weights [n, T] (computed over the whole mini-batch, so gradient
accumulation changes nothing):

    L_pg   = loss(fields)                                  policy loss matrix [n, T]          (loss.name)
    L_pg  *= tis_weights(old_logp, sampler_logp, mask)     if loss.tis.level != none          (tis.py)
    L_pg  *= pg_mask of every mask regulariser              e.g. top_entropy_tokens            (regularizers.py)
    loss   = sum(w L_pg) + kl_coef sum(w KL) + sum_j coef_j sum(w R_j)                          (kl.py, regularizers.py)
             + sum_j coef_j sum(U_j)       a regulariser's 'unweighted' term U_j, normalised by the stage itself
                                           (f_divergence_rehearsal: rows outside the loss mask)

with KL = the estimator's [n, T] values, times the importance ratio exp(logp - old_logp) (per token, or per
sequence: exp of the masked mean log-ratio) when ``kl.is_correction`` asks for it (TRL ``use_bias_correction_kl``:
``per_token_kl * coef_1``, the ratio differentiated).

The same :class:`Objective` is used by the update and by the sharpness diagnostic. ``fields`` holds the per-token
tensors the stages read by name (``logp``, ``old_logp``, ``advantages``, ``mask``, ``entropy``, ``logits``,
``sampler_logp``, ``ref_logp``, ``teacher_logp``, ``lengths`` and any per-row tensor of ``batch.extra``);
:meth:`batch_fields` takes the batch's part of them for some rows, the model's part (``logp``, ``entropy``,
``logits``) is the caller's. ``reads`` is what the stages read: a reference model is run when it holds
``ref_logp``, the teacher when it holds ``teacher_logp``, logits are kept only when it holds ``logits``, and the
entropy is differentiated only when a stage reads it without listing it in its ``no_grad_fields``.
"""

from __future__ import annotations

from typing import Any

import torch

from postrl import stages
from postrl.losses import KLController, check_aggregation
from postrl.losses.tis import tis_weights
from postrl.stages import StepEnd

# per-token fields of the batch read by name: the advantages, the sampler's log-probs and the frozen models'
# (the reference's, the teacher's: the trainer fills them when a stage reads them, postrl.train.policy.FROZEN)
_BATCH_FIELDS = {"advantages": "advantages", "sampler_logp": "sampler_logprobs", "ref_logp": "ref_logprobs",
                 "teacher_logp": "teacher_logprobs"}
_OBSERVED = {"ref_logprobs": "ref_logp", "old_logprobs": "old_logp", "sampler_logprobs": "sampler_logp"}
"""A stateful regulariser's ``observe`` reads batch fields (``ref_logprobs`` ...); what the objective must have for
it (e.g. a reference model for ``ref_logprobs``) is named as the loss's fields are."""


class Objective:
    """Built from the config's ``loss``, ``kl`` and ``regularizers`` sections and ``rollout.max_new_tokens`` (the
    horizon of the ``dr_grpo`` aggregation)."""

    def __init__(self, loss: Any, kl: Any, regularizers: list, *, max_new_tokens: int):
        self.loss = stages.build("loss", loss.name, loss.params, where="loss")
        self.agg = stages.build("aggregation", loss.agg).fn  # (mask, max_len, rows) -> token weights
        self.max_len = max_new_tokens
        self.agg_rows = loss.agg_rows
        self.tis = loss.tis
        # one KL: its estimator (kind kl) either in the loss (kl.placement=loss) or in the reward (Step.kl_penalty)
        self.kl = stages.build("kl", kl.estimator, where="kl.estimator").fn if kl.coef > 0 else None
        self.kl_placement = kl.placement
        self.kl_is = getattr(kl, "is_correction", "none")
        self.kl_ctrl = KLController(kl.coef, mode=kl.controller, target=kl.target, horizon=kl.horizon,
                                    pid_gains=kl.pid_gains, reward_velocity=kl.reward_velocity,
                                    entropy_floor=kl.entropy_floor)
        self.regularizers = stages.build_all("regularizer", regularizers, section="regularizers")
        self.coefs = [s.coef for s in regularizers]
        parts = [self.loss, *self.regularizers]
        self.reads = set().union(*(s.reads for s in parts))
        for s in self.regularizers:  # what a stateful regulariser observes (Step.observe_objective) is read too
            if s.stateful:
                self.reads |= {_OBSERVED.get(f, f) for f in stages.reads(s.fn.observe)}
        if self.kl is not None:
            self.reads.add("ref_logp")
        self.entropy_grad = any("entropy" in s.reads and "entropy" not in getattr(s.fn, "no_grad_fields", ())
                                for s in parts)
        self.warning = check_aggregation(loss.name, self.loss.fn, loss.agg)

    @classmethod
    def from_config(cls, cfg: Any) -> "Objective":
        """The objective of a whole config (its ``loss``, ``kl``, ``regularizers`` and ``rollout`` sections)."""
        return cls(cfg.loss, cfg.kl, cfg.regularizers, max_new_tokens=cfg.rollout.max_new_tokens)

    @property
    def kl_in_loss(self) -> bool:
        return self.kl is not None and self.kl_placement == "loss"

    @property
    def kl_in_reward(self) -> bool:
        return self.kl is not None and self.kl_placement == "reward"

    def rows(self, batch: Any) -> torch.Tensor:
        """bool [N]: the rows the aggregation's sequence average counts (``loss.agg_rows``, see
        :mod:`postrl.losses.aggregation`). ``all``: valid rows and rows whose reward failed (NaN), not the masked
        copies that pad a filtered batch or even out DDP processes (``valid`` False, finite reward; a padding copy
        of a failed row carries its NaN and counts like it);
        ``nonempty``: rows with at least one loss token."""
        if self.agg_rows == "nonempty":
            return (batch.completion_mask * batch.valid.unsqueeze(-1).float()).sum(-1) > 0
        failed = ~torch.isfinite(batch.reward) if batch.reward is not None else torch.zeros_like(batch.valid)
        return batch.valid.bool() | failed

    def weights(self, mask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The aggregation's weights [n, T] for a mini-batch's loss mask; ``rows`` (bool [n], from :meth:`rows`)
        the rows its sequence average counts (None: every row, or with ``loss.agg_rows=nonempty`` those with a
        token)."""
        if rows is None and self.agg_rows == "nonempty":
            rows = mask.sum(-1) > 0
        return self.agg(mask, max_len=self.max_len, rows=rows)

    def batch_fields(self, batch: Any, idx: torch.Tensor, device: Any = "cpu") -> dict:
        """The batch's fields for rows ``idx``: advantages, the loss mask (completion mask x valid rows), lengths,
        sampler / reference log-probs, and every per-row tensor of ``batch.extra`` a stage reads."""
        mask = (batch.completion_mask[idx] * batch.valid[idx].unsqueeze(-1).float()).to(device)
        fields = {"mask": mask, "lengths": mask.sum(-1)}
        for name, attr in _BATCH_FIELDS.items():
            v = getattr(batch, attr)
            fields[name] = v[idx].to(device) if v is not None else None
        for k, v in batch.extra.items():
            if k in self.reads and k not in fields and isinstance(v, torch.Tensor) and v.dim() > 0 \
                    and v.shape[0] == len(batch):
                fields[k] = v[idx].to(device)
        return fields

    def __call__(self, fields: dict, w: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
        """(loss, statistics, the policy loss's info) of a micro-batch; statistics are weighted sums (a
        mini-batch's sum is its aggregate), ``ratio_max`` a maximum; with the KL in the loss, ``info['kl_token']`` is
        its per-token [n, T] value (detached, after ``kl.is_correction``)."""
        loss_mat, info = self.loss(fields)
        m = fields["mask"]
        stats: dict[str, float] = {}
        if self.tis.level != "none":
            tw = tis_weights(fields["old_logp"].detach(), fields["sampler_logp"], m, level=self.tis.level,
                             mode=self.tis.mode, cap=self.tis.cap)
            loss_mat = loss_mat * tw
            stats["tis/weight"] = float((w * tw).sum())
            capped = (tw >= self.tis.cap) if self.tis.mode == "truncate" else (tw == 0)
            stats["tis/capped"] = float((w * capped.float()).sum())
        extra = 0.0
        for reg, coef in zip(self.regularizers, self.coefs):
            out = reg(fields)
            term = out.get("loss") if isinstance(out, dict) else out
            if isinstance(out, dict) and out.get("pg_mask") is not None:
                loss_mat = loss_mat * out["pg_mask"]
                stats[f"reg/{reg.label}/kept"] = float((w * out["pg_mask"].detach()).sum())
            if term is not None:
                agg = (w * term).sum()
                extra = extra + coef * agg
                stats[f"reg/{reg.label}"] = agg.item()
            if isinstance(out, dict) and out.get("unweighted") is not None:  # normalised by the stage itself
                total = out["unweighted"].sum()
                extra = extra + coef * total
                stats[f"reg/{reg.label}"] = stats.get(f"reg/{reg.label}", 0.0) + total.item()
        pg = (w * loss_mat).sum()
        loss = pg + extra
        stats["pg_loss"] = pg.item()
        if fields.get("entropy") is not None:
            stats["entropy"] = float((w * fields["entropy"].detach()).sum())
        if self.kl_in_loss:
            kl_mat = self.kl(fields["logp"], fields["ref_logp"])
            if self.kl_is != "none":
                log_ratio = fields["logp"] - fields["old_logp"]
                if self.kl_is == "sequence":
                    log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
                kl_mat = kl_mat * torch.exp(log_ratio)
            kl = (w * kl_mat).sum()
            info = {**info, "kl_token": kl_mat.detach()}
            loss = loss + self.kl_ctrl.value * kl
            stats["kl"] = kl.item()
        for key, val in info.items():
            if val.dtype == torch.bool:
                stats[key] = float((w * val.float()).sum())
        stats["ratio_max"] = float((info["ratio"] * m).max()) if "ratio" in info else 1.0
        return loss, stats, info

    def end_step(self, step: StepEnd, n_seq: int) -> dict:
        """Once per step, with the metrics reduced over processes: the KL coefficient this step used and its
        update (measured ``kl``, or ``kl_reward`` with kl.placement=reward, over ``n_seq`` sequences; the ``pid``
        controller also reads ``reward/mean`` and ``entropy``). (The stateful regularisers end their step with every
        other stage: ``postrl.step.Step.end``.)"""
        out = {}
        if self.kl is not None:
            out["kl_coef"] = self.kl_ctrl.value
            current = step.metrics.get("kl_reward" if self.kl_placement == "reward" else "kl")
            if current is not None:
                out.update(self.kl_ctrl.update(current, n_seq, reward=step.metrics.get("reward/mean"),
                                               entropy=step.metrics.get("entropy")) or {})
        return out
