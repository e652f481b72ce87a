"""Occupancy-measure regularisation with a learned discriminator: chi^2(mu_pi || mu_ref) (ORPO).

"Correlated Proxies: A New Definition and Improved Mitigation for Reward Hacking" (Laidlaw et al.): regularising the
chi^2 divergence between the occupancy measures of the policy and of the base (reference) policy mitigates reward
hacking better than a KL between action distributions. The occupancy ratio is estimated by a small discriminator
trained on state-action features of both policies.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from annotated_types import Ge, Gt
from torch import nn
from torch.nn import functional as F

from postrl.registry import register
from postrl.stages import StepEnd, Stateful

_SOURCE = "Correlated Proxies: A New Definition and Improved Mitigation for Reward Hacking (ORPO)"
Positive = Annotated[float, Gt(0)]


def reward_to_go(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_t = sum_{k >= t} m_k x_k per row, on the mask (0 elsewhere). [N, T]."""
    xm = x * mask
    return (xm.flip(-1).cumsum(-1).flip(-1)) * mask


def prefix_log_ratio(ref_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                     cap: float) -> torch.Tensor:
    """l_t = clamp(sum_{k <= t} m_k (ref_logp_k - behaviour_logp_k), -cap, cap): log of the reference's over the
    sampling policy's probability of the completion's prefix up to and including token t. [N, T]."""
    return ((ref_logp - behaviour_logp) * mask).cumsum(-1).clamp(-cap, cap)


