"""Reward shaping: transforms of the named reward matrix, and its combination into the scalar reward.

Each shaping stage returns a dict of the batch fields it sets (``rewards`` [N, K] and/or ``reward`` [N]; stages
that add a named column also set ``reward_names`` and ``reward_weights``; process-reward stages set
``step_rewards`` [N, S]). The stages run in the order the config lists them; one of them must produce
``reward`` (normally ``weighted_sum``, last).

Modules: ``transforms`` (par, centered, running_norm, ensemble_mean/min/uwo, dataset_median), ``process``
(clip_prm, delta_prm, min_form, gated, potential), ``length`` (overlong_soft, truncation_penalty, laser, laser_d,
grpo_lambda, kimi_length, cosine_length, conciseness_gated, adaptive_length_coef, step_length_regularizer).
Stateful stages are classes (built once per run by :func:`build_stage`) with ``state_dict`` /
``load_state_dict``; the trainer saves their state in the checkpoint.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from postrl import registry
from postrl.registry import register


@register("shaping", "weighted_sum", source="GRPO (DeepSeekMath); TRL reward_weights")
def weighted_sum(rewards: torch.Tensor, reward_weights: torch.Tensor) -> dict:
    """r_i = sum_k w_k r_i^k over the K named reward sources.

    Shapes: rewards [N, K], reward_weights [K] -> reward [N]. A NaN component (a failed reward) makes the sum
    NaN, so that completion is excluded downstream rather than scored as if the component were 0.
    Anchor: TRL ``reward_weights`` (TRL instead treats None as NaN and uses ``nansum``; postrl excludes).
    """
    return {"reward": (rewards * reward_weights.to(rewards.dtype)).sum(-1)}


def build_stage(kind: str, name: str, params: dict) -> tuple[Any, dict, str]:
    """(callable, call params, name) for a configured stage: a class is instantiated once with its params."""
    fn = registry.get(kind, name)
    if inspect.isclass(fn):
        return fn(**params), {}, name
    return fn, dict(params), name


def stages_state(stages: list[tuple[Any, dict, str]]) -> dict:
    """JSON-serialisable state of the stateful stages, keyed '<position>:<name>'."""
    return {f"{i}:{name}": fn.state_dict() for i, (fn, _, name) in enumerate(stages) if hasattr(fn, "state_dict")}


def load_stages_state(stages: list[tuple[Any, dict, str]], state: dict | None) -> None:
    for i, (fn, _, name) in enumerate(stages):
        key = f"{i}:{name}"
        if hasattr(fn, "load_state_dict") and state and key in state:
            fn.load_state_dict(state[key])


from postrl.shaping import length, process, transforms  # noqa: E402,F401  (register the stages)
