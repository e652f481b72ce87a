"""Hybrid-policy losses: the policy's own rollouts and external demonstrations in one objective (RL-PLUS).

The demonstrations join their prompt's group through the expansion ``demonstrations``
(:mod:`postrl.selection.guidance`), which marks them (``extra['demonstration']``) and sets their sampler log-probs
to the behaviour policy's, log pi_theta_old of each demonstration token at rollout time.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from annotated_types import Ge, Gt, Le

from postrl.errors import ConfigError
from postrl.losses.policy import ClipHigh, ClipLow, _adv, _ratio
from postrl.registry import register

RL_PLUS = ("RL-PLUS: Countering Capability Boundary Collapse of LLMs in Reinforcement Learning with Hybrid-policy "
           "Optimization")


def _demonstrations_needed(params: dict, run: Any, where: str) -> dict:
    """The loss weighs the rows the ``demonstrations`` expansion adds: the run must list it."""
    if run is not None and not any(f.name == "demonstrations" for f in run.filters):
        raise ConfigError(f"{where}: rl_plus mixes external demonstrations into the groups: add filters: [{{name: "
                          f"demonstrations, column: <the prompt rows' demonstration column>}}]")
    return params


@register("loss", "rl_plus", source=RL_PLUS, check=_demonstrations_needed)
def rl_plus(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, demonstration: torch.Tensor, *,
            eps_low: ClipLow = 0.2, eps_high: ClipHigh = 0.2, clip: bool = True, gamma: Annotated[float, Ge(0)] = 0.5,
            external_prob: Annotated[float, Gt(0), Le(1)] | None = None):
    """RL-PLUS: PPO on the policy's rollouts; on demonstrations, the multiple-importance-sampling ratio against the
    mixture behaviour policy times the exploration-based advantage.

    Rollout rows (``demonstration`` False): L_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high)),
    rho_t = pi_theta / pi_theta_old (``clip: false``: L_t = -A rho_t, the authors' launch script).
    Demonstration rows e (joined to their prompt's group by the ``demonstrations`` expansion, so A is the run's
    advantage over the group with them, e.g. GRPO's):
        r^m_t = pi_theta(e_t) / (1/2 pi_theta_old(e_t) + 1/2 pi_omega(e_t))      multiple importance sampling with
                the balance heuristic: the mixture of the two behaviour policies, the policy at rollout time and
                the demonstrations' external source pi_omega
        C_t   = (1 - sg(pi_theta(e_t)))^gamma                                      exploration-based weight: a
                correct token the policy finds unlikely gets (nearly) the full advantage, a likely one little
        L_t   = -r^m_t A C_t
    pi_omega is unknown for external text: ``external_prob`` None (default) uses the estimate of the authors'
    released code (``rlplus_core_alg.py``, strategy RL-PLUS), pi_omega = (pi_theta_old + 1) / 2; a number p uses
    pi_omega = p for every token (1: a deterministic demonstrator, as LUFFY assumes). Default gamma 0.5, the
    exponent of the released code. Probabilities are the temperature-scaled policy's (as ``logp``). All of it after
    "RL-PLUS" (abstract: "Multiple Importance Sampling to address distributional mismatch from external data, and
    Exploration-Based Advantage Function to guide the model towards high-value, unexplored reasoning paths");
    assumed beyond the abstract: the pi_omega estimate and gamma of the released code, no clip on the
    demonstration ratio (the released code clips neither), and C_t applied to the demonstration rows only.
    Shapes: logp, old_logp [N, T]; advantages [N] or [N, T]; demonstration [N] bool -> ([N, T] loss, info).
    """
    adv = _adv(advantages)
    demo = demonstration.bool().unsqueeze(-1)
    ratio = _ratio(logp, old_logp)
    pg1 = -adv * ratio
    on = torch.maximum(pg1, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)) if clip else pg1
    p, p_old = torch.exp(logp), torch.exp(old_logp.detach())
    p_omega = (p_old + 1.0) / 2.0 if external_prob is None else torch.full_like(p_old, float(external_prob))
    mis = p / (0.5 * p_old + 0.5 * p_omega)
    explore = (1.0 - p.detach()).clamp(min=0.0) ** gamma
    off = -mis * adv * explore
    loss = torch.where(demo, off, on)
    on_rows = ~demo
    zero = torch.zeros_like(logp, dtype=torch.bool)
    info = {
        "ratio": torch.where(demo, mis, ratio).detach(),
        "clip_low": ((ratio < 1.0 - eps_low) & (adv < 0) & on_rows).detach() if clip else zero,
        "clip_high": ((ratio > 1.0 + eps_high) & (adv > 0) & on_rows).detach() if clip else zero,
    }
    return loss, info


__all__ = ["rl_plus"]
