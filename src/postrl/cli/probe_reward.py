"""``postrl probe-reward``: what each reward pays a battery of degenerate completions."""

from __future__ import annotations

import json
import sys

from postrl.cli.common import add_import_paths, split_args
from postrl.errors import PostrlError
from postrl import registry


def run(args) -> int:
    from postrl.config import RewardSpec, load_config
    from postrl.data import load_source
    from postrl.diagnostics.probe import render_probe, run_probe

    path, overrides = split_args(args.items)
    add_import_paths(path)
    if args.task:
        overrides.insert(0, f"task={{name: {args.task}}}")
    cfg = load_config(path, overrides)
    specs = [RewardSpec(name=n, weight=1.0) for n in args.reward] if args.reward else list(cfg.rewards)
    if args.reward:
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


def add_parser(sub) -> None:
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
    p.set_defaults(fn=run)
