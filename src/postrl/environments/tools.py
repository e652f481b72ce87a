"""Tools: Python functions as tool schemas, the tool-call format, execution with a timeout, :class:`ToolEnvironment`.

A tool is a plain function with type hints and a Google-style docstring (``Args:``); its schema is transformers'
``get_json_schema(fn)``, the form ``apply_chat_template(messages, tools=[...])`` takes, so a chat template that
renders tools shows them to the model (:func:`schemas`).

The tool-call format (:func:`parse_tool_calls`), the one Qwen / Hermes templates use:
``<tool_call>{"name": "calc", "arguments": {"expression": "12*34"}}</tool_call>``; inside the tags a Python call
with literal arguments is accepted as well, ``<tool_call>calc("12*34")</tool_call>`` (positional arguments bind
to the function's parameters in order), for tokenizers without braces. A call that does not parse, names an
unknown tool, has an unclosed tag or arguments that do not bind is *malformed*: it is counted
(``malformed_calls``), never executed, and the model reads ``error: ...`` as the tool's result.

Execution (:func:`run_tool`): each call runs in its own daemon thread with a wall-clock ``timeout``; a call that
raises or runs past the timeout is a tool error (``tool_errors``), isolated to that call (a hung thread is
abandoned, the episode goes on), and the model reads ``error: ...``. Tools that run untrusted code should do so
through :mod:`postrl.sandbox` (a separate process with limits); a tool function itself runs in this process.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from postrl.environments import Environment

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def schemas(tools: list[Callable]) -> list[dict]:
    """The JSON schema of each tool (transformers ``get_json_schema``: name, description, parameters)."""
    from transformers.utils import get_json_schema

    return [get_json_schema(fn) for fn in tools]


@dataclass
class ToolCall:
    """A parsed call: ``name`` and bound ``arguments``, or ``error`` (malformed: why)."""

    name: str = ""
    arguments: dict | None = None
    error: str = ""


def _parse_one(body: str, tools: dict[str, Callable]) -> ToolCall:
    body = body.strip()
    if body.startswith("{"):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall(error=f"malformed tool call: invalid JSON ({e.msg})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall(error="malformed tool call: expected {\"name\": ..., \"arguments\": {...}}")
        name, args, kwargs = obj["name"], [], obj.get("arguments", {})
        if not isinstance(kwargs, dict):
            return ToolCall(error="malformed tool call: 'arguments' must be an object")
    else:
        try:
            node = ast.parse(body, mode="eval").body
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                raise ValueError("expected name(arguments)")
            name = node.func.id
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except (SyntaxError, ValueError) as e:
            return ToolCall(error=f"malformed tool call: {str(e).splitlines()[0] if str(e) else 'does not parse'}")
    if name not in tools:
        return ToolCall(name=name, error=f"unknown tool '{name}'; tools: {', '.join(tools)}")
    try:
        bound = inspect.signature(tools[name]).bind(*args, **kwargs)
    except TypeError as e:
        return ToolCall(name=name, error=f"bad arguments for '{name}': {e}")
    return ToolCall(name=name, arguments=dict(bound.arguments))


def parse_tool_calls(text: str, tools: dict[str, Callable]) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in ``text``, in order; an opening tag without its closing tag is one
    malformed call."""
    calls = [_parse_one(m.group(1), tools) for m in _CALL_RE.finditer(text)]
    if text.count(OPEN) > text.count(CLOSE):
        calls.append(ToolCall(error="malformed tool call: unclosed <tool_call>"))
    return calls


def run_tool(fn: Callable, arguments: dict, timeout: float) -> tuple[str, bool]:
    """(result text, ok): ``fn(**arguments)`` in a daemon thread; an exception or a run past ``timeout`` seconds
    gives ``('error: ...', False)`` and the thread is abandoned."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(**arguments)
        except BaseException as e:  # noqa: BLE001 - a tool's failure is reported to the model, never raised
            box["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=target, daemon=True, name=f"postrl-tool-{getattr(fn, '__name__', 'tool')}")
    t.start()
    t.join(timeout)
    if t.is_alive():
        return f"error: tool '{fn.__name__}' timed out after {timeout:g}s", False
    if "error" in box:
        return f"error: {box['error']}", False
    return str(box.get("value")), True


class ToolEnvironment(Environment):
    """An episode in which the model may call ``tools`` before it answers; the answer turn is verified.

    Each model turn: the tool calls in it (:func:`parse_tool_calls`) are executed (:func:`run_tool`) and their
    results, each formatted with ``result_format``, joined, are the next observation (role ``tool`` under a chat
    template); reward None, not done. A turn without a tool call is the answer: reward ``verify(answer, row)``,
    done. After ``max_calls`` tool calls in an episode further calls are refused (tool errors). ``info`` counts
    ``tool_calls``, ``tool_errors``, ``malformed_calls`` of the turn.
    """

    observation_role = "tool"

    def __init__(self, tools: list[Callable], *, timeout: float = 5.0, max_calls: int = 8,
                 result_format: str = "<result>{}</result>"):
        if timeout <= 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout}")
        self.tools = list(tools)
        self._by_name = {fn.__name__: fn for fn in self.tools}
        self.timeout, self.max_calls, self.result_format = float(timeout), int(max_calls), result_format
        self.row: dict = {}
        self.calls = 0

    def reset(self, row: dict) -> str:
        self.row, self.calls = dict(row), 0
        return str(row["prompt"])

    def verify(self, answer: str, row: dict) -> float | None:
        """The reward of the final answer (override); default None (no reward)."""
        return None

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        calls = parse_tool_calls(action, self._by_name)
        info = {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0}
        if not calls:
            return "", self.verify(action, self.row), True, info
        results = []
        for c in calls:
            if c.error:
                info["malformed_calls"] += 1
                results.append(f"error: {c.error}")
                continue
            info["tool_calls"] += 1
            self.calls += 1
            if self.calls > self.max_calls:
                info["tool_errors"] += 1
                results.append(f"error: more than {self.max_calls} tool calls")
                continue
            text, ok = run_tool(self._by_name[c.name], c.arguments or {}, self.timeout)
            info["tool_errors"] += int(not ok)
            results.append(text)
        return "".join(self.result_format.format(r) for r in results), None, False, info
