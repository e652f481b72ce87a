"""Preference data: reading and checking ``(prompt, chosen, rejected[, annotator, context, margin, bias])`` rows.

A preference file is JSONL / JSON / CSV / parquet (read by :func:`postrl.data.read_rows`), one pair per row:

==============  ========================  ================================================================
field           type                      meaning
==============  ========================  ================================================================
``prompt``      str                       the prompt (may be empty)
``chosen``      str                       the preferred completion
``rejected``    str, or list[str]         the other completion; a list = one correct vs many wrong
                                          (RewardMATH-style evaluation rows; training expands it to pairs)
``annotator``   str or int (optional)     who labelled the pair (per-annotator rationality)
``context``     str or int (optional)     a context label (per-context rationality)
``margin``      number (optional)         preference strength m >= 0 for the Llama-2 margin loss
``bias``        number in [0, 1] (opt.)   probability that a cognitive bias shaped this comparison (a judge's
                                          score, precomputed): the per-comparison rationality
                                          (``rationality='judged'``); the column name is configurable
``ref_prompt``  str (optional)            the prompt the *reference* model reads the completions under in
                                          ``postrl dpo`` (context distillation: Semantic Soft Bootstrapping's
                                          hinted teacher prompt, ``postrl pairs --ssb``); default the prompt
``prefix``      str (optional)            a step-level pair (``postrl pairs --dapo``): the response so far (the
                                          state); chosen and rejected are two next steps continuing it, each
                                          ended by EOS only when ``chosen_final`` / ``rejected_final`` is true
``chosen_advantage``, ``rejected_advantage``  numbers (optional): the critic's advantage A(s, a) of each
                                          completion (DAPO's step-level target, ``--loss dapo_step``)
==============  ========================  ================================================================

Any violation is a one-line :class:`~postrl.errors.DataError` naming the file, the row (1-based) and the field:
a missing field, a non-string text, identical chosen and rejected, an annotator of the wrong type, a margin that
is not a finite number, a bias score that is not a number in [0, 1].
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postrl.errors import DataError
from postrl.data import read_rows

__all__ = ["PreferencePair", "read_preferences", "check_preferences"]


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0
    annotator: str | None = None
    context: str | None = None
    row: int = 0  # 1-based row in the source file
    bias: float | None = None  # P(a cognitive bias shaped this comparison), from a judge
    ref_prompt: str | None = None  # what the reference model reads instead of the prompt (postrl dpo)
    prefix: str | None = None  # a step-level pair: the response so far; chosen / rejected continue it
    chosen_final: bool = True  # (a step-level pair) the chosen step ends the response: EOS follows it
    rejected_final: bool = True
    chosen_advantage: float | None = None  # A(s, a) of each completion, from a critic (DAPO)
    rejected_advantage: float | None = None


def _label(value: Any, where: str, field: str) -> str | None:
    if value is None:
        return None
    # bool is an int subclass: True/False is almost certainly a wrong column, not an annotator id.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(f"{where}: field '{field}' must be a string or integer id, got {type(value).__name__} "
                        f"{value!r}")
    return str(value)


def check_preferences(rows: list[dict], source: str = "preferences", *, allow_lists: bool = False,
                      bias_column: str = "bias") -> list[PreferencePair] | list[tuple[PreferencePair, list[str]]]:
    """Validate raw rows; return :class:`PreferencePair` objects (one per row); ``bias_column``: the column read
    into ``PreferencePair.bias``.

    With ``allow_lists`` a ``rejected`` list is allowed and the result is ``(pair, rejected_list)`` per row, where
    ``pair.rejected`` is the first wrong completion. Otherwise a list is expanded into one pair per wrong one.
    """
    out: list = []
    for i, r in enumerate(rows, 1):
        where = f"{source}: row {i}"
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected an object with prompt/chosen/rejected, got {type(r).__name__}")
        for f in ("prompt", "chosen", "rejected"):
            if f not in r or r[f] is None:
                raise DataError(f"{where}: missing field '{f}' (a preference row needs prompt, chosen, rejected)")
        for f in ("prompt", "chosen"):
            if not isinstance(r[f], str):
                raise DataError(f"{where}: field '{f}' must be a string, got {type(r[f]).__name__}")
        rej = r["rejected"]
        if isinstance(rej, (list, tuple)):
            if not rej or not all(isinstance(x, str) for x in rej):
                raise DataError(f"{where}: field 'rejected' must be a string or a non-empty list of strings")
            rejected = list(rej)
        elif isinstance(rej, str):
            rejected = [rej]
        else:
            raise DataError(f"{where}: field 'rejected' must be a string, got {type(rej).__name__}")
        for j, x in enumerate(rejected):
            if x == r["chosen"]:
                at = "" if len(rejected) == 1 else f" (entry {j})"
                raise DataError(f"{where}: fields 'chosen' and 'rejected'{at} are identical; a pair needs two "
                                f"different completions")
        margin = r.get("margin", 0.0)
        if margin is None:
            margin = 0.0
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(float(margin)):
            raise DataError(f"{where}: field 'margin' must be a finite number, got {margin!r}")
        annotator = _label(r.get("annotator"), where, "annotator")
        context = _label(r.get("context"), where, "context")
        bias = r.get(bias_column)
        if bias is not None and (isinstance(bias, bool) or not isinstance(bias, (int, float))
                                 or not 0.0 <= float(bias) <= 1.0):
            raise DataError(f"{where}: field '{bias_column}' must be a probability in [0, 1] (the chance that a "
                            f"cognitive bias shaped the comparison), got {bias!r}")
        ref_prompt = r.get("ref_prompt")
        if ref_prompt is not None and not isinstance(ref_prompt, str):
            raise DataError(f"{where}: field 'ref_prompt' must be a string (the reference model's prompt), got "
                            f"{type(ref_prompt).__name__}")
        prefix = r.get("prefix")
        if prefix is not None and not isinstance(prefix, str):
            raise DataError(f"{where}: field 'prefix' must be a string (the response so far), got "
                            f"{type(prefix).__name__}")
        step = {}
        for f in ("chosen_final", "rejected_final"):
            v = r.get(f)
            if v is not None and not isinstance(v, bool):
                raise DataError(f"{where}: field '{f}' must be true or false, got {v!r}")
            step[f] = (prefix is None) if v is None else v
        for f in ("chosen_advantage", "rejected_advantage"):
            v = r.get(f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise DataError(f"{where}: field '{f}' must be a finite number, got {v!r}")
            step[f] = None if v is None else float(v)
        pairs = [PreferencePair(r["prompt"], r["chosen"], x, float(margin), annotator, context, i,
                                None if bias is None else float(bias), ref_prompt, prefix, **step) for x in rejected]
        if allow_lists:
            out.append((pairs[0], rejected))
        else:
            out.extend(pairs)
    return out


def read_preferences(path: str | os.PathLike, *, allow_lists: bool = False, bias_column: str = "bias"):
    """Read and check a preference file (see the module docstring)."""
    return check_preferences(read_rows(path), str(Path(path)), allow_lists=allow_lists, bias_column=bias_column)
