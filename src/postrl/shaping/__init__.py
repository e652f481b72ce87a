"""Reward shaping: transforms of the named reward matrix, and its combination into the scalar reward.

Each shaping stage returns a dict of the batch fields it sets (``rewards`` [N, K] and/or ``reward`` [N]; stages
that add a named column also set ``reward_names`` and ``reward_weights``; process-reward stages set
``step_rewards`` [N, S]). The stages run in the order the config lists them; one of them must produce
``reward`` (normally ``weighted_sum``, last).

Modules: ``transforms`` (par, centered, running_norm, ensemble_mean/min/uwo/brme, dataset_median), ``process``
(clip_prm, delta_prm, min_form, gated, potential, thought_reward, pspo_wrs), ``length`` (overlong_soft,
truncation_penalty, laser, laser_d, grpo_lambda, kimi_length, cosine_length, conciseness_gated,
adaptive_length_coef, grsp), ``modes`` (thinkdial_budget, autothink), ``noise``
(reward_noise), ``diversity`` (diversity_potential, gardo_diversity); ``attribution`` holds the field producer
``occlusion_token_reward`` (token credit by occlusion, read by the advantage ``occlusion_credit``).
Stateful stages are classes (:class:`postrl.stages.Stateful`, built once per run by :func:`postrl.stages.build`):
``__call__`` reads the state, ``observe`` records the step's batches, ``end_step`` updates the state once per step;
their state travels with the checkpoint.
"""

from __future__ import annotations


import torch

from postrl.registry import register


@register("shaping", "weighted_sum", source="GRPO (DeepSeekMath); TRL reward_weights")
def weighted_sum(rewards: torch.Tensor, reward_weights: torch.Tensor, reward_skipped: torch.Tensor | None = None
                 ) -> dict:
    """r_i = sum_k w_k r_i^k over the K named reward sources that apply to completion i.

    Shapes: rewards [N, K], reward_weights [K], reward_skipped [N, K0] bool (K0 <= K: the scored sources; a column a
    shaping stage appended applies everywhere) -> reward [N]. A source that returned None for a row does not apply
    to it (``reward_skipped``) and adds nothing; a row no source applies to is NaN (excluded: TRL's "unscorable"
    row, whose advantage is 0). Any other NaN component (a failed reward) makes the sum NaN, so that completion is
    excluded downstream rather than scored as if the component were 0.
    Anchor: TRL ``reward_weights`` with ``nansum`` over the functions that returned a value
    (``multi_objective_aggregation='sum_then_normalize'``); unlike TRL, a failed (not None) entry excludes the row.
    """
    x = rewards * reward_weights.to(rewards.dtype)
    if reward_skipped is None or not bool(reward_skipped.any()):
        return {"reward": x.sum(-1)}
    skip = torch.zeros(rewards.shape, dtype=torch.bool, device=rewards.device)
    k0 = min(reward_skipped.shape[-1], rewards.shape[-1])
    skip[:, :k0] = reward_skipped[:, :k0].to(rewards.device)
    reward = torch.where(skip, torch.zeros_like(x), x).sum(-1)
    return {"reward": torch.where(skip.all(-1), torch.full_like(reward, float("nan")), reward)}


# (register the stages)
from postrl.shaping import attribution, diversity, length, modes, noise, process, transforms  # noqa: E402,F401
