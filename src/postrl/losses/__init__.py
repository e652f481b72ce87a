"""Policy losses, loss aggregation and regularisers.

A policy loss returns a per-token loss matrix ``[N, T]`` and a dict of per-token diagnostics; an aggregation
turns a mask into per-token weights ``w`` such that the scalar loss is ``sum(w * loss)``. Weights are computed
over a whole mini-batch before it is split into micro-batches, so gradient accumulation changes nothing.
"""

from __future__ import annotations

import torch

from postrl.registry import register

# ---------------------------------------------------------------------------------------------- policy losses


@register("loss", "ppo_clip", source="PPO (Schulman et al. 2017); clip-higher from DAPO; verl vanilla; TRL grpo")
def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
             eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None):
    """L_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high)), rho_t = exp(logp_t - old_logp_t).

    Clip-higher (DAPO): eps_high > eps_low, e.g. 0.2 / 0.28 (verl ``clip_ratio_low/high``, TRL ``epsilon`` /
    ``epsilon_high``). Dual-clip (Ye et al. 2020): for A < 0, L_t = min(L_t, -A c) with c = ``dual_clip`` > 1;
    verl's ``vanilla`` loss applies c = 3 by default (``clip_ratio_c``), TRL none; postrl default: none.
    Shapes: logp, old_logp [N, T]; advantages [N] or [N, T] -> ([N, T] loss, diagnostics of [N, T] bools).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    info = {
        "ratio": ratio.detach(),
        "clip_low": ((ratio < 1.0 - eps_low) & (adv < 0)).detach(),
        "clip_high": ((ratio > 1.0 + eps_high) & (adv > 0)).detach(),
    }
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"loss.dual_clip: expected a value > 1, got {dual_clip}")
        pg3 = -adv * dual_clip
        info["clip_dual"] = ((loss > pg3) & (adv < 0)).detach()
        loss = torch.where(adv < 0, torch.minimum(loss, pg3), loss)
    return loss, info


# ---------------------------------------------------------------------------------------------- aggregation
# | postrl               | verl loss_agg_mode        | TRL loss_type   |
# | token_mean           | token-mean                | bnpo / dapo     |
# | seq_mean_token_mean  | seq-mean-token-mean       | grpo            |
# | seq_mean_token_sum   | seq-mean-token-sum        | -               |
# | dr_grpo              | seq-mean-token-sum-norm   | dr_grpo         |


@register("aggregation", "token_mean", source="DAPO; verl token-mean; TRL loss_type='dapo'/'bnpo'")
def token_mean(mask: torch.Tensor, *, max_len: int | None = None) -> torch.Tensor:
    """loss = sum_{i,t} m_it L_it / sum_{i,t} m_it (every token of the mini-batch weighs the same)."""
    return mask / mask.sum().clamp(min=1.0)


@register("aggregation", "seq_mean_token_mean", source="GRPO paper; verl seq-mean-token-mean; TRL loss_type='grpo'")
def seq_mean_token_mean(mask: torch.Tensor, *, max_len: int | None = None) -> torch.Tensor:
    """loss = (1/B) sum_i (1/|o_i|) sum_t m_it L_it, B = sequences with at least one token."""
    lens = mask.sum(-1, keepdim=True)
    nseq = (lens > 0).sum().clamp(min=1)
    return mask / lens.clamp(min=1.0) / nseq


@register("aggregation", "seq_mean_token_sum", source="verl seq-mean-token-sum")
def seq_mean_token_sum(mask: torch.Tensor, *, max_len: int | None = None) -> torch.Tensor:
    """loss = (1/B) sum_i sum_t m_it L_it."""
    nseq = (mask.sum(-1) > 0).sum().clamp(min=1)
    return mask / nseq


@register("aggregation", "dr_grpo", source="Understanding R1-Zero-Like Training (Dr. GRPO); TRL loss_type='dr_grpo'; "
          "verl seq-mean-token-sum-norm")
def dr_grpo(mask: torch.Tensor, *, max_len: int | None = None) -> torch.Tensor:
    """loss = sum_{i,t} m_it L_it / (B * L_max), L_max = ``max_len`` (rollout.max_new_tokens; TRL
    ``max_completion_length``), or the padded width of the batch when not given."""
    L = max_len if max_len is not None else mask.shape[-1]
    return mask / (mask.shape[0] * L)


# ---------------------------------------------------------------------------------------------- KL regularisers
# Estimators of KL(pi_theta || pi_ref) per token from samples of pi_theta (Schulman, "Approximating KL
# Divergence", 2020). d = logp - ref_logp.


@register("regularizer", "kl_k1", source="Schulman 2020 k1; verl kl_loss_type=k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased, high variance, can be negative)."""
    return logp - ref_logp


@register("regularizer", "kl_k2", source="Schulman 2020 k2; verl kl_loss_type=mse")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (logp - ref_logp)^2."""
    return 0.5 * (logp - ref_logp) ** 2


@register("regularizer", "kl_k3", source="Schulman 2020 k3; GRPO paper; verl kl_loss_type=low_var_kl; TRL beta")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, always >= 0). The log-ratio is clamped to
    [-20, 20] before the exp; verl's low_var_kl additionally clamps k3 to [-10, 10], which postrl does not."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


@register("regularizer", "kl_abs", source="verl kl_loss_type=abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|logp - ref_logp|."""
    return (logp - ref_logp).abs()
