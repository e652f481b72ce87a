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
``kl.controller``: ``fixed``, ``adaptive`` (:class:`KLController`, Ziegler et al. 2019; verl ``kl_ctrl.type``) or
``pid`` (after SAFE: a threshold on the tracked KL moved by a PID on the reward velocity, gated by the entropy).
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
    """The KL coefficient (``kl.controller``): ``fixed``, ``adaptive`` toward a target KL (Ziegler et al. 2019,
    "Fine-Tuning Language Models from Human Preferences"; verl ``AdaptiveKLController``), or ``pid`` (after SAFE).
    Updated once per step (``Objective.end_step``); the value is part of the checkpoint (``state_dict``), so a
    resumed run continues with it (the ``pid`` controller's trackers too).

    ``adaptive``, after each step with ``current`` the step's measured KL and ``n`` its number of sequences:
    e = clip(current / target - 1, -0.2, 0.2);  coef <- coef * (1 + e * n / horizon).
    Defaults target = 0.1, horizon = 10000 (verl ``kl_ctrl.target_kl`` / ``kl_ctrl.horizon``).

    ``pid``: after "SAFE: Stable Alignment Finetuning with Entropy-Aware Predictive Control for RLHF" (entropy-gated
    KL regulation with a PID-controlled threshold driven by the reward velocity). With the step's measured KL
    ``current``, mean reward r (``reward/mean``) and aggregated token entropy H (``entropy``), after step t:
      Kbar_t = 0.9 Kbar_{t-1} + 0.1 current                       (short KL tracker, Kbar_0 = 0)
      Rbar_t = 0.95 Rbar_{t-1} + 0.05 r, v_t = Rbar_t - Rbar_{t-1}  (reward velocity; Rbar_1 = r, v_1 = 0)
      e_t = v_t - v*  (v* = ``reward_velocity`` = 0.001; e_1 = 0),  I_t = clip(I_{t-1} + e_t, -1, 1)
      u_t = kp e_t + ki I_t + kd (e_t - e_{t-1})                     (``pid_gains`` = (0.3, 0.01, 0.05))
      tau_t = clip(target + u_t, target / 3, 2 target)              (the KL threshold; SAFE: 0.3 in [0.1, 0.6])
      g_t = max(0.5, H_floor / (H + 0.1))                           (entropy gate, H_floor = ``entropy_floor`` = 2)
      coef_{t+1} = kl.coef * g_t * max(0, Kbar_t - tau_t) / tau_t    (coef_1 = 0)
    So the KL term is off while the tracked KL stays under the threshold, a rising reward (v above v*) raises the
    threshold (learning goes on), a falling one lowers it (a brake before a crash), and low entropy (mode
    collapse) amplifies the coefficient while high entropy (exploration) halves it at most. Assumed where SAFE is
    open or its released code differs: SAFE penalises (c/2) g (Kbar - tau)_+^2 with a constant c = 0.1; as a
    coefficient on postrl's KL term that is the hinge's slope, c g (Kbar - tau)_+, normalised here by tau so that
    ``kl.coef`` is unit-free (coef * g when the tracked KL is twice the threshold); the threshold's range is
    SAFE's [0.1, 0.6] scaled to ``kl.target`` (SAFE's 0.3); SAFE's phase detector (a threshold multiplier from
    the reward history) is not implemented; H missing (no entropy measured): g = 1. Defaults are SAFE's except
    the threshold (postrl's ``kl.target`` 0.1: per-token KLs of RLVR runs are far below SAFE's 0.3).
    """

    def __init__(self, coef: float, *, mode: str | None = None, adaptive: bool = False, target: float = 0.1,
                 horizon: int = 10000, pid_gains: tuple[float, float, float] = (0.3, 0.01, 0.05),
                 reward_velocity: float = 0.001, entropy_floor: float = 2.0):
        mode = mode or ("adaptive" if adaptive else "fixed")
        if mode in ("adaptive", "pid") and target <= 0:
            raise ValueError(f"kl: the {mode} controller needs target > 0, got {target}")
        if mode == "adaptive" and horizon <= 0:
            raise ValueError(f"kl: adaptive controller needs horizon > 0, got {horizon}")
        self.mode = mode
        self.adaptive = mode == "adaptive"
        self.coef = float(coef)
        self.value = 0.0 if mode == "pid" else float(coef)
        self.target = float(target)
        self.horizon = int(horizon)
        self.kp, self.ki, self.kd = (float(g) for g in pid_gains)
        self.reward_velocity = float(reward_velocity)
        self.entropy_floor = float(entropy_floor)
        self.pid = {"kl": 0.0, "reward": None, "integral": 0.0, "error": 0.0}

    def update(self, current: float, n_steps: int, *, reward: float | None = None,
               entropy: float | None = None) -> dict:
        """The step's update; returns the ``pid`` controller's readings (``kl_threshold``, ``kl_tracked``,
        ``kl_entropy_gate``), nothing for the others."""
        if self.mode == "adaptive":
            err = min(max(current / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + err * n_steps / self.horizon
        if self.mode != "pid":
            return {}
        st = self.pid
        st["kl"] = 0.9 * st["kl"] + 0.1 * float(current)
        e = 0.0
        if reward is not None and reward == reward:  # (NaN: no reading this step)
            if st["reward"] is None:
                st["reward"] = float(reward)
            else:
                old = st["reward"]
                st["reward"] = 0.95 * old + 0.05 * float(reward)
                e = (st["reward"] - old) - self.reward_velocity
                st["integral"] = min(max(st["integral"] + e, -1.0), 1.0)
        u = self.kp * e + self.ki * st["integral"] + self.kd * (e - st["error"])
        st["error"] = e
        tau = min(max(self.target + u, self.target / 3.0), 2.0 * self.target)
        gate = max(0.5, self.entropy_floor / (entropy + 0.1)) if entropy is not None and entropy == entropy else 1.0
        self.value = self.coef * gate * max(0.0, st["kl"] - tau) / tau
        return {"kl_threshold": tau, "kl_tracked": st["kl"], "kl_entropy_gate": gate}

    def state_dict(self) -> dict:
        return {"value": self.value, **({"pid": dict(self.pid)} if self.mode == "pid" else {})}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        if self.mode == "pid" and "pid" in state:
            self.pid = dict(state["pid"])
