"""``run()``: one program in the sandbox, optionally against tests (probing, then launching, then the result)."""

from __future__ import annotations

import time
from typing import Any

from postrl.sandbox.errors import SandboxConfigError
from postrl.sandbox.launch import launch
from postrl.sandbox.limits import Limits
from postrl.sandbox.probe import capabilities
from postrl.sandbox.results import SandboxResult, not_run, parses
from postrl.sandbox.testspec import collect


def run(code: str, tests: Any = None, *, stdin: str | None = None, limits: Limits | None = None,
        mode: str | None = None, site: bool = False, module: str = "solution") -> SandboxResult:
    """Run ``code`` in the sandbox; with ``tests`` (see :mod:`postrl.sandbox.testspec`), run it against them.

    Without tests: ``status`` is ok (exit code 0), failed (non-zero exit), timeout (wall or CPU limit), memory
    (MemoryError under the address-space limit), output_limit, killed (a signal) or error (the sandbox itself
    failed). With tests: ok only when every test passed; failed when some failed or the program did not load
    (syntax error, exception or exit while loading); timeout / memory / output_limit / killed when a test or the
    run hit that limit. ``passed``/``total`` count tests; "no tests collected" is 0/0, status failed.
    ``site=True`` lets the program import the sandbox interpreter's site-packages (default: standard library).
    Test code sees the program's top-level names directly and as the module ``solution``; ``module`` names it a
    second time (``postrl sandbox prog.py`` passes ``prog``, so a test file can ``from prog import add``).
    Raises :class:`~postrl.sandbox.errors.SandboxConfigError` for a bad argument,
    :class:`~postrl.sandbox.errors.SandboxDataError` for malformed tests and
    :class:`~postrl.sandbox.errors.SandboxUnavailable` when the requested isolation does not work here.
    """
    if not isinstance(code, str):
        raise SandboxConfigError(f"sandbox: code must be a string, got {type(code).__name__}")
    if not (isinstance(module, str) and module.isidentifier()):
        raise SandboxConfigError(f"sandbox: module must be a Python identifier, got {module!r}")
    caps = capabilities(mode)
    limits = limits or Limits()
    t0 = time.monotonic()
    spec = None
    if tests is not None:
        spec = collect(tests)
        res = not_run(code, spec["units"], caps["mode"], time.monotonic() - t0)
        if res is not None:
            return res
        spec = dict(spec, module=module)
    res = launch(caps, code, spec, stdin, limits, site=site)
    res.stages["parsed"] = True if spec is not None else parses(code)
    return res
