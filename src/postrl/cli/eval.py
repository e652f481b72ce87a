"""``postrl eval``: held-out accuracy, pass@k and length of a model or run; ``--ias``: instance-adaptive Best-of-N."""

from __future__ import annotations

import json
from pathlib import Path

from postrl.cli.common import add_import_paths, check_option, format_metrics, resolve_model_folder
from postrl.errors import ConfigError


def run(args) -> int:
    from postrl.config import load_config, read_yaml
    from postrl.data import load_source
    from postrl.evaluate import episode_runner, evaluate
    from postrl.models import load_model_and_tokenizer
    from postrl import accel

    from postrl.config import MAX_NEW_TOKENS, MAX_ROWS_PER_STEP

    check_option("--n", args.n, low=1, high=MAX_ROWS_PER_STEP)
    check_option("--k", args.k, low=1, high=MAX_ROWS_PER_STEP)
    check_option("--max-new-tokens", args.max_new_tokens, low=1, high=MAX_NEW_TOKENS)
    if args.ias:
        for flag, v in (("--ias-target", args.ias_target), ("--ias-quantile", args.ias_quantile)):
            if not 0.0 < v < 1.0:  # NaN fails too
                raise ConfigError(f"{flag} must be a number in (0, 1), got {v}")
        check_option("--ias-min", args.ias_min, low=1, high=MAX_ROWS_PER_STEP)
        check_option("--ias-max", args.ias_max, low=args.ias_min, high=MAX_ROWS_PER_STEP)
    add_import_paths()
    model_path = resolve_model_folder(args.target, "")
    base = read_yaml(Path(args.target) / "config.yaml") if (Path(args.target) / "config.yaml").is_file() else None
    overrides = list(args.overrides)
    if args.task:
        overrides.insert(0, f"task={{name: {args.task}}}")
    cfg = load_config(None, overrides, base=base)
    source = load_source(cfg.task.model_dump())
    model, tokenizer = load_model_and_tokenizer(model_path, cfg.model.dtype)
    rows = source.eval_rows(args.n, cfg.seed)
    gen = accel.prepare(model, cfg.accel).generator(model, tokenizer)
    res = evaluate(gen, tokenizer, source, rows,
                   max_new_tokens=args.max_new_tokens if args.max_new_tokens is not None
                   else cfg.rollout.max_new_tokens, k=args.k,
                   temperature=cfg.rollout.temperature or 1.0, seed=cfg.seed, chat_template=cfg.model.chat_template,
                   stop=cfg.rollout.stop, max_prompt_length=cfg.rollout.max_prompt_length,
                   prompt_overflow=cfg.rollout.prompt_overflow,
                   episodes=episode_runner(gen, tokenizer, cfg.environment, cfg.model.chat_template))
    if args.ias:
        if cfg.environment is not None:
            raise ConfigError("eval --ias: instance-adaptive Best-of-N samples single completions; this run names "
                              "an environment")
        from postrl.calibration import load_calibrator
        from postrl.evaluate import evaluate_ias
        from postrl.reward_models import load_reward_model

        prm = load_reward_model(args.ias)
        if getattr(prm, "kind", None) != "prm":
            raise ConfigError(f"eval --ias '{args.ias}': expected a process reward model (postrl prm train)")
        cal = load_calibrator(args.ias_calibrator) if args.ias_calibrator else None
        res.update(evaluate_ias(gen, tokenizer, rows, prm, calibrator=cal, target=args.ias_target,
                                quantile=args.ias_quantile, n_min=args.ias_min, n_max=args.ias_max,
                                condition=args.ias_condition or None,
                                max_new_tokens=args.max_new_tokens or cfg.rollout.max_new_tokens,
                                temperature=cfg.rollout.temperature or 1.0, seed=cfg.seed,
                                chat_template=cfg.model.chat_template, stop=cfg.rollout.stop))
    res = {"model": str(model_path), "task": cfg.task.name, **res}
    print(json.dumps(res) if args.json else format_metrics(res))
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="held-out accuracy, pass@k and length of a model or run")
    e.add_argument("target", metavar="MODEL_OR_RUN")
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    e.add_argument("--task", help="task name (default: the run's task, or arithmetic)")
    e.add_argument("--n", type=int, default=200, help="held-out prompts (>= 1)")
    e.add_argument("--k", type=int, default=4, help="samples per prompt for pass@k (>= 1)")
    e.add_argument("--max-new-tokens", type=int, default=None, help="completion length limit (>= 1; default: "
                   "the config's rollout.max_new_tokens)")
    e.add_argument("--ias", metavar="PRM_DIR", help="also run instance-adaptive Best-of-N with this process reward "
                   "model: samples per problem from its calibrated success bound (postrl.calibration.ias)")
    e.add_argument("--ias-calibrator", metavar="CAL_JSON", help="calibrator of the PRM's prompt scores (postrl "
                   "calibrate; conditional_ot gives the quantile bound); none: the raw PRM score")
    e.add_argument("--ias-target", type=float, default=0.95, help="probability that a problem's samples hold a "
                   "success (default 0.95)")
    e.add_argument("--ias-quantile", type=float, default=0.1, help="level of the lower bound (default 0.1)")
    e.add_argument("--ias-min", type=int, default=1, help="fewest samples per problem (default 1)")
    e.add_argument("--ias-max", type=int, default=16, help="most samples per problem, and the fixed Best-of-N "
                   "compared with (default 16)")
    e.add_argument("--ias-condition", default="prompt", help="the calibrator's condition for a problem (default "
                   "'prompt', as postrl prm train --calibration-prompts writes; '' for none)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=run)
