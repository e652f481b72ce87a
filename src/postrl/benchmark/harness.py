"""``postrl bench``: postrl's Trainer against TRL's GRPOTrainer, side by side, at equal work, on CPU (default; any
GPU is hidden from both workers) or both on the GPU (``--device cuda``; each phase's time then ends in a
``torch.cuda.synchronize``).

What is compared (both sides, every setting equal):
  * the same tiny Llama built locally from a config and written with ``save_pretrained`` (fp32), loaded by each
    side from that folder;
  * the same prompts (the ``arithmetic`` task's ``train_rows(step, P, seed)``), ``P`` prompts x ``G`` completions
    per step, ``max_new_tokens = T``, temperature 1, no top-k/top-p, KV cache on;
  * the same reward functions (:func:`digit_fraction` and ``correct``, weights 1 and 0.2), group-normalised
    advantages with eps 1e-4 (TRL ``scale_rewards='group'``);
  * the same loss: PPO-clip, eps 0.2, token-mean over the step's batch (TRL ``loss_type='dapo'``), no KL
    (``beta=0`` / ``kl.coef=0``), ``E`` optimisation epochs (TRL ``num_iterations``), one optimizer step per
    epoch, the whole batch in one forward/backward (TRL ``per_device_train_batch_size = P*G``, no gradient
    accumulation);
  * AdamW, the same learning rate, betas, eps, no weight decay, constant schedule, grad-norm clip 1.0.
  * TRL's ``gradient_checkpointing`` (on by default in GRPOConfig) is turned off: postrl does not recompute
    activations, so leaving it on would make TRL do more work.
  * Equal completion lengths: EOS does not stop generation on either side (postrl: ``rollout.ignore_eos=true``;
    TRL: ``eos_token_id=None`` in its generation config and no EOS cut in its completion mask), so
    every completion has exactly ``T`` tokens on both sides and both train on all of them. Each step checks it.

How it is run: each side lives in its own worker subprocess (``python -m postrl.benchmark worker ...``) that holds
its trainer; the parent tells the two workers to take one step each in turn (A B A B ...), so both see the same
machine load, and a per-step ratio is robust to load that changes over minutes. The first ``WARMUP_STEPS`` steps
of each side are a warm-up and are not counted.

Reported per side: wall time per step, completion tokens/s end to end and per phase (generation, reward,
old/ref log-probs, update = the rest of the step), peak RSS of the worker; the speed-up
(TRL time / postrl time = postrl tok/s / TRL tok/s). Next to them: the update's achieved FLOP/s against a fp32
matmul peak measured in the same run, and generation tokens/s against the bound set by memory bandwidth
(measured with a large tensor copy) for reading the weights and KV cache once per decode step.

TRL is an optional dependency (``pip install 'postrl[bench]'``), imported only inside its worker.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from postrl.errors import PostrlError

SIDES = ("postrl", "trl")
REWARD_WEIGHTS = (1.0, 0.2)
# Steps per side not counted: set-up that a long run amortises. postrl's thread policy (postrl.accel.cpu) measures each
# phase at its first use and again after 2 and 4 more uses (a few ms each time); TRL's first steps build its caches.
WARMUP_STEPS = 6
REWARDS_OVERRIDE = (f"rewards=[{{name: 'postrl.benchmark.harness:digit_fraction', weight: {REWARD_WEIGHTS[0]}}}, "
                    f"{{name: 'postrl.benchmark.harness:correct_reward', weight: {REWARD_WEIGHTS[1]}}}]")


# ------------------------------------------------------------------------------------------------ rewards
def digit_fraction(prompts, completions, **_):
    """Fraction of the completion's characters that are digits (a cheap reward with variance on any model)."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def correct_reward(prompts, completions, answer=None, task=None, **_):
    """postrl's ``correct`` (the task verifier), with only the columns it needs (TRL passes many kwargs)."""
    # lazy: the CLI's parser and the TRL side's worker import this module without postrl's torch code
    from postrl.rewards.builtin import correct

    return correct(prompts, completions, task=task, answer=answer)


# ------------------------------------------------------------------------------------------------ spec
@dataclass
class Spec:
    """One benchmark configuration; every field applies to both sides."""

    size: str = "1m"
    max_new_tokens: int = 32
    prompts: int = 4
    group_size: int = 8
    epochs: int = 1
    lr: float = 1e-5
    steps: int = 3  # measured steps per side
    warmup: int = 1  # steps per side not counted
    seed: int = 0
    threads: int | None = None  # torch intra-op threads for this side (None: the side's own default)
    device: str = "cpu"  # "cpu": both sides on the CPU (CUDA hidden from the workers); "cuda": both on the GPU
    model_dir: str = ""
    work_dir: str = ""
    side: str = "postrl"
    overrides: tuple[str, ...] = ()  # postrl side: config overrides of this variant (``--also postrl:KEY=VALUE,...``)

    @property
    def rows(self) -> int:
        return self.prompts * self.group_size

    @property
    def total_steps(self) -> int:
        return self.steps + self.warmup


