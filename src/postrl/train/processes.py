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
        """Average metrics over processes; keys ending in min / max are reduced as min / max. A key some processes
        lack (a reward's ``log_metric`` on one process) is reduced over the processes that have it."""
        if self.world == 1:
            return metrics
        import torch.distributed as dist

        names = sorted(set().union(*self.gather(sorted(metrics))))
        out = {}
        for op, pick in ((dist.ReduceOp.MAX, lambda k: k.endswith("max")),
                         (dist.ReduceOp.MIN, lambda k: k.endswith("min")),
                         (dist.ReduceOp.SUM, lambda k: not k.endswith(("max", "min")))):
            keys = [k for k in names if pick(k)]
            if op == dist.ReduceOp.SUM:  # sums and counts: the mean over the processes that logged the key
                t = torch.tensor([float(metrics[k]) if k in metrics else 0.0 for k in keys]
                                 + [float(k in metrics) for k in keys], dtype=torch.float64, device=self.acc.device)
                dist.all_reduce(t, op=op)
                sums, counts = t[:len(keys)], t[len(keys):]
                t = sums / counts.clamp(min=1)
            else:
                fill = float("-inf") if op == dist.ReduceOp.MAX else float("inf")
                t = torch.tensor([float(metrics.get(k, fill)) for k in keys], dtype=torch.float64,
                                 device=self.acc.device)
                dist.all_reduce(t, op=op)
            out.update(zip(keys, t.tolist()))
        return out
