"""``postrl calibrate``: fit a temperature / isotonic / conditional OT calibrator; ECE, Brier, reliability plot."""

from __future__ import annotations

import json
from pathlib import Path

from postrl.cli.common import format_metrics, holdout_split, log
from postrl.errors import DataError


def read_calibration_rows(path, score_field: str = "score", outcome_field: str = "outcome",
                          condition_field: str | None = "condition"):
    """(scores, outcomes, conditions or None) from a file of rows; a bad row is a DataError naming it."""
    from postrl.data import read_rows

    rows = read_rows(path)
    has_cond = condition_field is not None and any(condition_field in r for r in rows)
    s, y, c = [], [], []
    for i, r in enumerate(rows, 1):
        for f in (score_field, outcome_field):
            if f not in r:
                raise DataError(f"{path}: row {i}: missing field '{f}'")
            v = r[f]
            if not isinstance(v, (int, float)) or (isinstance(v, bool) and f == score_field):
                raise DataError(f"{path}: row {i}: field '{f}' must be a number, got {type(v).__name__}")
        if not 0.0 <= float(r[outcome_field]) <= 1.0:
            raise DataError(f"{path}: row {i}: field '{outcome_field}' must be in [0, 1], got {r[outcome_field]}")
        if has_cond:
            if condition_field not in r or r[condition_field] is None:
                raise DataError(f"{path}: row {i}: missing field '{condition_field}' (other rows have it)")
            c.append(str(r[condition_field]))
        s.append(float(r[score_field]))
        y.append(float(r[outcome_field]))
    return s, y, (c if has_cond else None)


def run(args) -> int:
    import numpy as np

    from postrl.calibration import brier, conditional_ece, ece, make_calibrator, reliability_diagram, to_prob

    s, y, c = read_calibration_rows(args.data, args.score_field, args.outcome_field, args.condition_field)
    idx = list(range(len(s)))
    if args.eval:
        es, ey, ec = read_calibration_rows(args.eval, args.score_field, args.outcome_field, args.condition_field)
        fit_idx, ev = idx, (es, ey, ec)
    else:
        fit_idx, held = holdout_split(idx, args.eval_fraction, args.seed)
        if not held:
            held = fit_idx
            log("calibrate: --eval-fraction 0: metrics on the fit rows themselves")
        ev = ([s[i] for i in held], [y[i] for i in held], None if c is None else [c[i] for i in held])
    cal = make_calibrator(args.method, input=args.input)
    cal.fit([s[i] for i in fit_idx], [y[i] for i in fit_idx], None if c is None else [c[i] for i in fit_idx])
    cal.save(args.out)
    es, ey, ec = ev
    before = to_prob(es, args.input)
    after = cal.apply(np.asarray(es), ec)
    res = {"method": args.method, "fit_rows": len(fit_idx), "eval_rows": len(es),
           "ece_before": ece(before, ey, args.bins), "ece_after": ece(after, ey, args.bins),
           "brier_before": brier(before, ey), "brier_after": brier(after, ey)}
    if ec is not None:
        res["conditional_ece_before"] = conditional_ece(before, ey, ec, args.bins)
        res["conditional_ece_after"] = conditional_ece(after, ey, ec, args.bins)
    if args.plot:
        reliability_diagram(args.plot, {"before": (before, ey), args.method: (after, ey)}, args.bins,
                            title=f"reliability ({Path(args.data).name})")
        res["plot"] = str(args.plot)
    res["calibrator"] = str(args.out)
    print(json.dumps(res) if args.json else format_metrics(res))
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("calibrate", help="fit temperature / isotonic / conditional OT calibration; ECE, Brier, plot")
    c.add_argument("data", help="rows of score, outcome (in [0, 1]) and optionally condition")
    c.add_argument("--method", choices=["temperature", "isotonic", "conditional_ot"], default="isotonic")
    c.add_argument("--out", required=True, help="calibrator JSON to write")
    c.add_argument("--plot", help="reliability diagram PNG to write")
    c.add_argument("--input", choices=["prob", "logit"], default="prob", help="scores are probabilities or logits")
    c.add_argument("--score-field", default="score")
    c.add_argument("--outcome-field", default="outcome")
    c.add_argument("--condition-field", default="condition")
    c.add_argument("--eval", help="separate evaluation file (default: --eval-fraction of DATA)")
    c.add_argument("--eval-fraction", type=float, default=0.3)
    c.add_argument("--bins", type=int, default=10)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=run)
