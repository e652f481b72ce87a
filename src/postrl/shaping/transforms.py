"""Transforms of reward columns: PAR, centering, running normalisation, RM-ensemble aggregation, dataset medians.

All keep NaN (a failed entry) as NaN. ``sources`` names the columns a stage transforms (default: all).
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
from annotated_types import Ge, Gt, Le, Lt

from postrl.registry import register
from postrl.reward_models.metrics import UWO_LAMBDA
from postrl.shaping._util import NAN, cols, group_mean
from postrl.stages import StepEnd, Stateful


def _ref_values(columns: dict, ref_column: str, name: str, n: int, stage: str) -> list[list[float]]:
    """Per row, the reference reward(s) of source ``name`` from data column ``ref_column``."""
    if ref_column not in columns:
        raise ValueError(f"shaping '{stage}': the rows have no '{ref_column}' column (reference rewards); "
                         f"columns: {', '.join(columns) or '(none)'}")
    out = []
    for i, v in enumerate(columns[ref_column]):
        if isinstance(v, dict):
            v = v.get(name)
        vals = v if isinstance(v, (list, tuple)) else [v]
        try:
            vals = [float(x) for x in vals]
        except (TypeError, ValueError):
            vals = []
        if not vals or not all(math.isfinite(x) for x in vals):
            raise ValueError(f"shaping '{stage}': row {i} has no usable reference reward in '{ref_column}' "
                             f"(got {columns[ref_column][i]!r})")
        out.append(vals)
    if len(out) != n:
        raise ValueError(f"shaping '{stage}': '{ref_column}' has {len(out)} rows for {n} completions")
    return out


@register("shaping", "par", source="Reward Shaping to Mitigate Reward Hacking in RLHF (PAR)")
def par(rewards, reward_names, columns, *, sources: list[str] | None = None, ref_column: str = "ref_reward"):
    """Preference As Reward: r' = (1/M) sum_m sigmoid(r - r_ref^m), in (0, 1), monotone in r, 0.5 at r = r_ref.

    r_ref^m are the rewards of M >= 1 reference responses to the same prompt (the paper: one suffices), read per
    row from the data column ``ref_column`` (default 'ref_reward'): a number, a list of numbers (M references),
    or a mapping {source name: number or list} when several sources are shaped. ``sources``: the columns to
    transform (default all). A row without a usable reference is an error naming the row.
    """
    out = rewards.clone()
    n = rewards.shape[0]
    for k in cols(reward_names, sources, "par"):
        refs = _ref_values(columns, ref_column, reward_names[k], n, "par")
        M = max(len(v) for v in refs) if refs else 1
        ref = torch.tensor([v + [NAN] * (M - len(v)) for v in refs], dtype=torch.float64).reshape(n, M)
        sig = torch.sigmoid(rewards[:, k].to(torch.float64).unsqueeze(-1) - ref)  # [N, M], NaN padded
        out[:, k] = sig.nanmean(-1).to(out.dtype)
        out[torch.isnan(rewards[:, k]), k] = NAN
    return {"rewards": out}


@register("shaping", "centered", source="reward centering (PAR design principle 3; group-mean baseline)")
def centered(rewards, reward_names, group_ids, columns=None, *, sources: list[str] | None = None,
             ref_column: str | None = None):
    """r' = r - ref: ref = the mean of the valid entries of the completion's group (default), or the row's value
    in data column ``ref_column`` (a reference reward; a mapping {source: value} for several sources).

    Shapes: rewards [N, K], group_ids [N]. ``sources``: columns to center (default all).
    """
    out = rewards.clone()
    n = rewards.shape[0]
    for k in cols(reward_names, sources, "centered"):
        r = rewards[:, k]
        if ref_column is None:
            ref = group_mean(r, group_ids, torch.isfinite(r))
        else:
            refs = _ref_values(columns or {}, ref_column, reward_names[k], n, "centered")
            ref = torch.tensor([sum(v) / len(v) for v in refs], dtype=torch.float64)
        out[:, k] = (r.to(torch.float64) - ref).to(out.dtype)
    return {"rewards": out}


@register("shaping", "running_norm", source="running reward normalisation (Welford / Chan running mean and std)")
class RunningNorm(Stateful):
    """r' = (r - mu) / (sigma + eps) with the running mean and std of every reward seen so far, per column.

    The batch's valid entries are merged into the running (count, mean, M2) (Chan et al.'s parallel Welford
    update) and the batch is normalised with the merged statistics; sigma is the population std sqrt(M2 / count).
    The merge is kept at the end of the step (``end_step``), with every batch the step trained on, once.
    ``center=False`` skips the subtraction, ``scale=False`` the division; ``clip`` (default None) clips r' to
    [-clip, clip]. Defaults: eps=1e-8. State (count, mean, M2 per column) is saved with the checkpoint.
    """

    _state = ("stats",)

    def __init__(self, *, sources: list[str] | None = None, center: bool = True, scale: bool = True,
                 eps: float = 1e-8, clip: Annotated[float, Gt(0)] | None = None):
        self.sources, self.center, self.scale, self.eps, self.clip = sources, center, scale, eps, clip
        self.stats: dict[str, list[float]] = {}

    @staticmethod
    def merge(stats: list[float], x: torch.Tensor) -> list[float]:
        """(count, mean, M2) with the values ``x`` merged in."""
        cnt, mean, m2 = stats
        x = x.to(torch.float64)
        if x.numel():
            nb, mb = float(x.numel()), float(x.mean())
            m2b = float(((x - mb) ** 2).sum())
            tot = cnt + nb
            delta = mb - mean
            mean = mean + delta * nb / tot
            m2 = m2 + m2b + delta * delta * cnt * nb / tot
            cnt = tot
        return [cnt, mean, m2]

    def _columns(self, rewards, reward_names):
        for k in cols(reward_names, self.sources, "running_norm"):
            r = rewards[:, k].to(torch.float64)
            yield k, reward_names[k], r, r[torch.isfinite(r)]

    def __call__(self, rewards, reward_names):
        out = rewards.clone()
        for k, name, r, ok in self._columns(rewards, reward_names):
            cnt, mean, m2 = self.merge(self.stats.get(name, [0.0, 0.0, 0.0]), ok)
            std = math.sqrt(m2 / cnt) if cnt else 0.0
            y = r - mean if self.center else r
            if self.scale:
                y = y / (std + self.eps)
            if self.clip is not None:
                y = y.clamp(-self.clip, self.clip)
            out[:, k] = y.to(out.dtype)
        return {"rewards": out}

    def observe(self, rewards, reward_names) -> None:
        for _, name, _, ok in self._columns(rewards, reward_names):
            self.record((name, ok))

    def end_step(self, step: StepEnd) -> dict:
        for name, ok in self.observed:  # every process's values of this step, in rank order
            self.stats[name] = self.merge(self.stats.get(name, [0.0, 0.0, 0.0]), ok)
        return {}


def _ensemble(rewards, reward_names, reward_weights, sources, name, weight, stage, agg):
    idx = cols(reward_names, sources, stage)
    if len(idx) < 2:
        raise ValueError(f"shaping '{stage}': an ensemble needs at least 2 member columns, got {len(idx)}")
    members = rewards[:, idx].to(torch.float64)
    value = agg(members).to(rewards.dtype)  # NaN in any member -> NaN
    keep = [k for k in range(len(reward_names)) if k not in idx]
    pos = sum(1 for k in keep if k < idx[0])
    new = torch.cat([rewards[:, keep[:pos]], value.unsqueeze(-1), rewards[:, keep[pos:]]], dim=-1)
    names = [reward_names[k] for k in keep]
    weights = [float(reward_weights[k]) for k in keep]
    names.insert(pos, name)
    weights.insert(pos, float(weight))
    if len(set(names)) != len(names):
        raise ValueError(f"shaping '{stage}': column '{name}' already exists; set a different 'name'")
    return {"rewards": new, "reward_names": names, "reward_weights": torch.tensor(weights, dtype=torch.float32)}


_ENS_SRC = "Reward Model Ensembles Help Mitigate Overoptimization"


@register("shaping", "ensemble_mean", source=_ENS_SRC)
def ensemble_mean(rewards, reward_names, reward_weights, *, sources: list[str] | None = None,
                  name: str = "ensemble", weight: float = 1.0):
    """Mean of K reward-model columns: R = (1/K) sum_k R_k; the members are replaced by one column ``name``.

    ``sources`` (default all columns) are the ensemble members; the new column takes ``weight`` (default 1.0)
    in the weighted sum and the place of the first member. A NaN member makes the entry NaN (excluded).
    """
    return _ensemble(rewards, reward_names, reward_weights, sources, name, weight, "ensemble_mean",
                     lambda m: m.mean(-1))


@register("shaping", "ensemble_min", source=_ENS_SRC + " (worst-case optimisation, WCO)")
def ensemble_min(rewards, reward_names, reward_weights, *, sources: list[str] | None = None,
                 name: str = "ensemble", weight: float = 1.0):
    """Worst-case optimisation: R = min_k R_k over the member columns (replaced by one column ``name``)."""
    return _ensemble(rewards, reward_names, reward_weights, sources, name, weight, "ensemble_min",
                     lambda m: torch.where(torch.isnan(m).any(-1), torch.full_like(m[:, 0], NAN),
                                           m.min(-1).values))


@register("shaping", "ensemble_uwo", source=_ENS_SRC + " (uncertainty-weighted optimisation, UWO)")
def ensemble_uwo(rewards, reward_names, reward_weights, *, sources: list[str] | None = None,
                 name: str = "ensemble", weight: float = 1.0, lam: Annotated[float, Ge(0)] = UWO_LAMBDA):
    """Uncertainty-weighted optimisation: R = mean_k R_k - lam * (1/K) sum_k (R_k - mean)^2 (the intra-ensemble
    population variance). Default lam = ``postrl.reward_models.metrics.UWO_LAMBDA`` (0.5; the paper tunes it per
    setting), the same default as the ``model`` reward source's ``uwo_lambda``; members are replaced by ``name``."""
    return _ensemble(rewards, reward_names, reward_weights, sources, name, weight, "ensemble_uwo",
                     lambda m: m.mean(-1) - lam * m.var(-1, unbiased=False))


