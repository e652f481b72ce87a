"""Faster paths to the logits of :func:`postrl.models.completion_logits` for the update (the CPU speed layer).

:func:`fast_logits` returns the same float32 logits [N, T, V] predicting each completion token, computed

* by :func:`postrl.accel.fused.fused_completion_logits` (``accel.fused``) when it supports the model and prompt +
  completion hold at most ``FUSED_MAX_POSITIONS`` positions: the same function with a hand-written backward, fewer,
  larger operators. It shares each distinct prompt among its rows whenever ``groups`` has rows with the same prompt
  (``accel.share_prompt``): it has no second model call to pay for (1M model, 32 rows of 12 + 32 tokens: update
  35.1 vs 37.7 ms; 8 rows: no difference measured);
* else, with ``groups`` [N] (rows with the same id have the same prompt, as the completions of one prompt in a GRPO
  group do) and a model that takes a key/value cache, by sharing prompts through the model's own forward
  (``accel.share_prompt``): each distinct prompt goes through the model once, its keys and values are repeated for
  its rows, and the completions run on top of them. A prompt's positions do not see its completions (causal
  attention), so the logits are the same function of the weights up to float rounding, and autograd sums the rows'
  gradients into the shared prompt; the prompt work is divided by the group size. It is used when it saves enough
  tokens to pay for its second model call (``SHARE_MIN_SAVING``), on a CPU only (see ``_shared_prompts``). Rows
  whose prompts differ despite a shared id, a model with gradient checkpointing, or a model without a key/value
  cache take the one-forward path;
* else None: the caller runs the model's own forward (:func:`postrl.models.completion_logits`).
"""

from __future__ import annotations

import torch

from postrl.models import cache_keyword, output_cache


def fast_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                groups: torch.Tensor | None, fused: bool) -> torch.Tensor | None:
    """The float32 logits [N, T, V] by the fused function (``fused``) or by shared prompts (``groups`` given), where
    one of them applies (see the module docstring); None where neither does."""
    P, T = prompt_ids.shape[1], completion_ids.shape[1]
    if fused:
        from postrl.accel.fused import fused_completion_logits, supports

        if 0 < P and 0 < T and P + T <= FUSED_MAX_POSITIONS and supports(model):
            grouping = _prompt_groups(prompt_ids, groups) if groups is not None else None
            return fused_completion_logits(model, prompt_ids, prompt_mask, completion_ids, *(grouping or (None, None)))
    shared = _shared_prompts(model, prompt_ids, T, groups)
    return None if shared is None else _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, *shared)


# Share prompts only when that removes at least this fraction of the tokens of the one-forward path, for models of
# up to 2M parameters, and proportionally less for larger ones: the shared path runs the model twice and indexes
# its cache, a cost per layer that is worth more than a few tokens of a tiny model but little next to a token of a
# large one (measured on CPU, 8 rows of 12 + 32 tokens, 20% of the tokens saved: 1M parameters 6% slower, 20M
# parameters 1.28x faster; 56% saved at 0.9M: 2.5x faster).
SHARE_MIN_SAVING = 0.25
SHARE_FULL_PARAMS = 2e6

# The fused training forward (postrl.accel.fused) writes the attention out as products and a softmax over every
# (query, key) pair, read again in the backward; the model's own forward runs torch's fused attention kernel, which
# does not keep them. Measured on a 2-core Zen 5, 32 rows, 12-token prompts: the fused update 1.14x as fast at 140
# positions (1M model), 0.91x at 268 (1M) and 0.76x at 268 (20M). Above this many positions the model's own forward
# runs.
FUSED_MAX_POSITIONS = 192


def _min_saving(model) -> float:
    n = sum(p.numel() for p in model.parameters())
    return SHARE_MIN_SAVING * min(1.0, SHARE_FULL_PARAMS / max(n, 1))


def _shared_prompts(model, prompt_ids: torch.Tensor, T: int, groups: torch.Tensor | None):
    """(first row of each distinct prompt [U], each row's prompt index [N]) when sharing the prompt pays and the
    model supports it; else None."""
    if groups is None or len(groups) < 2 or prompt_ids.shape[1] == 0:
        return None
    if prompt_ids.device.type != "cpu":
        # Measured on an H100 (forward + backward, 32-64 rows, 1M-110M parameters, 25-75% of the tokens saved): the
        # shared path took 0.88-2.3x the time of the one forward, mostly more. On a GPU these models are bound by
        # kernel launches, which the second model call doubles, and the completions' attention over the repeated
        # prompt cache runs a masked kernel instead of the causal one. Not measured on larger models.
        return None
    N, P = prompt_ids.shape
    n_uniq = int(torch.unique(groups).numel())
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    if (N - n_uniq) * P < _min_saving(inner) * N * (P + T):
        return None
    checkpointing = getattr(inner, "is_activation_checkpointing", None)  # transformers >= 5.x name
    if checkpointing is None:
        checkpointing = getattr(inner, "is_gradient_checkpointing", False)
    if checkpointing or not _takes_cache(inner):
        return None
    return _prompt_groups(prompt_ids, groups)


def _prompt_groups(prompt_ids: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first row of each distinct group [U], each row's group index [N]) when some rows share a group and the rows
    of each group hold the same prompt; else None."""
    uniq, inverse = torch.unique(groups.cpu(), return_inverse=True)
    if len(uniq) == len(groups):
        return None
    first = torch.full((len(uniq),), len(groups), dtype=torch.long).scatter_reduce_(
        0, inverse, torch.arange(len(groups)), reduce="amin")
    inverse, first = inverse.to(prompt_ids.device), first.to(prompt_ids.device)
    if not torch.equal(prompt_ids[first][inverse], prompt_ids):
        return None
    return first, inverse


def _takes_cache(model) -> bool:
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return cache_keyword(model) is not None and "logits_to_keep" in params


def _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, first, inverse) -> torch.Tensor:
    """Float32 logits [N, T, V] predicting each completion token: distinct prompts once, completions on top of
    their prompt's repeated keys and values (see ``completion_logprobs``)."""
    from transformers import DynamicCache

    T = completion_ids.shape[1]
    p_mask = prompt_mask[first]
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    inner = getattr(model, "module", model)
    cache = DynamicCache(config=getattr(inner, "config", None))
    key = cache_keyword(inner)
    out = model(input_ids=prompt_ids[first], attention_mask=p_mask, position_ids=p_pos, **{key: cache},
                use_cache=True, logits_to_keep=1)
    first_logits = out.logits[:, -1:, :].float()[inverse]  # predicts each row's first completion token
    if T == 1:
        return first_logits
    cache = output_cache(out)
    cache.batch_select_indices(inverse)  # each row gets its prompt's keys/values (indexing: gradients sum back)
    attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    pos = prompt_mask.sum(-1, keepdim=True) + torch.arange(T, device=completion_ids.device)  # as the full path
    out = model(input_ids=completion_ids, attention_mask=attn, position_ids=pos, **{key: cache},
                use_cache=True, logits_to_keep=T)
    return torch.cat([first_logits, out.logits[:, :-1, :].float()], dim=1)
