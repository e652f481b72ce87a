"""Prompt sources: where the prompts of a run come from.

A prompt source yields *rows*: dicts with at least ``prompt`` (str); every other key is a column that travels
with the completions to the reward functions (``answer``, ``task``, ``solution`` ...).

Determinism and resumption: ``train_rows(step, n, seed)`` is a pure function of its arguments, so the data
position of a run is its step and nothing else has to be saved. ``eval_rows`` never overlaps ``train_rows``.

Every source takes the prior-prompt options (:func:`prior_prompt`: ``system_prompt``, ``prompt_prefix``,
``prompt_suffix``, ``eval_prior``), which ``postrl.data.load_source`` applies to whatever source it builds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from postrl.generation import decorate_prompt


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


PRIOR_SOURCE = "Prior Prompt Engineering for Reinforcement Fine-Tuning"


class PriorPrompt(PromptSource):
    """A prompt source whose rows carry a prior prompt (instructions around every query); see :func:`prior_prompt`.

    Everything else (the rows' other columns, the held-out split, ``verify``, the source's own attributes) is the
    wrapped source's: ``source`` is it."""

    def __init__(self, source: PromptSource, *, system: str | None, prefix: str, suffix: str, at_eval: bool):
        self.source, self.system, self.prefix, self.suffix, self.at_eval = source, system, prefix, suffix, at_eval
        self.name = getattr(source, "name", "")

    def _decorate(self, rows: list[dict]) -> list[dict]:
        return [{**r, "prompt": decorate_prompt(r["prompt"], system=self.system, prefix=self.prefix,
                                                suffix=self.suffix)} for r in rows]

    def train_rows(self, step: int, n: int, seed: int) -> list[dict]:
        return self._decorate(self.source.train_rows(step, n, seed))

    def eval_rows(self, n: int, seed: int) -> list[dict]:
        rows = self.source.eval_rows(n, seed)
        return self._decorate(rows) if self.at_eval else rows

    def verify(self, completion: str, row: dict) -> float | None:
        return self.source.verify(completion, row)

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __getattr__(self, key: str) -> Any:  # the wrapped source's own attributes (label, dataset, ...)
        if key == "source":
            raise AttributeError(key)
        return getattr(self.source, key)


def prior_prompt(source: PromptSource, *, system_prompt: str | None = None, prompt_prefix: str = "",
                 prompt_suffix: str = "", eval_prior: bool = True) -> PromptSource:
    """``source`` with a prior prompt: instructions put around every query during training (task options).

    From "Prior Prompt Engineering for Reinforcement Fine-Tuning" (pPE): the prior prompt is "the instructions
    prepended to queries during training to elicit behaviors such as step-by-step reasoning" (its five pPE
    approaches: reasoning, planning, code-based reasoning, knowledge recall, null-example utilisation are five such
    texts); RFT then makes the model internalise the behaviour, so the models are evaluated on the plain query too.

    Every training row's prompt becomes ``decorate_prompt(prompt, system=system_prompt, prefix=prompt_prefix,
    suffix=prompt_suffix)`` (:func:`postrl.generation.decorate_prompt`): the query's text is ``prompt_prefix +
    query + prompt_suffix``; ``system_prompt`` adds a system message (the prompt becomes a conversation, which needs
    the tokenizer's chat template; ``prompt_prefix`` works with any model). ``eval_prior`` (default true): the
    held-out rows (``eval_rows``: the evaluations before, during and after training, ``postrl eval``) carry the
    prior prompt too; false: they are the plain queries, so the evaluation measures what the model internalised
    (``postrl eval RUN task.eval_prior=false`` compares both on one model). The held-out split, the rows' other
    columns and the verifier are the source's own (the prior prompt changes no answer). Assumed (the abstract gives
    no formula): a fixed text per run, the same for every row; no default text (the paper's five prompts are its
    experiments' choices, not part of the method). Without any option the source is returned unchanged."""
    if system_prompt is None and not prompt_prefix and not prompt_suffix:
        return source
    return PriorPrompt(source, system=system_prompt, prefix=prompt_prefix, suffix=prompt_suffix, at_eval=eval_prior)
