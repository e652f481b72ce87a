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

``conditional_ot`` -- "Distributional Process Reward Models: Calibrated Prediction of Future Rewards via
    Conditional Optimal Transport" (arXiv 2605.06785): a *monotone conditional quantile function* Q(tau | x) of the
    prefix's success probability (the outcome column: a Monte-Carlo success fraction) given features x of the
    prefix. In one dimension the optimal transport map from U(0, 1) onto the conditional law of y given x is its
    quantile function, the unique map non-decreasing in tau; learning it for every x is conditional OT map
    learning. Here x = [z, onehot(condition), features]: z the score's logit (the score itself for
    ``input='logit'``), the condition one-hot over the conditions seen at fit (an unseen one: all zeros), and
    optional extra ``features`` per row (the PRM's hidden state, or anything extracted from it); each column
    standardised with the fit set's mean / std. Model (monotone in tau by construction, non-crossing):
        h = x  (default ``hidden=0``: a linear-in-features head), or h = tanh(x W1 + b1) with ``hidden`` units
        a = h W2 + b2  in R^J,   v_1 = a_1,  v_j = v_{j-1} + softplus(a_j),   Q(tau_j | x) = sigmoid(v_j)
    at the J = ``n_taus`` (default 32) mid-point levels tau_j = (j - 1/2) / J, fitted by Adam (full batch,
    ``steps`` 300, ``lr`` 0.02, ``weight_decay`` 1e-4, ``seed`` 0; the linear head starts at the least-squares
    location shift, a hidden layer at the marginal quantiles) on the pinball loss of the logit-scale targets
            L = mean_{i,j} rho_{tau_j}(l_i - v_j(x_i)),  l = logit(y~)
    (quantiles commute with increasing maps, so the fitted v_j are quantiles of y~ on the logit scale, well
    conditioned). Monte-Carlo fractions y = k / M are discrete, and a model smooth in x puts its quantiles between
    the atoms, so central intervals under-cover (80% intervals covered ~70% of held-out outcomes at M = 16);
    as in quantile regression for counts (Machado & Santos Silva 2005, "Quantiles for Counts") the counts are
    jittered: y~ = (k + U(0, 1)) / (M + 1), and quantiles are mapped back by y = (q (M + 1) - 1/2) / M (clipped to
    [0, 1]), which keeps the mean (E[y~] = (E[k] + 1/2) / (M + 1)). M = ``rollouts``: by default the smallest
    M <= 256 with every outcome a multiple of 1/M; 0 (or outcomes on no such grid) fits logit(clip(y, 1e-3,
    1 - 1e-3)) directly.
    Read-outs: ``apply`` = the calibrated mean E[y | x] = int_0^1 Q(tau | x) dtau ~ mean_j Q(tau_j | x);
    ``quantiles(taus)`` by linear interpolation in tau (flat beyond tau_1 and tau_J, so levels outside
    [1/(2J), 1 - 1/(2J)] are clamped there); ``bounds(level)`` = (Q((1 - level)/2), Q((1 + level)/2)), a central
    interval of the *measured* outcome (with M rollouts it contains the binomial noise of the estimate, so it
    covers the true success probability at least as often). The PRM is not retrained. Assumed (the abstract
    leaves it open): the targets are the graded Monte-Carlo fractions, so fitting on outcomes that are all 0/1
    is an error (use ``isotonic``); the reward-time path (the ``model`` reward source) passes scores and step
    buckets, and with ``calibrator_features: hidden`` the PRM's hidden state at each step end as the features
    (the paper's conditioning; ``postrl prm train --calibration-features`` writes them into the fit rows).
    The lower quantiles are the confidence bounds that instance-adaptive Best-of-N uses
    (:mod:`postrl.calibration.ias`, ``postrl eval --ias``).
    The default linear head keeps held-out interval coverage near nominal on the synthetic benchmark
    (tests/test_calibration.py); a 32-unit tanh layer fitted on the same 2000 rows over-fits the quantiles (80%
    intervals covering 64-67% of held-out outcomes, Brier 0.024 against 0.017). When the features carry nothing beyond the score, its mean is no better than isotonic
    regression; its gain comes from conditions and features that separate prefixes the score confuses.
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
_Y_CLIP = 1e-3  # conditional_ot fits logit(clip(y, 1e-3, 1 - 1e-3))


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


def _infer_rollouts(y: np.ndarray, max_rollouts: int = 256) -> int:
    """The smallest M <= ``max_rollouts`` with every y a multiple of 1/M (to 1e-6), else 0 (continuous)."""
    for m in range(1, max_rollouts + 1):
        if np.all(np.abs(y * m - np.round(y * m)) < 1e-6 * m):
            return m
    return 0


def _softplus(a: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, a)


def _inv_softplus(a: np.ndarray) -> np.ndarray:
    return np.log(np.expm1(a))


class ConditionalOT(Calibrator):
    """Monotone conditional quantile model Q(tau | score, condition, features) (module docstring).

    ``fit`` / ``apply`` take ``features`` ([N, d] numbers per row, optional); ``quantiles`` and ``bounds`` give
    the conditional quantiles and central intervals at any level.
    """

    method = "conditional_ot"

    def __init__(self, input: str = "prob", n_taus: int = 32, hidden: int = 0, steps: int = 300, lr: float = 0.02,
                 weight_decay: float = 1e-4, seed: int = 0, conditions: Sequence[str] = (), n_features: int = 0,
                 mean: Sequence[float] = (), std: Sequence[float] = (), weights: dict[str, Any] | None = None,
                 rollouts: int | None = None):
        super().__init__(input)
        if rollouts is not None and rollouts < 0:
            raise ConfigError(f"conditional_ot: rollouts must be >= 0 (0: continuous outcomes), got {rollouts}")
        self.rollouts = None if rollouts is None else int(rollouts)
        if n_taus < 2:
            raise ConfigError(f"conditional_ot: n_taus must be >= 2, got {n_taus}")
        if hidden < 0 or steps < 1 or lr <= 0:
            raise ConfigError(f"conditional_ot: hidden must be >= 0, steps >= 1, lr > 0; got {hidden}, {steps}, {lr}")
        self.n_taus, self.hidden, self.steps = int(n_taus), int(hidden), int(steps)
        self.lr, self.weight_decay, self.seed = float(lr), float(weight_decay), int(seed)
        self.conditions = [str(c) for c in conditions]
        self.n_features = int(n_features)
        self.mean, self.std = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
        self.weights = {k: np.asarray(v, dtype=np.float64) for k, v in (weights or {}).items()}

    @property
    def taus(self) -> np.ndarray:
        """The fitted levels tau_j = (j - 1/2) / J."""
        return (np.arange(self.n_taus) + 0.5) / self.n_taus

    def _z(self, scores) -> np.ndarray:
        s = np.asarray(scores, dtype=np.float64).reshape(-1)
        if self.input == "logit":
            return s
        s = np.clip(s, _EPS, 1 - _EPS)
        return np.log(s) - np.log1p(-s)

    def _design(self, scores, conditions, features) -> np.ndarray:
        """Raw feature matrix [N, 1 + C + d]: z, one-hot condition, extra features."""
        z = self._z(scores)
        cols = [z[:, None]]
        if self.conditions:
            onehot = np.zeros((z.size, len(self.conditions)))
            if conditions is not None:
                c = np.asarray([str(x) for x in conditions]).reshape(-1)
                if c.size != z.size:
                    raise DataError(f"conditional_ot: {c.size} conditions for {z.size} scores")
                onehot = (c[:, None] == np.asarray(self.conditions)[None, :]).astype(np.float64)
            cols.append(onehot)
        if features is None:
            if self.n_features:
                raise ConfigError(f"conditional_ot calibrator: fitted with {self.n_features} features per row; "
                                  f"apply it with 'features' (the model reward source: calibrator_features: hidden)")
        else:
            f = np.asarray(features, dtype=np.float64)
            f = f.reshape(z.size, -1) if f.size else np.zeros((z.size, 0))
            if f.shape[1] != self.n_features:
                raise DataError(f"conditional_ot: 'features' has {f.shape[1]} columns, expected {self.n_features}")
            if not np.all(np.isfinite(f)):
                raise DataError("conditional_ot: 'features' must be finite numbers")
            cols.append(f)
        return np.concatenate(cols, axis=1)

    def _head(self, x: np.ndarray) -> np.ndarray:
        w = self.weights
        h = np.tanh(x @ w["W1"] + w["b1"]) if self.hidden else x
        return h @ w["W2"] + w["b2"]

    @staticmethod
    def _monotone(a: np.ndarray) -> np.ndarray:
        """v_1 = a_1, v_j = v_{j-1} + softplus(a_j): non-decreasing in j."""
        return np.cumsum(np.concatenate([a[:, :1], _softplus(a[:, 1:])], axis=1), axis=1)

    def fit(self, scores, outcomes, conditions=None, features=None):
        import torch

        s, y, c = _check_fit(scores, outcomes, conditions)
        if np.all((y == 0) | (y == 1)):
            raise DataError("conditional_ot: the outcomes are all 0/1; the conditional quantile model needs graded "
                            "success fractions (e.g. Monte-Carlo rollouts per prefix); use isotonic for binary "
                            "outcomes")
        self.conditions = [] if c is None else sorted(set(c.tolist()))
        self.n_features = 0
        if features is not None:
            f = np.asarray(features, dtype=np.float64)
            self.n_features = f.size // s.size if f.size else 0
        x = self._design(s, c, features)
        self.mean, self.std = x.mean(0), x.std(0)
        self.std[self.std < 1e-12] = 1.0
        x = (x - self.mean) / self.std
        taus = self.taus
        g = torch.Generator().manual_seed(self.seed)
        d, k = x.shape[1], self.hidden
        params = {}
        if k:
            params["W1"] = torch.randn(d, k, generator=g, dtype=torch.float64) / math.sqrt(d)
            params["b1"] = torch.zeros(k, dtype=torch.float64)
        w2 = np.random.default_rng(self.seed).normal(0, 0.01, (k or d, self.n_taus))
        # start: the linear head at a location shift (least squares of the logit targets on x, plus the
        # residual quantiles); a hidden layer at the outcome's marginal quantiles (logit scale)
        m = _infer_rollouts(y) if self.rollouts is None else self.rollouts
        self.rollouts = m
        if m:  # jittered counts (k + U(0, 1)) / (M + 1), in (0, 1)
            yc = (np.round(y * m) + np.random.default_rng(self.seed).uniform(size=y.size)) / (m + 1)
        else:
            yc = np.clip(y, _Y_CLIP, 1 - _Y_CLIP)
        yl = np.log(yc) - np.log1p(-yc)
        beta = np.zeros(d) if k else np.linalg.lstsq(x, yl - yl.mean(), rcond=None)[0]
        v0 = yl.mean() + np.quantile(yl - yl.mean() - x @ beta, taus)
        if not k:
            w2[:, 0] += beta
        b2 = np.r_[v0[0], _inv_softplus(np.maximum(np.diff(v0), 1e-3))]
        params["W2"] = torch.from_numpy(w2)
        params["b2"] = torch.tensor(b2)
        for p in params.values():
            p.requires_grad_(True)
        opt = torch.optim.Adam(params.values(), lr=self.lr, weight_decay=self.weight_decay)
        xt, yt, tt = torch.from_numpy(x), torch.from_numpy(yl)[:, None], torch.from_numpy(taus)[None, :]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # small matrices: one thread is fastest and does not contend
        try:
            self._train(params, opt, xt, yt, tt)
        finally:
            torch.set_num_threads(threads)
        self.weights = {n: p.detach().numpy().copy() for n, p in params.items()}
        return self

    def _train(self, params, opt, xt, yt, tt) -> None:
        """Adam on the pinball loss (module docstring), in place on ``params``."""
        import torch

        k = self.hidden
        for _ in range(self.steps):
            h = torch.tanh(xt @ params["W1"] + params["b1"]) if k else xt
            a = h @ params["W2"] + params["b2"]
            v = torch.cumsum(torch.cat([a[:, :1], torch.nn.functional.softplus(a[:, 1:])], dim=1), dim=1)
            u = yt - v  # (v: the torch twin of _monotone; the loss is on the logit scale)
            loss = torch.maximum(tt * u, (tt - 1) * u).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    def _grid(self, scores, conditions=None, features=None) -> np.ndarray:
        """[N, J] conditional quantiles at the fitted levels ``taus``."""
        if not self.weights:
            raise ConfigError("conditional_ot calibrator: not fitted")
        x = (self._design(scores, conditions, features) - self.mean) / self.std
        q = 1.0 / (1.0 + np.exp(-self._monotone(self._head(x))))
        if self.rollouts:  # back from the jittered scale: y = (q (M + 1) - 1/2) / M
            q = np.clip((q * (self.rollouts + 1) - 0.5) / self.rollouts, 0.0, 1.0)
        return q

    def apply(self, scores, conditions=None, features=None) -> np.ndarray:
        """Calibrated mean E[y | x] = mean_j Q(tau_j | x), shaped like ``scores``."""
        shape = np.shape(scores)
        return self._grid(scores, conditions, features).mean(1).reshape(shape)

    def quantiles(self, scores, taus, conditions=None, features=None) -> np.ndarray:
        """[N, len(taus)] conditional quantiles Q(tau | x) (linear in tau between the fitted levels)."""
        grid, t = self._grid(scores, conditions, features), np.asarray(taus, dtype=np.float64).reshape(-1)
        if np.any((t < 0) | (t > 1)):
            raise ConfigError(f"conditional_ot: quantile levels must be in [0, 1], got {t.tolist()}")
        idx = np.interp(t, self.taus, np.arange(self.n_taus))  # fractional column index, clamped at the ends
        lo = np.floor(idx).astype(int)
        hi = np.minimum(lo + 1, self.n_taus - 1)
        frac = idx - lo
        return grid[:, lo] * (1 - frac) + grid[:, hi] * frac

    def bounds(self, scores, level: float = 0.9, conditions=None, features=None) -> tuple[np.ndarray, np.ndarray]:
        """Central ``level`` interval (Q((1 - level)/2 | x), Q((1 + level)/2 | x)) of the outcome."""
        if not 0 < level < 1:
            raise ConfigError(f"conditional_ot: bound level must be in (0, 1), got {level}")
        q = self.quantiles(scores, [(1 - level) / 2, (1 + level) / 2], conditions, features)
        return q[:, 0], q[:, 1]

    def params(self):
        return {"n_taus": self.n_taus, "hidden": self.hidden, "steps": self.steps, "lr": self.lr,
                "weight_decay": self.weight_decay, "seed": self.seed, "conditions": self.conditions,
                "n_features": self.n_features, "rollouts": self.rollouts, "mean": self.mean.tolist(),
                "std": self.std.tolist(),
                "weights": {k: v.tolist() for k, v in self.weights.items()}}


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
