"""``postrl report``: a self-contained HTML report of one or more runs."""

from __future__ import annotations

from pathlib import Path


def run(args) -> int:
    from postrl.report.html import build_report

    out = Path(args.out) if args.out else (Path(args.runs[0]) / "report.html" if len(args.runs) == 1
                                           else Path("report.html"))
    build_report(args.runs, out)
    print(f"wrote {out}")
    return 0


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="write a self-contained HTML report of one or more runs",
                       description="Plots (reward per component, accuracy, length, entropy, KL, clipping, "
                       "throughput, alarms) of one or more runs overlaid, their config differences and samples, in "
                       "one HTML file with embedded images.")
    r.add_argument("runs", nargs="+", metavar="RUN_DIR")
    r.add_argument("--out", help="output file (default: RUN_DIR/report.html, or ./report.html for several runs)")
    r.set_defaults(fn=run)