# ------------------------------------------------------------------------------------------------ machine limits
def measure_peaks(quick: bool = False) -> dict:
    """fp32 matmul FLOP/s (square ``n x n`` matmul) and memory bandwidth (copy of a large tensor: read + write).

    Each is the best of several repetitions on 1 thread and on torch's default thread count (a peak: on a machine
    shared with other jobs the full count can be the slower one); the count that reached it is reported. The
    matmul runs through torch's default library (MKL) and through oneDNN (``postrl.accel.matmul``), and the peak is
    the faster of the two (``matmul_lib``): on AMD CPUs with AVX-512 MKL reaches about half of oneDNN's rate.
    """
    import torch

    # lazy: the CLI's parser and the TRL side's worker import this module without postrl's torch code
    from postrl.accel import matmul as mm_lib

    old = torch.get_num_threads()
    n = 1024 if quick else 2048
    numel = (32 if quick else 64) * 2**20  # 128 / 256 MiB of fp32, far beyond the caches
    reps = 3 if quick else 5
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    x = torch.ones(numel)
    y = torch.empty_like(x)
    bt = b.t().contiguous()  # oneDNN's linear takes the second factor as [N, K]
    libs = {"torch": lambda: torch.matmul(a, b, out=c)}
    if mm_lib.onednn_available():
        libs["onednn"] = lambda: mm_lib._mm(a, bt)
    flops: dict[tuple[int, str], float] = {}
    bw: dict[int, float] = {}
    try:
        for threads in sorted({1, old}):
            torch.set_num_threads(threads)
            y.copy_(x)
            best_cp = math.inf
            for lib, fn in libs.items():
                fn()
                best_mm = math.inf
                for _ in range(reps):
                    t = time.perf_counter()
                    fn()
                    best_mm = min(best_mm, time.perf_counter() - t)
                flops[threads, lib] = 2.0 * n**3 / best_mm
            for _ in range(reps):
                t = time.perf_counter()
                y.copy_(x)
                best_cp = min(best_cp, time.perf_counter() - t)
            bw[threads] = 2.0 * numel * 4 / best_cp
    finally:
        torch.set_num_threads(old)
    (tf, lib), tb = max(flops, key=flops.get), max(bw, key=bw.get)
    return {"matmul_flops": flops[tf, lib], "matmul_n": n, "matmul_threads": tf, "matmul_lib": lib,
            "matmul_by_lib": {k: max(v for (_, l2), v in flops.items() if l2 == k) for k in libs},
            "copy_bytes_per_s": bw[tb], "copy_threads": tb, "copy_mib": numel * 4 / 2**20, "threads": tf,
            "by_threads": {str(k): {"matmul_flops": max(v for (t2, _), v in flops.items() if t2 == k),
                                    "copy_bytes_per_s": bw[k]} for k in bw}}


def measure_peaks_cuda(quick: bool = False) -> dict:
    """As :func:`measure_peaks`, on the GPU: fp32 matmul (TF32 off, as both sides train) and a device copy."""
    import torch

    n = 4096 if quick else 8192
    numel = 256 * 2**20  # 1 GiB of fp32
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    x = torch.ones(numel, device="cuda")
    y = torch.empty_like(x)

    def best(fn, reps=5) -> float:
        fn()
        torch.cuda.synchronize()
        out = math.inf
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out = min(out, time.perf_counter() - t)
        return out

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        flops = 2.0 * n**3 / best(lambda: torch.mm(a, b))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    bw = 2.0 * numel * 4 / best(lambda: y.copy_(x))
    a = b = x = y = None  # (free the GPU memory before empty_cache)
    torch.cuda.empty_cache()
    return {"device": "cuda", "gpu": torch.cuda.get_device_name(), "matmul_flops": flops, "matmul_n": n,
            "matmul_threads": 0, "matmul_lib": "cuda", "matmul_by_lib": {"cuda": flops}, "copy_bytes_per_s": bw,
            "copy_threads": 0, "copy_mib": numel * 4 / 2**20, "threads": 0, "by_threads": {}}


