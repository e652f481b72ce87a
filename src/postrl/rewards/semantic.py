"""Semantic similarity reward: the cosine similarity of a small encoder's embeddings of completion and reference."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import torch
from annotated_types import Ge

from postrl.errors import ConfigError
from postrl.io import load_once
from postrl.registry import register
from postrl.rewards.builtin import TagName
from postrl.rewards.text import tagged

def load_encoder(path: str, device: str = "cpu"):
    """(model, tokenizer) of the encoder folder ``path`` (``AutoModel`` / ``AutoTokenizer`` from a folder written
    by ``save_pretrained``, never downloaded), loaded once per process and reloaded when its config changes."""
    p = Path(path)
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"rewards.encoder '{path}': no config.json in it (expected a folder written by "
                          "save_pretrained, e.g. a small BERT-like encoder)")

    def build():
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        try:
            tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
            model = AutoModel.from_pretrained(p, local_files_only=True).to(device).eval()
        except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad folder
            raise ConfigError(f"rewards.encoder '{path}': cannot load an encoder and its tokenizer from it "
                              f"({type(e).__name__}: {str(e)[:120]})") from None
        tok.padding_side = "right"  # an encoder's absolute positions start at its first token
        return model, tok

    return load_once(cfg, build, "encoder", device)


@torch.no_grad()
def embed(texts: list[str], path: str, *, pooling: str = "mean", max_length: int = 512, batch_size: int = 32,
          device: str = "cpu") -> torch.Tensor:
    """Unit-norm embeddings [n, H] of ``texts``: the encoder's last hidden state pooled over the text's tokens
    (``mean`` over the attention mask, or ``cls``: the first token), at most ``max_length`` tokens per text; texts
    padded on the right, so a text's embedding does not depend on the others of its batch."""
    model, tok = load_encoder(path, device)
    out = []
    for s in range(0, len(texts), batch_size):
        enc = tok(texts[s:s + batch_size], padding=True, truncation=True, max_length=max_length,
                  return_tensors="pt")
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        m = mask.unsqueeze(-1).to(h.dtype)
        if pooling == "mean":
            v = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        else:  # the first token
            v = h[:, 0]
        out.append(torch.nn.functional.normalize(v, dim=-1).cpu())
    return torch.cat(out) if out else torch.zeros(0, 0)


@register("reward", "semantic_similarity", source="Shaping Explanations: Semantic Reward Modeling with Encoder-Only "
                                                  "Transformers for GRPO")
def semantic_similarity(prompts, completions, answer=None, *, encoder: str,
                        pooling: Literal["mean", "cls"] = "mean", tag: TagName | None = None,
                        max_length: Annotated[int, Ge(1)] = 512, batch_size: Annotated[int, Ge(1)] = 32,
                        device: str = "cpu"):
    """r = cos(E(completion), E(reference)) in [-1, 1], E a small encoder-only transformer's pooled embedding.

    "Shaping Explanations" (the abstract: a small, efficient encoder-only transformer as a semantic reward model,
    "a dense, semantically rich reward signal based on the cosine similarity between a generated explanation and
    a ground-truth reference"): E(x) = the encoder's last hidden state, mean-pooled over x's tokens (``pooling``
    'mean', default) or taken at the first token ('cls'), at most ``max_length`` (512) tokens. ``encoder``
    (required): a local folder with the encoder and its tokenizer (``save_pretrained`` of any ``AutoModel``, e.g.
    a sentence-embedding BERT); loaded once per process on ``device`` ('cpu'). The reference is the row's ``answer``
    column (None for a row without one); the completion's text is its last ``<tag>...</tag>`` block when ``tag`` is
    set (0.0 when absent), else the whole completion; an empty completion scores 0.0. Assumed (not in the
    abstract): the pooling, and that the raw cosine is the reward (a sentence encoder fine-tuned for similarity,
    as in the paper, makes it meaningful; a raw pretrained encoder gives high cosines to most pairs).
    """
    if answer is None:
        raise ValueError("semantic_similarity needs an 'answer' column (the reference text)")
    hyps = [tagged(c, tag) for c in completions]
    texts = list(dict.fromkeys([str(a) for a in answer if a is not None and str(a).strip()] +
                               [h for h in hyps if h]))
    vec = embed(texts, encoder, pooling=pooling, max_length=max_length, batch_size=batch_size, device=device)
    at = {t: vec[i] for i, t in enumerate(texts)}
    out: list = []
    for h, a in zip(hyps, answer):
        if a is None or not str(a).strip():
            out.append(None)
        elif not h:
            out.append(0.0)
        else:
            out.append(float(at[h] @ at[str(a)]))
    return out


__all__ = ["semantic_similarity", "embed", "load_encoder"]
