"""Built-in procedural tasks with exact verifiers.

A procedural task generates problems from a seeded RNG, so there is no data file: ``train_rows(step, n, seed)``
samples from ``random.Random(stable_hash(name, params, seed, step))``. The held-out split is defined by the
problem itself: a row whose ``stable_hash(prompt) % 10 == 0`` is never used for training and is the only kind
``eval_rows`` returns, so train and eval never share a prompt whatever the seeds.

Prompts are short (the models of the small recipes are character-level): ``"47+385="`` and ``"3 5 7 -> 22:"``.
The completion is just the answer; the model then ends with EOS.
"""

from __future__ import annotations

import ast
import random
import re
from abc import abstractmethod
from collections import Counter
from typing import Annotated, Any

from annotated_types import Ge, Le
from pydantic import AfterValidator

from postrl.data.base import PromptSource
from postrl.seeding import stable_hash
from postrl.errors import ConfigError
from postrl.registry import register
from postrl.stages import parameters
from postrl import registry

HELD_OUT_MOD = 10
MAX_DIGITS = 1000  # arithmetic operands: a product has up to 2000 digits, within Python's int <-> str limit (4300)


def is_held_out(prompt: str) -> bool:
    """True for the ~10% of prompts that belong to the evaluation split of a procedural task."""
    return stable_hash(prompt) % HELD_OUT_MOD == 0


class ProceduralTask(PromptSource):
    """Shared train/eval logic of generated tasks: a subclass writes ``sample(rng)`` and ``verify``.

    ``params`` (set by the subclass) are the generator's settings; they enter the RNG seed so two tasks with
    different settings draw different streams.
    """

    name = ""
    params: dict[str, Any]
    # Attempts allowed per requested row before deciding the task's problem space is too small.
    _MAX_TRIES_PER_ROW = 1000
    # Consecutive eval draws without a new held-out prompt after which the held-out set counts as exhausted.
    _STALE_TRIES = 2000

    @abstractmethod
    def sample(self, rng: random.Random) -> dict:
        """One problem row (``prompt``, ``answer``, ``solution``, ``task`` ...) drawn from ``rng``."""

    def _key(self) -> tuple:
        return (self.name, tuple(sorted(self.params.items())))

    def train_rows(self, step: int, n: int, seed: int) -> list[dict]:
        rng = random.Random(stable_hash(*self._key(), seed, step))
        rows: list[dict] = []
        tries = 0
        while len(rows) < n:
            tries += 1
            if tries > self._MAX_TRIES_PER_ROW * (n + 1):
                raise ConfigError(f"task '{self.name}': {self.params} generates too few training problems")
            row = self.sample(rng)
            if not is_held_out(row["prompt"]):
                rows.append(row)
        return rows

    def eval_rows(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(stable_hash(*self._key(), seed, "eval"))
        rows: list[dict] = []
        seen: set[str] = set()
        stale = 0
        # A small problem space may hold fewer than n distinct held-out prompts: stop (and return what exists)
        # once _STALE_TRIES draws in a row brought nothing new. About 1 draw in 10 is held out.
        while len(rows) < n and stale < self._STALE_TRIES:
            stale += 1
            row = self.sample(rng)
            p = row["prompt"]
            if p not in seen and is_held_out(p):
                seen.add(p)
                rows.append(row)
                stale = 0
        return rows


# --------------------------------------------------------------------------------------------- arithmetic

_INT_RE = re.compile(r"[+-]?[0-9]+")


def parse_int(text: str) -> int | None:
    """``text`` stripped as an integer (optional sign, ASCII digits only), else None."""
    s = text.strip()
    if not _INT_RE.fullmatch(s):
        return None
    return int(s)


def _ops(ops: str) -> str:
    """a non-empty string of '+', '-', '*'"""
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"expected a non-empty string of '+', '-', '*', got {ops!r}")
    return ops


Ops = Annotated[str, AfterValidator(_ops)]


