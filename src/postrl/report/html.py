"""``postrl report RUN [RUN ...] --out FILE``: one self-contained HTML file (plots as embedded base64 PNG).

Sections: status of each run (steps, evaluation before / after, alarms), the config differences between runs,
alarms on a timeline with their cause and fix, curves (reward per component, accuracy and pass@k, length and
truncation, entropy, KL and log-prob mismatch, clip fractions, learning signal, throughput, grad norm and
sharpness, memory), each with every run overlaid, and a table of sample completions per run.
"""

from __future__ import annotations

import base64
import html
import io
import math
import time
from pathlib import Path

from postrl.diagnostics.engines import ENGINES
from postrl.diagnostics.monitors import ORDER
from postrl.diagnostics.sinks import flatten
from postrl.report.rundir import Run, load_run

STYLES = ["-", "--", ":", "-."]
CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1320px;color:#222;
background:#fafafa}
h1{margin-bottom:0} h2{border-bottom:2px solid #ddd;padding-bottom:4px;margin-top:32px}
.sub{color:#666;margin-top:4px}
table{border-collapse:collapse;margin:8px 0;font-size:13px;background:#fff}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f3f7}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.grid{display:flex;flex-wrap:wrap;gap:12px}
.plot{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:6px;width:640px}
.plot img{width:100%}
.error{color:#b00020;font-weight:bold} .warn{color:#b36b00;font-weight:bold} .info{color:#1d5fa8}
.mono{font-family:Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all;max-width:520px}
.trunc{background:#fff1f0}
.ok{color:#137333}
.legend-run{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:4px;vertical-align:middle}
"""


def _colors(n: int) -> list[str]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [matplotlib.colors.to_hex(cmap(i % 10)) for i in range(n)]


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)  # a fixed layout: bbox_inches="tight" would draw every figure twice
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _fig(title: str, ylabel: str = ""):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401

    fig, ax = plt.subplots(figsize=(6.4, 3.9))
    fig.subplots_adjust(left=0.11, right=0.88, top=0.92, bottom=0.33)
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _label(runs: list[Run], run: Run, series: str) -> str:
    return f"{run.name}: {series}" if len(runs) > 1 else series


def _plot(runs: list[Run], colors: list[str], title: str, series: list[tuple[str, str]], *, ylabel: str = "",
          logy: bool = False, evals: str | None = None, twin: list[tuple[str, str]] | None = None,
          twin_label: str = "", twin_hline: float | None = None) -> tuple[str, list[str]] | None:
    """One figure: for every run (its color) every (key, label) of ``series`` (line style per series); ``evals``:
    also the held-out evaluations' value of that key as markers; ``twin``: series on a right-hand axis (with a
    dotted reference line at ``twin_hline``); ``logy``: log scale, non-positive values left out.
    Returns (base64 PNG, names of the runs drawn), or None when no run has any of the series."""
    fig, ax = _fig(title, ylabel)
    ax2 = ax.twinx() if twin else None
    drawn = 0
    drawn_runs: list[str] = []
    for run, color in zip(runs, colors):
        before = drawn
        for j, (key, lab) in enumerate(series):
            xs, ys = run.series(key)
            if logy:
                xs, ys = [x for x, y in zip(xs, ys) if y > 0], [y for y in ys if y > 0]
            if xs:
                ax.plot(xs, ys, STYLES[j % len(STYLES)], color=color, lw=1.6, label=_label(runs, run, lab),
                        marker="o" if len(xs) < 3 else None, ms=4)
                drawn += 1
        if evals:
            pts = [(int(e.get("step", 0)), e[evals]) for e in run.evals if isinstance(e.get(evals), (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "D", color=color, ms=7, mec="black",
                        label=_label(runs, run, f"held-out {evals}"))
                drawn += 1
        if ax2 is not None:
            for j, (key, lab) in enumerate(twin):
                xs, ys = run.series(key)
                if xs:
                    ax2.plot(xs, ys, STYLES[(j + 1) % len(STYLES)], color=color, lw=1.2, alpha=0.55,
                             label=_label(runs, run, lab + " (right)"))
                    drawn += 1
        if drawn > before:
            drawn_runs.append(run.name)
    if not drawn:
        import matplotlib.pyplot as plt

        plt.close(fig)
        return None
    if logy:
        ax.set_yscale("log")
    if ax2 is not None:
        ax2.set_ylabel(twin_label)
        if twin_hline is not None:
            ax2.axhline(twin_hline, color="#b00020", ls=":", lw=1.2, label=f"threshold ({twin_hline:g}, right)")
    handles, labels = ax.get_legend_handles_labels()
    if ax2 is not None:
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3 if len(labels) > 4 else 2, frameon=False)
    return _png(fig), drawn_runs


def _alarm_timeline(runs: list[Run], colors: list[str]) -> str | None:
    names = sorted({a["name"] for r in runs for al in r.alarms()[0] for a in al}
                   | {a["name"] for r in runs for a in r.alarms()[1]}, key=lambda n: ORDER.get(n, 99))
    if not names:
        return None
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12.9, 0.5 * len(names) + 1.4), layout="constrained")
    ax.set_title("alarms on a timeline (a mark per step where the alarm was active; x: after the last step = final "
                 "check against the held-out evaluations)", fontsize=10)
    ypos = {n: i for i, n in enumerate(names)}
    k = len(runs)
    for ri, (run, color) in enumerate(zip(runs, colors)):
        off = (ri - (k - 1) / 2) * (0.6 / max(k, 1))
        per_step, final, _ = run.alarms()
        for m, al in zip(run.metrics, per_step):
            for a in al:
                sev = a.get("severity", "warn")
                ax.plot(int(m.get("step", 0)), ypos[a["name"]] + off, "s", color=color, ms=7,
                        mec="#b00020" if sev == "error" else color, mew=1.5)
        for a in final:
            ax.plot(run.steps_done + 0.5, ypos[a["name"]] + off, "*", color=color, ms=12, mec="black")
        ax.plot([], [], "s", color=color, label=run.name)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.invert_yaxis()
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    last = max((r.steps_done for r in runs), default=1)
    ax.set_xlim(0, last + 1.5)
    ax.legend(fontsize=8, loc="upper right")
    return _png(fig)


def config_diff(runs: list[Run]) -> dict[str, list]:
    """Flattened config keys whose values differ between runs (``output_dir`` excluded) -> value per run."""
    flats = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    missing = object()
    out = {}
    for k in keys:
        if k == "output_dir":
            continue
        vals = [f.get(k, missing) for f in flats]
        if any(repr(v) != repr(vals[0]) for v in vals):
            out[k] = ["(unset)" if v is missing else v for v in vals]
    return out


def _e(x) -> str:
    return html.escape(str(x))


def _fmt(v, spec=".3f") -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v)
    if isinstance(v, (int, float)):
        return "nan" if isinstance(v, float) and math.isnan(v) else format(v, spec)
    return _e(v)


def _status_table(runs: list[Run], colors: list[str]) -> str:
    rows = []
    for run, color in zip(runs, colors):
        st = "finished" if run.finished else "not finished"
        e0 = run.evals[0] if run.evals else {}
        e1 = run.evals[-1] if len(run.evals) > 1 else {}
        xs, ys = run.series("reward/mean")
        _, _, summ = run.alarms()
        al = ", ".join(f"<span class='{a.get('severity', 'warn')}'>{_e(n)}</span>" for n, a in
                       sorted(summ.items(), key=lambda kv: ORDER.get(kv[0], 99))) or "<span class='ok'>none</span>"
        ck = run.checkpoints()
        engine = f" ({_e(ENGINES.get(run.engine, run.engine))})" if run.engine != "postrl" else ""
        rows.append(
            f"<tr><td><span class='legend-run' style='background:{color}'></span>{_e(run.name)}{engine}</td>"
            f"<td>{st}</td>"
            f"<td class='num'>{run.steps_done} / {run.steps_planned if run.steps_planned is not None else '?'}</td>"
            f"<td class='num'>{_fmt(e0.get('accuracy'))} &rarr; {_fmt(e1.get('accuracy'))}</td>"
            f"<td class='num'>{_fmt(ys[0] if ys else None)} &rarr; {_fmt(ys[-1] if ys else None)}</td>"
            f"<td>{al}</td><td class='num'>{ck[-1][0] if ck else '-'}</td><td class='mono'>{_e(run.path)}</td></tr>")
    return ("<table><tr><th>run</th><th>status</th><th>steps</th><th>held-out accuracy before &rarr; after</th>"
            "<th>train reward first &rarr; last step</th><th>alarms</th><th>last checkpoint</th><th>directory</th>"
            "</tr>" + "".join(rows) + "</table>")


def _alarm_tables(runs: list[Run]) -> str:
    parts = []
    for run in runs:
        _, _, summ = run.alarms()
        if not summ:
            parts.append(f"<p><b>{_e(run.name)}</b>: <span class='ok'>no alarm</span></p>")
            continue
        rows = "".join(
            f"<tr><td class='{a.get('severity', 'warn')}'>{_e(n)}</td><td class='num'>{a['first_step']}&ndash;"
            f"{a['last_step']} ({a['steps']}&times;)</td><td>{_e(a['message'])}</td><td>{_e(a['cause'])}</td>"
            f"<td>{_e(a['fix'])}</td></tr>"
            for n, a in sorted(summ.items(), key=lambda kv: ORDER.get(kv[0], 99)))
        parts.append(f"<p><b>{_e(run.name)}</b></p><table><tr><th>alarm</th><th>steps</th><th>symptom</th>"
                     f"<th>likely cause</th><th>fix</th></tr>{rows}</table>")
    return "".join(parts)


def _samples_table(run: Run, limit: int = 12) -> str:
    if not run.samples:
        return f"<p><b>{_e(run.name)}</b>: no samples logged</p>"
    last = max(int(s.get("step", 0)) for s in run.samples)
    rows = [s for s in run.samples if int(s.get("step", 0)) == last][:limit]
    names = list(dict.fromkeys(k for s in rows for k in (s.get("rewards") or {})))
    head = "".join(f"<th>{_e(n)}</th>" for n in names)
    body = []
    for s in rows:
        comp = str(s.get("completion", ""))
        comp_html = _e(comp[:600] + ("..." if len(comp) > 600 else "")) if comp else "<i>&lt;empty&gt;</i>"
        cls = " class='trunc'" if s.get("truncated") else ""
        body.append(f"<tr{cls}><td class='mono'>{_e(str(s.get('prompt', ''))[:300])}</td><td class='mono'>"
                    f"{comp_html}</td>" + "".join(f"<td class='num'>{_fmt((s.get('rewards') or {}).get(n))}</td>"
                                                  for n in names)
                    + f"<td class='num'>{_fmt(s.get('reward'))}</td><td class='num'>{_fmt(s.get('advantage'))}</td>"
                    f"<td>{'truncated' if s.get('truncated') else ''}</td></tr>")
    return (f"<p><b>{_e(run.name)}</b>, step {last} (rows with a red background were truncated)</p>"
            f"<table><tr><th>prompt</th><th>completion</th>{head}<th>reward</th><th>advantage</th><th>flags</th>"
            "</tr>" + "".join(body) + "</table>")


def build_report(paths: list[str | Path], out: str | Path) -> Path:
    """Write the HTML report of the runs at ``paths`` to ``out``; returns ``out``."""
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    colors = _colors(len(runs))
    reward_names = list(dict.fromkeys(
        k[len("reward/"):-len("/mean")] for r in runs for m in r.metrics[:1] for k in m
        if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2))
    passk = sorted({k for r in runs for m in r.metrics[:1] for k in m if k.startswith("pass@") and k != "pass@1"})
    plots: list[tuple[str, tuple[str, list[str]] | None]] = [
        ("reward", _plot(runs, colors, "reward per component (train)",
                         [("reward/mean", "total")] + [(f"reward/{n}/mean", n) for n in reward_names],
                         ylabel="mean reward")),
        ("accuracy", _plot(runs, colors, "accuracy: train (verifier) and held-out (diamonds)",
                           [("accuracy", "train accuracy")] + [(k, f"train {k}") for k in passk],
                           evals="accuracy")),
        ("length", _plot(runs, colors, "completion length and truncation",
                         [("length/mean", "mean"), ("length/max", "max"), ("length/min", "min")], ylabel="tokens",
                         twin=[("truncated/frac", "truncated fraction")], twin_label="fraction truncated")),
        ("entropy", _plot(runs, colors, "token entropy and low-probability tokens", [("entropy", "entropy (nats)")],
                          twin=[("tokens/low_prob_frac", "low-prob token fraction")], twin_label="fraction")),
        ("kl", _plot(runs, colors, "KL: to the reference and within the update (per token)",
                     [("kl", "KL(policy||ref)"), ("ppo_kl", "policy KL in update (old - new)")], logy=True)),
        ("mismatch", _plot(runs, colors, "sampler vs trainer log-probs (before the update)",
                           [("mismatch/logp_abs_mean", "mean |dlogp|"), ("mismatch/logp_abs_max", "max |dlogp|"),
                            ("mismatch/kl", "KL(sampler||trainer)")], logy=True)),
        ("clip", _plot(runs, colors, "clip fractions by advantage sign",
                       [("clip_low", "low (A<0)"), ("clip_high", "high (A>0)"), ("clip_dual", "dual-clip"),
                        ("clip_region", "both signs (another engine's count)")],
                       twin=[("ratio/max", "max ratio")], twin_label="ratio")),
        ("signal", _plot(runs, colors, "learning signal per group",
                         [("zero_variance_groups/frac", "zero-variance groups"),
                          ("zero_variance_groups/all_wrong", "all wrong"),
                          ("zero_variance_groups/all_correct", "all correct"),
                          ("advantages/distinct_frac", "distinct advantages / G")], ylabel="fraction")),
        ("throughput", _plot(runs, colors, "throughput per phase (tokens/s)",
                             [("throughput/generation", "generation"), ("throughput/reward", "reward"),
                              ("throughput/reference", "reference"), ("throughput/update", "update")], logy=True)),
        ("stability", _plot(runs, colors, "grad norm and sharpness / stability threshold",
                            [("grad_norm", "grad norm"), ("grad_norm_max", "grad norm max")], logy=True,
                            twin=[("stability/ratio", "sharpness / threshold")], twin_label="ratio",
                            twin_hline=1.0)),
        ("memory", _plot(runs, colors, "memory (GB)", [("memory/rss_peak_gb", "peak RSS"),
                                                       ("memory/cuda_max_allocated_gb", "CUDA max allocated")])),
    ]
    timeline = _alarm_timeline(runs, colors)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>postrl report: {_e(', '.join(names))}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>postrl report</h1><div class='sub'>{_e(', '.join(names))} &middot; written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}</div>",
             "<h2>runs</h2>", _status_table(runs, colors)]
    if len(runs) > 1:
        diff = config_diff(runs)
        head = "".join(f"<th><span class='legend-run' style='background:{c}'></span>{_e(r.name)}</th>"
                       for r, c in zip(runs, colors))
        rows = "".join(f"<tr><td class='mono'>{_e(k)}</td>" + "".join(f"<td class='mono'>{_e(v)}</td>" for v in vals)
                       + "</tr>" for k, vals in diff.items()) or "<tr><td colspan='99'>identical configs</td></tr>"
        parts += ["<h2>config differences</h2>", f"<table><tr><th>key</th>{head}</tr>{rows}</table>"]
    parts.append("<h2>alarms</h2>")
    if timeline:
        parts.append(f"<div class='plot' style='width:1290px'><img alt='alarm timeline' "
                     f"src='data:image/png;base64,{timeline}'></div>")
    parts.append(_alarm_tables(runs))
    parts.append("<h2>curves</h2><div class='grid'>")
    for name, res in plots:
        if res:
            png, drawn = res
            parts.append(f"<div class='plot' data-plot='{name}' data-runs='{_e(','.join(drawn))}'><img "
                         f"alt='{name}: {_e(', '.join(drawn))}' src='data:image/png;base64,{png}'></div>")
    parts.append("</div><h2>samples</h2>")
    parts += [_samples_table(r) for r in runs]
    parts.append("</body></html>")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts))
    return out
