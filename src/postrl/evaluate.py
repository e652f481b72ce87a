"""Held-out evaluation: greedy accuracy, unbiased pass@k, mean completion length."""

from __future__ import annotations

from math import comb

from postrl.data import verify_row
from postrl.data.base import PromptSource
from postrl.models import encode_prompt
from postrl.rollout.base import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n samples, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(backend, tokenizer, source: PromptSource, rows: list[dict], *, max_new_tokens: int, k: int = 4,
             temperature: float = 1.0, seed: int = 0, chat_template: str = "auto", stop: list[str] | None = None) -> dict:
    """Greedy accuracy and mean length on ``rows``; with k > 1 also pass@1 and pass@k from k samples at
    ``temperature``. Rows without a verifier count as wrong."""
    prompts = [encode_prompt(tokenizer, r["prompt"], chat_template) for r in rows]
    greedy = backend.generate(prompts, 1, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                         stop=list(stop or [])), seed)
    scores = [float(verify_row(t, r) or 0.0) for t, r in zip(greedy.texts, rows)]
    out = {
        "accuracy": sum(s >= 1.0 for s in scores) / max(1, len(rows)),
        "mean_length": float(greedy.completion_mask.sum(-1).float().mean()),
        "truncated": float(greedy.truncated.float().mean()),
        "n": len(rows),
    }
    if k > 1:
        gen = backend.generate(prompts, k, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                          stop=list(stop or [])), seed + 1)
        p1 = pk = 0.0
        for i, r in enumerate(rows):
            c = sum(float(verify_row(gen.texts[i * k + j], r) or 0.0) >= 1.0 for j in range(k))
            p1 += pass_at_k(k, c, 1)
            pk += pass_at_k(k, c, k)
        out["pass@1"] = p1 / max(1, len(rows))
        out[f"pass@{k}"] = pk / max(1, len(rows))
    return out
