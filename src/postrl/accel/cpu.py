"""How many torch intra-op threads each phase of a step uses.

On a CPU, more threads are not always faster. Every parallel operator ends in a barrier where all its threads wait
for the slowest; when the operator is small (a decode step of a tiny model multiplies a few rows by a small matrix)
or when the cores are shared with other processes (a busy machine, or several training processes on the same
cores), a thread that the OS has descheduled holds every other one at that barrier, and a step can become many
times slower than on one thread. When the operators are large and the cores free, more threads are faster.

:class:`ThreadPolicy` therefore picks the thread count per phase ("generation", "update") by measuring: it times a
short probe shaped like the phase's matrix products (from the model's hidden and intermediate sizes and the
phase's rows) on one thread and on the full count, alternately, keeps the faster, and measures again after
``refresh_s`` seconds, or sooner when a phase's time per unit of work grows by more than 1.5x (the load of a shared
machine rises). For generation, more threads are chosen only when they are consistently and clearly (1.3x)
faster: on a shared machine a wrong "more" costs far more than a wrong "fewer" there; for the update, whose
operators are large, when they are 1.2x faster (see ``measure``). A fixed ``threads`` turns all this off.

The choice changes speed, not what is computed, but not always the last bits: a matrix product split over a
different number of threads may round differently. Measured here (torch 2.13, x86): SFT steps of the built-in
models (forward, backward, AdamW) give bitwise identical weights on 1, 2 and 4 threads after 200 steps, and on 3
and 8 after 10 (``tests/test_bench.py`` checks 1 against 2), while a decode step occasionally differs in the 7th
digit. So small models (hidden size up to ``SMALL_HIDDEN``) pin generation to one
thread, which also is the faster count for their tiny decode operators, and measure only the update: their runs
stay bitwise reproducible whatever the load. Larger models measure both phases; their metrics are bitwise
reproducible with a fixed ``accel.threads``, and with the default whenever runs choose the same counts.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from postrl.accel import decoder
from postrl.accel.matmul import OneDNNLinear, _mm


# Models up to this hidden size generate on one thread (``for_model``): a decode step's products are too small for a
# second thread to pay, and a fixed count keeps sampling bit-reproducible (a measured choice may differ between
# runs, which changes float rounding in a decode step). Their update is measured (bitwise identical on any count).
SMALL_HIDDEN = 256


class ThreadPolicy:
    """Per-phase torch thread counts: fixed (``threads``) or measured (``threads=None``, see module docstring)."""

    def __init__(self, threads: int | None = None, *, hidden: int = 256, inter: int = 1024,
                 max_threads: int | None = None, refresh_s: float = 60.0, base_phase: str = "update",
                 pinned: dict[str, int] | None = None, onednn: dict[str, bool] | None = None,
                 numpy: tuple[str, ...] = ()):
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self.fixed = threads
        self.pinned = dict(pinned or {})  # phase -> fixed count for that phase only (when ``threads`` is None)
        self.max_threads = max_threads or torch.get_num_threads()
        self.hidden, self.inter = int(hidden), int(inter)
        self.refresh_s = refresh_s
        self.base_phase = base_phase
        self.choices: dict[str, tuple[int, float]] = {}  # phase -> (threads, when measured)
        self.timings: dict[str, dict[int, float]] = {}  # phase -> threads -> probe seconds (last measurement)
        self.pace: dict[str, tuple[int, float]] = {}  # phase -> (threads, seconds per unit of work) of the last use
        # phase -> whether its products run on oneDNN (postrl.accel.matmul): the probe then times oneDNN's, whose
        # gain from a second thread differs from MKL's
        self.onednn = dict(onednn or {})
        # phases whose products run in numpy (the static decoder's numpy decode steps): probed with numpy's products,
        # its BLAS limited to the candidate count (postrl.accel.decoder.blas_threads)
        self.numpy = tuple(numpy)
        # Early re-measurements: a choice is measured again after this many further uses of the phase, then after
        # refresh_s only. The first measurements of a run are the least reliable (other processes starting or
        # finishing their set-up, a neighbour's OpenMP threads spinning after its last parallel region); measuring
        # again after 2 and 4 more uses keeps one bad start from fixing a slow choice for a minute.
        self.early = (2, 4)
        self._uses: dict[str, list[int]] = {}  # phase -> [uses since the last measurement, re-measurements done]

    @classmethod
    def for_model(cls, model, threads: int | None = None, decode: str = "torch", **kw) -> ThreadPolicy:
        """The policy for ``model``'s phases; ``decode``: the library of its decode steps ("numpy" or "torch", as
        :func:`postrl.accel.decoder.decode_library` resolves ``accel.decode``)."""
        cfg = getattr(model, "config", None)
        hidden = getattr(cfg, "hidden_size", None) or 256
        inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
        if threads is None and hidden <= SMALL_HIDDEN:
            kw.setdefault("pinned", {"generation": 1})  # tiny decode operators; bit-reproducible sampling

        onednn_gen = False
        if any(type(m) is OneDNNLinear for m in model.modules()):  # as the update and the decoder use it
            onednn_gen = hidden > decoder._ONEDNN_MIN_HIDDEN  # the decode steps' products, numpy steps included
            kw.setdefault("onednn", {"update": True, "generation": onednn_gen})
        if decode == "numpy" and not onednn_gen:
            kw.setdefault("numpy", ("generation",))
        return cls(threads, hidden=hidden, inter=inter, **kw)

    # ------------------------------------------------------------------------------------------------------------------
    def candidates(self) -> list[int]:
        return sorted({1, self.max_threads})

    def _probe(self, phase: str, rows: int):
        """Matrix products shaped like the phase (a decode step's rows, or a micro-batch's tokens): returns a
        function running one unit of it. A generation unit is an MLP's forward; an update unit adds the product
        of the backward pass that computes a weight's gradient, whose inner dimension is the tokens (it divides
        among threads differently from the forward's)."""
        # Operators of the phase's own size, since the cost of a barrier stall depends on how long an operator
        # runs: decode-step products of at most 32 rows (~1e8 floating-point operations per round), and update
        # products of up to a micro-batch's tokens (up to ~1e9 per unit: a smaller cap would cut a large model's
        # probe to a few dozen rows, which gain less from threads than its real products). An update round repeats
        # the unit up to ~1.2e8 operations only (one unit, ~4 ms on one core, for a 1M model's 300 tokens): with
        # 1e9 per round the probe of a tiny model took 60 ms, twice its update, at each of a short run's
        # measurements.
        update = phase != "generation"
        budget = 1e9 if update else 1e8
        per_row = (6.0 if update else 4.0) * self.hidden * self.inter
        rows = max(1, min(int(rows), 8192 if update else 32, int(budget / per_row)))
        budget = 1.2e8 if update else budget
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, self.hidden, generator=g)
        w1 = torch.randn(self.inter, self.hidden, generator=g) * self.hidden ** -0.5
        w2 = torch.randn(self.hidden, self.inter, generator=g) * self.inter ** -0.5
        F = torch.nn.functional
        reps = max(1, min(64, int(budget / (per_row * rows))))
        if phase in self.numpy:  # as the numpy decode step: weights [out, in] (x @ w.T), SiLU as g / (1 + exp(-g))
            xn, w1n, w2n = x.numpy(), w1.numpy(), w2.numpy()

            def unit_np() -> None:
                h = xn @ w1n.T
                h /= np.exp(-h) + 1.0
                h @ w2n.T

            return unit_np, reps
        if self.onednn.get(phase):
            linear = _mm

            def grad_w(h, x):  # [inter, hidden], as the oneDNN layer's backward computes it
                return linear(x.t(), h.t()).t()
        else:
            linear = F.linear

            def grad_w(h, x):
                return torch.mm(h.t(), x)

        def unit() -> None:
            h = F.silu(linear(x, w1))
            linear(h, w2)
            if update:
                grad_w(h, x)  # the shape of a weight gradient

        return unit, reps

    def measure(self, phase: str, rows: int, rounds: int | None = None) -> int:
        """Time the phase's probe on each candidate thread count, in interleaved rounds. For generation, a count
        above one is kept only when it is faster than one thread in every round and by at least 1.3x in total: a
        stall at a barrier in any round means the cores are shared right now, and a decode step is hundreds of
        tiny operators, so a busy spell would make generation many times slower (measured: 7x for a 20M model)
        against a gain of at most the thread count on a free machine. The update's operators are large, so a
        stall costs a fraction of each (measured: 1.3x slower at worst, 1.75x faster on a quiet machine): there
        more threads are kept when they are 1.2x faster in total. A candidate that takes more than twice as long
        as one thread in a round is dropped at once (finishing its probe would waste the time the measurement is
        meant to save). Returns the choice."""
        cands = self.candidates()
        old = torch.get_num_threads()
        unit, reps = self._probe(phase, rows)
        rounds = rounds or (5 if phase == "generation" else 3)
        total = {c: 0.0 for c in cands}
        alive = list(cands)
        slower_once: set[int] = set()
        one = math.inf

        def set_threads(c: int) -> None:
            torch.set_num_threads(c)
            if phase in self.numpy:
                blas.limit(limits=c)  # undone when ``blas`` exits

        blas = decoder.blas_controller() if phase in self.numpy else None
        try:
            with torch.inference_mode(), blas.limit(limits=old) if blas is not None else nullcontext():
                for c in cands:  # warm-up: first-call allocations
                    set_threads(c)
                    unit()
                for _ in range(rounds):
                    limit = math.inf
                    for c in list(alive):
                        set_threads(c)
                        t = time.perf_counter()
                        for _ in range(reps):
                            unit()
                            if time.perf_counter() - t > limit:
                                break
                        dt = time.perf_counter() - t
                        total[c] += dt
                        if c == 1:
                            limit, one = 2.0 * dt, dt
                        elif dt > limit:
                            alive.remove(c)
                        elif dt >= one:
                            slower_once.add(c)
                    if len(alive) == 1:
                        break
        finally:
            torch.set_num_threads(old)
        # More threads only when clearly and consistently faster; near a tie, fewer threads leave the cores to
        # everyone else on the machine, and the choice does not flip between runs (see the module docstring).
        choice = alive[0]
        for c in alive[1:]:
            if phase == "generation" and (c in slower_once or total[c] * 1.3 > total[choice]):
                continue
            if total[c] * 1.2 <= total[choice]:
                choice = c
        self.choices[phase] = (choice, time.monotonic())
        self.timings[phase] = dict(total)
        return choice

    def threads_for(self, phase: str, rows: int = 1) -> int:
        if self.fixed is not None:
            return self.fixed
        if phase in self.pinned:
            return self.pinned[phase]
        if len(self.candidates()) == 1:
            return self.max_threads
        chosen = self.choices.get(phase)
        uses = self._uses.setdefault(phase, [0, 0])
        again = uses[1] < len(self.early) and uses[0] >= self.early[uses[1]]
        if chosen is None or again or time.monotonic() - chosen[1] > self.refresh_s:
            if chosen is not None and again:
                uses[1] += 1
            uses[0] = 0
            return self.measure(phase, rows)
        uses[0] += 1
        return chosen[0]

    @contextmanager
    def use(self, phase: str, rows: int = 1, work: float | None = None) -> Iterator[int]:
        """Run the body with the phase's thread count. Afterwards the count is the ``base_phase``'s choice once
        that phase has been measured (the small operations between phases, such as metrics, stall at barriers
        just as a decode step does on a busy machine), else the count from before.

        ``work``: the body's amount of work in any unit fixed per phase (e.g. tokens). When the time per unit grows
        by more than 1.5x from the previous run with the same choice, the machine's load has risen: the choice is
        measured again at the next use instead of after ``refresh_s``. (A faster run only becomes the new pace: the
        first run after a measurement pays first-call costs, and a load that falls is caught by ``refresh_s``.)"""
        n = self.threads_for(phase, rows)
        old = torch.get_num_threads()
        if n != old:
            torch.set_num_threads(n)
        t0 = time.perf_counter()
        try:
            yield n
            if work and self.fixed is None and phase in self.choices:
                per = (time.perf_counter() - t0) / work
                last = self.pace.get(phase)
                if last is not None and last[0] == n and per > last[1] * 1.5:
                    self.choices.pop(phase)  # measure again next time
                    self.pace.pop(phase)
                else:
                    self.pace[phase] = (n, per)
        finally:
            base = self.choices.get(self.base_phase) if self.fixed is None else None
            after = base[0] if base is not None else old
            if torch.get_num_threads() != after:
                torch.set_num_threads(after)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
KEEP_TRIM_THRESHOLD = 2**30


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the CPU count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the OS; True when applied.

    A step allocates and frees the same large buffers again and again (activations of hundreds of KB to MBs). By
    default glibc serves blocks above a threshold (128 KB, raised as such blocks are freed) with their own
    ``mmap`` and gives them back with ``munmap`` on free, and trims the top of the heap when more than twice that
    is free; either way the next allocation of the same size touches fresh pages, and every 4 KB page costs a
    page fault. This sets the ``mmap`` threshold to 32 MB (glibc's maximum; larger blocks still get their own
    mapping) and the trim threshold to 1 GB, so that freed blocks are reused. The process then keeps its peak
    heap (measured: the same peak RSS for the 20M benchmark model). Measured on an AMD EPYC Zen 5 VM: the 1M
    model's update 19.3 -> 16.6 ms, the 20M model's step (32 rows x 32 tokens) 769 -> 708 ms. The same tuning
    the PyTorch CPU performance guides get from jemalloc or tcmalloc, without preloading a library. A
    process-wide setting; no effect (False) outside glibc."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - a glibc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                   KEEP_TRIM_THRESHOLD))
