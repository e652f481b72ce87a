"""The built-in model of the main job: a tiny Llama built from a config, warm-started by SFT, cached.

The first ``postrl train`` with ``model.path: builtin`` builds a character-level tokenizer and a tiny
``LlamaForCausalLM`` (``model.builtin_size``), runs ``postrl sft`` on the configured task's demonstrations
(``sft.*``), and saves the result with ``save_pretrained`` under ``$POSTRL_CACHE`` (default
``~/.cache/postrl``) in a folder named by a hash of everything that determines it. Later runs load it from
there, like any local model. The same command reproduces it bit for bit on the same machine.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from postrl.data import load_source
from postrl.data.base import stable_hash


def cache_root() -> Path:
    return Path(os.environ.get("POSTRL_CACHE", Path.home() / ".cache" / "postrl"))


def builtin_key(cfg) -> str:
    spec = (cfg.model.builtin_size, cfg.task.model_dump(), cfg.sft.model_dump(), cfg.seed, cfg.model.chat_template, 3)  # bump when demonstrations change
    return f"{stable_hash(json.dumps(spec, sort_keys=True, default=str)):016x}"


def ensure_builtin(cfg, log: Callable[[str], None] = print) -> Path:
    """Path of the built-in warm-started model for ``cfg``; builds and caches it when missing."""
    target = cache_root() / f"builtin-{cfg.task.name}-{cfg.model.builtin_size}-{builtin_key(cfg)}"
    if (target / "config.json").is_file():
        return target
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.train.sft import run_sft

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
    (tmp / "postrl_sft.json").write_text(json.dumps({"final_loss": losses[-1], "steps": len(losses)}))
    try:
        os.rename(tmp, target)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"built-in model ready in {time.time() - t0:.0f}s (SFT loss {losses[0]:.3f} -> {losses[-1]:.3f})")
    return target
