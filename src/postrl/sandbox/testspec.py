"""Normalising a row's ``tests`` into test units the sandbox harness runs.

Accepted forms of ``tests`` (a JSON string of a list or dict is parsed first):

- **Python test source** (a string): every top-level ``def test_*()`` is one test (the whole source runs first, as
  set-up); without any, every top-level ``assert`` statement is one test (the statements before it run first, in
  order). Anything else collects no test.
- **a list of Python snippets** (strings): each snippet is one test; it passes when it runs without an exception.
- **stdin/stdout cases**: a list of ``{"input": str, "output": str}`` (or ``stdin``/``stdout``) dicts or of
  ``[input, output]`` string pairs, or an APPS-style ``{"inputs": [...], "outputs": [...]}`` dict. The program runs
  once per case with the input on stdin; it passes when its stdout matches (trailing whitespace per line and
  trailing blank lines ignored, else whitespace-separated tokens equal).
- **function-call cases**: ``{"fn_name": name, "inputs": [[args...], ...], "outputs": [expected, ...]}`` (APPS);
  the function is called with the arguments and the result must equal the expected value as plain JSON data
  (tuples read as lists; an object of any other type never passes, so an ``__eq__`` that always answers True
  cannot fake a pass). As in APPS, an expected value wrapped in a one-element list also matches the bare value.

:func:`collect` returns ``{"kind": "asserts" | "stdio" | "calls", ...}`` with ``units`` (one per test); the
number of units is the test total, fixed here, outside the sandbox, before the candidate runs.
"""

from __future__ import annotations

import ast
import hashlib
import json
from typing import Any

from postrl.sandbox.errors import SandboxDataError


def _parse_json(tests: str) -> Any:
    s = tests.strip()
    if s[:1] in "[{":
        try:
            return json.loads(s)
        except ValueError:
            return None
    return None


def _source_units(src: str) -> dict:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError) as e:
        raise SandboxDataError(f"tests: the test source does not parse ({type(e).__name__}: {e})") from None
    fns = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
           and n.name.startswith("test")]
    if fns:
        return {"kind": "asserts", "setup": src, "units": [{"name": f, "fn": f} for f in dict.fromkeys(fns)]}
    units, pre = [], []
    lines = src.splitlines(keepends=True)

    def seg(node: ast.stmt) -> str:
        return "".join(lines[node.lineno - 1: node.end_lineno])

    for node in tree.body:
        if isinstance(node, ast.Assert):
            units.append({"name": f"assert@{node.lineno}", "pre": "".join(pre), "src": seg(node).strip()})
            pre = []
        else:
            pre.append(seg(node))
    return {"kind": "asserts", "setup": "", "units": units}


def _stdio(cases: list) -> dict:
    units = []
    for i, c in enumerate(cases):
        if isinstance(c, dict):
            inp = c.get("input", c.get("stdin"))
            out = c.get("output", c.get("stdout", c.get("expected")))
        elif isinstance(c, (list, tuple)) and len(c) == 2:
            inp, out = c
        else:
            raise SandboxDataError(f"tests[{i}]: expected a Python snippet, an {{input, output}} dict or an "
                                   f"[input, output] pair, got {type(c).__name__}")
        if not isinstance(inp, str) or not isinstance(out, str):
            raise SandboxDataError(f"tests[{i}]: stdin/stdout case needs string input and output")
        units.append({"name": f"case{i}", "input": inp, "output": out})
    return {"kind": "stdio", "units": units}


def collect(tests: Any) -> dict:
    """The test units of one row's ``tests`` (see the module docstring); raises
    :class:`~postrl.sandbox.errors.SandboxDataError` for a malformed value."""
    if isinstance(tests, str):
        parsed = _parse_json(tests)
        if parsed is None:
            return _source_units(tests)
        tests = parsed
    if isinstance(tests, dict):
        ins, outs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise SandboxDataError("tests: a dict needs 'inputs' and 'outputs' lists of the same length")
        fn = tests.get("fn_name")
        if fn:
            if not isinstance(fn, str) or not fn.isidentifier():
                raise SandboxDataError(f"tests: fn_name {fn!r} is not a Python identifier")
            units = [{"name": f"call{i}", "args": a if isinstance(a, list) else [a], "expected": o}
                     for i, (a, o) in enumerate(zip(ins, outs))]
            return {"kind": "calls", "fn_name": fn, "units": units}
        return _stdio([[a, o] for a, o in zip(ins, outs)])
    if isinstance(tests, (list, tuple)):
        tests = list(tests)
        if all(isinstance(t, str) for t in tests):
            return {"kind": "asserts", "setup": "",
                    "units": [{"name": f"snippet{i}", "pre": "", "src": t} for i, t in enumerate(tests)]}
        return _stdio(tests)
    raise SandboxDataError(f"tests: expected a string, list or dict, got {type(tests).__name__}")


def unit_keys(tests: Any) -> list[str]:
    """A stable key per test unit (problem digest + unit name), for statistics kept across training steps."""
    spec = collect(tests)
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    digest = hashlib.sha1(blob).hexdigest()[:16]
    return [f"{digest}:{u['name']}" for u in spec["units"]]
