"""Held-out evaluation: greedy accuracy, unbiased pass@k, mean completion length."""

from __future__ import annotations

import math
from math import comb
from typing import Callable

from postrl.data import verify_row
from postrl.data.base import PromptSource
from postrl.models import encode_prompt, fit_prompts
from postrl.rollout.base import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n samples, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(backend, tokenizer, source: PromptSource, rows: list[dict], *, max_new_tokens: int, k: int = 4,
             temperature: float = 1.0, seed: int = 0, chat_template: str = "auto", stop: list[str] | None = None,
             reward: Callable[[list[str], list[str], list[dict]], list[float]] | None = None,
             max_prompt_length: int | None = None, prompt_overflow: str = "truncate") -> dict:
    """Greedy accuracy and mean length on ``rows``; with k > 1 also pass@1 and pass@k from k samples at
    ``temperature``. A completion is correct when the row's task verifier gives it 1.0. When no row has a
    verifier and ``reward(prompts, completions, rows)`` is given (the run's rewards), completions are scored by it
    instead: ``reward`` is its mean on the greedy completions and correct means the full reward (>= 1);
    ``scored_by`` says which was used ("verifier", "rewards", or "none": every completion then counts as wrong).
    A prompt over ``max_prompt_length`` tokens is cut to its last ones (``prompt_overflow='truncate'``) or its row
    left out (``'drop'``), as in training (``rollout.max_prompt_length``); their number is ``prompts_truncated`` /
    ``prompts_dropped``."""
    prompts, over = fit_prompts([encode_prompt(tokenizer, r["prompt"], chat_template) for r in rows],
                                max_prompt_length)
    if prompt_overflow == "drop":
        prompts = [p for p, o in zip(prompts, over) if not o]
        rows = [r for r, o in zip(rows, over) if not o]
    greedy = backend.generate(prompts, 1, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                         stop=list(stop or [])), seed)
    verified = [verify_row(t, r) for t, r in zip(greedy.texts, rows)]
    by_rewards = reward is not None and bool(rows) and all(v is None for v in verified)

    def score(texts: list[str], of_rows: list[dict], checked: list | None = None) -> list[float]:
        if by_rewards:
            return [float(x) if math.isfinite(x) else 0.0
                    for x in reward([r["prompt"] for r in of_rows], texts, of_rows)]
        return [float(v or 0.0) for v in (checked or [verify_row(t, r) for t, r in zip(texts, of_rows)])]

    scores = score(greedy.texts, rows, verified)
    out = {
        "scored_by": "rewards" if by_rewards else "verifier" if any(v is not None for v in verified) else "none",
        "accuracy": sum(s >= 1.0 for s in scores) / max(1, len(rows)),
        "mean_length": float(greedy.completion_mask.sum(-1).float().mean()),
        "truncated": float(greedy.truncated.float().mean()),
        "n": len(rows),
    }
    if max_prompt_length is not None:
        out["prompts_truncated" if prompt_overflow == "truncate" else "prompts_dropped"] = sum(over)
    if by_rewards:
        out["reward"] = sum(scores) / max(1, len(rows))
    if k > 1:
        gen = backend.generate(prompts, k, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                          stop=list(stop or [])), seed + 1)
        sampled = score(gen.texts, [r for r in rows for _ in range(k)])
        p1 = pk = 0.0
        for i in range(len(rows)):
            c = sum(x >= 1.0 for x in sampled[i * k:(i + 1) * k])
            p1 += pass_at_k(k, c, 1)
            pk += pass_at_k(k, c, k)
        out["pass@1"] = p1 / max(1, len(rows))
        out[f"pass@{k}"] = pk / max(1, len(rows))
    return out
