"""The policy the trainer trains and its frozen reference: loaded, LoRA-wrapped, checkpointed as configured."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

from postrl.errors import PostrlError
from postrl.models import enable_gradient_checkpointing, load_model_and_tokenizer, lora, prepare_tokenizer
from postrl.train.builtin import ensure_builtin


def load_policy(cfg: Any, device: Any, log: Callable[[str], None], model: Any = None,
                tokenizer: Any = None) -> tuple[Any, Any, Path | None]:
    """(model, tokenizer, folder it was loaded from): ``cfg.model.path`` loaded in float32 (the master weights;
    bf16 is autocast in the update; ``builtin``: built first when missing, :mod:`postrl.train.builtin`), or the given
    ``model`` / ``tokenizer`` objects (folder None); no KV cache in
    training forwards, gradient checkpointing when ``train.gradient_checkpointing``, LoRA adapters on the frozen
    base when ``model.lora.r`` is set (QLoRA's 4-bit base on CUDA only: a ConfigError elsewhere)."""
    quant = lora.quantization_config(cfg.model.lora, device)
    path = None
    if model is None:
        # the built-in model: shipped or cached, built first when missing (train/builtin.py)
        path = ensure_builtin(cfg, log=log) if cfg.model.path == "builtin" else Path(cfg.model.path)
        model, tokenizer = load_model_and_tokenizer(path, "float32", quant)
    elif tokenizer is None:
        raise PostrlError("Trainer(model=...): give its tokenizer too (tokenizer=...)")
    else:
        prepare_tokenizer(tokenizer)
    model.config.use_cache = False
    if cfg.train.gradient_checkpointing:  # activations recomputed in the backward (the fused path then stands down)
        enable_gradient_checkpointing(model)
    if lora.enabled(cfg.model.lora):
        model = lora.apply(model, cfg.model.lora, seed=cfg.seed)
    return model, tokenizer, path


def reference_model(cfg: Any, model: Any, path: Path | None, device: Any, accel: Any) -> Any:
    """The frozen reference model: a second copy of the initial policy (loaded again from ``path``, or copied from
    a model object), with the speed layer's layers; None with LoRA, whose reference is the policy with its
    adapter disabled (the base weights, which LoRA never changes)."""
    if lora.enabled(cfg.model.lora):
        return None
    ref = copy.deepcopy(model) if path is None else load_model_and_tokenizer(path, "float32")[0]
    ref.requires_grad_(False).eval().to(device)
    accel.apply(ref)
    return ref
