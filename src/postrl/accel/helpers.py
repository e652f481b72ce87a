"""Helper processes that generate a share of the prompts, for :class:`~postrl.rollout.hf.HFGenerator` on a CPU.

A tiny model's decode step is bound by the cost of each operation, not by its rows: on a 2-core Zen 5, 4 rows
of the 1M benchmark model take 13.1 ms to generate 32 tokens, 8 rows 16.7 ms, and a second thread does not help.
When generation runs on one thread the other core idles, so ``accel.processes=2`` gives half the prompts to a
helper process: 8 rows in 14.0 ms instead of 16.4 ms (two prompts of 4 rows, with the transfers); a GRPO step of
the 1M model 32.0 instead of 34.0 ms.

* The helpers are spawned (not forked: the parent's OpenMP threads do not survive a fork) in the background
  (about 3 s to start, on the other core) and get the model once: its parameters are moved to shared memory, so
  the optimizer's in-place updates reach them without a copy. Until they report ready, generation stays in the
  training process.
* Prompts are split in contiguous blocks, one per process, each with its own seeds (one per prompt, as the
  trainer draws them), so a row's samples are those of the single-process run up to the float rounding of a
  smaller batch (the same tokens in the tests).
* Each process generates with (usable cores) / ``processes`` torch and BLAS threads; a helper's errors come back
  as a one-line RuntimeError.
* The training process's OpenMP threads must not spin on the helper's core after the update: libgomp's default
  spin (``GOMP_SPINCOUNT`` 300,000 pauses, about 7 ms on a Zen 5) made the helper's share 20 instead of 14 ms.
  The ``postrl`` command sets ``GOMP_SPINCOUNT=10000`` before torch loads unless it is set (the update's speed
  does not change); a program that imports torch itself should set it in its environment.
"""

from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager
from typing import Any

import torch

from postrl.rollout.base import Generation

__all__ = ["HelperPool", "merge_generations"]


def _serve(conn, model, tokenizer, options: dict) -> None:  # pragma: no cover - runs in the helper process
    import torch

    torch.set_num_threads(options["threads"])
    from postrl.rollout.hf import HFGenerator

    gen = HFGenerator(model, tokenizer, **options)
    conn.send(("ready", None, None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        prompts, n, params, seeds, eos_ids = msg
        try:
            gen.eos_ids = list(eos_ids)
            out = gen.generate(prompts, n, params, seeds)
            conn.send(("ok", {k: getattr(out, k).numpy() for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                   "completion_mask", "logprobs", "truncated")},
                       out.texts))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            last = traceback.extract_tb(e.__traceback__)[-1]
            conn.send(("error", f"{type(e).__name__}: {e} ({last.filename}:{last.lineno})", None))


@contextmanager
def _main_hidden():
    """Start a spawned process without it running the caller's ``__main__`` again (multiprocessing re-imports a
    script's top level in the child, which in a script without an ``if __name__ == "__main__"`` guard would start
    the training again): the helper needs only postrl, the model and the tokenizer."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


class HelperPool:
    """``count`` helper processes, each holding the model (shared parameters) and an :class:`HFGenerator` built
    with ``options``. :meth:`start` spawns them without waiting; :meth:`ready` says whether all have started."""

    def __init__(self, model, tokenizer, count: int, options: dict):
        self.model, self.tokenizer, self.count, self.options = model, tokenizer, count, options
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.started: list[bool] = []

    def start(self) -> None:
        if self.procs:
            return
        import torch.multiprocessing as mp

        self.model.share_memory()  # in place: the same parameters, now visible to the helpers
        ctx = mp.get_context("spawn")
        for _ in range(self.count):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, self.model, self.tokenizer, self.options), daemon=True,
                               name="postrl-generation-helper")
            with _main_hidden():
                proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
            self.started.append(False)

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether every helper has started (waits up to ``timeout`` seconds for each); starts them if needed."""
        self.start()
        for i, conn in enumerate(self.conns):
            if not self.started[i]:
                if not conn.poll(timeout):
                    if not self.procs[i].is_alive():
                        raise RuntimeError(self._died(i))
                    return False
                self._reply(i)
                self.started[i] = True
        return True

    def _reply(self, i: int) -> tuple:
        try:
            status, arrays, texts = self.conns[i].recv()
        except (EOFError, OSError):
            raise RuntimeError(self._died(i)) from None
        if status == "error":
            raise RuntimeError(f"generation helper process {i + 1}: {arrays}")
        return status, arrays, texts

    def submit(self, i: int, prompts: list[list[int]], n: int, params, seeds: list[int], eos_ids: list[int]) -> None:
        try:
            self.conns[i].send((prompts, n, params, seeds, eos_ids))
        except (BrokenPipeError, OSError):
            raise RuntimeError(self._died(i)) from None

    def result(self, i: int) -> Generation:
        _, arrays, texts = self._reply(i)
        return Generation(texts=texts, **{k: torch.from_numpy(v) for k, v in arrays.items()})

    def _died(self, i: int) -> str:
        proc = self.procs[i]
        proc.join(timeout=1.0)
        return f"generation helper process {i + 1} exited (exit code {proc.exitcode}); accel.processes=1 " \
               f"generates in the training process only"

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.terminate()
            conn.close()
        self.procs, self.conns, self.started = [], [], []


def merge_generations(parts: list[Generation], pad_id: int) -> Generation:
    """The rows of ``parts`` in order, as one :class:`Generation`: prompts re-padded on the left and completions on
    the right to the widest part (pad ``pad_id``, masks 0, log-probs 0)."""
    P = max(g.prompt_ids.shape[1] for g in parts)
    T = max(g.completion_ids.shape[1] for g in parts)
    N = sum(len(g.texts) for g in parts)
    pid = torch.full((N, P), pad_id, dtype=torch.long)
    pm = torch.zeros((N, P), dtype=parts[0].prompt_mask.dtype)
    cid = torch.full((N, T), pad_id, dtype=torch.long)
    cm = torch.zeros((N, T), dtype=parts[0].completion_mask.dtype)
    lp = torch.zeros((N, T), dtype=parts[0].logprobs.dtype)
    row = 0
    for g in parts:
        n, p, t = len(g.texts), g.prompt_ids.shape[1], g.completion_ids.shape[1]
        pid[row:row + n, P - p:] = g.prompt_ids
        pm[row:row + n, P - p:] = g.prompt_mask
        cid[row:row + n, :t] = g.completion_ids
        cm[row:row + n, :t] = g.completion_mask
        lp[row:row + n, :t] = g.logprobs
        row += n
    return Generation(prompt_ids=pid, prompt_mask=pm, completion_ids=cid, completion_mask=cm, logprobs=lp,
                      truncated=torch.cat([g.truncated for g in parts]), texts=[t for g in parts for t in g.texts])
