"""A bounded pool of worker threads, each driving one sandboxed subprocess at a time."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

from postrl.sandbox.errors import SandboxConfigError
from postrl.sandbox.execute import run
from postrl.sandbox.limits import Limits
from postrl.sandbox.probe import capabilities
from postrl.sandbox.results import SandboxResult


class SandboxPool:
    """Run many programs in parallel: at most ``workers`` sandboxes at once (default ``os.cpu_count()``).

    The sandbox is probed when the pool is created, so an isolation that this machine cannot give is logged at
    start-up, not at the first program. ``mode`` is the sandbox mode (``auto``/``bwrap``/``namespaces``/``fallback``,
    default ``POSTRL_SANDBOX``). Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, workers: int | None = None, *, limits: Limits | None = None, mode: str | None = None):
        workers = os.cpu_count() or 1 if workers is None else workers
        if not isinstance(workers, int) or workers < 1:
            raise SandboxConfigError(f"sandbox workers must be a positive integer, got {workers!r}")
        self.workers = workers
        self.limits = limits or Limits()
        self.mode = mode
        self.capabilities = capabilities(mode)
        self._ex = ThreadPoolExecutor(workers, thread_name_prefix="postrl-sandbox")

    def submit(self, code: str, tests: Any = None, *, stdin: str | None = None, limits: Limits | None = None,
               site: bool = False, mode: str | None = None) -> Future:
        """A future of :class:`SandboxResult` for one program (``mode`` overrides the pool's sandbox mode)."""
        return self._ex.submit(run, code, tests, stdin=stdin, limits=limits or self.limits,
                               mode=mode or self.mode, site=site)

    def map(self, codes: Iterable[str], tests: Iterable[Any] | None = None, *, limits: Limits | None = None,
            site: bool = False) -> list[SandboxResult]:
        """Results for ``codes`` (in order); ``tests`` is None or one entry per program."""
        codes = list(codes)
        tests = [None] * len(codes) if tests is None else list(tests)
        if len(tests) != len(codes):
            raise SandboxConfigError(f"sandbox: {len(codes)} programs but {len(tests)} test entries")
        futs = [self.submit(c, t, limits=limits, site=site) for c, t in zip(codes, tests)]
        return [f.result() for f in futs]

    def close(self) -> None:
        self._ex.shutdown(wait=True)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DEFAULT: list[SandboxPool] = []
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> SandboxPool:
    """The process-wide pool the reward sources share (created, and the sandbox probed, on first use)."""
    with _DEFAULT_LOCK:
        if not _DEFAULT:
            _DEFAULT.append(SandboxPool())
        return _DEFAULT[0]
