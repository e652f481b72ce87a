"""Running one program, host side: start the harness in the chosen mode, feed it the spec, watch the wall-time,
output and disk limits, tear the sandbox down, and hand what came back to :mod:`postrl.sandbox.results`.

The harness (:mod:`postrl.sandbox._harness`) runs inside the sandbox and is the only source of a result: it writes
one JSON report, tagged with a random nonce, on a descriptor the program does not hold.
"""

from __future__ import annotations

import atexit
import json
import marshal
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from postrl.sandbox import confine, seccomp
from postrl.sandbox._harness.util import descendants, kill_pids, proc_scan
from postrl.sandbox.errors import SandboxUnavailable
from postrl.sandbox.limits import Limits
from postrl.sandbox.results import SandboxResult, interpret

_HARNESS_PACKAGE = Path(__file__).with_name("_harness")
_HARNESS_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); import _harness.main; del sys.path[0]; "
                 "_harness.main.main(sys.argv[2])")
_HARNESS_DIRS: dict[str, str] = {}
_SIGNALS = {"KILL": int(signal.SIGKILL), "XCPU": int(signal.SIGXCPU), "XFSZ": int(signal.SIGXFSZ),
            "names": {int(s): s.name for s in signal.Signals}}


def harness_dir(python: str) -> str:
    """A private read-only copy of the harness package with its bytecode compiled by ``python`` (compiling the
    source at every run would cost more than the run), made once per interpreter; raises
    :class:`SandboxUnavailable` when that fails."""
    if python in _HARNESS_DIRS:
        return _HARNESS_DIRS[python]
    d = tempfile.mkdtemp(prefix="postrl-harness-")
    try:
        pkg = os.path.join(d, "_harness")
        shutil.copytree(_HARNESS_PACKAGE, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        files = sorted(str(f) for f in Path(pkg).glob("*.py"))
        subprocess.run([python, "-I", "-S", "-c", "import py_compile, sys\nfor f in sys.argv[1:]:\n"
                        "    py_compile.compile(f, doraise=True)", *files], check=True, timeout=120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"})
        for root, dirs, names in os.walk(d):
            os.chmod(root, 0o755)
            for f in names:
                os.chmod(os.path.join(root, f), 0o644)
    except (OSError, subprocess.SubprocessError) as e:
        shutil.rmtree(d, ignore_errors=True)
        detail = e.stderr.decode(errors="replace").strip().splitlines()[-1:] if isinstance(
            e, subprocess.CalledProcessError) and e.stderr else []
        raise SandboxUnavailable(f"could not prepare the sandbox harness for {python}: "
                                 f"{type(e).__name__}: {(detail or [e])[0]}") from None
    atexit.register(shutil.rmtree, d, True)
    _HARNESS_DIRS[python] = d
    return d


def launch(caps: dict, code: str, kind_spec: dict | None, stdin: str | None, limits: Limits, *,
           site: bool) -> SandboxResult:
    """Run ``code`` once in the sandbox that ``caps`` (:func:`postrl.sandbox.capabilities`) describes:
    ``kind_spec`` is :func:`postrl.sandbox.testspec.collect`'s result (None: a plain run, fed ``stdin``)."""
    t0 = time.monotonic()
    mode = "run" if kind_spec is None else kind_spec["kind"]
    units = [] if kind_spec is None else kind_spec["units"]
    uid = (1 << 24) + secrets.randbelow(1 << 29) if caps["unique_uid"] else None
    nonce = secrets.token_hex(16)
    python, disk_bytes = caps["python"], int(limits.disk_mb) << 20
    filtered = caps["seccomp"]["enabled"]
    private = None
    if caps["mode"] == "bwrap":
        workdir = confine.BOX
    else:
        private = tempfile.mkdtemp(prefix="postrl-sandbox-")
        os.chmod(private, 0o700)
        if uid is not None:
            os.chown(private, uid, uid)
        workdir = confine.BOX if caps["mode"] == "namespaces" else private
    flags = ["-I"] if site else ["-I", "-S"]
    margin = min(1.0, max(0.15, 0.1 * limits.timeout))
    spec = {"mode": mode, "code": code, "units": units, "stdin": stdin, "limits": limits.harness_dict(),
            "deadline": time.time() + limits.timeout - margin, "workdir": workdir, "python": python,
            "python_flags": flags, "uid": uid, "gid": uid, "kill_all": caps["kill_all"],
            "reaper": caps["mode"] == "fallback", "harden_prctl": caps["variant"] != "privileged",
            "signals": _SIGNALS, "seccomp": seccomp.program() if filtered and caps["mode"] != "bwrap" else None}
    if kind_spec is not None:
        spec.update({k: v for k, v in kind_spec.items() if k not in ("kind", "units")})
    if mode == "stdio":
        spec["import_src"] = _imports_source(code)
    if caps["mode"] == "namespaces":  # the harness drops to the run's uid itself, before entering the namespaces
        spec["confine"] = confine.namespaces_spec(private, python, disk_bytes, uid)
        spec["uid"] = spec["gid"] = None
    blob = marshal.dumps(spec, 4)
    feed = memoryview(str(len(blob)).encode() + b"\n" + blob + nonce.encode() + b"\n")
    report_r, report_w = os.pipe()
    info_r, info_w = os.pipe()
    child_fds = [report_w, info_w]
    if caps["mode"] == "bwrap" and filtered:  # bubblewrap reads the filter from a descriptor, to its end
        filter_r, filter_w = os.pipe()
        os.write(filter_w, seccomp.program())  # a few KB: fits in the pipe
        os.close(filter_w)
        child_fds.append(filter_r)
    hdir = caps["harness_dir"]
    harness = flags + ["-c", _HARNESS_BOOT, confine.HARNESS_MOUNT if caps["mode"] == "bwrap" else hdir,
                       str(report_w)]
    if caps["mode"] == "bwrap":
        argv = confine.bwrap_argv(caps, python, disk_bytes, info_w, child_fds[2] if filtered else None)
        argv += ["--", python] + harness
        env, cwd = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, "/"
    elif caps["mode"] == "namespaces":
        argv = [python] + harness
        env, cwd = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": confine.BOX,
                    "TMPDIR": "/tmp"}, "/"
    else:
        argv = [python] + harness
        env, cwd = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
                    "TMPDIR": workdir}, workdir
    cgroup = None
    try:
        if caps.get("cgroup"):
            cgroup = confine.Cgroup.create(caps["cgroup"], int(limits.memory_mb) + confine.CGROUP_SLACK_MB,
                                           int(limits.processes) + confine.CGROUP_SLACK_TASKS)
            if cgroup is None:
                raise SandboxUnavailable(f"sandbox: could not create the run's cgroup under "
                                         f"{caps['cgroup']['memory']} (it worked when the sandbox was probed; is "
                                         "the cgroup filesystem full or read-only?)")
            argv = ["/bin/sh", "-c", confine.CGROUP_JOIN, "sh", *cgroup.dirs, "--", *argv]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             pass_fds=child_fds, env=env, cwd=cwd, start_new_session=True)
    except BaseException:
        for fd in (report_r, info_r, *child_fds):
            os.close(fd)
        if private:
            shutil.rmtree(private, ignore_errors=True)
        if cgroup is not None:
            cgroup.remove()
        raise
    for fd in child_fds:
        os.close(fd)
    out_fd, err_fd, in_fd = p.stdout.fileno(), p.stderr.fileno(), p.stdin.fileno()
    os.set_blocking(in_fd, False)
    bufs = {out_fd: bytearray(), err_fd: bytearray(), report_r: bytearray(), info_r: bytearray()}
    caps_read = {out_fd: limits.output_bytes, err_fd: limits.output_bytes, report_r: 1 << 24, info_r: 1 << 16}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    sel.register(in_fd, selectors.EVENT_WRITE)
    writing = True
    deadline = t0 + limits.timeout
    timed_out, overflow, exited_at, child_pid = False, None, None, None
    disk_checked = t0
    try:
        while True:
            now = time.monotonic()
            if exited_at is None and p.poll() is not None:
                exited_at = now
            if exited_at is not None and (not any(fd in bufs for fd in sel.get_map()) or now - exited_at > 0.25):
                break
            if now >= deadline:
                timed_out = exited_at is None
                break
            for key, _ in sel.select(min(0.05, deadline - now)):
                fd = key.fd
                if fd == in_fd:
                    try:
                        n = os.write(in_fd, feed[:65536])
                        feed = feed[n:]
                    except BlockingIOError:
                        continue
                    except OSError:
                        feed = feed[:0]
                    if not feed:
                        sel.unregister(in_fd)
                        p.stdin.close()
                        writing = False
                    continue
                try:
                    b = os.read(fd, 65536)
                except OSError:
                    b = b""
                if not b:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                room = caps_read[fd] - len(buf)
                buf += b[: max(0, room)]
                if len(b) > room and fd in (out_fd, err_fd):
                    overflow = "stdout" if fd == out_fd else "stderr"
                if fd == info_r and child_pid is None:
                    try:
                        child_pid = int(json.loads(bytes(buf).decode())["child-pid"])
                    except (ValueError, KeyError, TypeError):
                        pass
            if caps["mode"] == "fallback" and now - disk_checked > 0.1:
                disk_checked = now
                if _dir_bytes(private) > int(limits.disk_mb) << 20:
                    overflow = "disk"
            if overflow:
                break
    finally:
        if p.poll() is None or timed_out or overflow:
            _terminate(p, caps, child_pid, uid)
        else:
            p.wait()
        # a report written before the kill is still in the pipe
        os.set_blocking(report_r, False)
        try:
            while len(bufs[report_r]) < caps_read[report_r]:
                b = os.read(report_r, 65536)
                if not b:
                    break
                bufs[report_r] += b
        except OSError:
            pass
        sel.close()
        for f in (p.stdout, p.stderr):
            f.close()
        if writing:
            try:
                p.stdin.close()
            except OSError:
                pass
        os.close(report_r)
        os.close(info_r)
        if caps["mode"] == "fallback":
            _sweep_uid(uid)
        if private:
            _rmtree(private)
        oom = 0
        if cgroup is not None:
            oom = cgroup.oom_kills()
            cgroup.remove()
    elapsed = time.monotonic() - t0
    stdout = bytes(bufs[out_fd]).decode("utf-8", "replace")
    stderr = bytes(bufs[err_fd]).decode("utf-8", "replace")
    report = None
    for line in bytes(bufs[report_r]).decode("utf-8", "replace").splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("nonce") == nonce:
            report = d
    res = SandboxResult(status="error", stdout=stdout, stderr=stderr, time=elapsed, mode=caps["mode"],
                        truncated=overflow is not None, uid=uid, total=len(units))
    interpret(res, report, mode, units, limits, p.returncode, timed_out, overflow, oom)
    return res


