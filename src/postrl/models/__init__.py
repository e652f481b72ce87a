"""Loading models and tokenizers, prompt encoding, and per-token log-probs."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from postrl.errors import PostrlError

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


def encode_prompt(tokenizer, text: str | list[dict], chat_template: str = "auto") -> list[int]:
    """Token ids of a prompt: the tokenizer's chat template (one user turn, generation prompt) when it has one
    and ``chat_template='auto'``; the plain text otherwise. A conversation (a list of ``{role, content}``
    messages, TRL's conversational format) is rendered with the chat template, which it needs. SFT, RL and eval
    all encode prompts here."""
    has_template = chat_template == "auto" and getattr(tokenizer, "chat_template", None)
    if isinstance(text, list):
        if not has_template:
            why = "model.chat_template is none" if chat_template != "auto" else "the tokenizer has no chat template"
            raise PostrlError(f"a conversational prompt (a list of messages) needs a chat template, but {why}; "
                              "give the prompt as a string, or use a model whose tokenizer has a chat template")
        ids = tokenizer.apply_chat_template(text, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return _nonempty(list(ids), text)
    if has_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return _nonempty(list(ids), text)
    return _nonempty(list(tokenizer(text, add_special_tokens=True)["input_ids"]), text)


def _nonempty(ids: list[int], prompt) -> list[int]:
    """``ids``; a prompt with text that encodes to no token (generation needs one) is one error line."""
    if not ids and prompt:
        shown = repr(prompt) if len(repr(prompt)) <= 60 else repr(prompt)[:57] + "..."
        raise PostrlError(f"prompt {shown} encodes to no tokens; every prompt needs at least one token")
    return ids


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


def fit_prompts(prompts: list[list[int]], max_length: int | None) -> tuple[list[list[int]], list[bool]]:
    """``rollout.max_prompt_length``: (prompts, over): each prompt longer than ``max_length`` tokens cut to its last
    ``max_length`` tokens (left truncation, TRL's ``max_prompt_length``: the end of the prompt, with the chat
    template's generation prompt, is what the completion follows), and ``over[i]`` whether prompt i was. With
    ``rollout.prompt_overflow=drop`` the caller leaves the flagged ones out. ``max_length`` None: no limit."""
    over = [max_length is not None and len(p) > max_length for p in prompts]
    return [p[-max_length:] if o else p for p, o in zip(prompts, over)], over


def completion_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      completion_ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits [N, T, V] predicting each completion token: one forward of the model over [prompt;
    completion] per row (prompt_ids/prompt_mask [N, P] left-padded, completion_ids [N, T]); only the last T+1
    positions go through the LM head (``logits_to_keep``)."""
    T = completion_ids.shape[1]
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=T + 1, use_cache=False)
    return out.logits[:, :-1, :].float()


def filter_logits(scaled: torch.Tensor, top_p: float = 1.0, top_k: int = 0,
                  keep: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of temperature-scaled logits [..., V]: removed tokens get -inf.

    top-k keeps the tokens whose logit is at least the k-th largest (0 or k >= V: off); top-p keeps, in
    descending order of the top-k-filtered distribution, each token while the mass *before* it is below
    ``top_p`` (so the token crossing the threshold stays, and the most likely token always does; 1.0: off).
    ``keep`` [...] (token ids, one per leading position) is always kept: the trainer passes the sampled tokens, so
    a float difference at the threshold can never give a sampled token -inf. The sampler
    (:func:`postrl.rollout.hf._sample`) and :func:`completion_logprobs` use this one function.
    """
    filtered = scaled
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(filtered, top_k, dim=-1).values[..., -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        remove = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        remove[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        filtered = torch.empty_like(filtered).scatter_(-1, order, sorted_logits)
    if keep is not None and filtered is not scaled:
        idx = keep.unsqueeze(-1)
        filtered = filtered.scatter(-1, idx, scaled.gather(-1, idx))
    return filtered


def completion_logprobs(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                        temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                        return_logits: bool = False, logits: torch.Tensor | None = None, top_p: float = 1.0,
                        top_k: int = 0):
    """log pi(o_t | q, o_<t) for every completion token.

    prompt_ids/prompt_mask [N, P] left-padded; completion_ids [N, T]. Logits are divided by ``temperature``
    (the sampler's convention; 0 means greedy and is treated as 1). Returns (logp [N, T], entropy [N, T] or None),
    plus the temperature-scaled logits [N, T, V] when ``return_logits``. The entropy is a no-grad diagnostic
    unless ``entropy_grad`` (a loss term that differentiates it).

    ``top_p`` < 1 or ``top_k`` > 0 (``rollout.logprobs=filtered``): logp is of the renormalised filtered
    distribution the sampler draws from, logits masked by :func:`filter_logits` (the completion's own tokens always
    kept) before the log-softmax: logp_t = z_t - logsumexp_{v kept} z_v; the gradient flows through the kept
    logits only (the kept set itself is not differentiated). The entropy and the returned logits stay those of
    the unfiltered temperature-scaled distribution.

    ``logits``: the float32 logits [N, T, V] of :func:`completion_logits` computed by another path (the CPU speed
    layer's, :func:`postrl.accel.Accel.logprobs`); None runs :func:`completion_logits`.
    """
    if logits is None:
        logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids)
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    norm = logz
    if top_p < 1.0 or top_k > 0:
        with torch.no_grad():
            removed = torch.isinf(filter_logits(logits.detach(), top_p, top_k, keep=completion_ids))
        norm = torch.logsumexp(logits.masked_fill(removed, float("-inf")), dim=-1)
    logp = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - norm
    ent = None
    if with_entropy:
        with torch.no_grad() if not entropy_grad else nullcontext():
            p = torch.softmax(logits, dim=-1)
            ent = logz - (p * logits).sum(-1)
    return (logp, ent, logits) if return_logits else (logp, ent)


def cache_keyword(model) -> str | None:
    """The name under which ``model.forward`` takes a key/value cache: ``cache`` (transformers >= 5.24, which
    deprecates the old name) or ``past_key_values`` (earlier versions); None when it takes neither."""
    import inspect

    from postrl.models import lora

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


