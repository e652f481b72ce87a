"""Calibration metrics of predicted success probabilities p against outcomes y in [0, 1].

Outcomes may be binary (0/1) or graded (a Monte-Carlo success fraction); every formula takes either.

* ECE (expected calibration error, equal-width bins; Guo et al. 2017 "On Calibration of Modern Neural Networks"):
  ECE = sum_b (n_b / N) |mean_{i in b} p_i - mean_{i in b} y_i| over B bins of [0, 1] (default B = 10; bin b holds
  p in [b/B, (b+1)/B), the last bin includes 1).
* conditional ECE: sum_c (N_c / N) ECE(p|c, y|c) -- ECE within each condition (e.g. step-index bucket), so a
  calibrator that is right on average but wrong per condition is seen.
* Brier score: mean_i (p_i - y_i)^2.
* reliability curve: per non-empty bin (mean p, mean y, count).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["ece", "conditional_ece", "brier", "reliability_curve", "reliability_diagram"]


def _arrays(p, y) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"{p.size} predictions for {y.size} outcomes")
    ok = np.isfinite(p) & np.isfinite(y)
    return p[ok], y[ok]


def reliability_curve(p, y, n_bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean prediction, mean outcome, count) of every non-empty equal-width bin."""
    p, y = _arrays(p, y)
    b = np.clip((p * n_bins).astype(int), 0, n_bins - 1)
    cnt = np.bincount(b, minlength=n_bins).astype(np.float64)
    sp = np.bincount(b, weights=p, minlength=n_bins)
    sy = np.bincount(b, weights=y, minlength=n_bins)
    nz = cnt > 0
    return sp[nz] / cnt[nz], sy[nz] / cnt[nz], cnt[nz]


def ece(p, y, n_bins: int = 10) -> float:
    """Expected calibration error (module docstring); NaN for no finite entries."""
    mp, my, cnt = reliability_curve(p, y, n_bins)
    if cnt.sum() == 0:
        return float("nan")
    return float(np.sum(cnt / cnt.sum() * np.abs(mp - my)))


def conditional_ece(p, y, conditions: Sequence, n_bins: int = 10) -> float:
    """Count-weighted mean over conditions of the ECE within each condition."""
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    y = np.asarray(y, dtype=np.float64).reshape(-1)
    c = np.asarray([str(x) for x in conditions])
    total, acc = 0, 0.0
    for v in np.unique(c):
        m = c == v
        e = ece(p[m], y[m], n_bins)
        if np.isfinite(e):
            n = int(np.isfinite(p[m]).sum())
            acc += n * e
            total += n
    return acc / total if total else float("nan")


def brier(p, y) -> float:
    """mean (p - y)^2 over finite entries."""
    p, y = _arrays(p, y)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def reliability_diagram(path, curves: dict[str, tuple], n_bins: int = 10, title: str = "reliability") -> None:
    """Write a PNG reliability diagram: one line per ``name -> (p, y)``, the diagonal, ECE in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.5), dpi=110)
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfect")
    for name, (p, y) in curves.items():
        mp, my, cnt = reliability_curve(p, y, n_bins)
        ax.plot(mp, my, marker="o", ms=4, label=f"{name} (ECE {ece(p, y, n_bins):.3f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted P(success)")
    ax.set_ylabel("observed success")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
