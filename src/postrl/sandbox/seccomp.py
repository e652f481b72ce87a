"""The sandbox's system-call filter: a seccomp classic-BPF program, assembled here (no libseccomp needed).

A deny-list modelled on Docker's default seccomp profile: the calls that profile refuses to a container without
extra capabilities (docs.docker.com/engine/security/seccomp, "significant syscalls blocked"), plus io_uring (which
Docker's profile dropped in 2023), the new mount API, ``ptrace`` and the calls that reach other processes' memory.
Kernel exploits go through these; a Python program under test needs none of them. The program, in order:

1. ``arch`` is not this machine's (``AUDIT_ARCH_X86_64`` / ``AUDIT_ARCH_AARCH64``): the process is killed
   (SIGSYS). That is the foreign-ABI bypass (i386 ``int 0x80`` on x86_64, AArch32 on aarch64), whose call numbers
   the table below does not cover.
2. x86_64: a call number with the x32 bit (``0x40000000``): EPERM (the x32 ABI reaches the same kernel code under
   other numbers).
3. a call of :data:`REFUSED`: EPERM.
4. ``clone3``: ENOSYS (its flags are in memory, which a filter cannot read; the C library then uses ``clone``).
5. ``clone`` with a namespace flag (``CLONE_NEWNS``, ``NEWCGROUP``, ``NEWUTS``, ``NEWIPC``, ``NEWUSER``,
   ``NEWPID``, ``NEWNET``): EPERM. Threads and ``fork`` are plain ``clone`` calls and pass.
6. ``personality`` other than Docker's allowed values (0, ``PER_LINUX32``, ``UNAME26``, both, and the query
   ``0xffffffff``): EPERM (``ADDR_NO_RANDOMIZE`` and ``READ_IMPLIES_EXEC`` weaken exploit mitigations).
7. anything else: allowed.

Bubblewrap loads the program itself (``bwrap --seccomp FD``); in the namespaces and fallback modes the harness
loads it (``prctl(PR_SET_NO_NEW_PRIVS)`` then ``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``) after building the
sandbox and before any program process starts.
"""

from __future__ import annotations

import platform
import struct
import sys

# name -> (x86_64, aarch64) call numbers (Linux uapi asm/unistd_64.h and asm-generic/unistd.h); None: no such call
_TABLE = {
    # namespaces and mounts (the sandbox is built before the filter is loaded)
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442),
    # kernel keyrings (not namespaced)
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    # kernel interfaces that kernel exploits go through
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282), "fanotify_init": (300, 262),
    "lookup_dcookie": (212, 18),
    # file handles (open_by_handle_at opens any file of a mounted file system by its handle)
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    # tracing and other processes' memory
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    # kernel modules, kexec, reboot, swap, accounting, quotas
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "create_module": (174, None), "get_kernel_syms": (177, None), "query_module": (178, None),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "reboot": (169, 142), "swapon": (167, 224),
    "swapoff": (168, 225), "acct": (163, 89), "quotactl": (179, 60), "quotactl_fd": (443, 443),
    "nfsservctl": (180, 42),
    # the clock (not namespaced)
    "settimeofday": (164, 170), "clock_settime": (227, 112), "clock_adjtime": (305, 266), "adjtimex": (159, 171),
    # NUMA memory policy (Docker: CAP_SYS_NICE only)
    "mbind": (237, 235), "get_mempolicy": (239, 236), "set_mempolicy": (238, 237), "move_pages": (279, 239),
    "migrate_pages": (256, 238), "set_mempolicy_home_node": (450, 450),
    # hardware, kernel log, obsolete calls
    "iopl": (172, None), "ioperm": (173, None), "syslog": (103, 116), "vhangup": (153, 58), "uselib": (134, None),
    "ustat": (136, None), "sysfs": (139, None), "_sysctl": (156, None),
}
_CLONE, _CLONE3, _PERSONALITY = {"x86_64": 56, "aarch64": 220}, 435, {"x86_64": 135, "aarch64": 92}
_ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column in _TABLE, AUDIT_ARCH_*
_X32_BIT = 0x40000000
_CLONE_NS_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # Docker's: PER_LINUX, PER_LINUX32, UNAME26, query

REFUSED = tuple(_TABLE)  # refused with EPERM where the architecture has them
EPERM, ENOSYS = 1, 38

