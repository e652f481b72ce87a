"""Reward sources for the claim specs of examples/compare/ (imported by path: ``claim_rewards:verifier``).

``verifier`` is the task verifier under a second name, so a spec can corrupt it (``reward_noise`` with
``sources: ["claim_rewards:verifier"]``) while ``correct`` (weight 0) stays the uncorrupted gold column that the
``accuracy`` metric and the held-out evaluation read.
"""

from __future__ import annotations

from postrl.rewards.builtin import correct


def verifier(prompts, completions, task=None, **columns):
    """The task verifier (1.0 when the row's task accepts the completion, else 0.0): ``correct`` under another name."""
    return correct(prompts, completions, task=task, **columns)
