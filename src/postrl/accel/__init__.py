"""The CPU speed layer: the same functions as the plain Hugging Face path, computed faster on a CPU.

One switch, ``accel.mode`` (:class:`postrl.config.AccelConfig`), and one call, :func:`prepare`, which applies the
layer to a model and returns the :class:`Accel` object the trainer uses for everything the layer changes:

* ``accel.threads``: the torch thread count of each phase (:class:`postrl.accel.cpu.ThreadPolicy`, ``cpu.py``);
* :meth:`Accel.generator`: the generation backend; Llama-family models decode with
  :class:`~postrl.accel.decoder.StaticDecoder` (``decoder.py``: fused projections, a static KV cache, numpy steps);
* :meth:`Accel.logprobs`: per-token log-probs for the update, by the hand-written fused forward and backward
  (``fused.py``);
* the policy's linear layers on oneDNN where MKL is slow (``matmul.py``), glibc's malloc keeping freed memory
  (``cpu.keep_freed_memory``), and tokenizers encoding on the calling thread (``TOKENIZERS_PARALLELISM=false``).

``accel.mode=off`` (or :func:`plain`) is the plain path everywhere: the model's own forward for log-probs,
:class:`~postrl.rollout.hf.HFGenerator` over the model's forward with a ``DynamicCache``, torch's thread count. Every
piece computes what the plain path computes up to float rounding (``tests/test_accel.py`` checks log-probs,
gradients and sampled tokens against it); ``postrl bench`` measures what each piece gains
(``--also postrl:accel.mode=off``; docs/benchmarks.md).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import torch

from postrl.accel.cpu import ThreadPolicy, keep_freed_memory
from postrl.errors import ConfigError
from postrl.logprobs import completion_logprobs
from postrl.accel import fused, matmul
from postrl.accel.decoder import StaticDecoder, decode_library
from postrl.rollout.hf import HFGenerator

__all__ = ["Accel", "plain", "prepare"]


@dataclass
class Accel:
    """What the speed layer applied to a model gives its user (built by :func:`prepare` or :func:`plain`).

    ``threads``: torch threads per phase; ``matmul``: the library of the policy's linear layers ('onednn' or
    'torch'); ``decode``: the library of the static decoder's steps ('numpy' or 'torch'), None for the model's own
    forward; ``fused``: the update's log-probs by the fused function where it applies."""

    mode: str
    threads: ThreadPolicy
    matmul: str = "torch"
    decode: str | None = None
    fused: bool = False

    def use(self, phase: str, rows: int = 1, work: float | None = None) -> AbstractContextManager[int]:
        """Run the body with the phase's torch thread count (:meth:`ThreadPolicy.use`)."""
        return self.threads.use(phase, rows=rows, work=work)

    def apply(self, model: torch.nn.Module) -> None:
        """The same layer library for another model of the run (the frozen reference model)."""
        if self.matmul == "onednn":
            matmul.use_onednn(model)

    def generator(self, model, tokenizer, batch_size: int | None = None):
        """An :class:`~postrl.rollout.hf.HFGenerator` for ``model`` with this layer's decoder and thread policy."""
        decoder = None
        if self.decode is not None:
            decoder = partial(StaticDecoder, library=self.decode)
        return HFGenerator(model, tokenizer, batch_size, decoder=decoder, threads=self.threads)

    def logprobs(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                 temperature: float = 1.0, **kw):
        """:func:`postrl.models.completion_logprobs` (same arguments and returns), its logits by
        :func:`postrl.accel.fused.fused_completion_logits` where that applies (``fused``, a supported model, at most
        ``FUSED_MAX_POSITIONS`` positions); else, and with mode off, by the model's own forward."""
        logits = None
        if self.fused:
            if fused.applies(model, prompt_ids.shape[1], completion_ids.shape[1]):
                logits = fused.fused_completion_logits(model, prompt_ids, prompt_mask, completion_ids)
        return completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, temperature, logits=logits, **kw)


def plain(threads: int | None = None) -> Accel:
    """The plain Hugging Face path (``accel.mode=off``): no part of the speed layer, ``threads`` torch threads
    (None: the current count)."""
    if threads:
        torch.set_num_threads(threads)
    return Accel("off", ThreadPolicy(threads or torch.get_num_threads()))


def prepare(model: torch.nn.Module, cfg, device: torch.device | str | None = None) -> Accel:
    """Apply the speed layer configured by ``cfg`` (:class:`postrl.config.AccelConfig`) to
    ``model``, which will run on ``device`` (default: where its parameters are), and return the :class:`Accel`.

    On a CPU this switches the model's linear layers to oneDNN where ``accel.matmul`` picks it (in place; the
    parameters and state dict are unchanged), applies ``accel.keep_freed_memory`` (process-wide) and sets
    ``TOKENIZERS_PARALLELISM=false`` unless set: the tokenizers library's Rayon threads keep spinning after each
    batch encode and take cores from the torch operators that follow (20M model: a decode step after a rollout's
    tokenisation on 2 threads was as slow as on 1; without the pool, 1.7x faster). On an accelerator only the
    static decoder (in torch) applies. A choice that cannot run here is a :class:`ConfigError`."""
    if cfg.mode == "off":
        return plain(cfg.threads)

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    supported = StaticDecoder.supports(model)
    if device.type != "cpu":
        if cfg.decode == "numpy":
            raise ConfigError(f"accel.decode: 'numpy' decodes on a CPU only (the model runs on {device.type}); "
                              f"use auto or torch")
        # the host's thread count is not measured on an accelerator (the CPU probe would time the wrong thing)
        return Accel("auto", ThreadPolicy(cfg.threads or torch.get_num_threads()),
                     decode="torch" if supported else None, fused=cfg.fused)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.keep_freed_memory:
        keep_freed_memory()
    lib = matmul.choose(cfg.matmul, model)
    matmul.use_onednn(model, lib == "onednn")
    try:
        decode = decode_library(model, cfg.decode)
    except ValueError as e:  # accel.decode=numpy for a model numpy cannot decode
        raise ConfigError(f"accel.decode: {e}") from None
    threads = ThreadPolicy.for_model(model, cfg.threads, decode=decode if supported else "torch")
    return Accel("auto", threads, matmul=lib, decode=decode if supported else None, fused=cfg.fused)
