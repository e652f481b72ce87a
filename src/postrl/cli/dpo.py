"""``postrl dpo``: offline preference optimisation on pair files; ``postrl pairs``: pairs from a policy's own
completions (the generate -> judge -> pairs half of the Self-Rewarding loop, docs/preference.md).

Heavy imports (torch, transformers) happen inside the commands, so ``postrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from postrl.cli.common import add_import_paths, check_option, format_metrics, holdout_split, log, split_args
from postrl.errors import ConfigError, PostrlError

DPO_EPILOG = """examples:
  postrl dpo prefs.jsonl --model models/sft --out runs/dpo                  DPO (loss sigmoid, beta 0.1)
  postrl dpo prefs.jsonl --model models/sft --out runs/ipo --loss ipo --beta 0.5
  postrl dpo prefs.jsonl --model models/sft --out runs/simpo --loss simpo --beta 2 --loss-arg gamma=1.0
  postrl dpo prefs.jsonl --model models/sft --out runs/lora --lora-r 8 --dtype bfloat16 --precompute-ref
  postrl dpo --resume runs/dpo                                               continue from the latest checkpoint
  postrl methods --kind preference                                           the losses and their parameters

DATA: the pair file of `postrl rm train` (JSONL / JSON / CSV / parquet: prompt, chosen, rejected[, margin]).
RUN: dpo.json, metrics.jsonl (TRL's names: rewards/chosen, rewards/margins, ...), eval.jsonl, checkpoints/,
final/ (a from_pretrained folder), summary.json.
"""

PAIRS_EPILOG = """examples:
  postrl pairs --model models/sft --out pairs.jsonl                            the default task's rewards
  postrl pairs --model models/m1 --out pairs.jsonl --prompts 256 rollout.group_size=4 'rewards=[{name: self_judge}]'

Each prompt of the config's task gets rollout.group_size completions from --model, scored by the config's
rewards; its best and worst completion (skipped when they tie) become one pair: prompt, chosen, rejected,
margin (the reward gap), chosen_reward, rejected_reward.

  postrl pairs --model models/sft --out ssb.jsonl --ssb --prompts 256            Semantic Soft Bootstrapping rows
  postrl dpo ssb.jsonl --model models/sft --out runs/ssb --loss ssb --lora-r 16  ... distilled into the student
  postrl pairs --model models/sft --out steps.jsonl --dapo prm/ --verifier correct  DAPO's step-level rows
  postrl dpo steps.jsonl --model models/sft --out runs/dapo --loss dapo_step     ... the offline step-level update
"""


def _value(text: str):
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def loss_params(args) -> dict:
    """The stage's parameters: ``--beta`` and every ``--loss-arg KEY=VALUE`` (values read as YAML scalars)."""
    params = {}
    for item in args.loss_arg:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--loss-arg {item!r}: expected KEY=VALUE (e.g. gamma=0.5)")
        params[key.strip()] = _value(value)
    if args.beta is not None:
        if "beta" in params:
            raise ConfigError("beta given twice: use --beta, not --loss-arg beta=...")
        params["beta"] = float(args.beta)
    return params


def check_loss(name: str, params: dict) -> None:
    """Build the stage once, before any model is loaded; its one-line errors name the option (``--beta``,
    ``--loss-arg KEY``, ``--loss``)."""
    from postrl.train.preference import build_loss

    try:
        build_loss(name, params)
    except ConfigError as e:
        msg = str(e)
        m = re.match(r"loss\.(\w+): (.*)", msg)
        if m:
            flag = "--beta" if m.group(1) == "beta" else f"--loss-arg {m.group(1)}"
            raise ConfigError(f"{flag}: {m.group(2)}") from None
        m = re.match(r"loss: unknown parameter '(\w+)' for preference '\w+'; valid: (.*)", msg)
        if m:
            raise ConfigError(f"--loss-arg {m.group(1)}: not a parameter of loss '{name}'; valid: "
                              f"{m.group(2)}") from None
        if msg.startswith("unknown preference"):
            raise ConfigError(f"--loss: {msg}") from None
        raise


def _settings(args):
    from postrl.train.preference import SETTINGS_FILE, PreferenceSettings

    if args.resume:
        given = [d for d, default in getattr(args, "dpo_defaults", {}).items() if getattr(args, d, default) != default]
        if given:
            flag = "DATA" if given[0] == "data" else "--" + given[0].replace("_", "-")
            raise ConfigError(f"--resume {args.resume} continues with the settings in {args.resume}/{SETTINGS_FILE}; "
                              f"drop {flag}")
        path = Path(args.resume) / SETTINGS_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise PostrlError(f"--resume {args.resume}: no {SETTINGS_FILE} in it (not a postrl dpo run)") from None
        except ValueError as e:
            raise PostrlError(f"--resume {args.resume}: {SETTINGS_FILE} is unreadable: {e}") from None
        return PreferenceSettings.from_json(data, str(path)), Path(args.resume)
    missing = [flag for flag, v in (("DATA", args.data), ("--model", args.model), ("--out", args.out)) if v is None]
    if missing:
        raise ConfigError(f"postrl dpo: give {', '.join(missing)} (or --resume RUN to continue a run)")
    s = PreferenceSettings(
        model=args.model, data=args.data, loss=args.loss, loss_params=loss_params(args), ref=args.ref,
        precompute_ref=args.precompute_ref, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size, max_length=args.max_length, schedule=args.schedule,
        warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        dtype=args.dtype, gradient_checkpointing=args.gradient_checkpointing, lora_r=args.lora_r,
        lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, lora_save=args.lora_save,
        chat_template=args.chat_template, seed=args.seed, save_every=args.save_every, keep_last=args.keep_last,
        eval_every=args.eval_every, eval_data=args.eval, eval_fraction=args.eval_fraction, accel=args.accel,
        device=args.device)
    return s, Path(args.out)


def run_dpo(args) -> int:
    from postrl.reward_models import read_preferences
    from postrl.train.preference import PreferenceTrainer

    settings, run_dir = _settings(args)
    check_loss(settings.loss, settings.loss_params)
    settings.check()
    pairs = read_preferences(settings.data)
    if settings.eval_data:
        train, held = pairs, read_preferences(settings.eval_data)
    else:
        train, held = holdout_split(pairs, settings.eval_fraction, settings.seed)
    if not train:
        raise ConfigError(f"{settings.data}: {len(pairs)} pairs, all held out by --eval-fraction "
                          f"{settings.eval_fraction}: nothing to train on")
    params = "".join(f" {k}={v}" for k, v in settings.loss_params.items())
    log(f"dpo: loss {settings.loss}{params}, {len(train)} pairs ({len(held)} held out), model {settings.model} -> "
        f"{run_dir}")
    summary = PreferenceTrainer(settings, train, held, run_dir, resume=bool(args.resume), log=log).train()
    for tag in ("before", "after"):
        if summary.get(tag):
            res = {k: v for k, v in summary[tag].items() if k not in ("step", "tag")}
            log(f"held out {tag}: " + format_metrics(res))
    log(f"saved {summary['final_model']}")
    if args.json:
        print(json.dumps(summary))
    return 0


def run_pairs(args) -> int:
    from postrl.config import load_config
    from postrl.train.preference import generate_pairs

    path, overrides = split_args(args.items)
    add_import_paths(path)
    cfg = load_config(path, [*overrides, f"model.path={json.dumps(args.model)}"])  # (a quoted YAML string)
    if args.prompts < 1:
        raise ConfigError(f"--prompts: expected an integer >= 1, got {args.prompts}")
    if args.ssb and args.dapo:
        raise ConfigError("--ssb and --dapo write different rows: give one")
    if args.dapo:
        from postrl.train.preference import generate_dapo

        check_option("--max-states", args.max_states, low=1)
        rows, counts = generate_dapo(cfg, args.prompts, args.dapo, verifier=args.verifier, max_states=args.max_states,
                                     log=log)
        if not rows:
            raise PostrlError(f"no step pair from {counts['prompts']} prompts ({counts['states']} states, "
                              f"{counts['skipped']} skipped: a step ran out of rollout.max_new_tokens or both steps "
                              f"were the same)")
        rows_out(args.out, rows)
        log(format_metrics(counts) + f"  -> {args.out}")
        return 0
    if args.ssb:
        from postrl.train.preference import generate_ssb

        check_option("--teacher-temperature", args.teacher_temperature, low=0)
        rows, counts = generate_ssb(cfg, args.prompts, verifier=args.verifier or "correct", threshold=args.threshold,
                                    teacher_temperature=args.teacher_temperature, log=log)
        if not rows:
            raise PostrlError(f"no SSB row from {counts['prompts']} prompts: {counts['with_both']} had both a correct "
                              f"and an incorrect rollout, {counts['teacher_verified']} teacher solutions were verified "
                              f"(more prompts, rollout.group_size or rollout.temperature)")
        rows_out(args.out, rows)
        log(format_metrics(counts) + f"  -> {args.out}")
        return 0
    rows, counts = generate_pairs(cfg, args.prompts, log=log)
    if not rows:
        raise PostrlError(f"no pair from {counts['prompts']} prompts: every prompt's best and worst completion tied "
                          f"in reward (more completions, rollout.group_size, or a higher rollout.temperature)")
    rows_out(args.out, rows)
    log(format_metrics(counts) + f"  -> {args.out}")
    return 0


def rows_out(path: str, rows: list[dict]) -> None:
    """Write ``rows`` as JSONL to ``path``, atomically."""
    import os

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    os.replace(tmp, out)


def add_parser(sub) -> None:
    d = sub.add_parser("dpo", help="offline preference optimisation (DPO, IPO, SimPO, AlphaPO, RPO...) on pairs",
                       epilog=DPO_EPILOG, formatter_class=argparse.RawTextHelpFormatter)
    d.add_argument("data", nargs="?", metavar="DATA", help="pair file: prompt, chosen, rejected[, margin]")
    d.add_argument("--model", help="policy folder (from_pretrained) or 'builtin'")
    d.add_argument("--out", help="run directory")
    d.add_argument("--loss", default="sigmoid", help="preference loss (postrl methods --kind preference); "
                   "default sigmoid (DPO)")
    d.add_argument("--beta", type=float, default=None, help="the loss's beta (default: the loss's own)")
    d.add_argument("--loss-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="another parameter of the loss, e.g. gamma=0.5, label_smoothing=0.1, distance=sq")
    d.add_argument("--ref", default=None, help="reference model folder (default: a frozen copy of --model; with "
                   "LoRA the policy with its adapter disabled); same vocabulary required")
    d.add_argument("--precompute-ref", action="store_true",
                   help="reference log-probs of every pair computed once before training")
    d.add_argument("--epochs", type=int, default=1)
    d.add_argument("--lr", type=float, default=1e-6)
    d.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    d.add_argument("--micro-batch-size", type=int, default=None, help="pairs per forward (default: the batch)")
    d.add_argument("--max-length", type=int, default=1024, help="tokens per prompt + completion (the start kept)")
    d.add_argument("--schedule", choices=["constant", "linear", "cosine"], default="linear")
    d.add_argument("--warmup-ratio", type=float, default=0.0)
    d.add_argument("--weight-decay", type=float, default=0.0)
    d.add_argument("--max-grad-norm", type=float, default=1.0)
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="bfloat16: float32 master weights, bf16 autocast forward")
    d.add_argument("--gradient-checkpointing", action="store_true")
    d.add_argument("--lora-r", type=int, default=None, help="LoRA rank (default: every weight trains)")
    d.add_argument("--lora-alpha", type=int, default=16)
    d.add_argument("--lora-dropout", type=float, default=0.0)
    d.add_argument("--lora-save", choices=["merged", "adapter", "both"], default="both")
    d.add_argument("--chat-template", choices=["auto", "none"], default="auto",
                   help="encode prompts with the tokenizer's chat template (auto) or as plain text")
    d.add_argument("--eval", default=None, help="held-out pair file (default: --eval-fraction of DATA)")
    d.add_argument("--eval-fraction", type=float, default=0.1)
    d.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: before and after)")
    d.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    d.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--accel", choices=["auto", "off"], default="auto", help="the CPU speed layer (postrl.accel)")
    d.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1 ...")
    d.add_argument("--resume", default=None, metavar="RUN", help="continue RUN from its latest checkpoint")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    d.set_defaults(fn=run_dpo, dpo_defaults={a.dest: a.default for a in d._actions
                                             if a.dest not in ("help", "resume", "json")})

    p = sub.add_parser("pairs", help="preference pairs from a policy's own completions, scored by the config's "
                       "rewards (e.g. self_judge)", epilog=PAIRS_EPILOG, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("items", nargs="*", metavar="[CONFIG] [KEY=VALUE]", help="a config and overrides, as postrl train")
    p.add_argument("--model", required=True, help="policy folder (from_pretrained) or 'builtin'")
    p.add_argument("--out", required=True, help="pair file to write (JSONL)")
    p.add_argument("--prompts", type=int, default=64, help="prompts to sample (train.prompts_per_step per round)")
    p.add_argument("--ssb", action="store_true", help="Semantic Soft Bootstrapping rows instead: per prompt the "
                   "model's own verified solution written after seeing its correct and most common wrong rollout "
                   "(ref_prompt); train with postrl dpo ROWS --loss ssb")
    p.add_argument("--dapo", default=None, metavar="PRM", help="Direct Advantage Policy Optimization's step-level "
                   "rows instead: at step prefixes of the model's trajectories, two next steps and their advantages "
                   "under the PRM critic (postrl prm train); train with postrl dpo ROWS --loss dapo_step")
    p.add_argument("--max-states", type=int, default=4, help="--dapo: states (step prefixes) per prompt")
    p.add_argument("--verifier", default=None, help="--ssb: the reward that labels rollouts correct (default "
                   "correct); --dapo: the reward whose outcome is the value after a final step (default: the PRM's)")
    p.add_argument("--threshold", type=float, default=1.0, help="--ssb: correct when the verifier scores >= this")
    p.add_argument("--teacher-temperature", type=float, default=0.0, help="--ssb: the teacher's sampling "
                   "temperature (0: greedy)")
    p.set_defaults(fn=run_pairs)
