"""CLI commands that read runs: ``postrl samples``, ``postrl report``, ``postrl doctor``, ``postrl probe-reward``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from postrl.errors import PostrlError


def cmd_samples(args) -> int:
    from postrl.report.rundir import load_run
    from postrl.report.samples import render_samples, select_samples

    run = load_run(args.run)
    rows = select_samples(run, step=args.step, min_reward=args.min_reward, max_reward=args.max_reward,
                          alarm=args.alarm)
    if args.limit:
        rows = rows[-args.limit:]
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
    else:
        render_samples(rows)
    return 0


def cmd_report(args) -> int:
    from postrl.report.html import build_report

    out = Path(args.out) if args.out else (Path(args.runs[0]) / "report.html" if len(args.runs) == 1
                                           else Path("report.html"))
    build_report(args.runs, out)
    print(f"wrote {out}")
    return 0


def cmd_doctor(args) -> int:
    from postrl.diagnostics.doctor import diagnose, render

    d = diagnose(args.run)
    if args.json:
        print(json.dumps(d.to_dict(), indent=1))
    else:
        render(d)
    return 0


def cmd_probe_reward(args) -> int:
    from postrl.config import RewardSpec, load_config
    from postrl.data import load_source
    from postrl.diagnostics.probe import render_probe, run_probe

    from postrl.cli import _split_args

    path, overrides = _split_args(args.items)
    if args.task:
        overrides.insert(0, f"task={{name: {args.task}}}")
    cfg = load_config(path, overrides)
    specs = [RewardSpec(name=n, weight=1.0) for n in args.reward] if args.reward else list(cfg.rewards)
    if args.reward:
        from postrl import registry

        for s in specs:
            registry.entry("reward", s.name)  # unknown name: one-line error listing the valid ones
    rows = load_source(cfg.task.model_dump()).eval_rows(args.n, cfg.seed)
    if not rows:
        raise PostrlError(f"task '{cfg.task.name}': no rows to probe with")
    res = run_probe(rows, specs)
    if args.json:
        print(json.dumps({"n": res.n, "rewards": res.reward_names, "weights": res.weights,
                          "probes": {p.name: {"degenerate": p.degenerate, "pay": res.mean[p.name],
                                              "total": res.total(p.name)} for p in res.probes}}, indent=1))
    else:
        render_probe(res, args.fail_on_pay)
    if args.fail_on_pay is not None:
        bad = res.exploits(args.fail_on_pay)
        if bad:
            print("degenerate completions paid more than "
                  f"{args.fail_on_pay:g}: " + ", ".join(f"{p} ({v:.2f})" for p, v in bad), file=sys.stderr)
            return 1
    return 0


def add_parsers(sub) -> None:
    s = sub.add_parser("samples", help="show a run's logged sample completions",
                       description="Show the sample completions a run logged (samples.jsonl), filtered.")
    s.add_argument("run", metavar="RUN_DIR")
    s.add_argument("--step", type=int, help="only samples of this step")
    s.add_argument("--min-reward", type=float, help="only samples with reward >= X")
    s.add_argument("--max-reward", type=float, help="only samples with reward <= X")
    s.add_argument("--alarm", metavar="NAME", help="only samples of steps where alarm NAME was active")
    s.add_argument("--limit", type=int, default=0, help="at most this many (the latest)")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.set_defaults(fn=cmd_samples)

    r = sub.add_parser("report", help="write a self-contained HTML report of one or more runs",
                       description="Plots (reward per component, accuracy, length, entropy, KL, clipping, "
                       "throughput, alarms) of one or more runs overlaid, their config differences and samples, in "
                       "one HTML file with embedded images.")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR")
    r.add_argument("--out", help="output file (default: RUN_DIR/report.html, or ./report.html for several runs)")
    r.set_defaults(fn=cmd_report)

    d = sub.add_parser("doctor", help="diagnose a run directory (finished, crashed or running)",
                       description="Where a run stands and what went wrong, most likely problem first.")
    d.add_argument("run", metavar="RUN_DIR")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_doctor)

    p = sub.add_parser("probe-reward", help="score degenerate completions with each reward",
                       description="Score a battery of degenerate completions (empty, tag spam, repeated and hedged "
                       "answers, prompt echo, very long, format-only...) with each reward and show what it pays.")
    p.add_argument("items", nargs="*", metavar="[CONFIG] [KEY=VALUE]")
    p.add_argument("--task", help="task name (default: the config's)")
    p.add_argument("--reward", action="append", default=[], metavar="NAME",
                   help="a reward to probe (repeatable; default: the config's rewards)")
    p.add_argument("--n", type=int, default=8, help="prompts of the task to build the probes from")
    p.add_argument("--fail-on-pay", type=float, default=None, metavar="X",
                   help="exit 1 when a degenerate completion earns more than X (weighted total of the rewards)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_probe_reward)
