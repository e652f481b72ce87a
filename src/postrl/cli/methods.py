"""``postrl methods [NAME]``: the registered stages; with NAME, one stage's description, source and parameters.

A stage's parameters are its keyword-only arguments (after ``*``; a class stage: those of ``__init__``), the
whole schema that ``stages.check_params`` validates a config against; each is listed with its type, range or
choices (from its annotation: ``float, >= 0 and < 1``, ``"group" / "none"``) and default (``required`` when it has
none); then the parameters of the producers of the fields it reads (:mod:`postrl.fields`), which the same config
entry sets.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from typing import Any

from postrl.cli.common import add_import_paths
from postrl.errors import PostrlError
from postrl import registry

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def type_text(ann: Any) -> str:
    """A parameter's annotation in words: ``float, >= 0 and < 1``, ``"group" / "none"``, ``list of str``,
    ``null or int, >= 1``, ``str, a valid regular expression`` (an ``AfterValidator``'s docstring)."""
    if ann is Any or ann is inspect.Parameter.empty:
        return "any"
    if isinstance(ann, str):
        return ann
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        base, notes = type_text(args[0]), []
        bounds = []
        for meta in ann.__metadata__:
            for attr, op in _BOUNDS:
                v = getattr(meta, attr, None)
                if v is not None and not callable(v):
                    bounds.append(f"{op} {_num(v)}")
            n = getattr(meta, "min_length", None)
            if n is not None:
                notes.append(("non-empty" if n == 1 else f"at least {n} characters") if args[0] is str
                             else f"at least {n} item{'s' if n != 1 else ''}")
            func = getattr(meta, "func", None)
            if callable(func) and inspect.getdoc(func):
                notes.append(inspect.getdoc(func).splitlines()[0].rstrip("."))
        return ", ".join([base, *([" and ".join(bounds)] if bounds else []), *notes])
    if origin is typing.Literal:
        return " / ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = " or ".join(type_text(a) for a in rest)
        return f"null or {inner}" if len(rest) < len(args) else inner
    if origin in (list, tuple, set, frozenset):
        items = [a for a in args if a is not Ellipsis]
        if origin is tuple and len(items) > 1 and Ellipsis not in args:
            return "list of " + ", ".join(_item(a) for a in items)
        return f"list of {_item(items[0])}" if items else "list"
    if origin is dict or ann is dict:
        return f"mapping of {_item(args[0])} to {_item(args[1])}" if args else "mapping"
    return getattr(ann, "__name__", str(ann))


def _item(ann: Any) -> str:
    """The words for an item of a list or mapping, in parentheses when they hold a comma."""
    t = type_text(ann)
    return f"({t})" if ", " in t else t


def stage_parameters(fn) -> list[dict]:
    """[{name, type, default, required}] of the stage ``fn``'s keyword-only parameters, in declaration order, the
    type in words with its range or choices (:func:`type_text`); a ``**kwargs`` catch-all is listed as ``**name``
    with type ``any keyword``."""
    from postrl import stages

    target = fn.__init__ if inspect.isclass(fn) else fn
    resolved = stages.parameters(fn)
    out = []
    for p in inspect.signature(target).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            out.append({"name": f"**{p.name}", "type": "any keyword", "default": None, "required": False})
        elif p.kind is p.KEYWORD_ONLY:
            ann = resolved.get(p.name, (Any,))[0]
            typ = type_text(p.annotation if ann is Any and p.annotation is not p.empty else ann)
            req = p.default is p.empty
            out.append({"name": p.name, "type": typ, "default": None if req else p.default, "required": req})
    return out


def _entries(name: str, kind: str | None) -> list:
    if ":" in name:  # a user's stage by import path, resolved like a config's
        return [registry.entry(kind or "reward", name)]
    found = [e for e in registry.all_entries() if e.name == name and (kind is None or e.kind == kind)]
    if not found:
        where = f" of kind '{kind}'" if kind else ""
        raise PostrlError(f"no stage '{name}'{where}; `postrl methods` lists them (or give an import path "
                          "'module:function')")
    return found


def _describe(e) -> dict:
    from postrl import stages

    fn = e.fn
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    params = stage_parameters(fn)
    own = {p["name"] for p in params}
    for field in dict.fromkeys(stages.producer_parameters(fn).values()):  # set in the same entry
        params += [{**p, "field": field} for p in stage_parameters(registry.get("field", field))
                   if p["name"] not in own]
    return {"kind": e.kind, "name": e.name, "description": inspect.getdoc(fn) or e.description,
            "source": e.source, "defined_in": f"{mod}:{qual}", "parameters": params}


def _render(d: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{d['kind']} {d['name']}[/]  ({d['defined_in']})", highlight=False)
    if d["source"]:
        con.print(f"source: {d['source']}", markup=False, highlight=False)
    con.print(d["description"] or "(no description)", markup=False, highlight=False)
    if not d["parameters"]:
        con.print("parameters: none", highlight=False)
        return
    first = next((p["name"] for p in d["parameters"] if not p["name"].startswith("**")), "KEY")
    con.print(f"parameters (in a config, beside the name: {{name: {d['name']}, {first}: ...}}):", markup=False,
              highlight=False)
    t = Table(header_style="bold")
    for c in ("parameter", "type", "default"):
        t.add_column(c)
    for p in d["parameters"]:
        typ = p["type"] + (f" (of the field {p['field']})" if p.get("field") else "")
        t.add_row(p["name"], typ, "required" if p["required"] else repr(p["default"]))
    con.print(t)


def run(args) -> int:
    if args.kind is not None and args.kind not in registry.KINDS:
        raise PostrlError(f"--kind '{args.kind}': valid kinds: {', '.join(registry.KINDS)}")
    if args.name is not None:
        add_import_paths()
        found = [_describe(e) for e in _entries(args.name, args.kind)]
        if args.json:
            print(json.dumps(found if len(found) > 1 else found[0], indent=1, default=repr))
        else:
            for d in found:
                _render(d)
        return 0
    entries = [e for e in registry.all_entries() if args.kind is None or e.kind == args.kind]
    if args.json:
        print(json.dumps([{"kind": e.kind, "name": e.name, "description": e.description, "source": e.source}
                          for e in entries], indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(header_style="bold")
    for c in ("kind", "name", "description", "source"):
        t.add_column(c)
    for e in entries:
        t.add_row(e.kind, e.name, e.description, e.source)
    Console().print(t)
    return 0


def add_parser(sub) -> None:
    m = sub.add_parser("methods",
                       help="list registered stages; NAME: one stage's parameters, types, ranges and defaults",
                       description="Without NAME: every registered stage with its description and source. With "
                       "NAME (a registered name, or an import path module:function): its full description, source, "
                       "and each parameter (the keys of its 'params' in a config) with type, range or choices, and "
                       "default.")
    m.add_argument("name", nargs="?", metavar="NAME", help="one stage (all kinds that have it, unless --kind)")
    m.add_argument("--kind", help="only this stage kind")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=run)
