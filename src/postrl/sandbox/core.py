"""Running untrusted, model-written Python in a separate, limited process.

Isolation (chosen once per process by :func:`capabilities`, which probes the machine and logs what it found):

- ``bwrap`` (bubblewrap works here): the program runs in fresh pid, network, ipc, uts and mount namespaces
  (``--unshare-*``, ``--die-with-parent``, ``--new-session``). The root is an empty tmpfs with read-only binds of
  ``/usr`` (and the ``/bin``, ``/lib*`` links), the Python installation, the harness and ``/etc/ld.so.cache``;
  ``/proc`` shows
  only the sandbox's processes; the only writable places are ``/box`` (the private working directory, also HOME)
  and ``/tmp``, two tmpfs of ``disk_mb`` each that vanish with the sandbox. No network device but a loopback of its
  own. Started as root, bubblewrap keeps no capability but setuid/setgid, and the harness drops at once to a uid
  unique to the run (so RLIMIT_NPROC counts only this run's processes and nothing outside is readable through
  permissions); started as another user, bubblewrap uses a user namespace (RLIMIT_NPROC then counts per user
  namespace, kernel >= 5.14). ``/dev/shm`` is a third sized tmpfs.
- ``namespaces`` (no usable bubblewrap, but the kernel lets this process create a user namespace): the harness
  builds the same isolation itself (``_harness._confine``): new user (the caller's uid mapped to root inside), mount,
  pid, network, ipc, uts and cgroup namespaces; a root of read-only binds of ``/usr`` (and the ``/bin``, ``/lib*``
  links), the Python installation and ``/etc/ld.so.cache``; a fresh ``/proc``; a minimal ``/dev``; ``/box``,
  ``/tmp`` and ``/dev/shm`` as tmpfs of ``disk_mb`` each; ``pivot_root`` into it and the host's root detached; the
  root read-only, nested user namespaces forbidden and every capability dropped before the program runs. The
  harness's first process waits outside; when the host kills it, the namespace's init dies and the kernel kills
  everything inside.
- ``fallback`` (neither): rlimits + ``setsid`` + a scrubbed environment + a private temporary
  directory as working directory and HOME (its size polled against ``disk_mb``), no namespaces, a reaper process
  that kills and reaps everything the run leaves. NOT isolated then: the network, reading files outside
  the sandbox, the visibility of other processes, SysV IPC, writes to world-writable directories (and, unless
  started as root, which drops to a unique uid, signalling the user's other processes and writing the user's
  files). Said once, at start-up, as a warning (``capabilities()["not_isolated"]`` lists each).

Limits in every mode (:class:`Limits`): wall time (enforced by the host, which kills the whole sandbox), CPU seconds
(RLIMIT_CPU, per process), memory, processes, output (the host stops reading and kills the sandbox past
``output_bytes`` on stdout or stderr), disk (tmpfs size with namespaces, RLIMIT_FSIZE per file in every mode), open
files. Memory and processes of the whole run: where this process can create a cgroup (root, or a delegated cgroup
v2), every run gets one (memory ``memory_mb`` + 32 MB for the supervisor, RAM + swap + tmpfs; ``pids.max``
``processes`` + 8 for the supervisor), joined by the launcher before anything starts; an OOM kill in it makes the
status ``memory``. Without a cgroup the bound is per process (RLIMIT_AS, RLIMIT_NPROC): the whole run may hold up to
``memory_mb x processes``, and ``capabilities()`` says so. The environment holds only PATH, LANG, HOME, TMPDIR (and
PWD).

The program never reports its own result: a harness (``_harness.py``) supervises it inside the sandbox and writes
one JSON report, tagged with a random nonce, on a descriptor the program does not hold. Test code runs in a checker
process; the program runs in its own fresh interpreter and only hands back plain data (see ``_harness``).
"""

from __future__ import annotations

import atexit
import json
import logging
import marshal
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from postrl.errors import ConfigError, PostrlError
from postrl.sandbox.testspec import collect

log = logging.getLogger("postrl.sandbox")

STATUSES = ("ok", "failed", "timeout", "memory", "output_limit", "killed", "error")
MODES = ("auto", "bwrap", "namespaces", "fallback")
_HARNESS = Path(__file__).with_name("_harness.py")
_BOX = "/box"
_HARNESS_MOUNT = "/.postrl"


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run.

    ``timeout``: wall seconds for the whole run (all tests together), host-enforced. ``cpu``: CPU seconds per
    process (default: ``timeout``). ``memory_mb``: address space per process, and (where a cgroup can be
    made) the memory of the whole run together, plus 32 MB for the supervisor. ``processes``: processes and
    threads the program may have, itself included. ``output_bytes``: per stream (stdout, stderr); more kills the
    run (status ``output_limit``); also the cap on one test's stdout. ``disk_mb``: size of each writable tmpfs and
    the largest file. ``open_files``: descriptors per process. ``test_timeout``: wall seconds per test (default: none,
    only the overall ``timeout``); a test over it fails and the next test runs in a fresh process.
    """

    timeout: float = 10.0
    cpu: float | None = None
    memory_mb: int = 512
    processes: int = 32
    output_bytes: int = 64 * 1024
    disk_mb: int = 32
    open_files: int = 64
    test_timeout: float | None = None

    def __post_init__(self) -> None:
        for k in ("timeout", "memory_mb", "processes", "output_bytes", "disk_mb", "open_files"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"sandbox limit '{k}' must be a positive number, got {v!r}")
        for k in ("cpu", "test_timeout"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise ConfigError(f"sandbox limit '{k}' must be a positive number or None, got {v!r}")
        if self.memory_mb < 32:
            raise ConfigError(f"sandbox limit 'memory_mb' must be at least 32 (Python itself needs it), got "
                              f"{self.memory_mb}")

    def harness_dict(self) -> dict:
        return {"memory_bytes": int(self.memory_mb) << 20, "cpu_seconds": float(self.cpu or self.timeout),
                "file_bytes": int(self.disk_mb) << 20, "open_files": int(self.open_files),
                "processes": int(self.processes), "output_bytes": int(self.output_bytes),
                "test_timeout": self.test_timeout}


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    ``status``: ok / failed / timeout / memory / output_limit / killed / error (see :func:`run`). ``passed`` /
    ``total``: tests (0 / 0 for a plain run). ``tests``: per test ``{name, status, reason}``. ``reason``: one line
    saying why, for anything but a clean pass. ``stages``: ``parsed`` / ``loaded`` (the program's module ran to the
    end) / ``imports_ok`` / ``errors`` (tests that raised or crashed, as opposed to wrong answers) / ``ran`` (tests
    that reached a verdict) / ``load_status`` (why loading failed: syntax, import, exit, memory, timeout, killed),
    used by staged rewards.
    """

    status: str
    exit_code: int | None = None
    passed: int = 0
    total: int = 0
    stdout: str = ""
    stderr: str = ""
    time: float = 0.0
    reason: str = ""
    tests: list = field(default_factory=list)
    truncated: bool = False
    mode: str = ""
    stages: dict = field(default_factory=dict)
    uid: int | None = None

    @property
    def fraction(self) -> float:
        """passed / total; 0.0 when no test was collected."""
        return self.passed / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("uid")
        d["time"] = round(self.time, 4)
        return d


# ------------------------------------------------------------------------------------------------ probing

_CAPS: dict[str, dict] = {}
_CAPS_LOCK = threading.Lock()
_WARNED: set[str] = set()


def _python_prefix(python: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.realpath(python)))


def _default_python() -> str:
    env = os.environ.get("POSTRL_SANDBOX_PYTHON")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise ConfigError(f"POSTRL_SANDBOX_PYTHON={env}: not an executable file")
        return os.path.realpath(env)
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _others_can_use(python: str) -> bool:
    """True when a stranger uid can execute ``python`` and read its installation (every ancestor o+x)."""
    prefix = _python_prefix(python)
    for p in (python, prefix, os.path.join(prefix, "lib")):
        q = Path(p)
        for d in [q, *q.parents]:
            try:
                mode = d.stat().st_mode
            except OSError:
                return False
            if not mode & 0o001:
                return False
    return True


def _bwrap_binary() -> str | None:
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap")
                                          if os.access(p, os.X_OK)), None)


def capabilities(mode: str | None = None) -> dict:
    """What this machine enforces, probed once per mode (``POSTRL_SANDBOX`` = auto | bwrap | namespaces | fallback).

    Returns ``{"mode", "variant", "python", "isolated": {network, filesystem_read, filesystem_write, processes,
    ipc, environment}, "limits": {limit: how it is enforced}, "not_isolated": [..], "notes": [..], "cgroup"}``.
    ``auto`` uses bubblewrap when it works, else namespaces when the kernel allows them, else falls back (logging
    one warning naming what is then not isolated); ``bwrap`` and ``namespaces`` raise :class:`PostrlError` when
    they do not work here.
    """
    mode = mode or os.environ.get("POSTRL_SANDBOX", "auto") or "auto"
    if mode not in MODES:
        raise ConfigError(f"sandbox mode '{mode}': expected one of {', '.join(MODES)} (POSTRL_SANDBOX)")
    with _CAPS_LOCK:
        if mode not in _CAPS:
            _CAPS[mode] = _with_cgroup(_probe(mode), _cgroup_bases())
        caps = _CAPS[mode]
    if caps["warning"] and caps["warning"] not in _WARNED:
        _WARNED.add(caps["warning"])
        log.warning(caps["warning"])
    return caps


def _probe(mode: str) -> dict:
    if not sys.platform.startswith("linux"):
        raise PostrlError(f"the code sandbox needs Linux (rlimits, /proc, namespaces); this is {sys.platform}")
    python = _default_python()
    root = os.geteuid() == 0
    errors = []
    if mode in ("auto", "bwrap"):
        bwrap = _bwrap_binary()
        if bwrap is None:
            errors.append("bwrap not found (install the 'bubblewrap' package)")
        else:
            for variant in (["privileged", "userns"] if root else ["userns"]):
                for sized in (True, False):
                    caps = _bwrap_caps(variant, bwrap, python, sized, root)
                    caps["harness_dir"] = _harness_dir(python)
                    err = _check(caps)
                    if err is None:
                        return caps
                    errors.append(f"{variant}{'' if sized else ' without tmpfs size'}: {err}")
        if mode == "bwrap":
            raise PostrlError("POSTRL_SANDBOX=bwrap but bubblewrap does not work here: " + "; ".join(errors))
    if mode in ("auto", "namespaces"):
        caps = _namespaces_caps(python, root)
        caps["harness_dir"] = _harness_dir(python)
        err = _check(caps)
        if err is None:
            return caps
        errors.append(f"namespaces (unshare): {err}")
        if mode == "namespaces":
            raise PostrlError("POSTRL_SANDBOX=namespaces but this kernel does not let an unprivileged process "
                              "create user, mount and pid namespaces: " + "; ".join(errors))
    candidates = [python] + [p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)]
    for py in dict.fromkeys(os.path.realpath(p) for p in candidates):
        if root and not _others_can_use(py):
            errors.append(f"{py} is not usable by an unprivileged uid")
            continue
        caps = _fallback_caps(py, root, errors if mode == "auto" else [])
        caps["harness_dir"] = _harness_dir(py)
        err = _check(caps)
        if err is None:
            return caps
        errors.append(f"fallback with {py}: {err}")
    raise PostrlError("the code sandbox does not work on this machine: " + "; ".join(errors))


def _check(caps: dict) -> str | None:
    try:
        res = _execute(caps, "print('ok')", None, None, Limits(timeout=20.0, memory_mb=256), site=False)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if res.status == "ok" and res.stdout == "ok\n":
        return None
    return f"probe program gave status {res.status}: {res.reason or res.stderr.strip()[-300:]}"


def _bwrap_caps(variant: str, bwrap: str, python: str, sized: bool, root: bool) -> dict:
    unique_uid = variant == "privileged"
    nproc = ("RLIMIT_NPROC on a uid unique to the run" if unique_uid else
             "NOT enforced: RLIMIT_NPROC does not apply to root, and root inside a user namespace is still root"
             if root else "RLIMIT_NPROC, counted per user namespace (kernel >= 5.14; older kernels count all the "
                          "user's processes)")
    not_isolated = [] if (unique_uid or not root) else ["process count (root in a user namespace)"]
    warning = None
    if not_isolated:
        warning = (f"postrl sandbox: bubblewrap ({variant}) works, but these limits are NOT enforced here: "
                   f"{', '.join(not_isolated)}")
    if not sized:
        warning = (warning + "; " if warning else "postrl sandbox: ") + (
            "this bubblewrap cannot size a tmpfs: the disk limit is per file only (RLIMIT_FSIZE)")
    return {
        "mode": "bwrap", "variant": variant, "bwrap": bwrap, "python": python, "sized": sized,
        "unique_uid": unique_uid, "kill_all": True,
        "isolated": {"network": True, "filesystem_read": True, "filesystem_write": True, "processes": True,
                     "ipc": True, "environment": True},
        "limits": {"wall_time": "host kills the sandbox (its pid namespace dies with it)",
                   "cpu_time": "RLIMIT_CPU per process", "memory": "RLIMIT_AS per process", "processes": nproc,
                   "output": "host stops reading and kills the sandbox",
                   "disk": "tmpfs size for /box, /tmp and /dev/shm, RLIMIT_FSIZE per file" if sized else
                           "RLIMIT_FSIZE per file only (no total)",
                   "open_files": "RLIMIT_NOFILE"},
        "not_isolated": not_isolated,
        "notes": ["no seccomp filter: the kernel is shared (a kernel exploit is not contained)",
                  "read-only view: /usr, the Python installation and /etc/ld.so.cache; nothing else of the host"],
        "warning": warning,
    }


def _namespaces_caps(python: str, root: bool) -> dict:
    """No bubblewrap, but the kernel lets this process create namespaces: the harness builds the same isolation
    itself (user, mount, pid, network, ipc, uts and cgroup namespaces; a fresh read-only root; see
    ``_harness._confine``)."""
    nproc = ("RLIMIT_NPROC on a uid unique to the run (the sandbox's root maps to it)" if root else
             "RLIMIT_NPROC, counted per user namespace (kernel >= 5.14)")
    return {
        "mode": "namespaces", "variant": "unique-uid" if root else "userns", "bwrap": None, "python": python,
        "sized": True, "unique_uid": root, "kill_all": True,
        "isolated": {"network": True, "filesystem_read": True, "filesystem_write": True, "processes": True,
                     "ipc": True, "environment": True},
        "limits": {"wall_time": "host kills the sandbox (its pid namespace dies with it)",
                   "cpu_time": "RLIMIT_CPU per process", "memory": "RLIMIT_AS per process", "processes": nproc,
                   "output": "host stops reading and kills the sandbox",
                   "disk": "tmpfs size for /box, /tmp and /dev/shm, RLIMIT_FSIZE per file",
                   "open_files": "RLIMIT_NOFILE"},
        "not_isolated": [],
        "notes": ["bubblewrap not found or unusable: namespaces built by the harness (unshare, mount, pivot_root)",
                  "root inside maps to " + ("a uid unique to the run" if root else "this user") + " outside",
                  "no seccomp filter: the kernel is shared (a kernel exploit is not contained)",
                  "read-only view: /usr, the Python installation and /etc/ld.so.cache; nothing else of the host",
                  "every capability dropped and nested user namespaces forbidden before the program runs"],
        "warning": None,
    }


# ------------------------------------------------------------------------------------------------ cgroups

_CGROUP_SLACK_MB = 32  # the sandbox's own supervisor processes, charged to the same cgroup as the program


def _cgroup_bases() -> dict | None:
    """Where this process may create a child cgroup with a memory and a pids limit: ``{"memory": dir,
    "pids": dir}`` (v1 hierarchies, or the same v2 directory twice), or None (no cgroup: not root, read-only
    cgroupfs, controllers not delegated)."""
    try:
        own = {}
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(","):
                    own[c] = path
    except (OSError, ValueError):
        return None
    fs = "/sys/fs/cgroup"
    if os.path.exists(f"{fs}/cgroup.controllers"):  # v2: the controllers must be enabled for our children
        base = fs + own.get("", "/")
        try:
            with open(f"{base}/cgroup.subtree_control") as f:
                ctl = f.read().split()
        except OSError:
            return None
        return {"memory": base, "pids": base} if {"memory", "pids"} <= set(ctl) else None
    out = {}
    for c in ("memory", "pids"):
        cand = [f"{fs}/{c}{own.get(c, '/')}".rstrip("/"), f"{fs}/{c}"]
        out[c] = next((d for d in cand if os.path.isdir(d)), None)
    if None in out.values():
        return None
    probe = _Cgroup.create(out, 64, 8, tag="probe")
    if probe is None:
        return None
    probe.remove()
    return out


class _Cgroup:
    """One run's cgroup(s): total memory (RAM + swap where the kernel accounts it, tmpfs pages included) and
    total tasks of everything the sandbox starts. The launcher joins it before anything else runs."""

    def __init__(self, dirs: list[str]):
        self.dirs = dirs

    @staticmethod
    def create(bases: dict, memory_mb: int, tasks: int, tag: str | None = None) -> "_Cgroup | None":
        name = f"postrl-sandbox-{tag or secrets.token_hex(8)}-{os.getpid()}"
        dirs: list[str] = []
        cg = _Cgroup(dirs)
        try:
            for base in dict.fromkeys((bases["memory"], bases["pids"])):
                d = os.path.join(base, name)
                os.mkdir(d)
                dirs.append(d)
            mem, pids = os.path.join(bases["memory"], name), os.path.join(bases["pids"], name)
            if os.path.exists(f"{mem}/memory.max"):  # v2
                _write(f"{mem}/memory.max", str(memory_mb << 20))
                _write(f"{mem}/memory.swap.max", "0", missing_ok=True)
            else:
                _write(f"{mem}/memory.limit_in_bytes", str(memory_mb << 20))
                _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_mb << 20), missing_ok=True)
            _write(f"{pids}/pids.max", str(tasks))
        except OSError:
            cg.remove()
            return None
        return cg

    def oom_kills(self) -> int:
        """Processes the kernel killed for going over the memory limit."""
        for d in self.dirs:
            for f in ("memory.events", "memory.oom_control"):
                try:
                    with open(os.path.join(d, f)) as fh:
                        for line in fh:
                            k, _, v = line.partition(" ")
                            if k == "oom_kill":
                                return int(v)
                except (OSError, ValueError):
                    continue
        return 0

    def remove(self) -> None:
        for d in self.dirs:
            for _ in range(200):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)


def _write(path: str, text: str, missing_ok: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        if not (missing_ok and not os.path.exists(path)):
            raise


_CGROUP_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@"'


def _with_cgroup(caps: dict, bases: dict | None) -> dict:
    """Record how the whole program's memory and process count are bounded (cgroup, else per process)."""
    caps["cgroup"] = bases
    if bases is not None:
        caps["limits"]["memory"] = (f"a cgroup: memory_mb (+{_CGROUP_SLACK_MB} MB for the supervisor) for every "
                                    "process of the run together, tmpfs included; RLIMIT_AS per process too")
        caps["limits"]["processes"] = "a cgroup (pids.max: processes + threads of the whole run), and " + \
            caps["limits"]["processes"]
        caps["not_isolated"] = [x for x in caps["not_isolated"] if not x.startswith("process count")]
    else:
        caps["limits"]["memory"] = ("RLIMIT_AS per process only (no cgroup can be created here): the program as a "
                                    "whole can hold up to memory_mb x processes")
        caps["not_isolated"] = caps["not_isolated"] + ["total memory: bounded only per process (RLIMIT_AS) x "
                                                       "process count"]
    missing = [x for x in caps["not_isolated"] if caps["mode"] != "fallback"]
    if caps["mode"] != "fallback":
        caps["warning"] = (f"postrl sandbox: {caps['mode']} mode works, but these are NOT enforced here: "
                           + "; ".join(missing)) if missing else None
        if caps["mode"] == "bwrap" and not caps["sized"]:
            caps["warning"] = (caps["warning"] + "; " if caps["warning"] else "postrl sandbox: ") + (
                "this bubblewrap cannot size a tmpfs: the disk limit is per file only (RLIMIT_FSIZE)")
    else:
        caps["warning"] = caps["warning"].split(". NOT isolated: ")[0] + ". NOT isolated: " + \
            "; ".join(caps["not_isolated"])
    return caps


def _fallback_caps(python: str, root: bool, errors: list) -> dict:
    not_isolated = ["network (the host's loopback and beyond, UNIX sockets by path and abstract)",
                    "filesystem reads outside the sandbox (anything readable by "
                    + ("an unknown uid: world-readable files" if root else "this user") + ")",
                    "process visibility (other processes and their command lines are listed in /proc)",
                    "IPC (SysV shared memory, message queues, semaphores: created on the host and can outlive "
                    "the run)",
                    "disk: RLIMIT_FSIZE per file and the private folder's size; nothing bounds the total written "
                    "elsewhere"]
    if root:
        not_isolated.append("writes to world-writable places outside the sandbox (/tmp, /var/tmp, /dev/shm, "
                            "/run/lock; top-level leftovers of the run's uid there are removed afterwards)")
    else:
        not_isolated += ["writes to this user's files outside the sandbox",
                         "signals: the program can kill any process of this user",
                         "process count: approximate (RLIMIT_NPROC counts all of the user's processes)",
                         "clean-up: a program that double-forks into a new session after its supervisor died "
                         "can outlive the run"]
    why = ("neither bubblewrap nor namespaces usable: " + "; ".join(errors)) if errors else \
        "namespaces not requested (POSTRL_SANDBOX=fallback)"
    return {
        "mode": "fallback", "variant": "root-uid" if root else "same-uid", "bwrap": None, "python": python,
        "sized": False, "unique_uid": root, "kill_all": root,
        "isolated": {"network": False, "filesystem_read": False, "filesystem_write": False, "processes": False,
                     "ipc": False, "environment": True},
        "limits": {"wall_time": "host kills the process group" + (" and every process of the run's uid" if root
                                                                  else " and its descendants"),
                   "cpu_time": "RLIMIT_CPU per process", "memory": "RLIMIT_AS per process",
                   "processes": "RLIMIT_NPROC on a uid unique to the run" if root else
                                "approximate: RLIMIT_NPROC counts all processes of this user",
                   "output": "host stops reading and kills the sandbox",
                   "disk": "RLIMIT_FSIZE per file only (no total)", "open_files": "RLIMIT_NOFILE"},
        "not_isolated": not_isolated,
        "notes": [why],
        "warning": ("postrl sandbox: running programs WITHOUT namespaces (" + why
                    + "). NOT isolated: " + "; ".join(not_isolated)),
    }


# ------------------------------------------------------------------------------------------------ launching


def _bwrap_argv(caps: dict, python: str, disk_bytes: int, report_fd: int, info_fd: int) -> list[str]:
    a = [caps["bwrap"]]
    if caps["variant"] == "privileged":
        a += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        a += ["--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
              "--unshare-cgroup-try", "--disable-userns"]
    a += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            a += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            a += ["--ro-bind", d, d]
    a += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefix = _python_prefix(python)
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        parts = Path(prefix).parts
        for i in range(2, len(parts)):
            a += ["--perms", "0755", "--dir", str(Path(*parts[:i]))]
        a += ["--ro-bind", prefix, prefix]
    if caps.get("harness_dir"):
        a += ["--ro-bind", caps["harness_dir"], _HARNESS_MOUNT]
    a += ["--proc", "/proc", "--dev", "/dev"]
    size = ["--size", str(disk_bytes)] if caps["sized"] else []
    a += ["--perms", "1777", *size, "--tmpfs", "/tmp", "--perms", "0777", *size, "--tmpfs", _BOX,
          "--perms", "1777", *size, "--tmpfs", "/dev/shm"]
    a += ["--chdir", _BOX, "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "LANG",
          "C.UTF-8", "--setenv", "HOME", _BOX, "--setenv", "TMPDIR", "/tmp", "--info-fd", str(info_fd)]
    return a


def _proc_uid_pids(uid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    out.append(int(name))
            except OSError:
                pass
    return out


def _proc_ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        return int(st[st.rindex(")") + 2:].split()[1])
    except (OSError, ValueError):
        return None


def _proc_descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            pp = _proc_ppid(int(name))
            if pp is not None:
                kids.setdefault(pp, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _terminate(p: subprocess.Popen, caps: dict, child_pid: int | None, uid: int | None) -> None:
    """Kill the whole sandbox and reap its top process; afterwards nothing of the run is left."""
    if caps["mode"] == "bwrap":
        if child_pid and _proc_ppid(child_pid) == p.pid:
            _kill([child_pid])  # the pid namespace's init: the kernel kills every process inside with it
        try:
            p.wait(timeout=2.0)
            return
        except subprocess.TimeoutExpired:
            pass
    if caps["mode"] == "namespaces":  # the top process waits outside; its death kills the namespace's init
        while p.poll() is None:
            _kill(_proc_descendants(p.pid) + [p.pid])
            time.sleep(0.005)
        p.wait()
        return
    # fallback: the top process is the run's reaper (it runs no program code); kill everything below it, let it
    # reap and exit; only if it does not, kill it too.
    t_end = time.monotonic() + 1.0
    while p.poll() is None:
        victims = _proc_descendants(p.pid)
        if uid is not None:
            victims += _proc_uid_pids(uid)
        _kill(victims)
        if time.monotonic() > t_end:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            _kill([p.pid])
        time.sleep(0.005)
    p.wait()


def _sweep_uid(uid: int | None) -> None:
    """Fallback clean-up: nothing may keep running under the run's uid, and what it left in the shared
    world-writable directories (top level of the temp dir, /var/tmp, /dev/shm, /run/lock) is removed."""
    if uid is None:
        return
    for _ in range(100):
        pids = _proc_uid_pids(uid)
        if not pids:
            break
        _kill(pids)
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


def _execute(caps: dict, code: str, kind_spec: dict | None, stdin: str | None, limits: Limits, *,
             site: bool) -> SandboxResult:
    """Launch the harness for one run and turn its report into a :class:`SandboxResult`."""
    t0 = time.monotonic()
    mode = "run" if kind_spec is None else kind_spec["kind"]
    units = [] if kind_spec is None else kind_spec["units"]
    uid = (1 << 24) + secrets.randbelow(1 << 29) if caps["unique_uid"] else None
    margin = min(1.0, max(0.15, 0.1 * limits.timeout))
    nonce = secrets.token_hex(16)
    python = caps["python"]
    private = None
    if caps["mode"] == "bwrap":
        workdir = _BOX
    else:
        private = tempfile.mkdtemp(prefix="postrl-sandbox-")
        os.chmod(private, 0o700)
        if uid is not None:
            os.chown(private, uid, uid)
        workdir = _BOX if caps["mode"] == "namespaces" else private
    flags = ["-I"] if site else ["-I", "-S"]
    spec = {"mode": mode, "code": code, "units": units, "stdin": stdin, "limits": limits.harness_dict(),
            "deadline": time.time() + limits.timeout - margin, "workdir": workdir, "python": python,
            "python_flags": flags, "uid": uid, "gid": uid, "kill_all": caps["kill_all"],
            "reaper": caps["mode"] == "fallback", "harden_prctl": caps["variant"] != "privileged",
            "signals": _SIGNALS}
    if kind_spec is not None:
        spec.update({k: v for k, v in kind_spec.items() if k not in ("kind", "units")})
    if mode == "stdio":
        spec["import_src"] = _imports_source(code)
    if caps["mode"] == "namespaces":  # the harness drops to the run's uid itself, before entering the namespaces
        spec["confine"] = dict(_confine_spec(private, python, int(limits.disk_mb) << 20), uid=uid)
        spec["uid"] = spec["gid"] = None
    blob = marshal.dumps(spec, 4)
    feed = memoryview(str(len(blob)).encode() + b"\n" + blob + nonce.encode() + b"\n")
    report_r, report_w = os.pipe()
    info_r, info_w = os.pipe()
    hdir = caps.get("harness_dir")
    if hdir is None:
        harness = flags + ["-c", _harness_source(), str(report_w)]
    else:
        harness = flags + ["-c", _HARNESS_BOOT, _HARNESS_MOUNT if caps["mode"] == "bwrap" else hdir, str(report_w)]
    if caps["mode"] == "bwrap":
        argv = _bwrap_argv(caps, python, int(limits.disk_mb) << 20, report_w, info_w) + ["--", python] + harness
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        cwd = "/"
    elif caps["mode"] == "namespaces":
        argv = [python] + harness
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": _BOX, "TMPDIR": "/tmp"}
        cwd = "/"
    else:
        argv = [python] + harness
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        cwd = workdir
    cgroup = None
    if caps.get("cgroup"):
        cgroup = _Cgroup.create(caps["cgroup"], int(limits.memory_mb) + _CGROUP_SLACK_MB,
                                int(limits.processes) + 8)
        if cgroup is None:
            for fd in (report_r, report_w, info_r, info_w):
                os.close(fd)
            if private:
                shutil.rmtree(private, ignore_errors=True)
            raise PostrlError(f"sandbox: could not create the run's cgroup under {caps['cgroup']['memory']} "
                              "(it worked when the sandbox was probed; is the cgroup filesystem full or read-only?)")
        argv = ["/bin/sh", "-c", _CGROUP_JOIN, "sh", *cgroup.dirs, "--", *argv]
    try:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             pass_fds=(report_w, info_w), env=env, cwd=cwd, start_new_session=True)
    except BaseException:
        for fd in (report_r, report_w, info_r, info_w):
            os.close(fd)
        if private:
            shutil.rmtree(private, ignore_errors=True)
        if cgroup is not None:
            cgroup.remove()
        raise
    os.close(report_w)
    os.close(info_w)
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
    _interpret(res, report, mode, units, limits, p.returncode, timed_out, overflow)
    if oom:
        res.status = "memory"
        res.reason = (f"memory limit of {limits.memory_mb} MB for the whole program exceeded (the kernel killed "
                      f"{oom} process{'es' if oom > 1 else ''})" + (f"; {res.reason}" if res.reason else ""))
    return res


def _confine_spec(root: str, python: str, disk_bytes: int) -> dict:
    """What the harness mounts in namespaces mode: the same read-only view as bubblewrap's."""
    binds, links = [("/usr", "/usr")], []
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            binds.append((d, d))
    if os.path.exists("/etc/ld.so.cache"):
        binds.append(("/etc/ld.so.cache", "/etc/ld.so.cache"))
    prefix = _python_prefix(python)
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        binds.append((prefix, prefix))
    return {"root": root, "binds": binds, "symlinks": links, "disk_bytes": disk_bytes}


_HARNESS_SRC: list[str] = []
_SIGNALS = {"KILL": int(signal.SIGKILL), "XCPU": int(signal.SIGXCPU), "XFSZ": int(signal.SIGXFSZ),
            "names": {int(s): s.name for s in signal.Signals}}


def _imports_source(code: str) -> str:
    """The program's top-level import statements (the stage check of a stdin/stdout program)."""
    import ast

    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ""
    return "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))


def _harness_source() -> str:
    if not _HARNESS_SRC:
        _HARNESS_SRC.append(_HARNESS.read_text())
    return _HARNESS_SRC[0]


_HARNESS_DIRS: dict[str, str | None] = {}
_HARNESS_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); import _harness; del sys.path[0]; "
                 "_harness.main(sys.argv[2])")


def _harness_dir(python: str) -> str | None:
    """A private read-only copy of the harness with its bytecode compiled by ``python`` (compiling the source at
    every run would cost more than the run); None when that fails (the source is then passed with ``-c``)."""
    if python in _HARNESS_DIRS:
        return _HARNESS_DIRS[python]
    d = tempfile.mkdtemp(prefix="postrl-harness-")
    try:
        shutil.copyfile(_HARNESS, os.path.join(d, "_harness.py"))
        subprocess.run([python, "-I", "-S", "-c", "import py_compile, sys; py_compile.compile(sys.argv[1], "
                        "doraise=True)", os.path.join(d, "_harness.py")], check=True, timeout=120,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin"})
        for root, dirs, files in os.walk(d):
            os.chmod(root, 0o755)
            for f in files:
                os.chmod(os.path.join(root, f), 0o644)
        atexit.register(shutil.rmtree, d, True)
    except (OSError, subprocess.SubprocessError):
        shutil.rmtree(d, ignore_errors=True)
        d = None
    _HARNESS_DIRS[python] = d
    return d


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


_SEVERITY = ("output_limit", "timeout", "memory", "killed", "error", "fail", "pass")


def _interpret(res: SandboxResult, report: dict | None, mode: str, units: list, limits: Limits,
               returncode: int | None, timed_out: bool, overflow: str | None) -> None:
    tests = []
    if report is not None and mode != "run":
        got = report.get("tests")
        if isinstance(got, list) and len(got) == len(units):
            tests = [{"name": u["name"], "status": str(t.get("status")), "reason": str(t.get("reason", ""))}
                     for u, t in zip(units, got)]
        else:
            report = None  # a report that does not match the test list is not a report
    res.tests = tests
    res.passed = sum(t["status"] == "pass" for t in tests)
    load = (report or {}).get("load") or {}
    res.stages = {"loaded": bool(load.get("loaded")) if mode in ("asserts", "calls") else None,
                  "imports_ok": (report or {}).get("imports_ok") if mode == "stdio" else None,
                  "errors": sum(t["status"] not in ("pass", "fail") for t in tests),
                  "ran": sum(t["status"] in ("pass", "fail") for t in tests),
                  "load_status": load.get("status")}
    if mode in ("asserts", "calls"):
        res.stages["imports_ok"] = res.stages["loaded"]
    if overflow == "disk":
        res.status, res.exit_code = "output_limit", None
        res.reason = f"disk limit exceeded: the private directory grew over {limits.disk_mb} MB"
        return
    if overflow:
        res.status, res.exit_code = "output_limit", None
        res.reason = f"output limit exceeded: {overflow} over {limits.output_bytes} bytes"
        return
    if timed_out:
        res.status, res.exit_code = "timeout", None
        res.reason = f"wall-time limit of {limits.timeout:g}s exceeded"
        if tests:
            res.reason += f" ({res.passed}/{len(units)} tests passed before)"
        return
    if report is None:
        res.passed, res.tests = 0, []
        if returncode is not None and returncode >= 128:
            res.status = "killed"
            res.reason = (f"the sandbox supervisor was killed (signal {returncode - 128}) before it reported: "
                          "the program killed its parent")
        elif returncode is not None and returncode < 0:
            res.status = "killed"
            res.reason = f"the sandbox was killed (signal {-returncode}) before it reported"
        else:
            res.status = "error"
            tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            res.reason = f"the sandbox failed without a report (exit status {returncode}): {tail[0][:300]}"
        res.exit_code = None
        return
    if mode == "run":
        code, sig = report.get("exit"), report.get("signal")
        res.exit_code = code if sig is None else -int(sig)
        if sig is not None:
            if sig == signal.SIGXCPU:
                res.status, res.reason = "timeout", f"CPU-time limit of {limits.cpu or limits.timeout:g}s exceeded"
            else:
                res.status = "killed"
                res.reason = f"killed by {_signame(sig)}"
        elif code == 0:
            res.status, res.reason = "ok", ""
        elif "MemoryError" in res.stderr[-2000:]:
            res.status, res.reason = "memory", f"memory limit of {limits.memory_mb} MB exceeded (MemoryError)"
        else:
            res.status = "failed"
            tail = [ln for ln in res.stderr.strip().splitlines() if ln.strip()][-1:] or [""]
            res.reason = f"exit code {code}" + (f": {tail[0][:300]}" if tail[0] else "")
        return
    n = len(units)
    if load.get("loaded") is False:
        st = load.get("status")
        res.status = {"timeout": "timeout", "memory": "memory", "killed": "killed"}.get(st, "failed")
        res.exit_code = 1
        res.reason = f"0/{n} tests: the program did not load: {load.get('error') or st}"
        return
    if res.passed == n:
        res.status, res.exit_code, res.reason = "ok", 0, ""
        return
    worst = min((t["status"] for t in tests), key=lambda s: _SEVERITY.index(s) if s in _SEVERITY else 4)
    res.status = {"output_limit": "output_limit", "timeout": "timeout", "memory": "memory",
                  "killed": "killed"}.get(worst, "failed")
    res.exit_code = 1
    first = next(t for t in tests if t["status"] != "pass")
    res.reason = f"{res.passed}/{n} tests passed; first failure {first['name']}: {first['status']}" + (
        f" ({first['reason'][:300]})" if first["reason"] else "")


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# ------------------------------------------------------------------------------------------------ public


def run(code: str, tests: Any = None, *, stdin: str | None = None, limits: Limits | None = None,
        mode: str | None = None, site: bool = False, module: str = "solution") -> SandboxResult:
    """Run ``code`` in the sandbox; with ``tests`` (see :mod:`postrl.sandbox.testspec`), run it against them.

    Without tests: ``status`` is ok (exit code 0), failed (non-zero exit), timeout (wall or CPU limit), memory
    (MemoryError under the address-space limit), output_limit, killed (a signal) or error (the sandbox itself
    failed). With tests: ok only when every test passed; failed when some failed or the program did not load
    (syntax error, exception or exit while loading); timeout / memory / output_limit / killed when a test or the
    run hit that limit. ``passed``/``total`` count tests; "no tests collected" is 0/0, status failed.
    ``site=True`` lets the program import the sandbox interpreter's site-packages (default: standard library).
    Test code sees the program's top-level names directly and as the module ``solution``; ``module`` names it a
    second time (``postrl sandbox prog.py`` passes ``prog``, so a test file can ``from prog import add``).
    """
    if not isinstance(code, str):
        raise ConfigError(f"sandbox: code must be a string, got {type(code).__name__}")
    if not (isinstance(module, str) and module.isidentifier()):
        raise ConfigError(f"sandbox: module must be a Python identifier, got {module!r}")
    caps = capabilities(mode)
    limits = limits or Limits()
    t0 = time.monotonic()
    spec = None
    if tests is not None:
        spec = collect(tests)
        if not spec["units"]:
            return SandboxResult(status="failed", exit_code=1, reason="no tests collected: 0/0 is not a pass",
                                 mode=caps["mode"], time=time.monotonic() - t0, stages=_no_stages(code))
        try:
            compile(code, "solution.py", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
            n = len(spec["units"])
            return SandboxResult(status="failed", exit_code=1, total=n, mode=caps["mode"],
                                 reason=f"0/{n} tests: syntax error: {type(e).__name__}: {e}",
                                 time=time.monotonic() - t0,
                                 tests=[{"name": u["name"], "status": "error", "reason": "syntax error"}
                                        for u in spec["units"]],
                                 stages={"parsed": False, "loaded": False, "imports_ok": False, "errors": n,
                                         "ran": 0, "load_status": "syntax"})
    if spec is not None:
        spec = dict(spec, module=module)
    res = _execute(caps, code, spec, stdin, limits, site=site)
    res.stages["parsed"] = True if spec is not None else _parses(code)
    return res


def _parses(code: str) -> bool:
    try:
        compile(code, "solution.py", "exec", dont_inherit=True)
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False


def _no_stages(code: str) -> dict:
    return {"parsed": _parses(code), "loaded": None, "imports_ok": None, "errors": 0, "ran": 0, "load_status": None}
