"""End-to-end training: learning, determinism, resume (after an exception and after SIGKILL), 2-process DDP,
CLI commands and their one-line errors. Every run uses a tiny model written with save_pretrained."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from postrl import registry
from postrl.config import load_config
from postrl.models.tiny import build_local
from postrl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


@registry.register("reward", "sevens", source="test: fraction of '7' characters")
def sevens_reward(prompts, completions, **_):
    """Fraction of the completion's characters that are '7' (a reward any policy can learn to raise)."""
    return [c.count("7") / max(1, len(c)) for c in completions]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nano")
    build_local(path, size="nano", seed=0)  # save_pretrained of model and tokenizer
    return path


def free_port() -> str:
    """A TCP port free now, for a 2-process test's rendezvous (a fixed one collides when two test runs share the
    machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def small(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
            "rollout.max_new_tokens=4", "rollout.group_size=4", "train.prompts_per_step=8", "train.steps=6",
            "train.save_every=3", "train.eval_size=16", "train.eval_k=2", "train.samples_every=2", "optim.lr=1e-3",
            *extra]


_MACHINE_KEYS = ("time/", "throughput/", "memory/")  # wall-clock and memory measurements vary run to run


def metrics(run: Path) -> list[dict]:
    """Every logged metric except timings and memory; NaN becomes the string 'nan' so equal runs compare equal."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: ("nan" if isinstance(v, float) and v != v else v) for k, v in r.items()
             if not k.startswith(_MACHINE_KEYS)} for r in rows]


def run_inprocess(args: list[str], resume: bool = False) -> dict:
    cfg = load_config(None, args)
    return Trainer(cfg, cfg.output_dir, resume=resume).train()


def crash_in_step(monkeypatch, args: list[str], step: int = 4) -> None:
    """Run ``args`` in process and let it die of an exception in step ``step`` (0-based; ``Trainer.train_step``
    patched)."""
    real = Trainer.train_step

    def crashing(self, s):
        if s == step:
            raise RuntimeError("simulated crash")
        return real(self, s)

    monkeypatch.setattr(Trainer, "train_step", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_inprocess(args)
    monkeypatch.setattr(Trainer, "train_step", real)


def resume(run: Path) -> dict:
    cfg = load_config(None, [], base=__import__("yaml").safe_load((run / "config.yaml").read_text()))
    return Trainer(cfg, run, resume=True).train()


def test_reward_rises_end_to_end(model_dir, tmp_path):
    """A from-scratch model learns, by RL alone, to write more 7s: the reward climbs several-fold."""
    out = tmp_path / "learn"
    run_inprocess(small(model_dir, out, "rewards=[{name: sevens}]", "train.steps=40", "optim.lr=3e-3",
                        "train.save_every=0", "rollout.group_size=8", "rollout.max_new_tokens=6",
                        "train.prompts_per_step=8"))
    m = metrics(out)
    first = sum(r["reward/mean"] for r in m[:5]) / 5
    last = sum(r["reward/mean"] for r in m[-5:]) / 5
    assert last > max(3 * first, 0.3), (first, last)
    assert all(r["grad_norm"] == r["grad_norm"] for r in m)  # finite
    # the run directory holds what the issue asks for
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "eval.jsonl", "summary.json"):
        assert (out / name).is_file(), name
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert {"prompt", "completion", "rewards", "advantage", "truncated"} <= set(sample)
    assert "sevens" in sample["rewards"]


def test_same_seed_same_metrics_and_resume_after_crash(model_dir, tmp_path, monkeypatch):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run_inprocess(small(model_dir, a))
    run_inprocess(small(model_dir, b))
    assert metrics(a) == metrics(b)  # same seed and config: identical metrics on CPU
    assert len(metrics(a)) == 6

    # crash in the 5th step (after the checkpoint of step 3), then resume: identical to the uninterrupted run
    crash_in_step(monkeypatch, small(model_dir, c))
    assert len(metrics(c)) == 4  # steps 1-4 were logged before the crash
    resume(c)
    assert metrics(c) == metrics(a)
    after = [json.loads(x) for x in (c / "eval.jsonl").read_text().splitlines()]
    assert [e["tag"] for e in after] == ["before", "after"]