def digit_range(task: str) -> Any:
    """The registered check of an ``arithmetic``-like task (registered as ``task``): ``min_digits`` <= ``digits``,
    each defaulting to the task's own default."""

    def check(params: dict, run: Any, where: str) -> dict:
        p = {**{k: d for k, (_, d) in parameters(registry.get("task", task)).items()}, **params}
        if p["min_digits"] > p["digits"]:
            raise ConfigError(f"{where}.min_digits: expected a value <= digits ({p['digits']}), got {p['min_digits']}")
        return params

    return check


@register("task", "arithmetic", source="procedural (TinyStories-scale sanity task)", check=digit_range("arithmetic"))
class ArithmeticTask(ProceduralTask):
    """Integer arithmetic ``a<op>b=`` with operands of min_digits..digits digits; answer is the integer.

    ``chatty``: the fraction of demonstrations (the ``solution`` column, used by ``postrl sft``) that an imperfect,
    hedging teacher wrote as ``"N, I think"`` instead of the bare number the verifier accepts. The answer
    and the verifier do not change. A model warm-started on such demonstrations has a systematic format error
    that RL with the verifier can correct; the main job uses it (see README). Default 0: a perfect teacher.
    """

    name = "arithmetic"

    def __init__(self, *, digits: Annotated[int, Ge(1), Le(MAX_DIGITS)] = 2, ops: Ops = "+", min_digits: Annotated[int, Ge(1)] = 1,
                 chatty: Annotated[float, Ge(0), Le(1)] = 0.0):
        self.chatty = float(chatty)
        self.digits, self.min_digits = digits, min_digits
        self.ops = "".join(sorted(set(ops), key=ops.index))
        self.params = {"digits": digits, "ops": self.ops, "min_digits": min_digits}
        if self.chatty:  # only then part of the RNG key, so the problems of chatty=0 stay what they were
            self.params["chatty"] = self.chatty

    def _operand(self, rng: random.Random) -> int:
        k = rng.randint(self.min_digits, self.digits)
        lo = 0 if k == 1 else 10 ** (k - 1)
        return rng.randint(lo, 10**k - 1)

    def sample(self, rng: random.Random) -> dict:
        a, b = self._operand(rng), self._operand(rng)
        op = rng.choice(self.ops)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        answer = str(result)
        solution = f"{answer}, I think" if self.chatty and rng.random() < self.chatty else answer
        return {"prompt": f"{a}{op}{b}=", "answer": answer, "solution": solution, "task": self.name}

    @staticmethod
    def verify(completion: str, row: dict) -> float | None:
        value = parse_int(completion)
        try:
            expected = int(str(row["answer"]).strip())
        except (KeyError, ValueError):
            return None
        return 1.0 if value is not None and value == expected else 0.0


# --------------------------------------------------------------------------------------------- scratchpad

_ANSWER_MARK = "so "


def _scratchpad_check(params: dict, run: Any, where: str) -> dict:
    """``scratchpad``: the teacher's three behaviours are fractions of the demonstrations."""
    p = {**{k: d for k, (_, d) in parameters(ScratchpadTask).items()}, **params}
    if p["direct"] + p["verbose"] > 1:
        raise ConfigError(f"{where}.verbose: direct + verbose must be at most 1, got {p['direct']} + {p['verbose']}")
    return params


@register("task", "scratchpad", source="procedural reasoning testbed (issue 32): multi-step sums with a scratchpad",
          check=_scratchpad_check)
