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


def _unit(text: str) -> float:
    """A number in [0, 1) fixed by ``text`` (stable across processes and runs)."""
    from postrl.seeding import stable_hash

    return (stable_hash("claim_rewards", text) % 1_000_003) / 1_000_003


def compressed_verifier(prompts, completions, task=None, *, low: float = 0.02, frac: float = 0.75, **columns):
    """An accurate teacher that induces low reward variance: the task verifier times a per-prompt scale, ``low``
    on a fixed fraction ``frac`` of the prompts (chosen by a hash of the prompt), 1.0 on the others.

    It ranks every right completion above every wrong one of the same prompt (pairwise accuracy 1.0 against the
    verifier), but on most prompts the right and the wrong completion differ by ``low`` only: the reward's
    variance under the policy is small there ("What Makes a Reward Model a Good Teacher?")."""
    gold = correct(prompts, completions, task=task, **columns)
    return [None if g is None else g * (low if _unit(p) < frac else 1.0) for g, p in zip(gold, prompts)]
