"""Confinement, host side: the sandbox's read-only view of the host, bubblewrap's command line, what the harness
builds in namespaces mode, and the run's cgroup.

The other parts of the confinement: the system-call filter (:mod:`postrl.sandbox.seccomp`) and, inside the sandbox,
the namespaces, privileges, rlimits and the filter's loading (:mod:`postrl.sandbox._harness.confine`).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

BOX = "/box"  # the private working directory (also HOME) inside bwrap and namespaces modes
HARNESS_MOUNT = "/.postrl"  # where bubblewrap shows the harness
CGROUP_SLACK_MB = 32  # the sandbox's own supervisor processes, charged to the same cgroup as the program
CGROUP_SLACK_TASKS = 8
# joins the run's cgroup(s), then execs the launcher: ``sh -c CGROUP_JOIN sh DIR... -- ARGV...``
CGROUP_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@"'


def python_prefix(python: str) -> str:
    return os.path.dirname(os.path.dirname(os.path.realpath(python)))


def _view(python: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """What of the host the sandbox sees, read-only: ``([(source, target)] binds, [(link, target)] symlinks)``:
    ``/usr`` and the ``/bin``, ``/sbin``, ``/lib*`` links (or directories), ``/etc/ld.so.cache`` and the Python
    installation."""
    binds, links = [("/usr", "/usr")], []
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            binds.append((d, d))
    if os.path.exists("/etc/ld.so.cache"):
        binds.append(("/etc/ld.so.cache", "/etc/ld.so.cache"))
    prefix = python_prefix(python)
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        binds.append((prefix, prefix))
    return binds, links


def bwrap_argv(caps: dict, python: str, disk_bytes: int, info_fd: int, seccomp_fd: int | None) -> list[str]:
    """bubblewrap's command line, up to (not including) ``--`` and the command."""
    a = [caps["bwrap"]]
    if caps["variant"] == "privileged":
        a += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        a += ["--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
              "--unshare-cgroup-try", "--disable-userns"]
    a += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    binds, links = _view(python)
    for src, dst in binds:
        parts = Path(dst).parts
        if src == python_prefix(python):  # bubblewrap would make its parents 0700: the run's uid must walk them
            for i in range(2, len(parts)):
                a += ["--perms", "0755", "--dir", str(Path(*parts[:i]))]
        a += ["--ro-bind", src, dst]
    for link, target in links:
        a += ["--symlink", target, link]
    if caps.get("harness_dir"):
        a += ["--ro-bind", caps["harness_dir"], HARNESS_MOUNT]
    a += ["--proc", "/proc", "--dev", "/dev"]
    size = ["--size", str(disk_bytes)] if caps["sized"] else []
    a += ["--perms", "1777", *size, "--tmpfs", "/tmp", "--perms", "0777", *size, "--tmpfs", BOX,
          "--perms", "1777", *size, "--tmpfs", "/dev/shm"]
    a += ["--chdir", BOX, "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "LANG",
          "C.UTF-8", "--setenv", "HOME", BOX, "--setenv", "TMPDIR", "/tmp", "--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        a += ["--seccomp", str(seccomp_fd)]
    return a


def namespaces_spec(root: str, python: str, disk_bytes: int, uid: int | None) -> dict:
    """What the harness builds in namespaces mode (``_harness.confine.confine``): the same view as bubblewrap's,
    on an empty tmpfs at ``root``."""
    binds, links = _view(python)
    return {"root": root, "binds": binds, "symlinks": links, "disk_bytes": disk_bytes, "uid": uid}


# ------------------------------------------------------------------------------------------------ cgroups


def cgroup_bases() -> dict | None:
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
    probe = Cgroup.create(out, 64, 8, tag="probe")
    if probe is None:
        return None
    probe.remove()
    return out


class Cgroup:
    """One run's cgroup(s): total memory (RAM + swap where the kernel accounts it, tmpfs pages included) and
    total tasks of everything the sandbox starts. The launcher joins it (:data:`CGROUP_JOIN`) before anything else
    runs."""

    def __init__(self, dirs: list[str]):
        self.dirs = dirs

    @staticmethod
    def create(bases: dict, memory_mb: int, tasks: int, tag: str | None = None) -> "Cgroup | None":
        name = f"postrl-sandbox-{tag or secrets.token_hex(8)}-{os.getpid()}"
        dirs: list[str] = []
        cg = Cgroup(dirs)
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
