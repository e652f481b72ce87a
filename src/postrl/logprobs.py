"""Per-token log-probs of completions under a causal LM: the one log-prob function of postrl.

Every path that needs log pi(o_t | q, o_<t) (the update, the reference and old-policy log-probs, the field
producers, the sampler's top-p / top-k filter) goes through :func:`completion_logprobs` (or, for the filter,
:func:`filter_logits`; from logits another program computed, :func:`filtered_token_logprobs`), usually through
:class:`postrl.context.ModelContext`. The CPU speed layer
(:mod:`postrl.accel`) computes the same logits faster and passes them in (``logits=``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


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
    logp, _ = filtered_token_logprobs(logits, completion_ids, top_p, top_k)
    ent = None
    if with_entropy:
        with torch.no_grad() if not entropy_grad else nullcontext():
            ent = logits_entropy(logits)
    return (logp, ent, logits) if return_logits else (logp, ent)


def logits_entropy(scaled: torch.Tensor) -> torch.Tensor:
    """Entropy [...] of the (unfiltered) distribution softmax(scaled) [..., V]: logsumexp(z) - sum_v p_v z_v."""
    return torch.logsumexp(scaled, dim=-1) - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)


def filtered_token_logprobs(scaled: torch.Tensor, ids: torch.Tensor, top_p: float = 1.0,
                            top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q(ids) [...], log M [...]) from temperature-scaled logits ``scaled`` [..., V] and token ids [...].

    q is the top-k / top-p filtered distribution renormalised over the kept set K (:func:`filter_logits`, the
    token ``ids`` always kept): log q_t = z_t - logsumexp_{v in K} z_v; differentiable through the kept logits
    (the kept set itself is not differentiated). log M_t = logsumexp_{v in K} z_v - logsumexp_v z_v <= 0 is the
    log of the unfiltered probability mass the filter kept (no gradient), so log q = log pi - log M. Without a
    filter (top_p 1, top_k 0): log q = log_softmax(z) at ``ids`` and log M = 0. Every path that renormalises
    (postrl's trainer, the TRL adapter, the verl plug-in, ``postrl check-logprobs``) goes through this function.
    """
    logz = torch.logsumexp(scaled, dim=-1)
    norm = logz
    if top_p < 1.0 or top_k > 0:
        with torch.no_grad():
            removed = torch.isinf(filter_logits(scaled.detach(), top_p, top_k, keep=ids))
        norm = torch.logsumexp(scaled.masked_fill(removed, float("-inf")), dim=-1)
    logp = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - norm
    return logp, (norm - logz).detach()
