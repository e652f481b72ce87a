"""Built-in reward sources (registered under ``reward``)."""

from __future__ import annotations

import re

from postrl.registry import register


@register("reward", "correct", source="task verifier (the row's task decides)")
def correct(prompts, completions, task=None, **columns):
    """1.0 when the row's task verifier accepts the completion, else 0.0 (None where a row has no verifier).

    The verifier is the ``verify`` of the prompt source registered under the row's ``task`` column.
    """
    from postrl.data import verify_row

    keys = list(columns)
    out = []
    for i, c in enumerate(completions):
        row = {k: columns[k][i] for k in keys}
        row["task"] = task[i] if task is not None else None
        out.append(verify_row(c, row))
    return out


@register("reward", "format", source="strict format check (regex full match)")
def format_reward(prompts, completions, *, pattern: str = r"\s*[-+]?\d+\s*", **_):
    """1.0 when the whole completion matches ``pattern`` (``re.fullmatch``, DOTALL), else 0.0.

    Default pattern: a single integer, optionally surrounded by whitespace (the built-in tasks' answer format).
    """
    rx = re.compile(pattern, re.DOTALL)
    return [1.0 if rx.fullmatch(c) else 0.0 for c in completions]
