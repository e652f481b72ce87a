"""``postrl sandbox FILE.py [--tests TESTS] [--timeout S] [--memory MB]``: run one program in the sandbox."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from postrl.errors import PostrlError


def _read(path: str, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise PostrlError(f"{what} '{path}': no such file")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PostrlError(f"{what} '{path}': cannot read it ({type(e).__name__}: {e})") from None


def cmd_sandbox(args) -> int:
    from postrl.rewards.code import sandbox_errors

    with sandbox_errors():
        return _sandbox(args)


def _sandbox(args) -> int:
    from postrl.sandbox import Limits, capabilities, run

    if args.capabilities:
        caps = capabilities(args.isolation)
        print(json.dumps({k: v for k, v in caps.items() if k != "warning"}, indent=1))
        return 0
    if args.file is None:
        raise PostrlError("sandbox: give the program FILE.py (or --capabilities)")
    code = _read(args.file, "program")
    tests = None
    if args.tests is not None:
        tests = _read(args.tests, "--tests")
        if args.tests.endswith(".json"):
            try:
                tests = json.loads(tests)
            except ValueError as e:
                raise PostrlError(f"--tests '{args.tests}': not valid JSON ({e})") from None
    stdin = _read(args.stdin, "--stdin") if args.stdin else None
    limits = Limits(timeout=args.timeout, memory_mb=args.memory, output_bytes=args.max_output,
                    test_timeout=args.test_timeout)
    stem = Path(args.file).stem
    res = run(code, tests, stdin=stdin, limits=limits, mode=args.isolation,
              module=stem if stem.isidentifier() else "solution")
    d = res.to_dict()
    keys = ("status", "exit_code", "passed", "total", "stdout", "stderr", "time", "reason", "mode", "tests")
    print(json.dumps({k: d[k] for k in keys}))
    return 0 if res.status == "ok" else 1


def add_parser(sub) -> None:
    s = sub.add_parser(
        "sandbox", help="run a Python program (optionally against tests) in the code sandbox; prints one JSON object",
        description="Run FILE.py in the code sandbox and print ONE JSON object: status, exit_code, passed, total, "
                    "stdout, stderr (truncated), time, reason. Exit status 0 when status is ok, 1 otherwise. "
                    "TESTS: a Python file of test_* functions or top-level asserts (it sees the program's names "
                    "directly, or imports them: 'from prog import add' for prog.py, or 'from solution import add'), "
                    "or a .json list of [stdin, stdout] cases / {fn_name, inputs, outputs}.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("file", nargs="?", metavar="FILE.py")
    s.add_argument("--tests", metavar="TESTS", help="tests to run the program against")
    s.add_argument("--timeout", type=float, default=10.0, metavar="S", help="wall seconds for the run (default 10)")
    s.add_argument("--memory", type=int, default=512, metavar="MB",
                   help="address space per process, and the whole run's memory where a cgroup can be made "
                        "(default 512)")
    s.add_argument("--test-timeout", type=float, default=None, metavar="S", help="wall seconds per test")
    s.add_argument("--max-output", type=int, default=64 * 1024, metavar="BYTES",
                   help="stdout/stderr cap; more kills the run (default 65536)")
    s.add_argument("--stdin", metavar="FILE", help="feed FILE to the program's stdin (plain run)")
    s.add_argument("--isolation", choices=("auto", "bwrap", "namespaces", "fallback"), default=None,
                   help="sandbox mode (default: POSTRL_SANDBOX or auto)")
    s.add_argument("--capabilities", action="store_true",
                   help="print what this machine enforces (isolation, limits, the seccomp filter) and exit")
    s.set_defaults(fn=cmd_sandbox)
