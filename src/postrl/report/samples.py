"""``postrl samples RUN``: the logged sample completions of a run (samples.jsonl), filtered, in a rich table."""

from __future__ import annotations


from postrl.errors import PostrlError
from postrl.report.rundir import Run


def select_samples(run: Run, *, step: int | None = None, min_reward: float | None = None,
                   max_reward: float | None = None, alarm: str | None = None) -> list[dict]:
    """Samples of ``run`` at ``step`` (default: all logged steps) with min_reward <= reward <= max_reward; with
    ``alarm``, only samples of steps where that alarm was active (logged samples closest to those steps when none
    was logged exactly there)."""
    rows = run.samples
    if step is not None:
        logged = sorted({int(r.get("step", 0)) for r in rows})
        if step not in logged:
            raise PostrlError(f"--step {step}: no samples logged at that step; logged steps: "
                              f"{', '.join(map(str, logged)) or 'none'} (train.samples_every)")
        rows = [r for r in rows if int(r.get("step", 0)) == step]
    if alarm is not None:
        per_step, final, summary = run.alarms()
        if alarm not in summary:
            raise PostrlError(f"--alarm {alarm}: this alarm never fired in {run.path}; fired: "
                              f"{', '.join(sorted(summary)) or 'none'}")
        steps = {int(m.get("step", 0)) for m, al in zip(run.metrics, per_step) if any(a["name"] == alarm for a in al)}
        if any(a["name"] == alarm for a in final):
            steps.add(run.steps_done)
        logged = sorted({int(r.get("step", 0)) for r in rows})
        keep = {s for s in logged if s in steps}
        if not keep and logged and steps:  # samples are logged every K steps: take the logged step nearest each
            keep = {min(logged, key=lambda s: abs(s - t)) for t in steps}
        rows = [r for r in rows if int(r.get("step", 0)) in keep]

    def rew(r):
        v = r.get("reward")
        return float(v) if isinstance(v, (int, float)) else None

    if min_reward is not None:
        rows = [r for r in rows if rew(r) is not None and rew(r) >= min_reward]
    if max_reward is not None:
        rows = [r for r in rows if rew(r) is not None and rew(r) <= max_reward]
    return rows


def render_samples(rows: list[dict], console=None, max_chars: int = 400) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    con = console or Console()
    if not rows:
        con.print("no samples match")
        return
    names = list(dict.fromkeys(k for r in rows for k in (r.get("rewards") or {})))
    t = Table(header_style="bold cyan", show_lines=True)
    t.add_column("step", justify="right")
    t.add_column("prompt", overflow="fold", max_width=40)
    t.add_column("completion", overflow="fold", max_width=60)
    for n in names:
        t.add_column(n, justify="right")
    for c in ("reward", "adv"):
        t.add_column(c, justify="right")
    t.add_column("flags")

    def fmt(v):
        return "fail" if v is None else f"{v:.3f}" if isinstance(v, (int, float)) else str(v)

    for r in rows:
        comp = str(r.get("completion", ""))
        text = Text(comp[:max_chars] + ("..." if len(comp) > max_chars else ""))
        if not comp:
            text = Text("<empty>", style="dim italic")
        flags = []
        if r.get("truncated"):
            flags.append("[red]truncated[/]")
        if r.get("valid") is False:
            flags.append("[red]invalid[/]")
        reward = r.get("reward")
        style = "green" if isinstance(reward, (int, float)) and reward > 0 else "red" if reward is None else ""
        t.add_row(str(r.get("step", "")), Text(str(r.get("prompt", ""))[:max_chars]), text,
                  *[fmt((r.get("rewards") or {}).get(n)) for n in names],
                  Text(fmt(reward), style=style), fmt(r.get("advantage")), " ".join(flags))
    con.print(t)
    con.print(f"{len(rows)} sample(s)")
