"""The code sandbox: hostile programs are contained, score 0 with a reason, and leave nothing running; the
system calls kernel exploits go through fail inside it.

Hostile programs go through the real reward path (``code_tests`` on a batch, so the pool runs them in parallel)
with short limits; containment is then checked from the host. Where the machine's isolation cannot contain
something (fallback mode: network, reads outside the sandbox), the test checks that ``capabilities()`` says so.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from pathlib import Path

import pytest

from postrl.rewards.code import code_tests, last_results
from postrl.sandbox import (Limits, SandboxConfigError, SandboxError, SandboxPool, SandboxUnavailable, capabilities,
                            confine, launch, probe, run)

try:
    CAPS = capabilities()
except SandboxError as e:  # pragma: no cover - a machine where no sandbox works at all
    pytest.skip(f"no code sandbox on this machine: {e}", allow_module_level=True)
NAMESPACES = CAPS["mode"] in ("bwrap", "namespaces")
TESTS = "def test_a():\n    assert add(1, 2) == 3\n\n\ndef test_b():\n    assert add(2, 2) == 4\n"
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
SECRET_ENV = "POSTRL_SANDBOX_TEST_SECRET"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stray(results, before: set[int] | frozenset = frozenset()) -> list[int]:
    """Processes left by these runs: any descendant of this test process that was not there before them
    (``before``: e.g. a W&B service or a multiprocessing resource tracker an earlier test of the session started,
    which lives until the session ends), any process of a run's uid."""
    left = [p for p in launch.descendants(os.getpid())
            if p not in before and "multiprocessing.resource_tracker" not in _cmdline(p)]
    for r in results:
        if r is not None and r.uid is not None:
            left += launch.uid_pids(r.uid)
    return left


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """Run the hostile suite once (two parallel batches) and hand the results to the tests."""
    before = set(launch.descendants(os.getpid()))  # what earlier tests of the session left running (not ours)
    outside = tmp_path_factory.mktemp("outside")
    secret_file = outside / "secret.txt"
    secret_file.write_text("TOP-SECRET-FILE")
    home_secret = Path.home() / f".postrl-sandbox-test-{uuid.uuid4().hex}"
    home_secret.write_text("TOP-SECRET-HOME")
    os.chmod(home_secret, 0o600)
    target = outside / "written-by-sandbox.txt"
    os.environ[SECRET_ENV] = "hunter2-env"
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.3)
    port = srv.getsockname()[1]
    quick = {
        "memory_bomb": "x = []\nwhile True:\n    x.append(bytearray(10 ** 7))\n",
        "disk_fill": "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n    i += 1\n",
        "network": (f"import socket\nnames = [n for _, n in socket.if_nameindex()]\nprint('IFACES', names)\n"
                    f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'leak')\n"),
        "environment": "import os\nprint('ENV', sorted(os.environ), os.environ.get('" + SECRET_ENV + "'))\n",
        "read_outside": ("for p in (%r, %r):\n    try:\n        print('READ', open(p).read())\n"
                         "    except OSError as e:\n        print('DENIED', type(e).__name__)\n"
                         % (str(secret_file), str(home_secret))),
        "write_outside": f"open({str(target)!r}, 'w').write('pwned')\n",
        "kill_parent": "import os\nos.kill(os.getppid(), 9)\n",
        "flood_stdout": "while True:\n    print('x' * 1000)\n",
        "syntax_error": "def add(a, b:\n    return a + b\n",
        "import_exit": "import sys\nsys.exit(0)\n",
        "import_os_exit": "import os\nos._exit(0)\n",
        "forge_marker": ("import json, os\nfake = json.dumps({'status': 'ok', 'passed': 2, 'total': 2, 'tests': "
                         "[{'status': 'pass'}] * 2, 'nonce': 'x'}) + '\\n'\nprint(fake)\n"
                         "for fd in range(3, 256):\n    try:\n        os.write(fd, fake.encode())\n"
                         "    except OSError:\n        pass\n"),
        "orphan_correct": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                           "        time.sleep(60)\n    os._exit(0)\n\ndef add(a, b):\n    return a + b\n"),
    }
    slow = {
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "infinite_loop": "while True:\n    pass\n",
        "sleeper": "import time\ntime.sleep(60)\n",
    }
    out = {}
    try:
        for batch, timeout in ((quick, 8.0), (slow, 2.0)):  # quick ones end on their own; slow ones hit the limit
            names = list(batch)
            rewards = code_tests(None, [f"```python\n{batch[n]}```" for n in names], [TESTS] * len(names),
                                 timeout=timeout, memory_mb=128)
            for n, rew, res in zip(names, rewards, last_results()):
                out[n] = (rew, res)
        try:
            conn, _ = srv.accept()
            conn.close()
            connected = True
        except socket.timeout:
            connected = False
        yield {"results": out, "connected": connected, "target": target, "before": before}
    finally:
        srv.close()
        os.environ.pop(SECRET_ENV, None)
        home_secret.unlink(missing_ok=True)


