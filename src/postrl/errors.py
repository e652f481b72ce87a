"""User-facing errors: one line, naming the field or file and what was expected.

The CLI prints ``postrl: error: <message>`` and exits with status 2 for any :class:`PostrlError`;
no traceback is shown for a user mistake.
"""



class PostrlError(Exception):
    """A mistake in the user's input (config, data, paths). The message is one line."""


class ConfigError(PostrlError):
    """An invalid configuration key, type or stage name."""


class DataError(PostrlError):
    """A prompts/data file or dataset that does not have what was expected."""


class RewardError(PostrlError):
    """A reward function that broke its contract (e.g. returned the wrong number of values)."""
