"""The built-in model of the main job: a tiny Llama built from a config, warm-started by SFT, shipped or cached.

``model.path: builtin`` names a character-level tokenizer and a tiny ``LlamaForCausalLM``
(``model.builtin_size``) trained by ``postrl sft`` on the configured task's demonstrations (``sft.*``), saved with
``save_pretrained`` in a folder named by a hash of everything that determines it. The one for the default config
ships with the package (``postrl/models/shipped/``), so ``postrl train`` starts RL at once; ``make builtin``
(``python -m postrl.train.builtin``) rebuilds it with the same code, bit for bit on this project's development
machine (``tests/test_builtin.py`` rebuilds it and compares). The ``calculator`` recipe's model (nano, SFT on
demonstrations of tool use) ships too (:data:`SHIPPED_RECIPES`; ``make builtin-calculator``, i.e.
``python -m postrl.train.builtin calculator``), so ``postrl train --recipe calculator`` starts RL at once; so do
the ``tool_calls`` and ``scratchpad`` recipes' (``make builtin-tool-calls``, ``make builtin-scratchpad``). Any other config's model is built by
``postrl train`` before the run (:mod:`postrl.train.builtin`; this module only finds it) and cached under
``$POSTRL_CACHE`` (default ``~/.cache/postrl``); later runs load it from there, like any local model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from postrl.seeding import stable_hash


def cache_root() -> Path:
    return Path(os.environ.get("POSTRL_CACHE", Path.home() / ".cache" / "postrl"))


def builtin_key(cfg) -> str:
    spec = (cfg.model.builtin_size, cfg.task.model_dump(), cfg.sft.model_dump(), cfg.seed, cfg.model.chat_template, 3)  # bump when demonstrations change
    return f"{stable_hash(json.dumps(spec, sort_keys=True, default=str)):016x}"


SHIPPED = Path(__file__).parent / "shipped"
SHIPPED_RECIPES = ("calculator", "tool_calls", "scratchpad")  # recipes whose built-in model ships besides the default config's


def builtin_name(cfg) -> str:
    return f"builtin-{cfg.task.name}-{cfg.model.builtin_size}-{builtin_key(cfg)}"


def find_builtin(cfg, use_shipped: bool = True) -> Path | None:
    """The folder of the built-in model for ``cfg`` when it exists: the shipped one when ``cfg`` is the config it
    was built from, else the cached one; None when it has not been built (:func:`postrl.train.builtin.ensure_builtin`
    builds it)."""
    shipped = SHIPPED / builtin_name(cfg)
    if use_shipped and (shipped / "config.json").is_file():
        return shipped
    target = cache_root() / builtin_name(cfg)
    return target if (target / "config.json").is_file() else None