_RET_KILL_PROCESS, _RET_KILL_THREAD, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x0, 0x00050000, 0x7FFF0000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_NR_OFF, _ARCH_OFF, _ARG0_OFF = 0, 4, 16  # struct seccomp_data; args are 64-bit, little-endian: low half first


def machine() -> str:
    return platform.machine()


def unavailable() -> str | None:
    """Why this machine cannot have the filter (None when it can; whether the kernel accepts it is found by
    running the probe program with it)."""
    m = machine()
    if m not in _ARCHES or sys.byteorder != "little" or struct.calcsize("P") != 8:
        return f"no system-call table for {m} ({sys.byteorder}-endian, {8 * struct.calcsize('P')}-bit) here"
    try:
        with open("/proc/self/status") as f:
            if not any(line.startswith("Seccomp:") for line in f):
                return "the kernel is built without seccomp (no 'Seccomp:' line in /proc/self/status)"
    except OSError as e:
        return f"cannot read /proc/self/status ({e.strerror})"
    return None


def _kill_action() -> int:
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as f:
            return _RET_KILL_PROCESS if "kill_process" in f.read().split() else _RET_KILL_THREAD
    except OSError:
        return _RET_KILL_THREAD  # kernels before 4.14: kill the thread (it is the process's only one, or the rest
        # keep running under the same filter)


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(arch: str | None = None) -> bytes:
    """The filter for ``arch`` (default: this machine), as ``struct sock_filter`` instructions (8 bytes each):
    what ``bwrap --seccomp`` reads and what ``prctl(PR_SET_SECCOMP)`` takes."""
    arch = arch or machine()
    col, audit = _ARCHES[arch]
    deny = _RET_ERRNO | EPERM
    p = [_ins(_LD_W_ABS, _ARCH_OFF), _ins(_JEQ, audit, 1, 0), _ins(_RET, _kill_action()), _ins(_LD_W_ABS, _NR_OFF)]
    if arch == "x86_64":
        p += [_ins(_JGE, _X32_BIT, 0, 1), _ins(_RET, deny)]
    for nr in sorted({row[col] for row in _TABLE.values() if row[col] is not None}):
        p += [_ins(_JEQ, nr, 0, 1), _ins(_RET, deny)]
    p += [_ins(_JEQ, _CLONE3, 0, 1), _ins(_RET, _RET_ERRNO | ENOSYS)]
    p += [_ins(_JEQ, _CLONE[arch], 0, 4), _ins(_LD_W_ABS, _ARG0_OFF), _ins(_JSET, _CLONE_NS_FLAGS, 0, 1),
          _ins(_RET, deny), _ins(_RET, _RET_ALLOW)]
    n = len(PERSONALITY_ALLOWED)
    p += [_ins(_JEQ, _PERSONALITY[arch], 0, n + 3), _ins(_LD_W_ABS, _ARG0_OFF)]
    p += [_ins(_JEQ, v, n - i, 0) for i, v in enumerate(PERSONALITY_ALLOWED)]
    p += [_ins(_RET, deny), _ins(_RET, _RET_ALLOW), _ins(_RET, _RET_ALLOW)]
    return b"".join(p)


def refused(arch: str | None = None) -> list[str]:
    """The calls this machine's filter refuses with EPERM whatever their arguments."""
    col = _ARCHES[arch or machine()][0]
    return [name for name, row in _TABLE.items() if row[col] is not None]


def report(enabled: bool, installed_by: str | None, why: str | None) -> dict:
    """The ``seccomp`` entry of :func:`postrl.sandbox.capabilities`."""
    if not enabled:
        return {"enabled": False, "why": why}
    arch = machine()
    return {"enabled": True, "installed_by": installed_by, "arch": arch,
            "refused_eperm": refused(arch),
            "argument_rules": {"clone": "EPERM with a namespace flag (CLONE_NEWUSER, NEWNS, NEWPID, NEWNET, NEWIPC, "
                                        "NEWUTS, NEWCGROUP); threads and fork pass",
                               "clone3": "ENOSYS (the C library falls back to clone)",
                               "personality": "EPERM except 0, 0x8, 0x20000, 0x20008 and the query 0xffffffff"},
            "other_abi": ("another architecture's calls (i386 int 0x80) kill the process; x32 calls fail with EPERM"
                          if arch == "x86_64" else "another architecture's calls (AArch32) kill the process")}

