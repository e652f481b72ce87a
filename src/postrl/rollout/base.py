"""The generation-backend interface.

A backend turns tokenised prompts into ``n`` sampled completions each, with the log-prob of every sampled
token. The CPU backend (:mod:`postrl.rollout.hf`) drives any HF causal LM with a KV cache; a vLLM backend
implements the same method on GPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters.

    ``logprobs`` are always of the temperature-scaled, *unfiltered* distribution (log_softmax(logits / T)), the
    convention TRL and verl use when they recompute old log-probs, so sampler and trainer log-probs agree.
    ``ignore_eos``: EOS does not end a completion (every completion runs to ``max_new_tokens`` unless a stop string
    ends it), as vLLM's ``ignore_eos`` and ``generate(eos_token_id=None)``: equal work per row, for benchmarks.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class Generation:
    """Rows are prompt-major: prompt i's j-th completion is row ``i * n + j``.

    prompt_ids [N, P] long, left-padded; prompt_mask [N, P] long;
    completion_ids [N, T] long, right-padded with pad_id; completion_mask [N, T] float (1 up to and including
    EOS or the token that completed a stop string); logprobs [N, T] float (0 where masked);
    truncated [N] bool (no EOS/stop within max_new_tokens); texts: decoded completions with the stop string
    and everything after it removed, special tokens skipped.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    truncated: torch.Tensor
    texts: list[str]


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
