"""Text-to-SQL reward: run the predicted and the gold SQL on the row's SQLite database in the sandbox.

The predicted SQL is model-written, so it never runs in the trainer's process: both queries run in the code sandbox
(:mod:`postrl.sandbox`, the pool the code rewards share), inside a fixed runner program that receives the database
on its standard input and opens it in memory (the sandbox sees no file of the host). The runner installs an SQLite
authorizer that allows reading only (SELECT, reading columns, functions, recursive CTEs): a statement that writes,
attaches another database, changes a pragma or opens a transaction fails to compile, as does a second statement.
It reports, on its standard output, each stage it reached; the comparison of the two result sets happens there too,
so only a verdict leaves the sandbox.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Literal

from annotated_types import Ge, Le

from postrl.registry import register
from postrl.rewards.code import Isolation, MemoryMB, Timeout, _check_isolation, _limits, sandbox_errors
from postrl.sandbox import SandboxResult, default_pool

_SQL_FENCE = re.compile(r"```[ \t]*sql[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

# The program that runs in the sandbox (trusted; the SQL it executes is not). Input on stdin: one JSON object
# {"db": base64 of the database file, "gold": sql, "pred": sql, "compare": "set" | "multiset" | "ordered"}.
# Output: one JSON line per stage reached: {"stage": "gold_ok"}, then {"stage": "done", "match": bool}, or
# {"stage": "gold" | "pred", "error": "..."} when that query fails.
RUNNER = r'''
import base64, json, sqlite3, sys
from collections import Counter

def say(**kw):
    print(json.dumps(kw), flush=True)

req = json.loads(sys.stdin.read())
con = sqlite3.connect(":memory:")
con.deserialize(base64.b64decode(req["db"]))
con.execute("PRAGMA query_only = ON")
ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
           getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
con.set_authorizer(lambda action, *_: sqlite3.SQLITE_OK if action in ALLOWED else sqlite3.SQLITE_DENY)

def rows(sql):
    cur = con.cursor()
    cur.execute(sql)
    return cur.fetchall()

def same(a, b, mode):
    if mode == "ordered":
        return a == b
    if mode == "multiset":
        return Counter(a) == Counter(b)
    return set(a) == set(b)

try:
    gold = rows(req["gold"])
except Exception as e:
    say(stage="gold", error=f"{type(e).__name__}: {e}"[:300])
    sys.exit(0)
say(stage="gold_ok")
try:
    pred = rows(req["pred"])
except Exception as e:
    say(stage="pred", error=f"{type(e).__name__}: {e}"[:300])
    sys.exit(0)
say(stage="done", match=bool(same(pred, gold, req["compare"])))
'''

_DB_CACHE: "OrderedDict[tuple, str]" = OrderedDict()
_DB_LOCK = threading.Lock()
_DB_CACHE_SIZE = 8


def _db_b64(path: str) -> str:
    """The database file as base64 (cached per path, size and modification time)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    with _DB_LOCK:
        hit = _DB_CACHE.get(key)
        if hit is not None:
            _DB_CACHE.move_to_end(key)
            return hit
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    with _DB_LOCK:
        _DB_CACHE[key] = data
        while len(_DB_CACHE) > _DB_CACHE_SIZE:
            _DB_CACHE.popitem(last=False)
    return data


def extract_sql(text: str, *, answer_tag: bool = False) -> str | None:
    """The predicted SQL: the last ```sql fenced block (Arctic-Text2SQL-R1's parser), stripped; with
    ``answer_tag``, the last such block inside the last ``<answer>...</answer>``. None when there is none (or it is
    empty)."""
    region = text or ""
    if answer_tag:
        m = _ANSWER.findall(region)
        if not m:
            return None
        region = m[-1]
    blocks = _SQL_FENCE.findall(region)
    sql = blocks[-1].strip() if blocks else ""
    return sql or None


def _verdict(r: SandboxResult) -> tuple[str, object]:
    """('done', match) | ('pred_error', why) | ('pred_died', why) | ('gold_error', why) | ('no_gold', why)."""
    stages = []
    for line in (r.stdout or "").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            stages.append(obj)
    last = stages[-1] if stages else {}
    if last.get("stage") == "done":
        return "done", bool(last.get("match"))
    if last.get("stage") == "pred":
        return "pred_error", last.get("error", "")
    if last.get("stage") == "gold":
        return "gold_error", last.get("error", "")
    if any(s.get("stage") == "gold_ok" for s in stages):  # the predicted query hit a limit (time, memory, output)
        return "pred_died", f"{r.status}: {r.reason}"
    return "no_gold", f"{r.status}: {r.reason}"


