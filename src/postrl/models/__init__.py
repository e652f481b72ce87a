"""Loading models and tokenizers, prompt encoding, and per-token log-probs."""

from __future__ import annotations

from pathlib import Path

import torch

from postrl.errors import PostrlError
from postrl.models import lora

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_folder(path: str | Path, what: str = "model.path") -> Path:
    """``path`` when it is a model folder (``config.json`` in it); else one PostrlError line naming ``what``, the
    same whether ``postrl config show`` or ``postrl train`` checks it."""
    p = Path(path)
    expected = "expected a folder written by save_pretrained"
    if not p.exists():
        raise PostrlError(f"{what} '{p}': no such folder ({expected})")
    if not p.is_dir():
        raise PostrlError(f"{what} '{p}': a file, not a folder ({expected})")
    if not (p / "config.json").is_file():
        raise PostrlError(f"{what} '{p}': no config.json in it ({expected})")
    return p


def load_model_and_tokenizer(path: str | Path, dtype: str = "float32", quantization_config=None):
    """``AutoModelForCausalLM`` + ``AutoTokenizer`` from a local folder written by ``save_pretrained``
    (``quantization_config``: QLoRA's 4-bit base, :func:`postrl.models.lora.quantization_config`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    p = check_model_folder(path)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(p)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise PostrlError(f"model.path '{p}': cannot load a tokenizer from it ({type(e).__name__})") from None
    try:
        extra = {} if quantization_config is None else {  # 4-bit weights are placed on the GPU as they load
            "quantization_config": quantization_config, "device_map": {"": torch.cuda.current_device()}}
        model = AutoModelForCausalLM.from_pretrained(p, dtype=_DTYPES[dtype], **extra)
    except Exception as e:  # noqa: BLE001
        raise PostrlError(f"model.path '{p}': cannot load a causal LM from it ({type(e).__name__}: {e})") from None
    prepare_tokenizer(tokenizer)
    return model, tokenizer


def prepare_tokenizer(tokenizer) -> None:
    """Left padding for generation; a pad token (EOS when the tokenizer has none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def enable_gradient_checkpointing(model) -> None:
    """``train.gradient_checkpointing``: each decoder layer's activations are recomputed in the backward instead of
    kept (transformers ``gradient_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint``: the same
    log-probs and gradients, less memory, one more forward per layer; no input needs ``requires_grad``, so it works
    with frozen LoRA bases). transformers >= 5.24 renamed it ``activation_checkpointing_enable`` and warns on the
    old name, which every supported version has."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def cache_keyword(model) -> str | None:
    """The name under which ``model.forward`` takes a key/value cache: ``cache`` (transformers >= 5.24, which
    deprecates the old name) or ``past_key_values`` (earlier versions); None when it takes neither."""
    import inspect

    if lora.is_lora(model):  # a peft model's forward passes its **kwargs to the model it adapts
        model = model.get_base_model()
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def output_cache(out):
    """The key/value cache a forward returned, under either version's field name."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache


