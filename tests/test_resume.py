"""A run directory under faults: corrupt checkpoints, a second process, SIGTERM / Ctrl-C, extended and finished runs,
a kill after the last step, and the final model folder. Each resumed run is compared with one uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from postrl.config import load_config
from postrl.report.doctor import diagnose
from postrl.train.run_state import read_notices
from postrl.train.trainer import Trainer
from test_train import metrics, model_dir, run_inprocess, small  # noqa: F401 - model_dir: the fixture

STEPS_DIR = "checkpoints"


class Log:
    """A reporter that keeps the lines the trainer says (``log``) and ignores the progress calls."""

    def __init__(self):
        self.lines: list[str] = []

    def log(self, text: str) -> None:
        self.lines.append(text)

    def start(self, *a) -> None:
        pass

    def step(self, *a) -> None:
        pass

    def finish(self, *a) -> None:
        pass


def resume(run: Path, *overrides: str, log: Log | None = None) -> dict:
    cfg = load_config(None, list(overrides), base=yaml.safe_load((run / "config.yaml").read_text()))
    return Trainer(cfg, run, resume=True, reporter=log).train()


def evals(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]


def files(run: Path) -> dict[str, bytes]:
    """Every file of the run directory but the lock file (its holder changes with each process)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and p.name != "run.lock"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "postrl", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def ref(model_dir, tmp_path_factory) -> Path:
    """The uninterrupted run: 6 steps, checkpoints at steps 3 and 6."""
    out = tmp_path_factory.mktemp("ref") / "run"
    run_inprocess(small(model_dir, out))
    return out


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(ref, tmp_path, capsys):
    """Truncated weights in the final checkpoint: the resume says so in one line (a notice: stderr and
    notices.jsonl), moves it aside, continues from step 3 and ends exactly as the uninterrupted run."""
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    weights = run / STEPS_DIR / "step-00000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    resume(run, log=Log())
    said = [x for x in capsys.readouterr().err.splitlines() if "unusable" in x]
    assert len(said) == 1 and "step-00000006" in said[0] and "model.safetensors" in said[0]
    assert said[0].startswith("notice: ") and "resuming from step-00000003" in said[0]
    assert [n["message"] for n in read_notices(run)] == [said[0][len("notice: "):]]
    assert (run / STEPS_DIR / "step-00000006.corrupt").is_dir()
    assert metrics(run) == metrics(ref) and evals(run) == evals(ref)
    assert diagnose(run).status == "finished" and any("corrupt" in n for n in diagnose(run).notes)


@pytest.mark.parametrize("broken", ["trainer_state.json", "optimizer.pt"])
def test_set_aside_checkpoint_is_said_under_quiet_and_kept_for_the_doctor(ref, tmp_path, broken):
    """--quiet silences progress, not what changes the run: a corrupt trainer_state or optimizer in the newest
    checkpoint is set aside and step 3 resumed, and that is on stderr, in RUN/notices.jsonl and in `postrl
    doctor` (before: with --quiet nothing was said anywhere)."""
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    (run / STEPS_DIR / "step-00000006" / broken).write_bytes(b"\x00garbage")
    r = cli("train", "--quiet", "--resume", str(run))
    assert r.returncode == 0, r.stderr[-2000:]
    said = [x for x in r.stderr.splitlines() if "unusable" in x]
    assert len(said) == 1 and said[0].startswith(f"notice: checkpoint {run / STEPS_DIR / 'step-00000006'} is "
                                                 f"unusable") and broken in said[0]
    assert "resuming from step-00000003" in said[0] and r.stdout == ""
    notices = read_notices(run)
    assert len(notices) == 1 and notices[0]["message"] == said[0][len("notice: "):]
    assert metrics(run) == metrics(ref)
    d = cli("doctor", str(run), "--json")
    assert json.loads(d.stdout)["notices"] == notices
    text = " ".join(cli("doctor", str(run)).stdout.replace("│", " ").split())  # the panel's lines, unwrapped
    assert "notice checkpoint" in text and "resuming from step-00000003" in text


def test_no_usable_checkpoint_is_one_line_naming_the_files(ref, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    (run / STEPS_DIR / "step-00000006" / "model.safetensors").write_bytes(b"")
    state = run / STEPS_DIR / "step-00000003" / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": "three"}))
    before = files(run)
    r = cli("train", "--quiet", "--resume", str(run))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no usable checkpoint" in r.stderr
    assert "step-00000006/model.safetensors" in r.stderr and "step-00000003/trainer_state.json" in r.stderr
    assert files(run) == before  # nothing moved, nothing written


def test_second_process_on_a_running_run_is_refused(model_dir, tmp_path):
    """`--resume RUN` while RUN is still training: one line naming the holder; the first run loses no step (it is
    then stopped by SIGTERM, and its log holds every step up to its checkpoint)."""
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "postrl", "train", "--quiet",
                              *small(model_dir, run, "train.steps=1000", "train.save_every=0")],
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").is_file():
        time.sleep(0.05)
        assert first.poll() is None and time.time() < deadline, first.stderr.read()
    r = cli("train", "--quiet", "--resume", str(run))
    assert first.poll() is None  # the first run was still going when the second one was refused
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"is in use by pid {first.pid} on " in r.stderr and "(started 20" in r.stderr
    assert diagnose(run).status == "running" and f"pid {first.pid}" in diagnose(run).detail
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) == 143, first.stderr.read()
    n = len(metrics(run))
    assert [m["step"] for m in metrics(run)] == list(range(1, n + 1))
    assert [p.name for p in (run / STEPS_DIR).iterdir()] == [f"step-{n:08d}"]
    assert (run / "run.lock").read_text() == ""  # released on exit


