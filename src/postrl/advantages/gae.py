"""GAE with a value head: the critic of PPO.

The value head is a linear map from the policy's last hidden state at the position that predicts completion token
t (the state s_t before emitting o_t) to V(s_t). It is trained on the *detached* hidden states (a stop-gradient
probe on the shared trunk): its loss never reaches the policy's weights, so no value-loss coefficient has to be
balanced against the policy loss, and it has its own AdamW optimizer. The estimator reads ``completion_hidden``
(produced by a no-grad forward, ``postrl.fields``), computes the values with :meth:`GAE.values` and the advantages;
at the end of the step, ``end_step`` regresses the head on the returns of that batch (:meth:`GAE.fit`, PPO
clipped value loss), once.
Head weights and optimizer state are saved in the checkpoint through ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

from typing import Annotated, Callable

import torch
from annotated_types import Ge, Gt, Le

from postrl.groups import valid_mask
from postrl.heads import ScalarHead
from postrl.advantages import masked_whiten
from postrl.registry import register
from postrl.stages import StepEnd, Stateful


def token_rewards(reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T] with the outcome reward on each row's last masked token (0 elsewhere; rows without tokens: 0)."""
    T = mask.shape[-1]
    pos = torch.arange(T, device=mask.device, dtype=torch.float32)
    m = (mask > 0).to(torch.float32)
    last = (m * pos).amax(-1).long()  # index of the last masked token (0 for a row without tokens: skipped)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = torch.nonzero(m.sum(-1) > 0).flatten()
    out[rows, last[rows]] = reward.to(torch.float32)[rows]
    return out


