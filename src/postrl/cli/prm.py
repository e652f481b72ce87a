"""``postrl prm train``: a process reward model on Monte-Carlo step labels (rolled out here, or from a file)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from postrl.cli.common import check_option, holdout_split, log, resolve_model_folder
from postrl.cli.rm import train_options
from postrl.errors import ConfigError, DataError

RECORDS_HELP = """--records FILE (JSONL, JSON or parquet), one row per completion:
  {"prompt": "2+3=", "completion": "2+3\\n\\n=5", "labels": [1.0, 0.75]}
  prompt, completion  the texts the PRM reads (the prompt encoded as in training, see --chat-template)
  labels              one number in [0, 1] per step of the completion, in order: the probability that the
                      solution is still on a correct path after that step (Math-Shepherd's soft label: the
                      fraction of continuations from the step's prefix that reach a correct answer; 0/1 hard
                      labels work too; rolled out here, the last step's label is the completion's own outcome).
                      The PRM is trained with BCE(sigmoid(score at the step's last token), label).
  steps (optional)    the completion's step texts, in order; without it the completion is cut at --delimiter
                      (a blank line by default; blank steps merge into the one before).
  The number of labels must equal the number of steps (else: an error naming the record).
  --labels-out writes this format, so labels rolled out once can be reused with --records.

examples:
  postrl prm train --policy runs/arithmetic-... --backbone tiny:nano --out prm/ --labels-out labels.jsonl
  postrl prm train --records labels.jsonl --backbone tiny:nano --out prm/
"""


def run_train(args) -> int:
    import yaml

    from postrl.reward_models import RMTrainConfig, fit_prm, hf_sampler, mc_step_labels
    from postrl.reward_models.prm import read_step_records

    check_option("--max-length", args.max_length, low=1)
    RMTrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed).check()  # at once
    if args.records:
        records = read_step_records(args.records)
    else:
        if not args.policy:
            raise ConfigError("prm train: give --policy (a model to roll out) or --records (labelled steps)")
        from postrl.data import load_source, verify_row
        from postrl.models import load_model_and_tokenizer
        from postrl.generation import encode_prompt
        from postrl.generation import SamplingParams
        from postrl.rollout.hf import HFGenerator

        spec = {"name": args.task}
        for kv in args.task_arg:
            if "=" not in kv:
                raise ConfigError(f"--task-arg '{kv}': expected KEY=VALUE")
            k, v = kv.split("=", 1)
            spec[k] = yaml.safe_load(v)
        source = load_source(spec)
        policy, tok = load_model_and_tokenizer(resolve_model_folder(args.policy, "--policy"))
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
        log(f"prm: {len(out.texts)} completions, {args.rollouts} rollouts per step prefix")
        records = mc_step_labels(rows_n, out.texts, sampler, verify, delimiter=args.delimiter,
                                 rollouts=args.rollouts, seed=args.seed)
        if args.labels_out:
            Path(args.labels_out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.labels_out, "w") as f:
                for r in records:
                    f.write(json.dumps(r.to_json()) + "\n")
            log(f"step labels: {args.labels_out}")
    if not records:
        raise DataError("prm train: no completion with a step to label")
    train, held = holdout_split(records, args.calibration_fraction if args.calibration_out else 0.0, args.seed,
                                "--calibration-fraction")
    cfg = RMTrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    model = fit_prm(args.backbone, train, cfg, delimiter=args.delimiter, max_length=args.max_length,
                    chat_template=args.chat_template, device=args.device, log=log)
    model.save_pretrained(args.out)
    log(f"saved {args.out}")
    if args.calibration_out:
        from postrl.calibration import step_bucket

        with open(args.calibration_out, "w") as f:
            for r in held:
                out = model.step_scores([r.prompt], [r.completion], steps=[r.steps] if r.steps else None,
                                        return_hidden=args.calibration_features)
                sc, hid = (out[0][0], out[1][0]) if args.calibration_features else (out[0], None)
                for j, y in enumerate(r.labels):
                    if j < sc.numel() and sc[j] == sc[j]:
                        row = {"score": float(sc[j]), "condition": step_bucket(j), "outcome": y}
                        if hid is not None:
                            row["features"] = [round(float(x), 6) for x in hid[j].tolist()]
                        f.write(json.dumps(row) + "\n")
            if args.calibration_prompts:  # the problem before any step: the fraction of its completions solved
                by_prompt: dict[str, list[float]] = {}
                for r in held:
                    by_prompt.setdefault(r.prompt, []).append(float(r.labels[-1]))
                prompts = list(by_prompt)
                sc, hid = model.prompt_scores(prompts)
                for k, p in enumerate(prompts):
                    row = {"score": float(sc[k]), "condition": "prompt",
                           "outcome": sum(by_prompt[p]) / len(by_prompt[p])}
                    if args.calibration_features:
                        row["features"] = [round(float(x), 6) for x in hid[k].tolist()]
                    f.write(json.dumps(row) + "\n")
        log(f"calibration set ({len(held)} held-out completions): {args.calibration_out}")
    return 0


def add_parser(sub) -> None:
    prm = sub.add_parser("prm", help="process reward models: train on Monte-Carlo step labels")
    psub = prm.add_subparsers(dest="prm_command", metavar="SUBCOMMAND")
    pt = psub.add_parser("train", help="label steps by policy rollouts on a verifiable task and train a PRM",
                         description="Label the steps of a policy's completions by Monte-Carlo rollouts on a\n"
                         "verifiable task (--policy), or read labelled steps (--records), and train a PRM.",
                         epilog=RECORDS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    pt.add_argument("--policy", help="policy model folder or run directory (rolls out the continuations)")
    pt.add_argument("--task", default="arithmetic", help="task with a verifier (arithmetic, countdown, ...)")
    pt.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE", help="task parameter")
    pt.add_argument("--records", help="train on existing step labels instead (JSONL: prompt, completion, labels "
                    "= one number in [0, 1] per step[, steps]; format below)")
    pt.add_argument("--prompts", type=int, default=64, help="task prompts to sample")
    pt.add_argument("--samples", type=int, default=4, help="completions per prompt")
    pt.add_argument("--rollouts", type=int, default=8, help="continuations per step prefix (M)")
    pt.add_argument("--delimiter", default="\n\n", help="step delimiter (default: blank line)")
    pt.add_argument("--max-new-tokens", type=int, default=32)
    pt.add_argument("--temperature", type=float, default=1.0)
    pt.add_argument("--labels-out", help="write the step labels here (JSONL, the --records format)")
    pt.add_argument("--calibration-out", help="write (score, condition, outcome) rows of held-out completions")
    pt.add_argument("--calibration-fraction", type=float, default=0.2)
    pt.add_argument("--calibration-prompts", action="store_true", help="also write one row per held-out prompt "
                    "(condition 'prompt': the PRM at the prompt's end, outcome = the fraction of its completions "
                    "solved), what postrl eval --ias calibrates problems with")
    pt.add_argument("--calibration-features", action="store_true", help="also write the PRM's hidden state at each "
                    "step end as 'features' (for postrl calibrate --method conditional_ot --features-field features)")
    train_options(pt, 1e-5)
    pt.set_defaults(fn=run_train)
    prm.set_defaults(fn=lambda a: (prm.print_help(), 2)[1])
