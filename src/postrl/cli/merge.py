"""``postrl merge MODEL... --out DIR``: merge models of one architecture into a ``from_pretrained`` folder.

The merge rules are :mod:`postrl.models.merge` (per tensor, peft's merge utilities for the task-vector methods);
this command checks the options, then writes the folder atomically: into a hidden temporary sibling
``.DIR.tmp-<pid>``, every file fsynced, then one rename (:mod:`postrl.train.checkpoint`'s ``_fsync_tree`` and
``_publish``, which also swap an existing folder out in one rename with ``--overwrite``). A crash leaves no
half-written DIR. Recipes (Balanced Actor Initialization, DLER's update-selective merge): ``docs/merge.md``.
"""

from __future__ import annotations

import argparse

from postrl.errors import ConfigError

# postrl.models.merge.METHODS (not imported here: it loads torch, and `postrl --help` must not)
METHODS = ("linear", "task_arithmetic", "ties", "dare", "dare_ties", "update_selective")

DESCRIPTION = """\
Merge models of one architecture (config model_type, parameter names and shapes) into DIR, a from_pretrained
folder: safetensors weights in the first model's layout and dtypes, the first model's config and tokenizer,
and postrl_merge.json (what was merged, and how). Each tensor is merged on its own:

  linear            sum_i w_i theta_i; weights normalised to sum 1 by default (a weighted average)
  task_arithmetic   theta_base + lambda * sum_i w_i tau_i,  tau_i = theta_i - theta_base        (peft)
  ties              theta_base + lambda * TIES(tau): trim each tau_i to its top --density by |.|, elect
                    each entry's sign by the larger total, mean of the agreeing w_i tau_i      (peft)
  dare              theta_base + lambda * sum_i w_i m_i tau_i / density, m_i ~ Bernoulli(--density)
                    drawn from --seed (one seed per tensor, from --seed and its name)        (peft dare_linear)
  dare_ties         DARE's drop and rescale, then TIES's sign election and disjoint mean      (peft)
  update_selective  (DLER) one RL MODEL: in each tensor the --top fraction of entries with the largest
                    |theta_rl - theta_base| take the RL value (theta_base + lambda * tau), the others the
                    base value

--weights: one per MODEL, >= 0, not all 0 (default 1 each). linear normalises them to sum 1; the task-vector
methods use them as given (their papers sum the task vectors, scaled by --lambda). --normalize /
--no-normalize overrides either default.
"""

EPILOG = """\
examples:
  postrl merge models/a models/b --weights 0.7 0.3 --out models/ab
  postrl merge models/math models/code --method ties --base models/base --density 0.2 --out models/mc
  postrl merge runs/dler/final --method update_selective --base models/base --top 0.25 --out models/dler-us
"""


def run(args) -> int:
    import os
    import shutil
    from pathlib import Path

    from postrl.models.merge import check_options, merge_folders
    from postrl.train.checkpoint import _fsync_tree, _publish

    check_options(len(args.models), args.method, weights=args.weights, base=args.base, density=args.density,
                  lam=args.lam, top=args.top, seed=args.seed, normalize=args.normalize)
    out = Path(args.out)
    if out.exists():
        if not args.overwrite:
            raise ConfigError(f"--out '{out}' exists: give a new folder, or --overwrite to replace that model folder")
        if not out.is_dir() or not (out / "config.json").is_file():
            raise ConfigError(f"--out '{out}' exists and is not a model folder (no config.json): --overwrite "
                              f"replaces a model folder only")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():  # our own leftover from an earlier failed attempt
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        record = merge_folders(args.models, tmp, method=args.method, weights=args.weights, normalize=args.normalize,
                               base=args.base, density=args.density, lam=args.lam, top=args.top, seed=args.seed)
        _fsync_tree(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    how = ", ".join(f"{k}={v}" for k, v in record.items() if k not in ("models", "method") and v is not None)
    print(f"merged {len(args.models)} model(s) by {args.method} ({how}) into {out}")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("merge", help="merge models into one from_pretrained folder (linear, task arithmetic, "
                       "TIES, DARE, update-selective)", description=DESCRIPTION,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("models", nargs="+", metavar="MODEL", help="from_pretrained folders (safetensors weights); the "
                   "first gives the config and the tokenizer")
    s.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist, unless "
                   "--overwrite)")
    s.add_argument("--method", default="linear", choices=METHODS, help="merge rule (above; default linear)")
    s.add_argument("--weights", nargs="+", type=float, metavar="W", help="one weight per MODEL (default 1 each)")
    s.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="divide the weights by their sum (default: on for linear, off otherwise)")
    s.add_argument("--base", metavar="PATH", help="the model the task vectors are taken from (task_arithmetic, "
                   "ties, dare, dare_ties, update_selective)")
    s.add_argument("--density", type=float, metavar="D", help="ties / dare / dare_ties: fraction of each task "
                   "vector kept, in (0, 1]")
    s.add_argument("--lambda", dest="lam", type=float, metavar="L", help="scale of the merged task vector "
                   "(default 1; not for linear)")
    s.add_argument("--top", type=float, metavar="F", help="update_selective: fraction of each tensor's entries "
                   "taken from the RL model, in (0, 1]")
    s.add_argument("--seed", type=int, help="dare / dare_ties: seed of the random drop (default 0)")
    s.add_argument("--overwrite", action="store_true", help="replace DIR if it is a model folder (atomically)")
    s.set_defaults(fn=run)
