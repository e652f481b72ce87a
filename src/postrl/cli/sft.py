"""``postrl sft``: supervised warm start on a task's demonstrations."""

from __future__ import annotations

from pathlib import Path

from postrl.cli.common import add_import_paths, split_args


def run(args) -> int:
    from postrl.config import load_config
    from postrl.data import load_source
    from postrl.models import load_model_and_tokenizer
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.train.sft import run_sft

    path, overrides = split_args(args.items)
    add_import_paths(path)
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


def add_parser(sub) -> None:
    s = sub.add_parser("sft", help="supervised warm start on a task's demonstrations")
    s.add_argument("items", nargs="*", metavar="[CONFIG] [KEY=VALUE]")
    s.add_argument("--out", required=True, help="folder to save_pretrained the result into")
    s.set_defaults(fn=run)
