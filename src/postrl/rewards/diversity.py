"""Diversity rewards of one completion on its own: lexical diversity (MultiRole-R1).

The diversity of a completion relative to the others of its batch (DIVER) is a shaping stage,
``diversity_potential`` (:mod:`postrl.shaping.diversity`), since it pays through potential-based shaping.
"""

from __future__ import annotations

import re
from typing import Annotated

from annotated_types import Ge, MinLen

from postrl.registry import register

_WORD = re.compile(r"\w+", re.UNICODE)


def distinct_n(words: list[str], n: int) -> float:
    """|distinct word n-grams| / |word n-grams| (distinct-n); 0 when the text has no n-gram."""
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@register("reward", "lexical_diversity", source="Diversity-Enhanced Reasoning for Subjective Questions "
                                                "(MultiRole-R1, lexical diversity reward)")
def lexical_diversity(prompts, completions, *, orders: Annotated[list[Annotated[int, Ge(1)]], MinLen(1)] | None = None,
                      min_words: Annotated[int, Ge(0)] = 20, lowercase: bool = True):
    """Lexical-diversity bonus in [0, 1]: the mean distinct-n of the completion's words (short texts scaled down).

        r = min(1, L / min_words) * (1 / |orders|) sum_{n in orders} |distinct n-grams| / |n-grams|

    words = the completion's ``\\w+`` tokens (lower-cased by default), L their number; orders default [1, 2]
    (distinct-1 and distinct-2, the type-token ratio and its bigram version), min_words 20 (0: no length scale).
    After "Diversity-Enhanced Reasoning for Subjective Questions" (MultiRole-R1: GRPO with "diversity as a reward
    signal in addition to the verifiable reward", promoting "perspective diversity and lexical diversity"; the
    abstract gives no formula). Assumed: distinct-n as the lexical measure, and the length scale, without which
    a one-word completion would earn the full bonus (distinct-1 of one word is 1). Add it with a small weight
    beside the verifiable reward: ``rewards: [{name: correct}, {name: lexical_diversity, weight: 0.1}]``.
    """
    ns = [1, 2] if orders is None else list(orders)
    out = []
    for c in completions:
        words = _WORD.findall((c or "").lower() if lowercase else (c or ""))
        if not words:
            out.append(0.0)
            continue
        scale = min(1.0, len(words) / min_words) if min_words else 1.0
        out.append(scale * sum(distinct_n(words, n) for n in ns) / len(ns))
    return out


__all__ = ["lexical_diversity", "distinct_n"]
