"""Code reward sources: run each completion's program against its row's unit tests in the sandbox.

Every source here reads the ``tests`` column (one entry per row: a Python test source, a list of snippets, or
stdin/stdout or function-call cases; see :mod:`postrl.sandbox.testspec`), extracts the program from the
completion with :func:`extract_code`, and runs all completions of the batch in parallel on the shared
:class:`~postrl.sandbox.SandboxPool` (``os.cpu_count()`` workers). A row without tests scores None (the entry is
reported as failed, never read as 0). "No tests collected", a syntax error, an exit while loading, a killed
supervisor, an output flood or a forged success marker score 0: the harness, not the program, counts the tests.

Shared keyword parameters: ``timeout`` (wall seconds per program, all its tests together), ``memory_mb``,
``test_timeout`` (wall seconds per test; default none), ``isolation`` (``auto`` / ``bwrap`` / ``namespaces`` /
``fallback``; ``bwrap`` and ``namespaces`` refuse to run where they do not work). :func:`last_results` gives the
sandbox results (status, reason, per-test outcomes) of the latest call, for inspection.

The test code runs in a checker process, apart from the program, which answers it with plain data only (see
docs/sandbox.md): rebinding builtins, reaching the reporting code or returning objects that compare equal to
anything cannot turn a failing test into a pass.
"""

from __future__ import annotations

import ast
import contextlib
import re
import threading
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, Lt

from postrl.errors import ConfigError, DataError, PostrlError
from postrl.sandbox.errors import SandboxConfigError, SandboxDataError, SandboxError
from postrl.registry import register
from postrl.stages import StepEnd, Stateful
from postrl.sandbox import Limits, SandboxResult, default_pool
from postrl.sandbox.testspec import unit_keys

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_LAST: threading.local = threading.local()

# A run that breaks the sandbox (kills its supervisor, floods the output, crashes the harness) earns nothing, nor
# does a program that ends its own process, or hits the time or memory limit, before it has even loaded.
_ZERO_STATUSES = ("killed", "output_limit", "error")
_ZERO_LOAD = ("exit", "timeout", "memory", "killed")


@contextlib.contextmanager
def sandbox_errors():
    """Re-raise the code sandbox's own errors (:mod:`postrl.sandbox.errors`: the sandbox imports nothing of postrl)
    as these: ``SandboxConfigError`` as :class:`ConfigError`, ``SandboxDataError`` (a row's malformed ``tests``) as
    :class:`DataError`, any other ``SandboxError`` (the requested isolation does not work here) as
    :class:`PostrlError`; the message is kept."""
    try:
        yield
    except SandboxConfigError as e:
        raise ConfigError(str(e)) from None
    except SandboxDataError as e:
        raise DataError(str(e)) from None
    except SandboxError as e:
        raise PostrlError(str(e)) from None



def _hostile(r: SandboxResult) -> bool:
    return r.status in _ZERO_STATUSES or not r.total or r.stages.get("load_status") in _ZERO_LOAD


def extract_code(text: str) -> str:
    """The program in a completion: the last ```python (or ```py) fenced block; else the last fenced block of any
    language; else the whole text. An unclosed final fence (a truncated completion) runs to the end."""
    blocks = _FENCE.findall(text or "")
    if not blocks:
        return text or ""
    py = [body for lang, body in blocks if lang]
    return (py or [body for _, body in blocks])[-1]


def last_results() -> list[SandboxResult | None]:
    """Sandbox results of the latest code-reward call in this thread (None for rows without tests)."""
    return list(getattr(_LAST, "results", []))


Timeout = Annotated[float, Gt(0)]  # seconds
MemoryMB = Annotated[int, Ge(1)]
Isolation = Literal["auto", "bwrap", "namespaces", "fallback"] | None  # None: the sandbox's default (auto)
Weight = Annotated[float, Ge(0)]
Unit = Annotated[float, Ge(0), Le(1)]


def _limits(timeout: float, memory_mb: int, test_timeout: float | None) -> Limits:
    with sandbox_errors():
        return Limits(timeout=timeout, memory_mb=memory_mb, test_timeout=test_timeout)


def _check_isolation(isolation: str | None) -> None:
    if isolation not in (None, "auto", "bwrap", "namespaces", "fallback"):
        raise ConfigError(f"isolation '{isolation}': expected auto, bwrap, namespaces or fallback")


