"""The policy the trainer trains and the frozen models beside it: loaded, LoRA-wrapped, checkpointed as configured.

A frozen model of a run is one whose per-token log-probs of the batch's completions become a batch field that
stages read by name (:data:`FROZEN`): the reference (``ref_logp``: the initial policy, a KL or f-divergence to it)
and the teacher (``teacher_logp``: ``model.teacher.path``, on-policy distillation). The trainer computes a field
only when a configured stage reads it (``Objective.reads``), with the one log-prob function of the run."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

from postrl.errors import ConfigError, PostrlError
from postrl.models import enable_gradient_checkpointing, load_model_and_tokenizer, lora, prepare_tokenizer
from postrl.train.builtin import ensure_builtin

# the frozen models' per-token log-prob fields (what a stage reads) -> the batch attribute that holds them
FROZEN = {"ref_logp": "ref_logprobs", "teacher_logp": "teacher_logprobs"}


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


def frozen_model(path: str | Path, tokenizer: Any, device: Any, accel: Any, *, what: str,
                 policy_name: str = "the policy") -> Any:
    """The model folder ``path`` loaded frozen (float32, eval mode, no gradient, the speed layer's layers), after
    checking that it reads the policy's tokens: its tokenizer's vocabulary (token -> id) must be the policy's and
    its output must cover every id of it (a larger, padded embedding table is fine: Qwen2.5's sizes differ so).
    A folder without ``config.json`` or another vocabulary is a one-line :class:`ConfigError` naming ``what`` (the
    option) and the folder."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{what} {path}: not a model folder (no config.json)")
    model, tok = load_model_and_tokenizer(p, "float32")
    theirs = model.get_output_embeddings().weight.shape[0]
    vocab = tokenizer.get_vocab()
    if tok.get_vocab() != vocab or theirs < max(vocab.values(), default=-1) + 1:
        raise ConfigError(f"{what} {path}: another vocabulary ({len(tok)} tokens, {theirs} output rows) than "
                          f"{policy_name} ({len(tokenizer)} tokens); it must use the policy's tokenizer (its "
                          f"log-probs are read on the policy's token ids)")
    model.config.use_cache = False
    model.requires_grad_(False).eval().to(device)
    accel.apply(model)
    return model


def teacher_model(cfg: Any, tokenizer: Any, device: Any, accel: Any) -> Any:
    """The frozen teacher (``model.teacher.path``, :func:`frozen_model`), or None when no teacher is set."""
    path = cfg.model.teacher.path
    return None if path is None else frozen_model(path, tokenizer, device, accel, what="model.teacher.path")
