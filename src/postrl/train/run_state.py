"""What a run directory records about the process writing it, how that process ended, and what a resume does.

- ``run.lock``: one training process at a time writes a run directory. The process holds an exclusive
  ``fcntl.flock`` on this file for the run's life and writes who it is into it (pid, host, start time); a second
  process (a ``--resume`` started while the run is still going) fails with one line naming the holder. The kernel
  drops the lock when its process dies, so the file of a killed run never blocks the next one; on a clean exit
  the file is emptied. Trainers in one process share the lock (it guards against two processes).
- ``status.json``: how the last process ended when it did not finish: ``stopped`` (SIGTERM / Ctrl-C, after a
  checkpoint of the last step), ``aborted`` (a second signal), ``failed`` (an exception). It is removed when a
  process starts training; a finished run has ``summary.json`` instead. ``postrl doctor`` reads both files.
- :class:`StopSignals`: the first SIGTERM / SIGINT asks the run to stop at the end of the current step (with a
  checkpoint; exit status 128 + signal: 143 / 130); a second one stops at once.
- ``notices.jsonl``: what changed what the run does (a checkpoint set aside and an older one resumed, the steps a
  resume decided, a reward that fails or does not apply, groups masked out of the update, a start-up warning):
  one JSON line each (:class:`Notices`), also printed to stderr in every mode (``--quiet`` silences progress,
  not these); ``postrl doctor`` lists them.
- :func:`resume_steps`, :func:`finished_summary`, :func:`after_eval`: what a resumed run still has to do.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from postrl.io import read_jsonl
from postrl.errors import PostrlError
from postrl.config import dump_yaml, read_yaml, yaml_load

LOCK_FILE = "run.lock"
STATUS_FILE = "status.json"
NOTICES_FILE = "notices.jsonl"


def check_run_dir(run_dir: str | os.PathLike, what: str = "output_dir") -> Path:
    """``run_dir`` if it is, or can become, a writable folder; else one PostrlError line naming ``what`` (a path
    that is a file or a device, under a file, or in a folder this process cannot write). Nothing is created."""
    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise PostrlError(f"{what} '{p}' is a file, not a folder; give a folder for the run directory")
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise PostrlError(f"{what} '{p}': '{probe}' is a file, not a folder")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise PostrlError(f"{what} '{p}': cannot write in '{probe}' (permission denied)")
    return p


# --------------------------------------------------------------------------------------------------- lock

_held: dict[str, list] = {}  # real path of the lock file -> [fd, number of holders in this process]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class RunLock:
    """Exclusive lock of ``run_dir`` for this process (see the module docstring); ``release()`` is idempotent."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = check_run_dir(run_dir, "run directory")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PostrlError(f"cannot create run directory {self.run_dir}: {exc.strerror or exc}") from None
        self.path = self.run_dir / LOCK_FILE
        self._key: str | None = os.path.realpath(self.path)
        held = _held.get(self._key)
        if held is not None:
            held[1] += 1
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            self._key = None
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise PostrlError(f"cannot lock run directory {self.run_dir}: {exc}") from None
            raise PostrlError(f"run directory {self.run_dir} is in use by {describe_holder(read_holder(self.run_dir))}"
                              f"; wait for it to end or stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": _now()})
                       + "\n").encode(), 0)
        _held[self._key] = [fd, 1]

    def release(self) -> None:
        """Drop this holder; the last one in the process empties the file and unlocks it."""
        if self._key is None:
            return
        held = _held.get(self._key)
        self._key, key = None, self._key
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _held[key]
            fd = held[0]
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)  # closing the last descriptor drops the flock

    def __del__(self):  # a trainer dropped without finishing train(): its share of the lock goes with it
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be half torn down; the OS unlocks
            pass


def read_holder(run_dir: str | os.PathLike) -> dict | None:
    """The holder written in ``run_dir/run.lock`` ({pid, host, started}), or None (no file, empty, unreadable).
    The file keeps the holder of a killed process: see :func:`holder_alive`."""
    try:
        text = (Path(run_dir) / LOCK_FILE).read_text()
        holder = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def holder_alive(holder: dict) -> bool | None:
    """True / False when the holder runs on this host and its pid is / is not alive; None for another host."""
    if holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_holder(holder: dict | None) -> str:
    if holder is None:
        return "another process"
    return f"pid {holder['pid']} on {holder.get('host', '?')} (started {holder.get('started', '?')})"


# --------------------------------------------------------------------------------------------------- notices


