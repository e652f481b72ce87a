"""Building the built-in warm-started model (:mod:`postrl.models.builtin` finds it): a step that ``postrl train``
runs before a run whose built-in model is missing, and that ``make builtin`` (``python -m postrl.train.builtin``,
``... calculator`` for the calculator recipe's) runs to rebuild the shipped ones.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from postrl.data import load_source
from postrl.models.builtin import SHIPPED, builtin_name, cache_root, find_builtin
from postrl.models.tiny import build_model, build_tokenizer
from postrl.train.sft import run_sft
from postrl import recipes
from postrl.config import Config, load_config


def ensure_builtin(cfg, log: Callable[[str], None] = print, use_shipped: bool = True) -> Path:
    """Path of the built-in warm-started model for ``cfg``: the shipped one when ``cfg`` is the config it was built
    from, else the cached one, built and cached when missing."""
    found = find_builtin(cfg, use_shipped)
    if found is not None:
        return found
    target = cache_root() / builtin_name(cfg)

    log(f"building the built-in model: {cfg.model.builtin_size} Llama + SFT warm start on '{cfg.task.name}' "
        f"({cfg.sft.steps} steps); cached in {target}")
    t0 = time.time()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, size=cfg.model.builtin_size, seed=cfg.seed)
    source = load_source(cfg.task.model_dump())
    losses = run_sft(model, tokenizer, source, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, lr=cfg.sft.lr,
                     warmup_steps=cfg.sft.warmup_steps, weight_decay=cfg.sft.weight_decay, seed=cfg.seed,
                     chat_template=cfg.model.chat_template)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "postrl_sft.json").write_text(json.dumps({"first_loss": losses[0], "final_loss": losses[-1],
                                                           "steps": len(losses)}))
    try:
        os.rename(tmp, target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built-in model ready in {time.time() - t0:.0f}s (SFT loss {losses[0]:.3f} -> {losses[-1]:.3f})")
    return target


def ship(dest: Path = SHIPPED, log: Callable[[str], None] = print, recipe: str | None = None) -> Path:
    """Build the built-in model of the default config (or of the bundled ``recipe``) from scratch (in a temporary
    cache) and put it in ``dest``, replacing the model of the same task and size shipped there before. ``make
    builtin`` (``make builtin-calculator``) runs this."""
    import tempfile

    cfg = Config() if recipe is None else load_config(None, [], base=recipes.load(recipe))
    old_cache = os.environ.get("POSTRL_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["POSTRL_CACHE"] = tmp
        try:
            built = ensure_builtin(cfg, log=log, use_shipped=False)
        finally:
            if old_cache is None:
                os.environ.pop("POSTRL_CACHE", None)
            else:
                os.environ["POSTRL_CACHE"] = old_cache
        dest.mkdir(parents=True, exist_ok=True)
        for stale in dest.glob(f"builtin-{cfg.task.name}-{cfg.model.builtin_size}-*"):
            shutil.rmtree(stale)
        final = dest / built.name
        shutil.copytree(built, final)
    log(f"shipped {final}")
    return final


if __name__ == "__main__":
    import sys

    ship(recipe=sys.argv[1] if len(sys.argv) > 1 else None)
