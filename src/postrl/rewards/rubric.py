"""Rubric-based reward (Chasing the Tail): a judge writes each prompt's rubric from great and excellent exemplars,
then grades every completion against it."""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from annotated_types import Ge, Gt

from postrl.errors import ConfigError
from postrl.registry import register
from postrl.rewards.judge import JudgeError, chat_function, parse_json_reply
from postrl.stages import StepEnd, Stateful

RUBRIC_SYSTEM = (
    "You write grading rubrics for responses to one prompt. The rubric must separate an excellent response from a "
    "merely great one: besides the basic requirements, include specific criteria that the best of the example "
    "responses meet and the good-but-not-best ones miss, and criteria that reward the different good ways to answer "
    "(the examples are diverse). Each criterion is one checkable statement about a response, with a weight (1 to 10:"
    " how much it matters). Reply with JSON only: "
    '{"criteria": [{"criterion": "<statement>", "weight": <number>}, ...]}'
)
RUBRIC_TEMPLATE = "Prompt:\n{prompt}\n\nReference answer (may be empty):\n{answer}\n\nExample responses:\n{exemplars}"
REFINE_TEMPLATE = (
    "Prompt:\n{prompt}\n\nCurrent rubric:\n{rubric}\n\nExample responses:\n{exemplars}\n\nCompare the best example "
    "responses with each other under the current rubric. Where the rubric cannot tell the excellent one from the "
    "great ones, add or sharpen criteria that do; drop criteria that every example meets equally. Reply with the "
    "whole refined rubric, in the same JSON form."
)
GRADE_SYSTEM = (
    "You grade a response against a rubric. For each criterion, in order, decide whether the response meets it. "
    'Reply with JSON only: {"verdicts": [true or false, ...]} (one entry per criterion, in the rubric\'s order).'
)
GRADE_TEMPLATE = "Prompt:\n{prompt}\n\nRubric:\n{rubric}\n\nResponse:\n{completion}"


def parse_rubric(reply: str) -> list[tuple[str, float]]:
    """[(criterion, weight)] of a judge's rubric reply ({"criteria": [{"criterion", "weight"}]} or a bare list);
    JudgeError when it is not such JSON, is empty, or a weight is not a positive number."""
    obj = parse_json_reply(reply)
    items = obj.get("criteria") if isinstance(obj, dict) else obj
    if not isinstance(items, list) or not items:
        raise JudgeError(f"rubric reply has no 'criteria' list: {reply[:60]!r}")
    out = []
    for it in items:
        text = it.get("criterion") if isinstance(it, dict) else it
        w = it.get("weight", 1.0) if isinstance(it, dict) else 1.0
        if not isinstance(text, str) or not text.strip():
            raise JudgeError(f"rubric criterion is not a text: {it!r}"[:100])
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            raise JudgeError(f"rubric weight is not a positive number: {it!r}"[:100])
        out.append((text.strip(), float(w)))
    return out


def parse_verdicts(reply: str, k: int) -> list[float]:
    """The k verdicts (each true/false, or a number in [0, 1]) of a grading reply; JudgeError otherwise."""
    obj = parse_json_reply(reply)
    v = obj.get("verdicts") if isinstance(obj, dict) else obj
    if not isinstance(v, list) or len(v) != k:
        raise JudgeError(f"grading reply has {len(v) if isinstance(v, list) else 'no'} verdicts for {k} criteria")
    out = []
    for x in v:
        if isinstance(x, bool):
            out.append(float(x))
        elif isinstance(x, (int, float)) and 0.0 <= x <= 1.0:
            out.append(float(x))
        else:
            raise JudgeError(f"verdict {x!r} is not true/false or a number in [0, 1]")
    return out


def format_rubric(rubric: list[tuple[str, float]]) -> str:
    return "\n".join(f"{i + 1}. (weight {w:g}) {c}" for i, (c, w) in enumerate(rubric))


def _exemplar_text(ex: Any) -> str:
    items = ex if isinstance(ex, (list, tuple)) else ([] if ex is None else [ex])
    return "\n\n".join(f"[{i + 1}]\n{e}" for i, e in enumerate(items)) or "(none)"


@register("reward", "rubric_judge", source="Chasing the Tail: Effective Rubric-based Reward Modeling for Large "
                                           "Language Model Post-Training")
