"""``postrl compare SPEC.yaml``: methods side by side, over seeds, with confidence intervals.

A spec names a base config and variants of it (a recipe, a config file, overrides); every (variant, seed) pair is a
*cell*, an ordinary run directory ``OUT/cells/<variant>/seed-<S>``. The runner trains the cells that have not
finished (a cell whose run directory has a summary.json covering its steps is never re-run; one with a complete
checkpoint resumes from it, as ``postrl train --resume``), then writes into ``OUT``:

- ``results.json``: per variant and metric the per-seed values, mean and 95% interval across seeds (Student t,
  :func:`interval`), and per variant the paired t-test against the base over the seeds both have (:func:`paired_t`);
- ``report.html``: the tables and every curve overlaid, one line per variant (mean over seeds) with a band (the
  95% interval of the mean at each step), built with the plotting helpers of :mod:`postrl.report.html`;
- ``table.txt``: the one-screen console table.

Metrics of a cell (:func:`cell_metrics`): held-out (``eval/accuracy``, ``eval/pass@k``, ``eval/mean_length``,
``eval/truncated``: final = the last evaluation, best = the best evaluation), training (``accuracy``,
``reward/mean``, ``reward/<name>/mean``, ``length/mean``, ``entropy``, ``kl`` and the spec's ``metrics``: final =
mean of the last ``final_window`` steps, best = best step), ``wall_s`` (seconds the runner spent on the cell) and
``auc/<key>`` (area under the learning curve of ``auc``, divided by its step span: the curve's mean level).
The spec format is documented in docs/compare.md.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from postrl.errors import ConfigError, PostrlError
from postrl import recipes
from postrl.config import _merge, dump_yaml, load_config, read_yaml
from postrl.report.console import ConsoleReporter
from postrl.report.html import CSS, _colors, _e, _fig, _png, config_diff
from postrl.report.rundir import load_run

__all__ = ["Spec", "Variant", "Cell", "load_spec", "parse_spec", "plan", "run_comparison", "interval", "paired_t",
           "t_cdf", "t_quantile", "cell_metrics", "summarize", "auc"]

SPEC_KEYS = {"name", "description", "out", "seeds", "base", "variants", "metrics", "auc", "primary", "final_window"}
VARIANT_KEYS = {"name", "description", "recipe", "config", "overrides"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# metrics where a larger value is better: "best" is their maximum (others have no best)
_HIGHER = re.compile(r"^(eval/accuracy|eval/pass@\d+|accuracy|pass@\d+|reward/.*mean)$")


# ---------------------------------------------------------------------------------------------------------------
# statistics


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer ``df`` >= 1, exact (closed form; Abramowitz & Stegun 26.7.3/26.7.4).

    With theta = atan(t / sqrt(df)), A = P(|T| < |t|) is ``2/pi (theta + sin theta (cos theta + 2/3 cos^3 theta +
    ... ))`` for odd df and ``sin theta (1 + 1/2 cos^2 theta + 1*3/(2*4) cos^4 theta + ...)`` for even df, the
    series ending at the power df - 2; then P(T <= t) = (1 + sign(t) A) / 2."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    th = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(th), math.cos(th)
    if df % 2:
        total, term = 0.0, c
        for k in range(1, df - 1, 2):  # powers 1, 3, ..., df - 2
            total += term
            term *= c * c * (k + 1) / (k + 2)
        a = 2 / math.pi * (th + (s * total if df > 1 else 0.0))
    else:
        total, term = 0.0, 1.0
        for k in range(0, df - 1, 2):  # powers 0, 2, ..., df - 2
            total += term
            term *= c * c * (k + 1) / (k + 2)
        a = s * total
    return 0.5 + math.copysign(a, t) / 2


def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p (bisection on :func:`t_cdf` to 1e-12; t_quantile(0.975, 2) = 4.3027)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -1e7, 1e7
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def interval(values: list[float], level: float = 0.95) -> dict:
    """Mean and the two-sided ``level`` confidence interval of the mean of ``values`` (finite ones) from Student's t:
    ``mean +- t_{(1+level)/2, n-1} * sd / sqrt(n)`` with the sample sd (n - 1 in the denominator).
    Returns {n, mean, sd, low, high, half}; with n < 2 the interval is NaN (one seed has no spread)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    nan = float("nan")
    if n == 0:
        return {"n": 0, "mean": nan, "sd": nan, "low": nan, "high": nan, "half": nan}
    mean = sum(xs) / n
    if n < 2:
        return {"n": 1, "mean": mean, "sd": nan, "low": nan, "high": nan, "half": nan}
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half, "half": half}