class ScratchpadTask(ProceduralTask):
    """Sum ``numbers`` integers, ``"23+7+4+8="``; a good solution writes the partial sums, then the answer.

    The answer (and the verifier) is the integer after the last ``"so "``: ``"23+7=30;30+4=34;34+8=42;so 42"``.
    The steps are ``;``-separated (``reward.step_delimiter: ";"``). The first number has 1..``digits`` digits, the
    others 1..``step_digits``. A small model cannot add four numbers at once but can add two, so the scratchpad is
    what makes a solution likely right: the task rewards longer reasoning, up to a point.

    The demonstrations (``solution``, for the SFT warm start) come from an imperfect teacher:

    - a fraction ``direct`` answers at once (``"so 42"``, the right answer): a model imitating it guesses;
    - a fraction ``verbose`` checks every partial sum by subtracting back (``"23+7=30;30-7=23;30+4=34;..."``):
      twice as long and no more often right, the padding a length penalty should remove;
    - the rest write the plain scratchpad;
    - in every scratchpad each partial sum is off by 1..3 with probability ``slip`` (carried on, so the answer is
      wrong): a warm start that writes partly wrong traces.

    Default (4 numbers, first up to 2 digits, others 1): plain trace 29 characters, verbose 50, direct 5.
    """

    name = "scratchpad"

    def __init__(self, *, numbers: Annotated[int, Ge(2), Le(12)] = 4, digits: Annotated[int, Ge(1), Le(6)] = 2,
                 step_digits: Annotated[int, Ge(1), Le(6)] = 1, direct: Annotated[float, Ge(0), Le(1)] = 0.0,
                 verbose: Annotated[float, Ge(0), Le(1)] = 0.0, slip: Annotated[float, Ge(0), Le(1)] = 0.0):
        self.numbers, self.digits, self.step_digits = numbers, digits, step_digits
        self.direct, self.verbose, self.slip = float(direct), float(verbose), float(slip)
        self.params = {"numbers": numbers, "digits": digits, "step_digits": step_digits, "direct": self.direct,
                       "verbose": self.verbose, "slip": self.slip}

    @staticmethod
    def _number(rng: random.Random, digits: int) -> int:
        k = rng.randint(1, digits)
        return rng.randint(1 if k == 1 else 10 ** (k - 1), 10 ** k - 1)

    def sample(self, rng: random.Random) -> dict:
        nums = [self._number(rng, self.digits)] + [self._number(rng, self.step_digits)
                                                   for _ in range(self.numbers - 1)]
        answer = str(sum(nums))
        style = rng.random()
        if style < self.direct:
            solution = f"{_ANSWER_MARK}{answer}"
        else:
            verbose = style < self.direct + self.verbose
            acc, steps = nums[0], []
            for x in nums[1:]:
                total = acc + x
                if self.slip and rng.random() < self.slip:
                    total += rng.choice((-1, 1)) * rng.randint(1, 3)
                steps.append(f"{acc}+{x}={total}")
                if verbose:
                    steps.append(f"{total}-{x}={acc}")
                acc = total
            solution = ";".join(steps) + f";{_ANSWER_MARK}{acc}"
        return {"prompt": "+".join(map(str, nums)) + "=", "answer": answer, "numbers": nums, "solution": solution,
                "task": self.name}

    @staticmethod
    def final_answer(completion: str) -> int | None:
        """The integer after the last ``"so "`` (None when there is none)."""
        if _ANSWER_MARK not in completion:
            return None
        return parse_int(completion.rsplit(_ANSWER_MARK, 1)[1])

    @staticmethod
    def verify(completion: str, row: dict) -> float | None:
        try:
            expected = int(str(row["answer"]).strip())
        except (KeyError, ValueError):
            return None
        value = ScratchpadTask.final_answer(completion)
        return 1.0 if value is not None and value == expected else 0.0


# --------------------------------------------------------------------------------------------- countdown

_PREC = {"+": 1, "-": 1, "*": 2}
_EXPR_CHARS = re.compile(r"[0-9+\-*() ]+")
_MAX_EXPR_LEN = 200


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _random_expr(rng: random.Random, nums: list[int]) -> tuple[str, int, int]:
    """A random expression tree over ``nums`` (each once), as (text, value, precedence of the top node)."""
    if len(nums) == 1:
        return str(nums[0]), nums[0], 3
    split = rng.randint(1, len(nums) - 1)
    left_s, left_v, left_p = _random_expr(rng, nums[:split])
    right_s, right_v, right_p = _random_expr(rng, nums[split:])
    op = rng.choice("+-*")
    p = _PREC[op]
    if left_p < p:
        left_s = f"({left_s})"
    # a-(b+c), a-(b-c) and a*(b+c) need parentheses; a+(b-c) and a*(b*c) do not.
    if right_p < p or (op == "-" and right_p == 1):
        right_s = f"({right_s})"
    return f"{left_s}{op}{right_s}", _apply(op, left_v, right_v), p