def run_completions(completions: list[str], tests: list | None, limits: Limits,
                    isolation: str | None = None) -> list[SandboxResult | None]:
    """Run every completion's extracted program against its row's tests, in parallel; None where no tests."""
    _check_isolation(isolation)
    n = len(completions)
    if tests is None:
        tests = [None] * n
    if len(tests) != n:
        raise ConfigError(f"tests column has {len(tests)} rows for {n} completions")
    with sandbox_errors():
        pool = default_pool()
        futs = [None if t is None else pool.submit(extract_code(c), t, limits=limits, mode=isolation)
                for c, t in zip(completions, tests)]
        results = [None if f is None else f.result() for f in futs]
    _LAST.results = results
    return results


@register("reward", "code_tests", source="unit-test pass rate in a sandbox (TRL/open-r1 code reward)",
          needs=("sandbox",))
def code_tests(prompts, completions, tests=None, *, timeout: Timeout = 10.0, memory_mb: MemoryMB = 512,
               test_timeout: Timeout | None = None, isolation: Isolation = None):
    """Fraction of the row's unit tests the completion's program passes in the sandbox.

    r_i = passed_i / total_i, total_i counted from the tests before the program runs (never by the program);
    0 when no test is collected, the program does not parse or load, or the run kills its supervisor / floods
    its output; None for a row without tests. Code: the last ```python block of the completion (else the text).
    Defaults: timeout 10 s per program, memory 512 MB, no per-test timeout.
    """
    limits = _limits(timeout, memory_mb, test_timeout)
    out = []
    for r in run_completions(completions, tests, limits, isolation):
        if r is None:
            out.append(None)
        elif _hostile(r):
            out.append(0.0)
        else:
            out.append(r.passed / r.total)
    return out


# ------------------------------------------------------------------------------------------------ reshaped