# ------------------------------------------------------------------------------------------------ teardown


def uid_pids(uid: int) -> list[int]:
    """Processes whose real uid is ``uid`` (the harness's process table: /proc/PID/status)."""
    return [pid for pid, _, u, _ in proc_scan() if u == uid]


def _terminate(p: subprocess.Popen, caps: dict, child_pid: int | None, uid: int | None) -> None:
    """Kill the whole sandbox and reap its top process; afterwards nothing of the run is left."""
    if caps["mode"] == "bwrap":
        if child_pid and any(pid == child_pid and ppid == p.pid for pid, ppid, _, _ in proc_scan()):
            kill_pids([child_pid])  # the pid namespace's init: the kernel kills every process inside with it
        try:
            p.wait(timeout=2.0)
            return
        except subprocess.TimeoutExpired:
            pass
    if caps["mode"] == "namespaces":  # the top process waits outside; its death kills the namespace's init
        while p.poll() is None:
            kill_pids(descendants(p.pid) + [p.pid])
            time.sleep(0.005)
        p.wait()
        return
    # fallback: the top process is the run's reaper (it runs no program code); kill everything below it, let it
    # reap and exit; only if it does not, kill it too.
    t_end = time.monotonic() + 1.0
    while p.poll() is None:
        victims = descendants(p.pid)
        if uid is not None:
            victims += uid_pids(uid)
        kill_pids(victims)
        if time.monotonic() > t_end:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            kill_pids([p.pid])
        time.sleep(0.005)
    p.wait()


def _sweep_uid(uid: int | None) -> None:
    """Fallback clean-up: nothing may keep running under the run's uid, and what it left in the shared
    world-writable directories (top level of the temp dir, /var/tmp, /dev/shm, /run/lock) is removed."""
    if uid is None:
        return
    for _ in range(100):
        pids = uid_pids(uid)
        if not pids:
            break
        kill_pids(pids)
        time.sleep(0.01)
    for d in dict.fromkeys((tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm", "/run/lock")):
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    _rmtree(e.path)
                else:
                    os.unlink(e.path)
            except OSError:
                pass


def _dir_bytes(path: str, max_entries: int = 20000) -> int:
    """Bytes under ``path`` (a directory with more than ``max_entries`` entries counts as over any limit)."""
    total, seen, todo = 0, 0, [path]
    while todo:
        try:
            it = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for e in it:
            seen += 1
            if seen > max_entries:
                return 1 << 62
            try:
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
                else:
                    total += e.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
    return total


def _rmtree(path: str) -> None:
    """Remove a directory tree the program may have made unreadable; never touches anything outside it."""
    root = os.path.abspath(path)

    def inside(q: str) -> bool:
        return q == root or q.startswith(root + os.sep)

    def onerror(fn, p, exc):
        for q in (os.path.dirname(p), p):
            try:
                if inside(q) and not os.path.islink(q):
                    os.chmod(q, 0o700)
            except OSError:
                pass
        try:
            fn(p)
        except OSError:
            pass

    shutil.rmtree(root, onerror=onerror)


def _imports_source(code: str) -> str:
    """The program's top-level import statements (the stage check of a stdin/stdout program)."""
    import ast

    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ""
    return "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