def paired_t(variant: dict, base: dict, level: float = 0.95) -> dict:
    """Paired t-test of ``variant`` against ``base`` (seed -> value; the seeds both have with finite values):
    d_s = variant_s - base_s, t = mean(d) / (sd(d) / sqrt(n)), df = n - 1, two-sided p = 2 (1 - F_t(|t|)), and
    the ``level`` interval of mean(d). Returns {n, diff, low, high, t, df, p}; with n < 2 t and p are NaN; when
    every d is the same (sd 0), p = 1 if they are all 0, else t and p are NaN."""
    seeds = [s for s in variant if s in base and _finite(variant[s]) and _finite(base[s])]
    d = [float(variant[s]) - float(base[s]) for s in seeds]
    iv = interval(d, level)
    n, nan = iv["n"], float("nan")
    out = {"n": n, "diff": iv["mean"], "low": iv["low"], "high": iv["high"], "t": nan, "df": n - 1, "p": nan}
    if n >= 2:
        if iv["sd"] > 0:
            t = iv["mean"] / (iv["sd"] / math.sqrt(n))
            out.update(t=t, p=2 * (1 - t_cdf(abs(t), n - 1)))
        elif iv["mean"] == 0:
            out.update(t=0.0, p=1.0)
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def auc(xs: list[float], ys: list[float]) -> float:
    """Area under the curve (trapezoid rule) divided by its span ``xs[-1] - xs[0]``: the curve's mean level, so
    runs of different lengths compare; one point: that value; none: NaN."""
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return float(ys[0])
    area = sum((xs[i + 1] - xs[i]) * (ys[i + 1] + ys[i]) / 2 for i in range(len(xs) - 1))
    return area / (xs[-1] - xs[0])


# ---------------------------------------------------------------------------------------------------------------
# the spec


@dataclass
class Variant:
    name: str
    recipe: str | None = None
    config: Path | None = None
    overrides: list[str] = field(default_factory=list)
    description: str = ""


@dataclass
class Spec:
    name: str
    out: Path
    seeds: list[int]
    base: Variant
    variants: list[Variant]
    metrics: list[str] = field(default_factory=list)
    auc: str = "accuracy"
    primary: str = "eval/accuracy"
    final_window: int = 1
    description: str = ""

    @property
    def all_variants(self) -> list[Variant]:
        return [self.base] + self.variants


@dataclass
class Cell:
    variant: Variant
    seed: int
    run_dir: Path
    cfg: Any  # postrl.config.Config

    @property
    def label(self) -> str:
        return f"{self.variant.name}/seed-{self.seed}"


def _overrides(raw, where: str) -> list[str]:
    """A mapping {dotted.key: value} (values as JSON, which YAML reads back) or a list of 'KEY=VALUE' strings."""
    if raw is None:
        return []
    if isinstance(raw, dict):
        return [f"{k}={json.dumps(v)}" for k, v in raw.items()]
    if isinstance(raw, list) and all(isinstance(x, str) and "=" in x for x in raw):
        return list(raw)
    raise ConfigError(f"{where}.overrides: expected a mapping of KEY: VALUE or a list of 'KEY=VALUE' strings")


def _variant(raw, name: str, where: str, root: Path) -> Variant:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(sorted(VARIANT_KEYS))}")
    for k in raw:
        if k not in VARIANT_KEYS:
            raise ConfigError(f"{where}: unknown key '{k}' (valid: {', '.join(sorted(VARIANT_KEYS))})")
    config = raw.get("config")
    if config is not None:
        config = (root / str(config)) if not Path(str(config)).is_absolute() else Path(str(config))
        if not config.is_file():
            raise ConfigError(f"{where}.config: file '{config}' does not exist")
    recipe = raw.get("recipe")
    if recipe is not None:
        recipes.path(str(recipe))  # unknown recipe: one line listing the valid ones
    return Variant(name=name, recipe=recipe, config=config, overrides=_overrides(raw.get("overrides"), where),
                   description=str(raw.get("description", "")))