class RubricJudge(Stateful):
    """A judge writes each prompt's rubric from great and excellent exemplars; r = the weighted share of it met.

    "Chasing the Tail" (the abstract: reward over-optimization comes from misspecification in the high-reward
    tail, "the inability to reliably distinguish Excellent responses from merely Great ones"; rubrics can use
    off-policy exemplars while staying insensitive to their artifacts; eliciting tail-capturing rubrics means
    "distinguishing among great and diverse responses"). After the paper, per prompt q:

        rubric(q) = the judge's criteria (c_k, w_k) written from q, its reference answer and the exemplars of q
                    (the row's ``exemplars`` column: a list of strong, diverse responses, e.g. from stronger models or
                    rewrites), then refined ``refine_rounds`` times (default 1): the judge compares the best
                    exemplars under the current rubric and adds criteria that separate excellent from great
        r_i = sum_k w_k v_ik / sum_k w_k in [0, 1],  v_ik in {0, 1} (or [0, 1]): the judge's verdict on c_k for o_i

    The judge is any function ``(system, user) -> reply text`` named by import path (``judge``, e.g. a local
    model), or an OpenAI-compatible endpoint (``base_url``, ``model``: :func:`postrl.rewards.judge.chat`). The
    prompts (``RUBRIC_SYSTEM``, ``REFINE_TEMPLATE``, ``GRADE_SYSTEM``) ask for JSON; a rubric that cannot be read
    fails the prompt's entries, an unreadable grade that entry (counted and excluded, never 0). The rubric is
    written once per prompt (keyed by the prompt, its answer and exemplars) and kept: a call uses the rubrics
    already kept and writes the missing ones (the same within a step, whatever the refill rounds);
    ``observe`` records a training batch's new rubrics and ``end_step`` keeps them, every process's, so a
    checkpoint holds them and a resumed run grades with the same rubrics. Assumed (the abstract gives the
    workflow, not the prompts): the prompts, weights 1 to 10, binary verdicts, one refinement round.
    """

    _state = ("rubrics",)

    def __init__(self, *, judge: str | None = None, base_url: str = "http://127.0.0.1:8000/v1", model: str = "judge",
                 refine_rounds: Annotated[int, Ge(0)] = 1, api_key_env: str = "OPENAI_API_KEY",
                 timeout: Annotated[float, Gt(0)] = 60.0, concurrency: Annotated[int, Ge(1)] = 8,
                 temperature: Annotated[float, Ge(0)] = 0.0, max_tokens: Annotated[int, Ge(1)] = 1024):
        self._chat_args = dict(base_url=base_url, model=model, what="rewards.judge", api_key_env=api_key_env,
                               timeout=timeout, temperature=temperature, max_tokens=max_tokens)
        self.judge_name = judge
        self.chat = chat_function(judge, **self._chat_args)
        self.refine_rounds, self.concurrency = refine_rounds, concurrency
        self.rubrics: dict[str, list] = {}  # key -> [[criterion, weight], ...] (kept across steps, checkpointed)
        self._new: dict[str, list] = {}  # written this step, not yet kept
        self._lock = threading.Lock()

    @staticmethod
    def key(prompt: str, answer: Any, exemplars: Any) -> str:
        return hashlib.blake2b(json.dumps([prompt, answer, exemplars], default=str).encode(),
                               digest_size=12).hexdigest()

    def write_rubric(self, prompt: str, answer: Any, exemplars: Any) -> list[tuple[str, float]]:
        """The judge's rubric for one prompt: written, then refined ``refine_rounds`` times."""
        ex = _exemplar_text(exemplars)
        ans = "" if answer is None else str(answer)
        rubric = parse_rubric(self.chat(RUBRIC_SYSTEM, RUBRIC_TEMPLATE.format(prompt=prompt, answer=ans,
                                                                              exemplars=ex)))
        for _ in range(self.refine_rounds):
            rubric = parse_rubric(self.chat(RUBRIC_SYSTEM, REFINE_TEMPLATE.format(
                prompt=prompt, rubric=format_rubric(rubric), exemplars=ex)))
        return rubric

    def _rubric(self, k: str) -> list | None:
        with self._lock:
            return self.rubrics.get(k) or self._new.get(k)

    def __call__(self, prompts, completions, answer=None, exemplars=None, **_):
        n = len(completions)
        answers = answer if answer is not None else [None] * n
        exs = exemplars if exemplars is not None else [None] * n
        keys = [self.key(p, a, e) for p, a, e in zip(prompts, answers, exs)]
        todo = {}
        for i, k in enumerate(keys):
            if self._rubric(k) is None and k not in todo:
                todo[k] = i
        failed: dict[str, Exception] = {}

        def write(k: str, i: int):
            try:
                rubric = self.write_rubric(prompts[i], answers[i], exs[i])
            except JudgeError as e:
                failed[k] = e
                return
            with self._lock:
                self._new[k] = [[c, w] for c, w in rubric]

        def grade(i: int):
            k = keys[i]
            if k in failed:
                return JudgeError(f"no rubric: {failed[k]}")
            rubric = self._rubric(k)
            try:
                v = parse_verdicts(self.chat(GRADE_SYSTEM, GRADE_TEMPLATE.format(
                    prompt=prompts[i], rubric=format_rubric(rubric), completion=completions[i])), len(rubric))
            except JudgeError as e:
                return e
            w = [float(x[1]) for x in rubric]
            return sum(wk * vk for wk, vk in zip(w, v)) / sum(w)

        if not completions:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, n))) as pool:
            list(pool.map(lambda kv: write(*kv), todo.items()))
            return list(pool.map(grade, range(n)))

    def observe(self, prompts, completions, columns=None) -> None:
        """Record the rubrics written for a batch that trains (kept at the end of the step)."""
        cols = columns or {}
        n = len(completions)
        answers = cols.get("answer") or [None] * n
        exs = cols.get("exemplars") or [None] * n
        with self._lock:
            for p, a, e in zip(prompts, answers, exs):
                k = self.key(p, a, e)
                if k in self._new:
                    self.record((k, self._new[k]))

    def end_step(self, step: StepEnd) -> dict:
        """Keep the rubrics written this step, every process's (the first written for a prompt wins)."""
        with self._lock:
            for k, rubric in self.observed:
                self.rubrics.setdefault(k, rubric)
            self._new = {}
        return {"rubrics": float(len(self.rubrics))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not isinstance(state.get("rubrics"), dict):
            raise ConfigError("rubric_judge: not a state_dict of this reward (a 'rubrics' mapping expected)")
        super().load_state_dict(state)

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d.pop("_lock", None)
        d.pop("chat", None)
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()
        self.chat = chat_function(self.judge_name, **self._chat_args)


__all__ = ["RubricJudge", "parse_rubric", "parse_verdicts", "format_rubric"]
