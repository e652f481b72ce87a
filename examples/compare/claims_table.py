"""Print a comparison's results as the markdown table of docs/claims.md.

    python examples/compare/claims_table.py OUT/results.json eval/accuracy auc/eval/accuracy reward/correct/mean

One row per variant, one column per metric: mean [95% interval] over the seeds; for a variant other than the base,
the paired difference to the base and its two-sided p (``postrl.compare.interval`` / ``paired_t``, recomputed from
the per-seed values). ``KEY:best`` is the maximum of KEY's curve per seed, ``auc:KEY`` its area divided by its step
span (``postrl.compare.auc``), ``KEY@STEP`` its value at STEP. The cells' mean wall seconds close each row.
``--base NAME`` takes the paired differences against variant NAME instead of the spec's base.
"""

from __future__ import annotations

import json
import math
import sys

from postrl.compare import auc, interval, paired_t


def fmt(x: float, digits: int = 3) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.{digits}f}"


def cell(values: dict, base: dict | None, digits: int = 3) -> str:
    iv = interval(list(values.values()))
    text = f"{fmt(iv['mean'], digits)} [{fmt(iv['low'], digits)}, {fmt(iv['high'], digits)}]"
    if base is not None:
        d = paired_t(values, base)
        p = d["p"]
        ptext = ("p = nan" if not math.isfinite(p) else "p < 0.001" if p < 0.001 else f"p = {p:.2g}" if p < 0.01
                 else f"p = {p:.2f}")
        text += f"; Δ {d['diff']:+.{digits}f}, {ptext}" if math.isfinite(d["diff"]) else ""
    return text


def per_seed(results: dict, variant: str, metric: str) -> dict | None:
    """seed -> value of ``metric`` (final value, ``KEY:best``, ``auc:KEY`` or ``KEY@STEP``) for ``variant``."""
    curves = results["curves"].get(variant, {})
    if metric.endswith(":best") or metric.startswith("auc:") or "@" in metric:
        key = metric[:-5] if metric.endswith(":best") else metric[4:] if metric.startswith("auc:") else metric.split("@")[0]
        if key not in curves:
            return None
        out = {}
        for seed, (xs, ys) in curves[key].items():
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
            if not pts:
                continue
            if metric.endswith(":best"):
                out[seed] = max(y for _, y in pts)
            elif metric.startswith("auc:"):
                out[seed] = auc([x for x, _ in pts], [y for _, y in pts])
            else:
                at = int(metric.split("@")[1])
                hit = [y for x, y in pts if x == at]
                if hit:
                    out[seed] = hit[0]
        return out
    v = results["variants"][variant]
    return v[metric]["per_seed"] if metric in v else None


def table(results: dict, metrics: list[str], digits: int = 3, base_name: str | None = None) -> str:
    base_name = base_name or results["spec"]["base"]
    variants = results["variants"]
    lines = ["| variant | " + " | ".join(metrics) + " | cell s |", "|---" * (len(metrics) + 2) + "|"]
    for name, v in variants.items():
        row = [name]
        for m in metrics:
            vals, base = per_seed(results, name, m), None
            if vals is None:
                row.append("-")
                continue
            if name != base_name:
                base = per_seed(results, base_name, m)
            row.append(cell(vals, base, digits))
        wall = v.get("wall_s", {}).get("per_seed", {})
        row.append(f"{sum(wall.values()) / len(wall):.0f}" if wall else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    base = None
    if "--base" in args:  # paired differences against another variant (every variant shares the seeds)
        i = args.index("--base")
        base = args[i + 1]
        del args[i:i + 2]
    res = json.load(open(args[0]))
    print(table(res, args[1:], base_name=base))
