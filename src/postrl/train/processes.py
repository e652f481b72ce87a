"""The training processes: what the trainer exchanges between them (DDP over gloo or NCCL, through Accelerate).

One process (``world == 1``) exchanges nothing: every call returns its input.
"""

from __future__ import annotations

from typing import Any

import torch


class Processes:
    """``rank`` / ``world`` / ``main`` of an ``accelerate.Accelerator`` and the collectives the pipeline uses."""

    def __init__(self, acc: Any):
        self.acc = acc
        self.rank, self.world, self.main = acc.process_index, acc.num_processes, acc.is_main_process

    def gather(self, obj: Any) -> list:
        """Every process's ``obj`` (picklable), in rank order."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def max(self, n: int) -> int:
        """The largest ``n`` over processes."""
        if self.world == 1:
            return n
        import torch.distributed as dist

        t = torch.tensor([n], device=self.acc.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def all_reduce_mean(self, t: torch.Tensor) -> None:
        """Average ``t`` over processes, in place."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
            t /= self.world

    def reduce_metrics(self, metrics: dict) -> dict:
        """Average metrics over processes; keys ending in min / max are reduced as min / max."""
        if self.world == 1:
            return metrics
        import torch.distributed as dist

        out = {}
        for op, pick in ((dist.ReduceOp.MAX, lambda k: k.endswith("max")),
                         (dist.ReduceOp.MIN, lambda k: k.endswith("min")),
                         (dist.ReduceOp.SUM, lambda k: not k.endswith(("max", "min")))):
            keys = sorted(k for k in metrics if pick(k))
            t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.acc.device)
            dist.all_reduce(t, op=op)
            if op == dist.ReduceOp.SUM:
                t = t / self.world
            out.update(zip(keys, t.tolist()))
        return out
