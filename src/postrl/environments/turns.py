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


def taken_turn_rewards(turn_rewards: torch.Tensor, turn_ends: torch.Tensor,
                       env_errors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r, taken, failed): ``turn_rewards`` in float64 with 0 for a turn the environment did not reward and for a
    turn not taken [N, K]; ``taken`` = ``turn_ends`` >= 0 [N, K]; ``failed`` [N] bool, an episode with a NaN reward
    in a turn it took (its environment or user failed) or an environment error (``env_errors`` > 0). What the
    episode-reward shapings (``score_bonus``, ``trajectory_score``) start from."""
    taken = turn_ends >= 0
    r = turn_rewards.double()
    failed = (torch.isnan(r) & taken).any(-1)
    if env_errors is not None:
        failed |= env_errors > 0
    return torch.where(taken, torch.nan_to_num(r, nan=0.0), torch.zeros_like(r)), taken, failed
