"""A small learned scalar head over feature vectors, with its own optimizer and checkpoint state.

The stages that learn a value from the policy's hidden states (GAE's value head, PCL's prompt value model, SPA's
progress estimator) each need the same thing: a head made on the first features it sees (their width is the
model's), whose output layer starts at zero (it predicts 0 before any fit), trained by its own AdamW, and saved in
the checkpoint with that optimizer. :class:`ScalarHead` is that; the fitting loop stays with each stage.
"""

from __future__ import annotations

import torch

from postrl import jsonstate
from postrl.seeding import stable_hash


def scalar_module(dim: int, units: int = 0, name: str = "postrl.head") -> torch.nn.Module:
    """Features [..., H] -> [..., 1]: linear (``units`` 0) or one hidden ReLU layer of ``units``; the output layer
    zero-initialised, the hidden layer's initialisation fixed by ``(name, H, units)`` (the global generator is left
    alone)."""
    if units:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stable_hash(name, dim, units) % 2**31)
            net = torch.nn.Sequential(torch.nn.Linear(dim, units), torch.nn.ReLU(), torch.nn.Linear(units, 1))
        last = net[-1]
    else:
        net = last = torch.nn.Linear(dim, 1)
    torch.nn.init.zeros_(last.weight)
    torch.nn.init.zeros_(last.bias)
    return net


class ScalarHead:
    """Features [..., H] -> scalar [...] through :func:`scalar_module`, made on the first call (or :meth:`make`);
    ``optimizer`` is AdamW at ``lr``, no weight decay. ``state_dict`` is ``{}`` before it is made, else the module
    and optimizer states (JSON-safe)."""

    def __init__(self, lr: float, units: int = 0, name: str = "postrl.head"):
        self.lr, self.units, self.name = float(lr), int(units), name
        self.module: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def made(self) -> bool:
        return self.module is not None

    def make(self, dim: int) -> None:
        self.module = scalar_module(dim, self.units, self.name)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.lr, weight_decay=0.0)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        if self.module is None:
            self.make(features.shape[-1])
        return self.module(features.float()).squeeze(-1)

    def parameters(self):
        return self.module.parameters()

    def state_dict(self) -> dict:
        if self.module is None:
            return {}
        return jsonstate.encode({"head": self.module.state_dict(), "optimizer": self.optimizer.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        state = jsonstate.decode(state)
        first = next(v for k, v in state["head"].items() if k.endswith("weight"))  # the input layer: [out, H]
        self.make(first.shape[-1])
        self.module.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
