"""Prompt sources: where the prompts of a run come from.

A prompt source yields *rows*: dicts with at least ``prompt`` (str); every other key is a column that travels
with the completions to the reward functions (``answer``, ``task``, ``solution`` ...).

Determinism and resumption: ``train_rows(step, n, seed)`` is a pure function of its arguments, so the data
position of a run is its step and nothing else has to be saved. ``eval_rows`` never overlaps ``train_rows``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod



class PromptSource(ABC):
    """Base class of tasks and file datasets."""

    name: str = ""

    @abstractmethod
    def train_rows(self, step: int, n: int, seed: int) -> list[dict]:
        """The ``n`` training rows of step ``step``; a pure function of (step, n, seed)."""

    @abstractmethod
    def eval_rows(self, n: int, seed: int) -> list[dict]:
        """Up to ``n`` held-out rows, disjoint from every ``train_rows`` result."""

    @staticmethod
    def verify(completion: str, row: dict) -> float | None:
        """Score ``completion`` for ``row`` (1.0 = correct); None when the source has no verifier."""
        return None
