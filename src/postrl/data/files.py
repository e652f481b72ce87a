"""Prompt sources backed by data: a local file (JSONL, JSON, CSV, parquet) or a Hugging Face dataset.

Training order: epoch ``e`` is the training rows permuted by ``random.Random(stable_hash(seed, e))``;
``train_rows(step, n, seed)`` returns positions ``step*n .. step*n+n-1`` of the endless concatenation of those
permutations, so every training row is seen exactly once per epoch and the position is a function of the step.

Evaluation: the rows of ``eval_path`` (or ``eval_split``) when given, else the last ``eval_fraction`` of a fixed
permutation of the rows (the same for every run seed, so no run ever trains on them).

``verifier`` names a task (e.g. ``arithmetic``) whose ``verify`` scores the rows; every row then carries
``task = verifier`` and the rows need whatever columns that verifier reads (``answer`` for arithmetic).
"""

from __future__ import annotations

import csv
import json
import os
import random
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Ge, Lt
from pydantic import AfterValidator

from postrl.data.base import PromptSource
from postrl.seeding import stable_hash
from postrl.io import read_jsonl
from postrl.errors import ConfigError, DataError
from postrl.registry import register
from postrl import registry

SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".parquet")
_SPLIT_SEED = "postrl-eval-split"


# --------------------------------------------------------------------------------------------- reading


def _read_json(path: Path) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON at line {e.lineno} ({e.msg})") from None
    except UnicodeDecodeError:
        raise  # read_rows says: not UTF-8
    except ValueError as e:  # an integer over Python's limit of digits
        raise DataError(f"{path}: not valid JSON ({str(e).split(';')[0].split(':')[0]})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got a {type(data).__name__}")
    for i, obj in enumerate(data, 1):
        if not isinstance(obj, dict):
            raise DataError(f"{path}: row {i} is a {type(obj).__name__}, expected a JSON object")
    return data


def _read_csv(path: Path) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as f:
        # Short rows give None for the missing fields: drop them so the column check reports them.
        return [{k: v for k, v in row.items() if k is not None and v is not None} for row in csv.DictReader(f)]


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow; install it with pip install 'postrl[data]'") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a corrupt file
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DataError(f"{path}: cannot read parquet ({type(e).__name__}: {first})") from None


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The records of a JSONL / JSON (list of objects) / CSV / parquet file, chosen by suffix."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: file not found")
    if p.is_dir():
        raise DataError(f"{p}: is a directory, expected a {', '.join(SUFFIXES)} file")
    suffix = p.suffix.lower()
    jsonl = lambda path: read_jsonl(path, strict=True)  # noqa: E731
    readers = {".jsonl": jsonl, ".ndjson": jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}
    if suffix not in readers:
        raise DataError(f"{p}: unsupported file type '{p.suffix}'; expected one of {', '.join(SUFFIXES)}")
    try:
        rows = readers[suffix](p)
    except UnicodeDecodeError as e:  # Latin-1, UTF-16 or a binary file
        raise DataError(f"{p}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); save it as "
                        f"UTF-8") from None
    except RecursionError:
        raise DataError(f"{p}: a value nested too deeply to read") from None
    except csv.Error as e:
        raise DataError(f"{p}: not a readable CSV file ({e})") from None
    except OSError as e:
        raise DataError(f"{p}: cannot read it ({e.strerror or e})") from None
    if not rows:
        raise DataError(f"{p}: no rows (empty file)")
    return rows


# --------------------------------------------------------------------------------------------- prompts


def _unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be encoded as UTF-8 (a lone surrogate, e.g. JSON's unpaired ``\\ud800``), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds {text[e.start:e.end].encode('unicode_escape').decode()} at character {e.start}, a lone " \
               f"surrogate that is not valid Unicode text"
    return None


def check_prompt(prompt: Any, where: str) -> str | list[dict]:
    """A prompt as a prompt source keeps it: a non-empty string, or a conversation (TRL's conversational format:
    a non-empty list of ``{"role": str, "content": str}`` messages, encoded with the chat template); else one
    DataError line starting with ``where``."""
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where} is empty; every prompt needs some text")
        bad = _unicode_problem(prompt)
        if bad:
            raise DataError(f"{where} {bad}")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        for j, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: message {j} needs a string 'role' and a string 'content' (a "
                                f"conversation is a list of {{role, content}} messages), got keys {sorted(m)}")
            bad = _unicode_problem(m["role"] + m["content"])
            if bad:
                raise DataError(f"{where}: message {j} {bad}")
        if not any(m["content"] for m in prompt):
            raise DataError(f"{where} is a conversation whose messages are all empty")
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise DataError(f"{where} is a {type(prompt).__name__}, expected a string or a conversation (a list of "
                    f"{{role, content}} messages)")


# --------------------------------------------------------------------------------------------- sources


def _verifier(verifier: str) -> str:
    """a registered task with a verifier (not a data source)"""
    try:
        cls = registry.get("task", verifier)
    except ConfigError as e:  # unknown name: the registry's message lists the valid ones
        raise ValueError(str(e)) from None
    if isinstance(cls, type) and issubclass(cls, RowsSource):
        raise ValueError(f"'{verifier}' is a data source, not a task with a verifier")
    return verifier


Verifier = Annotated[str, AfterValidator(_verifier)]
EvalFraction = Annotated[float, Ge(0), Lt(1)]  # the share of rows held out for evaluation


