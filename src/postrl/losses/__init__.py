"""Policy losses, loss aggregation, KL estimators, truncated importance sampling and regularisers.

The training objective (``postrl.losses.objective.Objective``, used by the update and by the sharpness probe), per
micro-batch, with w the aggregation's weights (computed over the whole mini-batch, so gradient accumulation
changes nothing):

    L      = loss(logp, old_logp, advantages, ...)           policy loss matrix [N, T]     (policy.py)
    L     *= tis_weights(old_logp, sampler_logp, mask)       if loss.tis.level != none     (tis.py)
    L     *= pg_mask of every mask regulariser                e.g. top_entropy_tokens       (regularizers.py)
    loss   = sum(w L) + kl_coef sum(w KL) + sum_j coef_j sum(w R_j)                          (kl.py, regularizers.py)

Stages read per-token fields by positional parameter name: ``logp`` (trainer log-probs, differentiable),
``old_logp`` (the policy that generated the batch; ``logp.detach()`` in a single pass), ``advantages``
([N] or [N, T]), ``mask`` (completion mask x valid rows), ``entropy`` (per-token, differentiable; computed only
when a stage asks for it, otherwise a no-grad diagnostic), ``logits`` ([N, T, V], only when a stage asks),
``sampler_logp``, ``ref_logp`` (a reference model is loaded when a stage asks), ``teacher_logp`` (the teacher's,
``model.teacher.path``: on-policy distillation, :mod:`postrl.losses.distill`), ``lengths`` ([N]).
Offline preference losses (kind ``preference``: DPO, IPO, hinge, rDPO, RPO, SimPO, AlphaPO; one value per
chosen/rejected pair, driven by ``postrl dpo``) are in :mod:`postrl.losses.preference`.
The aggregation table (postrl / verl ``loss_agg_mode`` / TRL ``loss_type``) is in
:mod:`postrl.losses.aggregation` and ``docs/losses.md``.
"""

from __future__ import annotations

from typing import Any

from postrl.losses.aggregation import (SEQUENCE_AGGREGATIONS, dr_grpo, seq_mean_token_mean, seq_mean_token_sum,
                                       token_mean)
from postrl.losses.kl import (KLController, kl_abs, kl_abs_st, kl_k1, kl_k1_st, kl_k2, kl_k3, kl_k3_st,
                              kl_low_var_kl, kl_low_var_kl_st, kl_reward_penalty, straight_through)
from postrl.losses import preference  # noqa: F401  (registers the preference losses of postrl dpo)
from postrl.losses.policy import clip_cov, cispo, dispo, gmpo, gpg, gspo, kl_cov, ppo_clip, sapo
from postrl.losses.regularizers import (AdaptiveEntropy, EntropySmoothing, ares_kl, entropy_band, entropy_bonus,
                                        f_divergence, lp_reg, steer, top_entropy_tokens)
from postrl.losses.occupancy import Chi2Occupancy
from postrl.losses.gardo import GardoKL, uncertainty_gate
from postrl.losses.tis import tis_weights
from postrl.losses import icr, srpo  # noqa: E402,F401  (register ICR and SRPO: regularisers and their fields)
from postrl.losses import avatar  # noqa: E402,F401  (registers AVATAR's temporal_advantage_shaping)
from postrl.losses import distill, hybrid  # noqa: E402,F401  (on-policy distillation; RL-PLUS's hybrid loss)

__all__ = [
    "ppo_clip", "gspo", "gmpo", "gpg", "cispo", "dispo", "sapo", "clip_cov", "kl_cov",
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo",
    "kl_k1", "kl_k2", "kl_k3", "kl_abs", "kl_k1_st", "kl_k3_st", "kl_abs_st", "kl_low_var_kl",
    "kl_low_var_kl_st", "straight_through",
    "kl_reward_penalty", "KLController", "tis_weights",
    "entropy_bonus", "AdaptiveEntropy", "top_entropy_tokens", "entropy_band", "EntropySmoothing", "lp_reg",
    "f_divergence", "steer", "ares_kl", "Chi2Occupancy", "GardoKL", "uncertainty_gate", "check_aggregation",
]


def check_aggregation(loss_name: str, loss_fn: Any, agg: str) -> str | None:
    """A warning when a sequence-level loss is aggregated per token (each sequence then weighs its length)."""
    if getattr(loss_fn, "sequence_level", False) and agg not in SEQUENCE_AGGREGATIONS:
        return (f"loss '{loss_name}' is a sequence-level objective but loss.agg={agg} weights each sequence by its "
                f"token count (TRL importance_sampling_level='sequence' with a token-level loss_type; verl gspo with "
                f"loss_agg_mode=token-mean); the paper averages over sequences (verl forces it for geo_mean): set "
                f"loss.agg=sequence")
    return None
