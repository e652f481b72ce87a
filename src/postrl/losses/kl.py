"""KL(pi_theta || pi_ref) estimators, their straight-through variants, the KL-in-reward penalty and the KL
coefficient controller.

Estimators of the per-token KL from samples of pi_theta (Schulman, "Approximating KL Divergence", 2020),
d = logp - ref_logp. Each is registered as kind ``kl`` under its name and chosen by ``kl.estimator``:

| kl.estimator | value                         | gradient     | verl ``kl_loss_type`` / ``kl_penalty`` |
|--------------|-------------------------------|--------------|----------------------------------------|
| k1           | d                             | of k1        | k1 / kl                                |
| k2           | d^2 / 2                       | of k2        | k2 / mse                               |
| k3           | exp(-d) + d - 1               | of k3        | - (TRL ``beta``: k3 unclamped)         |
| low_var_kl   | min(k3, 10)                   | of k3; 0 where k3 > 10 | k3 / low_var_kl                |
| abs          | abs(d)                        | of abs       | abs                                    |
| k1+ k3+ abs+ | value of k1 / k3 / abs        | of k2        | k1+ / abs+                             |
| low_var_kl+  | value of low_var_kl           | of k2        | k3+ / low_var_kl+                      |

verl's k3 (``kl_loss_type`` / ``kl_penalty`` ``k3`` or ``low_var_kl``) clamps the estimate to [-10, 10] (k3 >= 0,
so only the upper bound binds): a token whose policy is far from the reference (k3 > 10, e.g. d = ref_logp -
logp > 12.4) adds a constant 10 and no gradient. TRL's ``beta`` term and postrl's ``k3`` do not clamp. Choose
``kl.estimator=low_var_kl`` to reproduce verl exactly, ``k3`` for TRL.

The "+" (straight-through) variants return ``k2 - sg(k2) + sg(k)``: the value of k (what is logged and, in
the loss, what the coefficient multiplies) with the gradient of k2, whose expected gradient on on-policy
samples is the gradient of KL(pi_theta || pi_ref) (verl ``kl_penalty`` with a trailing ``+``).

``kl.placement``: ``loss`` adds coef * agg(KL) to the loss; ``reward`` subtracts coef * sum_t m_t KL_t from each
completion's reward before the advantages (:func:`kl_reward_penalty`, verl ``use_kl_in_reward``).
``kl.controller``: ``fixed`` or ``adaptive`` (:class:`KLController`, Ziegler et al. 2019; verl
``kl_ctrl.type``).
"""

from __future__ import annotations

from typing import Callable

import torch

from postrl.registry import register


@register("kl", "k1", source="Schulman 2020 k1; verl kl_loss_type=k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased, high variance, can be negative)."""
    return logp - ref_logp


@register("kl", "k2", source="Schulman 2020 k2; verl kl_loss_type=mse")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 (logp - ref_logp)^2."""
    return 0.5 * (logp - ref_logp) ** 2


@register("kl", "k3", source="Schulman 2020 k3; GRPO paper; TRL beta")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 (unbiased, always >= 0). The log-ratio is clamped to
    [-20, 20] before the exp (as verl and TRL); k3 itself is not clamped (TRL; verl's clamped k3 is
    ``low_var_kl``)."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(d) - d - 1.0


LOW_VAR_KL_CLAMP = 10.0


@register("kl", "low_var_kl", source="verl kl_loss_type=low_var_kl / k3 (clamped k3)")
def kl_low_var_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """verl's k3: clamp(k3, -10, 10) (``kl_penalty_forward`` for ``low_var_kl`` / ``k3``); where k3 > 10 the value
    is 10 and the gradient 0."""
    return kl_k3(logp, ref_logp).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


@register("kl", "abs", source="verl kl_loss_type=abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """|logp - ref_logp|."""
    return (logp - ref_logp).abs()


def straight_through(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """Wrap an estimator: value of ``fn``, gradient of k2 (``k2 - sg(k2) + sg(fn)``)."""

    def st(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        k2 = kl_k2(logp, ref_logp)
        return k2 - k2.detach() + fn(logp, ref_logp).detach()

    st.__name__ = st.__qualname__ = f"{fn.__name__}_st"
    st.__doc__ = (f"Straight-through {fn.__name__[3:]}+: value of {fn.__name__[3:]}, gradient of k2 "
                  f"(k2 - sg(k2) + sg({fn.__name__[3:]})); verl kl_loss_type={fn.__name__[3:]}+.")
    return st


kl_k1_st = register("kl", "k1+", source="verl kl_loss_type=k1+ (straight-through)")(straight_through(kl_k1))
kl_k3_st = register("kl", "k3+", source="straight-through k3 (unclamped value)")(straight_through(kl_k3))
kl_low_var_kl_st = register("kl", "low_var_kl+", source="verl kl_loss_type=k3+ / low_var_kl+ "
                            "(straight-through, value of the clamped k3)")(straight_through(kl_low_var_kl))
kl_abs_st = register("kl", "abs+", source="verl kl_loss_type=abs+ (straight-through)")(
    straight_through(kl_abs))


def kl_reward_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                      estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """Per-sequence KL for the reward: kl_i = sum_t m_it k(logp_it, ref_logp_it) and the per-token values.

    The trainer sets r_i <- r_i - coef * kl_i before the advantages (verl ``algorithm.use_kl_in_reward``:
    token-level reward - beta * kl, summed over the sequence by outcome estimators such as GRPO; verl's default
    ``kl_penalty`` there is k1). Also returns the controller's measurement, mean_i of the per-sequence token
    mean (verl's ``current_kl``). Shapes: [N, T] -> (kl_seq [N], kl_tok [N, T], current_kl float).
    """
    with torch.no_grad():
        tok = estimator(logp, ref_logp) * mask
        seq = tok.sum(-1)
        lens = mask.sum(-1)
        has = lens > 0
        current = float((seq[has] / lens[has]).mean()) if bool(has.any()) else 0.0
    return seq, tok, current


class KLController:
    """The KL coefficient: fixed, or adapted toward a target KL (Ziegler et al. 2019, "Fine-Tuning Language
    Models from Human Preferences"; verl ``AdaptiveKLController``).

    Adaptive update after each step, with ``current`` the step's measured KL and ``n`` its number of sequences:
    e = clip(current / target - 1, -0.2, 0.2);  coef <- coef * (1 + e * n / horizon).
    Defaults target = 0.1, horizon = 10000 (verl ``kl_ctrl.target_kl`` / ``kl_ctrl.horizon``). The coefficient
    is part of the checkpoint (``state_dict``), so a resumed run continues with the adapted value.
    """

    def __init__(self, coef: float, *, adaptive: bool = False, target: float = 0.1, horizon: int = 10000):
        if adaptive and (target <= 0 or horizon <= 0):
            raise ValueError(f"kl: adaptive controller needs target > 0 and horizon > 0, got {target} / {horizon}")
        self.value = float(coef)
        self.adaptive = adaptive
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current: float, n_steps: int) -> None:
        if not self.adaptive:
            return
        err = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