class Notices:
    """What changes what a run does, said in every mode: one line ``notice: <message>`` on stderr (``--quiet``
    silences the progress table, not these) and one JSON line ``{"time", "step", "kind", "message"}`` in
    ``RUN/notices.jsonl`` (``postrl doctor`` lists them). Notices given before the run directory is open (the
    trainer's start-up) are written when :meth:`start` opens it. ``enabled=False`` (a process other than the
    main one) says nothing. :meth:`once` says a message under a key the first time only."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, stream=None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.stream = stream
        self.pending: list[dict] = []
        self.opened = False
        self.said: set = set()

    def __call__(self, message: str, step: int | None = None, kind: str = "notice", echo: bool = True) -> None:
        if not self.enabled:
            return
        message = " ".join(str(message).split())
        if echo:
            try:
                print(f"{kind}: {message}", file=self.stream or sys.stderr, flush=True)
            except OSError:  # a closed stderr: the file still has it
                pass
        rec = {"time": _now(), "step": step, "kind": kind, "message": message}
        if self.opened:
            self._append([rec])
        else:
            self.pending.append(rec)

    def once(self, key, message: str, step: int | None = None, kind: str = "notice") -> bool:
        """Say ``message`` unless a message with ``key`` was said before; True when said now."""
        if key in self.said:
            return False
        self.said.add(key)
        self(message, step=step, kind=kind)
        return True

    def start(self, new: bool) -> None:
        """The run directory is ours now (its lock held): a new run starts an empty file (a resumed one appends);
        what was said before is written."""
        if not self.enabled:
            return
        if new:
            (self.run_dir / NOTICES_FILE).write_text("")
        self.opened = True
        self._append(self.pending)
        self.pending = []

    def _append(self, recs: list[dict]) -> None:
        if not recs:
            return
        try:
            with open(self.run_dir / NOTICES_FILE, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in recs))
        except OSError:
            pass  # stderr said it; a full or vanished disk does not stop the run for a notice


def read_notices(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``RUN/notices.jsonl`` (a line cut by a crash is skipped)."""
    return [r for r in read_jsonl(Path(run_dir) / NOTICES_FILE) if isinstance(r.get("message"), str)]


# --------------------------------------------------------------------------------------------------- status