def gae_advantages_returns(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                           lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) over the masked tokens (verl ``compute_gae_advantage_return`` without its whitening).

    delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}; V and A after the last masked token
    are 0 (terminal); unmasked positions pass the running values through. Returns (advantages, returns = A + V),
    both [N, T] in the values' dtype (at least float32). The recursion runs over T (vectorised over rows).
    """
    dt = torch.promote_types(values.dtype, torch.float32)
    # time-major copies: each step of the recursion reads one contiguous row
    vl, mk = values.to(dt).t().contiguous(), mask.to(dt).t().contiguous()
    base = (rewards.to(dt) - values.to(dt)).t().contiguous()  # r_t - V_t
    T, N = vl.shape
    next_v = torch.zeros(N, dtype=dt, device=vl.device)
    last = torch.zeros(N, dtype=dt, device=vl.device)
    adv = torch.empty_like(vl)
    for t in range(T - 1, -1, -1):
        cur = torch.add(torch.add(base[t], next_v, alpha=gamma), last, alpha=gamma * lam)  # delta_t + g l A_{t+1}
        next_v = torch.lerp(next_v, vl[t], mk[t])  # V_t where masked, else carried over
        last = torch.lerp(last, cur, mk[t])
        adv[t] = last
    adv = adv.t().contiguous()
    return adv, adv + values.to(dt)


@register("advantage", "gae", source="GAE (Schulman et al. 2016) with a value head, as in PPO/InstructGPT; "
          "verl adv_estimator=gae")
class GAE(Stateful):
    """GAE(gamma, lambda) advantages from a value head on the policy's hidden states (PPO's critic).

    Token rewards: the outcome reward r_i on the last completion token, 0 elsewhere. delta_t = r_t + gamma V_{t+1}
    - V_t, A_t = sum_k (gamma lam)^k delta_{t+k}; returns R_t = A_t + V_t (regression target of the value head).
    ``whiten=True`` (default, verl): A is whitened over all valid tokens of the batch (unbiased var, eps 1e-8).
    Defaults: gamma 1.0 (verl, OpenRLHF), lam 0.95 (OpenRLHF / TRL PPO; verl's default is 1.0), value loss
    0.5 * token-mean of max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) with c = ``value_clip`` 0.5 (verl
    ``critic.cliprange_value``), ``value_epochs`` 4 full-batch AdamW steps at ``value_lr`` 1e-3 per RL step.
    Matches verl ``compute_gae_advantage_return`` given the same values. Any group size (G = 1 included).
    Shapes: reward [N], completion_hidden [N, T, H], completion_mask [N, T], valid [N] -> [N, T] (``estimate``:
    values [N, T] in place of the hidden states). The head is fitted once per step, in ``end_step``.
    """

    def __init__(self, *, gamma: Annotated[float, Ge(0), Le(1)] = 1.0, lam: Annotated[float, Ge(0), Le(1)] = 0.95,
                 whiten: bool = True, value_lr: Annotated[float, Gt(0)] = 1e-3, value_epochs: Annotated[int, Ge(1)] = 4,
                 value_clip: Annotated[float, Gt(0)] | None = 0.5):
        self.gamma, self.lam, self.whiten = gamma, lam, whiten
        self.value_lr, self.value_epochs, self.value_clip = value_lr, value_epochs, value_clip
        self.head = ScalarHead(value_lr)  # V(s_t) on the policy's hidden state

    # ---------------------------------------------------------------------------------------- the estimator
    def __call__(self, reward: torch.Tensor, completion_hidden: torch.Tensor, completion_mask: torch.Tensor,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
        """Advantages [N, T] from the value head's V on ``completion_hidden`` [N, T, H] (the policy's last hidden
        state at each completion position)."""
        return self.estimate(reward, self.values(completion_hidden), completion_mask, valid)

    def observe(self, reward: torch.Tensor, completion_hidden: torch.Tensor, completion_mask: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
        """Keep the batch (and the values the advantages used) for the head's fit at the end of the step."""
        self.record((completion_hidden, reward, completion_mask, valid, self.values(completion_hidden)))

    def estimate(self, reward: torch.Tensor, values: torch.Tensor, completion_mask: torch.Tensor,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
        """GAE advantages [N, T] given the values [N, T]."""
        v = valid_mask(reward, valid)
        mask = completion_mask.float() * v.unsqueeze(-1)
        r = torch.where(v, reward.float(), torch.zeros_like(reward, dtype=torch.float32))
        adv, _ = gae_advantages_returns(token_rewards(r, mask), values.float(), mask, self.gamma, self.lam)
        if self.whiten:
            adv = masked_whiten(adv, mask)
        return (adv * mask).to(torch.float32)

    gather_observed = False  # each process fits on its own rows; the gradients are averaged over processes

    def end_step(self, step: StepEnd) -> dict:
        """Fit the value head on the step's batch (once per step; gradients averaged over processes)."""
        if not self.observed:
            return {}
        hidden, reward, mask, valid, values = self.observed[-1]
        return self.fit(hidden, reward, mask, valid, values, all_reduce=step.all_reduce_mean)

    # ---------------------------------------------------------------------------------------- the value head
    @torch.no_grad()
    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """V(s_t) [N, T] from hidden states [N, T, H] (the head is created, zero-initialised, on first use)."""
        return self.head(hidden)

    def fit(self, hidden: torch.Tensor, reward: torch.Tensor, completion_mask: torch.Tensor,
            valid: torch.Tensor | None, old_values: torch.Tensor,
            all_reduce: Callable[[torch.Tensor], None] | None = None) -> dict:
        """Regress the head on this batch's GAE returns; returns metrics. ``all_reduce`` averages a gradient
        tensor in place across processes (identical heads on every rank)."""
        v = valid_mask(reward, valid)
        mask = completion_mask.double() * v.unsqueeze(-1)
        r = torch.where(v, reward.double(), torch.zeros_like(reward, dtype=torch.float64))
        _, returns = gae_advantages_returns(token_rewards(r, mask), old_values, mask, self.gamma, self.lam)
        sel = mask > 0
        feats = hidden[sel].float()
        target = returns[sel].float()
        old = old_values[sel].float()
        if not self.head.made:
            self.head.make(hidden.shape[-1])
        n = max(int(sel.sum()), 1)
        loss_val = 0.0
        for _ in range(self.value_epochs):
            self.head.optimizer.zero_grad(set_to_none=False)
            pred = self.head(feats)
            err = (pred - target) ** 2
            if self.value_clip is not None:
                clipped = old + (pred - old).clamp(-self.value_clip, self.value_clip)
                err = torch.maximum(err, (clipped - target) ** 2)
            loss = 0.5 * err.sum() / n
            loss.backward()
            if all_reduce is not None:
                for p in self.head.parameters():
                    all_reduce(p.grad)
            self.head.optimizer.step()
            loss_val = float(loss.detach())
        ev = 0.0
        if sel.any():
            var = target.var(unbiased=False) if target.numel() > 1 else torch.tensor(0.0)
            ev = float(1 - (target - old).var(unbiased=False) / var) if var > 0 else 0.0
        return {"value/loss": loss_val, "value/explained_variance": ev,
                "value/mean": float(old.mean()) if old.numel() else 0.0}

    # ---------------------------------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict:
        return self.head.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state)