def parse_spec(data: dict, root: Path = Path("."), default_name: str = "compare") -> Spec:
    """Validate a spec mapping (``root``: folder that relative ``config`` paths are read from); one-line
    ConfigError naming the key on any mistake."""
    if not isinstance(data, dict):
        raise ConfigError("spec: expected a mapping with keys base, variants, seeds, ...")
    for k in data:
        if k not in SPEC_KEYS:
            raise ConfigError(f"spec: unknown key '{k}' (valid: {', '.join(sorted(SPEC_KEYS))})")
    name = str(data.get("name") or default_name)
    seeds = data.get("seeds", 3)
    if isinstance(seeds, bool) or not isinstance(seeds, (int, list)):
        raise ConfigError("seeds: expected a number of seeds (>= 1) or a list of integer seeds")
    if isinstance(seeds, int):
        if seeds < 1:
            raise ConfigError(f"seeds: expected at least 1 seed, got {seeds}")
        seeds = list(range(seeds))
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: expected a non-empty list of distinct integers, got {seeds!r}")
    base_raw = data.get("base") or {}
    if not isinstance(base_raw, dict):
        raise ConfigError("base: expected a mapping with keys " + ", ".join(sorted(VARIANT_KEYS)))
    base_name = str(base_raw.get("name", "base"))
    base = _variant(base_raw, base_name, "base", root)
    raw_variants = data.get("variants")
    if not isinstance(raw_variants, dict) or not raw_variants:
        raise ConfigError("variants: expected a mapping of at least one variant name -> {recipe, config, overrides}")
    variants = []
    for vname, vraw in raw_variants.items():
        vname = str(vname)
        if not _NAME.fullmatch(vname) or vname == base_name:
            raise ConfigError(f"variants.{vname}: a variant name is letters, digits, '_', '.', '-' and differs from "
                              f"the base's ('{base_name}')")
        if isinstance(vraw, dict) and "name" in vraw:
            raise ConfigError(f"variants.{vname}: unknown key 'name' (a variant is named by its key)")
        variants.append(_variant(vraw, vname, f"variants.{vname}", root))
    if not _NAME.fullmatch(base_name):
        raise ConfigError(f"base.name: '{base_name}' is not letters, digits, '_', '.', '-'")
    metrics = data.get("metrics") or []
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        raise ConfigError("metrics: expected a list of metric keys (e.g. reward/correct/mean)")
    fw = data.get("final_window", 1)
    if isinstance(fw, bool) or not isinstance(fw, int) or fw < 1:
        raise ConfigError(f"final_window: expected an integer >= 1, got {fw!r}")
    out = Path(str(data["out"])) if data.get("out") else Path("compare") / name
    return Spec(name=name, out=out, seeds=list(seeds), base=base, variants=variants, metrics=list(metrics),
                auc=str(data.get("auc", "accuracy")), primary=str(data.get("primary", "eval/accuracy")),
                final_window=fw, description=str(data.get("description", "")))


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file (see docs/compare.md)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"spec file '{p}' does not exist")
    return parse_spec(read_yaml(p), root=p.parent, default_name=p.stem)


def cell_config(spec: Spec, variant: Variant, seed: int, run_dir: Path):
    """The cell's Config: defaults <- recipe (the variant's, else the base's) <- base config file <- variant
    config file <- base overrides <- variant overrides <- seed and output_dir. A mistake names the variant."""
    data: dict = {}
    recipe = variant.recipe or spec.base.recipe
    if recipe:
        data = _merge(data, recipes.load(recipe))
    for f in dict.fromkeys(x for x in (spec.base.config, variant.config) if x is not None):
        data = _merge(data, read_yaml(f))
    over = spec.base.overrides + (variant.overrides if variant is not spec.base else [])
    over += [f"seed={seed}", f"output_dir={json.dumps(str(run_dir))}"]
    where = "base" if variant is spec.base else f"variants.{variant.name}"
    try:
        return load_config(None, over, base=data)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def plan(spec: Spec) -> list[Cell]:
    """Every cell, seed-major (all variants of the first seed, then the next seed: a partial comparison already
    has paired cells), each config resolved and validated."""
    cells = []
    for seed in spec.seeds:
        for v in spec.all_variants:
            run_dir = spec.out / "cells" / v.name / f"seed-{seed}"
            cells.append(Cell(v, seed, run_dir, cell_config(spec, v, seed, run_dir)))
    return cells


