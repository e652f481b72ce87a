"""Likelihood-based reward: the policy's log-probability of the reference answer after its own reasoning."""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge

from postrl.registry import register
from postrl.generation import encode_prompt
from postrl.logprobs import completion_logprobs


@register("reward", "likelihood", source="Likelihood-Based Reward Designs for General LLM Reasoning")
def likelihood(prompts, completions, answer=None, context=None, *, answer_marker: str | None = None,
               answer_prefix: str | None = None, reduce: Literal["sum", "mean"] = "sum",
               batch_size: Annotated[int, Ge(1)] = 16):
    """r_i = log p_policy(reference answer | prompt, reasoning_i) (reduce='sum', the paper's log-probability
    reward), or its mean per answer token (reduce='mean').

    reasoning_i = the completion cut just before the last occurrence of ``answer_marker`` (the whole completion
    when the marker is absent or not set), followed by ``answer_prefix`` (default: the marker itself, or nothing);
    the reference (the ``answer`` column) is tokenised on its own and appended; only its tokens are scored, with
    the prompt encoded as for generation (``model.chat_template``) and temperature 1. Needs the policy: the
    trainer passes a :class:`~postrl.rewards.core.RewardContext` (``context``); evaluated under no_grad in
    batches of ``batch_size``. Defaults: answer_marker=None, reduce='sum', batch_size=16. A missing or empty
    reference gives None. The reward is <= 0 and on the scale of log-probabilities: combine with care (weights).
    """
    if context is None or context.model is None:
        raise ValueError("likelihood needs the policy (a RewardContext from the trainer)")
    if answer is None:
        raise ValueError("likelihood needs an 'answer' column")
    tok, model = context.tokenizer, context.model
    prefix = answer_prefix if answer_prefix is not None else (answer_marker or "")
    items, out = [], [None] * len(completions)
    for i, (p, c, a) in enumerate(zip(prompts, completions, answer)):
        if a is None or not str(a).strip():
            continue
        reasoning = c
        if answer_marker:
            cut = c.rfind(answer_marker)
            if cut >= 0:
                reasoning = c[:cut]
        ctx = tok(reasoning + prefix, add_special_tokens=False)["input_ids"]
        ans = tok(str(a), add_special_tokens=False)["input_ids"]
        if not ans:
            continue
        items.append((i, encode_prompt(tok, p, context.chat_template), list(ctx), list(ans)))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    with torch.no_grad():
        for s in range(0, len(items), batch_size):
            chunk = items[s: s + batch_size]
            P = max(len(x[1]) for x in chunk)
            T = max(len(x[2]) + len(x[3]) for x in chunk)
            pids = torch.full((len(chunk), P), pad, dtype=torch.long)
            pmask = torch.zeros((len(chunk), P), dtype=torch.long)
            cids = torch.full((len(chunk), T), pad, dtype=torch.long)
            amask = torch.zeros((len(chunk), T), dtype=torch.float32)
            for r, (_, pi, ci, ai) in enumerate(chunk):
                pids[r, P - len(pi):] = torch.tensor(pi)
                pmask[r, P - len(pi):] = 1
                cids[r, : len(ci) + len(ai)] = torch.tensor(ci + ai)
                amask[r, len(ci): len(ci) + len(ai)] = 1.0
            dev = context.device
            logp, _ = completion_logprobs(model, pids.to(dev), pmask.to(dev), cids.to(dev), 1.0)
            tot = (logp.float().cpu() * amask).sum(-1)
            if reduce == "mean":
                tot = tot / amask.sum(-1)
            for r, (i, *_rest) in enumerate(chunk):
                out[i] = float(tot[r])
    return out
