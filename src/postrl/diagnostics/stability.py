"""Edge of stability: the top Hessian eigenvalue (sharpness) by power iteration with Hessian-vector products.

Gradient descent with step size lr is stable along a direction of curvature lambda only while lambda < 2/lr;
full-batch training drives the sharpness up to that threshold and hovers there ("edge of stability", Cohen et
al. 2021). For Adam the relevant quantity is the *preconditioned* sharpness lambda_max(P^-1 H), with
P = diag(sqrt(v_hat) + eps) from Adam's second-moment estimate, and the threshold of momentum beta1 is
(2 + 2 beta1) / ((1 - beta1) lr), i.e. 38/lr at beta1 = 0.9 ("Adaptive Gradient Methods at the Edge of
Stability", Cohen et al. 2022, arXiv:2207.14484; see also "A Rod Flow Model for Adam at the Edge of Stability").

P^-1 H is not symmetric, but it has the eigenvalues of the symmetric P^-1/2 H P^-1/2, which is what the Lanczos
iteration runs on. Lanczos gives the largest algebraic eigenvalue, also when the one of largest magnitude is
negative (the RL surrogate is not convex), with far fewer Hessian-vector products than a power iteration (10
where the power iteration took 20, or 40 with the shifted second run it needed for a negative dominant eigenvalue).
"""

from __future__ import annotations

from typing import Callable

import torch


def hvp_fn(loss: torch.Tensor, params: list[torch.Tensor]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """v -> H v for the Hessian of ``loss`` w.r.t. ``params`` (double backward; the graph is kept)."""
    grads = torch.autograd.grad(loss, params, create_graph=True)

    def hvp(v: list[torch.Tensor]) -> list[torch.Tensor]:
        dot = sum((g * x).sum() for g, x in zip(grads, v))
        out = torch.autograd.grad(dot, params, retain_graph=True, allow_unused=True)
        return [torch.zeros_like(p) if o is None else o.detach() for o, p in zip(out, params)]

    return hvp


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def _lanczos(op: Callable, shapes: list[torch.Tensor], iters: int, seed: int) -> float:
    """Largest eigenvalue of the symmetric operator ``op`` by ``iters`` Lanczos steps (one product each).

    Lanczos builds the Krylov space of ``op`` from a random start and returns the largest eigenvalue of ``op``
    restricted to it (the top Ritz value): for the same number of products it converges much faster than the power
    iteration's Rayleigh quotient (error ~ exp(-4k sqrt(gap)) against exp(-2k gap) for k steps and relative gap),
    and it gives the largest *algebraic* eigenvalue directly, also when the dominant one is negative. Only the
    last two basis vectors are kept (no reorthogonalization: a lost orthogonality repeats a converged Ritz value,
    which leaves the largest one as it is), so the memory is three copies of the parameters whatever ``iters``."""
    g = torch.Generator().manual_seed(seed)
    v = [torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.device, p.dtype) for p in shapes]
    n = _dot(v, v) ** 0.5
    v = [x / n for x in v]
    prev: list[torch.Tensor] | None = None
    alphas: list[float] = []
    betas: list[float] = []
    beta = 0.0
    for _ in range(iters):
        w = op(v)
        alpha = _dot(w, v)
        alphas.append(alpha)
        w = [a - alpha * b for a, b in zip(w, v)]
        if prev is not None:
            w = [a - beta * b for a, b in zip(w, prev)]
        beta = _dot(w, w) ** 0.5
        if beta <= 1e-10 * max(1.0, abs(alpha)):  # an invariant subspace: its Ritz values are exact
            break
        betas.append(beta)
        prev, v = v, [x / beta for x in w]
    k = len(alphas)
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if k > 1:
        off = torch.tensor(betas[:k - 1], dtype=torch.float64)
        t += torch.diag(off, 1) + torch.diag(off, -1)
    return float(torch.linalg.eigvalsh(t).max())


def top_eigenvalue(loss: torch.Tensor, params: list[torch.Tensor], *, iters: int = 10, seed: int = 0,
                   precond: list[torch.Tensor] | None = None) -> float:
    """Largest (positive) eigenvalue of H, or of P^-1 H when ``precond`` gives the diagonal of P per parameter.

    ``iters`` Hessian-vector products (Lanczos steps, :func:`_lanczos`).
    """
    hvp = hvp_fn(loss, params)
    if precond is not None:
        inv_sqrt = [p.rsqrt() for p in precond]

        def op(v):
            hv = hvp([x * s for x, s in zip(v, inv_sqrt)])
            return [x * s for x, s in zip(hv, inv_sqrt)]
    else:
        op = hvp
    return _lanczos(op, params, iters, seed)


def adam_preconditioner(optimizer, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], float, float] | None:
    """(diag of P per parameter, beta1, lr) of an Adam/AdamW ``optimizer``: P = sqrt(v / (1 - beta2^t)) + eps.

    None before the first optimizer step (no second-moment estimate yet), while every gradient so far was zero,
    or for an optimizer without one.
    """
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the real one
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    out = []
    beta1 = lr = None
    seen = 0.0
    for p in params:
        st = opt.state.get(p, {})
        g = group_of.get(id(p))
        if "exp_avg_sq" not in st or g is None:
            return None
        b1, b2 = g["betas"]
        t = float(st["step"])
        vhat = st["exp_avg_sq"] / (1.0 - b2 ** t)
        out.append(vhat.sqrt() + g["eps"])
        beta1, lr = b1, g["lr"]
        seen = max(seen, float(st["exp_avg_sq"].max()))
    if seen == 0.0:  # every gradient so far was zero: Adam has not moved, there is no preconditioner to speak of
        return None
    return out, float(beta1), float(lr)


def stability_threshold(lr: float, beta1: float | None = None) -> float:
    """2/lr for gradient descent; (2 + 2 beta1) / ((1 - beta1) lr) for Adam with momentum beta1 (38/lr at 0.9)."""
    if beta1 is None:
        return 2.0 / lr
    return (2.0 + 2.0 * beta1) / ((1.0 - beta1) * lr)