# ---------------------------------------------------------------------------------------------------------------
# running


def cell_state(cell: Cell) -> str:
    """'done' (summary.json covers the cell's steps), 'resume' (a complete checkpoint to continue from) or 'new'."""
    d = cell.run_dir
    if not d.is_dir():
        return "new"
    try:
        run = load_run(d)
    except Exception:  # noqa: BLE001 - an unreadable partial directory starts over
        return "new"
    if run.summary is not None and run.summary.get("steps") == cell.cfg.train.steps:
        return "done"
    return "resume" if run.checkpoints() else "new"


def _record_wall(cell: Cell, seconds: float) -> None:
    f = cell.run_dir / "compare_cell.json"
    prev = json.loads(f.read_text()).get("wall_s", 0.0) if f.is_file() else 0.0
    f.write_text(json.dumps({"wall_s": prev + seconds, "variant": cell.variant.name, "seed": cell.seed}))


def _prepare(cell: Cell) -> bool:
    """Clear a cell directory that has nothing to resume from; True when the cell resumes."""
    state = cell_state(cell)
    if state == "new" and cell.run_dir.exists():
        shutil.rmtree(cell.run_dir)
    return state == "resume"


def _run_in_process(cell: Cell) -> None:
    # lazy: postrl.compare stays importable without torch (with --jobs > 1 the cells train in subprocesses)
    from postrl.train.trainer import Trainer

    resume = _prepare(cell)
    t0 = time.perf_counter()
    reporter = ConsoleReporter([r.name for r in cell.cfg.rewards], enabled=False)
    Trainer(cell.cfg, cell.run_dir, resume=resume, reporter=reporter).train()
    _record_wall(cell, time.perf_counter() - t0)


def _run_subprocess(cell: Cell) -> None:
    """``python -m postrl train --quiet`` on the cell's resolved config (or ``--resume``), output in
    RUN_DIR/../seed-S.log, with this process's import path; a failure is a PostrlError naming the cell and its
    log."""
    resume = _prepare(cell)
    cell.run_dir.parent.mkdir(parents=True, exist_ok=True)
    cfg_file = cell.run_dir.parent / f"seed-{cell.seed}.yaml"
    cfg_file.write_text(dump_yaml(cell.cfg))
    cmd = [sys.executable, "-m", "postrl", "train", "--quiet"]
    cmd += ["--resume", str(cell.run_dir)] if resume else [str(cfg_file)]
    log = cell.run_dir.parent / f"seed-{cell.seed}.log"
    t0 = time.perf_counter()
    # the child imports what this process can (user stages beside the spec, put on sys.path by the CLI)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(log, "a") as fh:
        rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        raise PostrlError(f"cell {cell.label} failed (exit status {rc}); see {log}")
    _record_wall(cell, time.perf_counter() - t0)


