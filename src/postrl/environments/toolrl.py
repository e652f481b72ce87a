"""Tool-call rewards: ToolRL's ``tool_call`` (predicted calls scored against gold calls).

A predicted call is any call in a ``<tool_call>...</tool_call>`` block of the completion (:func:`predicted_calls`):
a JSON object ``{"name": ..., "arguments": {...}}`` (``"parameters"`` is accepted for ``"arguments"``, as ToolRL's
data writes it), several of them one per line, a JSON list of them, or Python calls with literal arguments
``name("x", unit="c")`` (one per line), the form :mod:`postrl.environments.tools` accepts. No tool schema is
needed: a positional argument of a Python call binds to the parameter names of the gold call of the same tool, in
their order (the gold's argument order is the tool's). The gold calls are a row's column (default ``tool_calls``):
a list of ``{"name", "arguments"}`` objects, one object, a JSON string of either, or text in the predicted-call
forms; an empty list means no call is expected. A gold value that is none of these stops the run with a one-line
:class:`~postrl.errors.DataError` naming the row (the data is wrong, not the completion).
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections import Counter
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt

from postrl.environments.tools import CLOSE, OPEN
from postrl.errors import ConfigError, DataError
from postrl.registry import register

_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
_THINK = re.compile(r"^\s*<think>.*?</think>", re.S)


class CallParseError(ValueError):
    """A call that does not parse (the message says why)."""


def _json_call(obj: Any) -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise CallParseError('expected {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI's function-call form: arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise CallParseError("'arguments' is a string that is not JSON") from None
    if not isinstance(args, dict):
        raise CallParseError("'arguments' must be an object")
    return {"name": obj["name"], "args": [], "kwargs": dict(args)}


def _python_call(text: str) -> dict:
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("expected name(arguments)")
        return {"name": node.func.id, "args": [ast.literal_eval(a) for a in node.args],
                "kwargs": {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}}
    except (SyntaxError, ValueError) as e:
        raise CallParseError(str(e).splitlines()[0] if str(e) else "does not parse") from None


def parse_block(body: str) -> list[dict]:
    """The calls of one ``<tool_call>`` block's body: ``[{"name", "args" (positional), "kwargs"}]``; raises
    :class:`CallParseError` when a call does not parse."""
    body = body.strip()
    if not body:
        raise CallParseError("empty tool call")
    if body[0] in "{[":
        try:
            obj = json.loads(body)
            return [_json_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        except json.JSONDecodeError:
            pass  # several JSON objects, one per line
    out = []
    for line in (s.strip() for s in body.splitlines()):
        if not line:
            continue
        if line.startswith("{"):
            try:
                out.append(_json_call(json.loads(line)))
            except json.JSONDecodeError as e:
                raise CallParseError(f"invalid JSON ({e.msg})") from None
        else:
            out.append(_python_call(line))
    return out


def predicted_calls(text: str) -> tuple[list[dict], str | None]:
    """(every call of every ``<tool_call>`` block of ``text``, in order; the first reason a block is malformed or
    None). An opening tag without its closing tag is malformed."""
    calls: list[dict] = []
    error = None
    for m in _BLOCK.finditer(text):
        try:
            calls += parse_block(m.group(1))
        except CallParseError as e:
            error = error or str(e)
    if text.count(OPEN) != text.count(CLOSE):
        error = error or "unclosed <tool_call>"
    return calls, error


def gold_calls(value: Any) -> list[dict]:
    """The gold calls of a row's column as ``[{"name", "arguments"}]``; raises :class:`CallParseError` (with why)
    for a value that is not a list of calls, a call, a JSON string of either or call text."""
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return []
        if s[0] in "{[":
            try:
                value = json.loads(s)
            except json.JSONDecodeError as e:
                raise CallParseError(f"not valid JSON ({e.msg})") from None
        else:
            calls, error = predicted_calls(s) if OPEN in s else (parse_block(s), None)
            if error:
                raise CallParseError(error)
            if any(c["args"] for c in calls):
                raise CallParseError("a gold Python call must name its arguments (name(key=value))")
            return [{"name": c["name"], "arguments": c["kwargs"]} for c in calls]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise CallParseError(f"expected a list of calls, got {type(value).__name__}")
    out = []
    for v in value:
        c = _json_call(v)
        out.append({"name": c["name"], "arguments": c["kwargs"]})
    return out


def bind(pred: dict, gold_names: list[str]) -> dict:
    """The predicted call's arguments by name: positional arguments bound to ``gold_names`` in order (an extra
    one to ``_<position>``), then its keyword arguments."""
    out = {(gold_names[i] if i < len(gold_names) else f"_{i}"): a for i, a in enumerate(pred["args"])}
    out.update(pred["kwargs"])
    return out


def match_score(a: list, b: list) -> float:
    """Multiset Jaccard |A n B| / |A u B| of two lists (1 when equal, both empty included; 0 when one is empty)."""
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    ca, cb = Counter(a), Counter(b)
    inter = sum(min(ca[k], cb[k]) for k in ca.keys() & cb.keys())
    return inter / (len(a) + len(b) - inter)


def correctness(gold: list[dict], pred: list[dict]) -> tuple[float, float]:
    """(S, S_max) of ToolRL's correctness: S = r_name + sum over gold calls g of the best unused predicted call p
    of the same name (in gold order) of r_param(g, p) + r_value(g, p); S_max = 1 + sum_g (1 + |keys(g)|).

    r_name = match_score(gold names, predicted names); r_param = match_score(keys(g), keys(p));
    r_value = sum_{k in keys(g)} 1[p[k] == g[k]]. An exact match of the whole call list scores S = S_max."""
    smax = 1.0 + sum(1.0 + len(g["arguments"]) for g in gold)
    bound = [[bind(p, list(g["arguments"])) for p in pred] for g in gold]
    if len(pred) == len(gold) and all(p["name"] == g["name"] and bound[j][j] == g["arguments"]
                                      for j, (g, p) in enumerate(zip(gold, pred))):
        return smax, smax
    score = match_score([g["name"] for g in gold], [p["name"] for p in pred])
    used: set[int] = set()
    for j, g in enumerate(gold):
        best, best_i = 0.0, -1
        for i, p in enumerate(pred):
            if i in used or p["name"] != g["name"]:
                continue
            args = bound[j][i]
            s = match_score(list(g["arguments"]), list(args)) + sum(
                1.0 for k, v in g["arguments"].items() if k in args and args[k] == v)
            if s > best:
                best, best_i = s, i
        if best_i >= 0:
            used.add(best_i)
            score += best
    return score, smax


def scales(step: int, schedule: str, format_range: tuple[float, float], correct_range: tuple[float, float],
           schedule_steps: int, switch_step: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """The (format, correctness) reward ranges at training ``step`` under ``schedule`` (see :func:`tool_call`)."""
    (f0, f1), (c0, c1) = format_range, correct_range
    if schedule == "smooth":
        f = min(step / schedule_steps, 1.0)
        return (-2 + (f0 + 2) * f, 2 + (f1 - 2) * f), (-2 + (c0 + 2) * f, 2 + (c1 - 2) * f)
    if schedule == "two_stage":
        if step < switch_step:
            return (f0, f1), (c0 / 3, c1 / 3)
        return (f0 / 2, f1 / 2), (c0, c1)
    return (f0, f1), (c0, c1)


def _check(params: dict, run: Any, where: str) -> dict:
    for key in ("format_range", "correct_range"):
        lo, hi = params.get(key, (0.0, 1.0))
        if not lo < hi:
            raise ConfigError(f"{where}.{key}: expected [low, high] with low < high, got [{lo}, {hi}]")
    return params


@register("reward", "tool_call", source="ToolRL: Reward is All Tool Learning Needs", check=_check)
def tool_call(prompts: list, completions: list, trainer_state: dict | None = None, *,
              gold_column: str = "tool_calls", think: bool = False,
              format_range: tuple[float, float] = (0.0, 1.0), correct_range: tuple[float, float] = (-3.0, 3.0),
              schedule: Literal["none", "smooth", "two_stage"] = "none",
              schedule_steps: Annotated[int, Gt(0)] = 150, switch_step: Annotated[int, Ge(0)] = 30,
              **columns: Any) -> list:
    """ToolRL's reward R = R_format + R_correct of the predicted tool calls against the row's gold calls.

    P = the completion's calls (:func:`predicted_calls`), G = the row's gold calls (column ``gold_column``,
    default ``tool_calls``; :func:`gold_calls`). With format range [f0, f1] (default [0, 1]) and correctness range
    [c0, c1] (default [-3, 3]):
      R_format = f1 when every ``<tool_call>`` block is closed and parses and P is non-empty iff G is (with
                 ``think``: the completion also opens with a ``<think>...</think>`` block), else f0
      R_correct = 0 when G is empty; c0 when a block does not parse; else (c1 - c0) S / S_max + c0 with
                 S = r_name + sum_g [r_param + r_value] over greedily matched pairs (:func:`correctness`), i.e.
                 tool-name overlap (multiset Jaccard of names), parameter-name overlap (Jaccard of the matched
                 calls' keys) and parameter-value matches (one per gold key whose value is equal), S_max = 1 +
                 sum_g (1 + |keys(g)|); an exact match gives c1.
    So R is in [-3, 4] by default (the paper's). ``schedule`` (the reward-scale study of the paper, Sec. 5.2):
    'none' (default); 'smooth' (the "dynamic" scale): both ranges move linearly from [-2, 2] at step 0 to their
    configured ranges at ``schedule_steps`` (150) and stay there; 'two_stage': correctness range / 3 before
    ``switch_step`` (30), then format range / 2. The step is the trainer's ``global_step``. After ToolRL
    (assumed where the abstract is silent, read from the paper's released reward code, not copied): greedy matching
    in gold order (not an optimal assignment); Python-call positional arguments bind to the gold call's keys in
    order; a single-turn block may hold several calls (one per line); the format check is the block structure
    above (the released code's anchored regex over ``<think>``/``<tool_call>``/``<response>`` is replaced by
    it, so a multi-turn episode with one block per turn scores); the released code caps the smooth schedule's
    format floor at -1 where postrl interpolates it to f0.

    Parameters (keyword-only; columns reach the function as keyword lists): ``gold_column`` ('tool_calls'),
    ``think`` (False), ``format_range`` ([0, 1]), ``correct_range`` ([-3, 3]), ``schedule``, ``schedule_steps``,
    ``switch_step``. A malformed gold value raises :class:`DataError` naming the row (the run stops).
    """
    if gold_column not in columns:
        raise DataError(f"reward 'tool_call': the rows have no column '{gold_column}' (the gold calls); columns: "
                        f"{', '.join(sorted(k for k in columns if k != 'group_ids')) or '(none)'}")
    step = int((trainer_state or {}).get("global_step", 0))
    (f0, f1), (c0, c1) = scales(step, schedule, tuple(format_range), tuple(correct_range), schedule_steps,
                                switch_step)
    out = []
    for i, (text, value) in enumerate(zip(completions, columns[gold_column])):
        try:
            gold = gold_calls(value)
        except CallParseError as e:
            prompt = str(prompts[i])[:60]
            raise DataError(f"reward 'tool_call': row {i} (prompt {prompt!r}): column '{gold_column}' is not a gold "
                            f"call list ({e}); got {str(value)[:80]!r}") from None
        pred, error = predicted_calls(text)
        fmt = error is None and bool(pred) == bool(gold) and (not think or _THINK.match(text) is not None)
        r_format = f1 if fmt else f0
        if not gold:
            r_correct = 0.0
        elif error is not None:
            r_correct = c0
        else:
            s, smax = correctness(gold, pred)
            r_correct = (c1 - c0) * s / smax + c0
        r = r_format + r_correct
        out.append(r if math.isfinite(r) else None)
    return out

