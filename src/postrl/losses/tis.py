"""Truncated importance sampling (TIS) for the sampler/trainer log-prob mismatch.

The sampler (vLLM, or postrl's own KV-cache sampler) and the trainer compute slightly different
probabilities for the same tokens (kernels, precision, batch shapes), so the rollout is off-policy for the
policy the loss thinks generated it ("Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", Yao et al. 2025). TIS multiplies the policy loss by a detached, truncated importance weight
(the KL and regularisers are not weighted, as in verl and TRL).
"""

from __future__ import annotations

import torch

LEVELS = ("none", "token", "sequence")
MODES = ("truncate", "mask")


def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, *,
                level: str = "token", mode: str = "truncate", cap: float = 2.0) -> torch.Tensor:
    """Detached weights [N, T] for the policy-loss matrix (``loss.tis``).

    d_t = old_logp_t - sampler_logp_t (trainer's log-prob of the policy that generated the batch minus the
    sampler's); ``level='token'``: w_t = exp(d_t); ``level='sequence'``: w_i = exp(sum_t m_t d_t) on every token
    of the row (the product of the token ratios). The log-weight is clamped to [-20, 20] (verl's safety bound).
    ``mode='truncate'``: w <- min(w, C); ``mode='mask'``: w <- 0 where w > C. Default C = ``cap`` = 2.0.
    Anchors: verl ``rollout_is='token'|'sequence'`` with ``rollout_is_threshold`` (default 2.0) is
    ``truncate``; TRL ``vllm_importance_sampling_mode`` = ``{token,sequence}_{truncate,mask}`` with
    ``vllm_importance_sampling_cap`` (TRL's current defaults: sequence_mask, cap 3.0). ``mask`` zeroes the weight
    and keeps the token in the aggregation's normaliser, as TRL does (verl's rejection mask removes it instead).
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"loss.tis.level: expected 'token' or 'sequence', got {level!r}")
    if mode not in MODES:
        raise ValueError(f"loss.tis.mode: expected 'truncate' or 'mask', got {mode!r}")
    if cap <= 0:
        raise ValueError(f"loss.tis.cap: expected a value > 0, got {cap}")
    with torch.no_grad():
        d = (old_logp - sampler_logp) * mask
        if level == "sequence":
            d = d.sum(-1, keepdim=True).expand_as(old_logp)
        w = torch.exp(d.clamp(-20.0, 20.0))
        if mode == "truncate":
            w = w.clamp(max=cap)
        else:
            w = w.masked_fill(w > cap, 0.0)
    return w