def write_json_atomic(path: Path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file and one rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def write_status(run_dir: str | os.PathLike, state: str, step: int, **info) -> dict:
    """Record how the process ended (``state``: stopped | aborted | failed) after ``step`` steps."""
    rec = {"state": state, "step": step, **info, "pid": os.getpid(), "time": _now()}
    write_json_atomic(Path(run_dir) / STATUS_FILE, rec)
    return rec


def read_status(run_dir: str | os.PathLike) -> dict | None:
    try:
        rec = json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and "state" in rec else None


def clear_status(run_dir: str | os.PathLike) -> None:
    try:
        os.unlink(Path(run_dir) / STATUS_FILE)
    except FileNotFoundError:
        pass


def describe_status(rec: dict) -> str:
    """One line: 'stopped at step 4 by SIGTERM', 'aborted at step 2 by a second SIGINT', 'failed at step 3: ...'."""
    step = rec.get("step", "?")
    if rec["state"] == "stopped":
        return f"stopped at step {step} by {rec.get('signal', 'a signal')} (checkpoint of step {step} saved)"
    if rec["state"] == "aborted":
        return f"aborted at step {step} by a second {rec.get('signal', 'signal')} (no checkpoint of the step)"
    return f"failed at step {step}: {rec.get('error', 'an error')}"


# --------------------------------------------------------------------------------------------------- signals


def _exit_for(signum: int) -> BaseException:
    """What the default handler would do: Ctrl-C is KeyboardInterrupt (exit status 130), SIGTERM exits 143."""
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


class StopSignals:
    """Context manager over a training loop: the first SIGTERM / SIGINT sets ``signum`` (the loop checks
    :meth:`requested` at the end of each step, saves a checkpoint and leaves through :meth:`stop`); a second one
    raises at once (KeyboardInterrupt / SystemExit(143)) and sets ``aborted`` to it. Handlers are installed only in the
    main thread (Python delivers signals there) and restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce: bool = True):
        self.announce = announce
        self.signum = 0  # the first signal
        self.aborted = 0  # the second one
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            self.aborted = signum
            raise _exit_for(signum)
        self.signum = signum
        if self.announce:  # os.write: no buffered stream is re-entered from a handler
            os.write(2, f"postrl: {name} received: stopping at the end of the current step with a checkpoint "
                        f"(send it again to stop at once)\n".encode())

    def requested(self, acc) -> int:
        """The signal any process received (0: none); a collective call in multi-process runs, so that every
        process stops after the same step."""
        if acc.num_processes == 1:
            return self.signum
        import torch
        import torch.distributed as dist

        t = torch.tensor([self.signum], dtype=torch.int64, device=acc.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def stop(self, run_dir: Path, step: int, signum: int, main: bool, resume: str | None = None) -> BaseException:
        """Record the stop after ``step`` (its checkpoint written), say it (``resume``: the command that continues
        the run, default ``postrl train --resume RUN``), and return the exception to raise."""
        name = signal.Signals(signum).name
        if main:
            write_status(run_dir, "stopped", step, signal=name)
            print(f"postrl: stopped at step {step} by {name}; checkpoint {run_dir}/checkpoints; continue with: "
                  f"{resume or f'postrl train --resume {run_dir}'}", file=sys.stderr, flush=True)
        return _exit_for(signum)


def record_end(run_dir: Path, step: int, exc: BaseException, stop: StopSignals) -> None:
    """``status.json`` for a process that leaves training through ``exc`` without a clean stop."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        sig = signal.Signals(stop.aborted).name if stop.aborted else "SIGINT"
        write_status(run_dir, "aborted", step, signal=sig)
    else:
        text = " ".join(str(exc).split())[:300]
        write_status(run_dir, "failed", step, error=f"{type(exc).__name__}: {text}")


# --------------------------------------------------------------------------------------------------- resume


def _recorded_config(run_dir: Path) -> dict:
    return read_yaml(run_dir / "config.yaml")


def resume_steps(run_dir: str | os.PathLike, requested: int, ckpt_step: int, say=print) -> int:
    """``train.steps`` of a run resumed from a checkpoint at ``ckpt_step``.

    ``requested`` differs from config.yaml's ``train.steps``: the user gave it (``--resume RUN train.steps=N``);
    it must be >= ``ckpt_step`` (else PostrlError: the run is already there). Otherwise the run goes on to
    max(config.yaml's steps, ``ckpt_step``): a run extended earlier is not cut back to its first plan.
    """
    run_dir = Path(run_dir)
    recorded = ((_recorded_config(run_dir).get("train") or {}).get("steps"))
    if requested != recorded:
        if requested < ckpt_step:
            raise PostrlError(f"--resume {run_dir}: train.steps={requested} is below the latest checkpoint's step "
                              f"{ckpt_step} (the run is already at step {ckpt_step}); give train.steps >= "
                              f"{ckpt_step}, or leave it out")
        return requested
    if isinstance(recorded, int) and recorded < ckpt_step:
        say(f"config.yaml plans {recorded} steps but the latest checkpoint is at step {ckpt_step}: "
            f"train.steps={ckpt_step}")
    return max(requested, ckpt_step)


def record_config(run_dir: str | os.PathLike, cfg) -> bool:
    """Rewrite ``run_dir/config.yaml`` with ``cfg`` when its content differs (a resume with overrides); True
    when written."""
    path = Path(run_dir) / "config.yaml"
    text = dump_yaml(cfg)
    if path.is_file() and yaml_load(path.read_text()) == yaml_load(text):
        return False
    tmp = path.with_name(f".config.yaml.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return True


def after_eval(run_dir: str | os.PathLike, steps: int) -> dict | None:
    """The final evaluation ("after" at ``steps``) already in eval.jsonl, or None: a process killed after the
    final checkpoint wrote it, and the resumed one reuses it instead of appending a second one."""
    found = [e for e in read_jsonl(Path(run_dir) / "eval.jsonl") if e.get("tag") == "after" and e.get("step") == steps]
    return found[-1] if found else None


def finished_summary(run_dir: str | os.PathLike, steps: int) -> dict | None:
    """summary.json when the run already finished at ``steps`` (summary of that step and its final
    evaluation in eval.jsonl), else None."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("steps") != steps or after_eval(run_dir, steps) is None:
        return None
    return summary


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep only the lines of ``path`` whose step is <= max_step (a resumed run rewrites what follows)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= max_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)


def open_new_run(run_dir: Path, config_yaml: str) -> RunLock:
    """A new run in ``run_dir``: its lock, config.yaml, empty logs, no summary of an earlier run in the folder."""
    lock = RunLock(run_dir)
    (run_dir / "config.yaml").write_text(config_yaml)
    for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
        (run_dir / name).write_text("")
    (run_dir / "summary.json").unlink(missing_ok=True)
    return lock


def append_samples(path: Path, step: int, batch, n: int) -> None:
    """Append the first ``n`` rows of a training batch to samples.jsonl: prompt, completion, each reward, the
    scalar reward, the mean advantage, truncated / valid (non-finite values as null), and under ``extra`` the
    columns reward functions logged with TRL's ``log_extra``."""
    def f(x) -> float | None:
        v = float(x)
        return v if math.isfinite(v) else None

    logged = {k.split(":", 1)[1]: v for k, v in batch.extra.items()  # a reward's TRL log_extra columns
              if k.startswith("log_extra:") and isinstance(v, list) and len(v) == len(batch)}

    def row(i: int) -> dict:
        r = {"step": step, "prompt": batch.prompts[i], "completion": batch.completions[i],
             "rewards": {name: f(batch.rewards[i, j]) for j, name in enumerate(batch.reward_names)},
             "reward": f(batch.reward[i]), "advantage": f(batch.advantages[i].mean()),
             "truncated": bool(batch.truncated[i]), "valid": bool(batch.valid[i])}
        if logged:
            r["extra"] = {k: v[i] for k, v in logged.items()}
        return r

    lines = [json.dumps(row(i), default=str) for i in range(min(len(batch), n))]
    with open(path, "a") as fh:
        fh.write("".join(line + "\n" for line in lines))
