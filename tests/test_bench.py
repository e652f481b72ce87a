"""The benchmark against TRL: postrl computes TRL's GRPO loss (the same numbers, the same gradients) on a fixed
batch, so the comparison in ``postrl bench`` is at equal work; the harness runs end to end in a minimal mode
(when trl is installed); the FLOP and bandwidth models behind its tables; the thread policy."""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from postrl.benchmark import harness as bench
from postrl.batch import RolloutBatch
from postrl.config import load_config
from postrl.errors import PostrlError
from postrl.models import load_model_and_tokenizer
from postrl.models.tiny import build_local
from postrl.accel.cpu import ThreadPolicy
from postrl.train.trainer import Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-nano")
    build_local(path, size="nano", seed=0)
    return path


def _fixed_batch(tok) -> RolloutBatch:
    """4 completions of 2 prompts (left-padded), of lengths 6, 4, 6, 2 (right-padded), mixed-sign advantages."""
    g = torch.Generator().manual_seed(3)
    prompts = [tok.encode("12+3="), tok.encode("7*8=")]
    P = max(len(p) for p in prompts)
    prompt_ids = torch.full((4, P), tok.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((4, P), dtype=torch.long)
    for i in range(4):
        p = prompts[i // 2]
        prompt_ids[i, P - len(p):] = torch.tensor(p)
        prompt_mask[i, P - len(p):] = 1
    lengths = torch.tensor([6, 4, 6, 2])
    T = 6
    completion_ids = torch.randint(5, 40, (4, T), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    completion_ids = torch.where(mask.bool(), completion_ids, tok.pad_token_id)
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=mask,
        group_ids=torch.tensor([0, 0, 1, 1]), sampler_logprobs=torch.zeros(4, T), truncated=torch.zeros(4, dtype=bool),
        prompts=["12+3="] * 2 + ["7*8="] * 2, completions=[""] * 4, valid=torch.ones(4, dtype=torch.bool),
        advantages=torch.tensor([1.3, -0.7, -1.1, 0.4]))


def trl_grpo_loss(model, batch: RolloutBatch, old: torch.Tensor | None, eps: float = 0.2) -> torch.Tensor:
    """TRL GRPOTrainer._compute_loss (trl 1.x), loss_type='dapo', beta=0, importance_sampling_level='token',
    temperature 1, one process and no accumulation, written out from its source: a forward over
    [prompt; completion] with attention_mask [prompt_mask; completion_mask] (no position ids), the log-probs of
    the completion tokens, coef_1 = exp(logp - old), coef_2 = clamp(coef_1, 1 - eps, 1 + eps),
    per_token_loss = -min(coef_1 A, coef_2 A), loss = sum(per_token_loss * mask) / sum(mask); old = logp.detach()
    when TRL does not store old log-probs (num_iterations 1)."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attn = torch.cat([batch.prompt_mask, batch.completion_mask.long()], dim=1)
    T = batch.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1:-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    old = logp.detach() if old is None else old
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    adv = batch.advantages.unsqueeze(1)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    mask = batch.completion_mask
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def _postrl_first_update(model_dir, tmp_path, batch, epochs: int):
    """postrl's Trainer.update on ``batch`` (the benchmark's settings); the loss of the first backward and the
    gradients at the first optimizer step."""
    cfg = load_config(None, [f"model.path={model_dir}", f"output_dir={tmp_path}", "loss.name=ppo_clip",
                             "loss.eps_low=0.2", "loss.eps_high=0.2", "loss.agg=token_mean", "kl.coef=0.0",
                             f"train.epochs={epochs}", "train.mini_batches=1", "train.micro_batch_size=64",
                             "optim.max_grad_norm=null", "rollout.temperature=1.0", "rollout.max_new_tokens=6",
                             "accel.threads=1"])
    trainer = Trainer(cfg, tmp_path)
    seen: dict = {}
    backward, step = trainer.acc.backward, trainer.optimizer.step

    def record_backward(loss, **kw):
        seen.setdefault("loss", float(loss.detach()))
        return backward(loss, **kw)

    def record_step(*a, **kw):
        seen.setdefault("grads", {n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters()})
        return step(*a, **kw)

    trainer.acc.backward = record_backward
    trainer.optimizer.step = record_step
    trainer.update(batch, step=0)
    return seen


@pytest.mark.parametrize("epochs", [1, 2])
def test_postrl_loss_and_gradient_equal_trl_formula_on_a_fixed_batch(model_dir, tmp_path, epochs):
    model, tok = load_model_and_tokenizer(model_dir)
    batch = _fixed_batch(tok)
    old = None
    if epochs > 1:  # stored old log-probs far enough from the policy that both clip bounds are hit
        with torch.no_grad():
            ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
            attn = torch.cat([batch.prompt_mask, batch.completion_mask.long()], dim=1)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, -7:-1]
            lp = torch.log_softmax(logits, -1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)
        shift = torch.tensor([[0.5, -0.5, 0.05, -0.05, 0.4, -0.4]]).expand(4, -1)
        old = (lp + shift) * batch.completion_mask
        batch.old_logprobs = old.clone()
    seen = _postrl_first_update(model_dir, tmp_path / f"run{epochs}", batch, epochs)

    model.train()
    ref = trl_grpo_loss(model, batch, old)
    ref.backward()
    assert math.isclose(seen["loss"], float(ref.detach()), rel_tol=1e-5, abs_tol=1e-6)
    grads = dict(model.named_parameters())
    total = sum(float(g.norm()) for g in seen["grads"].values())
    assert total > 1e-3  # a real gradient, not a zero that would match anything
    for name, g in seen["grads"].items():
        torch.testing.assert_close(g, grads[name].grad, atol=2e-6, rtol=1e-4, msg=name)


def test_flop_and_bandwidth_models():
    shape = {"hidden": 4, "layers": 2, "inter": 8, "vocab": 10, "layer_linear": 4 * 4 * 4 + 3 * 4 * 8,
             "kv_dim": 4, "params": 1000}
    S = 3 + 5
    fwd = 2 * 6 * S * 2 * (64 + 96) + 2 * 6 * 5 * 10 * 4 + 4 * 6 * 2 * 4 * S * (S + 1) / 2
    assert bench.update_flops(shape, rows=6, prompt_len=3, T=5, epochs=2) == pytest.approx(2 * 3 * fwd)
    # weights dominate when the cache is tiny: bound -> rows * bandwidth / weight bytes
    b = bench.generation_bound(dict(shape, params=10**9), rows=8, prompt_len=1, T=2, bandwidth=1e10)
    assert b == pytest.approx(8 * 1e10 / 4e9, rel=1e-3)
    peaks = bench.measure_peaks(quick=True)
    assert peaks["matmul_flops"] > 1e8 and peaks["copy_bytes_per_s"] > 1e8
    # the peak is the faster library's
    assert peaks["matmul_flops"] == max(peaks["matmul_by_lib"].values())
    assert peaks["matmul_by_lib"][peaks["matmul_lib"]] == peaks["matmul_flops"]


def test_thread_policy_fixed_and_measured():
    old = torch.get_num_threads()
    try:
        fixed = ThreadPolicy(1)
        with fixed.use("generation") as n:
            assert n == 1 and torch.get_num_threads() == 1
        p = ThreadPolicy(None, hidden=32, inter=64, max_threads=2)
        n = p.measure("update", rows=64, rounds=2)
        assert n in (1, 2) and set(p.timings["update"]) == {1, 2}
        torch.set_num_threads(2)
        with p.use("update") as m:  # measured less than refresh_s ago: the cached choice
            assert m == n == torch.get_num_threads()
        assert torch.get_num_threads() == n  # the base phase's count stays for what runs between phases
    finally:
        torch.set_num_threads(old)


def test_small_models_pin_generation_and_measure_the_update():
    from postrl.models.tiny import build_model, build_tokenizer

    model = build_model(build_tokenizer(), size="nano")
    p = ThreadPolicy.for_model(model, max_threads=2)
    assert p.threads_for("generation", rows=8) == 1 and "generation" not in p.timings  # pinned: never measured
    assert p.threads_for("update", rows=256) in (1, 2) and set(p.timings["update"]) == {1, 2}
    assert ThreadPolicy.for_model(model, 2, max_threads=2).threads_for("generation") == 2  # accel.threads wins


def test_update_is_bitwise_identical_on_one_and_two_threads():
    """What lets small models measure the update's thread count without losing bit-reproducibility
    (postrl.accel.cpu): SFT steps (forward, backward, AdamW) give the same weights on 1 and 2 threads."""
    from postrl.data import load_source
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.train.sft import run_sft

    tok = build_tokenizer()
    source = load_source({"name": "arithmetic"})
    old = torch.get_num_threads()
    weights = []
    try:
        for threads in (1, 2):
            model = build_model(tok, size="nano", seed=0)
            run_sft(model, tok, source, steps=8, batch_size=32, lr=3e-3, seed=0, threads=threads)
            weights.append([p.detach().clone() for p in model.parameters()])
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_bench_harness_minimal(model_dir, tmp_path):
    """Both sides take one step each on a nano model (T=4), alternately, with equal completion lengths."""
    pytest.importorskip("trl")
    spec = bench.Spec(size="nano", max_new_tokens=4, prompts=1, group_size=2, steps=1, warmup=0,
                      model_dir=str(model_dir))
    res = bench.run_pair(spec, tmp_path, log=lambda s: None)
    for side in ("postrl", "trl"):
        (rec,) = res["steps"][side]
        assert rec["len_min"] == rec["len_max"] == 4
        assert rec["wall"] > 0 and rec["rss_mib"] > 0
    peaks = {"copy_bytes_per_s": 1e10, "matmul_flops": 1e10, "matmul_n": 8, "matmul_threads": 1, "copy_threads": 1,
             "copy_mib": 1}
    s = bench.summarize(res, peaks, prompt_len=5)
    assert s["sides"]["trl"]["speedup_of_postrl"] > 0
    assert "speed-up of postrl" in bench.format_tables([s], peaks)
    json.dumps(s)  # the result is plain data


def test_bench_device_cpu_hides_gpus_and_cuda_needs_one(tmp_path, monkeypatch):
    """A CPU benchmark runs both workers with CUDA hidden (else postrl's Trainer would take a GPU and TRL not);
    --device cuda on a machine without one is a one-line error, before any work."""
    seen = {}

    class FakePopen:
        def __init__(self, cmd, env=None, **kw):
            seen[json.loads(cmd[-1])["device"]] = env.get("CUDA_VISIBLE_DEVICES")

    monkeypatch.setattr(bench.subprocess, "Popen", FakePopen)
    for device in ("cpu", "cuda"):
        bench.Worker(bench.Spec(device=device), tmp_path / f"{device}.log").log.close()
    assert seen["cpu"] == ""
    assert seen["cuda"] == __import__("os").environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        with pytest.raises(PostrlError, match="--device cuda: torch sees no CUDA device"):
            bench.run(quick=True, device="cuda", out_dir=tmp_path / "never", log=lambda s: None)
        assert not (tmp_path / "never").exists()


def test_thread_policy_measures_again_early_in_a_run(monkeypatch):
    """A choice is measured at the first use, again after 2 and after 4 more uses, then only after refresh_s."""
    p = ThreadPolicy(None, hidden=32, inter=64, max_threads=2, refresh_s=1e9)
    calls = []

    def measure(phase, rows, rounds=None):
        calls.append(phase)
        p.choices[phase] = (1, 0.0)
        return 1

    monkeypatch.setattr(p, "measure", measure)
    uses = []
    for i in range(1, 21):
        before = len(calls)
        p.threads_for("update", rows=64)
        if len(calls) > before:
            uses.append(i)
    assert uses == [1, 4, 9]


def test_thread_policy_probes_the_products_the_phase_runs():
    from postrl.accel import matmul
    from postrl.models.tiny import build_model, build_tokenizer

    model = build_model(build_tokenizer(), size="nano")
    assert ThreadPolicy.for_model(model).onednn == {}
    if matmul.onednn_available():
        matmul.use_onednn(model)
        p = ThreadPolicy.for_model(model, max_threads=2)
        assert p.onednn == {"update": True, "generation": False}  # nano decodes with torch's products
        assert p.threads_for("update", rows=64) in (1, 2)


def test_thread_policy_probes_numpy_products_for_numpy_decode_steps(monkeypatch):
    """With numpy decode steps the generation probe times numpy's products with numpy's BLAS limited to each
    candidate count, and leaves numpy's BLAS thread count as it found it."""
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.accel import decoder

    model = build_model(build_tokenizer(), size="medium")  # hidden 512: generation is measured, not pinned
    assert ThreadPolicy.for_model(model).numpy == ()
    p = ThreadPolicy.for_model(model, decode="numpy", max_threads=2)
    assert p.numpy == ("generation",)
    from postrl.accel import matmul

    if matmul.onednn_available():  # layers on oneDNN: the numpy steps' products are oneDNN's, and so is the probe
        dnn = copy.deepcopy(model)
        matmul.use_onednn(dnn)
        q = ThreadPolicy.for_model(dnn, decode="numpy")
        assert q.numpy == () and q.onednn == {"update": True, "generation": True}
    ctl = decoder.blas_controller()
    calls = []

    class Spy:  # the controller, recording the limits set
        def limit(self, limits):
            calls.append(limits)
            return ctl.limit(limits=limits)

    monkeypatch.setattr(decoder, "blas_controller", Spy)
    with ctl.limit(limits=2):
        assert p.measure("generation", rows=8, rounds=1) in (1, 2)
        assert [lib["num_threads"] for lib in ctl.info()] == [2] * len(ctl.info())
    assert set(calls) == {1, 2}  # each candidate count was set for numpy's BLAS


def test_keep_freed_memory_stops_page_faults_of_training_steps():
    """A forward and backward of the 1M benchmark model page-faults thousands of times a step under glibc's
    default thresholds (freed buffers unmapped or trimmed, the next ones faulted in again); after
    postrl.accel.cpu.keep_freed_memory almost never. Run in fresh processes: the setting is process-wide."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    script = """
import resource, sys, torch
from postrl.accel.cpu import keep_freed_memory
from postrl.models.tiny import build_model, build_tokenizer
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.set_num_threads(1)
model = build_model(build_tokenizer(), size="1m", seed=0).train()
ids = torch.randint(5, 60, (8, 44), generator=torch.Generator().manual_seed(0))
def step():
    model(input_ids=ids).logits.pow(2).mean().backward()
for _ in range(3):  # warm-up: first-call allocations fault in either way
    step()
counts = []
for _ in range(10):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(sorted(counts)[len(counts) // 2])  # the median step: robust to the odd fault burst of a busy machine
"""
    # glibc's initial thresholds (128 KiB), held fixed: its dynamic mmap threshold otherwise rises in some runs and
    # not in others (median step of the default: 1 to 286 faults in six runs); keep_freed_memory's mallopt overrides
    # them
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    faults = {mode: float(subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                                         check=True, env=env).stdout.split()[-1]) for mode in ("keep", "default")}
    assert faults["keep"] < 20, faults  # measured: 0-1 a step
    assert faults["default"] > 1000, faults  # measured: 14,000-16,000 a step


def test_load_meter_counts_other_processes_and_refuses_the_ratio_under_load(tmp_path):
    """The benchmark's background load: a process spinning outside the measured tree counts as background, the same
    process inside it (a child, as a worker is) does not, and counts once; a summary measured with a busy core prints no ratio, and says why."""
    import subprocess
    import sys
    import time

    import psutil

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 30: pass"])
    try:
        time.sleep(0.3)
        c0 = psutil.Process(spin.pid).cpu_times()
        inside, outside = bench.LoadMeter([os.getpid(), spin.pid]), bench.LoadMeter([])
        inside.start()
        outside.start()
        time.sleep(1.5)
        a, b = inside.stop(), outside.stop()
        c1 = psutil.Process(spin.pid).cpu_times()
    finally:
        spin.kill()
        spin.wait()
    spun = (c1.user + c1.system - c0.user - c0.system) / a["wall_s"]  # cores the spinner used (~1 on a quiet machine)
    assert spun > 0.1
    assert b["background_cores"] - a["background_cores"] == pytest.approx(spun, abs=0.1)  # counted once, outside
    assert a["own_cores"] - b["own_cores"] == pytest.approx(spun, abs=0.1)
    quiet = {"background_cores": 0.05, "own_cores": 2.0, "machine_cores": 2.05, "wall_s": 1.0, "cpus": 2}
    busy = dict(quiet, background_cores=1.0)
    assert bench.load_verdict(quiet) is None and bench.load_verdict(None) is None
    assert "1.00 of 2 cores busy" in bench.load_verdict(busy)
    sides = {"postrl": {"threads": "1/2", "matmul": "torch", "wall": 1.0, "tok_s": 1.0, "cpu_busy": 1.0,
                        "rss_mib": 1.0, "phase_tok_s": {"generation": 1.0, "reward": 1.0, "ref": None, "update": 1.0},
                        "update_flops_per_s": 1.0, "gen_bound_tok_s": 1.0}}
    sides["trl"] = dict(sides["postrl"], speedup_of_postrl=2.5)
    peaks = {"copy_bytes_per_s": 1e10, "matmul_flops": 1e10, "matmul_n": 8, "matmul_threads": 1, "copy_threads": 1,
             "copy_mib": 1}
    base = {"size": "1m", "params": 1e6, "T": 32, "rows": 8, "epochs": 1, "sides": sides}
    assert "2.50x" in bench.format_tables([dict(base, load=quiet, refused=None)], peaks)
    table = bench.format_tables([dict(base, load=busy, refused=bench.load_verdict(busy))], peaks)
    assert "2.50x" not in table and "not printed" in table and "rerun on a quiet machine" in table


def test_the_trl_side_lives_outside_the_installed_package(monkeypatch):
    """The TRL worker patches TRL's internals: it is benchmarks/trl_side.py of the source checkout, not a module of
    postrl; without it `postrl bench` says where it is in one line."""
    import importlib.util

    from postrl.benchmark import harness
    from postrl.errors import PostrlError

    assert importlib.util.find_spec("postrl.benchmark.trl_side") is None
    assert harness.trl_side_path().name == "trl_side.py"
    monkeypatch.setenv("POSTRL_BENCH_TRL", "/nonexistent/trl_side.py")
    with pytest.raises(PostrlError, match="not part of the installed package.*POSTRL_BENCH_TRL"):
        harness.trl_side_path()
