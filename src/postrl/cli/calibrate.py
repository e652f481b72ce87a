"""``postrl calibrate``: fit a temperature / isotonic / conditional OT calibrator; ECE, Brier, reliability plot.

``--features-field`` (conditional_ot only) reads a list of numbers per row (e.g. the PRM's hidden state) as extra
conditioning features; conditional_ot also reports the held-out coverage and mean width of its central
``--level`` interval (default 0.9).
"""

from __future__ import annotations

import json
from pathlib import Path

from postrl.cli.common import format_metrics, holdout_split, log
from postrl.errors import ConfigError, DataError


def read_calibration_rows(path, score_field: str = "score", outcome_field: str = "outcome",
                          condition_field: str | None = "condition", features_field: str | None = None):
    """(scores, outcomes, conditions or None, features or None) from a file of rows; a bad row is a DataError
    naming it. Features: ``features_field`` of every row, a list of numbers of one length."""
    from postrl.data import read_rows

    rows = read_rows(path)
    has_cond = condition_field is not None and any(condition_field in r for r in rows)
    s, y, c, feats = [], [], [], []
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
        if features_field is not None:
            v = r.get(features_field)
            if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                raise DataError(f"{path}: row {i}: field '{features_field}' must be a list of numbers")
            if feats and len(v) != len(feats[0]):
                raise DataError(f"{path}: row {i}: field '{features_field}' has {len(v)} numbers, row 1 has "
                                f"{len(feats[0])}")
            feats.append([float(x) for x in v])
        s.append(float(r[score_field]))
        y.append(float(r[outcome_field]))
    return s, y, (c if has_cond else None), (feats if features_field is not None else None)


def run(args) -> int:
    import numpy as np

    from postrl.calibration import brier, conditional_ece, ece, make_calibrator, reliability_diagram, to_prob

    if not 0 < args.level < 1:
        raise ConfigError(f"calibrate: --level must be in (0, 1), got {args.level}")
    if args.features_field and args.method != "conditional_ot":
        raise DataError(f"calibrate: --features-field needs --method conditional_ot, got {args.method}")
    fields = (args.score_field, args.outcome_field, args.condition_field, args.features_field)
    s, y, c, f = read_calibration_rows(args.data, *fields)
    idx = list(range(len(s)))
    if args.eval:
        ev = read_calibration_rows(args.eval, *fields)
        fit_idx = idx
    else:
        fit_idx, held = holdout_split(idx, args.eval_fraction, args.seed)
        if not held:
            held = fit_idx
            log("calibrate: --eval-fraction 0: metrics on the fit rows themselves")
        ev = tuple(None if col is None else [col[i] for i in held] for col in (s, y, c, f))
    sub = [None if col is None else [col[i] for i in fit_idx] for col in (s, y, c, f)]
    cal = make_calibrator(args.method, input=args.input)
    extra = {"features": sub[3]} if f is not None else {}
    cal.fit(*sub[:3], **extra)
    cal.save(args.out)
    es, ey, ec, ef = ev
    before = to_prob(es, args.input)
    extra = {"features": ef} if f is not None else {}
    after = cal.apply(np.asarray(es), ec, **extra)
    res = {"method": args.method, "fit_rows": len(fit_idx), "eval_rows": len(es),
           "ece_before": ece(before, ey, args.bins), "ece_after": ece(after, ey, args.bins),
           "brier_before": brier(before, ey), "brier_after": brier(after, ey)}
    if ec is not None:
        res["conditional_ece_before"] = conditional_ece(before, ey, ec, args.bins)
        res["conditional_ece_after"] = conditional_ece(after, ey, ec, args.bins)
    if args.method == "conditional_ot":
        lo, hi = cal.bounds(np.asarray(es), args.level, ec, **extra)
        eya = np.asarray(ey)
        res["level"] = args.level
        res["coverage"] = float(np.mean((eya >= lo) & (eya <= hi)))
        res["interval_width"] = float(np.mean(hi - lo))
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
    c.add_argument("--features-field", help="conditional_ot: field with a list of numbers per row (e.g. the PRM's "
                   "hidden state) to condition on")
    c.add_argument("--level", type=float, default=0.9, help="conditional_ot: level of the reported interval")
    c.add_argument("--eval", help="separate evaluation file (default: --eval-fraction of DATA)")
    c.add_argument("--eval-fraction", type=float, default=0.3)
    c.add_argument("--bins", type=int, default=10)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=run)
