"""RLFR: a flow-matching velocity field over the policy's latents; its velocity deviation is a token reward."""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt

from postrl import jsonstate
from postrl.advantages import grpo, masked_whiten
from postrl.registry import register
from postrl.stages import StepEnd, Stateful

RLFR_SOURCE = "RLFR: Extending Reinforcement Learning for LLMs with Flow Environment"


class VelocityField(torch.nn.Module):
    """v_phi(x_t, t): a two-layer SiLU MLP from [x_t, t] (H + 1) to a velocity (H), zero output at init."""

    def __init__(self, dim: int, width: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)  # the same initial field on every process
        self.inp, self.out = torch.nn.Linear(dim + 1, width), torch.nn.Linear(width, dim)
        with torch.no_grad():
            for lin in (self.inp,):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / (dim + 1) ** 0.5)
                lin.bias.zero_()
            self.out.weight.zero_()
            self.out.bias.zero_()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.out(torch.nn.functional.silu(self.inp(torch.cat([x, t], -1))))


def flow_pairs(x1: torch.Tensor, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_t, t, target) for ``k`` draws per latent of the rectified-flow path: x0 ~ N(0, I), t ~ U(0, 1),
    x_t = (1 - t) x0 + t x1, target velocity x1 - x0; ``x1`` [n, H] -> [n k, H], [n k, 1], [n k, H]."""
    gen = torch.Generator().manual_seed(seed)
    x1 = x1.float().repeat_interleave(k, 0)
    x0 = torch.randn(x1.shape, generator=gen)
    t = torch.rand((x1.shape[0], 1), generator=gen)
    return (1 - t) * x0 + t * x1, t, x1 - x0


@register("advantage", "rlfr", source=RLFR_SOURCE, needs=("groups",))
class RLFR(Stateful):
    """GRPO's advantage plus a token reward from the velocity deviation of the policy's latents in a flow field.

    After RLFR ("the flow fields of model latents are constructed from ... on-policy rejection sampling data, and
    the velocity deviations of policy latents within it are quantified to serve as a reward signal"). A velocity
    field v_phi(x, t) (``VelocityField``: an MLP of width ``width``, 128) is fitted by flow matching on the latents
    h (the policy's last hidden state at each completion token, field ``completion_hidden``) of the completions
    that succeed (rejection sampling: ``reward`` >= ``success``, 1.0): minimise mean ||v_phi(x_t, t) - (h - x0)||^2
    over x0 ~ N(0, I), t ~ U(0, 1), x_t = (1 - t) x0 + t h (``flow_pairs``, ``samples`` (4) draws per latent),
    ``flow_epochs`` (4) AdamW steps at ``flow_lr`` (1e-3) per RL step, on the step's successes (``end_step``;
    gradients averaged over processes, so every process holds the same field). A token's deviation
    D(h_t) = (1/K) sum_k ||v_phi(x_t^k, t^k) - (h_t - x0^k)||^2 / H with K = ``samples`` fixed draws (seeded, the
    same for every token), and the advantage
        A_{i,t} = A_i^GRPO + ``beta`` whiten(-D(h_{i,t}))
    (A^GRPO: ``grpo`` with ``scale``; whiten over the batch's valid completion tokens, so a token whose latent the
    field transports well, close to the successes' latents, gains and an off-manifold one loses; ``beta`` 0.1).
    Before the field has seen a success (or with ``beta`` 0) the advantage is GRPO's. Assumed (the abstract gives no
    formula): the last layer's latents, the MLP, the reward as the negative mean squared velocity error, its
    whitening and additive weight, and on-policy successes as the only flow data (the paper can also build the
    field from off-policy expert data). Shapes: reward [N], completion_hidden [N, T, H], completion_mask [N, T],
    group_ids [N] -> [N, T]. State: the field and its optimizer (checkpointed). Metrics: ``flow_loss``,
    ``flow_tokens`` (latents fitted this step), ``deviation`` (mean D of the step's tokens before the fit).
    """

    gather_observed = False  # latents are large: each process fits on its own, gradients averaged

    def __init__(self, *, beta: Annotated[float, Ge(0)] = 0.1, success: float = 1.0,
                 width: Annotated[int, Ge(1)] = 128, samples: Annotated[int, Ge(1)] = 4,
                 flow_lr: Annotated[float, Gt(0)] = 1e-3, flow_epochs: Annotated[int, Ge(1)] = 4,
                 scale: Literal["group", "batch", "none"] = "group", eps: Annotated[float, Ge(0)] = 1e-6):
        self.beta, self.success, self.width, self.samples = beta, success, width, samples
        self.flow_lr, self.flow_epochs, self.scale, self.eps = flow_lr, flow_epochs, scale, eps
        self.field: VelocityField | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.fits = 0  # steps the field has been fitted at

    def _make(self, dim: int) -> None:
        self.field = VelocityField(dim, self.width)
        self.optimizer = torch.optim.AdamW(self.field.parameters(), lr=self.flow_lr, weight_decay=0.0)

    @torch.no_grad()
    def deviation(self, hidden: torch.Tensor) -> torch.Tensor:
        """D(h) for latents [..., H] -> [...] (the field is created on first use)."""
        if self.field is None:
            self._make(hidden.shape[-1])
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        xt, t, target = flow_pairs(flat, self.samples, seed=1)
        err = ((self.field(xt, t) - target) ** 2).mean(-1).reshape(-1, self.samples).mean(-1)
        return err.reshape(hidden.shape[:-1])

    def __call__(self, reward: torch.Tensor, completion_hidden: torch.Tensor, completion_mask: torch.Tensor,
                 group_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        outcome = grpo(reward, group_ids, valid, scale=self.scale, eps=self.eps)
        v = torch.isfinite(reward) if valid is None else (valid.bool() & torch.isfinite(reward))
        mask = completion_mask.float() * v.unsqueeze(-1)
        adv = outcome.unsqueeze(-1) * mask
        if self.beta == 0 or self.fits == 0:
            return adv
        shaped = masked_whiten(-self.deviation(completion_hidden).double(), mask).float()
        return adv + self.beta * shaped * mask

    def observe(self, reward: torch.Tensor, completion_hidden: torch.Tensor, completion_mask: torch.Tensor,
                group_ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep the latents of the step's successful completions (and the step's mean deviation)."""
        v = torch.isfinite(reward) if valid is None else (valid.bool() & torch.isfinite(reward))
        tokens = (completion_mask > 0) & v.unsqueeze(-1)
        d = self.deviation(completion_hidden)  # (creates the field on first use, on every process)
        dev = float(d[tokens].mean()) if bool(tokens.any()) else 0.0
        good = tokens & (reward >= self.success).unsqueeze(-1)
        self.record((completion_hidden[good].float(), dev))

    def end_step(self, step: StepEnd) -> dict:
        """Fit the field on the step's successes by flow matching (gradients averaged over processes)."""
        if not self.observed:
            return {}
        latents = torch.cat([x for x, _ in self.observed]) if self.observed else torch.zeros(0)
        dev = sum(d for _, d in self.observed) / len(self.observed)
        n = torch.tensor([float(latents.shape[0])])
        step.all_reduce_mean(n)
        if float(n) == 0 or self.field is None:
            return {"deviation": dev, "flow_tokens": 0.0}
        loss_val = 0.0
        for epoch in range(self.flow_epochs):
            for p in self.field.parameters():
                p.grad = torch.zeros_like(p)
            if latents.shape[0]:
                xt, t, target = flow_pairs(latents, self.samples, seed=1000 + 97 * self.fits + epoch)
                loss = ((self.field(xt, t) - target) ** 2).mean()
                loss.backward()
                loss_val = float(loss.detach())
            for p in self.field.parameters():  # a process without successes contributes a zero gradient
                step.all_reduce_mean(p.grad)
            self.optimizer.step()
        self.fits += 1
        return {"flow_loss": loss_val, "flow_tokens": float(latents.shape[0]), "deviation": dev}

    def state_dict(self) -> dict:
        if self.field is None:
            return {"fits": self.fits}
        return {"fits": self.fits, **jsonstate.encode({"field": self.field.state_dict(),
                                                           "optimizer": self.optimizer.state_dict()})}

    def load_state_dict(self, state: dict) -> None:
        self.fits = int(state.get("fits", 0))
        if "field" not in state:
            return
        dec = jsonstate.decode({k: state[k] for k in ("field", "optimizer")})
        self._make(dec["field"]["out.weight"].shape[0])
        self.field.load_state_dict(dec["field"])
        self.optimizer.load_state_dict(dec["optimizer"])
