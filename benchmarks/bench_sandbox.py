"""Throughput of the code sandbox pool: programs per second.

    .venv/bin/python benchmarks/bench_sandbox.py [--workers N] [--trivial 200] [--tested 50] [--mode auto]

Runs ``--trivial`` one-line programs (``print(i)``), then ``--tested`` programs each checked against 5 assert-style
test functions, then ``--tested`` stdin/stdout programs with 5 cases each, on a ``SandboxPool`` (default
``os.cpu_count()`` workers), and prints one line per kind: count, wall seconds, programs/s, mean latency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from postrl.sandbox import Limits, SandboxPool, capabilities

TESTS = "".join(f"def test_{i}():\n    assert add({i}, {i + 1}) == {2 * i + 1}\n\n" for i in range(5))
STDIO = [[f"{i} {i + 1}\n", f"{2 * i + 1}\n"] for i in range(5)]


def bench(pool: SandboxPool, name: str, codes: list[str], tests: list | None) -> dict:
    t0 = time.perf_counter()
    res = pool.map(codes, tests)
    wall = time.perf_counter() - t0
    bad = [r for r in res if r.status != "ok"]
    row = {"kind": name, "programs": len(codes), "wall_s": round(wall, 2),
           "programs_per_s": round(len(codes) / wall, 1),
           "mean_latency_s": round(sum(r.time for r in res) / len(res), 3), "not_ok": len(bad)}
    if bad:
        row["first_not_ok"] = f"{bad[0].status}: {bad[0].reason}"
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--trivial", type=int, default=200)
    ap.add_argument("--tested", type=int, default=50)
    ap.add_argument("--mode", default=None, choices=("auto", "bwrap", "namespaces", "fallback"))
    a = ap.parse_args(argv)
    caps = capabilities(a.mode)
    limits = Limits(timeout=30.0, memory_mb=256)
    with SandboxPool(a.workers, limits=limits, mode=a.mode) as pool:
        print(json.dumps({"mode": caps["mode"], "variant": caps["variant"], "workers": pool.workers,
                          "cpus": os.cpu_count(), "python": sys.version.split()[0]}), flush=True)
        bench(pool, "trivial", [f"print({i})" for i in range(a.trivial)], None)
        bench(pool, "asserts x5", ["def add(a, b):\n    return a + b\n"] * a.tested, [TESTS] * a.tested)
        bench(pool, "stdio x5", ["a, b = map(int, input().split())\nprint(a + b)\n"] * a.tested,
              [STDIO] * a.tested)
    return 0


if __name__ == "__main__":
    sys.exit(main())