@register("reward", "sql_execution", source="Arctic-Text2SQL-R1: Simple Rewards, Strong Reasoning in Text-to-SQL",
          needs=("sandbox",))
def sql_execution(prompts, completions, db_path=None, gold_sql=None, answer=None, *,
                  valid_reward: Annotated[float, Ge(0), Le(1)] = 0.1,
                  compare: Literal["set", "multiset", "ordered"] = "set", answer_tag: bool = False,
                  db_root: str | None = None, timeout: Timeout = 10.0, memory_mb: MemoryMB = 512,
                  isolation: Isolation = None):
    """Text-to-SQL by execution: 1 if the predicted SQL returns the gold result, ``valid_reward`` if it runs, else 0.

    Arctic-Text2SQL-R1 (the abstract: "a lightweight reward signal based solely on execution correctness", no
    intermediate supervision; the paper's levels: an executable query in the right format earns 0.1, a correct
    execution 1):

        r = 1              if rows(pred) == rows(gold) on the row's database
        r = valid_reward   if pred runs without error (but returns another result)
        r = 0              if there is no ```sql block (the format), pred does not run, or it hits a limit

    pred = the last ```sql fenced block of the completion (the authors' parser; with ``answer_tag`` it must be
    inside the last ``<answer>...</answer>``); gold = the row's ``gold_sql`` column (else its ``answer``); the
    database = the SQLite file in the row's ``db_path`` column (relative paths are under ``db_root`` when set).
    ``compare``: 'set' (default; the authors' BIRD evaluation: ``set(pred_rows) == set(gold_rows)``, order and
    duplicates ignored), 'multiset' (duplicates count) or 'ordered' (the row lists are equal). Defaults:
    valid_reward 0.1, timeout 10 s for the whole run (both queries), memory 512 MB (the database is loaded in
    memory: its size counts). Both queries run in the sandbox, read-only (see the module docstring); a query that
    writes, attaches or runs several statements does not run (0). A failed entry (counted and excluded, never 0,
    with the reason) for a row without a database or gold SQL, a database file that does not exist, a gold SQL
    that fails on its database, or a run that fails before the gold SQL has run (the sandbox itself, or a
    database too large for ``memory_mb``).
    """
    _check_isolation(isolation)
    limits = _limits(timeout, memory_mb, None)
    n = len(completions)
    dbs = db_path if db_path is not None else [None] * n
    golds = gold_sql if gold_sql is not None else (answer if answer is not None else [None] * n)
    out: list = [None] * n
    futs: dict[int, object] = {}
    with sandbox_errors():
        pool = default_pool()
        for i, (c, db, gold) in enumerate(zip(completions, dbs, golds)):
            if not db or not gold:
                out[i] = ValueError("sql_execution: the row has no " + ("'db_path'" if not db else
                                                                       "'gold_sql' (or 'answer')"))
                continue
            path = str(Path(db_root) / db) if db_root and not os.path.isabs(str(db)) else str(db)
            if not os.path.isfile(path):
                out[i] = ValueError(f"sql_execution: database '{path}' does not exist")
                continue
            pred = extract_sql(c, answer_tag=answer_tag)
            if pred is None:
                out[i] = 0.0
                continue
            stdin = json.dumps({"db": _db_b64(path), "gold": str(gold), "pred": pred, "compare": compare})
            futs[i] = pool.submit(RUNNER, stdin=stdin, limits=limits, mode=isolation)
        for i, f in futs.items():
            r = f.result()
            kind, info = _verdict(r)
            if r.status == "error" and kind not in ("done", "pred_error"):
                out[i] = ValueError(f"sql_execution: the sandbox failed: {r.reason}")
            elif kind == "done":
                out[i] = 1.0 if info else float(valid_reward)
            elif kind in ("pred_error", "pred_died"):
                out[i] = 0.0
            elif kind == "gold_error":
                out[i] = ValueError(f"sql_execution: the gold SQL fails on '{dbs[i]}': {info}")
            else:
                out[i] = ValueError(f"sql_execution: the database '{dbs[i]}' could not be loaded ({info})")
    return out


__all__ = ["sql_execution", "extract_sql", "RUNNER"]
