"""Code repair: the model rewrites a buggy program; the row's tests run in the sandbox after every attempt, and the
test runner's report is the next observation."""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge, Gt

from postrl.environments import Environment
from postrl.rewards.code import code_reshaped, extract_code, reshaped_score, sandbox_errors
from postrl.registry import register
from postrl.sandbox import Limits, run


FAILURE_CAUSES = ("syntax", "compile", "runtime", "semantic", "timeout", "memory", "output_limit", "killed",
                  "no_tests")


def failure_cause(res) -> str | None:
    """Why an attempt failed, from its sandbox result (None when it passed every test): ``no_tests`` (the row's
    tests collect nothing: a data problem), ``syntax`` (does not parse), ``compile`` (does not load: an import
    error, an exit while loading), ``timeout`` / ``memory`` (a limit hit, while loading or running),
    ``output_limit`` / ``killed`` (the run broke the sandbox's rules), ``runtime`` (tests raised or crashed),
    ``semantic`` (every test ran to a verdict and some answers were wrong: compiles, not correct)."""
    st = res.stages or {}
    if res.total == 0:
        return "no_tests"
    if res.status == "ok" and res.passed == res.total:
        return None
    if st.get("parsed") is False:
        return "syntax"
    load = st.get("load_status")
    if load in ("timeout", "memory"):
        return load
    if st.get("loaded") is False or load in ("import", "exit", "syntax"):
        return "compile"
    if res.status in ("timeout", "memory", "output_limit", "killed"):
        return res.status
    return "runtime" if st.get("errors", 0) else "semantic"


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

    For "Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair" each step's ``info`` carries:
    ``process_score`` = s_k (the step-level process score the ``process_weighted`` advantage applies outside the
    group normalisation; the episode rollout collects them as ``turn_scores``) and ``failure_cause`` =
    :func:`failure_cause` of the attempt (None when solved; the rollout keeps the last one per episode as
    ``failure_cause``, which the ``failure_governance`` filter reads). Failure-cause-aware rollout control:
    an attempt that hits the wall-clock limit (``timeout``) is run again up to ``timeout_retries`` times (default
    0), so that a load spike of the machine, not the program, does not decide a comparison; the first run that
    does not time out counts. A sandbox that fails (status error) raises (the episode counts as an environment
    error: its reward is NaN and it is left out of its group).
    """

    observation_role = "user"

    def __init__(self, *, timeout: Annotated[float, Gt(0)] = 10.0, memory_mb: Annotated[int, Ge(1)] = 512,
                 reshaped: bool = True, feedback_format: str = "tests: {passed}/{total} passed; {reason}",
                 timeout_retries: Annotated[int, Ge(0)] = 0):
        self.timeout, self.memory_mb = timeout, memory_mb
        self.reshaped, self.feedback_format = reshaped, feedback_format
        self.timeout_retries = int(timeout_retries)
        self.row: dict = {}
        self.best = 0.0
        self.runs = 0  # sandbox runs of this episode (retries included)

    def reset(self, row: dict) -> str:
        if row.get("tests") is None:
            raise ValueError("code_repair: the row has no 'tests' column")
        self.row, self.best, self.runs = dict(row), 0.0, 0
        return str(row["prompt"])

    def _run(self, code: str):
        with sandbox_errors():
            res = run(code, self.row["tests"], limits=Limits(timeout=self.timeout, memory_mb=self.memory_mb))
        self.runs += 1
        if res.status == "error":
            raise RuntimeError(f"code_repair: the sandbox failed: {res.reason}")
        return res

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        code = extract_code(action)
        res = self._run(code)
        for _ in range(self.timeout_retries):
            if failure_cause(res) != "timeout":
                break
            res = self._run(code)
        solved = res.status == "ok" and res.total > 0 and res.passed == res.total
        weights = {k: v for k, v in code_reshaped.__kwdefaults__.items() if k.startswith("w_")}  # its defaults
        score = reshaped_score(res, code, **weights) if self.reshaped and res.total else float(solved)
        reward, self.best = max(score - self.best, 0.0), max(self.best, score)
        report = self.feedback_format.format(passed=res.passed, total=res.total, reason=res.reason or res.status)
        return report, reward, solved, {"process_score": score, "failure_cause": failure_cause(res)}
