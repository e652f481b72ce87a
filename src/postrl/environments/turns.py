"""Per-turn bookkeeping of multi-turn episodes, shared by the rollout (:mod:`postrl.environments.episodes`) and
the rewriting of episodes after it (:mod:`postrl.environments.cleaner`)."""

from __future__ import annotations

import torch

TURN_COUNTERS = ("tool_calls", "tool_errors", "malformed_calls")  # also kept per turn: turn_<name> [N, K]


def turn_index(turn_ends: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """[N, T] long: k on the model tokens of turn k (the tokens up to ``turn_ends[:, k]`` after turn k-1's end,
    in the loss mask), -1 on environment tokens and padding."""
    T = completion_mask.shape[1]
    t = torch.arange(T)
    ends = turn_ends.clone()
    before = (ends[:, None, :] < t[None, :, None]) & (ends[:, None, :] >= 0)          # [N, T, K]
    k = before.sum(-1)
    inside = k < (ends >= 0).sum(-1, keepdim=True)
    return torch.where(inside & (completion_mask > 0), k, torch.full_like(k, -1))
