"""Helpers shared by the shaping stages: column lookup, appended columns, group statistics."""

from __future__ import annotations

import math

import torch

from postrl.groups import group_index

NAN = float("nan")


def col(reward_names: list[str], name: str, stage: str, key: str = "source") -> int:
    """Index of the reward column ``name``; a ValueError listing the columns when there is none."""
    if name not in reward_names:
        raise ValueError(f"shaping '{stage}': {key} '{name}' is not a reward column; columns: "
                         f"{', '.join(reward_names) or '(none)'}")
    return reward_names.index(name)


def cols(reward_names: list[str], sources: list[str] | str | None, stage: str) -> list[int]:
    """Indices of ``sources`` (all columns when None)."""
    if sources is None:
        return list(range(len(reward_names)))
    if isinstance(sources, str):
        sources = [sources]
    return [col(reward_names, s, stage, "sources") for s in sources]


def append_column(rewards: torch.Tensor, reward_names: list[str], reward_weights: torch.Tensor,
                  values: torch.Tensor, name: str, weight: float, stage: str) -> dict:
    """The batch fields with one more named reward column (``values`` [N], weight ``weight``)."""
    if name in reward_names:
        raise ValueError(f"shaping '{stage}': column '{name}' already exists; set a different 'name'")
    return {
        "rewards": torch.cat([rewards, values.to(rewards.dtype).unsqueeze(-1)], dim=-1),
        "reward_names": [*reward_names, name],
        "reward_weights": torch.cat([reward_weights.to(torch.float32),
                                     torch.tensor([float(weight)], dtype=torch.float32)]),
    }


def with_column(rewards: torch.Tensor, k: int, values: torch.Tensor) -> torch.Tensor:
    out = rewards.clone()
    out[:, k] = values.to(rewards.dtype)
    return out


def correctness(rewards: torch.Tensor, reward_names: list[str], source: str, threshold: float, stage: str):
    """(correct [N] bool, known [N] bool): correct = r_source >= threshold; known = the entry did not fail."""
    r = rewards[:, col(reward_names, source, stage)]
    known = torch.isfinite(r)
    return known & (r >= threshold), known


def group_mean(x: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row mean of ``x`` over the valid rows of its group (NaN for a group with none)."""
    inv, ng = group_index(group_ids)
    x = x.to(torch.float64)
    v = valid.to(torch.float64)
    s = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, torch.where(valid, x, torch.zeros_like(x)))
    c = torch.zeros(ng, dtype=torch.float64).index_add_(0, inv, v)
    m = torch.where(c > 0, s / c.clamp(min=1), torch.full_like(s, math.nan))
    return m[inv]


def process_column(reward_names: list[str], step_reward_source: str | None, source: str | None, stage: str) -> int:
    """The column of the process reward whose step scores are in ``step_rewards``."""
    name = source or step_reward_source
    if name is None:
        raise ValueError(f"shaping '{stage}': no reward source returned step scores; set 'source'")
    return col(reward_names, name, stage)
