"""Reward noise: flip binary rewards and add zero-mean noise, reproducibly, to study (or simulate) noisy rewards."""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Le

from postrl.registry import register
from postrl.seeding import stable_hash
from postrl.shaping._util import cols

_UNIT = 2.0 ** 64


def _uniform(*parts) -> float:
    """A uniform number in (0, 1) determined by ``parts`` (the same in every process and Python version)."""
    return (stable_hash(*parts) + 0.5) / _UNIT


@register("shaping", "reward_noise", source="The Climb Carves Wisdom Deeper Than the Summit: On the Noisy Rewards "
                                            "in Learning to Reason")
def reward_noise(rewards, reward_names, group_ids, step=0, attempt=0, *, sources: list[str] | None = None,
                 flip_prob: Annotated[float, Ge(0), Le(1)] = 0.0, noise_std: Annotated[float, Ge(0)] = 0.0,
                 noise: Literal["gaussian", "uniform"] = "gaussian", per: Literal["row", "group"] = "row",
                 low: float = 0.0, high: float = 1.0, seed: int = 0):
    """Corrupt reward columns: flip a binary reward with probability ``flip_prob``, then add zero-mean noise.

    For each column k in ``sources`` (default all) and row i (failed entries stay NaN):

        r' = (low + high - r) if u_flip < flip_prob else r        (r in {low, high}; default {0, 1}: r' = 1 - r)
        r'' = r' + noise_std * z                                   z ~ N(0, 1) ('gaussian') or U(-sqrt 3, sqrt 3)

    ('uniform', also unit variance). u_flip and z derive from (``seed``, the step, the refill round, the row's
    group id, its position in the group, the column name) by a stable hash: the same batch of the same step gets
    the same noise in every process, every call (a refill round's rows their own) and every run with that seed.
    ``per='group'`` flips all the completions of a prompt together (one coin per group and column: the authors'
    released code flips per prompt); ``per='row'`` (default) flips each completion on its own, the abstract's
    "flipping 40% of the reward function's outputs" (``flip_prob: 0.4``). The noise is always per row.
    "The Climb Carves Wisdom Deeper Than the Summit" found RL robust to such noise (40% flips: 72% vs 75% on
    math with Qwen-2.5-7B). Flipping a column whose values are not in {low, high} is an error naming the column.
    Put it right after the reward sources (before any other shaping, and before ``weighted_sum``).
    """
    out = rewards.clone()
    g = group_ids.tolist()
    pos, seen = [], {}
    for gid in g:  # the row's position within its group, in batch order
        seen[gid] = seen.get(gid, -1) + 1
        pos.append(seen[gid])
    step, attempt = int(step), int(attempt)
    for k in cols(reward_names, sources, "reward_noise"):
        name = reward_names[k]
        r = rewards[:, k].to(torch.float64)
        ok = torch.isfinite(r)
        if flip_prob > 0:
            binary = (r == low) | (r == high)
            if bool((ok & ~binary).any()):
                bad = float(r[ok & ~binary][0])
                raise ValueError(f"shaping 'reward_noise': column '{name}' holds {bad:g}, not a binary reward in "
                                 f"{{{low:g}, {high:g}}}; set 'sources' to the binary columns, or flip_prob 0")
            unit = [(gid,) if per == "group" else (gid, p) for gid, p in zip(g, pos)]
            flip = torch.tensor([_uniform(seed, step, attempt, "flip", name, *u) < flip_prob for u in unit])
            r = torch.where(flip & ok, low + high - r, r)
        if noise_std > 0:
            if noise == "gaussian":  # Box-Muller from two hashed uniforms
                z = [math.sqrt(-2.0 * math.log(_uniform(seed, step, attempt, "z1", name, gid, p)))
                     * math.cos(2.0 * math.pi * _uniform(seed, step, attempt, "z2", name, gid, p))
                     for gid, p in zip(g, pos)]
            else:
                z = [math.sqrt(3.0) * (2.0 * _uniform(seed, step, attempt, "u", name, gid, p) - 1.0)
                     for gid, p in zip(g, pos)]
            r = r + noise_std * torch.tensor(z, dtype=torch.float64)
        out[:, k] = r.to(out.dtype)
    return {"rewards": out}


__all__ = ["reward_noise"]
