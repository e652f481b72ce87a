"""The test kinds (``asserts`` / ``calls``): the tests run in a checker process, the program in its own.

A forked checker runs the tests in order and reports each result on a private pipe; the program runs in a
separate, fresh interpreter (``_SERVER_SRC``, exec'd, so it holds none of the tests or expected values) as module
``solution``, and the tests reach its names through remote handles: a call, an attribute read or an iteration is a
request, and the answer is plain data of exact built-in types (or another handle, which equals only itself).

Nothing the program does to its own interpreter reaches a verdict: rebinding builtins, walking frames to the
reporting code, or objects with overridden comparison. What the tests cannot do through handles: mutate an argument
in place and look at it afterwards (arguments are copies), or pass functions to the program (only plain data and
handles).
"""

import marshal
import os
import select
import sys
import time

from .util import MSG_MAX, descendants, exit_of, flush, kill_pids, short, unhex


def run_tests(h, kind, units):
    """The ``asserts`` / ``calls`` kinds: a checker process (:func:`_checker`) runs the tests in order and reports
    each result on a private pipe. The harness (not the checker) knows how many tests there are, so a checker that
    dies leaves the remaining tests failed, never passed; a program process that ends mid-test fails that test and
    the next one gets a fresh program process; a test that (with a per-test timeout) hangs fails alone and the rest
    run in a fresh checker. Returns (one result per test, the load outcome)."""
    n = len(units)
    results = [None] * n
    load = {"loaded": None, "error": None, "status": None}
    per_test = h.limits.get("test_timeout")
    start = 0
    null = os.open(os.devnull, os.O_RDONLY)
    while start < n:
        token = os.urandom(16).hex()
        r, w = os.pipe()
        pid = h.fork_program(null, keep=(w,))
        if pid == 0:  # ---- child: the program's process from here on
            try:
                _checker(h, kind, units, start, w, token)
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
            limit = h.deadline
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
                    load["error"] = short(unhex(parts[3]))
                elif tag == "R" and len(parts) >= 5 and loaded_here:
                    try:
                        idx = int(parts[2])
                    except ValueError:
                        continue
                    if current <= idx < n and results[idx] is None:
                        outcome = parts[3] if parts[3] in ("pass", "fail", "error", "memory", "timeout", "killed") \
                            else "error"
                        results[idx] = {"status": outcome, "reason": short(unhex(parts[4]))}
                        current = idx + 1
                        last = time.time()
                elif tag == "D" and loaded_here:
                    done = True
        if killed_for is not None or not done:
            kill_pids(descendants(pid))  # the program process the checker started (its own session)
            h.kill_group(pid)
        os.close(r)
        if status is None:
            _, status = os.waitpid(pid, 0)
        code, sig = exit_of(status)
        if load["loaded"] is False:
            break
        if not loaded_here:  # died or hung before the program finished loading
            load["loaded"] = False
            if killed_for == "time":
                load["status"], load["error"] = "timeout", "wall-time limit reached while loading the program"
            elif sig is not None:
                load["status"], load["error"] = h.signal_reason(sig)
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
            st, reason = h.signal_reason(sig)
            results[current] = {"status": st, "reason": reason + " during the test"}
        else:
            results[current] = {"status": "error",
                                "reason": "the process exited (code %s) during the test" % code}
        start = current + 1
        if time.time() >= h.deadline:
            break
    os.close(null)
    if load["loaded"] is False:
        reason = "not run: " + (load["error"] or "the program did not load")
        st = load["status"] if load["status"] in ("timeout", "memory", "killed") else "error"
        results = [x if x is not None else {"status": st, "reason": reason} for x in results]
    results = [x if x is not None else {"status": "timeout", "reason": "not run: wall-time limit reached"}
               for x in results]
    return results, load


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
        code, sig = exit_of(self.reap())
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
                          % exit_of(ch.status)[0])
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
        return str(text)[:MSG_MAX].encode("utf-8", "replace").hex().encode()

    modules = [m for m in dict.fromkeys(["solution", h.spec.get("module") or "solution"]) if m.isidentifier()]
    ch, names = _start_program(h, modules[0])
    if ch is None:
        st, msg = names
        send(b"E", st.encode(), hexmsg(msg))
        flush()
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
    flush()
    os._exit(0)

