"""Code sandbox: run untrusted, model-written Python in a separate, limited, isolated process.

``run(code, tests=None, limits=Limits(...))`` returns a :class:`SandboxResult` (status, exit code, tests passed /
total, truncated stdout and stderr, time, reason); :class:`SandboxPool` runs many in parallel; ``capabilities()``
says what this machine enforces (bubblewrap, else the same namespaces built by the harness, else the rlimits-only
fallback and what it leaves open; and whether the seccomp filter is in force).

A self-contained package (it imports nothing else of postrl; its errors are :mod:`postrl.sandbox.errors`), one
module per responsibility:

- probing: :mod:`~postrl.sandbox.probe` (``capabilities()``: which isolation works here, what it enforces);
- confinement: :mod:`~postrl.sandbox.confine` (host side: the read-only view, bubblewrap's command line, the
  namespaces spec, cgroups), :mod:`~postrl.sandbox.seccomp` (the system-call filter), and inside the sandbox
  :mod:`postrl.sandbox._harness.confine` (namespaces, privileges, rlimits, loading the filter);
- running: :mod:`~postrl.sandbox.execute` (``run()``), :mod:`~postrl.sandbox.launch` (start the harness, watch the
  limits, tear down), :mod:`~postrl.sandbox.pool` (``SandboxPool``), :mod:`postrl.sandbox._harness` (the
  supervisor inside the sandbox, the only source of a result);
- result interpretation: :mod:`~postrl.sandbox.results` (``SandboxResult``, statuses and reasons);
- tests: :mod:`~postrl.sandbox.testspec` (the accepted forms of a row's ``tests``); limits:
  :mod:`~postrl.sandbox.limits`.
"""

from postrl.sandbox.errors import SandboxConfigError, SandboxDataError, SandboxError, SandboxUnavailable  # noqa: F401
from postrl.sandbox.execute import run  # noqa: F401
from postrl.sandbox.limits import Limits  # noqa: F401
from postrl.sandbox.pool import SandboxPool, default_pool  # noqa: F401
from postrl.sandbox.probe import capabilities  # noqa: F401
from postrl.sandbox.results import STATUSES, SandboxResult  # noqa: F401
from postrl.sandbox.testspec import collect  # noqa: F401
