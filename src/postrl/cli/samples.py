"""``postrl samples``: a run's logged sample completions, filtered."""

from __future__ import annotations

import json


def run(args) -> int:
    from postrl.report.rundir import load_run
    from postrl.report.samples import render_samples, select_samples

    run_dir = load_run(args.run)
    rows = select_samples(run_dir, step=args.step, min_reward=args.min_reward, max_reward=args.max_reward,
                          alarm=args.alarm)
    if args.limit:
        rows = rows[-args.limit:]
    if args.json:
        print("\n".join(json.dumps(r) for r in rows))
    else:
        render_samples(rows)
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("samples", help="show a run's logged sample completions",
                       description="Show the sample completions a run logged (samples.jsonl), filtered.")
    s.add_argument("run", metavar="RUN_DIR")
    s.add_argument("--step", type=int, help="only samples of this step")
    s.add_argument("--min-reward", type=float, help="only samples with reward >= X")
    s.add_argument("--max-reward", type=float, help="only samples with reward <= X")
    s.add_argument("--alarm", metavar="NAME", help="only samples of steps where alarm NAME was active")
    s.add_argument("--limit", type=int, default=0, help="at most this many (the latest)")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.set_defaults(fn=run)
