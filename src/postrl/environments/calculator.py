"""The calculator-tool arithmetic task: multi-digit problems the model answers by calling ``calc``.

Rows come from a prompt source with an integer ``answer`` column (the ``arithmetic`` task: ``task: {name:
arithmetic, digits: 3, ops: '*'}``). The model calls ``<tool_call>calc("123*45")</tool_call>``, reads
``<result>5535</result>``, and answers with the integer; the answer turn scores 1.0 when it parses as the expected
integer (the ``arithmetic`` verifier), else 0.0.
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Annotated

from annotated_types import Ge, Gt, Le

from postrl.data.tasks import ArithmeticTask, Ops, digit_range, parse_int
from postrl.environments.tools import ToolEnvironment
from postrl.registry import register

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_MAX_LEN = 64


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("only integers, + - * // and parentheses")


def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers with + - * // and parentheses, e.g. 123*45
    """
    if len(expression) > _MAX_LEN:
        raise ValueError(f"expression longer than {_MAX_LEN} characters")
    return str(_eval(ast.parse(expression.strip(), mode="eval").body))


@register("environment", "calculator", source="issue 20: calculator-tool arithmetic (TRL tools= / verifiers ToolEnv)")
class CalculatorEnv(ToolEnvironment):
    """Arithmetic with a ``calc`` tool; the answer turn scores 1 when it is the row's ``answer`` integer, else 0.

    ``timeout``: seconds per tool call (5); ``max_calls``: tool calls per episode (4).
    """

    def __init__(self, *, timeout: Annotated[float, Gt(0)] = 5.0, max_calls: Annotated[int, Ge(0)] = 4):
        super().__init__([calc], timeout=timeout, max_calls=max_calls)

    def verify(self, answer: str, row: dict) -> float | None:
        value = parse_int(answer)
        try:
            expected = int(str(row["answer"]).strip())
        except (KeyError, ValueError):
            return None
        return 1.0 if value is not None and value == expected else 0.0


@register("task", "calculator", source="issue 20: calculator-tool arithmetic (demonstrations of tool use)",
          check=digit_range("calculator"))
class CalculatorTask(ArithmeticTask):
    """The ``arithmetic`` problems (``a<op>b=``, default 3-digit products) with demonstrations of tool use.

    ``solution`` (for the SFT warm start): ``<tool_call>calc("a<op>b")</tool_call><result>v</result>v``, the exact
    text of a calculator episode (the result is what the environment appends); a fraction ``direct`` of them answers
    at once with a number of the right length but wrong digits (a teacher that guesses), so a model warm-started on
    them calls the tool only part of the time and RL with the environment's reward can raise its success rate.
    ``verify`` reads the integer after the last ``</result>`` (the whole text when there is none).
    """

    name = "calculator"

    def __init__(self, *, digits: Annotated[int, Ge(1)] = 3, ops: Ops = "*", min_digits: Annotated[int, Ge(1)] = 2,
                 direct: Annotated[float, Ge(0), Le(1)] = 0.0):
        super().__init__(digits=digits, ops=ops, min_digits=min_digits)
        self.direct = float(direct)
        self.params["direct"] = self.direct

    def sample(self, rng: random.Random) -> dict:
        row = super().sample(rng)
        expr, answer = row["prompt"][:-1], row["answer"]
        if rng.random() < self.direct:
            guess = str(rng.randint(10 ** (len(answer.lstrip("-")) - 1), 10 ** len(answer.lstrip("-")) - 1))
            row["solution"] = guess if guess != answer else str(int(guess) + 1)
        else:
            row["solution"] = f'<tool_call>calc("{expr}")</tool_call><result>{answer}</result>{answer}'
        row["task"] = self.name
        return row

    @staticmethod
    def verify(completion: str, row: dict) -> float | None:
        return ArithmeticTask.verify(completion.rsplit("</result>", 1)[-1], row)