def model_shape(model_dir: str | Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, L, inter, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    layer = h * (cfg["num_attention_heads"] * hd) * 2 + h * kv * hd * 2 + 3 * h * inter  # q,o + k,v + mlp
    return {"hidden": h, "layers": L, "inter": inter, "vocab": V, "layer_linear": layer, "kv_dim": kv * hd,
            "params": L * layer + V * h * (1 if cfg.get("tie_word_embeddings", True) else 2) + (2 * L + 1) * h}


def update_flops(shape: dict, rows: int, prompt_len: int, T: int, epochs: int) -> float:
    """Model FLOPs of the update: forward + backward (3x forward) per epoch, counting the linear layers on every
    position, the LM head on the T completion positions and causal attention (QK^T and AV) once per pair."""
    S = prompt_len + T
    fwd = 2.0 * rows * S * shape["layers"] * shape["layer_linear"]
    fwd += 2.0 * rows * T * shape["vocab"] * shape["hidden"]
    fwd += 2.0 * 2.0 * rows * shape["layers"] * shape["hidden"] * S * (S + 1) / 2
    return 3.0 * fwd * epochs


def generation_bound(shape: dict, rows: int, prompt_len: int, T: int, bandwidth: float) -> float:
    """Completion tokens/s if every decode step only had to read the weights and the KV cache once from memory."""
    weight_bytes = 4.0 * shape["params"]
    total = 0.0
    for t in range(T):
        kv = 4.0 * rows * shape["layers"] * 2 * shape["kv_dim"] * (prompt_len + t)
        total += (weight_bytes + kv) / bandwidth
    return rows * T / total


# ------------------------------------------------------------------------------------------------ model
def build_bench_model(path: str | Path, size: str, seed: int = 0) -> Path:
    # lazy: the CLI's parser and the TRL side's worker import this module without postrl's torch code
    from postrl.models.tiny import build_local

    path = Path(path)
    if not (path / "config.json").is_file():
        build_local(path, size=size, seed=seed)
    return path


# ------------------------------------------------------------------------------------------------ background load
# A ratio is printed only when the rest of the machine used less than this many cores on average while the measured
# steps ran. With one core busy in the background, TRL's two OpenMP threads stall at every barrier while postrl's
# thread policy drops to one thread: the quick ratio then read 17-20x instead of ~2.3x, a number nobody could
# reproduce on a quiet machine.
MAX_BACKGROUND_CORES = 0.25


def _machine_busy_s() -> float:
    """CPU seconds every process of the machine has used so far (all cores; idle and I/O wait excluded, time stolen
    by the hypervisor for other guests included)."""
    import psutil

    t = psutil.cpu_times()
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def _tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the live processes ``pids`` and all their descendants have used so far, each
    process counted once."""
    import psutil

    procs: dict[int, Any] = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs.update((p.pid, p) for p in (proc, *proc.children(recursive=True)))
        except psutil.Error:
            continue
    total = 0.0
    for p in procs.values():
        try:
            c = p.cpu_times()
        except psutil.Error:
            continue
        total += c.user + c.system
    return total


class LoadMeter:
    """The CPU the rest of the machine uses while the benchmark runs: machine-wide busy seconds (``psutil.cpu_times``,
    i.e. /proc/stat) minus those of the benchmark's own processes (``pids`` and their descendants: the parent, its
    workers and their children), per wall second: the average number of cores other processes kept busy."""

    def __init__(self, pids: list[int]):
        self.pids = list(pids)
        self.t0 = self.busy0 = self.own0 = None

    def start(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _machine_busy_s(), _tree_cpu_s(self.pids)

    def stop(self) -> dict:
        # lazy: the CLI's parser and the TRL side's worker import this module without postrl's torch code
        from postrl.accel.cpu import usable_cores

        wall = time.perf_counter() - self.t0
        busy, own = _machine_busy_s() - self.busy0, _tree_cpu_s(self.pids) - self.own0
        return {"wall_s": wall, "machine_cores": busy / wall, "own_cores": own / wall,
                "background_cores": max(0.0, busy - own) / wall, "cpus": usable_cores()}


def load_verdict(load: dict | None) -> str | None:
    """Why a ratio measured under ``load`` (:meth:`LoadMeter.stop`) is not printed; None when it is."""
    if load is None or load["background_cores"] < MAX_BACKGROUND_CORES:
        return None
    return (f"other processes kept {load['background_cores']:.2f} of {load['cpus']} cores busy during the measured "
            f"steps (limit {MAX_BACKGROUND_CORES}): the sides' thread policies react differently to a busy machine, "
            f"so the ratio would not be reproducible; rerun on a quiet machine")


# ------------------------------------------------------------------------------------------------ workers
def _children() -> list:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:  # pragma: no cover - a child exiting while listed
        return []


def _peak_rss_kib(pid: int) -> float:
    """A live process's peak resident set (VmHWM of /proc/PID/status), in KiB; 0 where not readable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


