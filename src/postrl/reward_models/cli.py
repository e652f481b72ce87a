"""``postrl rm train|eval``, ``postrl prm train`` and ``postrl calibrate`` (wired into :mod:`postrl.cli`).

Heavy imports (torch, transformers) happen inside the commands, so ``postrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from postrl.errors import ConfigError, DataError, PostrlError

RM_EPILOG = """examples:
  postrl rm train prefs.jsonl --backbone models/base --out rm/             Bradley-Terry, any AutoModel folder
  postrl rm train prefs.jsonl --backbone tiny:nano --rationality annotator --out rm/
  postrl rm train prefs.jsonl --backbone models/base --heads 4 --out rm-ens/     (or --seeds 4)
  postrl rm train prefs.jsonl --backbone models/base --odin --out rm-odin/
  postrl rm eval rm/ test.jsonl --compare rm-odin/
"""


def _log(msg: str) -> None:
    print(msg, flush=True)


def _split(items: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    idx = list(range(len(items)))
    random.Random(seed).shuffle(idx)
    k = int(round(len(items) * eval_fraction))
    held = set(idx[:k])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def _scalar_scores(model, prompts, completions, aggregate: str = "mean", batch_size: int = 32):
    from postrl.reward_models import aggregate_ensemble

    s = model.score(prompts, completions, batch_size)
    return aggregate_ensemble(s, aggregate) if s.shape[1] > 1 else s[:, 0]


def _pair_metrics(model, pairs, batch_size: int = 32) -> dict:
    from postrl.reward_models import pairwise_accuracy, preference_ece

    n = len(pairs)
    s = _scalar_scores(model, [p.prompt for p in pairs] * 2, [p.chosen for p in pairs] + [p.rejected for p in pairs],
                       batch_size=batch_size)
    return {"pairs": n, "pairwise_accuracy": pairwise_accuracy(s[:n], s[n:]),
            "preference_ece": preference_ece(s[:n], s[n:])}


# ------------------------------------------------------------------------------------------------ rm train
def cmd_rm_train(args) -> int:
    from postrl.reward_models import RMTrainConfig, fit_reward_model, read_preferences

    pairs = read_preferences(args.data)
    if args.eval:
        train, held = pairs, read_preferences(args.eval)
    else:
        train, held = _split(pairs, args.eval_fraction, args.seed)
    if args.odin and args.heads != 1:
        raise ConfigError("--odin uses its own two heads (length, quality); drop --heads")
    cfg = RMTrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                        margin=args.margin, rationality=args.rationality, rationality_lr=args.rationality_lr,
                        odin_length_weight=args.odin_length_weight, odin_ortho_weight=args.odin_ortho_weight,
                        smoothing=args.smoothing, seed=args.seed)
    cfg.check()
    _log(f"rm train: {len(train)} pairs ({len(held)} held out), backbone {args.backbone}")
    model = fit_reward_model(args.backbone, train, cfg, kind="odin" if args.odin else "bt", num_heads=args.heads,
                             seeds=args.seeds, max_length=args.max_length, device=args.device, log=_log)
    if held:
        m = _pair_metrics(model, held)
        model.meta["eval"] = m
        _log("held out: " + "  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))
    if getattr(model, "rationality", None):
        _log("rationality betas: " + json.dumps({k: round(v, 4) for k, v in model.rationality_table().items()}))
    model.save_pretrained(args.out)
    _log(f"saved {args.out}")
    return 0


# ------------------------------------------------------------------------------------------------ rm eval
def cmd_rm_eval(args) -> int:
    from postrl.reward_models import best_of_many_accuracy, load_reward_model, read_preferences, starc_distance
    from postrl.reward_models import pairwise_accuracy, preference_ece

    model = load_reward_model(args.model, device=args.device)
    rows = read_preferences(args.data, allow_lists=True)
    prompts, comps, owner = [], [], []
    for i, (p, rejected) in enumerate(rows):
        for c in [p.chosen, *rejected]:
            prompts.append(p.prompt)
            comps.append(c)
            owner.append(i)
    s = _scalar_scores(model, prompts, comps, args.aggregate, args.batch_size).double()
    correct, wrong, sc, sr = [], [], [], []
    pos = 0
    for p, rejected in rows:
        correct.append(float(s[pos]))
        w = s[pos + 1: pos + 1 + len(rejected)].tolist()
        wrong.append(w)
        sc.extend([float(s[pos])] * len(w))
        sr.extend(w)
        pos += 1 + len(rejected)
    res = {"model": str(args.model), "rows": len(rows), "pairs": len(sr),
           "pairwise_accuracy": pairwise_accuracy(sc, sr),
           "one_vs_many_accuracy": best_of_many_accuracy(correct, wrong),
           "preference_ece": preference_ece(sc, sr, beta=args.beta, n_bins=args.bins)}
    if args.compare:
        other = load_reward_model(args.compare, device=args.device)
        s2 = _scalar_scores(other, prompts, comps, args.aggregate, args.batch_size)
        res["compare"] = str(args.compare)
        res["starc_distance"] = starc_distance(s, s2, [p for p in prompts])
    if args.json:
        print(json.dumps(res))
    else:
        print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    return 0


# ------------------------------------------------------------------------------------------------ prm train
def _policy_folder(target: str) -> Path:
    p = Path(target)
    if (p / "config.json").is_file():
        return p
    if (p / "checkpoints").is_dir():
        from postrl.train.checkpoint import latest_checkpoint

        last = latest_checkpoint(p)
        if last is not None:
            return last
    raise PostrlError(f"--policy '{p}': neither a model folder (config.json) nor a run directory with a checkpoint")


def cmd_prm_train(args) -> int:
    import yaml

    from postrl.reward_models import RMTrainConfig, fit_prm, hf_sampler, mc_step_labels
    from postrl.reward_models.prm import read_step_records

    if args.records:
        records = read_step_records(args.records)
    else:
        if not args.policy:
            raise ConfigError("prm train: give --policy (a model to roll out) or --records (labelled steps)")
        from postrl.data import load_source, verify_row
        from postrl.models import encode_prompt, load_model_and_tokenizer
        from postrl.rollout.base import SamplingParams
        from postrl.rollout.hf import HFGenerator

        spec = {"name": args.task}
        for kv in args.task_arg:
            if "=" not in kv:
                raise ConfigError(f"--task-arg '{kv}': expected KEY=VALUE")
            k, v = kv.split("=", 1)
            spec[k] = yaml.safe_load(v)
        source = load_source(spec)
        policy, tok = load_model_and_tokenizer(_policy_folder(args.policy))
        rows = source.train_rows(0, args.prompts, args.seed)
        gen = HFGenerator(policy, tok)
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        out = gen.generate([encode_prompt(tok, r["prompt"], args.chat_template) for r in rows], args.samples, params,
                           seed=args.seed)
        rows_n = [r for r in rows for _ in range(args.samples)]

        def verify(c: str, r: dict):
            v = verify_row(c, r)
            return source.verify(c, r) if v is None else v

        sampler = hf_sampler(policy, tok, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             chat_template=args.chat_template)
        _log(f"prm: {len(out.texts)} completions, {args.rollouts} rollouts per step prefix")
        records = mc_step_labels(rows_n, out.texts, sampler, verify, delimiter=args.delimiter,
                                 rollouts=args.rollouts, seed=args.seed)
        if args.labels_out:
            Path(args.labels_out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.labels_out, "w") as f:
                for r in records:
                    f.write(json.dumps(r.to_json()) + "\n")
            _log(f"step labels: {args.labels_out}")
    if not records:
        raise DataError("prm train: no completion with a step to label")
    train, held = _split(records, args.calibration_fraction if args.calibration_out else 0.0, args.seed)
    cfg = RMTrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    model = fit_prm(args.backbone, train, cfg, delimiter=args.delimiter, max_length=args.max_length,
                    chat_template=args.chat_template, device=args.device, log=_log)
    model.save_pretrained(args.out)
    _log(f"saved {args.out}")
    if args.calibration_out:
        from postrl.calibration import step_bucket

        with open(args.calibration_out, "w") as f:
            for r in held:
                sc = model.step_scores([r.prompt], [r.completion], steps=[r.steps] if r.steps else None)[0]
                for j, y in enumerate(r.labels):
                    if j < sc.numel() and sc[j] == sc[j]:
                        f.write(json.dumps({"score": float(sc[j]), "condition": step_bucket(j),
                                            "outcome": y}) + "\n")
        _log(f"calibration set ({len(held)} held-out completions): {args.calibration_out}")
    return 0


# ------------------------------------------------------------------------------------------------ calibrate
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


def cmd_calibrate(args) -> int:
    import numpy as np

    from postrl.calibration import brier, conditional_ece, ece, make_calibrator, reliability_diagram, to_prob

    s, y, c = read_calibration_rows(args.data, args.score_field, args.outcome_field, args.condition_field)
    idx = list(range(len(s)))
    if args.eval:
        es, ey, ec = read_calibration_rows(args.eval, args.score_field, args.outcome_field, args.condition_field)
        fit_idx, ev = idx, (es, ey, ec)
    else:
        fit_idx, held = _split(idx, args.eval_fraction, args.seed)
        if not held:
            held = fit_idx
            _log("calibrate: --eval-fraction 0: metrics on the fit rows themselves")
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
    if args.json:
        print(json.dumps(res))
    else:
        print("  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    return 0


# ------------------------------------------------------------------------------------------------ parser
def _train_opts(p: argparse.ArgumentParser, lr: float) -> None:
    p.add_argument("--backbone", required=True, help="AutoModel folder (save_pretrained), or tiny:<size> / bag:<dim>")
    p.add_argument("--out", required=True, help="folder to save the reward model into")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--max-length", type=int, default=1024, help="tokens kept (from the right) per text")
    p.add_argument("--chat-template", choices=["auto", "none"], default="auto",
                   help="encode prompts with the tokenizer's chat template (auto) or as plain text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")


def add_commands(sub) -> None:
    """Add ``rm``, ``prm`` and ``calibrate`` to the ``postrl`` sub-parsers."""
    rm = sub.add_parser("rm", help="reward models: train (Bradley-Terry and variants), eval",
                        epilog=RM_EPILOG, formatter_class=argparse.RawTextHelpFormatter)
    rsub = rm.add_subparsers(dest="rm_command", metavar="SUBCOMMAND")
    t = rsub.add_parser("train", help="train a reward model on preference pairs (prompt, chosen, rejected)")
    t.add_argument("data", help="JSONL/JSON/CSV/parquet: prompt, chosen, rejected[, annotator, context, margin]")
    _train_opts(t, 1e-5)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--heads", type=int, default=1, help="K heads on one backbone (an ensemble when K > 1)")
    t.add_argument("--seeds", type=int, default=1, help="K independently trained models (an ensemble of seeds)")
    t.add_argument("--margin", action="store_true", help="Llama-2 margin loss with the 'margin' column")
    t.add_argument("--rationality", choices=["global", "annotator", "context"], default=None,
                   help="learn beta in P = sigmoid(beta (r_c - r_r)): one, per annotator, or per context")
    t.add_argument("--rationality-lr", type=float, default=1e-2)
    t.add_argument("--odin", action="store_true", help="ODIN: length head + length-decorrelated quality head")
    t.add_argument("--odin-length-weight", type=float, default=1.0)
    t.add_argument("--odin-ortho-weight", type=float, default=1.0)
    t.add_argument("--smoothing", type=float, default=None, metavar="BETA",
                   help="iterative data smoothing: y <- (1-BETA) y + BETA p_model (e.g. 0.5)")
    t.add_argument("--eval", default=None, help="held-out preference file (default: --eval-fraction of DATA)")
    t.add_argument("--eval-fraction", type=float, default=0.1)
    t.set_defaults(fn=cmd_rm_train)

    e = rsub.add_parser("eval", help="pairwise / one-vs-many accuracy, preference ECE, STARC distance")
    e.add_argument("model", help="reward model folder")
    e.add_argument("data", help="preference file; 'rejected' may be a list (one correct vs many wrong)")
    e.add_argument("--compare", default=None, help="second reward model: STARC-style distance to it")
    e.add_argument("--aggregate", choices=["mean", "min", "uwo"], default="mean", help="ensemble scalar")
    e.add_argument("--beta", type=float, default=1.0, help="P(c > r) = sigmoid(beta (r_c - r_r)) for the ECE")
    e.add_argument("--bins", type=int, default=10)
    e.add_argument("--batch-size", type=int, default=32)
    e.add_argument("--device", default="cpu")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=cmd_rm_eval)
    rm.set_defaults(fn=lambda a: (rm.print_help(), 2)[1])

    prm = sub.add_parser("prm", help="process reward models: train on Monte-Carlo step labels")
    psub = prm.add_subparsers(dest="prm_command", metavar="SUBCOMMAND")
    pt = psub.add_parser("train", help="label steps by policy rollouts on a verifiable task and train a PRM")
    pt.add_argument("--policy", help="policy model folder or run directory (rolls out the continuations)")
    pt.add_argument("--task", default="arithmetic", help="task with a verifier (arithmetic, countdown, ...)")
    pt.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="task parameter")
    pt.add_argument("--records", help="train on existing step labels (JSONL: prompt, completion, labels) instead")
    pt.add_argument("--prompts", type=int, default=64, help="task prompts to sample")
    pt.add_argument("--samples", type=int, default=4, help="completions per prompt")
    pt.add_argument("--rollouts", type=int, default=8, help="continuations per step prefix (M)")
    pt.add_argument("--delimiter", default="\n\n", help="step delimiter (default: blank line)")
    pt.add_argument("--max-new-tokens", type=int, default=32)
    pt.add_argument("--temperature", type=float, default=1.0)
    pt.add_argument("--labels-out", help="write the step labels here (JSONL)")
    pt.add_argument("--calibration-out", help="write (score, condition, outcome) rows of held-out completions")
    pt.add_argument("--calibration-fraction", type=float, default=0.2)
    _train_opts(pt, 1e-5)
    pt.set_defaults(fn=cmd_prm_train)
    prm.set_defaults(fn=lambda a: (prm.print_help(), 2)[1])

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
    c.set_defaults(fn=cmd_calibrate)