def run_comparison(spec: Spec, *, jobs: int = 1, progress: bool = True, console=None,
                   on_cell_done: Callable[[Cell], None] | None = None) -> dict:
    """Train every unfinished cell (``jobs`` = 1: in this process one after another; more: that many
    ``postrl train`` processes at once), then write results.json, report.html and table.txt into ``spec.out``.
    Returns the results (see :func:`summarize`)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    cells = plan(spec)
    spec.out.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if cell_state(c) != "done"]
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task(f"{spec.name}: cells", total=len(cells), completed=len(cells) - len(todo))
        if jobs <= 1:
            for c in todo:
                bar.update(task, description=f"{spec.name}: {c.label}")
                _run_in_process(c)
                bar.advance(task)
                if on_cell_done is not None:
                    on_cell_done(c)
        else:
            from concurrent.futures import ThreadPoolExecutor, as_completed

            with ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(_run_subprocess, c): c for c in todo}
                for fut in as_completed(futures):
                    fut.result()
                    bar.advance(task)
                    if on_cell_done is not None:
                        on_cell_done(futures[fut])
        bar.update(task, description=f"{spec.name}: done")
    results = summarize(spec, cells)
    write_outputs(spec, results, console=console)
    return results


# ---------------------------------------------------------------------------------------------------------------
# metrics and summary


def _num(v) -> float | None:
    return float(v) if _finite(v) else None


def cell_metrics(run_dir: Path, extra: list[str] = (), final_window: int = 1, auc_key: str = "accuracy") -> dict:
    """{metric: {"final": x, "best": x or None}} of one finished run directory, and "_curves": {metric: (steps,
    values)} for the plots (see the module docstring for which metrics and how final / best are taken)."""
    run = load_run(run_dir)
    out: dict = {}
    curves: dict = {}
    evals = [e for e in run.evals if isinstance(e, dict)]
    eval_keys = ["accuracy"] + sorted({k for e in evals for k in e if k.startswith("pass@")},
                                      key=lambda k: int(k[5:]) if k[5:].isdigit() else 0) + ["mean_length", "truncated"]
    for k in eval_keys:
        pts = [(int(e.get("step", 0)), _num(e.get(k))) for e in evals]
        pts = [(x, y) for x, y in pts if y is not None]
        if not pts:
            continue
        name = f"eval/{k}"
        ys = [y for _, y in pts]
        out[name] = {"final": ys[-1], "best": max(ys) if _HIGHER.match(name) else None}
        curves[name] = ([x for x, _ in pts], ys)
    first = run.metrics[0] if run.metrics else {}
    rewards = [k for k in first if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2]
    train_keys = list(dict.fromkeys(["accuracy", "reward/mean", *rewards, "length/mean", "entropy", "kl", *extra]))
    for k in train_keys:
        xs, ys = run.series(k)
        if not xs:
            continue
        tail = ys[-final_window:]
        out[k] = {"final": sum(tail) / len(tail), "best": max(ys) if _HIGHER.match(k) else None}
        curves[k] = (xs, ys)
    wall_f = run_dir / "compare_cell.json"
    if wall_f.is_file():
        out["wall_s"] = {"final": float(json.loads(wall_f.read_text())["wall_s"]), "best": None}
    key = f"eval/{auc_key}" if f"eval/{auc_key}" in curves and len(curves[f"eval/{auc_key}"][0]) > 2 else auc_key
    if key in curves:
        out[f"auc/{key}"] = {"final": auc(*curves[key]), "best": None}
    out["_curves"] = curves
    return out


def summarize(spec: Spec, cells: list[Cell]) -> dict:
    """results.json's content: {"spec", "variants": {variant: {metric: {"per_seed": {seed: final}, "final":
    interval, "best": interval or None}}}, "paired": {variant: {metric: paired_t vs base on the finals}},
    "curves": {variant: {metric: {seed: (steps, values)}}}} over the cells that finished."""
    per: dict[str, dict[str, dict]] = {v.name: {} for v in spec.all_variants}
    curves: dict[str, dict[str, dict]] = {v.name: {} for v in spec.all_variants}
    done = 0
    for c in cells:
        if cell_state(c) != "done":
            continue
        done += 1
        m = cell_metrics(c.run_dir, spec.metrics, spec.final_window, spec.auc)
        for k, curve in m.pop("_curves").items():
            curves[c.variant.name].setdefault(k, {})[c.seed] = curve
        for k, v in m.items():
            rec = per[c.variant.name].setdefault(k, {"per_seed": {}, "per_seed_best": {}})
            rec["per_seed"][c.seed] = v["final"]
            if v["best"] is not None:
                rec["per_seed_best"][c.seed] = v["best"]
    variants: dict = {}
    for vname, metrics in per.items():
        variants[vname] = {k: {"per_seed": r["per_seed"], "final": interval(list(r["per_seed"].values())),
                               "best": interval(list(r["per_seed_best"].values())) if r["per_seed_best"] else None}
                           for k, r in metrics.items()}
    base = spec.base.name
    paired = {v.name: {k: paired_t(r["per_seed"], per[base][k]["per_seed"])
                       for k, r in per[v.name].items() if k in per[base]} for v in spec.variants}
    return {"spec": {"name": spec.name, "description": spec.description, "seeds": spec.seeds, "base": base,
                     "variants": [v.name for v in spec.variants], "primary": spec.primary, "auc": spec.auc,
                     "final_window": spec.final_window},
            "cells": {"total": len(cells), "done": done}, "variants": variants, "paired": paired, "curves": curves}


# ---------------------------------------------------------------------------------------------------------------
# outputs


def _ci_text(iv: dict | None, digits: int = 3) -> str:
    if not iv or iv["n"] == 0:
        return "-"
    if iv["n"] < 2:
        return f"{iv['mean']:.{digits}f} (1 seed)"
    return f"{iv['mean']:.{digits}f} ± {iv['half']:.{digits}f}"


def _p_text(p: dict | None) -> str:
    if not p or p["n"] < 2 or not math.isfinite(p["diff"]):
        return "-"
    pv = "n/a" if not math.isfinite(p["p"]) else f"{p['p']:.3f}"
    return f"{p['diff']:+.3f} (p={pv})"


def table_columns(results: dict) -> list[str]:
    """The console table's metrics: the primary one, held-out accuracy and length, the reward, entropy, the AUC,
    the spec's extra metrics, wall time (those that some variant has), at most 6 (results.json and report.html
    have every metric)."""
    spec = results["spec"]
    have = set().union(*(set(m) for m in results["variants"].values()))
    want = [spec["primary"], "eval/accuracy", "eval/mean_length", "reward/mean", "entropy"]
    want += [k for k in have if k.startswith("auc/")] + list(results.get("extra_metrics", [])) + ["wall_s"]
    return [k for k in dict.fromkeys(want) if k in have][:6]


def console_table(results: dict):
    """A rich Table: one row per variant, mean ± 95% half-width per metric, and the paired difference of the
    primary metric against the base with its p-value."""
    from rich.table import Table

    spec = results["spec"]
    cols = table_columns(results)
    t = Table(title=f"{spec['name']}: mean ± 95% CI over seeds {spec['seeds']} (final values; paired t vs "
                    f"{spec['base']})", show_lines=False)
    t.add_column("variant", style="bold")
    t.add_column("n")
    for c in cols:
        t.add_column(c, justify="right")
    t.add_column(f"Δ {spec['primary']} vs base", justify="right")
    for vname, metrics in results["variants"].items():
        n = max((m["final"]["n"] for m in metrics.values()), default=0)
        row = [vname, str(n)] + [_ci_text(metrics[c]["final"]) if c in metrics else "-" for c in cols]
        row.append(_p_text(results["paired"].get(vname, {}).get(spec["primary"])) if vname != spec["base"]
                   else "(base)")
        t.add_row(*row)
    return t


def _band_plot(results: dict, metric: str, colors: dict[str, str]):
    """One figure: per variant the mean over seeds at each step and a band of the 95% interval of that mean."""
    fig, ax = _fig(metric)
    drawn = False
    for vname, by_metric in results["curves"].items():
        seeds = by_metric.get(metric)
        if not seeds:
            continue
        steps = sorted(set().union(*(set(xs) for xs, _ in seeds.values())))
        means, lows, highs, xs_ok = [], [], [], []
        for s in steps:
            vals = [ys[xs.index(s)] for xs, ys in seeds.values() if s in xs]
            iv = interval(vals)
            xs_ok.append(s)
            means.append(iv["mean"])
            lows.append(iv["low"] if iv["n"] > 1 else iv["mean"])
            highs.append(iv["high"] if iv["n"] > 1 else iv["mean"])
        ax.plot(xs_ok, means, color=colors[vname], lw=1.8, label=f"{vname} (n={len(seeds)})",
                marker="o" if len(xs_ok) < 4 else None)
        ax.fill_between(xs_ok, lows, highs, color=colors[vname], alpha=0.2, lw=0)
        drawn = True
    if not drawn:
        import matplotlib.pyplot as plt

        plt.close(fig)
        return None
    fig.legend(fontsize=8, loc="lower center", ncol=3, frameon=False)
    return _png(fig)


def build_html(results: dict, out: Path, run_dirs: dict[str, Path] | None = None) -> Path:
    """report.html: the summary table (mean and 95% interval of every metric's final and best value), the paired
    tests, the config differences between variants, and every curve with bands."""
    spec = results["spec"]
    names = list(results["variants"])
    colors = dict(zip(names, _colors(len(names))))
    metrics = list(dict.fromkeys(k for m in results["variants"].values() for k in m))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>postrl compare: {_e(spec['name'])}</title>"
             f"<style>{CSS}</style></head><body><h1>postrl compare: {_e(spec['name'])}</h1>",
             f"<div class='sub'>{_e(spec['description'])} &middot; seeds {_e(spec['seeds'])} &middot; cells done "
             f"{results['cells']['done']} / {results['cells']['total']} &middot; written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}</div>",
             "<h2>final values: mean ± 95% CI (Student t over seeds); best in brackets</h2><table><tr><th>metric</th>"
             + "".join(f"<th><span class='legend-run' style='background:{colors[v]}'></span>{_e(v)}</th>"
                       for v in names) + "</tr>"]
    for k in metrics:
        cells = []
        for v in names:
            r = results["variants"][v].get(k)
            txt = "-" if r is None else _ci_text(r["final"]) + (f" [{_ci_text(r['best'])}]" if r["best"] else "")
            cells.append(f"<td class='num'>{_e(txt)}</td>")
        parts.append(f"<tr><td class='mono'>{_e(k)}</td>{''.join(cells)}</tr>")
    parts.append("</table>")
    parts.append(f"<h2>paired t-test against the base ({_e(spec['base'])}) over seeds: difference of the final "
                 "values, 95% CI, p (two-sided)</h2><table><tr><th>metric</th>"
                 + "".join(f"<th>{_e(v)}</th>" for v in names if v != spec["base"]) + "</tr>")
    for k in metrics:
        row = []
        for v in names:
            if v == spec["base"]:
                continue
            p = results["paired"].get(v, {}).get(k)
            txt = "-" if not p or p["n"] < 2 else (f"{p['diff']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}] "
                                                   f"p={p['p']:.3f} (n={p['n']})")
            row.append(f"<td class='num'>{_e(txt)}</td>")
        parts.append(f"<tr><td class='mono'>{_e(k)}</td>{''.join(row)}</tr>")
    parts.append("</table>")
    if run_dirs:
        runs = []
        for v, d in run_dirs.items():
            if d.is_dir():
                r = load_run(d)
                r.path = Path(v)  # Run.name is the folder name: show the variant instead
                runs.append(r)
        diff = config_diff(runs) if len(runs) > 1 else {}
        diff.pop("seed", None)
        rows = "".join(f"<tr><td class='mono'>{_e(k)}</td>" + "".join(f"<td class='mono'>{_e(x)}</td>" for x in vals)
                       + "</tr>" for k, vals in diff.items()) or "<tr><td colspan='99'>identical configs</td></tr>"
        parts.append("<h2>config differences</h2><table><tr><th>key</th>"
                     + "".join(f"<th>{_e(r.name)}</th>" for r in runs) + f"</tr>{rows}</table>")
    parts.append("<h2>curves: mean over seeds, band = 95% CI of the mean at each step</h2><div class='grid'>")
    plotted = list(dict.fromkeys(k for by in results["curves"].values() for k in by))
    for k in plotted:
        png = _band_plot(results, k, colors)
        if png:
            parts.append(f"<div class='plot' data-plot='{_e(k)}'><img alt='{_e(k)}' "
                         f"src='data:image/png;base64,{png}'></div>")
    parts.append("</div></body></html>")
    out.write_text("\n".join(parts))
    return out


def write_outputs(spec: Spec, results: dict, console=None) -> None:
    """results.json, table.txt and report.html into ``spec.out``; the table is also printed on ``console``."""
    from rich.console import Console

    results["extra_metrics"] = list(spec.metrics)
    (spec.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    table = console_table(results)
    rec = Console(record=True, width=160, file=io.StringIO())  # only recorded
    rec.print(table)
    (spec.out / "table.txt").write_text(rec.export_text())
    if console is not None:
        console.print(table)
    run_dirs = {v.name: spec.out / "cells" / v.name / f"seed-{spec.seeds[0]}" for v in spec.all_variants}
    build_html(results, spec.out / "report.html", run_dirs)
