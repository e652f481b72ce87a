"""Rewards then shaping on a rollout batch: the run's reward sources and shaping stages as one object.

``Scorer.score(batch)`` fills ``rewards`` [N, K] (every source scores every completion: in parallel, per-call
timeout, failures isolated as NaN and counted; the config's ``reward`` section), ``raw_rewards`` (before shaping), the step texts /
step ends when a source or stage reads them, then runs the shaping stages in config order; ``valid`` marks the
completions with a finite reward. ``observe=False`` scores a batch that does not train (a greedy baseline): the
stateful stages then learn nothing from it; on a batch that trains, every stateful reward source and shaping stage
records it (``observe``); the step applies what they recorded once (:meth:`postrl.step.Step.end`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from postrl import stages
from postrl.batch import RolloutBatch
from postrl.errors import ConfigError
from postrl.rewards.code import sandbox_errors
from postrl.rewards import RewardContext, score_batch
from postrl.rewards.core import wants
from postrl.reasoning_steps import split_steps, step_token_ends

_log = logging.getLogger("postrl.rewards")


class Scorer:
    """``reward``: the config's ``reward`` section (evaluation and fault handling); ``rewards`` / ``shaping``: its
    stage lists; ``context``: what a reward that needs the model receives; ``tokenizer``: the policy's (step ends)."""

    def __init__(self, reward: Any, rewards: list, shaping: list, context: RewardContext, tokenizer: Any,
                 log: Callable[[str], None] | None = None):
        self.cfg = reward
        self.specs = rewards
        self.rewards = stages.build_all("reward", rewards, section="rewards")
        self.shaping = stages.build_all("shaping", shaping, section="shaping")
        self.weights = torch.tensor(reward.weights if reward.weights is not None
                                    else [r.weight for r in rewards], dtype=torch.float32)
        self.context = context
        self.tokenizer = tokenizer
        self.log = log
        self.wants_steps = any(wants(s.fn, "steps") for s in self.rewards)  # a process reward source
        self.wants_step_ends = any("step_ends" in s.reads for s in self.shaping)

    def check_sandbox(self) -> None:
        """Where a reward runs code in the sandbox (it declares ``needs=('sandbox',)``), say at start-up what this
        machine cannot enforce."""
        if any("sandbox" in s.needs for s in self.rewards) and self.log is not None:
            from postrl.sandbox import capabilities

            with sandbox_errors():
                warning = capabilities().get("warning")
            if warning:
                self.log(f"warning: {warning}")

    @property
    def stages(self) -> list[stages.Stage]:
        return [*self.rewards, *self.shaping]

    def score(self, batch: RolloutBatch, observe: bool = True) -> dict:
        """Score and shape ``batch`` in place; returns the failure counts, first failures and failure rates."""
        rc = self.cfg
        columns = {**batch.columns, "group_ids": batch.group_ids.tolist()}
        if self.wants_steps:
            columns["steps"] = [split_steps(c, rc.step_delimiter) for c in batch.completions]
        outcome = score_batch(batch.prompts, batch.completions, columns, self.specs,
                              built=[(s.fn, s.params) for s in self.rewards], context=self.context,
                              strict=rc.strict, timeout=rc.timeout, workers=rc.workers, chunk_size=rc.chunk_size,
                              completion_ids=[ids[:n].tolist() for ids, n in zip(batch.completion_ids,
                                                                                 batch.lengths.long().tolist())],
                              trainer_state={"global_step": int(batch.extra.get("step", 0)),
                                             "max_steps": int(batch.extra.get("max_steps", 0))})
        batch.reward_names = [r.name for r in self.specs]
        batch.rewards = outcome.matrix
        batch.reward_weights = self.weights
        batch.raw_rewards = outcome.matrix.clone()  # before shaping (metrics, filters on raw rewards)
        batch.extra["raw_reward_names"] = tuple(batch.reward_names)
        batch.step_rewards = outcome.step_rewards
        if outcome.step_source is not None:
            batch.extra["step_reward_source"] = outcome.step_source
        if outcome.step_rewards is not None or self.wants_step_ends:
            batch.step_ends = step_token_ends(batch.completion_ids, batch.lengths, batch.completions,
                                              self.tokenizer, rc.step_delimiter)
        if observe:
            for stage in self.rewards:
                stage.observe(batch)
        for stage in self.shaping:
            out = stage(batch)
            if observe:
                stage.observe(batch)
            for k, v in out.items():
                if k in RolloutBatch.__dataclass_fields__:
                    setattr(batch, k, v)
                else:  # a field RolloutBatch has no attribute for
                    batch.extra[k] = v
        if batch.reward is None:
            raise ConfigError("shaping: no stage produced the scalar reward; add {name: weighted_sum}")
        batch.valid = torch.isfinite(batch.reward)
        rates = {r.name: outcome.failure_rate(r.name) for r in self.specs}
        for name, rate in rates.items():
            if rate > rc.alarm_rate:
                msg = (f"reward '{name}' failed on {rate:.0%} of the batch (reward.alarm_rate={rc.alarm_rate:g});"
                       f" first failure: {outcome.first_failure.get(name)}")
                _log.warning(msg)
                if self.log is not None:
                    self.log(f"warning: {msg}")
        return {"failures": outcome.failures, "first_failure": outcome.first_failure, "failure_rate": rates}

    def weighted(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
        """sum_k w_k r_k of the reward sources (no shaping) per completion, NaN where one failed: the held-out
        evaluation's score when the task has no verifier."""
        columns = {k: [r.get(k) for r in rows] for k in {k for r in rows for k in r if k != "prompt"}}
        rc = self.cfg
        out = score_batch(prompts, completions, columns, self.specs, built=[(s.fn, s.params) for s in self.rewards],
                          context=self.context, timeout=rc.timeout, workers=rc.workers, chunk_size=rc.chunk_size)
        return (out.matrix * self.weights).sum(-1).tolist()

