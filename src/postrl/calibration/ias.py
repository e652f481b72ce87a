"""Instance-adaptive Best-of-N: how many samples to draw per problem from a calibrated success estimate.

"Distributional Process Reward Models" (arXiv 2605.06785) feeds the confidence bounds of its calibrated conditional
quantiles into the instance-adaptive scaling (IAS) framework of Park et al. (2025, "Know What You Don't Know:
Uncertainty Calibration of Process Reward Models"): a problem whose calibrated success probability is high needs
few samples, a hard one many. With p the probability that one sample succeeds and samples independent, N samples
contain a success with probability 1 - (1 - p)^N, so the fewest that reach a target C are

    N(p) = ceil(log(1 - C) / log(1 - p)),   clipped to [n_min, n_max]   (p <= 0: n_max; p >= C: n_min)

and IAS uses a conservative p: the lower ``quantile`` (default 0.1) of the calibrated conditional distribution of
the success probability (:meth:`postrl.calibration.ConditionalOT.quantiles`); a calibrator without quantiles gives
its calibrated mean, and no calibrator the PRM's raw score (the uncalibrated baseline the paper compares with).
Assumed (the abstract gives no formula): this Best-of-N rule of IAS, the defaults C = 0.95, quantile 0.1, and that
the success estimate of a problem is the PRM's reading of the prompt before any step (``RewardModel.prompt_scores``;
its condition ``'prompt'``, as ``postrl prm train --calibration-prompts`` writes it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from postrl.calibration.calibrators import ConditionalOT
from postrl.errors import ConfigError

__all__ = ["ias_samples", "success_bound"]


def ias_samples(p, *, target: float = 0.95, n_min: int = 1, n_max: int = 16) -> np.ndarray:
    """N_i = clip(ceil(log(1 - target) / log(1 - p_i)), n_min, n_max) per problem (module docstring); int [n]."""
    if not 0.0 < target < 1.0:
        raise ConfigError(f"ias: target must be in (0, 1), got {target}")
    if not 1 <= n_min <= n_max:
        raise ConfigError(f"ias: expected 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
    p = np.clip(np.asarray(p, dtype=np.float64).reshape(-1), 0.0, 1.0)
    out = np.full(p.shape, n_max, dtype=np.int64)
    easy = p >= target
    out[easy] = n_min
    mid = (p > 0.0) & ~easy
    need = np.ceil(math.log1p(-target) / np.log1p(-p[mid]) - 1e-12)
    out[mid] = np.clip(need, n_min, n_max).astype(np.int64)
    return out


def success_bound(calibrator: Any, scores, *, quantile: float = 0.1, conditions=None, features=None) -> np.ndarray:
    """The conservative success probability per problem: the ``quantile``-level conditional quantile of a
    ``conditional_ot`` calibrator (its confidence bound), a calibrator's calibrated mean otherwise, the raw score
    (clipped to [0, 1]) without a calibrator."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if calibrator is None:
        return np.clip(s, 0.0, 1.0)
    if isinstance(calibrator, ConditionalOT):
        return calibrator.quantiles(s, [quantile], conditions, features)[:, 0]
    if features is not None:
        raise ConfigError(f"ias: the {calibrator.method} calibrator takes no features (use conditional_ot)")
    return np.asarray(calibrator.apply(s, conditions), dtype=np.float64)