def lint_issues(code: str, *, max_line: int = 120) -> list[str]:
    """A small built-in lint (standard library only): unused imports, wildcard imports, bare ``except:``,
    mutable default arguments, ``== None``/``== True``-style comparisons, lines over ``max_line`` characters."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ["does not parse"]
    issues = []
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    exported = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            exported |= {e.value for e in ast.walk(n.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            if isinstance(n, ast.ImportFrom) and n.module == "__future__":
                continue
            for a in n.names:
                if a.name == "*":
                    issues.append(f"line {n.lineno}: wildcard import")
                    continue
                name = a.asname or a.name.split(".")[0]
                if name not in used and name not in exported:
                    issues.append(f"line {n.lineno}: unused import {name}")
        elif isinstance(n, ast.ExceptHandler) and n.type is None:
            issues.append(f"line {n.lineno}: bare except")
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in n.args.defaults + [d for d in n.args.kw_defaults if d is not None]:
                if isinstance(d, (ast.List, ast.Dict, ast.Set)):
                    issues.append(f"line {d.lineno}: mutable default argument")
        elif isinstance(n, ast.Compare):
            for op, right in zip(n.ops, n.comparators):
                if isinstance(op, (ast.Eq, ast.NotEq)) and isinstance(right, ast.Constant) and \
                        (right.value is None or right.value is True or right.value is False):
                    issues.append(f"line {n.lineno}: comparison to {right.value} with {type(op).__name__}")
    for i, line in enumerate(code.splitlines(), 1):
        if len(line) > max_line:
            issues.append(f"line {i}: longer than {max_line} characters")
    return issues


def reshaped_score(r: SandboxResult, code: str, *, w_parse: float, w_compile: float, w_run: float,
                   w_tests: float, w_lint: float) -> float:
    """The staged score of one sandbox result (see :func:`code_reshaped`)."""
    if _hostile(r):
        return 0.0
    st = r.stages
    P = 1.0 if st.get("parsed") else 0.0
    C = 1.0 if (st.get("loaded") if st.get("loaded") is not None else st.get("imports_ok")) else 0.0
    R = st.get("ran", 0) / r.total
    T = r.passed / r.total
    L = 1.0 / (1.0 + len(lint_issues(code))) if P else 0.0
    return w_parse * P + w_compile * P * C + w_run * C * R + w_tests * T + w_lint * P * L


@register("reward", "code_reshaped", source="Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair",
          needs=("sandbox",))
def code_reshaped(prompts, completions, tests=None, *, w_parse: Weight = 0.05, w_compile: Weight = 0.05,
                  w_run: Weight = 0.1, w_tests: Weight = 0.75, w_lint: Weight = 0.05, timeout: Timeout = 10.0,
                  memory_mb: MemoryMB = 512, test_timeout: Timeout | None = None, isolation: Isolation = None):
    """Staged partial credit for code: parses, loads, runs without error, passes tests, lints clean.

    After "Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair", whose outcome reward is layered:
    fail < compile-only < compile-and-semantic-correct ("binary rewards remove the compile-only middle tier").
    This reward is a finer staging of those tiers (the abstract gives no values): the compile tier is P and C (and
    R), the semantic tier the tests T; the lint term is postrl's, not the paper's (the summary in seed 000 read the
    paper as scoring readability and style, which it does not). The paper's two other parts are the advantage
    ``process_weighted`` (step-level process scores outside the group normalisation; ``code_repair`` gives each
    attempt's score as its process score) and the filter ``failure_governance``.

        r = w_parse * P + w_compile * P * C + w_run * C * R + w_tests * T + w_lint * P * L

    P = 1 if the program parses; C = 1 if it compiles and loads (its module runs to the end; for stdin/stdout
    programs: its top-level imports succeed); R = fraction of tests that ran to a verdict without raising or
    crashing (a wrong answer counts as ran); T = fraction of tests passed; L = 1 / (1 + lint issues) with the
    built-in :func:`lint_issues`. Each stage counts only when the one before it holds (P gates C and L, C gates R).
    Defaults w = (0.05, 0.05, 0.1, 0.75, 0.05) sum to 1, so a clean program passing every test scores 1.0.
    Assumed (not from the paper): the weights, the lint rules, and that a run with no test collected, that kills
    its supervisor, floods its output, or exits / times out / runs out of memory while loading scores 0 (limit
    abuse earns no partial credit). None for a row without tests.
    """
    ws = {"w_parse": w_parse, "w_compile": w_compile, "w_run": w_run, "w_tests": w_tests, "w_lint": w_lint}
    limits = _limits(timeout, memory_mb, test_timeout)
    results = run_completions(completions, tests, limits, isolation)
    return [None if r is None else reshaped_score(r, extract_code(c), **ws) for r, c in zip(results, completions)]


# ------------------------------------------------------------------------------------------------ VeRPO

@register("reward", "verrpo_weighted_tests",
          source="VeRPO: Verifiable Dense Reward Policy Optimization for Code Generation", needs=("sandbox",))
class VeRPOWeightedTests(Stateful):
    """Difficulty-weighted unit-test reward with an all-pass bonus; keeps per-test pass rates across steps.

    After "VeRPO: Verifiable Dense Reward Policy Optimization for Code Generation" (abstract: the dense reward is
    the sum of the weights of the passed tests, each weight estimated online from execution statistics, combined
    with the global execution outcome). For row i with tests j = 1..m (pass_ij in {0, 1}):

        w_j = max(min_weight, 1 - p_j)
        r_i = (1 - pass_bonus) * sum_j w_j pass_ij / sum_j w_j  +  pass_bonus * 1[all m tests pass]

    p_j is test j's running pass rate over every completion scored so far, this batch included (merged before
    weighting, so a test no completion passes gets the most weight at once; the merge is kept once per training
    step, in ``end_step``, with every batch the step scored): with ``momentum=None`` (default)
    p_j = (passes_j + prior_pass * prior_weight) / (attempts_j + prior_weight); with ``momentum=m`` an EMA
    p_j <- m p_j + (1 - m) * (this batch's pass rate of test j), starting from ``prior_pass``. Tests are keyed by a
    digest of the row's tests plus the test name, so the same problem met again keeps its statistics. Defaults:
    pass_bonus 0.5, prior_pass 0.5, prior_weight 1, min_weight 0.05. Assumed (not from the abstract): the
    normalisation by sum_j w_j (keeps r in [0, 1]; a fully correct program scores 1.0), the bonus mix, the prior
    and the floor. A row whose run failed in the sandbox itself (status error) scores None and is not counted.

    An instance is the reward (``r(prompts, completions, tests=...)``, built once per run by
    ``postrl.stages.build``); a call reads the statistics and never changes them (it remembers each completion's
    test outcomes); ``observe(completions, columns)`` records the outcomes of a batch that trains and ``end_step``
    merges every process's, once per step. ``state_dict()`` / ``load_state_dict()`` save and restore the
    statistics (plain JSON data).
    """

    def __init__(self, *, pass_bonus: Unit = 0.5, momentum: Annotated[float, Ge(0), Lt(1)] | None = None,
                 prior_pass: Unit = 0.5, prior_weight: Weight = 1.0, min_weight: Unit = 0.05, timeout: Timeout = 10.0,
                 memory_mb: MemoryMB = 512, test_timeout: Timeout | None = None, isolation: Isolation = None):
        self.pass_bonus, self.momentum = float(pass_bonus), momentum
        self.prior_pass, self.prior_weight, self.min_weight = float(prior_pass), float(prior_weight), float(min_weight)
        self.limits = _limits(timeout, memory_mb, test_timeout)
        self.isolation = isolation
        self.stats: dict[str, list[float]] = {}  # key -> [passes, attempts] (counts) or [rate, attempts] (EMA)
        self._outcomes: dict[tuple, tuple[list[str], list[int]]] = {}  # (completion, tests) -> (keys, passes)
        self._lock = threading.Lock()

    def observe(self, completions, columns) -> None:
        """Record the test outcomes of a batch that trains (as its call computed them)."""
        tests = columns.get("tests") or [None] * len(completions)
        outcomes: dict[str, list[int]] = {}
        with self._lock:
            for c, t in zip(completions, tests):
                row = self._outcomes.get((c, repr(t)))
                for k, p in zip(*row) if row is not None else ():
                    outcomes.setdefault(k, []).append(p)
        self.record(outcomes)

    def end_step(self, step: StepEnd) -> dict:
        """Merge the outcomes of every batch this step trained on, of every process, into the running statistics
        (once per step)."""
        with self._lock:
            for outcomes in self.observed:
                self._update(outcomes)
            self._outcomes = {}
        return {}

    def pass_rate(self, key: str) -> float:
        return self._rate(self.stats.get(key))

    def _rate(self, s: list[float] | None) -> float:
        if s is None:
            return self.prior_pass
        if self.momentum is None:
            return (s[0] + self.prior_pass * self.prior_weight) / (s[1] + self.prior_weight) if (
                s[1] + self.prior_weight) > 0 else self.prior_pass
        return s[0]

    def _update(self, outcomes: dict[str, list[int]], stats: dict | None = None) -> None:
        """Merge ``outcomes`` (per test key, its 0/1 results) into ``stats`` (default: the running statistics)."""
        stats = self.stats if stats is None else stats
        for key, vals in outcomes.items():
            s = stats.get(key)
            if self.momentum is None:
                s = s or [0.0, 0.0]
                s[0] += sum(vals)
                s[1] += len(vals)
            else:
                rate = sum(vals) / len(vals)
                prev, seen = (s[0], s[1]) if s else (self.prior_pass, 0.0)
                s = [self.momentum * prev + (1 - self.momentum) * rate, seen + len(vals)]
            stats[key] = s

    def __call__(self, prompts, completions, tests=None, **_):
        results = run_completions(completions, tests, self.limits, self.isolation)
        rows = []
        outcomes: dict[str, list[int]] = {}
        for r, t in zip(results, tests if tests is not None else [None] * len(completions)):
            if r is None or r.status == "error":
                rows.append(None)
                continue
            keys = _unit_keys(t)
            if _hostile(r) or len(r.tests) != len(keys):
                passes = [0] * len(keys)  # killed / flooded / no report: every test failed
            else:
                passes = [1 if x["status"] == "pass" else 0 for x in r.tests]
            rows.append((keys, passes))
            for k, p in zip(keys, passes):
                outcomes.setdefault(k, []).append(p)
        with self._lock:  # the statistics with this batch merged in (read only); end_step keeps the merge
            merged = {k: list(self.stats[k]) for k in outcomes if k in self.stats}
            self._update(outcomes, merged)
            rates = {k: self._rate(merged.get(k)) for k in outcomes}
            for c, t, row in zip(completions, tests if tests is not None else [None] * len(completions), rows):
                if row is not None:
                    self._outcomes[(c, repr(t))] = row
        out = []
        for row in rows:
            if row is None:
                out.append(None)
                continue
            keys, passes = row
            if not keys:
                out.append(0.0)
                continue
            w = [max(self.min_weight, 1.0 - rates[k]) for k in keys]
            dense = sum(wj * pj for wj, pj in zip(w, passes)) / sum(w)
            out.append((1 - self.pass_bonus) * dense + self.pass_bonus * float(all(passes)))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The running statistics and configuration, as plain JSON data."""
        with self._lock:
            return {"version": 1, "momentum": self.momentum, "prior_pass": self.prior_pass,
                    "prior_weight": self.prior_weight, "stats": {k: list(v) for k, v in self.stats.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != 1 or not isinstance(state.get("stats"), dict):
            raise ConfigError("verrpo_weighted_tests: not a state_dict of this reward (version 1 expected)")
        with self._lock:
            self.stats = {str(k): [float(v[0]), float(v[1])] for k, v in state["stats"].items()}

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d.pop("_lock", None)
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()


def _unit_keys(tests: Any) -> list[str]:
    with sandbox_errors():
        return unit_keys(tests)


__all__ = ["extract_code", "code_tests", "code_reshaped", "VeRPOWeightedTests", "lint_issues", "last_results",
           "run_completions"]
