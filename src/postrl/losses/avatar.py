"""AVATAR's Temporal Advantage Shaping (kind ``regularizer``, a ``pg_mask``): position-dependent token weights."""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge

from postrl.registry import register

AVATAR = "AVATAR: Reinforcement Learning to See, Hear, and Reason Over Video"


def tas_weights(mask: torch.Tensor, lam: float) -> torch.Tensor:
    """w_{i,t} = 1 + lam (2 t / (L_i - 1) - 1)^2 on the completion tokens of row i, 0 elsewhere.

    L_i = the index of row i's last completion token + 1 (its length for a contiguous mask), t = 0..L_i - 1, so
    w = 1 + lam at the first and the last token and 1 at the middle; a row of one token gets 1 + lam. [N, T]."""
    m = mask > 0
    T = mask.shape[-1]
    pos = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(m, pos, torch.full_like(pos, -1)).amax(-1, keepdim=True)  # L_i - 1 (-1: empty row)
    t_norm = pos.to(torch.float32) / last.clamp(min=1).to(torch.float32)
    return torch.where(m, 1.0 + lam * (2.0 * t_norm - 1.0) ** 2, torch.zeros((), dtype=torch.float32))


@register("regularizer", "temporal_advantage_shaping", source=AVATAR)
def temporal_advantage_shaping(mask, *, lam: Annotated[float, Ge(0)] = 0.3) -> dict:
    """Temporal Advantage Shaping (TAS): weight each token's policy loss by a U-shaped function of its position.

    AVATAR's TAS "upweights key reasoning phases during learning": the start (planning) and the end (the answer)
    of a response. After the released code (``GRPOTASTrainer._compute_tas_weights``): pg_mask_{i,t} = w_{i,t} =
    1 + ``lam`` (2 t / (L_i - 1) - 1)^2 (``tas_weights``; ``lam`` = lambda_TAS, default 0.3 as there), which
    multiplies the policy-loss matrix before the aggregation, so the update is the one with advantages
    A_{i,t} = w_{i,t} A_i (the KL term and the other regularisers are not weighted, as in the released code, where
    the KL is added after). ``coef`` is not used. ``lam`` 0: every weight 1 (plain GRPO). Assumed: L_i from the
    row's last completion token (the released code divides by the mask's sum - 1; the same for a contiguous mask).
    Shapes: mask [N, T] -> {"pg_mask": [N, T]}.
    """
    return {"pg_mask": tas_weights(mask, lam).to(mask.dtype if mask.is_floating_point() else torch.float32)}