def test_capabilities_say_what_is_enforced():
    for key in ("mode", "isolated", "limits", "not_isolated", "notes"):
        assert key in CAPS
    assert set(CAPS["isolated"]) >= {"network", "filesystem_read", "filesystem_write", "processes", "environment"}
    if NAMESPACES:
        assert all(CAPS["isolated"].values()) and CAPS["limits"]["processes"] != ""
    else:
        assert not CAPS["isolated"]["network"]
        assert any("network" in x for x in CAPS["not_isolated"])


def _fallback():
    try:
        return capabilities("fallback")
    except SandboxUnavailable as e:
        pytest.skip(f"fallback sandbox unavailable here: {e}")


def test_fallback_is_announced_once_at_startup(caplog):
    caps = _fallback()
    assert caps["mode"] == "fallback"
    for what in ("network", "filesystem reads outside the sandbox", "process visibility"):
        assert what in caps["warning"]
    probe._WARNED.discard(caps["warning"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="postrl.sandbox"):
        capabilities("fallback")
        capabilities("fallback")
    msgs = [r.getMessage() for r in caplog.records if "WITHOUT namespaces" in r.getMessage()]
    assert len(msgs) == 1 and "NOT isolated: network" in msgs[0]


def test_bwrap_required_but_missing_is_a_startup_error(monkeypatch):
    monkeypatch.setattr(probe, "_bwrap_binary", lambda: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap does not work here"):
        probe._probe("bwrap")


def test_bad_limits_and_mode_are_one_line_errors():
    with pytest.raises(SandboxConfigError, match="'timeout' must be a positive number"):
        Limits(timeout=0)
    with pytest.raises(SandboxConfigError, match="memory_mb"):
        Limits(memory_mb=4)
    with pytest.raises(SandboxConfigError, match="sandbox mode 'docker'"):
        capabilities("docker")


def test_correct_program_scores_one_and_partial_gives_the_fraction():
    comps = [GOOD, "```python\ndef add(a, b):\n    return a * b if a == 2 else a + b\n```",
             "```python\ndef add(a, b):\n    return 0\n```"]
    tests3 = TESTS + "\n\ndef test_c():\n    assert add(0, 5) == 5\n"
    assert code_tests(None, comps, [tests3] * 3, timeout=5.0) == pytest.approx([1.0, 1.0, 0.0])
    comps = [GOOD, "```python\ndef add(a, b):\n    return a - b\n```"]
    assert code_tests(None, comps, [tests3] * 2, timeout=5.0) == pytest.approx([1.0, 0.0])
    # top-level asserts: 2 of 3
    r = code_tests(None, ["def add(a, b):\n    return 3"], ["assert add(1, 2) == 3\nassert add(2, 1) == 3\n"
                                                           "assert add(2, 2) == 4\n"], timeout=5.0)
    assert r == pytest.approx([2 / 3])
    # stdin/stdout cases and function-call cases: 1 of 2 each
    stdio = [["3 4\n", "7\n"], ["1 1\n", "3\n"]]
    prog = "a, b = map(int, input().split())\nprint(a + b)\n"
    calls = {"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [3, 5]}
    assert code_tests(None, [prog, GOOD], [stdio, calls], timeout=5.0) == pytest.approx([0.5, 0.5])


def test_no_tests_collected_is_zero_never_a_pass():
    assert code_tests(None, [GOOD], ["x = 1\nprint('no tests here')\n"], timeout=5.0) == [0.0]
    assert "no tests collected" in last_results()[0].reason
    assert code_tests(None, [GOOD], [None]) == [None]


def test_always_equal_object_cannot_fake_a_call_test():
    fake = ("class E:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
            "def add(a, b):\n    return E()\n")
    calls = {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}
    assert code_tests(None, [fake], [calls], timeout=5.0) == [0.0]
    assert "not plain data" in last_results()[0].tests[0]["reason"]


EXPECT = {  # name -> (allowed statuses, words expected in the reason)
    "memory_bomb": ({"memory"}, "MemoryError"),
    "disk_fill": ({"failed", "output_limit"}, "No space left|disk limit|File too large"),
    "network": ({"failed"}, "Connection|Network|unreachable|refused|Errno|add"),
    "environment": ({"failed"}, "add"),
    "read_outside": ({"failed"}, "add"),
    "write_outside": ({"failed"}, "Errno|not defined"),
    "kill_parent": ({"killed"}, "killed"),
    "flood_stdout": ({"output_limit"}, "output limit"),
    "syntax_error": ({"failed"}, "syntax error"),
    "import_exit": ({"failed"}, "exit"),
    "import_os_exit": ({"failed"}, "ended the process"),
    "forge_marker": ({"failed"}, "not defined|garbage"),
    "fork_bomb": ({"timeout", "killed"}, "limit"),
    "infinite_loop": ({"timeout"}, "limit"),
    "sleeper": ({"timeout"}, "limit"),
}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_hostile_program_scores_zero_with_a_reason(hostile, name):
    import re

    reward, res = hostile["results"][name]
    statuses, words = EXPECT[name]
    if name == "network" and not CAPS["isolated"]["network"]:
        statuses = {"failed"}  # connects (not isolated), then has no add()
    assert reward == 0.0, (name, res)
    assert res.passed == 0 and res.total == 2
    assert res.status in statuses, (name, res.status, res.reason)
    assert re.search(words, res.reason), (name, res.reason)


def test_hostile_programs_are_contained(hostile):
    res = {k: v[1] for k, v in hostile["results"].items()}
    # environment: nothing of the parent's
    env_line = next(ln for ln in res["environment"].stdout.splitlines() if ln.startswith("ENV"))
    assert "hunter2-env" not in env_line and SECRET_ENV not in env_line
    names = set(eval(env_line[4:env_line.rindex("]") + 1]))  # noqa: S307 - our own program's output
    assert names <= {"PATH", "LANG", "HOME", "TMPDIR", "PWD", "LC_CTYPE"}
    # files outside the sandbox: neither read nor written
    if CAPS["isolated"]["filesystem_read"] or CAPS["unique_uid"]:
        assert "TOP-SECRET" not in res["read_outside"].stdout
        assert res["read_outside"].stdout.count("DENIED") == 2
    else:
        assert any("filesystem reads" in x for x in CAPS["not_isolated"])
    if CAPS["isolated"]["filesystem_write"] or CAPS["unique_uid"]:
        assert not hostile["target"].exists()
    else:
        assert any("writes to this user's files" in x for x in CAPS["not_isolated"])
    # network: no connection reached the host's loopback listener, no interface but lo
    if CAPS["isolated"]["network"]:
        assert not hostile["connected"]
        assert "IFACES ['lo']" in res["network"].stdout
    else:
        assert any("network" in x for x in CAPS["not_isolated"])
    # output flood: truncated at the limit
    assert len(res["flood_stdout"].stdout.encode()) <= 64 * 1024 and res["flood_stdout"].truncated


def test_orphans_are_killed_and_the_program_still_scores(hostile):
    reward, res = hostile["results"]["orphan_correct"]
    assert reward == 1.0 and res.status == "ok"


def test_nothing_survives_and_the_host_keeps_working(hostile):
    results = [r for _, r in hostile["results"].values()]
    assert _stray(results, hostile["before"]) == []
    assert all(_alive(p) for p in (os.getpid(), os.getppid()))
    assert code_tests(None, [GOOD], [TESTS], timeout=5.0) == [1.0]


def test_per_test_timeout_and_crash_keep_partial_credit():
    code = ("import os\ndef add(a, b):\n    if a == 5:\n        os._exit(0)\n    if a == 7:\n        while True:\n"
            "            pass\n    return a + b\n")
    tests = ("def test_1():\n    assert add(1, 1) == 2\ndef test_2():\n    assert add(5, 1) == 6\n"
             "def test_3():\n    assert add(7, 1) == 8\ndef test_4():\n    assert add(2, 2) == 4\n")
    r = run(code, tests, limits=Limits(timeout=6.0, test_timeout=0.7))
    assert [t["status"] for t in r.tests] == ["pass", "error", "timeout", "pass"]
    assert (r.passed, r.total) == (2, 4)


def test_plain_run_statuses():
    r = run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)\n", limits=Limits(timeout=5))
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("failed", 3, "out\n", "err\n")
    r = run("print(input()[::-1])", stdin="abc\n", limits=Limits(timeout=5))
    assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "cba\n")


def test_fallback_mode_contains_what_it_claims():
    """Forced fallback (no namespaces): limits, supervisor kill and clean-up still hold."""
    caps = _fallback()
    lim = Limits(timeout=3.0, memory_mb=128, output_bytes=4096)
    progs = [GOOD.strip("`").removeprefix("python\n"), "import os\nos.kill(os.getppid(), 9)\n",
             "import sys\nsys.exit(0)\n", "while True:\n    print('x' * 100)\n", "x = bytearray(10 ** 9)\n"]
    before = set(launch.descendants(os.getpid()))
    with SandboxPool(2, limits=lim, mode="fallback") as pool:
        results = pool.map(progs, [TESTS] * len(progs))
    assert [r.status for r in results] == ["ok", "killed", "failed", "output_limit", "memory"]
    assert [r.passed for r in results] == [2, 0, 0, 0, 0]
    assert _stray(results, before) == []
    assert not caps["isolated"]["network"] and not caps["isolated"]["filesystem_read"]


def test_cli_prints_one_json_object(tmp_path, capsys):
    import json

    from postrl.cli import main

    prog = tmp_path / "p.py"
    prog.write_text("def add(a, b):\n    return a + b\nprint('hi')\n")
    tests = tmp_path / "t.py"
    tests.write_text(TESTS)
    assert main(["sandbox", str(prog), "--tests", str(tests), "--timeout", "5", "--memory", "256"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {k: d[k] for k in ("status", "exit_code", "passed", "total", "stdout")} == \
        {"status": "ok", "exit_code": 0, "passed": 2, "total": 2, "stdout": "hi\n"}
    assert {"stderr", "time"} <= set(d)
    assert main(["sandbox", str(tmp_path / "missing.py")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"postrl: error: program '{tmp_path / 'missing.py'}': no such file"


# ------------------------------------------------------------------------------------------------ probes under attack
# Each probe is a hostile program run in every isolating mode this machine offers: bubblewrap where it works, and
# the namespaces mode (no bubblewrap) wherever the kernel lets an unprivileged process create namespaces, checked
# here with util-linux's own `unshare`, independently of the code under test.


def _kernel_has_namespaces() -> bool:
    import shutil
    import subprocess

    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--pid", "--fork", "--net",
                               "--ipc", "true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _isolating_modes() -> list[str]:
    modes = []
    if probe._bwrap_binary():
        try:
            capabilities("bwrap")
            modes.append("bwrap")
        except SandboxUnavailable:
            pass
    if _kernel_has_namespaces():
        modes.append("namespaces")  # must work here: a failure to start is a test failure, not a skip
    return modes


ISOLATING = _isolating_modes()
needs_namespaces = pytest.mark.skipif(not ISOLATING, reason="this kernel offers no namespaces and no bubblewrap")


@needs_namespaces
def test_auto_mode_isolates_when_the_kernel_allows_it():
    assert capabilities("auto")["mode"] == ISOLATING[0]
    assert all(capabilities("auto")["isolated"].values())


@needs_namespaces
@pytest.mark.parametrize("mode", ISOLATING)
def test_no_network_to_the_host(mode, tmp_path):
    """TCP and UDP on the host's 127.0.0.1, a UNIX socket by path and an abstract one: none is reachable."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    tcp.settimeout(0.2)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.2)
    os.chmod(tmp_path, 0o777)
    path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(path)
    os.chmod(path, 0o777)
    unix.listen(4)
    unix.settimeout(0.2)
    abstract_name = "\0postrl-test-" + uuid.uuid4().hex
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(abstract_name)
    abstract.listen(4)
    abstract.settimeout(0.2)
    prog = f"""
import socket
def attempt(what, fn):
    try:
        fn()
        print(what, 'REACHED')
    except OSError as e:
        print(what, 'blocked', type(e).__name__)
def tcp():
    socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=1).sendall(b'leak')
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.sendto(b'leak', ('127.0.0.1', {udp.getsockname()[1]}))
def unix(name):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    s.connect(name)
    s.sendall(b'leak')
attempt('tcp', tcp)
attempt('udp', udp)
attempt('unix', lambda: unix({path!r}))
attempt('abstract', lambda: unix({abstract_name!r}))
"""
    try:
        r = run(prog, limits=Limits(timeout=8.0), mode=mode)
        got = []
        for name, srv in (("tcp", tcp), ("unix", unix), ("abstract", abstract)):
            try:
                srv.accept()[0].close()
                got.append(name)
            except socket.timeout:
                pass
        try:
            udp.recvfrom(16)
            got.append("udp")
        except socket.timeout:
            pass
    finally:
        for s in (tcp, udp, unix, abstract):
            s.close()
    assert got == [], (got, r.stdout)  # the host's listeners heard nothing (UDP may go to the sandbox's own lo)
    for what in ("tcp", "unix", "abstract"):
        assert f"{what} blocked" in r.stdout, (r.status, r.stdout, r.stderr)


@needs_namespaces
@pytest.mark.parametrize("mode", ISOLATING)
def test_host_files_and_processes_cannot_be_read(mode):
    """A world-readable file in the host's /tmp and another process's command line stay out of reach."""
    import subprocess
    import tempfile

    secret = "SECRET-" + uuid.uuid4().hex
    fd, path = tempfile.mkstemp(prefix="postrl-probe-", dir="/tmp")
    os.write(fd, secret.encode())
    os.close(fd)
    os.chmod(path, 0o644)
    victim = subprocess.Popen(["sleep", "30", secret])
    prog = f"""
import os
found = []
try:
    found.append(open({path!r}).read())
except OSError as e:
    print('file blocked', type(e).__name__)
for pid in os.listdir('/proc'):
    if pid.isdigit():
        try:
            found.append(open('/proc/%s/cmdline' % pid, 'rb').read().decode(errors='replace'))
        except OSError:
            pass
print('PIDS', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
print('FOUND', [x for x in found if 'SECRET' in x])
"""
    try:
        r = run(prog, limits=Limits(timeout=8.0), mode=mode)
    finally:
        victim.kill()
        victim.wait()
        os.unlink(path)
    assert r.status == "ok", (r.reason, r.stderr)
    assert secret not in r.stdout and "FOUND []" in r.stdout, r.stdout
    assert "file blocked" in r.stdout
    pids = eval(r.stdout.split("PIDS ")[1].splitlines()[0])  # noqa: S307 - our own program's output
    assert victim.pid not in pids and os.getpid() not in pids and max(pids) < 100, pids


def _sysv_keys() -> set:
    keys = set()
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                keys |= {(kind, ln.split()[0]) for ln in f.readlines()[1:] if ln.strip()}
        except OSError:
            pass
    return keys


@needs_namespaces
@pytest.mark.parametrize("mode", ISOLATING)
def test_nothing_is_written_to_the_host(mode):
    """Files in the host's /tmp, /var/tmp, /run/lock and /dev/shm, SysV shared memory, message queues and
    semaphores: nothing is left behind; and writes outside the private folder stay within the disk limit."""
    tag = "postrl-probe-" + uuid.uuid4().hex
    places = ["/tmp", "/var/tmp", "/run/lock", "/dev/shm"]
    before = _sysv_keys()
    prog = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
key = 0x5eed0000 + os.getpid() % 1000
print('shm', libc.shmget(key, 4096, 0o1666), 'msg', libc.msgget(key + 1, 0o1666),
      'sem', libc.semget(key + 2, 1, 0o1666))
total = 0
for d in {places!r}:
    try:
        with open(os.path.join(d, {tag!r}), 'wb') as f:
            for _ in range(40):
                f.write(b'x' * (1 << 20))
                f.flush()
                total += 1 << 20
    except OSError as e:
        print(d, type(e).__name__)
print('WROTE_MB', total >> 20)
"""
    limits = Limits(timeout=8.0, disk_mb=4, memory_mb=128)
    try:
        r = run(prog, limits=limits, mode=mode)
        left = [os.path.join(d, tag) for d in places if os.path.exists(os.path.join(d, tag))]
    finally:
        for d in places:
            try:
                os.unlink(os.path.join(d, tag))
            except OSError:
                pass
    assert left == [], left
    assert _sysv_keys() - before == set()
    wrote = int(r.stdout.split("WROTE_MB ")[1].split()[0])
    # at most /tmp and /dev/shm (RLIMIT_FSIZE per file, tmpfs size per folder): never 4 x 40 MB
    assert wrote <= 2 * limits.disk_mb, (wrote, r.stdout)


@pytest.mark.parametrize("mode", ISOLATING + ["fallback"])
def test_memory_limit_covers_the_whole_program(mode):
    """Forked processes share one memory budget: with a cgroup (memory_mb + the supervisor's slack) for the whole
    run; without one, the stated per-process bound (memory_mb x processes)."""
    caps = capabilities(mode)
    prog = """
import os, select, time
r, w = os.pipe()
for _ in range(6):
    try:
        if os.fork() == 0:
            os.close(r)
            x = b'y' * (90 << 20)
            os.write(w, b'%8d' % os.getpid())
            time.sleep(6)
            os._exit(0)
    except OSError:
        pass
os.close(w)
holders, end = [], time.time() + 3
while time.time() < end:
    if select.select([r], [], [], 0.1)[0]:
        b = os.read(r, 8)
        if not b:
            break
        holders.append(int(b))
alive = [p for p in holders if os.waitpid(p, os.WNOHANG) == (0, 0)]
print('HELD', len(alive), flush=True)
"""
    lim = Limits(timeout=10.0, memory_mb=128, processes=8)
    r = run(prog, limits=lim, mode=mode)
    held = max([int(ln.split()[1]) for ln in r.stdout.splitlines() if ln.startswith("HELD")] or [0])
    assert "HELD" in r.stdout or r.status == "memory", (r.status, r.reason, r.stderr)
    if caps["cgroup"]:
        assert held * 90 <= lim.memory_mb + confine.CGROUP_SLACK_MB, (held, r.stdout)
        assert r.status == "memory" and "whole program" in r.reason, (r.status, r.reason)
        assert "cgroup" in caps["limits"]["memory"]
    else:
        assert held * 90 <= lim.memory_mb * lim.processes
        assert "memory_mb x processes" in caps["limits"]["memory"]


def test_cli_test_file_imports_the_program_by_its_file_name(tmp_path, capsys):
    """docs/sandbox.md: a test file reaches prog.py's names directly, as `from prog import ...` or as
    `from solution import ...`."""
    import json

    from postrl.cli import main

    prog = tmp_path / "prog.py"
    prog.write_text("def add(a, b):\n    return a + b\n")
    tests = tmp_path / "test_prog.py"
    tests.write_text("from prog import add\nimport solution\n\ndef test_a():\n    assert add(1, 2) == 3\n\n"
                     "def test_b():\n    assert solution.add(2, 2) == 4\n")
    assert main(["sandbox", str(prog), "--tests", str(tests), "--timeout", "8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["status"], d["passed"], d["total"]) == ("ok", 2, 2), d


@needs_namespaces
@pytest.mark.parametrize("mode", ISOLATING)
def test_sandbox_root_is_not_the_hosts_root(mode):
    """Root inside a user namespace that maps to the host's root passes /proc/sys permission checks by uid alone
    and is exempt from RLIMIT_NPROC: the sandbox's uid must map to some other uid, and kernel settings stay
    read-only to it."""
    prog = """
uid_map = open('/proc/self/uid_map').read().split()
print('OUTSIDE', uid_map[1])
try:
    open('/proc/sys/kernel/hostname', 'w').write('pwned')
    print('sysctl WRITTEN')
except OSError as e:
    print('sysctl blocked', type(e).__name__)
"""
    r = run(prog, limits=Limits(timeout=8.0), mode=mode)
    assert r.status == "ok", (r.reason, r.stderr)
    assert "sysctl blocked" in r.stdout, r.stdout
    outside = int(r.stdout.split("OUTSIDE ")[1].split()[0])
    assert outside != 0 or mode == "bwrap" and capabilities(mode)["unique_uid"], r.stdout


@needs_namespaces
def test_namespaces_mode_as_an_unprivileged_user():
    """The laptop case: no bubblewrap, not root. Run as `nobody` (from root, with the system Python): the program
    reaches no host listener, sees only its own processes, RLIMIT_NPROC bounds its forks and the seccomp filter
    refuses keyctl."""
    import json
    import shutil
    import subprocess
    import tempfile

    py = "/usr/bin/python3"
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(py):
        pytest.skip("needs root (to become nobody), setpriv and /usr/bin/python3")
    src = str(Path(probe.__file__).resolve().parents[2])
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    work = Path(tempfile.mkdtemp(prefix="postrl-nobody-"))
    os.chmod(work, 0o755)
    script = work / "as_nobody.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {src!r})
from postrl.sandbox import Limits, capabilities, run
prog = '''
import os, socket
try:
    socket.create_connection(("127.0.0.1", {srv.getsockname()[1]}), timeout=1)
    print("tcp REACHED")
except OSError:
    print("tcp blocked")
n = 0
for _ in range(40):
    try:
        if os.fork() == 0:
            import time
            time.sleep(3)
            os._exit(0)
        n += 1
    except OSError:
        break
print("FORKED", n, "PIDS", len([p for p in os.listdir("/proc") if p.isdigit()]))
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
print("KEYCTL", libc.syscall({{"x86_64": 250, "aarch64": 219}}[platform.machine()], 0, -2, 0), ctypes.get_errno())
'''
r = run(prog, limits=Limits(timeout=8.0, processes=8), mode="namespaces")
caps = capabilities("namespaces")
print(json.dumps({{"mode": caps["mode"], "seccomp": caps["seccomp"], "status": r.status, "stdout": r.stdout,
                  "stderr": r.stderr[-500:]}}))
""")
    for p in [Path(src), *Path(src).parents]:  # nobody must reach the code
        if not os.stat(p).st_mode & 0o001:
            shutil.rmtree(work)
            pytest.skip(f"{p} is not searchable by nobody")
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    try:
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py, str(script)],
                             capture_output=True, text=True, timeout=60, env=env, cwd="/")
        try:
            srv.accept()[0].close()
            reached = True
        except socket.timeout:
            reached = False
    finally:
        srv.close()
        shutil.rmtree(work)
    if "ModuleNotFoundError" in out.stderr or "SyntaxError" in out.stderr:
        pytest.skip(f"the system Python cannot import postrl.sandbox: {out.stderr.strip().splitlines()[-1]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    assert not reached and "tcp blocked" in d["stdout"], d
    forked, pids = int(d["stdout"].split("FORKED ")[1].split()[0]), int(d["stdout"].split("PIDS ")[1].split()[0])
    assert forked < 8 and pids <= 9, d
    if d["seccomp"]["enabled"]:  # the harness loaded the filter as an unprivileged user too
        assert "KEYCTL -1 1" in d["stdout"], d
    else:
        assert d["seccomp"]["why"], d


# ------------------------------------------------------------------------------------------------ system-call filter
# The probe program tries, through raw syscall numbers (its own table, not the filter's), the calls that container
# sandboxes refuse because kernel exploits go through them, the namespace flags of clone, the x32 and i386 ABIs,
# and what a program needs (threads, fork, subprocess). Run without a sandbox, the same program reaches the kernel:
# the control below shows the probe can tell a filtered process from an unfiltered one.

SYSCALL_PROBE = r'''
import ctypes, errno, json, os, platform, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
NR = {"x86_64": {"io_uring_setup": 425, "keyctl": 250, "add_key": 248, "perf_event_open": 298, "bpf": 321,
                 "open_by_handle_at": 304, "unshare": 272, "personality": 135, "clone": 56, "clone3": 435},
      "aarch64": {"io_uring_setup": 425, "keyctl": 219, "add_key": 217, "perf_event_open": 241, "bpf": 280,
                  "open_by_handle_at": 265, "unshare": 97, "personality": 92, "clone": 220, "clone3": 435},
      }[platform.machine()]

def call(nr, *args):
    ctypes.set_errno(0)
    rv = libc.syscall(L(nr), *args)
    return "ok" if rv != -1 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))

out = {}
out["io_uring_setup"] = call(NR["io_uring_setup"], L(1), None)
out["keyctl"] = call(NR["keyctl"], L(0), L(-2), L(0))  # KEYCTL_GET_KEYRING_ID, the process keyring
out["add_key"] = call(NR["add_key"], b"user", b"postrl-probe", b"x", L(1), L(-2))
out["perf_event_open"] = call(NR["perf_event_open"], None, L(0), L(-1), L(-1), L(0))
out["bpf"] = call(NR["bpf"], L(0), None, L(0))  # BPF_MAP_CREATE
out["open_by_handle_at"] = call(NR["open_by_handle_at"], L(-1), None, L(0))
out["unshare"] = call(NR["unshare"], L(0x10000000))  # CLONE_NEWUSER
out["personality"] = call(NR["personality"], L(0x0040000))  # ADDR_NO_RANDOMIZE
out["personality_query"] = call(NR["personality"], L(0xFFFFFFFF))
out["clone3"] = call(NR["clone3"], None, L(0))
ctypes.set_errno(0)
pid = libc.syscall(L(NR["clone"]), L(0x10000000 | 17), None, None, None, L(0))  # CLONE_NEWUSER | SIGCHLD
if pid == 0:
    os._exit(0)
out["clone_newuser"] = "ok" if pid > 0 else errno.errorcode.get(ctypes.get_errno(), "?")
if pid > 0:
    os.waitpid(pid, 0)
if platform.machine() == "x86_64":
    out["x32_getpid"] = call(0x40000000 | 39)
    pid = os.fork()
    if pid == 0:
        import mmap
        m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        m.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")  # mov eax, 20 (getpid, i386); int 0x80; ret
        ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()
        os._exit(0)
    _, st = os.waitpid(pid, 0)
    out["i386_int80"] = "signal %d" % os.WTERMSIG(st) if os.WIFSIGNALED(st) else "exit %d" % os.WEXITSTATUS(st)
t = threading.Thread(target=out.__setitem__, args=("thread", "ok"))
t.start()
t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.WEXITSTATUS(os.waitpid(pid, 0)[1])
out["subprocess"] = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"]).returncode
out["seccomp_mode"] = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("Seccomp:")][0]
print("PROBE", json.dumps(out))
'''
LISTED = ("io_uring_setup", "keyctl", "add_key", "perf_event_open", "bpf", "open_by_handle_at", "unshare",
          "personality")  # issue 26: reach the kernel from inside the sandbox without a filter


def _probe_result(stdout: str) -> dict:
    import json

    return json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("PROBE "))[6:])


def _filtered_modes() -> list[str]:
    modes = list(ISOLATING)
    try:
        capabilities("fallback")
        modes.append("fallback")
    except SandboxUnavailable:
        pass
    return modes


@pytest.mark.parametrize("mode", _filtered_modes())
def test_listed_syscalls_fail_with_eperm_inside_the_sandbox(mode):
    caps = capabilities(mode)
    if not caps["seccomp"]["enabled"]:
        pytest.skip(f"no seccomp filter here: {caps['seccomp']['why']}")
    r = run(SYSCALL_PROBE, limits=Limits(timeout=15.0), mode=mode)
    assert r.status == "ok", (r.status, r.reason, r.stderr[-800:])
    got = _probe_result(r.stdout)
    assert {name: got[name] for name in LISTED} == {name: "EPERM" for name in LISTED}, got
    assert got["clone_newuser"] == "EPERM" and got["clone3"] == "ENOSYS", got  # namespaces through clone: refused
    assert got["personality_query"] == "ok", got  # the allowed personality values still work
    assert (got["thread"], got["fork"], got["subprocess"]) == ("ok", 7, 0), got  # threads fall back to clone
    assert got["seccomp_mode"] == "2", got
    if "x32_getpid" in got:  # x86_64: the x32 ABI and i386 `int 0x80` do not get around the filter
        assert got["x32_getpid"] == "EPERM", got
        assert got["i386_int80"] == "signal 31", got  # SIGSYS: a foreign-architecture call kills the process


def test_the_syscall_probe_reaches_the_kernel_without_a_filter():
    """Control: the same program outside the sandbox gets past the calls the filter refuses (so the test above
    fails if the filter is not there)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-I", "-c", SYSCALL_PROBE], capture_output=True, text=True, timeout=60)
    got = _probe_result(out.stdout)
    if got["seccomp_mode"] != "0":
        pytest.skip("this test process already runs under a seccomp filter")
    assert got["personality"] == "ok" and got["keyctl"] != "EPERM" and got["add_key"] != "EPERM", got
    if "x32_getpid" in got:
        assert got["x32_getpid"] != "EPERM" and got["i386_int80"] != "signal 31", got


def test_capabilities_report_the_seccomp_filter(capsys):
    import json

    from postrl.cli import main

    f = CAPS["seccomp"]
    if not f["enabled"]:
        assert f["why"] and any("no seccomp filter" in x for x in CAPS["not_isolated"])
        return
    assert set(LISTED) - {"personality"} <= set(f["refused_eperm"]) and "personality" in f["argument_rules"]
    assert f["installed_by"].startswith("bubblewrap" if CAPS["mode"] == "bwrap" else "the harness")
    assert not any("seccomp" in x for x in CAPS["not_isolated"])
    assert main(["sandbox", "--capabilities"]) == 0
    assert json.loads(capsys.readouterr().out)["seccomp"] == f


@pytest.mark.parametrize("mode", _filtered_modes())
def test_a_filter_the_kernel_refuses_is_reported_off_and_listed(mode, monkeypatch):
    """A filter the kernel does not accept: a run promised it fails (it never goes on unfiltered), and the probe
    falls back to no filter, which the capability report and the warning then list."""
    from postrl.sandbox import seccomp

    caps = capabilities(mode)
    if not caps["seccomp"]["enabled"]:
        pytest.skip(f"no seccomp filter here: {caps['seccomp']['why']}")
    monkeypatch.setattr(seccomp, "program", lambda arch=None: b"\xff\xff\x00\x00\x00\x00\x00\x00")  # bad opcode
    assert run("print('unfiltered')", limits=Limits(timeout=10.0), mode=mode).status == "error"
    got = probe._finish(probe._probe(mode), None)
    assert got["mode"] == mode and got["seccomp"]["enabled"] is False
    assert "could not be loaded" in got["seccomp"]["why"]
    listed = [x for x in got["not_isolated"] if x.startswith("kernel attack surface: no seccomp filter")]
    assert listed and "io_uring" in listed[0] and listed[0] in got["warning"]


def test_a_kernel_without_seccomp_is_reported(monkeypatch):
    from postrl.sandbox import seccomp

    monkeypatch.setattr(seccomp, "unavailable", lambda: "the kernel is built without seccomp (test)")
    got = probe._finish(probe._probe("fallback"), None)
    assert got["seccomp"] == {"enabled": False, "why": "the kernel is built without seccomp (test)"}
    assert "NOT isolated" in got["warning"] and "no seccomp filter (the kernel is built without seccomp (test))" \
        in got["warning"]


# ------------------------------------------------------------------------------------------------ the package


def test_the_sandbox_imports_nothing_else_of_postrl():
    """Issue 25: a self-contained subpackage (imports inside functions count)."""
    import ast

    root = Path(probe.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(root)}: {n}" for n in names
                    if (n == "postrl" or n.startswith("postrl.")) and not n.startswith("postrl.sandbox")]
    assert bad == []


def test_callers_turn_sandbox_errors_into_one_line_postrl_errors(tmp_path, capsys):
    from postrl.cli import main
    from postrl.errors import ConfigError, DataError

    with pytest.raises(ConfigError, match="sandbox limit 'timeout' must be a positive number"):
        code_tests(None, [GOOD], [TESTS], timeout=0)
    with pytest.raises(DataError, match="tests: expected a string, list or dict, got int"):
        code_tests(None, [GOOD], [42], timeout=5.0)
    prog = tmp_path / "p.py"
    prog.write_text("print(1)\n")
    assert main(["sandbox", str(prog), "--timeout", "0"]) == 2
    assert capsys.readouterr().err.strip() == \
        "postrl: error: sandbox limit 'timeout' must be a positive number, got 0.0"


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_the_filter_program_decides_as_documented(arch):
    """The compiled classic-BPF program, run by a small interpreter here, for both architectures (only the one of
    this machine can be run by the kernel): the numbers are the test's own (Linux uapi tables)."""
    import struct

    from postrl.sandbox import seccomp

    prog = seccomp.program(arch)
    ins = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]

    def decide(nr, arg0=0, audit=None):
        data = struct.pack("<iIQ6Q", nr, audit if audit is not None else AUDIT[arch], 0, arg0, 0, 0, 0, 0, 0)
        pc, acc = 0, 0
        while True:
            code, jt, jf, k = ins[pc]
            if code == 0x20:  # ld [k]
                acc = struct.unpack_from("<I", data, k)[0]
            elif code == 0x06:  # ret k
                return {0x7FFF0000: "allow", 0x80000000: "kill", 0x0: "kill", 0x50001: "EPERM",
                        0x50026: "ENOSYS"}[k]
            elif code in (0x15, 0x35, 0x45):  # jeq / jge / jset
                hit = acc == k if code == 0x15 else acc >= k if code == 0x35 else bool(acc & k)
                pc += jt if hit else jf
            else:
                raise AssertionError(f"unexpected opcode {code:#x}")
            pc += 1

    AUDIT = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
    nr = {"x86_64": {"io_uring_setup": 425, "keyctl": 250, "add_key": 248, "perf_event_open": 298, "bpf": 321,
                     "open_by_handle_at": 304, "unshare": 272, "personality": 135, "clone": 56, "clone3": 435,
                     "read": 0, "write": 1, "getpid": 39, "mount": 165, "ptrace": 101},
          "aarch64": {"io_uring_setup": 425, "keyctl": 219, "add_key": 217, "perf_event_open": 241, "bpf": 280,
                      "open_by_handle_at": 265, "unshare": 97, "personality": 92, "clone": 220, "clone3": 435,
                      "read": 63, "write": 64, "getpid": 172, "mount": 40, "ptrace": 117}}[arch]
    for name in (*LISTED[:-1], "mount", "ptrace"):
        assert decide(nr[name]) == "EPERM", name
    for name in ("read", "write", "getpid"):
        assert decide(nr[name]) == "allow", name
    assert decide(nr["clone3"]) == "ENOSYS"
    assert decide(nr["clone"], 0x01200011) == "allow"  # fork: CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
    assert decide(nr["clone"], 0x003D0F00) == "allow"  # a thread (glibc's flags)
    assert decide(nr["clone"], 0x10000000 | 17) == "EPERM"  # CLONE_NEWUSER
    assert decide(nr["clone"], 0x40000000 | 17) == "EPERM"  # CLONE_NEWNET
    assert decide(nr["personality"], 0xFFFFFFFF) == "allow" and decide(nr["personality"], 0) == "allow"
    assert decide(nr["personality"], 0x0040000) == "EPERM"  # ADDR_NO_RANDOMIZE
    assert decide(nr["getpid"], audit=0x40000003) == "kill"  # AUDIT_ARCH_I386 (int 0x80) / any other arch
    if arch == "x86_64":
        assert decide(0x40000000 | 39) == "EPERM"  # x32 getpid
