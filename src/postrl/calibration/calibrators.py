"""Post-hoc calibrators of reward-model scores into P(success), fit on (score, condition, outcome) triples.

Scores are read as probabilities (``input='prob'``, e.g. a PRM's sigmoid outputs) or logits (``input='logit'``,
e.g. Bradley-Terry scores); outcomes are in [0, 1] (binary, or Monte-Carlo success fractions). Every calibrator
returns probabilities, is saved as JSON (``save`` / :func:`load_calibrator`) and applied at reward time by the
``model`` reward source (``calibrator: path.json``).

``temperature`` -- temperature scaling (Guo et al. 2017, "On Calibration of Modern Neural Networks"):
    p = sigmoid(z / T), z = logit(clip(s, 1e-6, 1 - 1e-6)) for probabilities, z = s for logits; T > 0 minimises
    the BCE -mean[y log p + (1 - y) log(1 - p)] on the fit set (golden-section search on log(1/T) in [-7, 7],
    80 iterations; the loss is convex in 1/T). One parameter; keeps the ranking.

``isotonic`` -- isotonic regression (Zadrozny & Elkan 2002): the non-decreasing step function g minimising
    sum_i (g(s_i) - y_i)^2, fitted with pool-adjacent-violators (own implementation, equal scores pooled first);
    applied by linear interpolation between the fitted points and clipped outside them (scikit-learn
    ``IsotonicRegression(out_of_bounds='clip')`` behaviour).

``conditional_ot`` -- after "Distributional Process Reward Models: Calibrated Prediction of Future Rewards via
    Conditional Optimal Transport". For each condition c (e.g. a step-index bucket) the 1-D optimal transport map
    from the distribution of predicted scores onto the distribution of observed success is the quantile map
        T_c(s) = F_{y|c}^{-1}(F_{s|c}(s)),
    estimated from ``n_quantiles`` (default 101) evenly spaced quantiles of each (linear interpolation between
    them, clipped at the ends). No retraining; monotone within each condition. A condition with fewer than
    ``min_count`` (default 20) fit rows, or not seen at fit time, uses the map fitted on all rows. Assumed (the
    abstract leaves it open): the target distribution is the empirical distribution of the outcome column per
    condition, so the outcomes must be graded success fractions (e.g. Monte-Carlo rollouts); with 0/1 outcomes the
    quantile map would output 0/1, so fitting on binary outcomes is an error (use ``isotonic``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from postrl.errors import ConfigError, DataError

__all__ = ["Calibrator", "TemperatureScaling", "Isotonic", "ConditionalOT", "load_calibrator", "make_calibrator",
           "pav", "METHODS", "to_prob"]

_EPS = 1e-6


def to_prob(scores, input: str = "prob") -> np.ndarray:
    """Scores as probabilities: unchanged for ``prob`` (clipped to [0, 1]), sigmoid for ``logit``."""
    s = np.asarray(scores, dtype=np.float64)
    if input == "logit":
        return 1.0 / (1.0 + np.exp(-s))
    return np.clip(s, 0.0, 1.0)


def _check_fit(scores, outcomes, conditions=None):
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(outcomes, dtype=np.float64).reshape(-1)
    if s.shape != y.shape:
        raise DataError(f"calibration: {s.size} scores for {y.size} outcomes")
    if s.size == 0:
        raise DataError("calibration: no rows to fit on")
    bad = np.flatnonzero(~np.isfinite(s))
    if bad.size:
        raise DataError(f"calibration: row {bad[0] + 1}: field 'score' is not a finite number")
    bad = np.flatnonzero(~(np.isfinite(y) & (y >= 0) & (y <= 1)))
    if bad.size:
        raise DataError(f"calibration: row {bad[0] + 1}: field 'outcome' must be a number in [0, 1], got {y[bad[0]]}")
    c = None
    if conditions is not None:
        c = np.asarray([str(x) for x in conditions])
        if c.size != s.size:
            raise DataError(f"calibration: {c.size} conditions for {s.size} scores")
    return s, y, c


class Calibrator(ABC):
    """Base: ``fit(scores, outcomes, conditions=None)``, ``apply(scores, conditions=None) -> probabilities``."""

    method = ""

    def __init__(self, input: str = "prob"):
        if input not in ("prob", "logit"):
            raise ConfigError(f"calibration: input '{input}': valid: prob, logit")
        self.input = input

    @abstractmethod
    def fit(self, scores, outcomes, conditions=None) -> "Calibrator":
        """Fit on (score, outcome[, condition]) rows; returns self."""

    @abstractmethod
    def apply(self, scores, conditions=None) -> np.ndarray:
        """Calibrated probabilities for ``scores``."""

    def __call__(self, scores, conditions=None) -> np.ndarray:
        return self.apply(scores, conditions)  # the subclass's apply (a class-level alias would bind the base's)

    @abstractmethod
    def params(self) -> dict[str, Any]:
        """JSON-serialisable fitted parameters."""

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "input": self.input, "params": self.params(), "format": 1}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path


class TemperatureScaling(Calibrator):
    """p = sigmoid(z / T) (module docstring); ``temperature`` = T (1.0 before fitting)."""

    method = "temperature"

    def __init__(self, input: str = "prob", temperature: float = 1.0):
        super().__init__(input)
        self.temperature = float(temperature)

    def _z(self, scores) -> np.ndarray:
        s = np.asarray(scores, dtype=np.float64)
        if self.input == "logit":
            return s
        s = np.clip(s, _EPS, 1 - _EPS)
        return np.log(s) - np.log1p(-s)

    def fit(self, scores, outcomes, conditions=None):
        s, y, _ = _check_fit(scores, outcomes)
        z = self._z(s)

        def nll(log_a: float) -> float:
            t = np.exp(log_a) * z
            # -[y log sigmoid(t) + (1-y) log sigmoid(-t)] = softplus(t) - y t
            return float(np.mean(np.logaddexp(0.0, t) - y * t))

        lo, hi = -7.0, 7.0
        g = (math.sqrt(5) - 1) / 2
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        fa, fb = nll(a), nll(b)
        for _ in range(80):
            if fa < fb:
                hi, b, fb = b, a, fa
                a = hi - g * (hi - lo)
                fa = nll(a)
            else:
                lo, a, fa = a, b, fb
                b = lo + g * (hi - lo)
                fb = nll(b)
        self.temperature = float(np.exp(-(lo + hi) / 2))
        return self

    def apply(self, scores, conditions=None) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self._z(scores) / self.temperature))

    def params(self):
        return {"temperature": self.temperature}


def pav(y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Pool-adjacent-violators: the non-decreasing sequence minimising sum w_i (g_i - y_i)^2 (y in fit order)."""
    y = np.asarray(y, dtype=np.float64)
    w = np.ones_like(y) if w is None else np.asarray(w, dtype=np.float64)
    vals: list[float] = []
    wts: list[float] = []
    cnts: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi)
        wts.append(wi)
        cnts.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            v, ww, c = vals.pop(), wts.pop(), cnts.pop()
            tw = wts[-1] + ww
            vals[-1] = (vals[-1] * wts[-1] + v * ww) / tw
            wts[-1] = tw
            cnts[-1] += c
    return np.repeat(np.asarray(vals), cnts)


