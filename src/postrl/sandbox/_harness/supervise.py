"""The supervisor's process control and the modes that need no checker: a plain run and stdin/stdout cases.

:class:`Harness` forks program processes (own session, descriptors closed, rlimits applied), kills and reaps what
they leave, and runs

- ``run``: a forked child executes the program as ``__main__`` (stdout/stderr go straight to the host);
- ``stdio``: one fresh ``python main.py`` per case (exec'd, so it holds none of the expected outputs); the harness
  itself compares the output.

The test kinds (``asserts`` / ``calls``) are in :mod:`.checker`.
"""

import os
import select
import sys
import time

from .confine import apply_limits
from .util import SIG, MAXFD, descendants, exit_of, flush, kill_pids, short


class Harness:
    """One run's supervisor: the spec, its limits and deadline, and the program processes it starts."""

    def __init__(self, spec):
        self.spec = spec
        self.limits = spec["limits"]
        self.deadline = float(spec["deadline"])
        self.workdir = spec["workdir"]
        self.python = [spec["python"]] + list(spec.get("python_flags", []))
        self.nproc = None

    # ------------------------------------------------------------------ processes

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
            for a, b in zip(keep, keep[1:] + [MAXFD]):
                if b > a + 1:
                    os.closerange(a + 1, b)
            apply_limits(self.limits, self.nproc)
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
            kill_pids(descendants(os.getpid()))
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
        code, sig = exit_of(status)
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
            code, sig = exit_of(status)
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
                results.append({"status": "fail", "reason": short("wrong output %r, expected %r"
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
    flush()
    os._exit(status)