class _Proto:
    """The worker's channel to the parent: commands on stdin, JSON replies on the original stdout.

    Anything else the libraries print goes to stderr, so it cannot corrupt the replies."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self.children: list = []

    def send(self, msg: dict) -> None:
        # peak RSS of this process plus that of its child processes (any a side starts; shared pages count twice:
        # an upper bound)
        msg["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 + sum(
            _peak_rss_kib(c.pid) for c in self.children) / 1024.0
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    def cpu_s(self) -> float:
        """CPU seconds (user + system, all threads) this process and its child processes (listed once by
        :meth:`find_children`) have used so far."""
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime + sum(t.user + t.system for t in (c.cpu_times() for c in self.children))

    def find_children(self) -> None:
        """List the live child processes (after the set-up; listing them scans every process of the machine)."""
        self.children = _children()

    @staticmethod
    def recv() -> str:
        line = sys.stdin.readline()
        return line.strip() or "quit"


def _bench_rows(spec: Spec, steps: int) -> list[dict]:
    # lazy: the CLI's parser and the TRL side's worker import this module without postrl's torch code
    from postrl.data import load_source

    src = load_source({"name": "arithmetic"})
    return [r for s in range(steps) for r in src.train_rows(s, spec.prompts, spec.seed)]


def _sync(spec: Spec) -> None:
    """On the GPU, wait for queued kernels, so that a phase's time is its own (postrl's phases end in host copies)."""
    if spec.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _policy_threads(policy) -> str:
    """``"generation/update"`` thread counts of a ThreadPolicy (as chosen for the last step)."""
    ch = policy.choices
    only = policy.max_threads if len(policy.candidates()) == 1 else "?"
    return "/".join(str(ch[k][0] if k in ch else (policy.fixed or policy.pinned.get(k) or only))
                    for k in ("generation", "update"))


def _postrl_worker(spec: Spec, proto: _Proto) -> None:
    import torch

    # lazy: the CLI's parser and the TRL side's worker import this module without postrl's torch code
    from postrl.config import load_config
    from postrl.train.trainer import Trainer

    t0 = time.perf_counter()
    overrides = [
        f"model.path={spec.model_dir}", f"output_dir={spec.work_dir}", f"seed={spec.seed}",
        "task.name=arithmetic", "model.chat_template=none",
        REWARDS_OVERRIDE,
        f"rollout.group_size={spec.group_size}", f"rollout.max_new_tokens={spec.max_new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0", "rollout.ignore_eos=true",
        f"train.prompts_per_step={spec.prompts}", f"train.micro_batch_size={spec.rows}",
        f"train.epochs={spec.epochs}", "train.mini_batches=1", f"train.steps={spec.total_steps}",
        "train.save_every=0", "train.samples_every=1000000", "diagnostics.edge_of_stability.every=0",
        "advantage.name=grpo", "advantage.scale=group", "advantage.eps=1e-4",
        "loss.name=ppo_clip", "loss.eps_low=0.2", "loss.eps_high=0.2", "loss.agg=token_mean", "kl.coef=0.0",
        f"optim.lr={spec.lr}", "optim.weight_decay=0.0", "optim.warmup_steps=0", "optim.schedule=constant",
        "optim.max_grad_norm=1.0",
    ]
    overrides += list(spec.overrides)
    if spec.threads:
        overrides.append(f"accel.threads={spec.threads}")
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg, spec.work_dir)
    proto.find_children()
    proto.send({"ready": True, "init_s": time.perf_counter() - t0, "threads": torch.get_num_threads()})
    step = 0
    while proto.recv() == "step":
        c = proto.cpu_s()
        t = time.perf_counter()
        m = trainer.train_step(step)
        _sync(spec)
        wall, cpu = time.perf_counter() - t, proto.cpu_s() - c
        step += 1
        threads = spec.threads or _policy_threads(trainer.accel.threads)
        proto.send({"wall": wall, "generation": m["time/generation"], "reward": m["time/reward"],
                    "ref": m["time/ref"], "len_min": m["length/min"], "len_max": m["length/max"],
                    "loss": m.get("pg_loss"), "threads": threads, "cpu_s": cpu, "matmul": trainer.accel.matmul})


TRL_SIDE = "benchmarks/trl_side.py"
"""The TRL side of the benchmark (it patches TRL's internals to time its phases and to run at equal work), kept out of
the installed package: it runs from a source checkout of postrl (or from the file ``$POSTRL_BENCH_TRL`` names)."""


def trl_side_path() -> Path:
    """The TRL side's file: ``$POSTRL_BENCH_TRL``, else ``benchmarks/trl_side.py`` of the source checkout this package
    runs from; a one-line error when neither exists."""
    env = os.environ.get("POSTRL_BENCH_TRL")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / TRL_SIDE
    if not path.is_file():
        raise PostrlError(f"postrl bench: the TRL side ({TRL_SIDE}, which patches TRL's internals) is not part of the "
                          f"installed package; run postrl bench from a source checkout of postrl, or set "
                          f"POSTRL_BENCH_TRL to that file (looked for {path})")
    return path


def _trl_worker(spec: Spec, proto: _Proto) -> None:
    import importlib.util

    path = trl_side_path()
    mod_spec = importlib.util.spec_from_file_location("postrl_bench_trl_side", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    module.trl_worker(spec, proto)


def worker_main(argv: list[str]) -> int:
    spec = Spec(**json.loads(argv[0]))
    proto = _Proto()
    try:
        (_postrl_worker if spec.side == "postrl" else _trl_worker)(spec, proto)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        import traceback

        traceback.print_exc()
        proto.send({"error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


class Worker:
    """A side's worker subprocess; ``step()`` runs one training step there and returns its measurements."""

    def __init__(self, spec: Spec, log_path: Path, env: dict | None = None):
        self.spec = spec
        self.log = open(log_path, "w")
        # CPU runs hide any GPU from both sides: postrl's Trainer would otherwise take it and TRL would not
        hide = {"CUDA_VISIBLE_DEVICES": ""} if spec.device == "cpu" else {}
        # Both sides in the same environment, the postrl command's (GOMP_SPINCOUNT=10000 unless set,
        # postrl.cli.quiet_openmp_spin): with libgomp's default spin, a side's idle OpenMP threads spin for ~7 ms into
        # the other side's step (TRL's generation took 53 instead of 45 ms after postrl's update)
        self.proc = subprocess.Popen([sys.executable, "-m", "postrl.benchmark", "worker", json.dumps(asdict(spec))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **hide, **(env or {})})
        self.ready: dict | None = None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise PostrlError(f"bench: the {self.spec.side} worker exited (status {self.proc.returncode}); "
                              f"see {self.log.name}")
        msg = json.loads(line)
        if "error" in msg:
            raise PostrlError(f"bench: {self.spec.side} worker: {msg['error']} (log: {self.log.name})")
        return msg

    def wait_ready(self) -> dict:
        if self.ready is None:
            self.ready = self._read()
        return self.ready

    def step(self) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.log.close()


def run_pair(spec: Spec, root: Path, variants: dict[str, dict] | None = None,
             log: Any = print) -> dict:
    """Run the sides of ``spec`` alternately, one step each in turn; returns per-side step records.

    ``variants``: name -> Spec field overrides (default: postrl and trl with their own defaults).
    """
    variants = variants or {"postrl": {"side": "postrl"}, "trl": {"side": "trl"}}
    workers: dict[str, Worker] = {}
    try:
        for name, over in variants.items():
            wdir = root / name
            wdir.mkdir(parents=True, exist_ok=True)
            s = replace(spec, work_dir=str(wdir), **over)
            workers[name] = Worker(s, root / f"{name}.log")
        ready = {name: w.wait_ready() for name, w in workers.items()}
        steps: dict[str, list[dict]] = {name: [] for name in workers}
        meter = LoadMeter([os.getpid()]) if spec.device == "cpu" else None  # this process and the workers
        load = None
        for i in range(spec.total_steps):
            if i == spec.warmup and meter is not None:
                meter.start()
            for name, w in workers.items():
                rec = w.step()
                n = spec.max_new_tokens
                if not (rec["len_min"] == rec["len_max"] == n):
                    raise PostrlError(f"bench: {name} step {i}: completion lengths {rec['len_min']}..{rec['len_max']}"
                                      f", expected all {n} (equal work)")
                rec["warmup"] = i < spec.warmup
                steps[name].append(rec)
                log(f"  {name:<12} step {i + 1}/{spec.total_steps}  {rec['wall']:.2f}s"
                    + ("  (warm-up)" if rec["warmup"] else ""))
        if meter is not None and meter.t0 is not None:
            load = meter.stop()
    finally:
        for w in workers.values():
            w.close()
    return {"spec": asdict(spec), "ready": ready, "steps": steps, "load": load}


# ------------------------------------------------------------------------------------------------ summary
def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(result: dict, peaks: dict, prompt_len: int) -> dict:
    spec = result["spec"]
    shape = model_shape(spec["model_dir"])
    rows, T, E = spec["prompts"] * spec["group_size"], spec["max_new_tokens"], spec["epochs"]
    tokens = rows * T
    out: dict[str, Any] = {"size": spec["size"], "params": shape["params"], "T": T, "rows": rows, "epochs": E,
                           "sides": {}, "load": result.get("load"), "refused": load_verdict(result.get("load"))}
    for name, recs in result["steps"].items():
        meas = [r for r in recs if not r["warmup"]]
        wall = _median([r["wall"] for r in meas])
        ph = {k: _median([r[k] for r in meas]) for k in ("generation", "reward", "ref")}
        ph["update"] = _median([r["wall"] - r["generation"] - r["reward"] - r["ref"] for r in meas])
        fl = update_flops(shape, rows, prompt_len, T, E)
        out["sides"][name] = {
            "wall": wall, "walls": [r["wall"] for r in meas], "tok_s": tokens / wall,
            "phases": ph, "phase_tok_s": {k: (tokens / v if v > 0 else None) for k, v in ph.items()},
            "rss_mib": max(r["rss_mib"] for r in recs), "threads": meas[-1]["threads"] if meas else None,
            "matmul": meas[-1].get("matmul", "torch") if meas else None,
            "cpu_busy": _median([r["cpu_s"] / r["wall"] for r in meas]),
            "update_flops": fl, "update_flops_per_s": fl / ph["update"] if ph["update"] > 0 else None,
            "gen_bound_tok_s": generation_bound(shape, rows, prompt_len, T, peaks["copy_bytes_per_s"]),
        }
    if "postrl" in out["sides"]:
        p = result["steps"]["postrl"]
        for name in out["sides"]:
            if name == "postrl":
                continue
            o = result["steps"][name]
            pairs = [b["wall"] / a["wall"] for a, b in zip(p, o) if not a["warmup"]]
            out["sides"][name]["speedup_of_postrl"] = _median(pairs)
            out["sides"][name]["speedup_pairs"] = pairs
    return out


def _fmt_s(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def format_tables(summaries: list[dict], peaks: dict) -> str:
    lines = []
    lines.append("| model | T | side | threads (gen/update) | matmul | s/step | tok/s | gen tok/s | reward tok/s "
                 "| ref tok/s | update tok/s | CPU busy | peak RSS MiB | speed-up of postrl |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        for name, d in s["sides"].items():
            pt = d["phase_tok_s"]

            def f(v):
                return "-" if v is None else f"{v:,.0f}"
            sp = d.get("speedup_of_postrl")
            cell = "" if sp is None else "not printed (load)" if s.get("refused") else f"{sp:.2f}x"
            lines.append(f"| {s['size']} ({s['params'] / 1e6:.2f}M) | {s['T']} | {name} | {d['threads']} "
                         f"| {d.get('matmul') or '-'} | {_fmt_s(d['wall'])} | {d['tok_s']:,.0f} | {f(pt['generation'])} | {f(pt['reward'])} "
                         f"| {f(pt['ref']) if s['epochs'] > 1 else '-'} | {f(pt['update'])} | {d['cpu_busy']:.2f} "
                         f"| {d['rss_mib']:.0f} "
                         f"| {cell} |")
    for s in summaries:
        load = s.get("load")
        if load is not None:
            lines.append("")
            lines.append(f"{s['size']} T={s['T']}: background load during the measured steps "
                         f"{load['background_cores']:.2f} cores of {load['cpus']} (the benchmark itself "
                         f"{load['own_cores']:.2f})" + (f"; ratio not printed: {s['refused']}" if s.get("refused")
                                                         else ""))
    lines.append("")
    by_lib = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.get("matmul_by_lib", {}).items())
    if peaks.get("device") == "cuda":
        lines.append(f"Limits measured in this run on the GPU ({peaks['gpu']}): fp32 matmul (TF32 off) "
                     f"{peaks['matmul_flops'] / 1e12:.1f} TFLOP/s ({peaks['matmul_n']}^2), memory bandwidth "
                     f"{peaks['copy_bytes_per_s'] / 1e9:,.0f} GB/s (copy of {peaks['copy_mib']:.0f} MiB, read + write); "
                     "best of repeated runs. (*CPU busy*: host CPU seconds per wall second.)")
    else:
        lines.append(f"Limits measured in this run: fp32 matmul {peaks['matmul_flops'] / 1e9:.1f} GFLOP/s "
                     f"({peaks['matmul_n']}^2, {peaks.get('matmul_lib', 'torch')}, {peaks['matmul_threads']} "
                     f"thread(s); by library: {by_lib}), memory bandwidth {peaks['copy_bytes_per_s'] / 1e9:.1f} GB/s "
                     f"(copy of {peaks['copy_mib']:.0f} MiB, read + write, {peaks['copy_threads']} thread(s)); best "
                     "of repeated runs on 1 thread and on all threads.")
    lines.append("")
    lines.append("| model | T | side | update GFLOP/s | % of matmul peak | gen tok/s | bandwidth bound tok/s | % of bound |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for s in summaries:
        for name, d in s["sides"].items():
            uf = d["update_flops_per_s"]
            g = d["phase_tok_s"]["generation"]
            lines.append(f"| {s['size']} | {s['T']} | {name} | {uf / 1e9:.2f} | {100 * uf / peaks['matmul_flops']:.0f}% "
                         f"| {g:,.0f} | {d['gen_bound_tok_s']:,.0f} | {100 * g / d['gen_bound_tok_s']:.1f}% |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ scaling
def _scaling_point(spec: Spec, root: Path, procs: int, log: Any) -> dict:
    """postrl alone: run ``spec.total_steps`` steps in a fresh process tree (torchrun for more than one)."""
    root.mkdir(parents=True, exist_ok=True)
    s = replace(spec, side="postrl", work_dir=str(root))
    out = root / "steps.json"
    if procs == 1:
        cmd = [sys.executable, "-m", "postrl.benchmark", "run-steps", json.dumps(asdict(s)), str(out)]
    else:
        import socket

        with socket.socket() as sock:  # a free port for the process group
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # torch.distributed.run (torchrun): what `accelerate launch --cpu --num_processes N -m postrl train` ends
        # up running (postrl.launch); each worker is DDP over gloo with OMP_NUM_THREADS=1.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_addr",
               "127.0.0.1", "--master_port", str(port), "-m", "postrl.benchmark", "run-steps", json.dumps(asdict(s)),
               str(out)]
    with open(root / "log.txt", "w") as f:  # on the CPU, as the tables it extends
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if r.returncode != 0:
        raise PostrlError(f"bench: scaling run failed (status {r.returncode}); see {root / 'log.txt'}")
    recs = json.loads(out.read_text())
    meas = recs[spec.warmup:]
    if any(not (x["len_min"] == x["len_max"] == spec.max_new_tokens) for x in recs) or recs[-1]["processes"] != procs:
        raise PostrlError(f"bench: scaling run in {root} did not run {procs} process(es) at equal lengths")
    return {"procs": procs, "wall": _median([x["wall"] for x in meas]), "walls": [x["wall"] for x in meas],
            "threads": recs[-1]["threads"]}


def run_steps_main(argv: list[str]) -> int:
    """``python -m postrl.benchmark run-steps SPEC OUT``: postrl only, no parent protocol; rank 0 writes OUT."""
    # lazy: the CLI's parser and the TRL side's worker import this module without postrl's torch code
    from postrl.config import load_config
    from postrl.train.trainer import Trainer

    spec = Spec(**json.loads(argv[0]))
    overrides = [
        f"model.path={spec.model_dir}", f"output_dir={spec.work_dir}", f"seed={spec.seed}", "model.chat_template=none",
        REWARDS_OVERRIDE,
        f"rollout.group_size={spec.group_size}", f"rollout.max_new_tokens={spec.max_new_tokens}",
        "rollout.ignore_eos=true",
        f"train.prompts_per_step={spec.prompts}", f"train.micro_batch_size={spec.rows}",
        f"train.epochs={spec.epochs}", f"train.steps={spec.total_steps}", "train.save_every=0",
        "train.samples_every=1000000", "diagnostics.edge_of_stability.every=0", "advantage.eps=1e-4", "kl.coef=0.0",
        f"optim.lr={spec.lr}",
    ]
    if spec.threads:
        overrides.append(f"accel.threads={spec.threads}")
    trainer = Trainer(load_config(None, overrides), spec.work_dir)
    recs = []
    for step in range(spec.total_steps):
        t = time.perf_counter()
        m = trainer.train_step(step)
        threads = spec.threads or _policy_threads(trainer.accel.threads)
        recs.append({"wall": time.perf_counter() - t, "threads": threads, "len_min": m["length/min"],
                     "len_max": m["length/max"], "processes": trainer.world})
    if trainer.main:
        Path(argv[1]).write_text(json.dumps(recs))
    return 0


def run_scaling(base: Spec, root: Path, quick: bool, log: Any = print) -> list[dict]:
    """Step time of postrl as one factor changes at a time from ``base``."""
    rows = []
    grid: list[tuple[str, Any, dict]] = []
    for g in ((4, 8) if quick else (4, 8, 16)):
        grid.append(("group size", g, {"group_size": g}))
    for t in ((32, 64) if quick else (32, 64, 128, 256)):
        grid.append(("completion length", t, {"max_new_tokens": t}))
    for sz in (("nano", "1m") if quick else ("nano", "1m", "small", "20m")):
        grid.append(("model size", sz, {"size": sz}))
    for factor, value, over in grid:
        s = replace(base, **over)
        s = replace(s, model_dir=str(build_bench_model(root / "models" / s.size, s.size, s.seed)))
        log(f"scaling: {factor} = {value}")
        p = _scaling_point(s, root / f"{factor.replace(' ', '_')}-{value}", 1, log)
        rows.append({"factor": factor, "value": value, **p, "tokens": s.rows * s.max_new_tokens})
    s = replace(base, model_dir=str(build_bench_model(root / "models" / base.size, base.size, base.seed)))
    for procs in (1, 2):
        log(f"scaling: processes = {procs}")
        p = _scaling_point(s, root / f"procs-{procs}", procs, log)
        rows.append({"factor": "processes", "value": procs, **p, "tokens": s.rows * s.max_new_tokens})
    return rows


def format_scaling(rows: list[dict], base: Spec) -> str:
    lines = [f"Base: model {base.size}, {base.prompts} prompts x G={base.group_size}, T={base.max_new_tokens}, "
             f"{base.epochs} epoch(s); one factor changed at a time.", "",
             "| factor | value | s/step | completion tok/s | threads per process (gen/update) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['factor']} | {r['value']} | {_fmt_s(r['wall'])} | {r['tokens'] / r['wall']:,.0f} "
                     f"| {r['threads']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ entry point
def machine_info(device: str = "cpu") -> dict:
    model = platform.processor() or ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model = info.get("Model name", model).strip()
        cpus = info.get("CPU(s)", "").strip()
    except OSError:
        cpus = str(os.cpu_count())
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    import torch

    info = {"cpu": model, "cpus": cpus, "loadavg": load, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "python": platform.python_version()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def parse_variant(name: str) -> dict:
    """``SIDE``, ``SIDE@THREADS`` or ``postrl:KEY=VALUE,KEY=VALUE`` (postrl with config overrides) as the Spec
    fields of a variant."""
    if name.startswith("postrl:"):
        items = tuple(x for x in name[len("postrl:"):].split(",") if x)
        if not items or not all("=" in x for x in items):
            raise PostrlError(f"bench --also '{name}': expected postrl:KEY=VALUE[,KEY=VALUE...]")
        return {"side": "postrl", "overrides": items}
    side, _, n = name.partition("@")
    if side not in SIDES or (n and not n.isdigit()):
        raise PostrlError(f"bench --also '{name}': expected SIDE, SIDE@THREADS with SIDE in {', '.join(SIDES)}, "
                          f"or postrl:KEY=VALUE,...")
    return {"side": side, "threads": int(n) if n else None}


def run(quick: bool = False, sizes: list[str] | None = None, lengths: list[int] | None = None,
        prompts: int | None = None, group_size: int | None = None, steps: int | None = None, epochs: int = 1,
        lr: float = 1e-5, scaling: bool | None = None, also: list[str] | None = None,
        out_dir: str | Path | None = None, device: str = "cpu", log: Any = print) -> dict:
    sizes = sizes or (["1m"] if quick else ["1m", "20m"])
    lengths = lengths or ([32] if quick else [32, 256])
    base = Spec(prompts=prompts or (2 if quick else 4), group_size=group_size or (4 if quick else 8),
                steps=steps or (8 if quick else 3), warmup=WARMUP_STEPS, epochs=epochs, lr=lr, device=device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise PostrlError("bench --device cuda: torch sees no CUDA device")
    scaling = (not quick and device == "cpu") if scaling is None else scaling
    root = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="postrl-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    info = machine_info(device)
    log(f"postrl bench ({'quick' if quick else 'full'}, {device}): {info['cpu']}, {info['cpus']} CPUs"
        f"{', ' + info['gpu'] if device == 'cuda' else ''}, load {info['loadavg'][0]:.1f}; work dir {root}")
    measure = measure_peaks_cuda if device == "cuda" else measure_peaks
    peaks = measure(quick)
    log(f"matmul peak {peaks['matmul_flops'] / 1e9:.1f} GFLOP/s, copy bandwidth {peaks['copy_bytes_per_s'] / 1e9:.1f} GB/s")
    variants = {"postrl": {"side": "postrl"}, "trl": {"side": "trl"}}
    for name in also or []:  # e.g. trl@1: TRL with 1 torch thread; postrl:accel.mode=off: postrl with overrides
        variants[name] = parse_variant(name)
    summaries = []
    # lazy: the CLI's parser and the TRL side's worker import this module without postrl's torch code
    from postrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    for size in sizes:
        mdir = build_bench_model(root / "models" / size, size, base.seed)
        for T in lengths:
            spec = replace(base, size=size, max_new_tokens=T, model_dir=str(mdir))
            rows = _bench_rows(spec, 1)
            plen = max(len(tok(r["prompt"])["input_ids"]) for r in rows)
            log(f"{size} T={T}: {spec.prompts} prompts x {spec.group_size} completions, {spec.epochs} epoch(s)")
            res = run_pair(spec, root / f"{size}-T{T}", variants, log=log)
            summaries.append(summarize(res, peaks, plen))
            sp = summaries[-1]["sides"]["trl"]["speedup_of_postrl"]
            why = summaries[-1]["refused"]
            log(f"  -> speed-up of postrl over TRL: {sp:.2f}x" if why is None else f"  -> no ratio: {why}")
    end = peaks if quick else measure(quick)  # the load may have changed: keep the better of the two
    start = peaks
    mm = max(start, end, key=lambda p: p["matmul_flops"])
    cp = max(start, end, key=lambda p: p["copy_bytes_per_s"])
    peaks = {**start, "matmul_flops": mm["matmul_flops"], "matmul_threads": mm["matmul_threads"],
             "matmul_lib": mm.get("matmul_lib", "torch"), "copy_bytes_per_s": cp["copy_bytes_per_s"], "copy_threads": cp["copy_threads"], "start": start,
             "end": end}
    for s in summaries:
        for d in s["sides"].values():
            d["gen_bound_tok_s"] *= peaks["copy_bytes_per_s"] / peaks["start"]["copy_bytes_per_s"]
    result = {"machine": info, "peaks": peaks, "quick": quick, "device": device, "summaries": summaries,
              "tables": format_tables(summaries, peaks)}
    if scaling:
        base_s = replace(base, size=sizes[0], max_new_tokens=64 if not quick else 32)
        result["scaling"] = run_scaling(base_s, root / "scaling", quick, log=log)
        result["scaling_table"] = format_scaling(result["scaling"], base_s)
    (root / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def cmd_bench(args) -> int:
    try:
        import trl  # noqa: F401
    except ImportError:
        raise PostrlError("postrl bench compares with TRL's GRPOTrainer: pip install 'postrl[bench]'") from None
    res = run(quick=args.quick, sizes=args.sizes, lengths=args.lengths, prompts=args.prompts,
              group_size=args.group_size, steps=args.steps, epochs=args.epochs, lr=args.lr,
              scaling=False if args.no_scaling else None, also=args.also, out_dir=args.out, device=args.device)
    m = res["machine"]
    gpu = f"; GPU {m['gpu']}" if "gpu" in m else ""
    text = [f"# postrl bench ({'quick' if res['quick'] else 'full'}, {res['device']})", "",
            f"{m['date']}; {m['cpu']}, {m['cpus']} CPUs{gpu}; load average at start {m['loadavg'][0]:.1f}; "
            f"torch {m['torch']}.", "", res["tables"]]
    if "scaling_table" in res:
        text += ["", "## Scaling (postrl)", "", res["scaling_table"]]
    print("\n".join(text))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(text) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


def add_parser(sub) -> None:
    """The ``postrl bench`` sub-command (registered by :mod:`postrl.cli`)."""
    b = sub.add_parser("bench", help="postrl vs TRL's GRPOTrainer side by side at equal work (CPU)",
                       description="Time postrl's Trainer and TRL's GRPOTrainer on the same tiny model, prompts and "
                       "settings, one step each in turn; print per-phase tokens/s, peak RSS, the speed-up, FLOP/s "
                       "against a matmul peak and generation against the memory-bandwidth bound. Needs "
                       "'postrl[bench]' (trl).")
    b.add_argument("--quick", action="store_true", help="one small configuration, 8 measured steps (< 1 minute)")
    b.add_argument("--sizes", nargs="+", metavar="SIZE", help="model sizes (postrl.models.tiny.SIZES; default 1m 20m)")
    b.add_argument("--lengths", nargs="+", type=int, metavar="T", help="completion lengths (default 32 256)")
    b.add_argument("--prompts", type=int, help="prompts per step (default 4; quick 2)")
    b.add_argument("--group-size", type=int, help="completions per prompt (default 8; quick 4)")
    b.add_argument("--steps", type=int, help="measured steps per side after six warm-up steps (default 3; quick 8)")
    b.add_argument("--epochs", type=int, default=1, help="optimisation epochs per batch (TRL num_iterations)")
    b.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    b.add_argument("--also", nargs="+", metavar="SIDE@THREADS",
                   help="extra variants run in the same rotation, e.g. trl@1 (TRL with 1 torch thread)")
    b.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where both sides run (default cpu, with any GPU hidden from them; cuda: the GPU path, "
                   "no scaling table)")
    b.add_argument("--no-scaling", action="store_true", help="skip the scaling table (full mode)")
    b.add_argument("--out", help="work directory (default: a new temporary one)")
    b.add_argument("--markdown", help="also write the tables to this file")
    b.add_argument("--json", help="also write all measurements to this file")
    b.set_defaults(fn=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    """``python -m postrl.benchmark worker SPEC`` / ``run-steps SPEC OUT``: the processes the benchmark starts. The
    benchmark itself is ``postrl bench`` (the CLI, which sets the environment first)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        return worker_main(argv[1:])
    if argv and argv[0] == "run-steps":
        return run_steps_main(argv[1:])
    print("usage: python -m postrl.benchmark {worker SPEC | run-steps SPEC OUT} (the benchmark's own processes); "
          "run the benchmark with: postrl bench", file=sys.stderr)
    return 2
