"""User-facing errors: one line, naming the field or file and what was expected.

The CLI prints ``postrl: error: <message>`` and exits with status 2 for any :class:`PostrlError`;
no traceback is shown for a user mistake.
"""

import contextlib


class PostrlError(Exception):
    """A mistake in the user's input (config, data, paths). The message is one line."""


class ConfigError(PostrlError):
    """An invalid configuration key, type or stage name."""


class DataError(PostrlError):
    """A prompts/data file or dataset that does not have what was expected."""


class RewardError(PostrlError):
    """A reward function that broke its contract (e.g. returned the wrong number of values)."""


@contextlib.contextmanager
def sandbox_errors():
    """Re-raise the code sandbox's own errors (:mod:`postrl.sandbox.errors`: the sandbox imports nothing of postrl)
    as these: ``SandboxConfigError`` as :class:`ConfigError`, ``SandboxDataError`` (a row's malformed ``tests``) as
    :class:`DataError`, any other ``SandboxError`` (the requested isolation does not work here) as
    :class:`PostrlError`; the message is kept."""
    from postrl.sandbox.errors import SandboxConfigError, SandboxDataError, SandboxError

    try:
        yield
    except SandboxConfigError as e:
        raise ConfigError(str(e)) from None
    except SandboxDataError as e:
        raise DataError(str(e)) from None
    except SandboxError as e:
        raise PostrlError(str(e)) from None
