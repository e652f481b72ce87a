"""The resource limits of one sandboxed run."""

from __future__ import annotations

from dataclasses import dataclass

from postrl.sandbox.errors import SandboxConfigError


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run.

    ``timeout``: wall seconds for the whole run (all tests together), host-enforced. ``cpu``: CPU seconds per
    process (default: ``timeout``). ``memory_mb``: address space per process, and (where a cgroup can be
    made) the memory of the whole run together, plus 32 MB for the supervisor. ``processes``: processes and
    threads the program may have, itself included. ``output_bytes``: per stream (stdout, stderr); more kills the
    run (status ``output_limit``); also the cap on one test's stdout. ``disk_mb``: size of each writable tmpfs and
    the largest file. ``open_files``: descriptors per process. ``test_timeout``: wall seconds per test (default: none,
    only the overall ``timeout``); a test over it fails and the next test runs in a fresh process.
    """

    timeout: float = 10.0
    cpu: float | None = None
    memory_mb: int = 512
    processes: int = 32
    output_bytes: int = 64 * 1024
    disk_mb: int = 32
    open_files: int = 64
    test_timeout: float | None = None

    def __post_init__(self) -> None:
        for k in ("timeout", "memory_mb", "processes", "output_bytes", "disk_mb", "open_files"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise SandboxConfigError(f"sandbox limit '{k}' must be a positive number, got {v!r}")
        for k in ("cpu", "test_timeout"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise SandboxConfigError(f"sandbox limit '{k}' must be a positive number or None, got {v!r}")
        if self.memory_mb < 32:
            raise SandboxConfigError(f"sandbox limit 'memory_mb' must be at least 32 (Python itself needs it), got "
                                     f"{self.memory_mb}")

    def harness_dict(self) -> dict:
        """The limits as the harness reads them (plain data: it is marshalled to the sandbox)."""
        return {"memory_bytes": int(self.memory_mb) << 20, "cpu_seconds": float(self.cpu or self.timeout),
                "file_bytes": int(self.disk_mb) << 20, "open_files": int(self.open_files),
                "processes": int(self.processes), "output_bytes": int(self.output_bytes),
                "test_timeout": self.test_timeout}
