"""HERON: preference pairs from an ordered list of reward factors with margins (``postrl rm heron``).

"Deep Reinforcement Learning from Hierarchical Weak Preference Feedback" (HERON; abstract: instead of a linear
combination of reward factors or human preferences, learn the reward "simply by ranking the importance of the
reward factors": trajectories are compared "using a hierarchical decision tree induced by the given ranking" and
the comparisons train a preference-based reward model). For two completions a, b of the same prompt and the
factors f_1 > f_2 > ... > f_m in order of importance, each with a direction s_l (+1: higher is better, -1: lower
is better) and a margin delta_l >= 0:

    for l = 1..m:   d_l = s_l (f_l(a) - f_l(b))
                    d_l >  delta_l  ->  a preferred, decided at level l
                    d_l < -delta_l  ->  b preferred, decided at level l
                    otherwise       ->  a tie at this level: go to level l + 1
    no level decides -> no pair

(strict inequalities, as the authors' code compares ``f_i s > f_j s + sigma``). ``margin_unit='std'`` reads each
delta_l as a multiple of the factor's population standard deviation over all rows (the authors' code uses
``sigma_mult * std``; ``absolute`` (default) takes delta_l as given). Every pair of distinct completions of a
prompt is compared (the paper compares trajectory pairs of a batch; an LLM's completions are comparable only
within a prompt); ``max_pairs`` keeps the first ones per prompt. The pairs (prompt, chosen, rejected, ``level``:
the deciding factor) are the file ``postrl rm train`` reads; the reward model is trained on them as on any pairs.

Rows: ``prompt``, ``completion`` and each factor, as a column of the row or inside its ``rewards`` mapping (the
form of a run's ``samples.jsonl``: every reward source's value). A factor named ``length`` that the row does not
have is the completion's length in characters. A missing or non-numeric factor value is a one-line DataError
naming the row and the factor. Assumed (not from the abstract): the factors are given per completion (postrl's
reward columns), margins default to 0, and ties at every level give no pair (the authors' code skips them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from postrl.errors import ConfigError, DataError

__all__ = ["Factor", "parse_factors", "heron_compare", "heron_pairs"]

MARGIN_UNITS = ("absolute", "std")


@dataclass(frozen=True)
class Factor:
    """One level of the hierarchy: the factor's ``name``, its direction ``sign`` (+1 higher is better, -1 lower is
    better) and its ``margin`` delta (in ``margin_unit``)."""

    name: str
    sign: int = 1
    margin: float = 0.0


def parse_factors(names: Sequence[str], margins: Sequence[float] | None = None) -> list[Factor]:
    """Factors from names in order of importance (``-name``: lower is better) and one margin each (default 0)."""
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ConfigError("--factors: expected at least one factor name (most important first)")
    margins = list(margins) if margins is not None else [0.0] * len(names)
    if len(margins) != len(names):
        raise ConfigError(f"--margins: expected one margin per factor ({len(names)}), got {len(margins)}")
    out = []
    for n, m in zip(names, margins):
        if not (math.isfinite(m) and m >= 0):
            raise ConfigError(f"--margins: the margin of '{n}' must be a finite number >= 0, got {m}")
        sign = -1 if n.startswith("-") else 1
        name = n[1:] if n[0] in "+-" else n
        if not name:
            raise ConfigError(f"--factors: '{n}' names no factor")
        out.append(Factor(name, sign, float(m)))
    if len({f.name for f in out}) != len(out):
        raise ConfigError("--factors: a factor is listed twice")
    return out


def heron_compare(a: Sequence[float], b: Sequence[float], factors: Sequence[Factor],
                  margins: Sequence[float] | None = None) -> tuple[int, int]:
    """(+1 when a is preferred, -1 when b is, 0 when no level decides; the deciding level's index or -1).

    ``a``, ``b``: the factor values in the order of ``factors``; ``margins``: the deltas (default each factor's)."""
    deltas = [f.margin for f in factors] if margins is None else list(margins)
    for level, (f, delta) in enumerate(zip(factors, deltas)):
        d = f.sign * (float(a[level]) - float(b[level]))
        if d > delta:
            return 1, level
        if d < -delta:
            return -1, level
    return 0, -1


def _value(row: dict, name: str, where: str) -> float:
    if name in row:
        v = row[name]
    elif isinstance(row.get("rewards"), dict) and name in row["rewards"]:
        v = row["rewards"][name]
    elif name == "length":
        v = len(row["completion"])
    else:
        raise DataError(f"{where}: no factor '{name}' (a column of the row, or a key of its 'rewards' mapping)")
    if isinstance(v, bool):
        v = float(v)
    if not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise DataError(f"{where}: factor '{name}' must be a finite number, got {v!r}")
    return float(v)


def heron_pairs(rows: Sequence[dict], factors: Sequence[Factor], *, margin_unit: str = "absolute",
                max_pairs: int | None = None, source: str = "rows") -> tuple[list[dict], dict]:
    """(pair rows, counts) of :func:`heron_compare` over every two distinct completions of each prompt.

    Pair rows: ``prompt``, ``chosen``, ``rejected``, ``level`` (the deciding factor's name); prompts in order of
    first appearance, within a prompt the pairs (i, j), i < j, in row order. Counts: ``rows``, ``prompts``,
    ``compared``, ``undecided``, ``decided/<factor>`` and the margins used (``margin/<factor>``)."""
    if margin_unit not in MARGIN_UNITS:
        raise ConfigError(f"--margin-unit '{margin_unit}': valid: {', '.join(MARGIN_UNITS)}")
    if max_pairs is not None and max_pairs < 1:
        raise ConfigError(f"--max-pairs: expected an integer >= 1, got {max_pairs}")
    groups: dict[str, list[tuple[str, list[float]]]] = {}
    values: list[list[float]] = []
    for i, r in enumerate(rows, 1):
        where = f"{source}: row {i}"
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected an object with prompt, completion and the factors")
        for key in ("prompt", "completion"):
            if not isinstance(r.get(key), str):
                raise DataError(f"{where}: field '{key}' must be a string (rows of prompt, completion and factors)")
        vals = [_value(r, f.name, where) for f in factors]
        values.append(vals)
        groups.setdefault(r["prompt"], []).append((r["completion"], vals))
    if not rows:
        raise DataError(f"{source}: no rows")
    margins = [f.margin for f in factors]
    if margin_unit == "std":
        n = len(values)
        for k in range(len(factors)):
            col = [v[k] for v in values]
            mean = sum(col) / n
            margins[k] = factors[k].margin * math.sqrt(sum((x - mean) ** 2 for x in col) / n)
    counts: dict[str, Any] = {"rows": len(rows), "prompts": len(groups), "compared": 0, "undecided": 0,
                              **{f"decided/{f.name}": 0 for f in factors},
                              **{f"margin/{f.name}": m for f, m in zip(factors, margins)}}
    out = []
    for prompt, members in groups.items():
        made = 0
        for i in range(len(members)):
            for j in range(i + 1, len(members)):
                if max_pairs is not None and made >= max_pairs:
                    break
                (ci, vi), (cj, vj) = members[i], members[j]
                if ci == cj:
                    continue
                counts["compared"] += 1
                winner, level = heron_compare(vi, vj, factors, margins)
                if winner == 0:
                    counts["undecided"] += 1
                    continue
                counts[f"decided/{factors[level].name}"] += 1
                chosen, rejected = (ci, cj) if winner > 0 else (cj, ci)
                out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "level": factors[level].name})
                made += 1
    return out, counts
