"""Tiny Hugging Face models and tokenizers built locally, with no download.

``build_tokenizer`` makes a character-level tokenizer with the ``tokenizers`` library and wraps it as a
``PreTrainedTokenizerFast`` (so ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` work on it).
``build_model`` makes a randomly initialised ``LlamaForCausalLM`` (a standard HF architecture) from a config.
``build_local`` writes both into a folder that ``from_pretrained`` loads like any downloaded model.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Characters every built-in task needs: digits, operators, letters for words, punctuation, space, newline.
DEFAULT_CHARS = (
    "0123456789+-*/=()[],.:;?!<>_'\" \n"
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)
SPECIAL = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}

SIZES = {
    # name: (hidden, layers, heads, intermediate)
    "nano": (64, 2, 4, 128),
    "tiny": (128, 4, 4, 384),
    "small": (256, 6, 8, 768),
    "medium": (512, 8, 8, 1536),
    "1m": (128, 4, 4, 480),  # 1.01M parameters (benchmarks)
    "20m": (512, 6, 8, 1536),  # 20.5M parameters (benchmarks)
}


def build_tokenizer(chars: str = DEFAULT_CHARS):
    """A character-level tokenizer: every character is one token; decoding concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL.values())}
    for ch in dict.fromkeys(chars):
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL["pad"],
        bos_token=SPECIAL["bos"],
        eos_token=SPECIAL["eos"],
        unk_token=SPECIAL["unk"],
        padding_side="left",
    )


def build_model(tokenizer, size: str = "tiny", seed: int = 0, max_positions: int = 512):
    """A randomly initialised LlamaForCausalLM sized by ``size`` (see ``SIZES``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in SIZES:
        raise ValueError(f"unknown tiny model size '{size}'; valid: {', '.join(SIZES)}")
    hidden, layers, heads, inter = SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_local(path: str | Path, size: str = "tiny", seed: int = 0):
    """Build a tiny model + tokenizer and ``save_pretrained`` both into ``path``; returns (model, tokenizer)."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, size=size, seed=seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer
