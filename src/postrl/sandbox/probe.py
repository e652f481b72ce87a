"""Capability probing: which isolation works on this machine, and what it enforces.

:func:`capabilities` probes once per process and mode (``POSTRL_SANDBOX`` = auto | bwrap | namespaces | fallback)
by running a probe program in each candidate, in order: bubblewrap (as root: privileged, then in a user
namespace; with sized tmpfs, then without), the namespaces the harness builds itself, then the fallback (rlimits
only). Every candidate is tried with the seccomp filter first; where it runs only without the filter, the filter is
reported off with the reason. What is then not enforced is logged once, as a warning.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path

from postrl.sandbox import confine, seccomp
from postrl.sandbox.errors import SandboxConfigError, SandboxUnavailable
from postrl.sandbox.launch import harness_dir, launch
from postrl.sandbox.limits import Limits

log = logging.getLogger("postrl.sandbox")

MODES = ("auto", "bwrap", "namespaces", "fallback")
_CAPS: dict[str, dict] = {}
_CAPS_LOCK = threading.Lock()
_WARNED: set[str] = set()
# the probe program: prints ok and its seccomp mode (2: a filter is in force)
_PROBE = "print('ok', [ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('Seccomp:')])"


def capabilities(mode: str | None = None) -> dict:
    """What this machine enforces, probed once per mode (``POSTRL_SANDBOX`` = auto | bwrap | namespaces | fallback).

    Returns ``{"mode", "variant", "python", "isolated": {network, filesystem_read, filesystem_write, processes,
    ipc, environment}, "limits": {limit: how it is enforced}, "seccomp": {"enabled", ...}, "not_isolated": [..],
    "notes": [..], "cgroup", "warning"}``. ``seccomp`` says whether the system-call filter is in force, who loads
    it and what it refuses, or why it is off (``not_isolated`` then lists it). ``auto`` uses bubblewrap when it
    works, else namespaces when the kernel allows them, else falls back (logging one warning naming what is then not
    isolated); ``bwrap`` and ``namespaces`` raise :class:`SandboxUnavailable` when they do not work here.
    """
    mode = mode or os.environ.get("POSTRL_SANDBOX", "auto") or "auto"
    if mode not in MODES:
        raise SandboxConfigError(f"sandbox mode '{mode}': expected one of {', '.join(MODES)} (POSTRL_SANDBOX)")
    with _CAPS_LOCK:
        if mode not in _CAPS:
            _CAPS[mode] = _finish(_probe(mode), confine.cgroup_bases())
        caps = _CAPS[mode]
    if caps["warning"] and caps["warning"] not in _WARNED:
        _WARNED.add(caps["warning"])
        log.warning(caps["warning"])
    return caps


def _default_python() -> str:
    env = os.environ.get("POSTRL_SANDBOX_PYTHON")
    if env:
        if not (os.path.isfile(env) and os.access(env, os.X_OK)):
            raise SandboxConfigError(f"POSTRL_SANDBOX_PYTHON={env}: not an executable file")
        return os.path.realpath(env)
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _others_can_use(python: str) -> bool:
    """True when a stranger uid can execute ``python`` and read its installation (every ancestor o+x)."""
    prefix = confine.python_prefix(python)
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


def _probe(mode: str) -> dict:
    """The first candidate of ``mode`` that runs the probe program, before its cgroup and warning are added."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the code sandbox needs Linux (rlimits, /proc, namespaces); this is {sys.platform}")
    python = _default_python()
    root = os.geteuid() == 0
    errors: list[str] = []
    if mode in ("auto", "bwrap"):
        bwrap = _bwrap_binary()
        if bwrap is None:
            errors.append("bwrap not found (install the 'bubblewrap' package)")
        else:
            for variant in (["privileged", "userns"] if root else ["userns"]):
                for sized in (True, False):
                    caps = _bwrap_caps(variant, bwrap, python, sized, root)
                    err = _works(caps)
                    if err is None:
                        return caps
                    errors.append(f"{variant}{'' if sized else ' without tmpfs size'}: {err}")
        if mode == "bwrap":
            raise SandboxUnavailable("POSTRL_SANDBOX=bwrap but bubblewrap does not work here: " + "; ".join(errors))
    if mode in ("auto", "namespaces"):
        caps = _namespaces_caps(python, root)
        err = _works(caps)
        if err is None:
            return caps
        errors.append(f"namespaces (unshare): {err}")
        if mode == "namespaces":
            raise SandboxUnavailable("POSTRL_SANDBOX=namespaces but this kernel does not let an unprivileged "
                                     "process create user, mount and pid namespaces: " + "; ".join(errors))
    candidates = [python] + [p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.path.exists(p)]
    for py in dict.fromkeys(os.path.realpath(p) for p in candidates):
        if root and not _others_can_use(py):
            errors.append(f"{py} is not usable by an unprivileged uid")
            continue
        caps = _fallback_caps(py, root, errors if mode == "auto" else [])
        err = _works(caps)
        if err is None:
            return caps
        errors.append(f"fallback with {py}: {err}")
    raise SandboxUnavailable("the code sandbox does not work on this machine: " + "; ".join(errors))


def _works(caps: dict) -> str | None:
    """None when ``caps`` runs the probe program (with the seccomp filter where this machine can have it, else
    without, saying why in ``caps["seccomp"]``); else why not."""
    try:
        caps["harness_dir"] = harness_dir(caps["python"])
    except SandboxUnavailable as e:
        return str(e)
    why = seccomp.unavailable()
    caps["seccomp"] = {"enabled": why is None, "why": why}
    err = _check(caps)
    if err is not None and why is None:
        caps["seccomp"] = {"enabled": False, "why": f"the filter could not be loaded here ({err})"}
        if _check(caps) is None:
            return None
    return err


def _check(caps: dict) -> str | None:
    try:
        res = launch(caps, _PROBE, None, None, Limits(timeout=20.0, memory_mb=256), site=False)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if res.status != "ok" or not res.stdout.startswith("ok "):
        return f"probe program gave status {res.status}: {res.reason or res.stderr.strip()[-300:]}"
    if caps["seccomp"]["enabled"] and res.stdout != "ok ['2']\n":
        return f"the seccomp filter is not in force (the probe program printed {res.stdout.strip()!r})"
    return None


_VIEW_NOTE = "read-only view: /usr, the Python installation and /etc/ld.so.cache; nothing else of the host"


def _bwrap_caps(variant: str, bwrap: str, python: str, sized: bool, root: bool) -> dict:
    unique_uid = variant == "privileged"
    nproc = ("RLIMIT_NPROC on a uid unique to the run" if unique_uid else
             "NOT enforced: RLIMIT_NPROC does not apply to root, and root inside a user namespace is still root"
             if root else "RLIMIT_NPROC, counted per user namespace (kernel >= 5.14; older kernels count all the "
                          "user's processes)")
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
        "not_isolated": [] if (unique_uid or not root) else ["process count (root in a user namespace)"],
        "notes": [_VIEW_NOTE],
    }


def _namespaces_caps(python: str, root: bool) -> dict:
    """No bubblewrap, but the kernel lets this process create namespaces: the harness builds the same isolation
    itself (user, mount, pid, network, ipc, uts and cgroup namespaces; a fresh read-only root; see
    ``_harness.confine.confine``)."""
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
                  _VIEW_NOTE,
                  "every capability dropped and nested user namespaces forbidden before the program runs"],
    }


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
    }


def _finish(caps: dict, bases: dict | None) -> dict:
    """Add to a working candidate what the whole run's memory and process count are bounded by (a cgroup, else
    per process), the seccomp filter's report, and the one warning that names what is not enforced."""
    caps["cgroup"] = bases
    if bases is not None:
        caps["limits"]["memory"] = (f"a cgroup: memory_mb (+{confine.CGROUP_SLACK_MB} MB for the supervisor) for "
                                    "every process of the run together, tmpfs included; RLIMIT_AS per process too")
        caps["limits"]["processes"] = "a cgroup (pids.max: processes + threads of the whole run), and " + \
            caps["limits"]["processes"]
        caps["not_isolated"] = [x for x in caps["not_isolated"] if not x.startswith("process count")]
    else:
        caps["limits"]["memory"] = ("RLIMIT_AS per process only (no cgroup can be created here): the program as a "
                                    "whole can hold up to memory_mb x processes")
        caps["not_isolated"] = caps["not_isolated"] + ["total memory: bounded only per process (RLIMIT_AS) x "
                                                       "process count"]
    f = caps["seccomp"]
    by = ("bubblewrap (bwrap --seccomp FD)" if caps["mode"] == "bwrap" else
          "the harness (prctl PR_SET_SECCOMP), after confining itself and before the program starts")
    caps["seccomp"] = seccomp.report(f["enabled"], by, f["why"])
    if f["enabled"]:
        caps["notes"].append(f"seccomp filter loaded by {by}: {len(caps['seccomp']['refused_eperm'])} system calls "
                             "fail with EPERM (io_uring, keyrings, bpf, perf_event_open, file handles, namespaces, "
                             "mounts, ptrace, modules...), so do clone with namespace flags and unusual "
                             "personality values; another architecture's calls kill the process. The kernel is "
                             "still shared: an exploit through an allowed call is not contained")
    else:
        caps["not_isolated"] = caps["not_isolated"] + [
            f"kernel attack surface: no seccomp filter ({f['why']}): io_uring, keyctl, add_key, bpf, "
            "perf_event_open, open_by_handle_at, unshare, personality and the rest reach the kernel"]
    if caps["mode"] == "fallback":
        caps["warning"] = ("postrl sandbox: running programs WITHOUT namespaces (" + caps["notes"][0]
                           + "). NOT isolated: " + "; ".join(caps["not_isolated"]))
        return caps
    missing = caps["not_isolated"]
    caps["warning"] = (f"postrl sandbox: {caps['mode']} mode works, but these are NOT enforced here: "
                       + "; ".join(missing)) if missing else None
    if caps["mode"] == "bwrap" and not caps["sized"]:
        caps["warning"] = (caps["warning"] + "; " if caps["warning"] else "postrl sandbox: ") + (
            "this bubblewrap cannot size a tmpfs: the disk limit is per file only (RLIMIT_FSIZE)")
    return caps
