"""``postrl doctor``: where a run stands and what went wrong, most likely problem first."""

from __future__ import annotations

import json


def run(args) -> int:
    from postrl.report.doctor import diagnose, render

    d = diagnose(args.run)
    if args.json:
        print(json.dumps(d.to_dict(), indent=1))
    else:
        render(d)
    return 0


def add_parser(sub) -> None:
    d = sub.add_parser("doctor", help="diagnose a run directory (finished, crashed or running)",
                       description="Where a run stands and what went wrong, most likely problem first.")
    d.add_argument("run", metavar="RUN_DIR")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=run)