class RowsSource(PromptSource):
    """Shared epoch/eval logic over an in-memory list of rows (``FileSource``, ``DatasetSource``)."""

    _PERM_CACHE = 4

    def _setup(
        self,
        label: str,
        rows: list[dict],
        eval_rows: list[dict] | None,
        eval_label: str | None,
        prompt_column: str,
        columns: list[str] | None,
        eval_fraction: float,
        verifier: str | None,
    ) -> None:
        self.label = label
        self.prompt_column = prompt_column
        self.columns = list(columns) if columns is not None else None
        self.verifier = verifier
        rows = [self._normalize(label, i, r) for i, r in enumerate(rows, 1)]
        if eval_rows is not None:
            self._eval = [self._normalize(eval_label or label, i, r) for i, r in enumerate(eval_rows, 1)]
            self._train = rows
        else:
            order = list(range(len(rows)))
            random.Random(stable_hash(_SPLIT_SEED, len(rows))).shuffle(order)
            n_eval = int(round(len(rows) * eval_fraction))
            if eval_fraction > 0 and len(rows) >= 2:
                n_eval = max(1, n_eval)
            n_eval = min(n_eval, len(rows) - 1)
            held = set(order[len(rows) - n_eval :])
            self._eval = [rows[i] for i in order[len(rows) - n_eval :]]
            self._train = [r for i, r in enumerate(rows) if i not in held]
        self._perms: dict[tuple[int, int], list[int]] = {}

    def _normalize(self, label: str, rownum: int, row: dict) -> dict:
        if self.prompt_column not in row:
            cols = ", ".join(map(str, row)) or "(none)"
            raise DataError(f"{label}: row {rownum} has no prompt column '{self.prompt_column}' (columns: {cols})")
        prompt = check_prompt(row[self.prompt_column], f"{label}: row {rownum} column '{self.prompt_column}'")
        if self.columns is None:
            out = {k: v for k, v in row.items() if k != self.prompt_column}
        else:
            out = {}
            for c in self.columns:
                if c not in row:
                    cols = ", ".join(map(str, row))
                    raise DataError(f"{label}: row {rownum} has no column '{c}' (columns: {cols})")
                out[c] = row[c]
        for k, v in out.items():  # what is tokenized (a demonstration) or compared must be valid text too
            bad = _unicode_problem(v) if isinstance(v, str) else None
            if bad:
                raise DataError(f"{label}: row {rownum} column '{k}' {bad}")
        out["prompt"] = prompt
        if self.verifier is not None:
            out["task"] = self.verifier
        return out

    def __len__(self) -> int:
        return len(self._train)

    def _perm(self, seed: int, epoch: int) -> list[int]:
        key = (seed, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = list(range(len(self._train)))
            random.Random(stable_hash(seed, epoch)).shuffle(perm)
            if len(self._perms) >= self._PERM_CACHE:
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = perm
        return perm

    def train_rows(self, step: int, n: int, seed: int) -> list[dict]:
        size = len(self._train)
        out = []
        for pos in range(step * n, step * n + n):
            epoch, i = divmod(pos, size)
            out.append(dict(self._train[self._perm(seed, epoch)[i]]))
        return out

    def eval_rows(self, n: int, seed: int) -> list[dict]:
        return [dict(r) for r in self._eval[:n]]

    @staticmethod
    def verify(completion: str, row: dict) -> float | None:
        # circular at import: postrl.data imports this module
        from postrl.data import verify_row

        return verify_row(completion, row)


@register("task", "file", source="local JSONL / JSON / CSV / parquet file")
class FileSource(RowsSource):
    """Rows of a local JSONL, JSON (list of objects), CSV or parquet file."""

    name = "file"

    def __init__(
        self,
        *,
        path: str,
        prompt_column: str = "prompt",
        columns: list[str] | None = None,
        eval_fraction: EvalFraction = 0.1,
        eval_path: str | None = None,
        verifier: Verifier | None = None,
    ):
        self.path = str(path)
        rows = read_rows(path)
        eval_rows = read_rows(eval_path) if eval_path is not None else None
        self._setup(str(path), rows, eval_rows, str(eval_path) if eval_path else None, prompt_column, columns,
                    eval_fraction, verifier)


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "loading a dataset needs the 'datasets' package; install it with pip install 'postrl[data]'"
        ) from None
    return datasets


def _load_split(name_or_path: str, split: str, config_name: str | None) -> list[dict]:
    datasets = _import_datasets()
    p = Path(name_or_path)
    try:
        if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()
                           or (p / "state.json").exists()):
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{name_or_path}: no split '{split}'; splits: {', '.join(ds)}")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name_or_path, config_name, split=split)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types (FileNotFoundError, ValueError, DatasetNotFoundError ...)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{name_or_path}: cannot load split '{split}' ({msg})") from None
    rows = ds.to_list()
    if not rows:
        raise DataError(f"{name_or_path}: split '{split}' has no rows")
    return rows


@register("task", "dataset", source="Hugging Face datasets (load_dataset / load_from_disk)")
class DatasetSource(RowsSource):
    """Rows of a Hugging Face dataset (hub name or ``save_to_disk`` folder)."""

    name = "dataset"

    def __init__(
        self,
        *,
        name_or_path: str,
        split: str = "train",
        config_name: str | None = None,
        prompt_column: str = "prompt",
        columns: list[str] | None = None,
        eval_fraction: EvalFraction = 0.1,
        eval_split: str | None = None,
        verifier: Verifier | None = None,
    ):
        self.name_or_path = str(name_or_path)
        rows = _load_split(self.name_or_path, split, config_name)
        eval_rows = _load_split(self.name_or_path, eval_split, config_name) if eval_split is not None else None
        self._setup(f"{name_or_path}[{split}]", rows, eval_rows,
                    f"{name_or_path}[{eval_split}]" if eval_split else None, prompt_column, columns,
                    eval_fraction, verifier)
