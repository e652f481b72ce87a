"""The live console of ``postrl train``: a rich progress bar and a table of the latest steps.

On a terminal the bar and table update in place; otherwise (a log file, CI) one plain line per step is printed.
The ``alarms`` column names the alarms active at each step; an alarm is printed in full (symptom, cause, fix)
when it starts firing, and the alarms raised during the run are listed again at the end.
"""

from __future__ import annotations

import math
from collections import deque

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


def _fmt(v: float | None, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


class ConsoleReporter:
    def __init__(self, reward_names: list[str], console: Console | None = None, rows: int = 8, enabled: bool = True):
        self.console = console or Console(stderr=False)
        self.reward_names = reward_names
        self.recent: deque = deque(maxlen=rows)
        self.enabled = enabled
        self.live: Live | None = None
        self.progress = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                                 TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console)
        self.task = None
        self.active: set[str] = set()  # alarms active at the previous step
        self.raised: dict[str, dict] = {}

    def log(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, markup=False, highlight=False)

    def _table(self) -> Table:
        t = Table(box=None, pad_edge=False, header_style="bold cyan")
        cols = ["step", "reward"] + [f"r:{n}" for n in self.reward_names] + ["acc", "len", "trunc", "entropy", "kl",
                                                                              "clip", "tok/s", "alarms"]
        for c in cols:
            t.add_column(c, justify="left" if c == "alarms" else "right", style="bold red" if c == "alarms" else None)
        for m in self.recent:
            t.add_row(*self._cells(m))
        return t

    def _cells(self, m: dict) -> list[str]:
        clip = (m.get("clip_low") or 0.0) + (m.get("clip_high") or 0.0)
        return ([str(m["step"]), _fmt(m.get("reward/mean"))]
                + [_fmt(m.get(f"reward/{n}/mean")) for n in self.reward_names]
                + [_fmt(m.get("accuracy"), ".2f"), _fmt(m.get("length/mean"), ".1f"), _fmt(m.get("truncated/frac"), ".2f"),
                   _fmt(m.get("entropy")), _fmt(m.get("kl"), ".4f"), _fmt(clip, ".3f"),
                   _fmt(m.get("time/tokens_per_s"), ".0f"), _alarm_names(m)])

    def start(self, total: int, done: int, before: dict | None) -> None:
        if not self.enabled:
            return
        if before:
            self.log(_eval_line("held-out before RL", before))
        self.task = self.progress.add_task("rl", total=total, completed=done)
        if self.console.is_terminal:
            self.live = Live(Group(self.progress, self._table()), console=self.console, refresh_per_second=4)
            self.live.start()

    def step(self, metrics: dict) -> None:
        if not self.enabled:
            return
        alarms = [a for a in metrics.get("alarms") or [] if isinstance(a, dict)]
        for a in alarms:
            if a["name"] not in self.active:  # newly firing: say it in full once
                self.console.print(f"[bold red]ALARM[/] step {metrics['step']} [bold]{a['name']}[/]: {a['message']}\n"
                                   f"  likely cause: {a['cause']}\n  fix: {a['fix']}", highlight=False)
            self.raised.setdefault(a["name"], {"first": metrics["step"]})["last"] = metrics["step"]
        self.active = {a["name"] for a in alarms}
        self.recent.append(metrics)
        self.progress.update(self.task, completed=metrics["step"])
        if self.live is not None:
            self.live.update(Group(self.progress, self._table()))
        else:
            names = ["step", "reward"] + [f"r:{n}" for n in self.reward_names] + ["acc", "len", "trunc", "entropy",
                                                                                  "kl", "clip", "tok/s", "alarms"]
            self.console.print("  ".join(f"{n}={c}" for n, c in zip(names, self._cells(metrics))), highlight=False)

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        if self.live is not None:
            self.live.stop()
        b, a = summary.get("before") or {}, summary["after"]
        t = Table(title="held-out evaluation (greedy accuracy; pass@k from sampled completions)", header_style="bold")
        t.add_column("")
        keys = [k for k in a if k not in ("step", "tag", "n", "scored_by")]
        for k in keys:
            t.add_column(k, justify="right")
        if b:
            t.add_row("before RL", *[_fmt(b.get(k)) for k in keys])
        t.add_row("after RL", *[_fmt(a.get(k)) for k in keys])
        self.console.print(t)
        if b and a.get("scored_by") == "rewards":
            self.console.print(f"reward {b['reward']:.3f} -> {a['reward']:.3f} ({a['reward'] - b['reward']:+.3f}) on "
                               f"{a['n']} held-out prompts, scored by the configured rewards (the task has no "
                               f"verifier)")
        elif b:
            self.console.print(f"accuracy {b['accuracy']:.3f} -> {a['accuracy']:.3f} "
                               f"({a['accuracy'] - b['accuracy']:+.3f}) on {a['n']} held-out prompts")
        final = summary.get("alarms") or {}
        names = dict(self.raised)
        for n, rec in final.items():
            names.setdefault(n, {"first": rec.get("first_step"), "last": rec.get("last_step")})
        if names:
            self.console.print("[bold red]alarms raised:[/] " + ", ".join(
                f"{n} (steps {r.get('first')}-{r.get('last')})" for n, r in names.items())
                + f"  -> postrl doctor {summary['run_dir']}", highlight=False)
        else:
            self.console.print("[green]no alarm raised[/]")
        self.console.print(f"run directory: {summary['run_dir']}")


def _alarm_names(m: dict) -> str:
    return ",".join(a["name"] for a in m.get("alarms") or [] if isinstance(a, dict)) or "-"


def _eval_line(tag: str, res: dict) -> str:
    parts = [f"{k}={_fmt(v)}" for k, v in res.items() if k not in ("step", "tag") and isinstance(v, float)]
    how = " (scored by the configured rewards: the task has no verifier)" if res.get("scored_by") == "rewards" else ""
    return f"{tag}{how}: " + "  ".join(parts)
