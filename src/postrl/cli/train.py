"""``postrl train``: RL-train a model (no arguments: the embedded default)."""

from __future__ import annotations

import time
from pathlib import Path

from postrl.cli.common import add_import_paths, split_args
from postrl.errors import PostrlError


def _default_run_dir(cfg) -> Path:
    return Path("runs") / f"{cfg.task.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(args) -> int:
    from postrl.config import load_config, read_yaml
    from postrl.report.console import ConsoleReporter
    from postrl.train.trainer import Trainer

    path, overrides = split_args(args.items)
    add_import_paths(path)
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
    from postrl.train.run_state import check_run_dir

    check_run_dir(run_dir, "--resume" if args.resume else "output_dir")  # before minutes of model loading
    reporter = ConsoleReporter([r.name for r in cfg.rewards], enabled=not args.quiet)
    trainer = Trainer(cfg, run_dir, resume=bool(args.resume), reporter=reporter)
    reporter.enabled = reporter.enabled and trainer.main
    trainer.train()
    return 0


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="RL-train a model (no arguments: the embedded default)",
                       description="RL-train a model. CONFIG is a YAML file; KEY=VALUE items override any key.")
    t.add_argument("items", nargs="*", metavar="[CONFIG] [KEY=VALUE]")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    t.add_argument("--recipe", metavar="NAME", help="start from a bundled recipe (grpo, dapo, gspo, ppo, ...); "
                   "CONFIG and KEY=VALUE apply on top")
    t.add_argument("--quiet", action="store_true", help="no console table")
    t.set_defaults(fn=run)
