"""The renormalised top-p / top-k log-prob, written out token by token: the reference the integrations' corrections
and ``postrl check-logprobs`` are tested against (independent of :func:`postrl.logprobs.filter_logits`)."""

from __future__ import annotations

import itertools

import torch


def renormalised_reference(scaled: torch.Tensor, ids: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """log q(ids): top-k (the logits at least the k-th largest, ties kept as HF's and vLLM's top-k keep them),
    then top-p over the top-k distribution (in descending order a token is kept while the mass before it is below
    top_p), the sampled token always kept, renormalised."""
    out = torch.empty(ids.shape)
    for idx in itertools.product(*map(range, ids.shape)):
        z = scaled[idx].double()
        order = torch.argsort(z, descending=True)
        keep = z >= z[order[top_k - 1]] if 0 < top_k < len(z) else torch.ones_like(z, dtype=torch.bool)
        p = torch.softmax(z.masked_fill(~keep, float("-inf")), -1)[order]
        before = torch.cumsum(p, 0) - p
        keep[order[(before >= top_p) | (p == 0)]] = False
        tok = ids[idx]
        keep[tok] = True
        out[idx] = float(z[tok] - torch.logsumexp(z[keep], 0))
    return out
