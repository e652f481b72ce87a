"""Which library multiplies the matrices of a CPU training step: torch's default (MKL) or oneDNN.

A float32 ``F.linear`` on a CPU runs through MKL's sgemm. On AMD CPUs with AVX-512 (measured: an AMD EPYC Zen 5
VM, torch 2.13.0+cpu) MKL takes a generic code path and reaches about half of what the core can do: 110 GFLOP/s
on one thread for the products of a training step (296 x 128 times 128 x 480), where oneDNN, which torch also
ships, reaches 240 for the same product, in float32, with results equal to MKL's up to float rounding. On AMD
CPUs without AVX-512 (an AMD EPYC Zen 3 VM, AVX2) MKL's AVX2 path is as fast as oneDNN's on these products
alone and faster inside a training step (update phase of the 1M benchmark model, 2 threads: 55 ms with MKL,
68 ms with oneDNN), and much faster on a decode step's few rows (8 x 128 times 128 x 960: 43 vs 79 us).
:func:`use_onednn` makes a model's ``nn.Linear`` layers compute their forward and both products of their
backward (input gradient and weight gradient) with oneDNN (``torch.ops.mkldnn._linear_pointwise``, the kernel
torch's own compiler emits for CPU linear layers):

    y = x W^T + b,   dL/dx = g W,   dL/dW = g^T x,   dL/db = sum_rows g      (g = dL/dy)

The same function and the same float32 arithmetic; only the library (and so the summation order inside a
product) differs. oneDNN's results are bitwise identical on 1 and 2 threads (tested), like MKL's for these shapes.
A backward that builds a graph (double backward, as the sharpness diagnostic does) uses torch's differentiable
products instead.

``accel.matmul`` picks it: ``torch`` never, ``onednn`` always (where oneDNN exists), ``auto`` (default) on AMD
CPUs with AVX-512 (:func:`choose`). Only float32 CPU layers are switched; any other layer keeps ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a @ b_t^T with oneDNN (``a`` [M, K], ``b_t`` [N, K]; either may be a transposed view)."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, None, "none", [], "")


def onednn_grad_input(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dL/dx = g W with oneDNN (``g`` [M, out], ``w`` [out, in])."""
    return _mm(g, w.t())


def onednn_grad_weight(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dL/dW = g^T x with oneDNN (``g`` [M, out], ``x`` [M, in]). oneDNN copies a transposed first operand:
    transpose the smaller of g and x."""
    return _mm(g.t(), x.t()) if g.shape[1] <= x.shape[1] else _mm(x.t(), g.t()).t()


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = gw = gb = None
        if torch.is_grad_enabled():  # building a graph of the backward (double backward): differentiable ops
            if need_x:
                gx = (g @ weight).view(ctx.x_shape)
            if need_w:
                gw = g.t() @ x2
        else:
            if need_x:
                gx = onednn_grad_input(g, weight).view(ctx.x_shape)
            if need_w:
                gw = onednn_grad_weight(g, x2)
        if need_b and ctx.has_bias:
            gb = g.sum(0)
        return gx, gw, gb


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` computed with oneDNN (forward and backward) for float32 CPU tensors; ``F.linear`` otherwise."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.numel() == 0:
        return F.linear(x, weight, bias)
    return _OneDNNLinear.apply(x, weight, bias)


class OneDNNLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose products run on oneDNN (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def use_onednn(model: torch.nn.Module, enable: bool = True) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`OneDNNLinear` (``enable=False``: back); returns
    how many layers were switched. Parameters, hooks and the state dict are untouched."""
    n = 0
    for mod in model.modules():
        if enable and type(mod) is torch.nn.Linear:
            mod.__class__ = OneDNNLinear
            n += 1
        elif not enable and type(mod) is OneDNNLinear:
            mod.__class__ = torch.nn.Linear
            n += 1
    return n


def _cpuinfo(field: str) -> str:
    """The first value of ``field`` in /proc/cpuinfo ('' when unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_vendor() -> str:
    """The CPU vendor string of this machine ('AuthenticAMD', 'GenuineIntel', ...; '' when unknown)."""
    return _cpuinfo("vendor_id")


def cpu_has_avx512() -> bool:
    """Whether this CPU has AVX-512 (the ``avx512f`` flag)."""
    return "avx512f" in _cpuinfo("flags").split()


def choose(setting: str, model: torch.nn.Module) -> str:
    """The library for ``accel.matmul = setting`` (auto / torch / onednn) and this model: 'onednn' or 'torch'.

    ``auto`` is a rule, not a timing, so that every run and every process of a run on a machine makes the same
    choice (a timed choice could differ between two runs and change their last bits): oneDNN on AMD CPUs, where
    MKL's generic path runs at about half of oneDNN's speed (``postrl bench`` measures both), torch's default
    elsewhere."""
    if setting == "torch" or not onednn_available():
        return "torch"
    params = next(iter(model.parameters()), None)
    if params is None or params.dtype != torch.float32 or params.device.type != "cpu":
        return "torch"
    if setting == "onednn":
        return "onednn"
    return "onednn" if cpu_vendor() == "AuthenticAMD" and cpu_has_avx512() else "torch"
