"""Warm starts of the reasoning testbed (the ``scratchpad`` recipe) of three strengths, for the label-free claim.

    python examples/compare/make_warm_starts.py OUT_DIR      (default compare_data/warm_starts; ~17 min on 2 cores)

One SFT run of the recipe's built-in model (nano, seed 0, the recipe's sft settings: 2000 steps of 64
demonstrations, lr 3e-3, 20 warmup steps, cosine decay; one thread), saved after 600 steps (``weak``), 1000 steps
(``medium``) and at the end (``strong``: the model `make builtin-scratchpad` ships, up to the rounding of another
thread count). Measured on 100 held-out prompts: sampled (T = 1) accuracy 0.03 / 0.17 / 0.32, greedy 0.13 / 0.56 /
0.94.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    from postrl import recipes
    from postrl.config import load_config
    from postrl.data import load_source
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.train.sft import run_sft

    cfg = load_config(None, [], base=recipes.load("scratchpad"))
    tok = build_tokenizer()
    model = build_model(tok, size=cfg.model.builtin_size, seed=cfg.seed)
    keep = {600: "weak", 1000: "medium"}

    def on_step(step: int, loss: float) -> None:
        if step in keep:
            model.save_pretrained(out / keep[step])
            tok.save_pretrained(out / keep[step])
        if step % 100 == 0:
            print(f"sft step {step} loss {loss:.4f}", flush=True)

    losses = run_sft(model, tok, load_source(cfg.task.model_dump()), steps=cfg.sft.steps,
                     batch_size=cfg.sft.batch_size, lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps,
                     weight_decay=cfg.sft.weight_decay, seed=cfg.seed, chat_template=cfg.model.chat_template,
                     on_step=on_step, threads=1)
    model.save_pretrained(out / "strong")
    tok.save_pretrained(out / "strong")
    (out / "strong" / "postrl_sft.json").write_text(json.dumps({"first_loss": losses[0], "final_loss": losses[-1],
                                                                "steps": len(losses)}))
    print(f"wrote {out}/weak, medium, strong")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "compare_data/warm_starts"))
