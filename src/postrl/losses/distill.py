"""On-policy distillation: a term pulling the policy toward a frozen teacher on the policy's own samples.

Configured as one regulariser entry (``regularizers: [{name: distill, coef: 1.0, ...}]``) with a teacher
(``model.teacher.path``, a model folder with the policy's vocabulary). The trainer runs the teacher on every
batch the objective reads it for and stores its per-token log-probs as the batch field ``teacher_logp``
(``batch.teacher_logprobs``), exactly as it does for the reference model's ``ref_logp``
(:data:`postrl.train.policy.FROZEN`). The teacher scores the policy's sampled tokens only: a per-token estimator of
the reverse KL KL(pi_theta || pi_teacher) on y ~ pi_theta, not a sum over the vocabulary.

KEPO ("Knowledge-Enhanced Preference Optimization for Reinforcement Learning with Reasoning") adds two things to
plain on-policy distillation: a *quality gate* (distil only the trajectories whose reward is at least a threshold:
the field ``distill_gate``, set in the same entry) and teacher-hint resampling of the groups where every
completion failed (the expansion ``teacher_hint``, :mod:`postrl.selection.expansions`).

The anchors, with what is equal:

* verl 0.9 ``distillation`` (``trainer/distillation/losses.py``): ``distillation_loss`` with a per-token estimator
  (``distillation_loss.loss_mode`` in ``kl``/``k1``, ``mse``/``k2``, ``abs``, ``low_var_kl``/``k3``) computes
  d_t = kl_penalty(log pi_theta, log pi_teacher) on the sampled tokens, clamps it to [-c, c] with
  ``loss_max_clamp`` c, and either (``use_policy_gradient=True``) feeds A_t = -sg(d_t) to its ``vanilla`` PPO
  loss (``clip_ratio_low/high``, dual clip 3) or (``use_policy_gradient=False``) back-propagates d_t itself; the
  result is aggregated with the actor's ``loss_agg_mode`` and added to the policy loss times
  ``distillation_loss_coef``. ``distill`` computes the same per-token matrix (``estimator``, ``mode``,
  ``eps_low``/``eps_high``, ``dual_clip``, ``max_clamp``); the objective aggregates it with ``loss.agg`` and
  multiplies it by ``coef``: equal in value and gradient (``tests/test_distill.py`` calls verl's function).
  verl's ``k3`` is postrl's ``low_var_kl`` (clamped at 10); postrl's ``k3`` is unclamped.
* TRL's ``GKDTrainer.generalized_jsd_loss`` / ``DistillationTrainer`` with ``beta=1`` (``lmbda=1``: on-policy)
  is the reverse KL summed over the whole vocabulary from both models' logits. Not the same quantity: ``distill``
  sees the teacher's log-prob of the sampled token only. What holds exactly, for a fixed prefix and y_t ~ pi_theta:
  E[k1] = KL(pi_theta || pi_teacher) (TRL's value), and the expected gradient of the policy-gradient form with k1
  on the first pass (ratio 1), E[k1_t grad log pi(y_t)], equals the gradient of TRL's beta=1 loss; so does the
  ``direct`` form with ``k2``. The ``direct`` form with ``k3`` has the expected gradient of TRL's beta=0 loss
  (forward KL(pi_teacher || pi_theta)). ``tests/test_distill.py`` checks these by summing over the vocabulary.
* The "advantage" form (Thinking Machines' on-policy distillation, slime ``--use-opd``, Tinker:
  A_t <- A_t - coef * k1_t inside the one policy loss) has, on the first pass (ratio 1), the gradient of the
  policy loss plus ``coef`` x the policy-gradient ``distill`` term; they differ only once PPO's clip binds.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from annotated_types import Gt

from postrl import registry
from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.errors import ConfigError, DataError
from postrl.losses.policy import ClipHigh, ClipLow, ppo_clip
from postrl.registry import register
from postrl.stages import parameters

KEPO = "KEPO: Knowledge-Enhanced Preference Optimization for Reinforcement Learning with Reasoning"
SOURCE = ("On-Policy Distillation of Language Models (Agarwal et al. 2024, GKD); verl distillation "
          "(use_policy_gradient / loss_mode); quality gate: " + KEPO)


@register("field", "distill_gate", source=KEPO + " (quality-gated distillation)")
def distill_gate(ctx: ModelContext, batch: RolloutBatch, *, gate_reward: str | None = None,
                 gate_threshold: float | None = None) -> torch.Tensor:
    """KEPO's quality gate [N] float: 1 for a trajectory whose reward is >= ``gate_threshold``, 0 otherwise.

    ``gate_reward``: the reward source whose raw value is compared (``raw_rewards``, before shaping: e.g.
    ``correct``); None (default): the scalar reward ``reward`` after shaping (with ``kl.placement=reward``, after
    the KL penalty). ``gate_threshold`` None (default): no gate, every row 1. A failed (NaN) reward is 0. No model
    call: the gate reads the scored batch."""
    n = len(batch)
    if gate_threshold is None:
        return torch.ones(n)
    if gate_reward is None:
        x = batch.reward
    else:
        raw, names = batch.raw_rewards, batch.extra.get("raw_reward_names")
        if raw is None or names is None:
            raw, names = batch.rewards, batch.reward_names
        names = list(names)
        if gate_reward not in names:
            raise DataError(f"regularizers.distill.gate_reward: no reward source named '{gate_reward}' in this "
                            f"batch; rewards: {', '.join(names)}")
        x = raw[:, names.index(gate_reward)]
    x = x.float()
    return (torch.isfinite(x) & (x >= gate_threshold)).float()


def _distill_check(params: dict, run: Any, where: str) -> dict:
    """The estimator is a registered KL estimator; ``direct`` with ``k1`` has no teacher in its gradient (verl
    refuses it too); a run needs ``model.teacher.path``; ``gate_reward`` names one of the run's reward sources."""
    p = {**{k: d for k, (_, d) in parameters(distill).items()}, **params}
    if p["estimator"] not in registry.names("kl"):
        raise ConfigError(f"{where}.estimator: unknown KL estimator '{p['estimator']}'; valid: "
                          f"{', '.join(registry.names('kl'))}")
    if p["mode"] == "direct" and p["estimator"] == "k1":
        raise ConfigError(f"{where}.estimator: k1 with mode direct: the gradient of k1 = logp - teacher_logp does not "
                          f"depend on the teacher (verl refuses it too); use k1 with mode policy_gradient, or k2 / k3 "
                          f"/ low_var_kl with mode direct")
    if run is not None:
        if run.model.teacher.path is None:
            raise ConfigError(f"{where}: distill reads the teacher's log-probs (teacher_logp): set model.teacher.path "
                              f"(a model folder with the policy's vocabulary)")
        gate = params.get("gate_reward")
        names = [r.name for r in run.rewards]
        if gate is not None and gate not in names:
            raise ConfigError(f"{where}.gate_reward: no reward source named '{gate}' in this run; rewards: "
                              f"{', '.join(names)}")
    return params


@register("regularizer", "distill", source=SOURCE, needs=("teacher",), check=_distill_check)
def distill(logp: torch.Tensor, old_logp: torch.Tensor, teacher_logp: torch.Tensor, distill_gate: torch.Tensor, *,
            estimator: str = "k1", mode: Literal["policy_gradient", "direct"] = "policy_gradient",
            eps_low: ClipLow = 0.2, eps_high: ClipHigh = 0.2, dual_clip: Annotated[float, Gt(1)] | None = 3.0,
            max_clamp: Annotated[float, Gt(0)] | None = None) -> torch.Tensor:
    """On-policy distillation toward the teacher (reverse KL on the policy's samples), gated by trajectory quality.

    Per token of the policy's own completion, with the teacher's log-prob of the same token (``teacher_logp``,
    from ``model.teacher.path`` at the rollout temperature) and a KL estimator of kind ``kl`` (``estimator``,
    default ``k1``):
        d_t = estimator(logp_t, teacher_logp_t)        k1: logp_t - teacher_logp_t; E_{y~pi}[k1] = KL(pi || pi_T)
        d_t = clip(d_t, -max_clamp, max_clamp)         when ``max_clamp`` is set
        mode policy_gradient (default; reverse KL as a negative per-token reward, Thinking Machines / verl
            ``use_policy_gradient=True``):  R_t = ppo_clip(logp, old_logp, A_t = -sg(d_t); eps_low, eps_high,
            dual_clip), i.e. max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)), for A < 0 at most -A dual_clip
        mode direct (GKD's supervised form, verl ``use_policy_gradient=False``): R_t = d_t, differentiated
            through logp (k2: the expected gradient of the reverse KL; k3: of the forward KL; k1 is refused)
        R_t *= g_i                                      g = ``distill_gate`` (KEPO's quality gate, default all 1)
    The objective adds ``coef`` x sum(w R) (w: the run's ``loss.agg`` weights), so a gated-out row adds 0 and the
    aggregation's normaliser is unchanged. In policy_gradient mode at ratio 1 the term's value is the aggregated
    d (``reg/distill``: the mean reverse-KL estimate with k1).
    Defaults: k1, policy_gradient, eps 0.2 / 0.2, dual clip 3 (verl's vanilla loss, whose ``clip_ratio_c`` the
    distillation config leaves at 3), no clamp (verl's YAML ``loss_max_clamp: null``). Anchor: verl
    ``distillation.distillation_loss`` with ``loss_mode`` = estimator (verl ``k3`` = postrl ``low_var_kl``),
    ``use_policy_gradient`` = (mode == policy_gradient), ``clip_ratio_low/high`` = eps, ``loss_max_clamp`` =
    max_clamp, ``distillation_loss_coef`` = coef, ``use_task_rewards=True``: equal in value and gradient with the
    same aggregation. KEPO's gate: ``gate_threshold`` / ``gate_reward`` (the producer ``distill_gate``); assumed
    where the abstract is silent: a hard 0/1 gate per trajectory on its reward, the aggregation's normaliser kept.
    Shapes: logp, old_logp, teacher_logp [N, T]; distill_gate [N] -> [N, T].
    """
    d = registry.get("kl", estimator)(logp, teacher_logp)
    if max_clamp is not None:
        d = d.clamp(-max_clamp, max_clamp)
    if mode == "direct":
        out = d
    else:
        out, _ = ppo_clip(logp, old_logp, -d.detach(), eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    return out * distill_gate.to(out.dtype).unsqueeze(-1)


__all__ = ["distill", "distill_gate", "KEPO"]
