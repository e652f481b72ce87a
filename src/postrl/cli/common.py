"""What several commands share: the ``[CONFIG] [KEY=VALUE]`` items, import paths for user stages, a model folder
or run directory, a held-out split, and the one-line console form of Python warnings.

Light at import (argparse-level only): ``postrl --help`` must not load torch.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from pathlib import Path

from postrl.errors import ConfigError, PostrlError


def split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """First item without '=' is the config file; the rest are KEY=VALUE overrides."""
    path, overrides = None, []
    for it in items:
        if "=" in it:
            overrides.append(it)
        elif path is None:
            path = it
        else:
            raise PostrlError(f"unexpected argument '{it}': give one config file and KEY=VALUE overrides")
    return path, overrides


def add_import_paths(config_path: str | Path | None = None, path: list[str] | None = None) -> list[str]:
    """Put the current folder, then the config file's folder, at the front of ``path`` (``sys.path``) unless there.

    A config names user stages by import path (``rewards: [{name: my_rewards:exact_answer}]``). ``python -m
    postrl`` finds ``my_rewards.py`` in the current folder because ``-m`` puts it on ``sys.path``; the ``postrl``
    console script does not (its ``sys.path[0]`` is the script's own folder). Commands that load a config call
    this first, so both resolve the same modules: the current folder first, like ``python -m``, then the folder
    of the config file, so a config and the rewards beside it work from anywhere. Returns the folders added.
    """
    path = sys.path if path is None else path
    present = {os.path.abspath(p or os.curdir) for p in path}
    added = []
    for folder in (os.getcwd(), None if config_path is None else os.path.dirname(os.path.abspath(config_path))):
        if folder is not None and folder not in present:
            present.add(folder)
            added.append(folder)
    path[:0] = added
    return added


def resolve_model_folder(target: str, what: str) -> Path:
    """A model folder (``config.json``), or a run directory's latest complete checkpoint; else one error line
    naming ``what`` (e.g. ``"--policy"``, or nothing) and ``target``."""
    p = Path(target)
    name = f"{what} '{p}'" if what else f"'{p}'"
    if (p / "config.json").is_file():
        return p
    if (p / "checkpoints").is_dir():
        from postrl.train.checkpoint import latest_checkpoint

        last = latest_checkpoint(p)
        if last is None:
            raise PostrlError(f"{name}: run directory without a complete checkpoint")
        return last
    raise PostrlError(f"{name}: neither a model folder (config.json) nor a run directory (checkpoints/)")


def holdout_split(items: list, fraction: float, seed: int, flag: str = "--eval-fraction") -> tuple[list, list]:
    """(kept, held out): a seeded random ``fraction`` of ``items`` held out, both in their original order."""
    if not 0.0 <= fraction < 1.0:
        raise ConfigError(f"{flag} must be in [0, 1), got {fraction}")
    idx = list(range(len(items)))
    random.Random(seed).shuffle(idx)
    held = set(idx[:int(round(len(items) * fraction))])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def check_option(flag: str, value, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
    """A command-line number in range, else one ConfigError line naming ``flag``: finite, >= ``low`` (> with
    ``low_open``), <= ``high``; None (an option left out) passes."""
    if value is None:
        return
    import math

    bad = not math.isfinite(float(value)) if isinstance(value, float) else False
    if low is not None:
        bad = bad or (value <= low if low_open else value < low)
    if high is not None:
        bad = bad or value > high
    if bad:
        lo = "" if low is None else (f"> {low:g}" if low_open else f">= {low:g}")
        hi = "" if high is None else f"<= {high:g}"
        want = " and ".join(x for x in (lo, hi) if x) or "finite"
        kind = "a finite number" if isinstance(value, float) else "an integer"
        raise ConfigError(f"{flag} must be {kind} {want}, got {value}")


def format_metrics(res: dict) -> str:
    """``k=v`` pairs on one line, floats with 4 decimals (the commands' plain output)."""
    return "  ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())


def log(msg: str) -> None:
    print(msg, flush=True)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../postrl


def format_warning(message, category, filename: str, lineno: int) -> str:
    """One console line for a Python warning, the form of the trainer's ``warning: ...`` lines.

    A warning postrl raises (a configuration that cannot work as intended) is its message alone; a library's
    keeps its category and origin in brackets, since its message alone may not say where it comes from. Newlines
    in the message are folded into spaces."""
    text = " ".join(str(message).split())
    if os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
        return f"warning: {text}"
    return f"warning: {text} [{category.__name__}, {filename}:{lineno}]"


def show_warnings_as_lines(stream=None) -> None:
    """Install :func:`format_warning` as ``warnings.showwarning``: every warning shown (the filters still decide
    which and how often) is one line on ``stream`` (default: stderr at the time of the warning)."""

    def show(message, category, filename, lineno, file=None, line=None):
        out = file or stream or sys.stderr
        try:
            out.write(format_warning(message, category, filename, lineno) + "\n")
        except OSError:  # a closed or broken stream: nothing to show the warning on, as in warnings' own default
            pass

    warnings.showwarning = show