def test_resume_keeps_the_sharpness_batch(model_dir, tmp_path, monkeypatch):
    """The sharpness diagnostic measures on a batch fixed at its first estimate (step 2 here); a run resumed from
    the checkpoint of step 3 must go on measuring on that batch, not on the first batch after the resume."""
    a, c = tmp_path / "a", tmp_path / "c"
    extra = ("rewards=[{name: sevens}]", "diagnostics.edge_of_stability.every=2",
             "diagnostics.edge_of_stability.iters=3")
    run_inprocess(small(model_dir, a, *extra))
    crash_in_step(monkeypatch, small(model_dir, c, *extra))
    resume(c)
    sharp = [m["stability/sharpness"] for m in metrics(a) if "stability/sharpness" in m]
    assert len(sharp) == 3 and len(set(sharp)) == 3  # steps 2, 4, 6: measured, and the policy moved between
    assert metrics(c) == metrics(a)


def test_resume_after_sigkill_mid_run(model_dir, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "killed"
    args = small(model_dir, ref, "train.steps=8", "train.save_every=2")
    run_inprocess(args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "postrl", "train", "--quiet", *small(model_dir, run, "train.steps=8",
                                                                       "train.save_every=2")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (run / "checkpoints" / "step-00000002" / "trainer_state.json").exists():
        time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to clean up
    proc.wait()
    r = subprocess.run([sys.executable, "-m", "postrl", "train", "--quiet", "--resume", str(run)], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert metrics(run) == metrics(ref)


def test_two_process_ddp_matches_one_process(model_dir, tmp_path):
    """accelerate launch --cpu --num_processes 2: DDP over gloo trains, and with per-sequence aggregation the
    metrics equal a 1-process run on the same prompts (the rollouts do not depend on the process count)."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = ("loss.agg=seq_mean_token_mean", "train.steps=3", "train.save_every=0", "accel.threads=1")
    # the reference on the CPU as well, also where a GPU is present (--cpu hides it from the two workers)
    r = cli("train", "--quiet", *small(model_dir, one, *extra), env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", free_port(),
           "-m", "postrl", "train", "--quiet", *small(model_dir, two, *extra)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((two / "summary.json").read_text())["processes"] == 2  # really two workers, not one
    assert json.loads((one / "summary.json").read_text())["processes"] == 1
    m1, m2 = metrics(one), metrics(two)
    assert len(m2) == 3
    for a, b in zip(m1, m2):
        for key in ("reward/mean", "accuracy", "pg_loss", "grad_norm", "entropy", "length/mean", "length/max"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    # both processes ended with the same weights, and those equal the 1-process run's
    from safetensors.torch import load_file

    w1 = load_file(str(next((one / "checkpoints").glob("step-*")) / "model.safetensors"))
    w2 = load_file(str(next((two / "checkpoints").glob("step-*")) / "model.safetensors"))
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-5), k


def test_bfloat16_trains_with_float32_master_weights(model_dir, tmp_path):
    """model.dtype=bfloat16 (it crashed in the fused AdamW step): the weights the optimizer steps stay float32, the
    model's forward in the update runs under bf16 autocast, and training is finite."""
    cfg = load_config(None, small(model_dir, tmp_path / "bf16", "model.dtype=bfloat16", "train.steps=2"))
    tr = Trainer(cfg, tmp_path / "bf16")
    seen = []
    layer = next(m for m in tr.policy.modules() if isinstance(m, torch.nn.Linear))
    layer.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype) if torch.is_grad_enabled() else None)
    rows = [tr.train_step(s) for s in range(2)]
    assert all(p.dtype == torch.float32 for p in tr.policy.parameters())
    assert seen and set(seen) == {torch.bfloat16}
    assert all(math.isfinite(m["pg_loss"]) and math.isfinite(m["grad_norm"]) for m in rows)


def test_eval_without_a_verifier_uses_the_configured_rewards(model_dir, tmp_path):
    """A file task without a verifier and a user reward: held-out prompts are scored by the run's rewards (it read
    'accuracy 0.000 -> 0.000' before, every completion counted wrong), and the summary says so."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(40)))
    (tmp_path / "short_rewards.py").write_text(
        "def short(prompts, completions, **columns):\n"
        "    return [1.0 if len(c) <= 3 else 0.25 for c in completions]\n")
    out = tmp_path / "run"
    r = cli("train", *small(model_dir, out, "task={name: file, path: " + str(data) + "}",
                            "rewards=[{name: 'short_rewards:short', weight: 2.0}]"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    for ev in (summary["before"], summary["after"]):
        assert ev["scored_by"] == "rewards"
        assert ev["reward"] == pytest.approx(2.0 * (0.25 + 0.75 * ev["accuracy"]))  # weighted; 1 = full reward
    said = " ".join(r.stdout.split())
    assert "held-out before RL (scored by the configured rewards: the task has no verifier)" in said
    assert "scored by the configured rewards (the task has no verifier)" in said


def test_trainer_refuses_an_accelerate_state_with_mixed_precision(model_dir, tmp_path):
    """accelerate's state is per process: after a TRL trainer set it to bf16, accelerate would wrap postrl's forward
    in bf16 autocast, silently; postrl says so and stops instead."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from postrl.errors import PostrlError

    AcceleratorState._reset_state(True)
    Accelerator(cpu=True, mixed_precision="bf16")
    try:
        with pytest.raises(PostrlError, match="mixed_precision=bf16"):
            Trainer(load_config(None, small(model_dir, tmp_path / "run")), tmp_path / "run")
    finally:
        AcceleratorState._reset_state(True)


def test_readme_multi_process_command(tmp_path):
    """The README's command as a user types it, default config (built-in model, diagnostics on, prompts of
    different lengths): `accelerate launch --cpu --num_processes 2 -m postrl train train.steps=3`. It used to die at
    step 3 on rank 1 (a diagnostics buffer of the previous step's width, reset on the main process only), then to
    hang (the processes chose different forward paths from their own data)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
           "--main_process_port", free_port(), "-m", "postrl", "train", "train.steps=3"]
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / "summary.json").read_text())["processes"] == 2
    rows = metrics(run)
    assert [m["step"] for m in rows] == [1, 2, 3] and all(math.isfinite(m["pg_loss"]) for m in rows)


def test_accelerate_cpu_launch_hides_gpus(monkeypatch):
    """`accelerate launch --cpu` on a machine with a GPU: postrl hides the GPU from itself and its workers (seen on
    an H100: otherwise the gloo barrier of rank 1 asked for cuda:1, "invalid device ordinal"); without --cpu the
    environment is left alone."""
    from postrl.launch import relaunch_if_needed

    for var in ("MASTER_ADDR", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert relaunch_if_needed(["train"]) is None and os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert relaunch_if_needed(["train"]) is None and os.environ["CUDA_VISIBLE_DEVICES"] == ""


def cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "postrl", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})})


def test_prompts_file_with_missing_column_is_one_line_error(model_dir, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    r = cli("train", "--quiet", f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}",
            f"task={{name: file, path: {f}, verifier: arithmetic}}")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "prompts.jsonl" in r.stderr and "row 2" in r.stderr and "prompt" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing written half


def test_reward_with_wrong_number_of_values_is_one_line_error(model_dir, tmp_path):
    (tmp_path / "badreward.py").write_text("def short(prompts, completions, **kw):\n    return [1.0]\n")
    r = cli("train", "--quiet", *small(model_dir, tmp_path / "run"), "rewards=[{name: 'badreward:short'}]",
            "reward.strict=true", env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "postrl: error: reward 'badreward:short' returned 1 values for 32 completions"


def test_user_reward_by_import_path_trl_and_verl_signatures(model_dir, tmp_path):
    (tmp_path / "myrewards.py").write_text(
        "def trl_style(prompts, completions, answer, **kwargs):\n"
        "    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.strip() == ground_truth)}\n"
        "async def async_style(prompts, completions, answer, **kwargs):\n"
        "    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]\n")
    out = tmp_path / "run"
    r = cli("train", "--quiet", *small(model_dir, out, "train.steps=2", "train.save_every=0"),
            "rewards=[{name: 'myrewards:trl_style'}, {name: 'myrewards:compute_score'}, {name: correct}, "
            "{name: 'myrewards:async_style'}]",
            env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    for m in metrics(out):  # all of them agree with the task verifier on every completion
        assert m["reward/myrewards:trl_style/mean"] == m["reward/correct/mean"]
        assert m["reward/myrewards:compute_score/mean"] == m["reward/correct/mean"]
        assert m["reward/myrewards:async_style/mean"] == m["reward/correct/mean"]  # async def, awaited
        assert m["reward/myrewards:async_style/failure_rate"] == 0.0


def test_sft_then_eval_cli(model_dir, tmp_path):
    out = tmp_path / "sft"
    r = cli("sft", f"model.path={model_dir}", "task.digits=1", "sft.steps=60", "sft.batch_size=32", "--out", str(out))
    assert r.returncode == 0, r.stderr
    losses = [float(line.split("loss")[1]) for line in r.stdout.splitlines() if "loss" in line]
    assert losses[-1] < 0.5 * losses[0]
    r = cli("eval", str(out), "--task", "arithmetic", "task.digits=1", "--n", "5", "--k", "2", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["n"] == 5 and 0.0 <= res["accuracy"] <= 1.0 and "pass@2" in res
    r = cli("eval", str(tmp_path / "nothing"), "--task", "arithmetic")
    assert r.returncode == 2 and "neither a model folder" in r.stderr


def test_onednn_layers_train_the_same_function(model_dir, tmp_path):
    """accel.matmul=onednn (postrl.accel.matmul) vs torch's products: the same first step up to float rounding,
    checkpoints that load as plain HF models."""
    from postrl.accel import matmul

    if not matmul.onednn_available():
        pytest.skip("this torch build has no oneDNN")
    a, b = tmp_path / "a", tmp_path / "b"
    cfg = load_config(None, small(model_dir, a, "accel.matmul=onednn", "train.steps=2", "accel.threads=1"))
    t = Trainer(cfg, cfg.output_dir)
    assert t.accel.matmul == "onednn" and any(type(m) is matmul.OneDNNLinear for m in t.policy.modules())
    t.train()
    run_inprocess(small(model_dir, b, "accel.matmul=torch", "train.steps=2", "accel.threads=1"))
    ma, mb = metrics(a), metrics(b)
    for key in ("reward/mean", "pg_loss", "entropy", "grad_norm", "length/mean"):
        assert ma[0][key] == pytest.approx(mb[0][key], rel=1e-4, abs=1e-6), key
    from transformers import AutoModelForCausalLM

    ckpt = sorted((a / "checkpoints").iterdir())[-1]
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert not any(type(m) is matmul.OneDNNLinear for m in loaded.modules())


def test_numpy_decode_with_bfloat16_mixed_precision_decodes_the_float32_weights(model_dir, tmp_path):
    """model.dtype=bfloat16 keeps float32 master weights, so numpy (float32 only) can still decode them."""
    r = cli("train", "--quiet", *small(model_dir, tmp_path / "run"), "model.dtype=bfloat16", "accel.decode=numpy")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clipping", "under-the-norm"])
def test_clip_folded_into_the_fused_step_equals_clip_then_step(max_norm):
    """clip_into_step (the trainer's gradient clip as the fused AdamW's grad_scale) against torch's
    clip_grad_norm_ then the step: the same norm, the same parameters over three steps (up to float rounding when
    it clips; exactly when the norm is under max_norm)."""
    from postrl.train.optim import clip_into_step

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    b = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    b.load_state_dict(a.state_dict())
    oa = torch.optim.AdamW(a.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    ob = torch.optim.AdamW(b.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for model in (a, b):
            model(x).square().sum().backward()
        na = torch.nn.utils.clip_grad_norm_(a.parameters(), max_norm)
        oa.step()
        nb = clip_into_step(list(b.parameters()), ob, max_norm)
        ob.step()
        ob.grad_scale = None
        assert float(nb) == pytest.approx(float(na), rel=1e-6) and (float(na) > max_norm) == (max_norm < 1)
        for pa, pb in zip(a.parameters(), b.parameters()):
            if max_norm < 1:
                torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-7)
            else:
                assert torch.equal(pb, pa)
        oa.zero_grad()
        ob.zero_grad()
