"""Result interpretation: the host turns the harness's report (or its absence) into a :class:`SandboxResult`."""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass, field

from postrl.sandbox.limits import Limits

STATUSES = ("ok", "failed", "timeout", "memory", "output_limit", "killed", "error")
_SEVERITY = ("output_limit", "timeout", "memory", "killed", "error", "fail", "pass")


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    ``status``: ok / failed / timeout / memory / output_limit / killed / error (see :func:`postrl.sandbox.run`).
    ``passed`` / ``total``: tests (0 / 0 for a plain run). ``tests``: per test ``{name, status, reason}``.
    ``reason``: one line saying why, for anything but a clean pass. ``stages``: ``parsed`` / ``loaded`` (the
    program's module ran to the end) / ``imports_ok`` / ``errors`` (tests that raised or crashed, as opposed to wrong
    answers) / ``ran`` (tests that reached a verdict) / ``load_status`` (why loading failed: syntax, import, exit,
    memory, timeout, killed), used by staged rewards.
    """

    status: str
    exit_code: int | None = None
    passed: int = 0
    total: int = 0
    stdout: str = ""
    stderr: str = ""
    time: float = 0.0
    reason: str = ""
    tests: list = field(default_factory=list)
    truncated: bool = False
    mode: str = ""
    stages: dict = field(default_factory=dict)
    uid: int | None = None

    @property
    def fraction(self) -> float:
        """passed / total; 0.0 when no test was collected."""
        return self.passed / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("uid")
        d["time"] = round(self.time, 4)
        return d


def parses(code: str) -> bool:
    try:
        compile(code, "solution.py", "exec", dont_inherit=True)
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False


def not_run(code: str, units: list, mode: str, elapsed: float) -> SandboxResult | None:
    """The result of a run that needs no sandbox: no test collected (never a pass), or a program that does not
    compile (every test fails); None when the program must run."""
    if not units:
        return SandboxResult(status="failed", exit_code=1, reason="no tests collected: 0/0 is not a pass", mode=mode,
                             time=elapsed, stages={"parsed": parses(code), "loaded": None, "imports_ok": None,
                                                   "errors": 0, "ran": 0, "load_status": None})
    try:
        compile(code, "solution.py", "exec", dont_inherit=True)
        return None
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        n = len(units)
        return SandboxResult(status="failed", exit_code=1, total=n, mode=mode, time=elapsed,
                             reason=f"0/{n} tests: syntax error: {type(e).__name__}: {e}",
                             tests=[{"name": u["name"], "status": "error", "reason": "syntax error"} for u in units],
                             stages={"parsed": False, "loaded": False, "imports_ok": False, "errors": n, "ran": 0,
                                     "load_status": "syntax"})


def interpret(res: SandboxResult, report: dict | None, mode: str, units: list, limits: Limits,
              returncode: int | None, timed_out: bool, overflow: str | None, oom_kills: int) -> None:
    """Fill ``res`` (status, exit code, tests, reason, stages) from the harness's ``report`` (None when there was
    none with the run's nonce) and what the host saw: the top process's ``returncode``, the wall-time limit,
    an ``overflow`` ("stdout" / "stderr" / "disk") and the cgroup's OOM kills."""
    _interpret(res, report, mode, units, limits, returncode, timed_out, overflow)
    if oom_kills:
        res.status = "memory"
        res.reason = (f"memory limit of {limits.memory_mb} MB for the whole program exceeded (the kernel killed "
                      f"{oom_kills} process{'es' if oom_kills > 1 else ''})" + (f"; {res.reason}" if res.reason
                                                                               else ""))


def _interpret(res: SandboxResult, report: dict | None, mode: str, units: list, limits: Limits,
               returncode: int | None, timed_out: bool, overflow: str | None) -> None:
    tests = []
    if report is not None and mode != "run":
        got = report.get("tests")
        if isinstance(got, list) and len(got) == len(units):
            tests = [{"name": u["name"], "status": str(t.get("status")), "reason": str(t.get("reason", ""))}
                     for u, t in zip(units, got)]
        else:
            report = None  # a report that does not match the test list is not a report
    res.tests = tests
    res.passed = sum(t["status"] == "pass" for t in tests)
    load = (report or {}).get("load") or {}
    res.stages = {"loaded": bool(load.get("loaded")) if mode in ("asserts", "calls") else None,
                  "imports_ok": (report or {}).get("imports_ok") if mode == "stdio" else None,
                  "errors": sum(t["status"] not in ("pass", "fail") for t in tests),
                  "ran": sum(t["status"] in ("pass", "fail") for t in tests),
                  "load_status": load.get("status")}
    if mode in ("asserts", "calls"):
        res.stages["imports_ok"] = res.stages["loaded"]
    if overflow == "disk":
        res.status, res.exit_code = "output_limit", None
        res.reason = f"disk limit exceeded: the private directory grew over {limits.disk_mb} MB"
        return
    if overflow:
        res.status, res.exit_code = "output_limit", None
        res.reason = f"output limit exceeded: {overflow} over {limits.output_bytes} bytes"
        return
    if timed_out:
        res.status, res.exit_code = "timeout", None
        res.reason = f"wall-time limit of {limits.timeout:g}s exceeded"
        if tests:
            res.reason += f" ({res.passed}/{len(units)} tests passed before)"
        return
    if report is None:
        res.passed, res.tests = 0, []
        if returncode is not None and returncode >= 128:
            res.status = "killed"
            res.reason = (f"the sandbox supervisor was killed (signal {returncode - 128}) before it reported: "
                          "the program killed its parent")
        elif returncode is not None and returncode < 0:
            res.status = "killed"
            res.reason = f"the sandbox was killed (signal {-returncode}) before it reported"
        else:
            res.status = "error"
            tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            res.reason = f"the sandbox failed without a report (exit status {returncode}): {tail[0][:300]}"
        res.exit_code = None
        return
    if mode == "run":
        code, sig = report.get("exit"), report.get("signal")
        res.exit_code = code if sig is None else -int(sig)
        if sig is not None:
            if sig == signal.SIGXCPU:
                res.status, res.reason = "timeout", f"CPU-time limit of {limits.cpu or limits.timeout:g}s exceeded"
            else:
                res.status = "killed"
                res.reason = f"killed by {_signame(sig)}"
        elif code == 0:
            res.status, res.reason = "ok", ""
        elif "MemoryError" in res.stderr[-2000:]:
            res.status, res.reason = "memory", f"memory limit of {limits.memory_mb} MB exceeded (MemoryError)"
        else:
            res.status = "failed"
            tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or [""]
            res.reason = f"exit code {code}" + (f": {tail[0][:300]}" if tail[0] else "")
        return
    n = len(units)
    if load.get("loaded") is False:
        st = load.get("status")
        res.status = {"timeout": "timeout", "memory": "memory", "killed": "killed"}.get(st, "failed")
        res.exit_code = 1
        res.reason = f"0/{n} tests: the program did not load: {load.get('error') or st}"
        return
    if res.passed == n:
        res.status, res.exit_code, res.reason = "ok", 0, ""
        return
    worst = min((t["status"] for t in tests), key=lambda s: _SEVERITY.index(s) if s in _SEVERITY else 4)
    res.status = {"output_limit": "output_limit", "timeout": "timeout", "memory": "memory",
                  "killed": "killed"}.get(worst, "failed")
    res.exit_code = 1
    first = next(t for t in tests if t["status"] != "pass")
    res.reason = f"{res.passed}/{n} tests passed; first failure {first['name']}: {first['status']}" + (
        f" ({first['reason'][:300]})" if first["reason"] else "")


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
