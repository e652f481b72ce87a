"""Confinement inside the sandbox: the namespaces mode's isolation, privileges, rlimits and the seccomp filter.

- :func:`confine` (namespaces mode): new user, mount, pid, network, ipc, uts and cgroup namespaces and a fresh
  read-only root, built with the kernel's own calls, the way bubblewrap does it;
- :func:`reaper` (fallback mode): a child subreaper that kills and reaps what the run leaves;
- :func:`harden`: drop to the run's uid, no-new-privs, not dumpable;
- :func:`load_seccomp`: the system-call filter compiled by :mod:`postrl.sandbox.seccomp` (namespaces and fallback
  modes; bubblewrap loads it itself);
- :func:`apply_limits`: the rlimits of a program process.
"""

import os
import resource
import time

from .util import SIG, descendants, exit_of, get_libc, kill_pids, prctl, proc_scan

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_CAPBSET_DROP = 1, 4, 22, 24
_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 36, 38
_SECCOMP_MODE_FILTER = 2
_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS = {"RDONLY": 1, "NOSUID": 2, "NODEV": 4, "NOEXEC": 8, "REMOUNT": 32, "NOATIME": 1024, "NODIRATIME": 2048,
       "BIND": 4096, "REC": 16384, "PRIVATE": 1 << 18, "RELATIME": 1 << 21}
_ST_TO_MS = ((1, "RDONLY"), (2, "NOSUID"), (4, "NODEV"), (8, "NOEXEC"), (1024, "NOATIME"), (2048, "NODIRATIME"),
             (4096, "RELATIME"))
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}


def harden(spec):
    """Drop root (when started as root), forbid privilege gain, make this process unreadable to the program.

    ``prctl`` needs ctypes (slow to import), so it is used only where it adds something: not under privileged
    bubblewrap, which already set no-new-privs, and where the uid change itself clears dumpability.
    """
    uid, gid, full = spec.get("uid"), spec.get("gid"), spec.get("harden_prctl", True)
    if full:
        prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if uid is not None and os.geteuid() == 0:
        if full:
            for cap in range(64):
                if prctl(_PR_CAPBSET_DROP, cap) != 0 and cap > 40:
                    break
        _drop_to(uid, gid)
    try:
        with open("/proc/sys/fs/suid_dumpable") as f:
            suid_dumpable = f.read().strip()
    except OSError:
        suid_dumpable = "?"
    if full or uid is None or suid_dumpable != "0":
        prctl(_PR_SET_DUMPABLE, 0)
    if full:
        prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _drop_to(uid, gid):
    """Root to ``uid`` / ``gid`` for good (real, effective and saved ids; no supplementary groups)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise RuntimeError("could not drop to the sandbox uid")


def load_seccomp(program):
    """Load the system-call filter ``program`` (``struct sock_filter`` instructions, 8 bytes each, compiled by
    :mod:`postrl.sandbox.seccomp`) on this process; every process it starts inherits it. Raises OSError when the
    kernel refuses it: the run then fails rather than going on without the filter it was promised."""
    import ctypes

    libc = get_libc()
    if libc is None:
        raise RuntimeError("the seccomp filter needs ctypes")

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(bytes(program), len(program))
    fprog = _Fprog(len(program) // 8, ctypes.addressof(buf))
    _sys(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _sys(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "load the seccomp filter")


def _sys(rv, what):
    if rv != 0:
        import ctypes

        e = ctypes.get_errno()
        raise OSError(e, "%s: %s" % (what, os.strerror(e)))


def _mount(src, dst, fstype, flags, data=None):
    libc = get_libc()
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


def confine(c, report_fd):
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

    libc = get_libc()
    if libc is None:
        raise RuntimeError("namespaces mode needs ctypes")
    as_root = c.get("uid") is not None and os.geteuid() == 0
    if as_root:
        _sys(libc.unshare(_CLONE_NEWNS), "unshare the mount namespace")
        _build_root(c, libc)
        _drop_to(c["uid"], c["uid"])
        prctl(_PR_SET_DUMPABLE, 1)  # the uid change made /proc/self root's; the maps below need it ours (no
        # program runs yet; harden() makes this process undumpable again before one does)
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
        code, sig = exit_of(st)
        os._exit(128 + sig if sig is not None else code)
    prctl(_PR_SET_PDEATHSIG, SIG["KILL"])
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
        if prctl(_PR_CAPBSET_DROP, cap) != 0 and cap > 40:
            break

    class _Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class _Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    data = (_Data * 2)()
    _sys(libc.capset(ctypes.byref(_Hdr(0x20080522, 0)), data), "drop capabilities")


def reaper(report_fd, uid):
    """Fallback mode only (no pid namespace): fork; the parent stays behind as the run's reaper.

    It runs no program code. It is a child subreaper, so everything the program orphans is re-parented to it and
    reaped here; when the harness child ends (or is killed by the program) it kills what is left of the run (every
    process of the run's uid, or its descendants) and exits with the child's status. Returns in the child only.
    """
    prctl(_PR_SET_CHILD_SUBREAPER, 1)
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
        victims = [p for p, pp, u, _ in proc_scan() if p != os.getpid() and uid is not None and u == uid]
        victims += descendants(os.getpid())
        kill_pids(victims)
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
    code, sig = exit_of(status)
    os._exit(128 + sig if sig is not None else code)


def apply_limits(L, nproc):
    """rlimits for a program process (called in the child, after fork, before exec or import): ``L`` is the
    spec's ``limits``, ``nproc`` the RLIMIT_NPROC value (None: not set)."""

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
    if nproc is not None:
        lim(resource.RLIMIT_NPROC, nproc)
