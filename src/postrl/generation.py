"""The generation interface: sampling parameters, a generation's result, the backend protocol, prompt encoding and
left padding.

A backend turns tokenised prompts into ``n`` sampled completions each, with the log-prob of every sampled
token. The CPU backend (:mod:`postrl.rollout.hf`) drives any HF causal LM with a KV cache; a vLLM backend
implements the same method on GPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from postrl.errors import PostrlError


@dataclass
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters.

    ``logprobs``: which distribution the returned log-probs are of.
    ``full`` (default): the temperature-scaled, *unfiltered* distribution (log_softmax(logits / T)), the
    convention TRL and verl use when they recompute old log-probs (vLLM ``logprobs_mode='raw_logprobs'`` after
    temperature). With top-p / top-k the tokens are drawn from the filtered distribution q = pi / M (M the kept
    mass), so the trainer's ratio pi_theta / pi_old omits the factor 1 / M of the true behaviour policy: each
    token's log-ratio is off by log M (the kept log-mass, ``Generation.kept_logmass``).
    ``filtered``: log-probs of the renormalised filtered distribution, log q = log pi - log M (vLLM
    ``processed_logprobs``); the trainer then computes the same filtered log-probs
    (:func:`postrl.models.completion_logprobs` with :meth:`logprob_filter`), so the policy being optimised is the
    one that samples. Greedy decoding (temperature 0) is unaffected.
    ``ignore_eos``: EOS does not end a completion (every completion runs to ``max_new_tokens`` unless a stop string
    ends it), as vLLM's ``ignore_eos`` and ``generate(eos_token_id=None)``: equal work per row, for benchmarks.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: str = "full"

    def __post_init__(self):
        if self.logprobs not in ("full", "filtered"):
            raise ValueError(f"rollout.logprobs: expected full or filtered, got {self.logprobs!r}")

    @property
    def filters(self) -> bool:
        """Tokens are drawn from a top-p / top-k filtered distribution."""
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0)

    def logprob_filter(self) -> dict:
        """The keyword arguments (``top_p``, ``top_k``) that make :func:`postrl.models.completion_logprobs` compute
        the log-probs this sampler returns: the filter with ``logprobs='filtered'``, none otherwise."""
        if self.logprobs == "filtered" and self.filters:
            return {"top_p": self.top_p, "top_k": self.top_k}
        return {}


@dataclass
class Generation:
    """Rows are prompt-major: prompt i's j-th completion is row ``i * n + j``.

    prompt_ids [N, P] long, left-padded; prompt_mask [N, P] long;
    completion_ids [N, T] long, right-padded with pad_id; completion_mask [N, T] float (1 up to and including
    EOS or the token that completed a stop string); logprobs [N, T] float (0 where masked; of the distribution
    ``SamplingParams.logprobs`` names); truncated [N] bool (no EOS/stop within max_new_tokens); texts: decoded
    completions with the stop string and everything after it removed, special tokens skipped;
    kept_logmass [N, T] float or None: log M_t, the log of the unfiltered probability mass the top-p / top-k filter
    kept at each sampled position (<= 0; 0 where masked), None when no filter applies.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    truncated: torch.Tensor
    texts: list[str]
    kept_logmass: torch.Tensor | None = None


class GenerationBackend(ABC):
    """Generates completions for already-tokenised prompts."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingParams,
                 seed: int | list[int]) -> Generation:
        """Sample ``n`` completions for each prompt; the same ``seed`` gives the same result.

        ``seed`` may be one int per prompt: then a prompt's samples depend only on its own seed, so the trainer
        gets the same rollouts whatever the number of processes the prompts are spread over."""

    def sync_weights(self, model: torch.nn.Module) -> None:  # pragma: no cover - trivial for in-process backends
        """Make the backend generate with ``model``'s current weights (a no-op when it shares the module)."""

    def close(self) -> None:  # pragma: no cover - trivial for in-process backends
        """Release what the backend holds besides the model (processes, servers); it may generate again later."""


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(ids, mask)``, both ``[len(seqs), max_len]`` long tensors.

    ``mask`` is 1 on real tokens and 0 on padding (which sits on the left).
    """
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        if len(seq):
            ids[i, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[i, width - len(seq) :] = 1
    return ids, mask


def decorate_prompt(prompt: str | list[dict], *, system: str | None = None, prefix: str = "",
                    suffix: str = "") -> str | list[dict]:
    """``prompt`` with instructions around it, as a prior prompt or a prompt template writes them.

    The query's text becomes ``prefix + query + suffix``: a string prompt's whole text, a conversation's last user
    message (a conversation without a user message gets them on its last message). ``system`` (None: none) makes
    the prompt a conversation that opens with a system message (a string prompt becomes ``[{system}, {user:
    text}]``, rendered with the tokenizer's chat template, which it then needs: ``encode_prompt`` says so); a
    conversation that already opens with a system message gets ``system + "\\n\\n"`` before that message's
    content. Returns a new object; ``prompt`` is not changed."""
    if isinstance(prompt, str):
        text = f"{prefix}{prompt}{suffix}"
        return text if system is None else [{"role": "system", "content": system}, {"role": "user", "content": text}]
    msgs = [dict(m) for m in prompt]
    if prefix or suffix:
        users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
        j = users[-1] if users else len(msgs) - 1
        msgs[j]["content"] = f"{prefix}{msgs[j]['content']}{suffix}"
    if system is not None:
        if msgs and msgs[0].get("role") == "system":
            msgs[0]["content"] = f"{system}\n\n{msgs[0]['content']}"
        else:
            msgs.insert(0, {"role": "system", "content": system})
    return msgs


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


def fit_prompts(prompts: list[list[int]], max_length: int | None) -> tuple[list[list[int]], list[bool]]:
    """``rollout.max_prompt_length``: (prompts, over): each prompt longer than ``max_length`` tokens cut to its last
    ``max_length`` tokens (left truncation, TRL's ``max_prompt_length``: the end of the prompt, with the chat
    template's generation prompt, is what the completion follows), and ``over[i]`` whether prompt i was. With
    ``rollout.prompt_overflow=drop`` the caller leaves the flagged ones out. ``max_length`` None: no limit."""
    over = [max_length is not None and len(p) > max_length for p in prompts]
    return [p[-max_length:] if o else p for p, o in zip(prompts, over)], over
