"""Reward models you can check: Bradley-Terry (+ margin, per-comparison rationality from a bias judge, learned
per-label rationality, ensembles, ODIN, iterative data smoothing), process reward models with Monte-Carlo step
labels, and their evaluation.

* :mod:`~postrl.reward_models.model` -- :class:`RewardModel` (HF backbone + heads), :class:`RewardEnsemble`,
  ``save_pretrained`` / ``from_pretrained`` / :func:`load_reward_model`.
* :mod:`~postrl.reward_models.train` -- the preference losses and :func:`fit_reward_model`.
* :mod:`~postrl.reward_models.prm` -- Monte-Carlo step labels and PRM training.
* :mod:`~postrl.reward_models.metrics` -- pairwise / one-vs-many accuracy, preference ECE, STARC distance,
  ensemble aggregation.
* :mod:`~postrl.reward_models.data` -- reading and checking preference files.
* :mod:`~postrl.reward_models.backbones` -- ``AutoModel`` folders, ``tiny:<size>`` Llamas, ``bag:<dim>``.
* :mod:`~postrl.reward_models.heron` -- HERON's pairs from an ordered list of reward factors (``postrl rm heron``).
* :mod:`~postrl.reward_models.critique` -- Critique-out-Loud: critics, critiques in the text the head reads.

CLI: ``postrl rm train``, ``postrl rm eval``, ``postrl rm heron``, ``postrl prm train``, ``postrl calibrate``
(:mod:`postrl.cli.rm`, :mod:`postrl.cli.prm`, :mod:`postrl.cli.calibrate`). Names are imported lazily so that the CLI starts without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PreferencePair": "data", "check_preferences": "data", "read_preferences": "data",
    "RewardModel": "model", "RewardEnsemble": "model", "load_reward_model": "model", "reduce_steps": "model",
    "step_pieces": "model",
    "RMTrainConfig": "train", "bt_loss": "train", "fit_reward_model": "train", "train_reward_model": "train",
    "pearson": "train", "odin_penalties": "train", "comparison_betas": "train", "online_step": "train",
    "heron_pairs": "heron", "parse_factors": "heron", "Critic": "critique", "cloud_scores": "critique",
    "StepRecord": "prm", "fit_prm": "prm", "hf_sampler": "prm", "mc_step_labels": "prm", "train_prm": "prm",
    "aggregate_ensemble": "metrics", "best_of_many_accuracy": "metrics", "pairwise_accuracy": "metrics",
    "preference_ece": "metrics", "starc_distance": "metrics",
    "BagOfTokensModel": "backbones", "load_backbone": "backbones",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'postrl.reward_models' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"postrl.reward_models.{mod}"), name)
    globals()[name] = value
    return value