class _Unsafe(Exception):
    pass


def _eval_node(node: ast.AST, used: list[int]) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a = _eval_node(node.left, used)
        b = _eval_node(node.right, used)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        return a * b
    raise _Unsafe(type(node).__name__)


def eval_countdown_expr(text: str) -> tuple[int, list[int]] | None:
    """Value and numbers used of an expression of integers, + - * and parentheses; None if anything else.

    Parsed with ``ast`` and evaluated node by node: names, calls, attributes, unary signs, powers, divisions,
    non-decimal literals are all rejected, so nothing in the completion is ever executed.
    """
    s = text.strip()
    if not s or len(s) > _MAX_EXPR_LEN or not _EXPR_CHARS.fullmatch(s):
        return None
    try:
        tree = ast.parse(s, mode="eval")
        used: list[int] = []
        value = _eval_node(tree.body, used)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _Unsafe):
        return None
    return value, used


def _target_range(params: dict, run: Any, where: str) -> dict:
    """``countdown``: ``min_target`` <= ``max_target``."""
    p = {**{k: d for k, (_, d) in parameters(CountdownTask).items()}, **params}
    if p["min_target"] > p["max_target"]:
        raise ConfigError(f"{where}.max_target: expected a value >= min_target ({p['min_target']}), "
                          f"got {p['max_target']}")
    return params


@register("task", "countdown", source="Countdown numbers game (TinyZero, Pan et al. 2025)", check=_target_range)
class CountdownTask(ProceduralTask):
    """Reach the target with + - * and parentheses, each given number used at most once."""

    name = "countdown"
    _MAX_SAMPLE_TRIES = 10_000

    def __init__(self, *, numbers: Annotated[int, Ge(2)] = 3, max_number: Annotated[int, Ge(1)] = 9,
                 min_target: int = 1, max_target: int = 100):
        self.numbers, self.max_number = numbers, max_number
        self.min_target, self.max_target = min_target, max_target
        self.params = {"numbers": numbers, "max_number": max_number, "min_target": min_target, "max_target": max_target}

    def sample(self, rng: random.Random) -> dict:
        for _ in range(self._MAX_SAMPLE_TRIES):
            nums = [rng.randint(1, self.max_number) for _ in range(self.numbers)]
            k = rng.randint(2, self.numbers)
            chosen = rng.sample(nums, k)
            expr, value, _ = _random_expr(rng, chosen)
            # A target equal to a given number would be solved by copying it; draw again.
            if self.min_target <= value <= self.max_target and value not in nums:
                prompt = " ".join(map(str, nums)) + f" -> {value}:"
                return {
                    "prompt": prompt,
                    "answer": str(value),
                    "numbers": nums,
                    "target": value,
                    "solution": expr,
                    "task": self.name,
                }
        raise ConfigError(
            f"task 'countdown': no target in {self.min_target}..{self.max_target} reachable with "
            f"{self.numbers} numbers up to {self.max_number}"
        )

    @staticmethod
    def verify(completion: str, row: dict) -> float | None:
        try:
            numbers = [int(x) for x in row["numbers"]]
            target = int(row["target"])
        except (KeyError, TypeError, ValueError):
            return None
        parsed = eval_countdown_expr(completion)
        if parsed is None:
            return 0.0
        value, used = parsed
        if Counter(used) - Counter(numbers):  # some number used more often than given
            return 0.0
        return 1.0 if value == target else 0.0
