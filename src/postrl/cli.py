"""postrl <command>: train, sft, eval, methods, config.

A user mistake (bad config, missing file, unknown name) prints ``postrl: error: <one line>`` and exits with
status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from postrl.errors import ConfigError, PostrlError

EPILOG = """examples:
  postrl train                                  the embedded default: tiny model, arithmetic, CPU
  postrl train run.yaml optim.lr=1e-5           a YAML config plus dot-list overrides
  postrl train --recipe dapo train.steps=100    a bundled recipe (base config) plus overrides
  postrl train --resume runs/arithmetic-...     continue a run from its latest checkpoint
  postrl config show run.yaml train.steps=10    print the resolved config
  postrl methods --kind advantage               list registered stages
  postrl eval runs/arithmetic-... --task arithmetic
"""


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """First item without '=' is the config file; the rest are KEY=VALUE overrides."""
    path, overrides = None, []
    for it in items:
        if "=" in it:
            overrides.append(it)
        elif path is None:
            path = it
        else:
            raise PostrlError(f"unexpected argument '{it}': give one config file and KEY=VALUE overrides")
    return path, overrides


def _default_run_dir(cfg) -> Path:
    return Path("runs") / f"{cfg.task.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_train(args) -> int:
    from postrl.config import load_config, read_yaml
    from postrl.report.console import ConsoleReporter
    from postrl.train.trainer import Trainer

    path, overrides = _split_args(args.items)
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise PostrlError(f"--resume {run_dir}: no config.yaml in it (expected a postrl run directory)")
        if path is not None or args.recipe:
            raise PostrlError("--resume takes the run's own config; give only KEY=VALUE overrides")
        cfg = load_config(None, overrides, base=read_yaml(run_dir / "config.yaml"))
    else:
        from postrl import recipes

        cfg = load_config(path, overrides, base=recipes.load(args.recipe) if args.recipe else None)
        run_dir = Path(cfg.output_dir) if cfg.output_dir else _default_run_dir(cfg)
        if cfg.output_dir is None:
            cfg.output_dir = str(run_dir)
    reporter = ConsoleReporter([r.name for r in cfg.rewards], enabled=not args.quiet)
    trainer = Trainer(cfg, run_dir, resume=bool(args.resume), reporter=reporter)
    reporter.enabled = reporter.enabled and trainer.main
    trainer.train()
    return 0


def cmd_sft(args) -> int:
    from postrl.config import load_config
    from postrl.data import load_source
    from postrl.models import load_model_and_tokenizer
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.train.sft import run_sft

    path, overrides = _split_args(args.items)
    cfg = load_config(path, overrides)
    source = load_source(cfg.task.model_dump())
    if cfg.model.path == "builtin":
        tokenizer = build_tokenizer()
        model = build_model(tokenizer, size=cfg.model.builtin_size, seed=cfg.seed)
    else:
        model, tokenizer = load_model_and_tokenizer(cfg.model.path, cfg.model.dtype)
    every = max(1, cfg.sft.steps // 10)

    def on_step(s: int, loss: float) -> None:
        if (s + 1) % every == 0 or s == 0:
            print(f"sft step {s + 1}/{cfg.sft.steps}  loss {loss:.4f}", flush=True)

    run_sft(model, tokenizer, source, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
            warmup_steps=cfg.sft.warmup_steps, weight_decay=cfg.sft.weight_decay, seed=cfg.seed,
            chat_template=cfg.model.chat_template, on_step=on_step)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved {out}")
    return 0


def _resolve_eval_model(target: str) -> Path:
    p = Path(target)
    if (p / "config.json").is_file():
        return p
    if (p / "checkpoints").is_dir():
        from postrl.train.checkpoint import latest_checkpoint

        last = latest_checkpoint(p)
        if last is None:
            raise PostrlError(f"'{p}': run directory without a complete checkpoint")
        return last
    raise PostrlError(f"'{p}': neither a model folder (config.json) nor a run directory (checkpoints/)")


def cmd_eval(args) -> int:
    from postrl.config import load_config, read_yaml
    from postrl.data import load_source
    from postrl.evaluate import evaluate
    from postrl import accel
    from postrl.models import load_model_and_tokenizer

    model_path = _resolve_eval_model(args.target)
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
                   max_new_tokens=args.max_new_tokens or cfg.rollout.max_new_tokens, k=args.k,
                   temperature=cfg.rollout.temperature or 1.0, seed=cfg.seed, chat_template=cfg.model.chat_template,
                   stop=cfg.rollout.stop)
    res = {"model": str(model_path), "task": cfg.task.name, **res}
    print(json.dumps(res) if args.json else "  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                                      for k, v in res.items()))
    return 0


def cmd_methods(args) -> int:
    from postrl import registry

    entries = [e for e in registry.all_entries() if args.kind is None or e.kind == args.kind]
    if args.kind is not None and args.kind not in registry.KINDS:
        raise PostrlError(f"--kind '{args.kind}': valid kinds: {', '.join(registry.KINDS)}")
    if args.json:
        print(json.dumps([{"kind": e.kind, "name": e.name, "description": e.description, "source": e.source}
                          for e in entries], indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(header_style="bold")
    for c in ("kind", "name", "description", "source"):
        t.add_column(c)
    for e in entries:
        t.add_row(e.kind, e.name, e.description, e.source)
    Console().print(t)
    return 0


def cmd_config(args) -> int:
    from postrl.config import dump_yaml, load_config

    path, overrides = _split_args(args.items)
    print(dump_yaml(load_config(path, overrides)), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="postrl", description="RL post-training of language models as a pipeline of "
                                "named, tested stages.", epilog=EPILOG, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="RL-train a model (no arguments: the embedded default)",
                       description="RL-train a model. CONFIG is a YAML file; KEY=VALUE items override any key.")
    t.add_argument("items", nargs="*", metavar="[CONFIG] [KEY=VALUE]")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    t.add_argument("--recipe", metavar="NAME", help="start from a bundled recipe (grpo, dapo, gspo, ppo, ...); "
                   "CONFIG and KEY=VALUE apply on top")
    t.add_argument("--quiet", action="store_true", help="no console table")
    t.set_defaults(fn=cmd_train)

    s = sub.add_parser("sft", help="supervised warm start on a task's demonstrations")
    s.add_argument("items", nargs="*", metavar="[CONFIG] [KEY=VALUE]")
    s.add_argument("--out", required=True, help="folder to save_pretrained the result into")
    s.set_defaults(fn=cmd_sft)

    e = sub.add_parser("eval", help="held-out accuracy, pass@k and length of a model or run")
    e.add_argument("target", metavar="MODEL_OR_RUN")
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    e.add_argument("--task", help="task name (default: the run's task, or arithmetic)")
    e.add_argument("--n", type=int, default=200, help="held-out prompts")
    e.add_argument("--k", type=int, default=4, help="samples per prompt for pass@k")
    e.add_argument("--max-new-tokens", type=int, default=None)
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=cmd_eval)

    m = sub.add_parser("methods", help="list registered stages with their description and source")
    m.add_argument("--kind", help="only this stage kind")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=cmd_methods)

    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    cs = csub.add_parser("show", help="print the resolved config")
    cs.add_argument("items", nargs="*", metavar="[FILE] [KEY=VALUE]")
    cs.set_defaults(fn=cmd_config)
    cr = csub.add_parser("reference", help="print the configuration reference (markdown)")
    cr.set_defaults(fn=lambda a: print(__import__("postrl.config", fromlist=["x"]).reference_markdown()) or 0)

    from postrl.benchmark.harness import add_parser as add_bench_parser  # postrl bench: side by side with TRL

    add_bench_parser(sub)
    from postrl.report.commands import add_parsers as add_run_parsers  # samples, report, doctor, probe-reward

    add_run_parsers(sub)
    from postrl.reward_models.cli import add_commands as add_rm_commands  # rm train|eval, prm train, calibrate

    add_rm_commands(sub)
    from postrl.sandbox.cli import add_parser as add_sandbox_parser  # postrl sandbox FILE.py [--tests TESTS]

    add_sandbox_parser(sub)
    return p


def quiet_openmp_spin(environ=os.environ) -> bool:
    """Set ``GOMP_SPINCOUNT=10000`` (libgomp's idle threads spin about 0.2 ms, not its default ~7 ms, before they
    sleep) unless it is set, and only before torch (and with it libgomp) is loaded; True when set. A phase on fewer
    threads then has the other cores at once after the update; the update's back-to-back parallel regions are as
    fast (``postrl.accel``)."""
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = "10000"
    return True


def main(argv: list[str] | None = None) -> int:
    quiet_openmp_spin()
    from postrl.launch import relaunch_if_needed

    try:
        status = relaunch_if_needed(list(sys.argv[1:] if argv is None else argv))
    except PostrlError as e:
        print(f"postrl: error: {e}", file=sys.stderr)
        return 2
    if status is not None:
        return status
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse cannot take positionals after an option (`eval RUN --task t task.digits=3`): KEY=VALUE items that
    # it left over are overrides of the command; anything else is an error as usual.
    bad = [x for x in extra if x.startswith("-") or "=" not in x]
    field = "items" if hasattr(args, "items") else "overrides" if hasattr(args, "overrides") else None
    if bad or (extra and field is None):
        parser.error(f"unrecognized arguments: {' '.join(bad or extra)}")
    if extra:
        getattr(args, field).extend(extra)
    if not hasattr(args, "fn"):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return args.fn(args)
    except PostrlError as e:
        print(f"postrl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("postrl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
