"""postrl sandbox harness: the trusted supervisor that runs INSIDE the sandbox.

Started by :mod:`postrl.sandbox.core` as ``python -I -S -c <this file> REPORT_FD`` with the run's spec on stdin
(``<length>\\n<marshal blob>`` then a one-line nonce). It imports only built-in modules (no json, re, enum,
subprocess: interpreter start-up is most of a sandbox run's cost). It

1. drops to the sandbox uid when it starts as root (no-new-privs, bounding set cleared, not dumpable, so the
   program cannot read its memory or descriptors through /proc or ptrace);
2. runs the program in a child process (its own session) under rlimits: address space, CPU seconds, file size,
   processes, open files, no core dumps:

   - ``run``: a forked child executes the program as ``__main__`` (stdout/stderr go straight to the host);
   - ``stdio``: one fresh ``python main.py`` per case (exec'd, so it holds none of the expected outputs); the
     harness itself compares the output;
   - ``asserts`` / ``calls``: a forked checker runs the tests in order and reports each result on a private pipe;
     the program runs in a separate, fresh interpreter (``_SERVER_SRC``, exec'd, so it holds none of the tests or
     expected values) as module ``solution``, and the tests reach its names through remote handles: a call, an
     attribute read or an iteration is a request, and the answer is plain data of exact built-in types (or
     another handle, which equals only itself). The harness (not the checker) was told how many tests there
     are, so a checker that dies leaves the remaining tests failed, never passed; a program process that ends
     mid-test fails that test and the next one gets a fresh program process; a test that (with a per-test
     timeout) hangs fails alone and the rest run in a fresh checker;

3. reads the nonce only after every child has been started, and writes ONE JSON report, tagged with it, on
   REPORT_FD (a descriptor no program process holds). The host accepts nothing else as a result; text the program
   prints, whatever it looks like, is just output.

Nothing the program does to its own interpreter reaches a verdict: rebinding builtins, walking frames to the
reporting code, or objects with overridden comparison (an object that is not plain data comes back as a handle,
which compares equal to nothing but itself). What the tests cannot do through handles: mutate an argument in place
and look at it afterwards (arguments are copies), or pass functions to the program (only plain data and handles).
"""

import errno
import marshal
import os
import resource
import select
import sys
import time

_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 4, 24, 36, 38
_MSG_MAX = 400
_MAXFD = 65536
SIG = {"KILL": 9, "XCPU": 24, "XFSZ": 25, "names": {}}  # replaced by the host's values (spec["signals"])

_ESC = {i: "\\u%04x" % i for i in range(32)}
_ESC[ord('"')] = '\\"'
_ESC[ord("\\")] = "\\\\"


def _jdump(x):
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
        return "[" + ",".join(_jdump(v) for v in x) + "]"
    if t is dict:
        return "{" + ",".join(_jdump(str(k)) + ":" + _jdump(v) for k, v in x.items()) + "}"
    return _jdump(str(x))


def _short(text, n=_MSG_MAX):
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _unhex(text):
    try:
        return bytes.fromhex(text).decode("utf-8", "replace")
    except ValueError:
        return "(unreadable message)"


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(65536, n - got))
        if not b:
            raise EOFError("spec truncated")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read_line(fd, limit=128):
    out = b""
    while not out.endswith(b"\n"):
        b = os.read(fd, 1)
        if not b or len(out) > limit:
            break
        out += b
    return out.strip()


_LIBC = []


def _libc():
    if not _LIBC:
        try:
            import ctypes

            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except Exception:  # noqa: BLE001 - no ctypes: that hardening is skipped, the rest still holds
            _LIBC.append(None)
    return _LIBC[0]


def _prctl(*args):
    libc = _libc()
    return -1 if libc is None else libc.prctl(*(list(args) + [0] * (5 - len(args))))


def _harden(spec):
    """Drop root (when started as root), forbid privilege gain, make this process unreadable to the program.

    ``prctl`` needs ctypes (slow to import), so it is used only where it adds something: not under privileged
    bubblewrap, which already set no-new-privs, and where the uid change itself clears dumpability.
    """
    uid, gid, full = spec.get("uid"), spec.get("gid"), spec.get("harden_prctl", True)
    if full:
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if uid is not None and os.geteuid() == 0:
        if full:
            for cap in range(64):
                if _prctl(_PR_CAPBSET_DROP, cap) != 0 and cap > 40:
                    break
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise RuntimeError("could not drop to the sandbox uid")
    try:
        with open("/proc/sys/fs/suid_dumpable") as f:
            suid_dumpable = f.read().strip()
    except OSError:
        suid_dumpable = "?"
    if full or uid is None or suid_dumpable != "0":
        _prctl(_PR_SET_DUMPABLE, 0)
    if full:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _proc_scan():
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


def _count_tasks(uid):
    """Tasks (processes and threads) owned by ``uid`` that this process can see: the RLIMIT_NPROC baseline."""
    return sum(t for _, _, u, t in _proc_scan() if u == uid)


def _descendants(root):
    kids = {}
    for pid, ppid, _, _ in _proc_scan():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(pids):
    for p in pids:
        try:
            os.kill(p, SIG["KILL"])
        except OSError:
            pass


def _status(st):
    """(exit code, signal) of a wait status."""
    if os.WIFSIGNALED(st):
        return None, os.WTERMSIG(st)
    return os.WEXITSTATUS(st), None


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass


class Harness:
    def __init__(self, spec):
        self.spec = spec
        self.limits = spec["limits"]
        self.deadline = float(spec["deadline"])
        self.workdir = spec["workdir"]
        self.python = [spec["python"]] + list(spec.get("python_flags", []))
        self.nproc = None

    # ------------------------------------------------------------------ limits and processes

    def apply_limits(self):
        """rlimits for a program process (called in the child, after fork, before exec or import)."""
        L = self.limits

        def lim(res, soft, hard=None):
            hard = soft if hard is None else hard
            cur_soft, cur_hard = resource.getrlimit(res)
            if cur_hard != resource.RLIM_INFINITY:
                hard = min(hard, cur_hard)
                soft = min(soft, hard)
            try:
                resource.setrlimit(res, (soft, hard))
            except (ValueError, OSError):
                pass

        lim(resource.RLIMIT_CORE, 0)
        if L.get("memory_bytes"):
            lim(resource.RLIMIT_AS, int(L["memory_bytes"]))
        if L.get("cpu_seconds"):
            c = max(1, int(-(-float(L["cpu_seconds"]) // 1)))
            lim(resource.RLIMIT_CPU, c, c + 1)
        if L.get("file_bytes"):
            lim(resource.RLIMIT_FSIZE, int(L["file_bytes"]))
        if L.get("open_files"):
            lim(resource.RLIMIT_NOFILE, int(L["open_files"]))
        if self.nproc is not None:
            lim(resource.RLIMIT_NPROC, self.nproc)

    def fork_program(self, stdin_fd, stdout_fd=None, keep=()):
        """Fork a program process: own session, stdin/stdout redirected, every other descriptor closed, limits
        applied. Returns the pid in the parent and 0 in the child."""
        pid = os.fork()
        if pid:
            return pid
        try:
            os.setsid()
            os.dup2(stdin_fd, 0)
            if stdout_fd is not None:
                os.dup2(stdout_fd, 1)
            keep = sorted({0, 1, 2, *keep})
            for a, b in zip(keep, keep[1:] + [_MAXFD]):
                if b > a + 1:
                    os.closerange(a + 1, b)
            self.apply_limits()
        except BaseException:  # noqa: BLE001
            os._exit(127)
        return 0

    def exec_program(self, stdin_fd, stdout_fd):
        """A fresh ``python main.py`` (nothing of the harness's memory survives the exec)."""
        pid = self.fork_program(stdin_fd, stdout_fd)
        if pid == 0:
            try:
                os.execv(self.python[0], self.python + ["main.py"])
            finally:
                os._exit(127)
        return pid

    @staticmethod
    def kill_group(pid):
        for target in (lambda: os.killpg(pid, SIG["KILL"]), lambda: os.kill(pid, SIG["KILL"])):
            try:
                target()
            except OSError:
                pass

    def cleanup(self):
        """Kill every process the program left behind, then reap what was re-parented to this harness."""
        if self.spec.get("kill_all"):  # unique uid or own pid namespace: kill(-1) reaches only the sandbox
            try:
                os.kill(-1, SIG["KILL"])
            except OSError:
                pass
        end = time.time() + 1.0
        while True:
            _kill(_descendants(os.getpid()))
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                if time.time() > end:
                    break
                time.sleep(0.002)

    def signal_reason(self, sig):
        if sig == SIG["XCPU"]:
            return "timeout", "CPU-time limit (%ss) exceeded" % self.limits.get("cpu_seconds")
        if sig == SIG["XFSZ"]:
            return "error", "file-size limit exceeded"
        return "killed", "killed by %s" % SIG["names"].get(sig, "signal %d" % sig)

    # ------------------------------------------------------------------ modes

    def run_program(self):
        """Plain run: the program as ``__main__`` in a forked child; returns its exit code / signal."""
        data = self.spec.get("stdin")
        if data is not None:
            r, w = os.pipe()
        else:
            r, w = os.open(os.devnull, os.O_RDONLY), None
        pid = self.fork_program(r)
        if pid == 0:
            _run_main(self.spec["code"])
        os.close(r)
        status = None
        if w is not None:
            pending = memoryview(data.encode())
            os.set_blocking(w, False)
            while pending and status is None:
                _, wl, _ = select.select([], [w], [], 0.05)
                if wl:
                    try:
                        pending = pending[os.write(w, pending[:65536]):]
                    except OSError:
                        break
                wp, st = os.waitpid(pid, os.WNOHANG)
                if wp:
                    status = st
            os.close(w)
        if status is None:
            _, status = os.waitpid(pid, 0)
        code, sig = _status(status)
        return {"exit": code, "signal": sig}

    def _communicate(self, pid, w, r, data, out_limit, deadline):
        """Feed ``data`` to ``w``, read ``r`` up to ``out_limit`` bytes, until exit and EOF or ``deadline``."""
        out, pending = bytearray(), memoryview(data)
        os.set_blocking(w, False)
        if not pending:
            os.close(w)
            w = None
        why, status, exited_at = None, None, None
        while True:
            now = time.time()
            if status is None:
                wp, st = os.waitpid(pid, os.WNOHANG)
                if wp:
                    status, exited_at = st, now
            if status is not None and (r is None or now - exited_at > 0.05):
                break
            if now >= deadline:
                why = "time"
                break
            rl, wl = ([r] if r is not None else []), ([w] if w is not None else [])
            if not rl and not wl:
                time.sleep(0.002)
                continue
            rr, ww, _ = select.select(rl, wl, [], min(0.05, max(0.0, deadline - now)))
            if ww:
                try:
                    pending = pending[os.write(w, pending[:65536]):]
                except OSError:
                    pending = pending[:0]
                if not pending:
                    os.close(w)
                    w = None
            if rr:
                b = os.read(r, 65536)
                if not b:
                    os.close(r)
                    r = None
                else:
                    out += b
                    if len(out) > out_limit:
                        why = "output"
                        break
        self.kill_group(pid)
        for fd in (w, r):
            if fd is not None:
                os.close(fd)
        if status is None:
            _, status = os.waitpid(pid, 0)
        return bytes(out[:out_limit]), status, why

    @staticmethod
    def same_output(got, want):
        a = [ln.rstrip() for ln in got.splitlines()]
        b = [ln.rstrip() for ln in want.splitlines()]
        while a and not a[-1]:
            a.pop()
        while b and not b[-1]:
            b.pop()
        return a == b or got.split() == want.split()

    def run_stdio(self, units):
        results = []
        out_limit = int(self.limits.get("output_bytes") or 1 << 20)
        per_test = self.limits.get("test_timeout")
        for i, u in enumerate(units):
            now = time.time()
            if now >= self.deadline:
                results += [{"status": "timeout", "reason": "not run: wall-time limit reached"}
                            for _ in units[i:]]
                break
            dl = self.deadline if not per_test else min(self.deadline, now + float(per_test))
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            pid = self.exec_program(in_r, out_w)
            os.close(in_r)
            os.close(out_w)
            out, status, why = self._communicate(pid, in_w, out_r, u["input"].encode(), out_limit, dl)
            code, sig = _status(status)
            if why == "time":
                results.append({"status": "timeout", "reason": "wall-time limit reached"})
            elif why == "output":
                results.append({"status": "output_limit", "reason": "stdout over %d bytes" % out_limit})
            elif sig is not None:
                st, reason = self.signal_reason(sig)
                results.append({"status": st, "reason": reason})
            elif code != 0:
                results.append({"status": "error", "reason": "exit code %d" % code})
            elif self.same_output(out.decode("utf-8", "replace"), u["output"]):
                results.append({"status": "pass", "reason": ""})
            else:
                results.append({"status": "fail", "reason": _short("wrong output %r, expected %r"
                                                                   % (out[:120].decode("utf-8", "replace"),
                                                                      u["output"][:120]))})
        return results

    def check_imports(self):
        """Stage signal for stdio programs: do the program's top-level imports succeed? (forked child)."""
        src = self.spec.get("import_src") or ""
        if not src:
            return True
        null = os.open(os.devnull, os.O_RDWR)
        pid = self.fork_program(null, null)
        if pid == 0:
            try:
                os.dup2(0, 2)
                exec(compile(src, "main.py", "exec", dont_inherit=True), {"__name__": "solution"})
                os._exit(0)
            except BaseException:  # noqa: BLE001
                os._exit(1)
        os.close(null)
        status = None
        while status is None:
            wp, st = os.waitpid(pid, os.WNOHANG)
            if wp:
                status = st
            elif time.time() >= self.deadline:
                self.kill_group(pid)
                _, status = os.waitpid(pid, 0)
            else:
                time.sleep(0.002)
        return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0

    # ------------------------------------------------------------------ in-process tests

    def run_inprocess(self, kind, units):
        n = len(units)
        results = [None] * n
        load = {"loaded": None, "error": None, "status": None}
        per_test = self.limits.get("test_timeout")
        start = 0
        null = os.open(os.devnull, os.O_RDONLY)
        while start < n:
            token = os.urandom(16).hex()
            r, w = os.pipe()
            pid = self.fork_program(null, keep=(w,))
            if pid == 0:  # ---- child: the program's process from here on
                try:
                    _checker(self, kind, units, start, w, token)
                finally:
                    os._exit(0)
            os.close(w)
            buf, loaded_here, done = b"", False, False
            last = time.time()
            current = start
            killed_for = status = exited_at = None
            while not done:
                if status is None:
                    wp, st = os.waitpid(pid, os.WNOHANG)
                    if wp:
                        status, exited_at = st, time.time()
                elif time.time() - exited_at > 0.05:
                    break  # the child is gone; whatever still holds the pipe is not the child
                now = time.time()
                limit = self.deadline
                if per_test and loaded_here:
                    limit = min(limit, last + float(per_test))
                if now >= limit:
                    killed_for = "time"
                    break
                rl, _, _ = select.select([r], [], [], min(0.05, limit - now))
                if not rl:
                    continue
                b = os.read(r, 65536)
                if not b:
                    break
                buf += b
                if len(buf) > 1 << 20:
                    killed_for = "protocol"
                    break
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    parts = line.decode("ascii", "replace").split(" ")
                    if len(parts) < 2 or parts[0] != token:
                        continue
                    tag = parts[1]
                    if tag == "L":
                        loaded_here = True
                        load["loaded"] = True
                        last = time.time()
                    elif tag == "E" and len(parts) >= 4:
                        load["loaded"] = False
                        load["status"] = parts[2]
                        load["error"] = _short(_unhex(parts[3]))
                    elif tag == "R" and len(parts) >= 5 and loaded_here:
                        try:
                            idx = int(parts[2])
                        except ValueError:
                            continue
                        if current <= idx < n and results[idx] is None:
                            outcome = parts[3] if parts[3] in ("pass", "fail", "error", "memory", "timeout", "killed") \
                                else "error"
                            results[idx] = {"status": outcome, "reason": _short(_unhex(parts[4]))}
                            current = idx + 1
                            last = time.time()
                    elif tag == "D" and loaded_here:
                        done = True
            if killed_for is not None or not done:
                _kill(_descendants(pid))  # the program process the checker started (its own session)
                self.kill_group(pid)
            os.close(r)
            if status is None:
                _, status = os.waitpid(pid, 0)
            code, sig = _status(status)
            if load["loaded"] is False:
                break
            if not loaded_here:  # died or hung before the program finished loading
                load["loaded"] = False
                if killed_for == "time":
                    load["status"], load["error"] = "timeout", "wall-time limit reached while loading the program"
                elif sig is not None:
                    load["status"], load["error"] = self.signal_reason(sig)
                    load["error"] += " while loading the program"
                else:
                    load["status"] = "exit"
                    load["error"] = "the program ended the process while loading (exit code %s)" % code
                break
            if done or current >= n:
                break
            # the child stopped during test `current`: that test fails, the rest get a fresh process
            if killed_for == "time":
                results[current] = {"status": "timeout", "reason": "wall-time limit reached during the test"}
            elif killed_for == "protocol":
                results[current] = {"status": "error", "reason": "garbage on the result channel"}
            elif sig is not None:
                st, reason = self.signal_reason(sig)
                results[current] = {"status": st, "reason": reason + " during the test"}
            else:
                results[current] = {"status": "error",
                                    "reason": "the process exited (code %s) during the test" % code}
            start = current + 1
            if time.time() >= self.deadline:
                break
        os.close(null)
        if load["loaded"] is False:
            reason = "not run: " + (load["error"] or "the program did not load")
            st = load["status"] if load["status"] in ("timeout", "memory", "killed") else "error"
            results = [x if x is not None else {"status": st, "reason": reason} for x in results]
        results = [x if x is not None else {"status": "timeout", "reason": "not run: wall-time limit reached"}
                   for x in results]
        return results, load


def _show_exception():
    """Print the current exception as Python would, without the harness's own frame."""
    try:
        et, ev, tb = sys.exc_info()
        if tb is not None:  # drop the harness's frame (a syntax error then shows no traceback at all)
            tb = tb.tb_next
            ev = ev.with_traceback(tb)
        sys.excepthook(et, ev, tb)
    except BaseException:  # noqa: BLE001
        pass


def _run_main(code):
    """The child of a plain run: execute ``code`` as ``__main__`` and exit as ``python main.py`` would."""
    mod = type(sys)("__main__")
    mod.__file__ = "main.py"
    mod.__builtins__ = __builtins__
    sys.modules["__main__"] = mod
    sys.argv = ["main.py"]
    status = 0
    try:
        exec(compile(code, "main.py", "exec", dont_inherit=True), mod.__dict__)
    except SystemExit as e:
        c = e.code
        if c is None:
            status = 0
        elif type(c) is int:
            status = c & 0xFF
        else:
            try:
                print(c, file=sys.stderr)
            except BaseException:  # noqa: BLE001
                pass
            status = 1
    except BaseException:  # noqa: BLE001
        _show_exception()
        status = 1
    try:
        import atexit

        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    _flush()
    os._exit(status)


# The program's process in the test kinds: a fresh interpreter (nothing of the harness, the tests or the expected
# values is in its memory) that loads the program and then answers requests from the checker: call a function,
# read an attribute, list an iterable. Every answer is plain data (exact built-in types, tagged) or a handle to an
# object that stays in the program's process. Whatever the program does to this code only changes its own answers.
_SERVER_SRC = r'''
import marshal, os, sys
def _serve(rfd, wfd, module):
    def bye():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(0)
    def readmsg():
        head = b""
        while not head.endswith(b"\n"):
            c = os.read(rfd, 1)
            if not c:
                bye()
            head += c
        n, buf = int(head), b""
        while len(buf) < n:
            c = os.read(rfd, n - len(buf))
            if not c:
                bye()
            buf += c
        return marshal.loads(buf)
    def send(x):
        b = repr(x).encode("utf-8", "surrogatepass")
        b = str(len(b)).encode() + b"\n" + b
        while b:
            b = b[os.write(wfd, b):]
    handles = []
    def enc(x, d=0):
        t = type(x)
        if d > 200:
            raise ValueError("value nested too deeply")
        if x is None:
            return ("n",)
        if t is bool:
            return ("B", x)
        if t is int:
            return ("i", hex(x))
        if t is float or t is complex:
            return ("f" if t is float else "c", repr(x))
        if t is str or t is bytes:
            return ("s" if t is str else "b", x)
        if t is list or t is tuple or t is set or t is frozenset:
            return ({list: "l", tuple: "t", set: "S", frozenset: "F"}[t], [enc(v, d + 1) for v in x])
        if t is dict:
            return ("d", [(enc(k, d + 1), enc(v, d + 1)) for k, v in x.items()])
        handles.append(x)
        if t is type(sys) and type(x.__name__) is str:
            return ("m", x.__name__, len(handles) - 1)
        return ("h", len(handles) - 1, t.__name__)
    def dec(x):
        tag = x[0]
        if tag == "h":
            return handles[x[1]]
        if tag == "v":
            return x[1]
        if tag == "d":
            return {dec(k): dec(v) for k, v in x[1]}
        seq = [dec(v) for v in x[1]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](seq)
    def reply(fn):
        try:
            out = ("r", enc(fn()))
        except MemoryError:
            out = ("x", "MemoryError", "")
        except SystemExit as e:
            out = ("x", "SystemExit", "the program called exit(%r)" % (e.code,))
        except BaseException as e:
            try:
                out = ("x", type(e).__name__, str(e)[:400])
            except BaseException:
                out = ("x", "Exception", "(an exception that cannot be shown)")
        send(out)
    mod = type(sys)(module)
    mod.__file__ = module + ".py"
    sys.modules[module] = mod
    sys.argv = [module + ".py"]
    code = readmsg()
    try:
        exec(compile(code, module + ".py", "exec", dont_inherit=True), mod.__dict__)
    except MemoryError:
        send(("E", "memory", "MemoryError while loading the program"))
        bye()
    except SystemExit as e:
        send(("E", "exit", "the program called exit(%r) while loading" % (e.code,)))
        bye()
    except BaseException as e:
        import traceback
        traceback.print_exc()
        send(("E", "import", "%s: %s" % (type(e).__name__, e)))
        bye()
    names = []
    for k, v in list(mod.__dict__.items()):
        if not k.startswith("__"):
            try:
                e = enc(v)
                if e[0] not in ("h", "m") and len(repr(e)) > 65536:  # big data stays here, read on demand
                    handles.append(v)
                    e = ("h", len(handles) - 1, type(v).__name__)
                names.append((k, e))
            except BaseException:
                pass
    send(("L", names))
    while True:
        op = readmsg()
        if op[0] == "call":
            f, a, k = handles[op[1]], dec(op[2]), dec(op[3])
            reply(lambda: f(*a, **k))
        elif op[0] == "getattr":
            o, name = handles[op[1]], op[2]
            reply(lambda: getattr(o, name))
        elif op[0] == "list":
            o = handles[op[1]]
            reply(lambda: list(o))
        elif op[0] == "len":
            o = handles[op[1]]
            reply(lambda: len(o))
        elif op[0] == "getitem":
            o, key = handles[op[1]], dec(op[2])
            reply(lambda: o[key])
        elif op[0] == "contains":
            o, item = handles[op[1]], dec(op[2])
            reply(lambda: item in o)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
_serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
'''


class _ProgramGone(Exception):
    """The program's process ended (or sent garbage) during a request; ``status`` is the test's status."""

    def __init__(self, status, reason):
        Exception.__init__(self, reason)
        self.status = status


class _Channel:
    """The checker's end of the conversation with one program process (see ``_SERVER_SRC``)."""

    def __init__(self, h, module):
        self.h, self.module = h, module
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        pid = h.fork_program(null, keep=(req_r, resp_w))
        if pid == 0:
            try:
                os.set_inheritable(req_r, True)
                os.set_inheritable(resp_w, True)
                os.execv(h.python[0], h.python + ["-c", _SERVER_SRC, str(req_r), str(resp_w), module])
            finally:
                os._exit(127)
        for fd in (null, req_r, resp_w):
            os.close(fd)
        self.pid, self.w, self.r = pid, req_w, resp_r
        self.status = None

    def close(self):
        """End the conversation: the program sees EOF, flushes its output and exits (killed after 0.2 s)."""
        for fd in (self.w, self.r):
            try:
                os.close(fd)
            except OSError:
                pass
        end = time.time() + 0.2
        while self.status is None and time.time() < end:
            wp, st = os.waitpid(self.pid, os.WNOHANG)
            if wp:
                self.status = st
            else:
                time.sleep(0.002)
        self.h.kill_group(self.pid)
        self.reap()

    def reap(self):
        if self.status is None:
            try:
                _, self.status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.status = 0
        return self.status

    def gone(self, during):
        code, sig = _status(self.reap())
        if sig is not None:
            st, reason = self.h.signal_reason(sig)
            return _ProgramGone(st, reason + " " + during)
        return _ProgramGone("error", "the program ended its process (exit code %s) %s" % (code, during))

    def send(self, obj):
        b = marshal.dumps(obj, 4)
        b = str(len(b)).encode() + b"\n" + b
        try:
            while b:
                b = b[os.write(self.w, b):]
        except OSError:
            raise self.gone("during the test") from None

    def recv(self, during="during the test"):
        head = b""
        while not head.endswith(b"\n"):
            c = os.read(self.r, 1)
            if not c:
                raise self.gone(during)
            head += c
            if len(head) > 12:
                raise _ProgramGone("error", "garbage on the program's answer channel")
        try:
            n = int(head)
        except ValueError:
            raise _ProgramGone("error", "garbage on the program's answer channel") from None
        if n > 1 << 24:
            raise _ProgramGone("error", "the program's answer is over 16 MB")
        buf = b""
        while len(buf) < n:
            c = os.read(self.r, n - len(buf))
            if not c:
                raise self.gone(during)
            buf += c
        import ast

        try:
            return ast.literal_eval(buf.decode("utf-8", "surrogatepass"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, UnicodeDecodeError):
            raise _ProgramGone("error", "garbage on the program's answer channel") from None


class _Remote:
    """An object that lives in the program's process. It equals only itself (no comparison reaches the program)
    and has no truth value; calling it, reading an attribute, its length, an item, membership or iterating it asks
    the program, and the answer comes back as plain data or as another remote object."""

    __slots__ = ("_ch", "_id", "_type")

    def __init__(self, ch, hid, tname):
        object.__setattr__(self, "_ch", ch)
        object.__setattr__(self, "_id", hid)
        object.__setattr__(self, "_type", tname)

    def __call__(self, *args, **kwargs):
        return _ask(self._ch, ("call", self._id, _enc(args), _enc(kwargs)))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _ask(self._ch, ("getattr", self._id, name))

    def __iter__(self):
        return iter(_ask(self._ch, ("list", self._id)))

    def __bool__(self):  # the program's __bool__ would decide `assert f(x)`: not data, so no truth value
        raise TypeError("a %s object from the program has no truth value in a test (only plain data has)"
                        % self._type)

    def __len__(self):
        return _ask(self._ch, ("len", self._id))

    def __getitem__(self, key):
        return _ask(self._ch, ("getitem", self._id, _enc(key)))

    def __contains__(self, item):
        return _ask(self._ch, ("contains", self._id, _enc(item)))

    def __repr__(self):
        return "<program object of type %s>" % self._type


def _enc(x, d=0):
    """An argument for the program: plain data (tagged) or a remote object of the same program."""
    t = type(x)
    if d > 200:
        raise ValueError("argument nested too deeply")
    if t is _Remote:
        return ("h", x._id)
    if x is None or t in (bool, int, float, complex, str, bytes):
        return ("v", x)
    if t in (list, tuple, set, frozenset):
        return ({list: "l", tuple: "t", set: "S", frozenset: "F"}[t], [_enc(v, d + 1) for v in x])
    if t is dict:
        return ("d", [(_enc(k, d + 1), _enc(v, d + 1)) for k, v in x.items()])
    raise TypeError("cannot pass a %s to the program (only plain data)" % t.__name__)


_SEQ = {"l": list, "t": tuple, "S": set, "F": frozenset}


def _dec(ch, x, d=0):
    """Plain data of the exact built-in types from a tagged answer; anything malformed is garbage."""
    if type(x) is not tuple or not x or d > 200:
        raise _ProgramGone("error", "garbage on the program's answer channel")
    tag, n = x[0], len(x)
    if tag == "n" and n == 1:
        return None
    if n == 2 and tag == "B" and type(x[1]) is bool:
        return x[1]
    if n == 2 and tag in ("s", "b") and type(x[1]) is (str if tag == "s" else bytes):
        return x[1]
    if n == 2 and tag in ("i", "f", "c") and type(x[1]) is str and len(x[1]) < 100000:
        try:
            return int(x[1], 16) if tag == "i" else float(x[1]) if tag == "f" else complex(x[1])
        except ValueError:
            pass
    if n == 2 and tag in _SEQ and type(x[1]) is list:
        try:
            return _SEQ[tag](_dec(ch, v, d + 1) for v in x[1])
        except TypeError:  # an unhashable member of a set
            raise _ProgramGone("error", "garbage on the program's answer channel") from None
    if n == 2 and tag == "d" and type(x[1]) is list:
        out = {}
        for kv in x[1]:
            if type(kv) is not tuple or len(kv) != 2:
                break
            try:
                out[_dec(ch, kv[0], d + 1)] = _dec(ch, kv[1], d + 1)
            except TypeError:
                break
        else:
            return out
    if n == 3 and tag == "h" and type(x[1]) is int and type(x[2]) is str:
        return _Remote(ch, x[1], x[2])
    if n == 3 and tag == "m" and type(x[1]) is str and type(x[2]) is int:
        # a module the program imported: the checker's own copy of it (the program cannot lie through it)
        try:
            __import__(x[1])
            return sys.modules[x[1]]
        except BaseException:  # noqa: BLE001 - a module only the program has: reach it as a remote object
            return _Remote(ch, x[2], "module")
    raise _ProgramGone("error", "garbage on the program's answer channel")


_BUILTIN_ERRORS = {k: v for k, v in __builtins__.items() if isinstance(v, type) and issubclass(v, Exception)} \
    if isinstance(__builtins__, dict) else {k: v for k, v in vars(__builtins__).items()
                                            if isinstance(v, type) and issubclass(v, Exception)}


def _ask(ch, op):
    ch.send(op)
    ans = ch.recv()
    if type(ans) is tuple and len(ans) == 2 and ans[0] == "r":
        return _dec(ch, ans[1])
    if type(ans) is tuple and len(ans) == 3 and ans[0] == "x" and type(ans[1]) is str and type(ans[2]) is str:
        if ans[1] == "MemoryError":
            raise MemoryError("in the program")
        if ans[1] == "SystemExit":
            raise _ProgramGone("error", ans[2])
        cls = _BUILTIN_ERRORS.get(ans[1])
        if cls is None or cls is AssertionError:  # the program's own assertion is its error, not a test verdict
            raise RuntimeError("the program raised %s: %s" % (ans[1], ans[2]))
        raise cls(ans[2])
    raise _ProgramGone("error", "garbage on the program's answer channel")


def _start_program(h, module):
    """A fresh program process with the program loaded: (channel, {name: value}) or (None, (status, reason))."""
    ch = _Channel(h, module)
    try:
        ch.send(h.spec["code"])
        ans = ch.recv("while loading the program")
    except _ProgramGone as e:
        ch.close()
        if "ended its process" in str(e):
            return None, ("exit", "the program ended the process while loading (exit code %s)"
                          % _status(ch.status)[0])
        return None, (e.status, str(e))
    if type(ans) is tuple and len(ans) == 3 and ans[0] == "E" and type(ans[1]) is str and type(ans[2]) is str:
        ch.close()
        return None, (ans[1] if ans[1] in ("memory", "exit", "import") else "import", ans[2])
    if not (type(ans) is tuple and len(ans) == 2 and ans[0] == "L" and type(ans[1]) is list):
        ch.close()
        return None, ("import", "garbage on the program's answer channel")
    names = {}
    try:
        for item in ans[1]:
            if type(item) is tuple and len(item) == 2 and type(item[0]) is str and item[0].isidentifier():
                names[item[0]] = _dec(ch, item[1])
    except _ProgramGone as e:
        ch.close()
        return None, ("import", str(e))
    return ch, names


def _checker(h, kind, units, start, wfd, token):
    """The checker process: runs units[start:] against a separate program process and reports each result.

    The test code, the expected values and this report channel live here; the program runs in its own fresh
    interpreter (``_SERVER_SRC``) and only ever hands back plain data or remote handles, so nothing it does to
    its own memory (builtins, frames, comparison methods) reaches a verdict. The program's names are visible to
    the tests directly and as a module (``from solution import add``; ``spec['module']`` names it too).
    """
    tok = token.encode()

    def send(*fields):
        out = [tok]
        for f in fields:
            out.append(f if isinstance(f, bytes) else str(f).encode("utf-8", "replace"))
        try:
            os.write(wfd, b" ".join(out) + b"\n")
        except OSError:
            os._exit(0)

    def hexmsg(text):
        return str(text)[:_MSG_MAX].encode("utf-8", "replace").hex().encode()

    modules = [m for m in dict.fromkeys(["solution", h.spec.get("module") or "solution"]) if m.isidentifier()]
    ch, names = _start_program(h, modules[0])
    if ch is None:
        st, msg = names
        send(b"E", st.encode(), hexmsg(msg))
        _flush()
        os._exit(0)
    send(b"L")
    setup_error = None

    def namespace(names):
        mod = type(sys)(modules[0])
        for k, v in names.items():
            setattr(mod, k, v)
        for m in modules:
            sys.modules[m] = mod
        ns = dict(names)
        ns["__name__"] = "tests"
        if kind == "asserts" and h.spec.get("setup"):
            try:
                exec(compile(h.spec["setup"], "tests.py", "exec", dont_inherit=True), ns)
            except BaseException as e:  # noqa: BLE001
                return ns, "test set-up failed: %s: %s" % (type(e).__name__, e)
        return ns, None

    ns, setup_error = namespace(names)

    def canon(x, depth=0):
        t = type(x)
        if x is None or t is bool or t is int or t is str or t is float:
            return x
        if depth > 50:
            raise TypeError("result nested too deeply")
        if t is list or t is tuple:
            return [canon(v, depth + 1) for v in x]
        if t is dict:
            return {(str(k) if type(k) is int else canon(k, depth + 1)): canon(v, depth + 1) for k, v in x.items()}
        raise TypeError("result of type %s is not plain data" % (x._type if t is _Remote else t.__name__))

    def same(a, b):
        ta, tb = type(a), type(b)
        if ta is float or tb is float:
            if ta not in (int, float) or tb not in (int, float):
                return False
            return a == b or abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
        if ta is not tb:
            return False
        if ta is list:
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if ta is dict:
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    fn_name = h.spec.get("fn_name")
    for i in range(start, len(units)):
        u = units[i]
        status, msg = b"pass", ""
        try:
            if ch is None:
                ch, names = _start_program(h, modules[0])
                if ch is None:
                    raise _ProgramGone("error", "the program did not load again: %s" % names[1])
                ns, setup_error = namespace(names)
            if setup_error is not None:
                raise RuntimeError(setup_error)
            if kind == "calls":
                f = ns.get(fn_name)
                if type(f) is not _Remote:
                    raise NameError("function %r is not defined" % fn_name)
                got = canon(f(*u["args"]))
                want = canon(u["expected"])
                ok = same(got, want) or (type(want) is list and len(want) == 1 and same(got, want[0]))
                if not ok:
                    status, msg = b"fail", "returned %s, expected %s" % (repr(got)[:120], repr(want)[:120])
            elif "fn" in u:
                f = ns.get(u["fn"])
                if not callable(f):
                    raise NameError("test %s is not defined" % u["fn"])
                f()
            else:
                if u.get("pre"):
                    exec(compile(u["pre"], "tests.py", "exec", dont_inherit=True), ns)
                exec(compile(u["src"], "tests.py", "exec", dont_inherit=True), ns)
        except _ProgramGone as e:
            status, msg = e.status.encode(), str(e)
            if ch is not None:
                ch.close()
            ch = None
        except AssertionError as e:
            status, msg = b"fail", "AssertionError: %s" % (e,)
        except MemoryError:
            status, msg = b"memory", "MemoryError"
        except SystemExit as e:
            status, msg = b"error", "the test called exit(%r)" % (e.code,)
        except BaseException as e:  # noqa: BLE001
            status, msg = b"error", "%s: %s" % (type(e).__name__, e)
        send(b"R", i, status, hexmsg(msg) if msg else b"")
    if ch is not None:
        ch.close()
    send(b"D")
    _flush()
    os._exit(0)


_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS = {"RDONLY": 1, "NOSUID": 2, "NODEV": 4, "NOEXEC": 8, "REMOUNT": 32, "NOATIME": 1024, "NODIRATIME": 2048,
       "BIND": 4096, "REC": 16384, "PRIVATE": 1 << 18, "RELATIME": 1 << 21}
_ST_TO_MS = ((1, "RDONLY"), (2, "NOSUID"), (4, "NODEV"), (8, "NOEXEC"), (1024, "NOATIME"), (2048, "NODIRATIME"),
             (4096, "RELATIME"))
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
_PR_SET_PDEATHSIG = 1


def _sys(rv, what):
    if rv != 0:
        import ctypes

        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def _mount(src, dst, fstype, flags, data=None):
    libc = _libc()
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _sys(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), "mount %s on %s" % (src or fstype, dst))


def _bind_ro(src, dst, is_dir):
    """Bind ``src`` read-only at ``dst`` (keeping the flags the kernel locks in a user namespace)."""
    if is_dir:
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, _MS["BIND"] | _MS["REC"])
    st = os.statvfs(dst).f_flag
    flags = _MS["BIND"] | _MS["REMOUNT"] | _MS["RDONLY"]
    for bit, name in _ST_TO_MS:
        if st & bit:
            flags |= _MS[name]
    _mount(None, dst, None, flags)


def _build_root(c, libc):
    """Build the sandbox's root in the current (new, private) mount namespace and ``pivot_root`` into it: an empty
    tmpfs with read-only binds of ``c["binds"]``, a minimal /dev, tmpfs of ``c["disk_bytes"]`` each for /box, /tmp
    and /dev/shm, a /proc; the host's root detached, the new root read-only."""
    root = c["root"]
    size = "size=%d" % int(c["disk_bytes"])
    nosuid = _MS["NOSUID"] | _MS["NODEV"]
    _mount("none", "/", None, _MS["REC"] | _MS["PRIVATE"])
    _mount("tmpfs", root, "tmpfs", nosuid, "mode=0755,size=1m")
    for src, dst in c["binds"]:
        _bind_ro(src, root + dst, os.path.isdir(src))
    for link, target in c["symlinks"]:
        os.symlink(target, root + link)
    os.makedirs(root + "/dev")
    _mount("tmpfs", root + "/dev", "tmpfs", _MS["NOSUID"], "mode=0755,size=64k")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(root + "/dev/" + name, "a").close()
        _mount("/dev/" + name, root + "/dev/" + name, None, _MS["BIND"])
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root + "/dev/" + name)
    for d, mode in (("/dev/shm", "1777"), ("/tmp", "1777"), ("/box", "0777")):
        os.makedirs(root + d, exist_ok=True)
        _mount("tmpfs", root + d, "tmpfs", nosuid, "mode=%s,%s" % (mode, size))
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", nosuid | _MS["NOEXEC"])
    os.chdir(root)
    os.mkdir(".old")
    import platform

    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise RuntimeError("pivot_root: unknown system call number on %s" % platform.machine())
    _sys(libc.syscall(nr, b".", b".old"), "pivot_root")
    os.chdir("/")
    _sys(libc.umount2(b"/.old", 2), "detach the host's root")
    os.rmdir("/.old")
    _mount(None, "/", None, _MS["BIND"] | _MS["REMOUNT"] | _MS["RDONLY"] | nosuid)


def _confine(c, report_fd):
    """Namespaces mode (no bubblewrap): new user, mount, pid, network, ipc, uts and cgroup namespaces and a fresh
    read-only root (:func:`_build_root`), the way bubblewrap does it, with only the kernel (``unshare``, ``mount``,
    ``pivot_root``).

    The calling process stays outside the pid namespace as the waiter (it exits with the sandbox's status; when it
    is killed, the sandbox's init gets SIGKILL and the kernel kills everything in the pid namespace). The child is
    pid 1 of the new namespace; it mounts a /proc of that namespace, forbids nested user namespaces and drops every
    capability. Returns in the child only.

    Started as root, the root is built first, as root, in a private mount namespace; then the process drops to
    ``c["uid"]`` (unique to the run) and enters the other namespaces, whose root maps to that uid. Root inside must
    not be the host's root, which passes permission checks on /proc/sys and /proc/sysrq-trigger by uid alone and is
    exempt from RLIMIT_NPROC; and the new uid could not walk to a Python installation under /root. Mounts made by
    the host's root are locked read-only for the namespace's root. Started as another user, everything happens
    after entering the user namespace, as its root.
    """
    import ctypes

    libc = _libc()
    if libc is None:
        raise RuntimeError("namespaces mode needs ctypes")
    as_root = c.get("uid") is not None and os.geteuid() == 0
    if as_root:
        _sys(libc.unshare(_CLONE_NEWNS), "unshare the mount namespace")
        _build_root(c, libc)
        os.setgroups([])
        os.setresgid(c["uid"], c["uid"], c["uid"])
        os.setresuid(c["uid"], c["uid"], c["uid"])
        if os.geteuid() != c["uid"]:
            raise RuntimeError("could not drop to the sandbox uid")
        _prctl(_PR_SET_DUMPABLE, 1)  # the uid change made /proc/self root's; the maps below need it ours (no
        # program runs yet; _harden makes this process undumpable again before one does)
    uid, gid = os.geteuid(), os.getegid()
    _sys(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
                      | _CLONE_NEWCGROUP), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
        try:
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
        except FileNotFoundError:
            pass
    pid = os.fork()
    if pid:
        os.close(0)
        os.close(report_fd)
        while True:
            try:
                _, st = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        code, sig = _status(st)
        os._exit(128 + sig if sig is not None else code)
    _prctl(_PR_SET_PDEATHSIG, SIG["KILL"])
    if as_root:  # a /proc of the new pid namespace over the one built as root (which showed the host's)
        _mount("proc", "/proc", "proc", _MS["NOSUID"] | _MS["NODEV"] | _MS["NOEXEC"])
    else:
        _build_root(c, libc)
    try:
        libc.sethostname(b"sandbox", 7)
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
    except OSError:
        pass
    for cap in range(64):
        if _prctl(_PR_CAPBSET_DROP, cap) != 0 and cap > 40:
            break

    class _Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class _Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    data = (_Data * 2)()
    _sys(libc.capset(ctypes.byref(_Hdr(0x20080522, 0)), data), "drop capabilities")


def _reaper(report_fd, uid):
    """Fallback mode only (no pid namespace): fork; the parent stays behind as the run's reaper.

    It runs no program code. It is a child subreaper, so everything the program orphans is re-parented to it and
    reaped here; when the harness child ends (or is killed by the program) it kills what is left of the run (every
    process of the run's uid, or its descendants) and exits with the child's status. Returns in the child only.
    """
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    pid = os.fork()
    if pid == 0:
        return
    os.close(report_fd)
    os.close(0)
    status = 0
    while True:
        try:
            w, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if w == pid:
            status = st
            break
    end = time.time() + 5.0
    while True:
        victims = [p for p, pp, u, _ in _proc_scan() if p != os.getpid() and uid is not None and u == uid]
        victims += _descendants(os.getpid())
        _kill(victims)
        while True:
            try:
                w, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                w = 0
            if not w:
                break
        if not victims or time.time() > end:
            break
        time.sleep(0.005)
    code, sig = _status(status)
    os._exit(128 + sig if sig is not None else code)


def main(report_fd):
    report_fd = int(report_fd)
    os.set_inheritable(report_fd, False)
    spec = marshal.loads(_read_exact(0, int(_read_line(0))))
    SIG.update(spec.get("signals") or {})
    if spec.get("confine"):
        _confine(spec["confine"], report_fd)
    if spec.get("reaper"):
        _reaper(report_fd, spec.get("uid"))
    _harden(spec)
    h = Harness(spec)
    os.chdir(h.workdir)
    procs = int(h.limits.get("processes") or 0)
    if procs:
        h.nproc = _count_tasks(os.getuid()) + procs
    report = {"mode": spec["mode"], "nproc": h.nproc}
    try:
        if spec["mode"] == "run":
            report.update(h.run_program())
        elif spec["mode"] == "stdio":
            with open("main.py", "w", encoding="utf-8") as f:
                f.write(spec["code"])
            report["imports_ok"] = h.check_imports()
            report["tests"] = h.run_stdio(spec["units"])
        else:
            tests, load = h.run_inprocess(spec["mode"], spec["units"])
            report["tests"] = tests
            report["load"] = load
    finally:
        h.cleanup()
    report["nonce"] = _read_line(0).decode()
    data = (_jdump(report) + "\n").encode()
    while data:
        try:
            n = os.write(report_fd, data)
        except InterruptedError:
            continue
        except OSError as e:
            if e.errno == errno.EPIPE:
                break
            raise
        data = data[n:]
    os.close(report_fd)


if __name__ == "__main__" and len(sys.argv) == 2 and sys.argv[1].isdigit():
    main(sys.argv[1])
