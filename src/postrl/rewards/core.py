"""Scoring a batch with several named reward sources.

Failure is loud but does not stop the run: a source that raises, or returns None / NaN / inf for an entry,
leaves NaN in the reward matrix for the affected entries; those completions are then excluded from the
advantage computation (never read as 0), and the count and the first failing input are reported per source.
A source that returns the wrong number of values breaks its contract: that is a :class:`RewardError`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from postrl import registry
from postrl.errors import RewardError

_VERL_PARAMS = {"data_source", "solution_str", "ground_truth"}


def _is_verl(fn: Callable) -> bool:
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return _VERL_PARAMS <= params


def _accepts(fn: Callable) -> tuple[set[str], bool]:
    sig = inspect.signature(fn)
    names = {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def call_reward(fn: Callable, prompts: list[str], completions: list[str], columns: dict[str, list], params: dict) -> list:
    """Call one reward source on a batch; returns its raw list of values."""
    if _is_verl(fn):
        out = []
        for i, c in enumerate(completions):
            row = {k: v[i] for k, v in columns.items()}
            gt = row.get("ground_truth", row.get("answer"))
            res = fn(data_source=row.get("data_source", row.get("task", "")), solution_str=c, ground_truth=gt,
                     extra_info=row, **params)
            out.append(res["score"] if isinstance(res, dict) else res)
        return out
    names, var_kw = _accepts(fn)
    kwargs = {k: v for k, v in columns.items() if var_kw or k in names}
    kwargs.update(params)
    res = fn(prompts, completions, **kwargs)
    if isinstance(res, torch.Tensor):
        res = res.tolist()
    return list(res)


def _to_float(v: Any) -> float:
    if v is None:
        return math.nan
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f if math.isfinite(f) else math.nan


@dataclass
class RewardOutcome:
    matrix: torch.Tensor  # [N, K], NaN where the entry failed
    failures: dict[str, int] = field(default_factory=dict)  # per source: entries that failed
    first_failure: dict[str, str] = field(default_factory=dict)  # per source: the first failing input / error


def score_batch(prompts: list[str], completions: list[str], columns: dict[str, list], specs: list) -> RewardOutcome:
    """Score ``completions`` with every reward spec (objects with ``.name`` and ``.params``)."""
    n = len(completions)
    mat = torch.full((n, len(specs)), math.nan, dtype=torch.float32)
    out = RewardOutcome(mat)
    for k, spec in enumerate(specs):
        fn = registry.get("reward", spec.name)
        try:
            values = call_reward(fn, prompts, completions, columns, spec.params)
        except Exception as e:  # a broken reward must not stop the run: every entry of this source fails
            out.failures[spec.name] = n
            out.first_failure[spec.name] = f"{type(e).__name__}: {e} (first completion {completions[0]!r})" if n else str(e)
            continue
        if len(values) != n:
            raise RewardError(f"reward '{spec.name}' returned {len(values)} values for {n} completions")
        vals = [_to_float(v) for v in values]
        mat[:, k] = torch.tensor(vals, dtype=torch.float32)
        bad = [i for i, v in enumerate(vals) if math.isnan(v)]
        if bad:
            out.failures[spec.name] = len(bad)
            out.first_failure[spec.name] = f"returned {values[bad[0]]!r} for completion {completions[bad[0]]!r}"
    return out
