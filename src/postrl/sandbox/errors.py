"""The sandbox's own errors (the sandbox imports nothing else of postrl; its callers re-raise these as postrl's
user errors, see :func:`postrl.errors.sandbox_errors`). Every message is one line."""


class SandboxError(Exception):
    """Base class: something the sandbox was asked cannot be done. The message is one line."""


class SandboxConfigError(SandboxError, ValueError):
    """An invalid limit, mode, argument or ``POSTRL_SANDBOX_PYTHON``."""


class SandboxDataError(SandboxError, ValueError):
    """A row's ``tests`` value that is not one of the accepted forms (see :mod:`postrl.sandbox.testspec`)."""


class SandboxUnavailable(SandboxError):
    """The requested isolation does not work on this machine (or no sandbox does, or a run's cgroup could not be
    made)."""
