"""Reading what users and runs write: JSON lines, and objects named by import path (``module:attr``).

``read_jsonl(path)`` reads a JSON-lines file in one of two modes: ``strict`` (a data file a user gives: a line that
is not a JSON object, or a file that is not UTF-8 text, is a one-line :class:`~postrl.errors.DataError` naming
the file and line) or lenient (a run's own logs: a line cut by a crash, or still being written, is skipped; a
missing file reads as no rows). ``load_object("pkg.mod:name", what)`` imports a module and returns its attribute,
or raises one :class:`~postrl.errors.ConfigError` line naming ``what``. ``load_once(path, build, *key)`` builds
what a file holds once per process (again when the file changes).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

from postrl.errors import ConfigError, DataError


def read_jsonl(path: str | os.PathLike, *, strict: bool = False) -> list[dict]:
    """The JSON objects of a JSON-lines file, one per non-empty line (see the module docstring for ``strict``)."""
    p = Path(path)
    rows: list[dict] = []
    try:
        data = p.read_bytes()
    except OSError as e:
        if strict:
            raise DataError(f"{p}: cannot read it ({e.strerror or type(e).__name__})") from None
        return rows
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if strict:
            raise DataError(f"{p}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save it "
                            f"as UTF-8 JSON lines") from None
        text = data.decode("utf-8", errors="replace")
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, an int over Python's digit limit
            if strict:
                msg = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply" if isinstance(
                    e, RecursionError) else str(e).split(";")[0].split(":")[0]
                raise DataError(f"{p}: line {lineno} is not valid JSON ({msg})") from None
            continue  # a line cut by a crash or still being written
        if isinstance(obj, dict):
            rows.append(obj)
        elif strict:
            raise DataError(f"{p}: line {lineno} is a {type(obj).__name__}, expected a JSON object")
    return rows


def load_object(path: str, what: str) -> Any:
    """The attribute named by ``path`` = ``'module.name:attr'`` (``attr`` may be dotted); ``what`` names the config
    key or option in the one-line error."""
    module_name, sep, attr = str(path).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what}: expected an import path 'module:attribute', got '{path}'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} '{path}': cannot import module '{module_name}' ({e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what} '{path}': module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


_TRUE = {"true", "yes", "1"}
_FALSE = {"false", "no", "0", ""}


def column_flag(value: Any, where: str) -> bool:
    """A data column's yes/no value: a bool, a number (non-zero: yes), a string (true/yes/1 or false/no/0/empty,
    any case: a CSV file's cells) or None (missing: no); anything else is one :class:`~postrl.errors.DataError`
    line naming ``where``."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise DataError(f"{where}: expected true or false, got {value!r}")


_LOADED: dict[tuple, Any] = {}
_LOADED_LOCK = threading.RLock()  # a build may load another file (an encoder for a corpus)


def load_once(path: str | os.PathLike, build: Callable[[], Any], *key: Any) -> Any:
    """``build()`` once per process for the file ``path`` (its resolved name and modification time) and ``key``;
    built again when the file is re-written. For what a stage reads from a file on every call (a model folder's
    config, a corpus, an index). Builds run one at a time; an exception is not cached."""
    p = Path(path)
    full = (str(p.resolve()), p.stat().st_mtime_ns if p.exists() else 0, *key)
    with _LOADED_LOCK:
        if full not in _LOADED:
            _LOADED[full] = build()
        return _LOADED[full]