def test_sigterm_stops_at_the_end_of_the_step_with_a_checkpoint(model_dir, ref, tmp_path):
    """SIGTERM: the step in progress ends, its checkpoint is written, status.json and the doctor say where it
    stopped, the exit status is 143; the resumed run ends as the uninterrupted one."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "postrl", "train", "--quiet", *small(model_dir, run)],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
        time.sleep(0.02)
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 143, err
    n = len(metrics(run))
    assert 1 <= n <= 6
    assert f"stopped at step {n} by SIGTERM" in err and "Traceback" not in err
    assert json.loads((run / STEPS_DIR / f"step-{n:08d}" / "trainer_state.json").read_text())["step"] == n
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "stopped" and status["step"] == n and status["signal"] == "SIGTERM"
    d = diagnose(run)
    assert d.status == "stopped" and d.detail.startswith(f"stopped at step {n} by SIGTERM")
    resume(run)
    assert metrics(run) == metrics(ref) and evals(run) == evals(ref)
    assert not (run / "status.json").exists() and diagnose(run).status == "finished"


def _signal_in_step(monkeypatch, at: int, signum: int, times: int) -> None:
    real = Trainer.train_step

    def step(self, s):
        out = real(self, s)
        if s == at:
            for _ in range(times):
                os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(Trainer, "train_step", step)


def test_ctrl_c_stops_cleanly_and_a_second_signal_aborts_at_once(model_dir, tmp_path, monkeypatch):
    stopped, aborted = tmp_path / "stopped", tmp_path / "aborted"
    handler = signal.getsignal(signal.SIGINT)
    _signal_in_step(monkeypatch, at=1, signum=signal.SIGINT, times=1)
    with pytest.raises(KeyboardInterrupt):  # the CLI turns it into exit status 130
        run_inprocess(small(model_dir, stopped))
    assert len(metrics(stopped)) == 2 and (stopped / STEPS_DIR / "step-00000002").is_dir()
    assert json.loads((stopped / "status.json").read_text())["state"] == "stopped"
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    monkeypatch.undo()

    _signal_in_step(monkeypatch, at=1, signum=signal.SIGTERM, times=2)
    with pytest.raises(SystemExit) as info:
        run_inprocess(small(model_dir, aborted))
    assert info.value.code == 143
    assert not (aborted / STEPS_DIR).exists()  # aborted inside step 2: no checkpoint of it
    status = json.loads((aborted / "status.json").read_text())
    assert (status["state"], status["step"], status["signal"]) == ("aborted", 1, "SIGTERM")
    assert diagnose(aborted).detail == "aborted at step 1 by a second SIGTERM (no checkpoint of the step)"


def test_extended_run_keeps_its_steps_and_a_lower_steps_is_refused(model_dir, ref, tmp_path):
    """train.steps=4, then --resume train.steps=6, then a plain --resume: nothing to do (summary, config.yaml,
    checkpoint and doctor all at step 6); the metrics equal the uninterrupted 6-step run. --resume train.steps=3
    is refused in one line."""
    run = tmp_path / "run"
    run_inprocess(small(model_dir, run, "train.steps=4"))
    resume(run, "train.steps=6")
    assert metrics(run) == metrics(ref)
    log = Log()
    summary = resume(run, log=log)
    assert summary["steps"] == 6 and "nothing to do" in log.lines[-1]
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 6
    d = diagnose(run)
    assert (d.status, d.run.steps_done, d.run.steps_planned) == ("finished", 6, 6)

    before = files(run)
    r = cli("train", "--quiet", "--resume", str(run), "train.steps=3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "train.steps=3 is below the latest checkpoint's step 6 (the run is already at step 6)" in r.stderr
    assert files(run) == before

    # a run directory as an earlier postrl left it: config.yaml and summary.json at 4, the checkpoint at 6
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["train"]["steps"] = 4
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "summary.json").write_text(json.dumps({**json.loads((run / "summary.json").read_text()), "steps": 4}))
    summary = resume(run, log=Log())
    assert summary["steps"] == 6 and json.loads((run / "summary.json").read_text())["steps"] == 6
    assert any("config.yaml plans 4 steps but the latest checkpoint is at step 6" in n["message"]
               for n in read_notices(run))
    assert sorted(p.name for p in (run / STEPS_DIR).iterdir()) == ["step-00000004", "step-00000006"]  # no new one
    assert metrics(run) == metrics(ref) and [e["tag"] for e in evals(run)] == ["before", "after", "after"]
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 6


def test_resuming_a_finished_run_writes_nothing(ref, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    before = files(run)
    log = Log()
    summary = resume(run, log=log)
    assert log.lines == [f"{run}: the run already finished at step 6: nothing to do (give train.steps=N to train "
                         f"further)"]
    assert summary == json.loads((ref / "summary.json").read_text())
    assert files(run) == before


def test_kill_after_the_final_checkpoint_then_resume_equals_the_uninterrupted_run(model_dir, ref, tmp_path,
                                                                                 monkeypatch):
    run = tmp_path / "run"
    real = Trainer.save

    def save_then_die(self, step):
        real(self, step)
        if step == self.cfg.train.steps:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(Trainer, "save", save_then_die)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_inprocess(small(model_dir, run))
    monkeypatch.undo()
    assert (run / STEPS_DIR / "step-00000006").is_dir() and not (run / "summary.json").exists()
    assert diagnose(run).detail == "failed at step 6: RuntimeError: simulated crash"
    resume(run)
    assert evals(run) == evals(ref) and metrics(run) == metrics(ref)
    assert json.loads((run / "summary.json").read_text())["after"] == evals(ref)[-1]
    assert (run / "final" / "model.safetensors").is_file()


def test_final_model_folder_loads_and_generates_as_the_trained_policy(ref):
    """RUN/final: what a TRL user expects after training, a from_pretrained folder of the final policy and
    tokenizer (the same logits and greedy generation as the final checkpoint)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final, last = ref / "final", ref / STEPS_DIR / "step-00000006"
    assert json.loads((ref / "summary.json").read_text())["final_model"] == str(final)
    tok = AutoTokenizer.from_pretrained(final)
    ids = tok("7+2=", return_tensors="pt").input_ids
    a, b = AutoModelForCausalLM.from_pretrained(final).eval(), AutoModelForCausalLM.from_pretrained(last).eval()
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
        ga = a.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        gb = b.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(ga, gb)
    assert not any(p.name.startswith(".final") for p in ref.iterdir())  # no temporary folder left


def test_doctor_tells_a_killed_run_from_a_running_one(ref, tmp_path):
    """A lock file that still names a process which no longer exists (SIGKILL: no clean-up) is a killed run, even
    when its metrics were written a second ago; the same file naming a live process is a running one."""
    import socket

    run = tmp_path / "run"
    shutil.copytree(ref, run)
    (run / "summary.json").unlink()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                              "started": "2026-01-01T00:00:00+0000"}))
    d = diagnose(run)
    assert d.status == "stopped" and d.detail.startswith(f"killed: pid {dead.pid} on {socket.gethostname()}")
    (run / "run.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "x"}))
    assert diagnose(run).status == "running"