class Isotonic(Calibrator):
    """Isotonic regression by PAV (module docstring); ``x``/``y`` are the fitted points (block ends)."""

    method = "isotonic"

    def __init__(self, input: str = "prob", x: Sequence[float] = (), y: Sequence[float] = ()):
        super().__init__(input)
        self.x = np.asarray(x, dtype=np.float64)
        self.y = np.asarray(y, dtype=np.float64)

    def fit(self, scores, outcomes, conditions=None):
        s, y, _ = _check_fit(scores, outcomes)
        xs, inv = np.unique(s, return_inverse=True)  # equal scores pooled first
        w = np.bincount(inv).astype(np.float64)
        ym = np.bincount(inv, weights=y) / w
        g = pav(ym, w)
        # keep only the ends of every constant block: interpolation between them reproduces the fit
        keep = np.ones(xs.size, dtype=bool)
        if xs.size > 2:
            same_prev = np.r_[False, g[1:] == g[:-1]]
            same_next = np.r_[g[:-1] == g[1:], False]
            keep = ~(same_prev & same_next)
        self.x, self.y = xs[keep], g[keep]
        return self

    def apply(self, scores, conditions=None) -> np.ndarray:
        if self.x.size == 0:
            raise ConfigError("isotonic calibrator: not fitted")
        return np.interp(np.asarray(scores, dtype=np.float64), self.x, self.y)

    def params(self):
        return {"x": self.x.tolist(), "y": self.y.tolist()}


