"""The harness's entry point: read the spec, confine, supervise the mode, write the one report."""

import errno
import marshal
import os

from .checker import run_tests
from .confine import confine, harden, load_seccomp, reaper
from .supervise import Harness
from .util import SIG, count_tasks, jdump, read_exact, read_line


def main(report_fd):
    """Run the spec read from stdin; write the report, tagged with the nonce read after it, on ``report_fd``."""
    report_fd = int(report_fd)
    os.set_inheritable(report_fd, False)
    spec = marshal.loads(read_exact(0, int(read_line(0))))
    SIG.update(spec.get("signals") or {})
    if spec.get("confine"):
        confine(spec["confine"], report_fd)
    if spec.get("reaper"):
        reaper(report_fd, spec.get("uid"))
    harden(spec)
    if spec.get("seccomp"):  # namespaces and fallback modes (bubblewrap loaded it before starting the harness)
        load_seccomp(spec["seccomp"])
    h = Harness(spec)
    os.chdir(h.workdir)
    procs = int(h.limits.get("processes") or 0)
    if procs:
        h.nproc = count_tasks(os.getuid()) + procs
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
            tests, load = run_tests(h, spec["mode"], spec["units"])
            report["tests"] = tests
            report["load"] = load
    finally:
        h.cleanup()
    report["nonce"] = read_line(0).decode()
    data = (jdump(report) + "\n").encode()
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

