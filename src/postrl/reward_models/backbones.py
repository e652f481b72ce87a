"""Backbones of reward models: any Hugging Face ``AutoModel`` from a local folder, or a tiny one built here.

``load_backbone(spec, seed)`` understands:

=====================  ===============================================================================
spec                   backbone
=====================  ===============================================================================
``path/to/folder``     ``AutoModel.from_pretrained(folder)`` + ``AutoTokenizer`` (a causal-LM checkpoint
                       loads as its base model, e.g. ``LlamaForCausalLM`` -> ``LlamaModel``)
``tiny:<size>``        a randomly initialised Llama of :data:`postrl.models.tiny.SIZES` (nano, tiny, ...)
                       with the character tokenizer (seeded by ``seed``)
``bag:<dim>``          :class:`BagOfTokensModel`, a bag-of-tokens encoder with ``dim``-wide embeddings and
                       the character tokenizer (seeded by ``seed``); fast, for tests and demonstrations
=====================  ===============================================================================

:class:`BagOfTokensModel` is a real ``PreTrainedModel`` (registered with ``AutoConfig``/``AutoModel`` under
``model_type = "postrl_bag"``), so a reward model built on it goes through exactly the code a Llama backbone
does: ``backbone(input_ids, attention_mask).last_hidden_state``, ``save_pretrained``, ``from_pretrained``.
Its hidden state at position t is ``[sum_{s<=t} E[x_s] / length_scale ; mean_{s<=t} E[x_s]]`` (masked), i.e.
token counts and token frequencies seen through a learned embedding ``E`` -- so a linear head on it can express
any linear function of counts (including length) and of frequencies.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from postrl.errors import PostrlError
from postrl.models.tiny import SIZES, build_model, build_tokenizer

__all__ = ["BagOfTokensConfig", "BagOfTokensModel", "load_backbone", "hidden_size"]


def _transformers_quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


try:  # keep the import cheap for the CLI: transformers is only needed once a backbone is built
    from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import BaseModelOutput
except ImportError:  # pragma: no cover - transformers is a hard dependency
    raise


class BagOfTokensConfig(PretrainedConfig):
    """Config of :class:`BagOfTokensModel`: ``vocab_size``, ``embed_dim`` (hidden_size = 2 * embed_dim),
    ``length_scale`` (counts are divided by it; default 16.0)."""

    model_type = "postrl_bag"

    def __init__(self, vocab_size: int = 128, embed_dim: int = 16, length_scale: float = 16.0,
                 pad_token_id: int | None = 0, **kwargs):
        self.vocab_size = vocab_size
        self.embed_dim = embed_dim
        self.length_scale = length_scale
        self.hidden_size = 2 * embed_dim
        super().__init__(pad_token_id=pad_token_id, **kwargs)


class BagOfTokensModel(PreTrainedModel):
    """h_t = [sum_{s<=t} m_s E[x_s] / length_scale ; sum_{s<=t} m_s E[x_s] / max(1, sum_{s<=t} m_s)].

    Shapes: input_ids / attention_mask [B, T] -> last_hidden_state [B, T, 2 * embed_dim]. Causal (position t sees
    tokens <= t), like a decoder's hidden states, so last-token pooling reads the whole sequence.
    """

    config_class = BagOfTokensConfig
    base_model_prefix = "bag"
    main_input_name = "input_ids"

    def __init__(self, config: BagOfTokensConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        self.post_init()

    def _init_weights(self, module):  # noqa: D401 - HF hook
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=1.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_) -> BaseModelOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        m = attention_mask.to(self.embed.weight.dtype).unsqueeze(-1)
        e = self.embed(input_ids) * m
        counts = e.cumsum(1)
        n = m.cumsum(1).clamp(min=1.0)
        h = torch.cat([counts / self.config.length_scale, counts / n], dim=-1)
        return BaseModelOutput(last_hidden_state=h)


AutoConfig.register("postrl_bag", BagOfTokensConfig, exist_ok=True)
AutoModel.register(BagOfTokensConfig, BagOfTokensModel, exist_ok=True)


def hidden_size(backbone) -> int:
    """Width of ``last_hidden_state`` (``config.hidden_size``; ``config.d_model`` / ``n_embd`` as fallbacks)."""
    cfg = backbone.config
    for key in ("hidden_size", "d_model", "n_embd", "dim"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    raise PostrlError(f"backbone {type(backbone).__name__}: cannot tell its hidden size from its config")


def load_backbone(spec: str | Path, seed: int = 0, lm_head: bool = False):
    """``(backbone, tokenizer)`` for ``spec`` (see the module docstring); the tokenizer gets a pad token.

    ``lm_head=True``: ``(backbone, tokenizer, head)`` with the causal LM's output layer (``lm_head``, logits =
    head(last_hidden_state)), for a text-generation loss beside the reward head (``rm train --lm-reg``); the folder
    must then hold a causal LM (``AutoModelForCausalLM``) and ``bag:<dim>`` is refused (it has no LM head)."""
    _transformers_quiet()
    spec_s = str(spec)
    if spec_s.startswith("tiny:"):
        size = spec_s.split(":", 1)[1]
        if size not in SIZES:
            raise PostrlError(f"backbone '{spec_s}': unknown tiny size '{size}'; valid: {', '.join(SIZES)}")
        tok = build_tokenizer()
        lm = build_model(tok, size=size, seed=seed)
        backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        return (backbone, _with_pad(tok), lm.get_output_embeddings()) if lm_head else (backbone, _with_pad(tok))
    if lm_head and spec_s.startswith("bag:"):
        raise PostrlError(f"backbone '{spec_s}': a bag-of-tokens encoder has no language-model head; --lm-reg needs "
                          f"a causal LM (a model folder or tiny:<size>)")
    if spec_s.startswith("bag:"):
        try:
            dim = int(spec_s.split(":", 1)[1])
        except ValueError:
            raise PostrlError(f"backbone '{spec_s}': expected bag:<embedding dim>, e.g. bag:16") from None
        tok = build_tokenizer()
        torch.manual_seed(seed)
        model = BagOfTokensModel(BagOfTokensConfig(vocab_size=len(tok), embed_dim=dim, pad_token_id=tok.pad_token_id))
        return model, _with_pad(tok)
    p = Path(spec_s)
    if not p.is_dir():
        raise PostrlError(f"backbone '{p}': no such folder (expected a folder written by save_pretrained, "
                          f"or tiny:<size> / bag:<dim>)")
    if not (p / "config.json").is_file():
        raise PostrlError(f"backbone '{p}': no config.json in it (expected a folder written by save_pretrained)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(p)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad folder
        raise PostrlError(f"backbone '{p}': cannot load a tokenizer from it ({type(e).__name__})") from None
    torch.manual_seed(seed)
    if lm_head:
        from transformers import AutoModelForCausalLM

        try:
            lm = AutoModelForCausalLM.from_pretrained(p)
        except Exception as e:  # noqa: BLE001
            raise PostrlError(f"backbone '{p}': --lm-reg needs a causal LM with its LM head, and "
                              f"AutoModelForCausalLM cannot load it ({type(e).__name__})") from None
        return lm.get_decoder(), _with_pad(tok), lm.get_output_embeddings()
    try:
        backbone = AutoModel.from_pretrained(p)
    except Exception as e:  # noqa: BLE001
        raise PostrlError(f"backbone '{p}': cannot load it with AutoModel ({type(e).__name__}: {e})") from None
    return backbone, _with_pad(tok)


def _with_pad(tok):
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