def _quantile_map(s: np.ndarray, y: np.ndarray, n_quantiles: int) -> tuple[np.ndarray, np.ndarray]:
    u = np.linspace(0.0, 1.0, n_quantiles)
    src, tgt = np.quantile(s, u), np.quantile(y, u)
    xs, inv = np.unique(src, return_inverse=True)  # flat stretches of the source CDF: average their targets
    ys = np.bincount(inv, weights=tgt) / np.bincount(inv)
    return xs, ys


class ConditionalOT(Calibrator):
    """Per-condition quantile map F_{y|c}^{-1} o F_{s|c} (module docstring)."""

    method = "conditional_ot"

    def __init__(self, input: str = "prob", n_quantiles: int = 101, min_count: int = 20,
                 maps: dict[str, tuple] | None = None, pooled: tuple | None = None):
        super().__init__(input)
        if n_quantiles < 2:
            raise ConfigError(f"conditional_ot: n_quantiles must be >= 2, got {n_quantiles}")
        self.n_quantiles = int(n_quantiles)
        self.min_count = int(min_count)
        self.maps = {k: (np.asarray(a), np.asarray(b)) for k, (a, b) in (maps or {}).items()}
        self.pooled = None if pooled is None else (np.asarray(pooled[0]), np.asarray(pooled[1]))

    def fit(self, scores, outcomes, conditions=None):
        s, y, c = _check_fit(scores, outcomes, conditions)
        if np.all((y == 0) | (y == 1)):
            raise DataError("conditional_ot: the outcomes are all 0/1; the quantile map needs graded success "
                            "fractions (e.g. Monte-Carlo rollouts per prefix); use isotonic for binary outcomes")
        self.pooled = _quantile_map(s, y, self.n_quantiles)
        self.maps = {}
        if c is not None:
            for v in np.unique(c):
                m = c == v
                if m.sum() >= self.min_count:
                    self.maps[str(v)] = _quantile_map(s[m], y[m], self.n_quantiles)
        return self

    def apply(self, scores, conditions=None) -> np.ndarray:
        if self.pooled is None:
            raise ConfigError("conditional_ot calibrator: not fitted")
        s = np.asarray(scores, dtype=np.float64)
        out = np.interp(s, *self.pooled)
        if conditions is not None and self.maps:
            c = np.asarray([str(x) for x in conditions]).reshape(s.shape)
            for v, (xs, ys) in self.maps.items():
                m = c == v
                if m.any():
                    out[m] = np.interp(s[m], xs, ys)
        return np.clip(out, 0.0, 1.0)

    def params(self):
        return {"n_quantiles": self.n_quantiles, "min_count": self.min_count,
                "maps": {k: [a.tolist(), b.tolist()] for k, (a, b) in self.maps.items()},
                "pooled": None if self.pooled is None else [self.pooled[0].tolist(), self.pooled[1].tolist()]}


METHODS = {"temperature": TemperatureScaling, "isotonic": Isotonic, "conditional_ot": ConditionalOT}


def make_calibrator(method: str, input: str = "prob", **params) -> Calibrator:
    """An unfitted calibrator by name (temperature, isotonic, conditional_ot)."""
    if method not in METHODS:
        raise ConfigError(f"calibration method '{method}': valid: {', '.join(METHODS)}")
    return METHODS[method](input=input, **params)


def load_calibrator(path: str | Path) -> Calibrator:
    """A calibrator saved by :meth:`Calibrator.save`."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"calibrator '{p}': file not found")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"calibrator '{p}': not valid JSON ({e.msg})") from None
    method = d.get("method") if isinstance(d, dict) else None
    if method not in METHODS:
        raise ConfigError(f"calibrator '{p}': unknown method {method!r}; valid: {', '.join(METHODS)}")
    return METHODS[method](input=d.get("input", "prob"), **d.get("params", {}))
