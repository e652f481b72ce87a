"""Code sandbox: run untrusted, model-written Python in a separate, limited, isolated process.

``run(code, tests=None, limits=Limits(...))`` returns a :class:`SandboxResult` (status, exit code, tests passed /
total, truncated stdout and stderr, time, reason); :class:`SandboxPool` runs many in parallel; ``capabilities()``
says what this machine enforces (bubblewrap, else the same namespaces built with ``unshare``, else the rlimits-only
fallback and what it leaves open).
See :mod:`postrl.sandbox.core` for the isolation and :mod:`postrl.sandbox.testspec` for the accepted tests.
"""

from postrl.sandbox.core import STATUSES, Limits, SandboxResult, capabilities, run  # noqa: F401
from postrl.sandbox.pool import SandboxPool, default_pool  # noqa: F401
from postrl.sandbox.testspec import collect  # noqa: F401
