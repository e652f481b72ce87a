"""postrl <command>: one module per command, assembled into one parser here.

Each command module (``postrl.cli.train``, ``.eval``, ``.methods`` ...) has ``add_parser(sub)``, which adds its
sub-command (help texts, options, ``fn``: the function that runs it), and imports what is heavy (torch,
transformers) only inside that function, so ``postrl --help`` stays fast. What several commands share is in
:mod:`postrl.cli.common`. ``postrl bench`` is added by its own package.

A user mistake (bad config, missing file, unknown name) prints ``postrl: error: <one line>`` and exits with
status 2, without a traceback. A Python warning prints as one ``warning: <message>`` line (no source line).
"""

from __future__ import annotations

import argparse
import os
import sys

from postrl.cli import (budget, calibrate, check_logprobs, compare, config, doctor, dpo, export, merge, methods,
                        presample, prm, probe_reward, report, rm, samples, sandbox, sft, train)
from postrl.cli import eval as eval_command
from postrl.cli.common import show_warnings_as_lines
from postrl.errors import PostrlError
from postrl.benchmark.harness import add_parser as add_bench_parser
from postrl.launch import relaunch_if_needed

__all__ = ["main", "build_parser", "quiet_openmp_spin"]

EPILOG = """examples:
  postrl train                                  the embedded default: tiny model, arithmetic, CPU
  postrl train run.yaml optim.lr=1e-5           a YAML config plus dot-list overrides
  postrl train --recipe dapo train.steps=100    a bundled recipe (base config) plus overrides
  postrl train --resume runs/arithmetic-...     continue a run from its latest checkpoint
  postrl config show run.yaml train.steps=10    print the resolved config
  postrl methods --kind advantage               list registered stages
  postrl methods overlong_soft                  one stage: description, source, parameters (type, range, default)
  postrl eval runs/arithmetic-... --task arithmetic
  postrl merge models/a models/b --out models/ab  the weighted average of two models (docs/merge.md)
  postrl dpo prefs.jsonl --model models/sft --out runs/dpo   offline preference optimisation (docs/preference.md)
  postrl check-logprobs rollout.top_p=0.9       do sampler and trainer agree on the log-probs?
"""

# in the order `postrl --help` lists them (bench between config and samples: added below)
_BEFORE_BENCH = (train, sft, presample, eval_command, methods, config)
_AFTER_BENCH = (samples, report, compare, doctor, budget, probe_reward, check_logprobs, rm, prm, calibrate, dpo, export,
                merge, sandbox)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="postrl", description="RL post-training of language models as a pipeline of "
                                "named, tested stages.", epilog=EPILOG, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for command in _BEFORE_BENCH:
        command.add_parser(sub)
    add_bench_parser(sub)  # postrl bench: side by side with TRL
    for command in _AFTER_BENCH:
        command.add_parser(sub)
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
    """The ``postrl`` command (console script and ``python -m postrl``); returns the exit status."""
    quiet_openmp_spin()
    show_warnings_as_lines()
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
