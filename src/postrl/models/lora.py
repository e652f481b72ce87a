"""LoRA / QLoRA adapters through ``peft`` (``model.lora`` in the config, :class:`postrl.config.LoraConfig`).

* :func:`apply` wraps a loaded causal LM in a ``peft`` ``PeftModel`` with LoRA adapters (Hu et al. 2021, "LoRA:
  Low-Rank Adaptation of Large Language Models"): each target linear layer computes ``W x + (alpha / r) B A x``
  with ``W`` frozen, ``A`` [r, in] initialised like a linear layer and ``B`` [out, r] zero (so the policy starts as
  the base model). Only ``A`` and ``B`` require gradients; the trainer's optimizer steps those alone.
* The reference model of a KL term is the same module with its adapter disabled (``PeftModel.disable_adapter``):
  exactly the base model, with no second copy of the weights.
* :func:`quantization_config`: QLoRA (Dettmers et al. 2023), the base weights loaded in 4-bit NF4 with bf16
  compute by bitsandbytes, which needs a CUDA device.
* Saving: a checkpoint holds the adapter (``PeftModel.save_pretrained``: ``adapter_config.json`` +
  ``adapter_model.safetensors``; :func:`load_adapter_weights` restores it); the final model is the adapter, the
  merged model (:func:`save_merged`: ``W + (alpha / r) B A`` per layer, peft's ``merge_and_unload`` values, written
  by the base model's ``save_pretrained``), or both.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from postrl.errors import ConfigError, PostrlError

ADAPTER = "default"  # peft's name of the one adapter


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs the peft package: pip install 'postrl[lora]'") from None
    return peft


def enabled(lora_cfg: Any) -> bool:
    """Whether the config's ``model.lora`` section asks for adapters (a rank is given)."""
    return lora_cfg.r is not None


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` ``PeftModel`` (False without importing peft when nothing imported it)."""
    return "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel)


def quantization_config(lcfg: Any, device: torch.device):
    """The ``from_pretrained`` quantization config of ``model.lora.quantize`` (None for 'none'): 4-bit NF4 with
    double quantization and bf16 compute (the QLoRA paper's setting). A ConfigError off CUDA or without
    bitsandbytes."""
    if lcfg.quantize == "none":
        return None
    if device.type != "cuda":
        raise ConfigError(f"model.lora.quantize=4bit (QLoRA) needs a CUDA GPU and bitsandbytes; this run is on "
                          f"{device.type}: leave model.lora.quantize=none (LoRA on full-precision weights)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError("model.lora.quantize=4bit needs the bitsandbytes package: pip install bitsandbytes") \
            from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def apply(model, lcfg: Any, seed: int = 0):
    """``model`` wrapped with LoRA adapters as ``lcfg`` (:class:`postrl.config.LoraConfig`) says; the adapters'
    initial ``A`` drawn from ``seed`` (the global RNG is left as it was). A 4-bit model is prepared for k-bit
    training first (peft ``prepare_model_for_kbit_training``: norms in float32)."""
    peft = _peft()
    targets = lcfg.target_modules if isinstance(lcfg.target_modules, str) else list(lcfg.target_modules)
    config = peft.LoraConfig(r=lcfg.r, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM")
    if getattr(model, "is_loaded_in_4bit", False):
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        # peft asks transformers >= 5 for is_gradient_checkpointing, which warns that the name is deprecated
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        try:
            return peft.get_peft_model(model, config)
        except ValueError as e:  # e.g. target modules not found in the model
            raise ConfigError(f"model.lora.target_modules: {str(e).splitlines()[0]}") from None


def load_adapter_weights(model, path: Path) -> None:
    """Load the adapter weights of ``path`` (``adapter_model.safetensors``) into the PeftModel ``model``; a file
    that does not fit it is a PostrlError naming the checkpoint."""
    from safetensors.torch import load_file

    peft = _peft()
    if not is_lora(model):
        raise PostrlError(f"checkpoint {path.parent} holds LoRA adapters but the run has no model.lora.r")
    sd = load_file(str(path), device="cpu")
    want = set(peft.get_peft_model_state_dict(model).keys())
    if set(sd) != want:
        diff = sorted(set(sd) ^ want)
        raise PostrlError(f"checkpoint {path.parent}: its adapter does not fit this run's model.lora ({len(diff)} "
                          f"weights differ, e.g. {diff[0]})")
    out = peft.set_peft_model_state_dict(model, sd)
    if getattr(out, "unexpected_keys", None):
        raise PostrlError(f"checkpoint {path.parent}: unknown adapter weights, e.g. {out.unexpected_keys[0]}")


@torch.no_grad()
def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapted layer's weight replaced by ``W + delta`` (peft's
    ``get_delta_weight``: ``(alpha / r) B A``, what ``merge_and_unload`` writes), under the base model's own names;
    the live model is not changed."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    sd = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
    for name, mod in base.named_modules():
        if isinstance(mod, LoraLayer) and ADAPTER in mod.lora_A:
            w = mod.get_base_layer().weight
            sd[f"{name}.weight"] = w + mod.get_delta_weight(ADAPTER).to(w.dtype)
    return sd


def save_merged(model, directory: Path) -> None:
    """Write the merged model (:func:`merged_state_dict`) as a plain Hugging Face folder (``from_pretrained``)."""
    model.get_base_model().save_pretrained(str(directory), state_dict=merged_state_dict(model))
