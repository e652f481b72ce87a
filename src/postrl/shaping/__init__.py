"""Reward shaping: transforms of the named reward matrix, and its combination into the scalar reward.

Each shaping stage returns a dict of the batch fields it sets (``rewards`` [N, K] and/or ``reward`` [N]).
The stages run in the order the config lists them; one of them must produce ``reward``.
"""

from __future__ import annotations

import torch

from postrl.registry import register


@register("shaping", "weighted_sum", source="GRPO (DeepSeekMath); TRL reward_weights")
def weighted_sum(rewards: torch.Tensor, reward_weights: torch.Tensor) -> dict:
    """r_i = sum_k w_k r_i^k over the K named reward sources.

    Shapes: rewards [N, K], reward_weights [K] -> reward [N]. A NaN component (a failed reward) makes the sum
    NaN, so that completion is excluded downstream rather than scored as if the component were 0.
    Anchor: TRL ``reward_weights`` (TRL instead treats None as NaN and uses ``nansum``; postrl excludes).
    """
    return {"reward": (rewards * reward_weights.to(rewards.dtype)).sum(-1)}
