"""Rewards then shaping on a rollout batch: the run's reward sources and shaping stages as one object.

``Scorer.score(batch)`` fills ``rewards`` [N, K] (every source scores every completion: in parallel, per-call
timeout, failures isolated as NaN and counted; the config's ``reward`` section), ``raw_rewards`` (before shaping),
``extra['reward_skipped']`` [N, K] (a source returned None: it does not apply to the row), the step texts / step
ends when a source or stage reads them, then runs the shaping stages in config order (a driver may add reward
sources the config does not name: ``sources``, callables with a name and a weight, scored first, e.g. the TRL
adapter's ``reward_funcs``; ``batch.extra['trainer_state']`` and ``batch.extra['completion_messages']``, when a driver
sets them, are what TRL-style sources receive as ``trainer_state`` and, for conversational prompts, as
``completions``); ``valid`` marks the
completions with a finite reward. What TRL-style sources log (``log_extra``: ``extra['log_extra:<column>']``, one
value per row, into samples.jsonl; ``log_metric``: the step's mean per name, in the returned ``metrics``) comes
back with the outcome. A source that raises on every completion (two or more) of the first batch the Scorer
scores stops the run with one line (``reward.on_all_failed=stop``, a bug in the reward); notices (``notice``:
stderr in every mode and the run directory) say what changes the run: that, a source failing on more than
``reward.alarm_rate`` of a batch, rows no source applies to. ``observe=False`` scores a batch that does not train
(a greedy baseline): the stateful stages then learn nothing from it; on a batch that trains, every stateful reward
source and shaping stage records it (``observe``); the step applies what they recorded once
(:meth:`postrl.step.Step.end`).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Callable

import torch

from postrl import registry, stages
from postrl.batch import RolloutBatch
from postrl.errors import ConfigError, RewardError
from postrl.rewards.code import sandbox_errors
from postrl.rewards import RewardContext, score_batch
from postrl.rewards.core import trainer_state, wants
from postrl.reasoning_steps import split_steps, step_token_ends
from postrl.sandbox import capabilities

_log = logging.getLogger("postrl.rewards")


class Scorer:
    """``reward``: the config's ``reward`` section (evaluation and fault handling); ``rewards`` / ``shaping``: its
    stage lists; ``context``: what a reward that needs the model receives; ``tokenizer``: the policy's (step ends);
    ``log``: the console; ``notice``: what changes the run (``postrl.train.run_state.Notices``: every mode);
    ``sources``: reward sources a driver adds before the config's, as ``(name, callable, weight)`` (names unique
    among all sources; a source that is a class instance keeps its state as the driver made it)."""

    def __init__(self, reward: Any, rewards: list, shaping: list, context: RewardContext, tokenizer: Any,
                 log: Callable[[str], None] | None = None, notice: Callable[..., None] | None = None,
                 sources: list[tuple[str, Callable, float]] | None = None):
        self.cfg = reward
        sources = list(sources or [])
        names = [n for n, _, _ in sources]
        clash = [n for i, n in enumerate(names) if n in names[:i] or n in {r.name for r in rewards}]
        if clash:
            raise ConfigError(f"rewards: two reward sources are named '{clash[0]}'; give each source its own name")
        self.specs = [SimpleNamespace(name=n, weight=float(w), params={}) for n, _, w in sources] + list(rewards)
        self.rewards = [stages.Stage("reward", n, fn, {}, (), label=n) for n, fn, _ in sources] + \
            stages.build_all("reward", rewards, section="rewards")
        self.shaping = stages.build_all("shaping", shaping, section="shaping")
        config_weights = reward.weights if reward.weights is not None else [r.weight for r in rewards]
        self.weights = torch.tensor([float(w) for _, _, w in sources] + list(config_weights), dtype=torch.float32)
        self.context = context
        self.tokenizer = tokenizer
        self.log = log
        self.notice = notice
        self.scored = 0  # batches scored (the first one decides reward.on_all_failed)
        self.said: set = set()
        self.wants_steps = any(wants(s.fn, "steps") for s in self.rewards)  # a process reward source
        self.wants_step_ends = any("step_ends" in s.reads for s in self.shaping)

    def check_sandbox(self) -> None:
        """Where a reward runs code in the sandbox (it declares ``needs=('sandbox',)``), say at start-up what this
        machine cannot enforce."""
        if any("sandbox" in s.needs for s in self.rewards) and (self.log or self.notice) is not None:
            with sandbox_errors():
                warning = capabilities().get("warning")
            if warning:
                self._say(warning, kind="warning")

    def _say(self, msg: str, step: int | None = None, kind: str = "notice", key: Any = None) -> None:
        """A notice (stderr in every mode, the run directory) the first time ``key`` is seen, else the console log
        only; without a notice function, the console log (``warning: ...``)."""
        if self.notice is not None and (key is None or key not in self.said):
            if key is not None:
                self.said.add(key)
            self.notice(msg, step=step, kind=kind)
        elif self.log is not None:
            self.log(f"{kind}: {msg}" if kind == "warning" else msg)

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
                              trainer_state=batch.extra.get("trainer_state") or trainer_state(
                                  int(batch.extra.get("step", 0)), int(batch.extra.get("max_steps", 0))),
                              completion_messages=batch.extra.get("completion_messages"))
        step = int(batch.extra.get("step", 0)) + 1
        first, self.scored = self.scored == 0, self.scored + 1
        n = len(batch)
        for name, k in outcome.raised.items():
            if first and n >= 2 and k == n:  # (one row, e.g. verl's per-response call, is no evidence of a bug)
                msg = (f"reward '{name}' raised {outcome.first_exception[name]} on every completion of the first "
                       f"step: a bug in the reward, not in the data")
                if rc.on_all_failed == "stop":
                    raise RewardError(f"{msg} (reward.on_all_failed=continue trains on without it)")
                self._say(f"{msg}; reward.on_all_failed=continue: its entries are excluded while it fails",
                          step=step, key=("raised", name))
        batch.reward_names = [r.name for r in self.specs]
        batch.rewards = outcome.matrix
        batch.reward_weights = self.weights
        batch.raw_rewards = outcome.matrix.clone()  # before shaping (metrics, filters on raw rewards)
        batch.extra["reward_skipped"] = outcome.skipped  # None: the source does not apply to the row (TRL)
        for column, values in outcome.logged_columns.items():  # TRL log_extra: a column of samples.jsonl
            batch.extra[f"log_extra:{column}"] = values
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
                msg = (f"reward '{name}' failed on {rate:.0%} of the batch at step {step} (reward.alarm_rate="
                       f"{rc.alarm_rate:g}; its failed entries are excluded from the advantage); first failure: "
                       f"{outcome.first_failure.get(name)}")
                _log.warning(msg)
                self._say(msg, step=step, kind="warning", key=("failed", name))
        skipped = outcome.skipped
        if n and skipped is not None and skipped.shape[1] and bool(skipped.any()):
            none = skipped.all(-1) if len(self.specs) else skipped.new_zeros(n)
            for k, name in enumerate(batch.reward_names):
                if first and bool(skipped[:, k].all()):
                    self._say(f"reward '{name}' returned None on every completion of step {step}: it applies to "
                              "none of them (None = does not apply, as in TRL); the other sources score them",
                              step=step, key=("none", name))
            if bool(none.any()):
                self._say(f"{int(none.sum())} of {n} completions at step {step}: every reward source returned "
                          "None, so none applies; they have no reward and take no part in the update (TRL: "
                          "unscorable)", step=step, key="unscorable")
        metrics = {k: sum(v) / len(v) for k, v in outcome.logged_metrics.items() if v}  # TRL log_metric
        return {"failures": outcome.failures, "first_failure": outcome.first_failure, "failure_rate": rates,
                "skipped_rate": {r.name: outcome.skipped_rate(r.name) for r in self.specs}, "metrics": metrics}

    def weighted(self, prompts: list[str], completions: list[str], rows: list[dict]) -> list[float]:
        """sum_k w_k r_k of the reward sources (no shaping) per completion, NaN where one failed: the held-out
        evaluation's score when the task has no verifier."""
        columns = {k: [r.get(k) for r in rows] for k in {k for r in rows for k in r if k != "prompt"}}
        rc = self.cfg
        out = score_batch(prompts, completions, columns, self.specs, built=[(s.fn, s.params) for s in self.rewards],
                          context=self.context, timeout=rc.timeout, workers=rc.workers, chunk_size=rc.chunk_size)
        combine = registry.get("shaping", "weighted_sum")  # (by name: train does not import the shaping package)
        return combine(out.matrix, self.weights, out.skipped)["reward"].tolist()

