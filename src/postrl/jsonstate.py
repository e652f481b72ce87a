"""JSON-serialisable state of stateful stages (filters' running statistics, value heads and their optimizers).

The trainer saves a stage's ``state_dict()`` inside the checkpoint's ``trainer_state.json``; tensors are written as
``{"__tensor__": nested list, "dtype": "float32"}`` (float32/float64 round-trip exactly through JSON) and dicts with
non-string keys (an optimizer's per-parameter state) as ``{"__items__": [[key, value], ...]}``.
"""

from __future__ import annotations

from typing import Any

import torch


def encode(obj: Any) -> Any:
    """A JSON-serialisable copy of ``obj`` (dicts, lists, tuples, tensors, numbers, strings, None)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return {"__tensor__": t.tolist(), "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: encode(v) for k, v in obj.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return obj


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            t = torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
            return t.reshape(obj["shape"])
        if "__items__" in obj:
            return {decode(k): decode(v) for k, v in obj["__items__"]}
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj
