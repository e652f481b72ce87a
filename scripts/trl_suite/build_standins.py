"""Local stand-ins for the hub models TRL's GRPO tests load (trl-internal-testing/tiny-*), in an HF hub cache.

Each model: a config like TRL's tiny models (hidden 8, 2 layers, bf16), random weights, a byte-level tokenizer whose
special tokens are those of the real model's chat template (TRL's own jinja files, so TRL recognises the template).
Written under HF_HOME=./hf_home as hub snapshots, so from_pretrained finds them with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
HUB = ROOT / "hf_home" / "hub"
TEMPLATES = Path(__import__("trl").__file__).parent / "chat_templates"
COMMIT = "0" * 40


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer(template: str, specials: list[str], extra: list[str], roles: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    found = re.findall(r"<\|[A-Za-z0-9_]+\|>", template)
    special = list(dict.fromkeys([*specials, *found, *[v for v in roles.values() if v]]))
    out = PreTrainedTokenizerFast(tokenizer_object=tok, **{k: v for k, v in roles.items() if v})
    out.add_special_tokens({"additional_special_tokens": [s for s in special if s not in roles.values()]})
    out.add_tokens([e for e in extra if e not in special])
    out.chat_template = template
    return out


def save(repo: str, model, tok, gen_eos: list[str] | None = None, bos: str | None = None):
    from transformers import GenerationConfig

    folder = HUB / f"models--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    text = model.config.get_text_config()
    for role in ("bos", "eos", "pad"):
        setattr(text, f"{role}_token_id", getattr(tok, f"{role}_token_id"))
    model.save_pretrained(snap)
    tok.save_pretrained(snap)
    if hasattr(model, "generation_config") and model.can_generate():
        ids = [tok.convert_tokens_to_ids(t) for t in (gen_eos or [tok.eos_token])]
        GenerationConfig(eos_token_id=ids if len(ids) > 1 else ids[0], bos_token_id=tok.convert_tokens_to_ids(bos)
                         if bos else None, pad_token_id=tok.pad_token_id).save_pretrained(snap)
    print("built", repo)


def small(cfg_cls, **kw):
    base = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                intermediate_size=32)
    base.update(kw)
    return cfg_cls(**base)


def main(only: set[str] | None = None):
    import transformers as T

    torch.manual_seed(0)
    qwen_roles = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")
    qwen_extra = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
    jobs = {}

    def job(name):
        def deco(fn):
            jobs[name] = fn
            return fn
        return deco

    @job("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5")
    def _():
        tok = tokenizer((TEMPLATES / "qwen2_5.jinja").read_text(), [], qwen_extra, qwen_roles)
        m = T.Qwen2ForCausalLM(small(T.Qwen2Config, vocab_size=len(tok))).to(torch.bfloat16)
        save("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5", m, tok, ["<|im_end|>", "<|endoftext|>"],
             bos="<|endoftext|>")

    @job("trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5")
    def _():
        tok = tokenizer((TEMPLATES / "qwen2_5.jinja").read_text(), [], qwen_extra, qwen_roles)
        m = T.Qwen2ForSequenceClassification(small(T.Qwen2Config, vocab_size=len(tok), num_labels=1,
                                                   pad_token_id=tok.pad_token_id)).to(torch.bfloat16)
        save("trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5", m, tok)

    @job("trl-internal-testing/tiny-Qwen3ForCausalLM")
    def _():
        tok = tokenizer((TEMPLATES / "qwen3.jinja").read_text(), [], qwen_extra, qwen_roles)
        m = T.Qwen3ForCausalLM(small(T.Qwen3Config, vocab_size=len(tok), head_dim=8)).to(torch.bfloat16)
        save("trl-internal-testing/tiny-Qwen3ForCausalLM", m, tok, ["<|im_end|>", "<|endoftext|>"])

    @job("trl-internal-testing/tiny-Qwen3ForSequenceClassification")
    def _():
        tok = tokenizer((TEMPLATES / "qwen3.jinja").read_text(), [], qwen_extra, qwen_roles)
        m = T.Qwen3ForSequenceClassification(small(T.Qwen3Config, vocab_size=len(tok), head_dim=8, num_labels=1,
                                                   pad_token_id=tok.pad_token_id)).to(torch.bfloat16)
        save("trl-internal-testing/tiny-Qwen3ForSequenceClassification", m, tok)

    @job("trl-internal-testing/tiny-Qwen3MoeForCausalLM")
    def _():
        tok = tokenizer((TEMPLATES / "qwen3.jinja").read_text(), [], qwen_extra, qwen_roles)
        m = T.Qwen3MoeForCausalLM(small(T.Qwen3MoeConfig, vocab_size=len(tok), num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, head_dim=8, norm_topk_prob=True)).to(torch.bfloat16)
        save("trl-internal-testing/tiny-Qwen3MoeForCausalLM", m, tok, ["<|im_end|>", "<|endoftext|>"])

    llama_roles = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    llama_specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|eom_id|>",
                      "<|python_tag|>"]

    @job("trl-internal-testing/tiny-LlamaForSequenceClassification-3.2")
    def _():
        tok = tokenizer((TEMPLATES / "llama3_2.jinja").read_text(), llama_specials, [], llama_roles)
        m = T.LlamaForSequenceClassification(small(T.LlamaConfig, vocab_size=len(tok), num_labels=1)).to(
            torch.bfloat16)
        save("trl-internal-testing/tiny-LlamaForSequenceClassification-3.2", m, tok)

    @job("trl-internal-testing/tiny-Gemma2ForCausalLM")
    def _():
        roles = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
        tok = tokenizer((TEMPLATES / "gemma.jinja").read_text(), ["<start_of_turn>", "<end_of_turn>"], [], roles)
        m = T.Gemma2ForCausalLM(small(T.Gemma2Config, vocab_size=len(tok), head_dim=8,
                                      pad_token_id=tok.pad_token_id)).to(torch.bfloat16)
        save("trl-internal-testing/tiny-Gemma2ForCausalLM", m, tok, ["<eos>", "<end_of_turn>"], bos="<bos>")

    @job("trl-internal-testing/tiny-Cohere2ForCausalLM")
    def _():
        roles = dict(bos_token="<BOS_TOKEN>", eos_token="<|END_OF_TURN_TOKEN|>", pad_token="<PAD>")
        tok = tokenizer((TEMPLATES / "cohere2.jinja").read_text(), [], [], roles)
        m = T.Cohere2ForCausalLM(small(T.Cohere2Config, vocab_size=len(tok), head_dim=2,
                                       pad_token_id=tok.pad_token_id)).to(torch.bfloat16)
        save("trl-internal-testing/tiny-Cohere2ForCausalLM", m, tok, bos="<BOS_TOKEN>")

    @job("trl-internal-testing/tiny-GptOssForCausalLM")
    def _():
        roles = dict(bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>")
        tok = tokenizer((TEMPLATES / "gptoss.jinja").read_text(), [], [], roles)
        m = T.GptOssForCausalLM(small(T.GptOssConfig, vocab_size=len(tok), num_local_experts=4,
                                      num_experts_per_tok=2, head_dim=8)).to(torch.bfloat16)
        save("trl-internal-testing/tiny-GptOssForCausalLM", m, tok, ["<|return|>", "<|call|>"])

    @job("trl-internal-testing/tiny-Glm4MoeForCausalLM")
    def _():
        roles = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>")
        tok = tokenizer((TEMPLATES / "glm4moe.jinja").read_text(), ["[gMASK]", "<sop>"],
                        ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                         "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"], roles)
        m = T.Glm4MoeForCausalLM(small(T.Glm4MoeConfig, vocab_size=len(tok), n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=16, head_dim=8, first_k_dense_replace=1,
                                       n_group=1, topk_group=1)).to(torch.bfloat16)
        save("trl-internal-testing/tiny-Glm4MoeForCausalLM", m, tok, ["<|endoftext|>", "<|user|>", "<|observation|>"])

    for name, fn in jobs.items():
        if only and name not in only:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a stand-in that cannot be built: its tests fail on both sides
            print("FAILED", name, type(e).__name__, e)


if __name__ == "__main__":
    main(set(sys.argv[1:]) or None)
