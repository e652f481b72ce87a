"""Helpers of the agent tests: a scripted generation backend and a model context on the built-in tokenizer."""

from __future__ import annotations

import torch

from postrl.context import ModelContext
from postrl.generation import Generation, SamplingParams


def scripted(tok, turns):
    """A backend that 'samples' ``turns[k]`` on its k-th call (a string for every row, or a list: one string per
    live episode, in order), honouring max_new_tokens and stop strings like HFGenerator; log-prob -0.5 per token."""
    state = {"k": 0}

    def generate(prompts, n, params, seeds):
        texts = turns[state["k"]]
        state["k"] += 1
        texts = [texts] * len(prompts) if isinstance(texts, str) else list(texts)[:len(prompts)]
        rows, ended = [], []
        for text in texts:
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            stop = next((s for s in params.stop if s in text), None)
            if stop is not None:
                ids = list(tok(text[:text.index(stop) + len(stop)], add_special_tokens=False)["input_ids"])
            done = stop is not None or (ids and ids[-1] == tok.eos_token_id)
            if len(ids) > params.max_new_tokens:
                ids, done = ids[:params.max_new_tokens], False
            rows.append(ids)
            ended.append(bool(done))
        W = max(len(r) for r in rows)
        t = torch.full((len(rows), W), tok.pad_token_id, dtype=torch.long)
        m = torch.zeros((len(rows), W))
        for i, r in enumerate(rows):
            t[i, :len(r)] = torch.tensor(r)
            m[i, :len(r)] = 1.0
        N = len(rows)
        return Generation(torch.zeros(N, 1, dtype=torch.long), torch.ones(N, 1, dtype=torch.long), t, m,
                          torch.full(t.shape, -0.5) * m, torch.tensor([not e for e in ended]),
                          [tok.decode(r, skip_special_tokens=True) for r in rows])

    return generate


def ctx_for(tok, generate, model=None, max_new=48):
    return ModelContext(model, tok, sampling=SamplingParams(max_new_tokens=max_new, temperature=1.0),
                        generate=generate, pad_id=tok.pad_token_id)