@register("shaping", "dataset_median", source="MedGRPO: Multi-Task Reinforcement Learning for Heterogeneous "
                                              "Medical Video Understanding")
class DatasetMedian(Stateful):
    """Cross-dataset normalisation: each dataset's median reward maps to the common value ``target``.

    After MedGRPO (the abstract fixes only "median -> common value"; the map is assumed piecewise linear so that
    order and bounds are kept): per dataset d (the row's ``key`` column, default 'task') and column, with lo_d,
    med_d, hi_d the min, median and max of the dataset's last ``window`` rewards (this batch included),
    r' = target * (r - lo_d) / (med_d - lo_d) for r <= med_d, and
    r' = target + (1 - target) * (r - med_d) / (hi_d - med_d) for r > med_d,
    so lo_d -> 0, med_d -> target, hi_d -> 1 (a zero-width side maps to target). Defaults: key='task',
    target=0.5, window=1024, sources=all columns. The windows are saved with the checkpoint.
    """

    _state = ("history",)

    def __init__(self, *, key: str = "task", target: Annotated[float, Gt(0), Lt(1)] = 0.5,
                 window: Annotated[int, Ge(1)] = 1024, sources: list[str] | None = None):
        self.key, self.target, self.window, self.sources = key, target, window, sources
        self.history: dict[str, list[float]] = {}

    def __call__(self, rewards, reward_names, columns):
        out = rewards.clone()
        t = self.target
        for k, lab, rows, values in self._groups(rewards, reward_names, columns):
            r = rewards[:, k].tolist()
            hist = (self.history.get(f"{reward_names[k]}|{lab}", []) + values)[-self.window:]
            if not hist:
                continue
            s = sorted(hist)
            m = len(s)
            lo, hi = s[0], s[-1]
            med = s[m // 2] if m % 2 else 0.5 * (s[m // 2 - 1] + s[m // 2])
            for i in rows:
                x = r[i]
                if not math.isfinite(x):
                    continue
                if x <= med:
                    y = t if med - lo <= 0 else t * (x - lo) / (med - lo)
                else:
                    y = t if hi - med <= 0 else t + (1 - t) * (x - med) / (hi - med)
                out[i, k] = y
        return {"rewards": out}

    def _groups(self, rewards, reward_names, columns):
        """(column, dataset label, its rows, their finite rewards) for each column and dataset of the batch."""
        labels = columns.get(self.key)
        if labels is None:
            raise ValueError(f"shaping 'dataset_median': the rows have no '{self.key}' column; columns: "
                             f"{', '.join(columns) or '(none)'}")
        by: dict[str, list[int]] = {}
        for i, lab in enumerate(labels):
            by.setdefault(str(lab), []).append(i)
        for k in cols(reward_names, self.sources, "dataset_median"):
            r = rewards[:, k].tolist()
            for lab, rows in by.items():
                yield k, lab, rows, [r[i] for i in rows if math.isfinite(r[i])]

    def observe(self, rewards, reward_names, columns) -> None:
        for k, lab, _, values in self._groups(rewards, reward_names, columns):
            self.record((f"{reward_names[k]}|{lab}", values))

    def end_step(self, step: StepEnd) -> dict:
        for key, values in self.observed:  # every process's rewards of this step, in rank order
            self.history[key] = (self.history.get(key, []) + values)[-self.window:]
        return {}



@register("shaping", "ensemble_brme", source="Reward-Robust RLHF in LLMs (BRME)")
def ensemble_brme(rewards, reward_names, reward_weights, *, sources: list[str] | None = None,
                  name: str = "ensemble", weight: float = 1.0, lam: Annotated[float, Ge(0), Le(1)] = 0.5):
    """Reward-robust objective: R = lam * mean_k R_k + (1 - lam) * min_k R_k over the K member columns.

    "Reward-Robust RLHF in LLMs": the objective balances nominal performance (the ensemble's mean) and
    robustness (its minimum, the worst reward in the uncertainty set that the Bayesian Reward Model Ensemble
    spans). lam = 1 is ``ensemble_mean``, lam = 0 is ``ensemble_min``; default lam = 0.5 (assumed: the abstract
    fixes the form, not the value). The ensemble's members are K reward columns (``model/0`` .. ``model/K-1`` of a
    trained ensemble, see :mod:`postrl.rewards.model`); postrl's ensemble is K heads or K seeds, not the paper's
    Bayesian heads (which would output a mean and a std per head). The members are replaced by one column
    ``name`` with ``weight`` (default 1.0); a NaN member makes the entry NaN. Shapes: rewards [N, K'] -> [N, K'-K+1].
    """
    return _ensemble(rewards, reward_names, reward_weights, sources, name, weight, "ensemble_brme",
                     lambda m: torch.where(torch.isnan(m).any(-1), torch.full_like(m[:, 0], NAN),
                                           lam * m.mean(-1) + (1.0 - lam) * m.min(-1).values))
