"""Group helpers: the one group index every stage, filter, producer, metric and integration uses.

A group is the set of completions of one prompt (``group_ids`` [N], any integer ids, not necessarily dense or
sorted). Statistics are vectorised with scatter-adds over the dense index (no Python loop over groups), in float64,
and count only the rows marked valid.

    inv, ng = group_index(group_ids)                     # dense group number per row [N], number of groups
    mean, std, n = group_stats(x, group_ids, valid)      # per-row group mean, unbiased std, valid count
    mean, lo, hi, n = group_moments(x, group_ids)        # over the finite entries of x
    lo, hi = group_minmax(x, group_ids, valid)
    corr, defined = group_corr(x, y, group_ids, valid)   # Pearson correlation within each group
    first, inv = group_first_rows(group_ids)             # first row of each group [ng]
    gids = dense_ids(values)                             # any hashable ids (verl's uid strings) -> [N] long
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def group_index(group_ids: Any) -> tuple[torch.Tensor, int]:
    """(inverse index [N] in 0..ng-1, ng): dense group numbers for scatter/index_add, in order of the sorted ids."""
    _, inv = torch.unique(torch.as_tensor(group_ids), return_inverse=True)
    inv = inv.reshape(-1)
    return inv, (int(inv.max()) + 1 if inv.numel() else 0)


def dense_ids(values: Any) -> torch.Tensor:
    """Dense group ids [N] (long) from any per-row hashable values (e.g. verl's ``uid`` strings)."""
    _, inv = np.unique(np.asarray([str(x) for x in values], dtype=object), return_inverse=True)
    return torch.as_tensor(inv.reshape(-1), dtype=torch.long)


def group_sum(x: torch.Tensor, inv: torch.Tensor, ng: int) -> torch.Tensor:
    """Per-group sums [ng] of ``x`` [N] (float64)."""
    return torch.zeros(ng, dtype=torch.float64, device=x.device).index_add_(0, inv, x.to(torch.float64))


def valid_mask(reward: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Rows that take part: ``valid`` (when given) and a finite reward."""
    v = torch.isfinite(reward)
    return v if valid is None else (v & valid.bool())


def group_stats(x: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None):
    """Per-row group mean, unbiased group std and group size, counting only valid rows.

    Returns (mean [N], std [N], count [N]) in float64; std is 0 for groups with fewer than 2 valid rows.
    """
    x = x.to(torch.float64)
    v = torch.ones_like(x, dtype=torch.bool) if valid is None else valid.bool()
    x0 = torch.where(v, x, torch.zeros_like(x))
    inv, ng = group_index(group_ids)
    cnt = group_sum(v, inv, ng)
    mean = group_sum(x0, inv, ng) / cnt.clamp(min=1)
    dev = torch.where(v, x - mean[inv], torch.zeros_like(x))
    ss = group_sum(dev * dev, inv, ng)
    var = torch.where(cnt > 1, ss / (cnt - 1).clamp(min=1), torch.zeros_like(ss))
    return mean[inv], var.sqrt()[inv], cnt[inv]


def group_minmax(x: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row min and max of ``x`` over the valid rows of its group (+inf / -inf for a group with none)."""
    inv, ng = group_index(group_ids)
    x = x.to(torch.float64)
    lo = torch.full((ng,), math.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(valid, x, torch.full_like(x, math.inf)), "amin")
    hi = torch.full((ng,), -math.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(valid, x, torch.full_like(x, -math.inf)), "amax")
    return lo[inv], hi[inv]


def group_moments(x: torch.Tensor, group_ids: torch.Tensor):
    """(per-row group mean, min, max, count) over the finite entries of ``x``."""
    ok = torch.isfinite(x)
    mean, _, cnt = group_stats(torch.where(ok, x, torch.zeros_like(x)), group_ids, ok)
    lo, hi = group_minmax(x, group_ids, ok)
    return mean, lo, hi, cnt


def group_first_rows(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each group [ng], group number of each row [N])."""
    inv, ng = group_index(group_ids)
    n = inv.numel()
    first = torch.full((ng,), n, dtype=torch.long).scatter_reduce(0, inv, torch.arange(n), "amin")
    return first, inv


def group_corr(x: torch.Tensor, y: torch.Tensor, group_ids: torch.Tensor,
               valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pearson correlation of ``x`` and ``y`` within each group, over its valid rows: (per-row correlation [N]
    float64, defined [N] bool).

    corr_g = sum (x - mean_g x)(y - mean_g y) / sqrt(sum (x - mean_g x)^2 sum (y - mean_g y)^2) over the valid rows
    of group g; defined when the group has >= 2 valid rows and both x and y take more than one value among them
    (exact: min != max), NaN otherwise."""
    v = torch.ones(x.shape[0], dtype=torch.bool) if valid is None else valid.bool()
    x, y = x.to(torch.float64), y.to(torch.float64)
    mx, _, n = group_stats(x, group_ids, v)
    my, _, _ = group_stats(y, group_ids, v)
    inv, ng = group_index(group_ids)
    dx = torch.where(v, x - mx, torch.zeros_like(x))
    dy = torch.where(v, y - my, torch.zeros_like(y))
    cov, vx, vy = group_sum(dx * dy, inv, ng)[inv], group_sum(dx * dx, inv, ng)[inv], group_sum(dy * dy, inv, ng)[inv]
    lo_x, hi_x = group_minmax(x, group_ids, v)
    lo_y, hi_y = group_minmax(y, group_ids, v)
    defined = (n >= 2) & (hi_x > lo_x) & (hi_y > lo_y)
    corr = cov / (vx * vy).sqrt().clamp(min=1e-300)
    return torch.where(defined, corr, torch.full_like(corr, math.nan)), defined
