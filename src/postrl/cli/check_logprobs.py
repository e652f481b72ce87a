"""``postrl check-logprobs [CONFIG] [KEY=VALUE ...]``: do sampler and trainer agree on the log-probs, before a run.

Generates with the configured sampler and recomputes the log-probs of the sampled tokens with the trainer's
forward (:mod:`postrl.diagnostics.agreement`): the configured trainer, several micro-batch sizes and padding
layouts, and top-p / top-k with and without the correction. Prints a table; exits 1 when more than
``--max-outside`` of the tokens have a probability ratio outside [0.9, 1.1] in the configured row.
"""

from __future__ import annotations

import json

from postrl.cli.common import add_import_paths, split_args
from postrl.errors import ConfigError


def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--micro-batch-sizes: expected comma-separated positive integers, got {text!r}")
    return sizes


def run(args) -> int:
    import torch

    from postrl import accel
    from postrl.config import load_config
    from postrl.diagnostics.agreement import check_agreement, render
    from postrl.train.policy import load_policy

    path, overrides = split_args(args.items)
    add_import_paths(path)
    cfg = load_config(path, overrides)
    if args.prompts < 1:
        raise ConfigError(f"--prompts: expected a positive number of prompts, got {args.prompts}")
    if not 0.0 <= args.max_outside <= 1.0:
        raise ConfigError(f"--max-outside: expected a fraction in [0, 1], got {args.max_outside}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ConfigError(f"--top-p: expected a value in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 0:
        raise ConfigError(f"--top-k: expected a value >= 0, got {args.top_k}")
    sizes = _sizes(args.micro_batch_sizes)
    device = torch.device(args.device)
    log = (lambda s: None) if args.json else print
    model, tokenizer, _ = load_policy(cfg, device, log)
    model.to(device)
    # the trainer's speed layer (train/trainer.py): under bf16 autocast the model's own products, no fused update
    mixed = cfg.model.dtype == "bfloat16"
    speed = accel.prepare(model, cfg.accel.model_copy(update={"matmul": "torch"}) if mixed else cfg.accel, device)
    speed.fused = speed.fused and not mixed
    res = check_agreement(model, tokenizer, cfg, generator=speed.generator(model, tokenizer, cfg.rollout.batch_size),
                          logprob_fn=speed.logprobs, device=device, prompts=args.prompts, micro_batch_sizes=sizes,
                          probe_top_p=args.top_p, probe_top_k=args.top_k)
    ok = res.configured.outside <= args.max_outside
    if args.json:
        print(json.dumps({**res.to_dict(), "max_outside": args.max_outside, "ok": ok}, indent=1))
    else:
        render(res, args.max_outside)
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("check-logprobs", help="sampler vs trainer log-prob agreement, before a run",
                       description="Generate with the configured sampler, recompute the log-probs with the trainer's "
                       "forward, and report the per-token log-ratio: as configured, across micro-batch sizes and "
                       "padding layouts, and with top-p / top-k uncorrected and corrected (rollout.logprobs). Exits 1 "
                       "when the configured row has more than --max-outside of its tokens with a probability ratio "
                       "outside [0.9, 1.1].")
    p.add_argument("items", nargs="*", metavar="[CONFIG] [KEY=VALUE]")
    p.add_argument("--prompts", type=int, default=8, help="prompts of the task (x rollout.group_size completions)")
    p.add_argument("--micro-batch-sizes", metavar="N,N,...", default=None,
                   help="micro-batch sizes to recompute with (default: 1, 4, train.micro_batch_size, all rows)")
    p.add_argument("--top-p", type=float, default=None, help="the filter of the top-p / top-k rows (default: the "
                   "config's, else 0.9)")
    p.add_argument("--top-k", type=int, default=None, help="top-k of those rows (default: the config's, else off)")
    p.add_argument("--max-outside", type=float, default=0.01, metavar="FRAC",
                   help="exit 1 when more than FRAC of the configured row's tokens are outside [0.9, 1.1] "
                   "(default 0.01)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    p.set_defaults(fn=run)
