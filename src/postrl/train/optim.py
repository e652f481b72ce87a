"""The optimizer, its schedule, and the gradient clip folded into a fused AdamW step."""

from __future__ import annotations

import math

import torch


def make_scheduler(optimizer, warmup: int, total: int, schedule: str):
    """Linear warmup over ``warmup`` optimizer steps, then constant / linear decay to 0 / cosine decay to 0."""

    def factor(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        if schedule == "constant":
            return 1.0
        frac = min(1.0, (s - warmup) / max(1, total - warmup))
        return 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_into_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` folded into the next step of a fused Adam/AdamW
    ``optimizer``: returns the gradients' total 2-norm ``n`` and sets the optimizer's ``grad_scale`` to
    ``max(1, (n + 1e-6) / max_norm)``, by which the fused kernel divides each gradient as it reads it. The step is
    that of clipping (``g * min(1, max_norm / (n + 1e-6))``) up to float rounding, without a pass that rewrites the
    gradients (1M parameters on a 2-core Zen 5: the clip 0.22 vs 0.13 ms, with the step 0.56-0.62 vs 0.52 ms).
    The caller sets ``grad_scale`` back to None after the step; a non-finite ``n`` is the caller's to handle (the
    step must not run)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    return norm


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """Fused AdamW over the trainable parameters (``cfg``: the config's ``optim`` section), weight decay on the
    matrices only (biases and norms in a group without it); one kernel per group on CPU and CUDA, the same update
    as the per-tensor loop."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


def clip_target(acc, optimizer) -> torch.optim.Optimizer | None:
    """The fused optimizer :func:`clip_into_step` folds the gradient clip into, where nothing else scales the
    gradients (no loss scaler, no sharded training); None: clip with accelerate's ``clip_grad_norm_``."""
    from accelerate.utils import DistributedType

    if acc.scaler is None and acc.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU,
                                                        DistributedType.MULTI_GPU):
        return optimizer.optimizer
    return None
