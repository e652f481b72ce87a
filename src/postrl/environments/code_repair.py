"""Code repair: the model rewrites a buggy program; the row's tests run in the sandbox after every attempt, and the
test runner's report is the next observation."""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge, Gt

from postrl.environments import Environment
from postrl.rewards.code import sandbox_errors
from postrl.registry import register


@register("environment", "code_repair", source="Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair",
          needs=("sandbox",))
class CodeRepairEnv(Environment):
    """Repair the row's program against its ``tests`` (sandbox); feedback from the test runner each turn.

    Each model turn is an attempt: its program (``postrl.rewards.code.extract_code``: the last fenced block, else
    the text) runs against the row's ``tests`` (any form of :mod:`postrl.sandbox.testspec`) in
    :func:`postrl.sandbox.run` with ``timeout`` seconds and ``memory_mb``. The attempt's score s_k is the weak-feedback
    reshaped score (``postrl.rewards.code.reshaped_score``, the ``code_reshaped`` reward: parses, loads, runs,
    fraction of tests passed, lint; 1.0 for a clean program passing every test) when ``reshaped`` (default), else
    1[every test passed]. The turn's reward is the improvement r_k = s_k - max_{j<k} s_j (0 before any attempt) when
    positive, else 0, so an episode's rewards sum to its best attempt's score and a turn is credited with the
    progress it made. The episode ends when every test passes; otherwise the observation is the runner's report:
    ``tests: p/n passed; <first failure>`` (``feedback_format``).
    """

    observation_role = "user"

    def __init__(self, *, timeout: Annotated[float, Gt(0)] = 10.0, memory_mb: Annotated[int, Ge(1)] = 512,
                 reshaped: bool = True, feedback_format: str = "tests: {passed}/{total} passed; {reason}"):
        self.timeout, self.memory_mb = timeout, memory_mb
        self.reshaped, self.feedback_format = reshaped, feedback_format
        self.row: dict = {}
        self.best = 0.0

    def reset(self, row: dict) -> str:
        if row.get("tests") is None:
            raise ValueError("code_repair: the row has no 'tests' column")
        self.row, self.best = dict(row), 0.0
        return str(row["prompt"])

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        from postrl.rewards.code import code_reshaped, extract_code, reshaped_score
        from postrl.sandbox import Limits, run

        code = extract_code(action)
        with sandbox_errors():
            res = run(code, self.row["tests"], limits=Limits(timeout=self.timeout, memory_mb=self.memory_mb))
        if res.status == "error":
            raise RuntimeError(f"code_repair: the sandbox failed: {res.reason}")
        solved = res.status == "ok" and res.total > 0 and res.passed == res.total
        weights = {k: v for k, v in code_reshaped.__kwdefaults__.items() if k.startswith("w_")}  # its defaults
        score = reshaped_score(res, code, **weights) if self.reshaped and res.total else float(solved)
        reward, self.best = max(score - self.best, 0.0), max(self.best, score)
        report = self.feedback_format.format(passed=res.passed, total=res.total, reason=res.reason or res.status)
        return report, reward, solved, {}
