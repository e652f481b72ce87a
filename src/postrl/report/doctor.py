"""``postrl doctor RUN``: read any run directory (finished, crashed or still running) and say what went wrong.

Where a run stands comes from the files the trainer keeps (``postrl.train.run_state``): a live process holding
``run.lock`` is running; summary.json is a finished run; status.json says how a process stopped (a signal, with a
checkpoint of its last step) or failed; a lock file left by a dead process is a run killed without clean-up. A
run directory without these (another host, an older postrl) falls back on how recently metrics.jsonl changed.

The diagnosis lists where the run stands (steps done / planned, last checkpoint, evaluation before / after), the
notices the trainer recorded (``notices.jsonl``: a checkpoint set aside, a reward failing, a start-up warning) and
every alarm the monitors raise over its logged metrics, most likely problem first: alarms are ranked by
severity, then by causal order (a non-finite loss, a sampler that is not the trainer and truncated completions
explain the other symptoms, e.g. groups with identical rewards), then by how long they lasted.

A run of another engine (a TRL / transformers output folder, verl's file-logger metrics, a W&B offline run:
``postrl.report.foreign``) is diagnosed by the same monitors over its metrics read in postrl's names; each alarm
names that engine's options, and the monitors whose metrics the run does not log are listed once as skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from postrl.diagnostics.engines import ENGINES
from postrl.diagnostics.monitors import sort_key, unread, unread_text
from postrl.report.rundir import Run, load_run
from postrl.train.run_state import describe_holder, describe_status, holder_alive, read_notices

RUNNING_SECONDS = 300.0  # a run whose metrics.jsonl changed this recently and has no summary counts as running


@dataclass
class Diagnosis:
    run: Run
    status: str  # finished | running | stopped | ended (another engine's run whose logs do not say if it finished)
    alarms: list[dict]  # ranked, most likely problem first
    notes: list[str] = field(default_factory=list)
    detail: str | None = None  # how it is running / how it stopped, when the run directory says
    notices: list[dict] = field(default_factory=list)  # RUN/notices.jsonl: what changed what the run does

    @property
    def primary(self) -> dict | None:
        return self.alarms[0] if self.alarms else None

    def to_dict(self) -> dict:
        r = self.run
        ck = r.checkpoints()
        return {"run": str(r.path), "engine": r.engine, "status": self.status, "detail": self.detail,
                "steps_done": r.steps_done,
                "steps_planned": r.steps_planned, "last_checkpoint": str(ck[-1][1]) if ck else None,
                "eval_before": _eval(r, first=True), "eval_latest": _eval(r, first=False),
                "alarms": self.alarms, "primary": self.primary["name"] if self.primary else None,
                "notes": self.notes, "notices": self.notices}


def _eval(run: Run, first: bool) -> dict | None:
    if not run.evals:
        return None
    return run.evals[0] if first else (run.evals[-1] if len(run.evals) > 1 else None)


def diagnose(path: str | Path) -> Diagnosis:
    run = load_run(path)
    status, detail = _where(run)
    _, _, summary = run.alarms()
    ranked = sorted(summary.values(), key=lambda a: (*sort_key(a), -a["steps"]))
    notes = []
    if not run.metrics:
        notes.append("no step has been logged yet" + (" (metrics.jsonl is empty)" if run.engine == "postrl" else ""))
    if run.foreign is not None:
        notes += run.foreign.notes
        if run.metrics and run.engine != "postrl":
            keys = {k for m in run.metrics for k in m} | {k for e in run.evals for k in e}
            skipped = unread_text(unread(keys), run.engine)
            if skipped:
                notes.append(skipped)
    bad = run.bad_batches()
    if bad:
        notes.append(f"{len(bad)} batch(es) of skipped steps saved: {', '.join(str(b) for b in bad[:3])}"
                     f"{' ...' if len(bad) > 3 else ''}")
    xs, ys = run.series("reward/mean")
    if len(ys) >= 2:
        k = max(1, min(5, len(ys) // 4))
        a, b = sum(ys[:k]) / k, sum(ys[-k:]) / k
        notes.append(f"training reward {a:.3f} -> {b:.3f} (mean of the first / last {k} steps)")
    for q in run.quarantined():
        notes.append(f"checkpoint {q.name} was unusable on resume and moved aside")

    return Diagnosis(run, status, ranked, notes, detail, read_notices(run.path))


def _where(run: Run) -> tuple[str, str | None]:
    """(finished | running | stopped, detail): see the module docstring for the order of the evidence."""
    if run.foreign is not None:
        if run.finished:
            return "finished", None
        age = run.seconds_since_write()
        running = age is not None and age < RUNNING_SECONDS
        if running:
            return "running", run.foreign.detail
        return ("ended" if run.foreign.finished is None else "stopped"), run.foreign.detail
    holder = run.holder()
    alive = holder_alive(holder) if holder is not None else None
    if alive:
        return "running", f"{describe_holder(holder)} holds the run"
    if run.finished:
        return "finished", None
    end = run.end_status()
    if end is not None:
        return "stopped", describe_status(end)
    if alive is False:
        return "stopped", (f"killed: {describe_holder(holder)} ended without cleaning up (SIGKILL, out of memory, "
                           f"power loss?)")
    age = run.seconds_since_write()
    return ("running" if age is not None and age < RUNNING_SECONDS else "stopped"), None


def render(d: Diagnosis, console=None) -> None:
    """Print the diagnosis with rich."""
    from rich.console import Console
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    con = console or Console()
    r = d.run
    planned = r.steps_planned
    where = {"finished": "[green]finished[/]",
             "running": f"[yellow]running[/] ({escape(d.detail or 'no summary.json yet')}; metrics written "
                        f"{r.seconds_since_write() or 0:.0f}s ago)",
             "stopped": f"[red]stopped before the end[/] ({escape(d.detail or 'crashed or killed; no summary.json')})",
             "ended": f"not running ({escape(d.detail or 'the logs do not say whether it finished')})",
             }[d.status]
    ck = r.checkpoints()
    lines = [f"run        {r.path}"]
    if r.foreign is not None:
        lines.append(f"engine     {ENGINES.get(r.engine, r.engine)} ({escape(r.foreign.kind)})")
    lines += [f"status     {where}",
             f"steps      {r.steps_done} / {planned if planned is not None else '?'}",
             f"checkpoint {('step ' + str(ck[-1][0]) + '  ' + str(ck[-1][1])) if ck else 'none'}"]
    if d.status != "finished" and ck:
        if r.engine == "postrl" and r.foreign is None:
            lines.append(f"resume     postrl train --resume {r.path}")
        elif r.engine == "trl":
            lines.append(f"resume     trainer.train(resume_from_checkpoint='{ck[-1][1]}')")
    eb, el = _eval(r, True), _eval(r, False)

    def ev(e):
        keys = [k for k in e if k not in ("step", "tag", "n") and isinstance(e[k], (int, float))]
        return "  ".join(f"{k}={e[k]:.3f}" for k in keys)

    if eb:
        lines.append(f"eval       before (step {eb.get('step', 0)}): {ev(eb)}")
    if el:
        lines.append(f"           {el.get('tag', 'latest')} (step {el.get('step')}): {ev(el)}")
        if "accuracy" in eb and "accuracy" in el:
            lines.append(f"           accuracy {eb['accuracy']:.3f} -> {el['accuracy']:.3f} "
                         f"({el['accuracy'] - eb['accuracy']:+.3f})")
    for n in d.notes:
        lines.append(f"note       {escape(n)}")
    for rec in d.notices:  # what changed what the run does (RUN/notices.jsonl), said in every mode
        at = f"step {rec['step']}: " if rec.get("step") is not None else ""
        lines.append(f"{rec.get('kind', 'notice'):<10} {escape(at + rec['message'])}")
    con.print(Panel("\n".join(lines), title="postrl doctor", expand=False))
    if not d.alarms:
        con.print("[green]no alarm:[/] no monitor found a problem in the logged metrics.")
        return
    p = d.primary
    con.print(Panel(f"[bold]{p['name']}[/] (steps {p['first_step']}-{p['last_step']}, {p['steps']} step(s))\n"
                    f"{p['message']}\n[bold]likely cause:[/] {p['cause']}\n[bold]fix:[/] {p['fix']}",
                    title="most likely problem", border_style="red" if p.get("severity") == "error" else "yellow",
                    expand=False))
    if len(d.alarms) > 1:
        t = Table(title="all alarms, most likely first", header_style="bold", show_lines=True)
        for c in ("alarm", "steps", "symptom", "fix"):
            t.add_column(c, overflow="fold")
        for a in d.alarms:
            t.add_row(f"{a['name']}\n({a.get('severity', 'warn')})", f"{a['first_step']}-{a['last_step']}\n"
                      f"({a['steps']}x)", a["message"], a["fix"])
        con.print(t)
