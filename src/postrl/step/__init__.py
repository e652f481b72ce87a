"""One training step, assembled once: the stages of a run and what every driver does with them.

postrl's trainer, the TRL adapter and the verl plug-in (and any new driver: a preference trainer, a reader of
another engine's run) build one :class:`Step` from a config and keep only what their engine owns (the model,
generation, the optimizer, checkpoints, processes):

    step = Step(cfg, context=RewardContext(model=..., tokenizer=...), tokenizer=tok)
    info = step.score(batch)                  rewards (fault isolated) -> shaping; stateful stages record
    keep = step.keep(batch)                   keep-mask filters (a driver that cannot refill masks the rest)
    step.kl_penalty(batch)                    kl.placement=reward: r -= coef * sum_t KL_t (needs old/ref log-probs)
    step.advantages(ctx, batch)               fields (the estimator's, the regularisers') produced through the
                                              model context, then the estimator
    step.observe_objective(batch)             with the old / reference log-probs in place: the stateful
                                              regularisers observe the batch that trains
    fields = step.objective.batch_fields(batch, rows)   the batch's part of the loss's per-token fields
    loss, stats, info = step.objective(fields, weights) the objective (losses/objective.py)
    metrics = step.metrics(batch, info)       the batch's metrics (docs/metrics.md)
    metrics |= step.end(metrics, n_seq, all_reduce_mean=..., gather=..., reset_reference=...)   state changes, once
    alarms = step.watchdog.step(metrics)      the monitors (docs/metrics.md)
    state = step.state_dict()                 every stateful stage and the KL controller, for checkpoints

The batch assembly with generation, selection and refill (:class:`postrl.step.sampling.BatchSource`) is for a
driver that generates itself (postrl's trainer).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from postrl import stages
from postrl.batch import RolloutBatch
from postrl.diagnostics.metrics import batch_metrics
from postrl.diagnostics.monitors import Watchdog
from postrl.errors import ConfigError
from postrl.fields import produce
from postrl.losses import kl_reward_penalty
from postrl.losses.objective import Objective
from postrl.rewards import RewardContext
from postrl.step.scoring import Scorer


class Step:
    """The run's stages (rewards, shaping, selection, advantage, objective) and its monitors, from ``cfg``.

    ``context``: what a reward that needs the model receives; ``tokenizer``: the policy's (process rewards' step
    ends); ``log``: where warnings go (one line each); ``notice``: where what changes the run goes (every mode:
    ``postrl.train.run_state.Notices``); ``sources``: reward sources the driver adds before the config's
    ``rewards``, as ``(name, callable, weight)`` (``Scorer``; the TRL adapter's ``reward_funcs``)."""

    def __init__(self, cfg: Any, *, context: RewardContext | None = None, tokenizer: Any = None,
                 log: Callable[[str], None] | None = None, notice: Callable[..., None] | None = None,
                 sources: list | None = None):
        self.scorer = Scorer(cfg.reward, cfg.rewards, cfg.shaping, context or RewardContext(), tokenizer, log=log,
                             notice=notice, sources=sources)
        self.selection = stages.build_all(stages.FILTER_KINDS, cfg.filters, section="filters")
        self.attempts = max([spec.attempts() for spec, st in zip(cfg.filters, self.selection)
                             if st.kind == "filter"], default=1)
        self.advantage = stages.build("advantage", cfg.advantage.name, cfg.advantage.params, where="advantage")
        self.objective = Objective.from_config(cfg)
        self.low_prob = cfg.diagnostics.entropy_collapse.low_prob
        self.watchdog = Watchdog(cfg.model_dump(mode="json"), cfg.diagnostics)
        self.group_size = cfg.rollout.group_size
        self.warnings = self._check()

    # ------------------------------------------------------------------------------------------------ stages
    @property
    def sections(self) -> dict[str, list[stages.Stage]]:
        """The run's stages by checkpoint section (their state is saved and restored together)."""
        return {"rewards": self.scorer.rewards, "shaping": self.scorer.shaping, "filters": self.selection,
                "advantage": [self.advantage], "regularizers": self.objective.regularizers}

    @property
    def all_stages(self) -> list[stages.Stage]:
        return [s for group in self.sections.values() for s in group]

    def needing(self, need: str) -> list[stages.Stage]:
        """The run's stages (the policy loss included) that declared ``need`` (e.g. ``reference_reset``): a driver
        that cannot offer it refuses them at start-up."""
        return [s for s in [*self.all_stages, self.objective.loss] if need in s.needs]

    def _check(self) -> list[str]:
        """What the stages declared they need of the run: a ConfigError for a selection that cannot work, warnings
        for a dubious combination (returned)."""
        warn = []
        G = self.group_size
        selectors = [s.name for s in self.selection if s.kind == "selector"]
        if len(selectors) > 1:
            raise ConfigError(f"filters: at most one prompt selector per run, got {', '.join(selectors)}")
        for s in [*self.selection, self.advantage]:  # (a stage declares its needs, from its parameters if they matter)
            if "groups" in s.needs and G < 2:
                if s.kind == "advantage":
                    warn.append(f"advantage '{s.name}' uses the group as its baseline and rollout.group_size=1: a "
                                f"group of one completion has no baseline (use reinforce_pp, remax or gae for one "
                                f"completion per prompt)")
                else:
                    raise ConfigError(f"filters.{s.name}: rollout.group_size must be >= 2 (every group would be one "
                                      f"completion, which this filter drops; `postrl methods {s.name}` lists its "
                                      f"options)")
            if s.kind == "sampling":
                s.fn.plan(G)  # raises when the group cannot hold the plan
        if self.objective.warning:
            warn.append(self.objective.warning)
        return warn

    # ------------------------------------------------------------------------------------------------ the step
    def score(self, batch: RolloutBatch, observe: bool = True) -> dict:
        """Rewards then shaping, in place (``Scorer.score``); ``observe=False`` for a batch that does not train."""
        return self.scorer.score(batch, observe=observe)

    def keep(self, batch: RolloutBatch, observe: bool = True) -> torch.Tensor:
        """bool [N]: the rows every keep-mask filter keeps; a stateful filter (``trapo``) records the groups it
        judged (``observe=True``: a generated batch of the step, kept or not; its state changes in ``end``)."""
        keep = torch.ones(len(batch), dtype=torch.bool)
        for f in self.selection:
            if f.kind == "filter":
                keep &= f(batch).bool()
                if observe:
                    f.observe(batch)
        return keep

    def kl_penalty(self, batch: RolloutBatch) -> None:
        """``kl.placement=reward``: r_i <- r_i - coef * sum_t m_it KL_it before the advantages (verl
        ``use_kl_in_reward``), from the batch's ``old_logprobs`` (the policy that generated it) and
        ``ref_logprobs``; the per-token values go to ``batch.extra['kl_token']``. A no-op otherwise."""
        obj = self.objective
        if not obj.kl_in_reward or len(batch) == 0:
            return
        seq, tok, _ = kl_reward_penalty(batch.old_logprobs, batch.ref_logprobs, batch.completion_mask, obj.kl)
        batch.reward = batch.reward - obj.kl_ctrl.value * seq
        batch.extra["kl_token"] = tok

    def advantages(self, ctx: Any, batch: RolloutBatch, observe: bool = True) -> torch.Tensor:
        """The advantage stage on ``batch`` (the fields it and the regularisers read that the batch lacks produced
        first through the model context ``ctx``, once per batch: the objective then reads a regulariser's field
        from ``batch.extra``); a stateful estimator records the batch (``observe=True``: it trains)."""
        produce(ctx, batch, self.advantage)
        for reg in self.objective.regularizers:
            produce(ctx, batch, reg)
        out = self.advantage(batch)
        if isinstance(out, dict):  # advantages and per-row fields for later stages (e.g. ares: its HWE windows)
            out = dict(out)
            adv = out.pop("advantages")
            batch.extra.update(out)
        else:
            adv = out
        batch.advantages = adv
        if observe:
            self.advantage.observe(batch)
        return batch.advantages

    def observe_objective(self, batch: RolloutBatch) -> None:
        """Once per step, on the batch that trains, with its old / reference log-probs in place (a driver computes
        those first; the regularisers' fields were produced in :meth:`advantages`): every stateful regulariser's
        ``observe`` (e.g. ``chi2_occupancy``'s discriminator data, which needs ``ref_logprobs``)."""
        for s in self.objective.regularizers:
            s.observe(batch)

    def metrics(self, batch: RolloutBatch, info: dict) -> dict:
        """Per-step metrics of the batch (``postrl.diagnostics.metrics.batch_metrics``, docs/metrics.md) and each
        reward source's failure rate on the scored batch (before filters); with ``kl.placement=reward`` the KL
        in the reward (verl ``current_kl``: mean over rows of the per-token mean). Rows that are not this step's
        rollouts (``extra['rehearsal']``: pre-sampled completions of the initial policy; ``extra['replayed']``:
        groups of earlier steps, ``avatar_replay``; ``extra['demonstration']``: external demonstrations) are left
        out and counted (``rehearsal/rows``, ``replay/rows``, ``demonstration/rows``)."""
        names = {"rehearsal": "rehearsal/rows", "replayed": "replay/rows", "demonstration": "demonstration/rows"}
        outside = {k: v.bool() for k in names
                   if isinstance(v := batch.extra.get(k), torch.Tensor) and v.dim() == 1 and bool(v.any())}
        if outside:
            others = torch.stack(list(outside.values())).any(0)
            m = self.metrics(batch.select(torch.nonzero(~others).flatten()), info)
            m.update({names[k]: float(v.sum()) for k, v in outside.items()})
            return m
        m = batch_metrics(batch, info, low_prob=self.low_prob)
        for name, rate in info.get("failure_rate", {}).items():
            m[f"reward/{name}/failure_rate"] = rate
        if "kl_token" in batch.extra:
            mask = batch.completion_mask * batch.valid.unsqueeze(-1).float()
            lens = mask.sum(-1)
            has = lens > 0
            m["kl_reward"] = float((batch.extra["kl_token"].sum(-1)[has] / lens[has]).mean()) if has.any() else 0.0
        return m

    def end(self, metrics: dict, n_seq: int, *, all_reduce_mean: Callable[[Any], None] = lambda t: None,
            gather: Callable[[Any], list] = lambda obj: [obj],
            reset_reference: Callable[[], None] | None = None) -> dict:
        """The end of the step, once, with the step's metrics reduced over processes and ``n_seq`` sequences over
        all processes: the KL controller's update and every stateful stage's (what they recorded, gathered from
        every process). ``reset_reference``: the driver's copy of the policy into its reference model, for the
        stages that declared ``needs=('reference_reset',)`` (e.g. ``gardo_kl`` with ``reset_every``). Returns their
        metrics."""
        end = stages.StepEnd(metrics, all_reduce_mean, gather)
        if reset_reference is not None:
            end.reset_reference = reset_reference
        out = self.objective.end_step(end, n_seq)
        out.update(stages.end_step(self.all_stages, end))
        return out

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Every stateful stage's state by section, and the KL controller's: JSON data for a checkpoint."""
        out = {k: stages.state_of(v) for k, v in self.sections.items()}
        out["kl"] = self.objective.kl_ctrl.state_dict()
        return out

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        for k, group in self.sections.items():
            stages.load_state(group, state.get(k))
        if state.get("kl"):
            self.objective.kl_ctrl.load_state_dict(state["kl"])