@register("regularizer", "chi2_occupancy", source=_SOURCE)
class Chi2Occupancy(Stateful):
    """chi^2 occupancy-measure regulariser to the reference, estimated with a small discriminator (after ORPO).

    A per-token penalty exp(d) - 1 from a discriminator whose logit d estimates log(mu_pi / mu_ref) on state-action
    features, paid through the policy gradient.

    Occupancy. For a language model the state-action pair of token t is (prompt, o_<t, o_t): the feature x_t is the
    policy's last hidden state at token t (``token_hidden``, produced through the model context). mu_pi = the
    current policy's rollouts (the batch); the reference's rollouts are not sampled: the same tokens stand for
    them, importance-weighted by the probability ratio of the prefix, exact for token sequences (the transition is
    deterministic): mu_ref(x_t) / mu_pi(x_t) = prod_{k <= t} pi_ref(o_k) / pi_b(o_k), pi_b the policy that
    sampled the batch (``old_logprobs``, or ``sampler_logprobs`` in a single pass), log-weight
    l_t = clamp(sum_{k <= t} (ref_logp_k - b_logp_k), -``max_log_ratio``, ``max_log_ratio``) (5).
    Discriminator (once per step, ``end_step``, on what ``observe`` recorded: at most ``max_tokens`` (4096) loss
    tokens per process and step, drawn uniformly, seeded): features standardised with the mean and std of its first
    batch, an MLP d = Linear(H, ``hidden``) -> tanh -> Linear(hidden, 1) (``hidden`` 64; 0: logistic regression),
    ``updates`` (20) full-batch Adam steps (``lr`` 1e-3) on the balanced logistic loss
      L_D = (1/n) sum_t softplus(-d(x_t)) + sum_t wbar_t softplus(d(x_t)),  wbar = softmax(l) (self-normalised),
    whose minimiser is d = log(mu_pi / mu_ref) in the feature space. Its metrics: ``disc_loss``, ``chi2`` = the
    policy samples' mean of exp(d) - 1 (an estimate of chi^2(mu_pi || mu_ref) = E_pi[mu_pi / mu_ref] - 1) and
    ``ess`` = 1 / (n sum wbar^2) (the importance weights' effective sample fraction).
    Penalty (each forward pass, no gradient through d): p_t = clamp(exp(d(x_t)) - 1, -1, ``clip``) (10), the
    derivative of chi^2 with respect to mu_pi, i.e. ORPO's per-step reward -coef p_t (its released code's
    ``chi2`` discriminator reward exp(d) - 1, clipped); as a reward summed over the rest of the completion, it
    reaches the loss through the policy gradient:
      R_t = sg(G_t) rho_t,   G_t = sum_{k >= t} m_k p_k,   rho_t = exp(logp_t - old_logp_t)
    so the loss's coef * agg(R) lowers the probability of tokens whose continuation the discriminator marks as
    visited more by the policy than by the reference. Before the first discriminator update R = 0 (at the first
    step the policy is the reference). The discriminator's weights are in the checkpoint. Assumed where the
    abstract is open: the features (the policy's hidden state; ORPO's discriminators read the environment's
    state and action), the importance-weighted reference samples in place of reference rollouts, the reward-to-go
    without discount or baseline (p = 0 where the occupancies agree), and the defaults above (postrl's; ORPO's
    clip is a tuned option). Needs a reference model (``ref_logprobs``). Memory: token_hidden is [N, T, H].
    Shapes: logp, old_logp, mask [N, T]; token_hidden [N, T, H] -> [N, T].
    """

    def __init__(self, *, hidden: Annotated[int, Ge(0)] = 64, lr: Positive = 1e-3, updates: Annotated[int, Ge(1)] = 20,
                 clip: Positive = 10.0, max_log_ratio: Positive = 5.0, max_tokens: Annotated[int, Ge(1)] = 4096,
                 seed: int = 0):
        self.hidden, self.lr, self.updates = int(hidden), float(lr), int(updates)
        self.clip, self.max_log_ratio, self.max_tokens, self.seed = float(clip), float(max_log_ratio), \
            int(max_tokens), int(seed)
        self.net: nn.Module | None = None
        self.mu: torch.Tensor | None = None
        self.sigma: torch.Tensor | None = None
        self.steps = 0  # discriminator updates so far
        self._recorded = 0  # observe calls this step (the subsample's seed)

    # ------------------------------------------------------------------------------------------------ discriminator
    def _build(self, dim: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            if self.hidden == 0:
                return nn.Linear(dim, 1)
            return nn.Sequential(nn.Linear(dim, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def logit(self, x: torch.Tensor) -> torch.Tensor:
        """d(x) for features x [..., H] (standardised first) -> [...]."""
        net = self.net.to(x.device)
        z = (x.float() - self.mu.to(x.device)) / self.sigma.to(x.device)
        return net(z).squeeze(-1)

    def penalty(self, token_hidden: torch.Tensor) -> torch.Tensor:
        """p = clamp(exp(d) - 1, -1, clip) per token [N, T] (0 before the first discriminator update)."""
        if self.net is None:
            return torch.zeros(token_hidden.shape[:-1], device=token_hidden.device)
        with torch.no_grad():
            d = self.logit(token_hidden).clamp(max=math.log1p(self.clip))
            return torch.expm1(d).clamp(-1.0, self.clip)

    # ------------------------------------------------------------------------------------------------ the stage
    def __call__(self, logp: torch.Tensor, old_logp: torch.Tensor, token_hidden: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        p = self.penalty(token_hidden).to(logp.dtype)
        G = reward_to_go(p, mask)
        ratio = torch.exp((logp - old_logp.detach()).clamp(-20.0, 20.0))
        return G.detach() * ratio

    def observe(self, token_hidden: torch.Tensor, completion_mask: torch.Tensor, ref_logprobs: torch.Tensor,
                sampler_logprobs: torch.Tensor, old_logprobs: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> None:
        m = completion_mask.float()
        if valid is not None:
            m = m * valid.float().unsqueeze(-1)
        b = old_logprobs if old_logprobs is not None else sampler_logprobs
        on = m > 0
        if not bool(torch.isfinite(b.float()[on]).all()):
            raise ValueError("regularizer 'chi2_occupancy' needs the log-probs of the policy that sampled the batch "
                             "(old_logprobs or sampler_logprobs); this driver gives neither")
        lw = prefix_log_ratio(ref_logprobs.float(), torch.where(on, b.float(), torch.zeros_like(m)), m,
                              self.max_log_ratio)
        x, w = token_hidden.float()[on], lw[on]
        if x.shape[0] > self.max_tokens:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.steps * 1009 + self._recorded)
            keep = torch.randperm(x.shape[0], generator=gen)[:self.max_tokens]
            x, w = x[keep], w[keep]
        self._recorded += 1
        self.record((x.detach().cpu(), w.detach().cpu()))

    def end_step(self, step: StepEnd) -> dict:
        self._recorded = 0
        if not self.observed:
            return {}
        X = torch.cat([x for x, _ in self.observed])
        lw = torch.cat([w for _, w in self.observed]).to(torch.float64)
        if X.shape[0] == 0:
            return {}
        if self.net is None:
            self.mu = X.mean(0)
            self.sigma = X.std(0, unbiased=False).clamp(min=1e-6)
            self.net = self._build(X.shape[1])
        net = self.net.cpu()
        wbar = torch.softmax(lw, 0).float()
        opt = torch.optim.Adam(net.parameters(), lr=self.lr)
        z = (X - self.mu) / self.sigma
        for _ in range(self.updates):
            d = net(z).squeeze(-1)
            loss = F.softplus(-d).mean() + (wbar * F.softplus(d)).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        self.steps += 1
        with torch.no_grad():
            d = net(z).squeeze(-1)
            loss = F.softplus(-d).mean() + (wbar * F.softplus(d)).sum()
            chi2 = torch.expm1(d.clamp(max=math.log1p(self.clip))).mean()
        return {"disc_loss": float(loss), "chi2": float(chi2), "ess": float(1.0 / (len(wbar) * (wbar ** 2).sum()))}

    # ------------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        if self.net is None:
            return {"steps": self.steps, "net": None}
        return {"steps": self.steps, "dim": int(self.mu.numel()), "mu": self.mu.tolist(),
                "sigma": self.sigma.tolist(),
                "net": {k: v.detach().cpu().tolist() for k, v in self.net.state_dict().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        if state.get("net") is None:
            self.net = self.mu = self.sigma = None
            return
        self.mu = torch.tensor(state["mu"], dtype=torch.float32)
        self.sigma = torch.tensor(state["sigma"], dtype=torch.float32)
        self.net = self._build(int(state["dim"]))
        self.net.load_state_dict({k: torch.tensor(v, dtype=torch.float32) for k, v in state["net"].items()})
