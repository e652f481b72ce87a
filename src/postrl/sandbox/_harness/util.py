"""Harness helpers: the report's JSON, the spec's framing, libc (``prctl``), the process table, wait statuses.

Built-in modules only (see the package docstring). The host's teardown (:mod:`postrl.sandbox.launch`) uses the
process table helpers too.
"""

import os
import sys

MSG_MAX = 400
MAXFD = 65536
SIG = {"KILL": 9, "XCPU": 24, "XFSZ": 25, "names": {}}  # replaced by the host's values (spec["signals"])

_ESC = {i: "\\u%04x" % i for i in range(32)}
_ESC[ord('"')] = '\\"'
_ESC[ord("\\")] = "\\\\"


def jdump(x):
    """JSON text of plain data (the json module would import re and enum: too slow for every run)."""
    if x is None:
        return "null"
    if x is True:
        return "true"
    if x is False:
        return "false"
    t = type(x)
    if t is int:
        return str(x)
    if t is float:
        return repr(x) if x == x and x not in (float("inf"), float("-inf")) else "null"
    if t is str:
        return '"' + x.encode("utf-8", "replace").decode("utf-8").translate(_ESC) + '"'
    if t is list or t is tuple:
        return "[" + ",".join(jdump(v) for v in x) + "]"
    if t is dict:
        return "{" + ",".join(jdump(str(k)) + ":" + jdump(v) for k, v in x.items()) + "}"
    return jdump(str(x))


def short(text, n=MSG_MAX):
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def unhex(text):
    try:
        return bytes.fromhex(text).decode("utf-8", "replace")
    except ValueError:
        return "(unreadable message)"


def read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(65536, n - got))
        if not b:
            raise EOFError("spec truncated")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_line(fd, limit=128):
    out = b""
    while not out.endswith(b"\n"):
        b = os.read(fd, 1)
        if not b or len(out) > limit:
            break
        out += b
    return out.strip()


_LIBC = []


def get_libc():
    if not _LIBC:
        try:
            import ctypes

            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except Exception:  # noqa: BLE001 - no ctypes: that hardening is skipped, the rest still holds
            _LIBC.append(None)
    return _LIBC[0]


def prctl(*args):
    libc = get_libc()
    return -1 if libc is None else libc.prctl(*(list(args) + [0] * (5 - len(args))))


def proc_scan():
    """(pid, ppid, real uid, threads) of every process visible in /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/status" % name) as f:
                st = f.read()
        except OSError:
            continue
        ppid = uid = None
        threads = 1
        for line in st.splitlines():
            if line.startswith("PPid:"):
                ppid = int(line.split()[1])
            elif line.startswith("Uid:"):
                uid = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        out.append((int(name), ppid, uid, threads))
    return out


def count_tasks(uid):
    """Tasks (processes and threads) owned by ``uid`` that this process can see: the RLIMIT_NPROC baseline."""
    return sum(t for _, _, u, t in proc_scan() if u == uid)


def descendants(root):
    kids = {}
    for pid, ppid, _, _ in proc_scan():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_pids(pids):
    for p in pids:
        try:
            os.kill(p, SIG["KILL"])
        except OSError:
            pass


def exit_of(st):
    """(exit code, signal) of a wait status."""
    if os.WIFSIGNALED(st):
        return None, os.WTERMSIG(st)
    return os.WEXITSTATUS(st), None


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass

