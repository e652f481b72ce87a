"""``postrl rm train|eval``: reward models (Bradley-Terry and variants) on preference pairs.

Heavy imports (torch, transformers) happen inside the commands, so ``postrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json

from postrl.cli.common import check_option, format_metrics, holdout_split, log
from postrl.errors import ConfigError, PostrlError

RM_EPILOG = """examples:
  postrl rm train prefs.jsonl --backbone models/base --out rm/             Bradley-Terry, any AutoModel folder
  postrl rm train prefs.jsonl --backbone tiny:nano --rationality judged --out rm/    (a 'bias' column in [0, 1])
  postrl rm train prefs.jsonl --backbone models/base --rationality judged --bias-judge http://127.0.0.1:8000/v1 \
      --out rm/                                        (an LLM judge scores each pair's bias, then training)
  postrl rm train prefs.jsonl --backbone tiny:nano --rationality annotator --out rm/   (learned beta per annotator)
  postrl rm train prefs.jsonl --backbone models/base --heads 4 --out rm-ens/     (or --seeds 4)
  postrl rm train prefs.jsonl --backbone models/base --odin --out rm-odin/
  postrl rm train prefs.jsonl --backbone models/base-lm --lm-reg 0.01 --out rm-grm/   (LM head kept, SFT regulariser)
  postrl rm train prefs.jsonl --backbone models/base --critic models/critic --out rm-cloud/   (CLoud; reward cloud)
  postrl rm heron samples.jsonl --factors correct,-length --margins 0,4 --out pairs.jsonl   (HERON pairs)
  postrl rm eval rm/ test.jsonl --compare rm-odin/
  postrl rm eval rm/ --samples runs/x/samples.jsonl     within-prompt reward variance under the policy (teacher/*)
"""


def scalar_scores(model, prompts, completions, aggregate: str = "mean", batch_size: int = 32):
    """One score per completion: the model's single head, or its ensemble aggregated (mean | min | uwo)."""
    from postrl.reward_models import aggregate_ensemble

    s = model.score(prompts, completions, batch_size)
    return aggregate_ensemble(s, aggregate) if s.shape[1] > 1 else s[:, 0]


def _pair_metrics(model, pairs, batch_size: int = 32) -> dict:
    from postrl.reward_models import pairwise_accuracy, preference_ece

    n = len(pairs)
    s = scalar_scores(model, [p.prompt for p in pairs] * 2, [p.chosen for p in pairs] + [p.rejected for p in pairs],
                      batch_size=batch_size)
    return {"pairs": n, "pairwise_accuracy": pairwise_accuracy(s[:n], s[n:]),
            "preference_ece": preference_ece(s[:n], s[n:])}


def judge_bias(pairs, judge: str, *, model: str = "judge", timeout: float = 30.0, concurrency: int = 8) -> None:
    """Set each pair's ``bias`` (the probability that a cognitive bias shaped it) from ``judge``
    (:func:`postrl.rewards.judge.bias_judge`): an OpenAI-compatible endpoint (``http(s)://...``) or an import path
    ``module:function`` to a judge ``(system, user) -> reply text``. A pair the judge could not score is a
    PostrlError (one line, the first failure)."""
    from postrl.rewards.judge import bias_judge

    url = judge.startswith(("http://", "https://"))
    probs = bias_judge([p.prompt for p in pairs], [p.chosen for p in pairs], [p.rejected for p in pairs],
                       judge=None if url else judge, base_url=judge if url else "", model=model, timeout=timeout,
                       concurrency=concurrency)
    bad = [(p, x) for p, x in zip(pairs, probs) if not isinstance(x, float)]
    if bad:
        p, x = bad[0]
        raise PostrlError(f"--bias-judge {judge}: no bias probability for {len(bad)} of {len(pairs)} pairs; first: "
                          f"row {p.row}: {x}")
    for p, x in zip(pairs, probs):
        p.bias = x


def run_train(args) -> int:
    from postrl.reward_models import RMTrainConfig, fit_reward_model, read_preferences
    from postrl.reward_models.train import check_margins

    check_option("--max-length", args.max_length, low=1)
    check_option("--heads", args.heads, low=1)
    check_option("--seeds", args.seeds, low=1)
    check_option("--bias-judge-timeout", args.bias_judge_timeout, low=0, low_open=True)
    pairs = read_preferences(args.data, bias_column=args.bias_column)
    if args.eval:
        train, held = pairs, read_preferences(args.eval, bias_column=args.bias_column)
    else:
        train, held = holdout_split(pairs, args.eval_fraction, args.seed)
    if args.odin and args.heads != 1:
        raise ConfigError("--odin uses its own two heads (length, quality); drop --heads")
    if args.bias_judge and args.rationality != "judged":
        raise ConfigError("--bias-judge sets per-comparison rationality: add --rationality judged")
    cfg = RMTrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                        margin=args.margin, rationality=args.rationality, beta_max=args.beta_max,
                        beta_min=args.beta_min, rationality_lr=args.rationality_lr,
                        odin_length_weight=args.odin_length_weight, odin_ortho_weight=args.odin_ortho_weight,
                        smoothing=args.smoothing, lm_reg=args.lm_reg, lm_reg_form=args.lm_reg_form,
                        lm_reg_beta=args.lm_reg_beta, seed=args.seed)
    cfg.check()
    if args.margin:
        check_margins(pairs, args.data)
    if args.rationality == "judged" and args.bias_judge:  # the judge's calls only once the settings are right
        judge_bias(train, args.bias_judge, model=args.bias_judge_model, timeout=args.bias_judge_timeout)
        log(f"bias judge: {len(train)} pairs, mean bias {sum(p.bias for p in train) / max(len(train), 1):.3f}, "
            f"{sum(p.bias >= 0.5 for p in train)} likely biased (p >= 0.5)")
    critic = None
    if args.critic:  # Critique-out-Loud: each response gets a critique before training
        from postrl.reward_models.critique import Critic, attach_critiques

        check_option("--critic-max-tokens", args.critic_max_tokens, low=1)
        check_option("--critic-temperature", args.critic_temperature, low=0)
        critic = Critic(args.critic, max_new_tokens=args.critic_max_tokens, temperature=args.critic_temperature,
                        chat_template=args.chat_template, device=args.device)
        attach_critiques(train, critic, seed=args.seed, log=log)
        if held:
            attach_critiques(held, critic, seed=args.seed)
    log(f"rm train: {len(train)} pairs ({len(held)} held out), backbone {args.backbone}")
    model = fit_reward_model(args.backbone, train, cfg, kind="odin" if args.odin else "bt", num_heads=args.heads,
                             seeds=args.seeds, max_length=args.max_length, chat_template=args.chat_template,
                             device=args.device, log=log)
    if held:
        m = _pair_metrics(model, held)
        model.meta["eval"] = m
        log("held out: " + format_metrics(m))
    if getattr(model, "rationality", None) in ("annotator", "context"):
        log("rationality betas: " + json.dumps({k: round(v, 4) for k, v in model.rationality_table().items()}))
    elif getattr(model, "rationality", None) == "judged":
        log("comparison betas: " + format_metrics(model.meta["train"]["comparison_betas"]))
    if critic is not None:
        from postrl.reward_models.critique import CRITIQUE_MARKER

        model.meta["critique"] = {"critic": args.critic, "max_new_tokens": args.critic_max_tokens,
                                  "temperature": args.critic_temperature, "chat_template": args.chat_template,
                                  "marker": CRITIQUE_MARKER}
    model.save_pretrained(args.out)
    log(f"saved {args.out}")
    return 0


def _teacher_metrics(model, path: str, aggregate: str, batch_size: int) -> dict:
    """teacher/* of the reward model on a file of policy samples (prompt, completion; several per prompt)."""
    from postrl.data.files import read_rows
    from postrl.reward_models.metrics import teacher_variance

    rows = read_rows(path)
    for i, r in enumerate(rows):
        for key in ("prompt", "completion"):
            if not isinstance(r.get(key), str):
                raise ConfigError(f"{path}: row {i} has no text '{key}' (expected rows with prompt and completion, "
                                  f"several completions per prompt, e.g. a run's samples.jsonl)")
    prompts = [r["prompt"] for r in rows]
    s = scalar_scores(model, prompts, [r["completion"] for r in rows], aggregate, batch_size)
    res = teacher_variance(s, prompts)
    if res["teacher/prompts"] == 0:
        raise ConfigError(f"{path}: no prompt has two completions; the within-prompt variance needs several "
                          f"completions per prompt")
    return {"samples": len(rows), **res}


def run_eval(args) -> int:
    from postrl.reward_models import best_of_many_accuracy, load_reward_model, read_preferences, starc_distance
    from postrl.reward_models import pairwise_accuracy, preference_ece

    if args.data is None and args.samples is None:
        raise ConfigError("rm eval: give a preference file (DATA), --samples FILE, or both")
    model = load_reward_model(args.model, device=args.device)
    if args.data is None:
        res = {"model": str(args.model), **_teacher_metrics(model, args.samples, args.aggregate, args.batch_size)}
        print(json.dumps(res) if args.json else format_metrics(res))
        return 0
    rows = read_preferences(args.data, allow_lists=True)
    prompts, comps = [], []
    for p, rejected in rows:
        for c in [p.chosen, *rejected]:
            prompts.append(p.prompt)
            comps.append(c)
    s = scalar_scores(model, prompts, comps, args.aggregate, args.batch_size).double()
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
        s2 = scalar_scores(other, prompts, comps, args.aggregate, args.batch_size)
        res["compare"] = str(args.compare)
        res["starc_distance"] = starc_distance(s, s2, list(prompts))
    if args.samples:
        res.update(_teacher_metrics(model, args.samples, args.aggregate, args.batch_size))
    print(json.dumps(res) if args.json else format_metrics(res))
    return 0


def run_heron(args) -> int:
    from postrl.data import read_rows
    from postrl.reward_models.heron import heron_pairs, parse_factors

    margins = None
    if args.margins is not None:
        try:
            margins = [float(x) for x in args.margins.split(",")]
        except ValueError:
            raise ConfigError(f"--margins: expected comma-separated numbers, got '{args.margins}'") from None
    factors = parse_factors(args.factors.split(","), margins)
    check_option("--max-pairs", args.max_pairs, low=1)
    pairs, counts = heron_pairs(read_rows(args.rows), factors, margin_unit=args.margin_unit,
                                max_pairs=args.max_pairs, source=args.rows)
    if not pairs:
        raise PostrlError(f"{args.rows}: no pair: no two completions of a prompt differ by more than a margin in any "
                          f"factor ({counts['compared']} compared)")
    import os
    from pathlib import Path

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    os.replace(tmp, out)
    decided = ", ".join(f"{f.name} {counts['decided/' + f.name]}" for f in factors)
    log(f"heron: {counts['rows']} rows, {counts['prompts']} prompts, {counts['compared']} comparisons; decided at "
        f"{decided}; undecided {counts['undecided']}; wrote {len(pairs)} pairs to {args.out}")
    return 0


def train_options(p: argparse.ArgumentParser, lr: float) -> None:
    """Options every reward-model training command takes (backbone, output, optimisation, encoding)."""
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


def add_parser(sub) -> None:
    rm = sub.add_parser("rm", help="reward models: train (Bradley-Terry and variants), eval",
                        epilog=RM_EPILOG, formatter_class=argparse.RawTextHelpFormatter)
    rsub = rm.add_subparsers(dest="rm_command", metavar="SUBCOMMAND")
    t = rsub.add_parser("train", help="train a reward model on preference pairs (prompt, chosen, rejected)")
    t.add_argument("data", help="JSONL/JSON/CSV/parquet: prompt, chosen, rejected[, annotator, context, margin, "
                   "bias]")
    train_options(t, 1e-5)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--heads", type=int, default=1, help="K heads on one backbone (an ensemble when K > 1)")
    t.add_argument("--seeds", type=int, default=1, help="K independently trained models (an ensemble of seeds)")
    t.add_argument("--margin", action="store_true", help="Llama-2 margin loss with the 'margin' column")
    t.add_argument("--rationality", choices=["judged", "annotator", "context"], default=None,
                   help="beta in P = sigmoid(beta (r_c - r_r)): judged = per comparison from its bias probability p "
                   "(beta = beta_max - (beta_max - beta_min) p; 'Mitigating Cognitive Bias in RLHF by Altering "
                   "Rationality'); annotator / context = one learned beta per label")
    t.add_argument("--bias-column", default="bias", help="column of precomputed bias probabilities in [0, 1] "
                   "(--rationality judged)")
    t.add_argument("--bias-judge", default=None, metavar="URL|MODULE:FUNCTION",
                   help="ask a judge for each training pair's bias probability (LLM-as-judge with postrl's "
                   "cognitive-bias rubric): an OpenAI-compatible endpoint, or a function (system, user) -> reply "
                   "text")
    t.add_argument("--bias-judge-model", default="judge", help="model name sent to the judge endpoint")
    t.add_argument("--bias-judge-timeout", type=float, default=30.0, help="seconds per judge call")
    t.add_argument("--beta-max", type=float, default=1.0, help="beta of a comparison with bias probability 0")
    t.add_argument("--beta-min", type=float, default=0.1, help="beta of a comparison with bias probability 1")
    t.add_argument("--rationality-lr", type=float, default=1e-2, help="learning rate of the learned betas")
    t.add_argument("--odin", action="store_true", help="ODIN: length head + length-decorrelated quality head")
    t.add_argument("--odin-length-weight", type=float, default=1.0)
    t.add_argument("--odin-ortho-weight", type=float, default=1.0)
    t.add_argument("--smoothing", type=float, default=None, metavar="BETA",
                   help="iterative data smoothing: y <- (1-BETA) y + BETA p_model (e.g. 0.5)")
    t.add_argument("--lm-reg", type=float, nargs="?", const=0.01, default=None, metavar="ALPHA",
                   help="keep the backbone's LM head and add a text-generation loss on the chosen responses: L = "
                   "(1-ALPHA) L_BT + ALPHA L_reg (default ALPHA 0.01; 'Regularizing Hidden States Enables Learning "
                   "Generalizable Reward Model for LLMs'); needs a causal-LM backbone")
    t.add_argument("--lm-reg-form", choices=["logsigmoid", "nll"], default="logsigmoid",
                   help="L_reg = -log sigmoid(beta log pi(chosen | prompt)) (GRM's SFT regulariser) or -log pi(...)")
    t.add_argument("--lm-reg-beta", type=float, default=0.1, help="beta of the logsigmoid form")
    t.add_argument("--critic", default=None, metavar="FOLDER|MODULE:FUNCTION",
                   help="Critique-out-Loud: a critic writes a critique of every chosen and rejected response and the "
                   "reward head reads prompt + response + critique (score with the reward 'cloud')")
    t.add_argument("--critic-max-tokens", type=int, default=128, help="critique length in tokens")
    t.add_argument("--critic-temperature", type=float, default=0.0, help="0: greedy critiques")
    t.add_argument("--eval", default=None, help="held-out preference file (default: --eval-fraction of DATA)")
    t.add_argument("--eval-fraction", type=float, default=0.1)
    t.set_defaults(fn=run_train)

    h = rsub.add_parser("heron", help="preference pairs from an ordered list of reward factors with margins (HERON)",
                        description="Compare every two completions of a prompt factor by factor, most important "
                        "first: the first factor whose values differ by more than its margin decides; no factor: no "
                        "pair. 'Deep Reinforcement Learning from Hierarchical Weak Preference Feedback'. The output "
                        "is a pair file for postrl rm train.")
    h.add_argument("rows", help="JSONL/JSON/CSV/parquet rows: prompt, completion and each factor (a column or a key "
                   "of 'rewards', e.g. a run's samples.jsonl); 'length' defaults to the completion's characters")
    h.add_argument("--factors", required=True, help="factor names, most important first, comma-separated; "
                   "'-name': lower is better (e.g. correct,-length)")
    h.add_argument("--margins", default=None, help="one margin per factor, comma-separated (default all 0)")
    h.add_argument("--margin-unit", choices=["absolute", "std"], default="absolute",
                   help="std: each margin times the factor's standard deviation over the rows (HERON's code)")
    h.add_argument("--max-pairs", type=int, default=None, help="at most this many pairs per prompt")
    h.add_argument("--out", required=True, help="pair file to write (JSONL: prompt, chosen, rejected, level)")
    h.set_defaults(fn=run_heron)

    e = rsub.add_parser("eval", help="pairwise / one-vs-many accuracy, preference ECE, STARC distance, teacher "
                        "variance")
    e.add_argument("model", help="reward model folder")
    e.add_argument("data", nargs="?", default=None,
                   help="preference file; 'rejected' may be a list (one correct vs many wrong)")
    e.add_argument("--samples", default=None, help="completions of the policy to be trained (prompt, completion; "
                   "several per prompt, e.g. a run's samples.jsonl): teacher/variance, teacher/variance_share "
                   "('What Makes a Reward Model a Good Teacher?')")
    e.add_argument("--compare", default=None, help="second reward model: STARC-style distance to it")
    e.add_argument("--aggregate", choices=["mean", "min", "uwo"], default="mean", help="ensemble scalar")
    e.add_argument("--beta", type=float, default=1.0, help="P(c > r) = sigmoid(beta (r_c - r_r)) for the ECE")
    e.add_argument("--bins", type=int, default=10)
    e.add_argument("--batch-size", type=int, default=32)
    e.add_argument("--device", default="cpu")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=run_eval)
    rm.set_defaults(fn=lambda a: (rm.print_help(), 2)[1])
