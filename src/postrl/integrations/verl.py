"""The verl plug-in: postrl's stages inside verl (>= 0.9) without a fork.

Install ``pip install postrl[verl]``. verl loads the plug-in in every process that imports verl, by either route:

* the ``verl.plugins`` entry point that postrl's package declares (``VERL_USE_EXTERNAL_PLUGINS``, default ``auto``);
* ``VERL_USE_EXTERNAL_MODULES=postrl.integrations.verl``.

verl logs an entry point that fails to load at debug level only, so loading here is loud: any failure is printed to
stderr before it propagates, and :func:`check_registered` verifies at start-up that
every name below is in verl's registries (a missing name is an error, not a silent fallback).

What it registers (prefix ``postrl_``, so verl's own names are never touched; a name verl already holds that is
not postrl's is an error, because verl's loss registry silently overwrites):

* every postrl advantage estimator with ``register_adv_est`` (``algorithm.adv_estimator=postrl_gdpo``). verl's
  trainer calls it with keywords: ``token_level_rewards`` [B, T], ``response_mask`` [B, T], ``index`` (the ``uid``
  of each row's prompt), ``config`` (``algorithm``). postrl's fields come from them: ``reward`` = row sum of
  ``token_level_rewards``, ``rewards`` = that as one column, ``group_ids`` = ``index``, ``completion_mask``,
  ``lengths``, ``valid`` = finite reward. An estimator reading anything else (``token_entropy``,
  ``greedy_reward`` ...) is refused with one line naming the field. Returns (advantages, returns), both the
  advantage broadcast over the row's tokens and masked.
* every postrl policy loss with ``register_policy_loss`` (``actor_rollout_ref.actor.policy_loss.loss_mode=
  postrl_ppo_clip``), called as verl's actor calls it (``old_log_prob``, ``log_prob``, ``advantages``,
  ``response_mask``, ``loss_agg_mode``, ``config``, ``rollout_is_weights``). The per-token loss is postrl's; it is
  multiplied by verl's rollout importance weights when given and aggregated by verl's ``agg_loss`` with
  ``config.global_batch_info`` (data-parallel size, global token and sequence counts), so the loss is the same
  for any degree of parallelism. postrl's ``loss.agg`` maps to verl's ``loss_agg_mode`` (:data:`AGG_MODES`); with
  a postrl config, a mismatch is an error.

Stage parameters (verl's config dataclasses cannot carry them) come from a postrl YAML named by the environment
variable ``POSTRL_CONFIG`` (:data:`ENV_CONFIG`): its ``advantage``, ``loss``, ``rewards``, ``shaping`` and
``diagnostics`` sections, validated as ``postrl train`` validates them (one-line error for an unknown name or
parameter). ``postrl export verl RUN.yaml`` writes the verl command line that sets it for the driver and, through
``ray_kwargs.ray_init.runtime_env.env_vars``, for every Ray worker. Without it, every stage runs with its defaults.

Rewards: :func:`compute_score` is a verl reward function (``reward.custom_reward_function.path=
pkg://postrl.integrations.verl``, ``name=compute_score``). verl 0.9's reward loop scores one response per call
(``RewardManagerBase.run_single``); there is no batch-level reward manager registry in it, so the shaping stages
that need a group (they read ``group_ids``) are refused at start-up; row-wise shaping runs. It runs postrl's
reward sources with fault isolation (the step's scoring, :meth:`postrl.step.Step.score`) and returns ``score`` plus each source's value (``reward_extra_info``: verl
logs them and puts them in ``non_tensor_batch``). A failed source gives NaN (never 0): ``postrl_*`` estimators
exclude that row from every group statistic (advantage 0), as postrl's trainer does.

Diagnostics: the plug-in wraps verl's ``compute_data_metrics`` (``verl.trainer.ppo.metric_utils``, called by the
trainer with the step's batch on the driver) to add postrl's metrics computed from that batch (``postrl/...``: the
step's own batch metrics, :meth:`postrl.step.Step.metrics`, on the batch read as a :class:`RolloutBatch`, plus
the sampler/trainer log-prob mismatch, KL to the reference, and the token entropy estimated as the mean surprisal
of the sampled tokens) and runs the step's monitors (``Step.watchdog``) over them: an alarm is logged as a warning
and reported as ``postrl/alarm/<name> = 1``.

Top-p / top-k (``rollout.top_p`` / ``rollout.top_k`` of the postrl config, which ``postrl export verl`` writes into
``actor_rollout_ref.rollout.top_p`` / ``top_k``): vLLM samples from the filtered, renormalised distribution
q = pi / M and, in verl's default ``logprobs_mode=processed_logprobs``, returns log q, while verl's trainer
computes log pi over the whole vocabulary: every token's ratio carries the kept mass M. Where verl's trainer
computes log-probs: each training engine (FSDP, automodel, torchtitan) divides the logits by the temperature and
calls ``verl.utils.torch_functional.logprobs_from_logits(logits, labels)`` for the old, the reference and the
update's log-probs; the engine is not told top_p / top_k (only the temperature rides in the batch). The plug-in
replaces that function (:func:`install_logprob_filter`, in every process: the defining module and any verl
module that imported it by name) with one that, when the postrl config sets ``rollout.logprobs: filtered`` and a
filter, returns the log-probs of the renormalised filtered distribution
(:func:`filtered_logprobs_from_logits`, postrl's :func:`~postrl.logprobs.filtered_token_logprobs`, the kept set
from the trainer's logits: vLLM does not return its kept set to verl), and is verl's own function otherwise. With
the correction on, each worker checks at construction (:func:`check_worker_config`, a wrap of
``ActorRolloutRefWorker.__init__``) that verl's sampling settings are the postrl config's and that its engine
calls that function: Megatron (vocab-parallel log-probs, ``vocab_parallel_log_probs_from_logits``) and
``use_fused_kernels`` (no logits) cannot be corrected from a plug-in and are refused, naming the patch point.
The kept mass is logged on the driver (``postrl/sampler/kept_mass_*``) where verl's batch shows it: uncorrected,
with rollout log-probs (``actor_rollout_ref.rollout.calculate_log_probs=true``, vLLM's processed log-probs),
log M_t = old_log_probs_t - rollout_log_probs_t (<= 0; plus the engines' own mismatch); or a ``kept_logmass``
column of the batch (the documented patch point: verl's workers return only the log-probs to the driver, so with
the correction on the kept mass reaches the driver only if ``prepare_model_outputs`` puts it in the engine's
output and ``_compute_old_log_prob`` copies it into the batch). Uncorrected, ``filtered_sampling`` fires when the
kept mass is low, and at every step with the mass unmeasured (no rollout log-probs) while a filter is on.

State: verl calls the registered functions with no context, so the plug-in keeps one :class:`Run` per process
(:func:`run`): the postrl config named by ``$POSTRL_CONFIG``, its :class:`~postrl.step.Step` and the diagnostics'
step count, made on first use and made anew when ``$POSTRL_CONFIG`` changes. verl's plug-in contract is an import
(it never calls a function of the plug-in), so importing this module registers (:func:`load`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable

import torch

from postrl import registry, stages
from postrl.batch import RolloutBatch
from postrl.errors import ConfigError, PostrlError
from postrl.generation import SamplingParams
from postrl.groups import dense_ids
from postrl.logprobs import filtered_token_logprobs
from postrl.config import Config, load_config
from postrl.diagnostics.metrics import mismatch_metrics
from postrl.diagnostics.monitors import Alarm
from postrl.losses.kl import kl_k3
from postrl.rewards.core import wants
from postrl.step import Step

ENV_CONFIG = "POSTRL_CONFIG"
PREFIX = "postrl_"
AGG_MODES = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
             "sequence": "seq-mean-token-mean", "seq_mean_token_sum": "seq-mean-token-sum",
             "dr_grpo": "seq-mean-token-sum-norm"}
"""postrl ``loss.agg`` -> verl ``actor.loss_agg_mode``. ``dr_grpo``: verl divides by ``loss_scale_factor`` (set to
``rollout.max_new_tokens`` by the export) and by the sequences with at least one token (postrl: all rows)."""

ADVANTAGE_FIELDS = ("reward", "rewards", "reward_weights", "reward_names", "group_ids", "completion_mask",
                    "lengths", "valid")
"""The postrl batch fields an advantage estimator gets inside verl."""
LOSS_FIELDS = ("logp", "old_logp", "advantages", "mask", "lengths")
"""The per-token fields a policy loss gets inside verl."""

_log = logging.getLogger("postrl.integrations.verl")


# ------------------------------------------------------------------------------------------------ the run


class Run:
    """The postrl side of a verl run in this process: the config named by ``$POSTRL_CONFIG`` (postrl's defaults
    without it), its :class:`~postrl.step.Step` (rewards, shaping, advantage, loss, monitors) and the stages verl may
    call by their ``postrl_<name>``: the configured one with its parameters, any other with its defaults."""

    def __init__(self, path: str):
        self.path = path
        self.config = load_config(path) if path else Config()
        self.step = Step(self.config)
        self._stages: dict[tuple[str, str], stages.Stage] = {}
        self.diagnostics_steps = 0
        r = self.config.rollout
        self.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                       top_k=r.top_k, logprobs=r.logprobs)
        self.warned_unmeasured = False

    def stage(self, kind: str, name: str) -> stages.Stage:
        """postrl's ``kind`` stage ``name``: the step's own when the config selects it, else with its defaults."""
        own = self.step.advantage if kind == "advantage" else self.step.objective.loss
        if own.name == name:
            return own
        if (kind, name) not in self._stages:
            self._stages[(kind, name)] = stages.build(kind, name)
        return self._stages[(kind, name)]


_RUN: Run | None = None


def run() -> Run:
    """This process's :class:`Run` (made on first use, and anew when ``$POSTRL_CONFIG`` names another file)."""
    global _RUN
    path = os.environ.get(ENV_CONFIG) or ""
    if _RUN is None or _RUN.path != path:
        _RUN = Run(path)
    return _RUN


def run_config():
    """The postrl config named by ``$POSTRL_CONFIG`` (validated); postrl's defaults without it."""
    return run().config


def _stage(kind: str, name: str) -> stages.Stage:
    return run().stage(kind, name)


def _check_reads(stage: stages.Stage) -> None:
    allowed = ADVANTAGE_FIELDS if stage.kind == "advantage" else LOSS_FIELDS
    missing = [f for f in stage.reads if f not in allowed and _required(stage, f)]
    if missing:
        raise ConfigError(f"{stage.kind} '{stage.name}' reads batch field '{missing[0]}', which verl's trainer does "
                          f"not pass to a {'policy loss' if stage.kind == 'loss' else 'advantage estimator'} "
                          f"(available: {', '.join(allowed)}); use it with postrl train")


def _call(stage: stages.Stage, fields: dict) -> Any:
    _check_reads(stage)
    return stage(fields)


def _required(stage: stages.Stage, field: str) -> bool:
    fn = stage.fn.__call__ if stage.stateful else stage.fn
    p = stages.signature(fn).parameters.get(field)
    return p is not None and p.default is p.empty


def group_ids_of(index: Any) -> torch.Tensor:
    """verl's ``index`` (the ``uid`` of each row's prompt, any hashable values) -> dense postrl group ids [B]."""
    return dense_ids(index)


# ------------------------------------------------------------------------------------------------ advantages


def advantage_fields(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any) -> dict:
    """postrl's advantage fields (:data:`ADVANTAGE_FIELDS`) from what verl's trainer passes."""
    mask = response_mask.float()
    reward = token_level_rewards.float().sum(-1)
    n = reward.shape[0]
    gids = group_ids_of(index) if index is not None else torch.arange(n)
    return {"reward": reward, "rewards": reward.unsqueeze(-1), "reward_weights": torch.ones(1),
            "reward_names": ["score"], "group_ids": gids.to(reward.device), "completion_mask": mask,
            "lengths": mask.sum(-1), "valid": torch.isfinite(reward)}


def _advantage_fn(name: str) -> Callable:
    def advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                  config: Any = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        fields = advantage_fields(token_level_rewards, response_mask, index)
        with torch.no_grad():
            adv = _call(_stage("advantage", name), fields)
        mask = fields["completion_mask"]
        adv = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).to(mask) * mask
        return adv, adv

    advantage.__doc__ = f"postrl advantage estimator '{name}' in verl's registry (see postrl.integrations.verl)."
    advantage.__qualname__ = advantage.__name__ = f"{PREFIX}{name}"
    advantage.postrl_stage = ("advantage", name)
    return advantage


# ------------------------------------------------------------------------------------------------ policy losses


def _check_agg(loss_agg_mode: str) -> None:
    if not os.environ.get(ENV_CONFIG):
        return
    agg = run_config().loss.agg
    want = AGG_MODES.get(agg)
    if want is None:
        raise ConfigError(f"loss.agg '{agg}' has no verl loss_agg_mode; use one of {', '.join(AGG_MODES)}")
    if loss_agg_mode != want:
        raise ConfigError(f"verl actor.loss_agg_mode is '{loss_agg_mode}' but postrl loss.agg={agg} needs '{want}'; "
                          f"set actor_rollout_ref.actor.loss_agg_mode={want} (postrl export verl does)")


def _loss_fn(name: str) -> Callable:
    def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                    rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        from verl.trainer.ppo.core_algos import agg_loss

        _check_agg(loss_agg_mode)
        mask = response_mask.to(log_prob.dtype)
        fields = {"logp": log_prob, "old_logp": old_log_prob, "advantages": advantages, "mask": mask,
                  "lengths": mask.sum(-1)}
        loss_mat, info = _call(_stage("loss", name), fields)
        if rollout_is_weights is not None:
            loss_mat = loss_mat * rollout_is_weights
        batch_info = dict(config.global_batch_info) if config is not None else {}
        pg_loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch_info)
        n = mask.sum().clamp(min=1.0)
        metrics = {f"actor/postrl/{k}": float((v.float() * mask).sum() / n) for k, v in info.items()
                   if v.dtype == torch.bool}
        if "ratio" in info:
            metrics["actor/postrl/ratio_max"] = float((info["ratio"] * mask).max())
        return pg_loss, metrics

    policy_loss.__doc__ = f"postrl policy loss '{name}' in verl's registry (see postrl.integrations.verl)."
    policy_loss.__qualname__ = policy_loss.__name__ = f"{PREFIX}{name}"
    policy_loss.postrl_stage = ("loss", name)
    return policy_loss


# ------------------------------------------------------------------------------------------------ registration

_FNS: dict[tuple[str, str], Callable] = {}  # (kind, postrl name) -> the function registered with verl


def _verl_registries() -> dict[str, dict]:
    from verl.trainer.ppo import core_algos

    return {"advantage": core_algos.ADV_ESTIMATOR_REGISTRY, "loss": core_algos.POLICY_LOSS_REGISTRY}


def expected_names() -> dict[str, list[str]]:
    """The verl names the plug-in registers: {'advantage': ['postrl_grpo', ...], 'loss': [...]}."""
    return {kind: [PREFIX + n for n in registry.names(kind)] for kind in ("advantage", "loss")}


def register() -> dict[str, list[str]]:
    """Register every postrl advantage estimator and policy loss with verl (idempotent); returns the names.

    A ``postrl_*`` name verl already holds with a function that is not postrl's is a :class:`PostrlError`
    (``register_policy_loss`` would silently overwrite it)."""
    from verl.trainer.ppo import core_algos

    regs = _verl_registries()
    decorators = {"advantage": core_algos.register_adv_est, "loss": core_algos.register_policy_loss}
    makers = {"advantage": _advantage_fn, "loss": _loss_fn}
    out: dict[str, list[str]] = {}
    for kind in ("advantage", "loss"):
        for name in registry.names(kind):
            vname = PREFIX + name
            fn = _FNS.setdefault((kind, name), makers[kind](name))
            old = regs[kind].get(vname)
            if old is fn:
                continue
            if old is not None and getattr(old, "postrl_stage", None) != (kind, name):
                raise PostrlError(f"verl already registers {kind} '{vname}' ({old.__module__}.{old.__qualname__}); "
                                  "postrl does not overwrite verl's names")
            regs[kind].pop(vname, None)  # an earlier load of this module (same stage): replace it
            decorators[kind](vname)(fn)
        out[kind] = [PREFIX + n for n in registry.names(kind)]
    return out


def check_registered() -> None:
    """Raise (after logging at error level and printing to stderr) when a name of :func:`expected_names` is not in
    verl's registries as postrl's function."""
    regs = _verl_registries()
    for kind, names in expected_names().items():
        bad = [n for n in names if getattr(regs[kind].get(n), "postrl_stage", None) is None]
        if bad:
            _loud(f"postrl verl plug-in: {len(bad)} {kind} name(s) missing from verl's registry, e.g. '{bad[0]}'")
            raise PostrlError(f"postrl's {kind} '{bad[0]}' is not registered with verl")


def _loud(msg: str) -> None:
    """Printed to stderr (a Ray worker's stderr goes to its log and the driver's console), whatever the logging
    configuration: verl reports a plug-in that fails to load at debug level only."""
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ rewards


def check_scoring(step: Any) -> None:
    """Refuse what verl's per-response reward call cannot feed: shaping that needs a group, process (step)
    rewards, rewards reading token ids or groups."""
    scorer = step.scorer
    for s in scorer.shaping:
        if "group_ids" in s.reads:
            raise ConfigError(f"shaping '{s.name}' needs a group of completions; verl's reward loop scores one "
                              "response per call: use it with postrl train")
    for s in scorer.rewards:
        if wants(s.fn, "completion_ids") or wants(s.fn, "group_ids"):
            raise ConfigError(f"reward '{s.name}' reads token ids or groups, which verl's reward call does not "
                              "pass; use it with postrl train")
    if scorer.wants_steps or scorer.wants_step_ends:
        raise ConfigError("process (step) rewards and step shaping need the tokenizer's step boundaries, which "
                          "verl's reward call does not pass; use them with postrl train")


def check_config(cfg: Any) -> None:
    """Everything of a postrl config that must hold to run it on verl, checked before launch (``postrl export
    verl``) and at the plug-in's start-up: the advantage estimator and policy loss read only what verl passes, the
    aggregation has a verl mode, the rewards and shaping run per response. One-line :class:`ConfigError`."""
    step = Step(cfg)
    adv = step.advantage
    for s in [adv, step.objective.loss, *step.objective.regularizers]:
        if "teacher_logp" in s.reads:
            raise ConfigError(f"{s.kind} '{s.name}' reads teacher_logp, a teacher model's log-probs, which the verl "
                              f"plug-in cannot give; use verl's own on-policy distillation (distillation.enabled=true, "
                              f"distillation.teacher_models.teacher_model.model_path=...; docs/losses.md maps "
                              f"distill's options to it)")
    _check_reads(adv)
    if "rewards" in adv.reads and len(cfg.rewards) > 1:
        raise ConfigError(f"advantage '{cfg.advantage.name}' reads the per-source reward matrix; verl passes an "
                          "estimator only the summed reward (per-source values reach only verl's own 'gdpo', "
                          "algorithm.gdpo_reward_keys): use that, or postrl train")
    _check_reads(step.objective.loss)
    for s in step.needing("reference_reset"):
        raise ConfigError(f"{s.kind} '{s.name}': resetting the reference model is not available on verl (verl's "
                          "reference worker is its own); use it with postrl train")
    if cfg.loss.agg not in AGG_MODES:
        raise ConfigError(f"loss.agg '{cfg.loss.agg}' has no verl loss_agg_mode; use one of {', '.join(AGG_MODES)}")
    check_scoring(step)


def compute_score(data_source: Any, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **kwargs: Any) -> dict:
    """verl reward function: postrl's reward sources (fault isolated) and row-wise shaping on one response.

    Columns passed to the sources: ``answer`` and ``ground_truth`` (verl's ground truth), ``data_source`` and
    every key of ``extra_info``; the prompt text is ``extra_info['prompt']`` (or ``'question'``, else empty).
    Returns ``{'score': shaped reward, <source name>: raw value, ..., 'postrl_failed': failed sources}``; a
    failed source is NaN and so is the score (postrl_* estimators exclude the row)."""
    extra = dict(extra_info or {})
    prompt = str(extra.get("prompt", extra.get("question", "")))
    columns = {k: [v] for k, v in extra.items()}
    columns.update(answer=[ground_truth], ground_truth=[ground_truth], data_source=[data_source])
    z = torch.zeros((1, 1))
    batch = RolloutBatch(prompt_ids=z.long(), prompt_mask=z.long(), completion_ids=z.long(), completion_mask=z,
                         group_ids=torch.zeros(1, dtype=torch.long), sampler_logprobs=z,
                         truncated=torch.zeros(1, dtype=torch.bool), prompts=[prompt], completions=[solution_str],
                         columns=columns)
    r = run()
    if not getattr(r, "scoring_checked", False):
        check_scoring(r.step)
        r.scoring_checked = True
    info = r.step.score(batch)
    out: dict[str, Any] = {"score": float(batch.reward[0])}
    for k, name in enumerate(batch.reward_names):
        out[name] = float(batch.raw_rewards[0, k])
    out["postrl_failed"] = float(sum(info["failures"].values()))
    return out


# ------------------------------------------------------------------------------------------------ diagnostics


def rollout_batch(data: Any) -> tuple[RolloutBatch, bool]:
    """verl's batch (a DataProto after advantages) as a :class:`RolloutBatch` (reward = the row sum of
    ``token_level_scores``, one reward column ``score``; group ids from the rows' ``uid``, in ``non_tensor_batch``
    or, in verl's v1 trainer, a tensor column; the sampler's log-probs: ``rollout_log_probs``, else
    ``old_log_probs``) and whether it had group ids."""
    b = data.batch
    mask = b["response_mask"].float()
    reward = b["token_level_scores"].float().sum(-1)
    n, T = mask.shape
    uid = data.non_tensor_batch.get("uid")
    if uid is None and "uid" in b.keys():  # verl's v1 trainer keeps it as a tensor column
        uid = b["uid"].tolist()
    lp = b["rollout_log_probs"] if "rollout_log_probs" in b.keys() else \
        b["old_log_probs"] if "old_log_probs" in b.keys() else torch.full((n, T), float("nan"))
    kept = kept_logmass_of(data)
    adv = b["advantages"] if "advantages" in b.keys() else None
    prompts = b["prompts"] if "prompts" in b.keys() else torch.zeros((n, 0), dtype=torch.long)
    batch = RolloutBatch(prompt_ids=prompts, prompt_mask=torch.ones_like(prompts),
                         completion_ids=b["responses"] if "responses" in b.keys() else torch.zeros((n, T), dtype=torch.long),
                         completion_mask=mask,
                         group_ids=group_ids_of(uid) if uid is not None else torch.arange(n),
                         sampler_logprobs=lp.float(), truncated=mask.sum(-1) >= T, prompts=[""] * n,
                         completions=[""] * n, reward_names=["score"], rewards=reward.unsqueeze(-1),
                         raw_rewards=reward.unsqueeze(-1), reward_weights=torch.ones(1), reward=reward,
                         valid=torch.isfinite(reward), advantages=adv)
    if kept is not None:
        batch.extra["sampler_kept_logmass"] = kept.float() * mask
    return batch, uid is not None


def kept_logmass_of(data: Any) -> torch.Tensor | None:
    """log M [B, T], the log of the probability mass the sampler's top-p / top-k filter kept at each response
    token, as far as verl's batch shows it: its ``kept_logmass`` column (a verl patched to return it), else, when
    the postrl config has a filter and the trainer's log-probs are uncorrected (``rollout.logprobs: full``),
    ``old_log_probs - rollout_log_probs`` clamped at 0 (vLLM's processed log-probs are log pi - log M; the
    engines' own mismatch adds its noise); None otherwise (no filter, corrected, or no rollout log-probs)."""
    b = data.batch
    if "kept_logmass" in b.keys():
        return b["kept_logmass"].float()
    s = run().sampling
    if not s.filters or s.logprob_filter() or not {"old_log_probs", "rollout_log_probs"} <= set(b.keys()):
        return None
    return (b["old_log_probs"].float() - b["rollout_log_probs"].float()).clamp(max=0.0)


def batch_metrics(data: Any) -> dict[str, float]:
    """postrl's per-step metrics from verl's batch (a DataProto after advantages), keyed as postrl's trainer keys
    them (so postrl's monitors read them): the step's batch metrics (:meth:`postrl.step.Step.metrics`) of the batch
    read as a RolloutBatch (:func:`rollout_batch`), the sampler/trainer mismatch, ``kl`` (k3 of the trainer's
    log-probs to the reference's, per token) and ``entropy`` (mean -log p of the sampled tokens, an unbiased
    estimate of the token entropy of the sampling policy). Without the rows' ``uid`` no group statistic is
    reported (rather than a wrong one)."""
    batch, grouped = rollout_batch(data)
    m = run().step.metrics(batch, {})
    if not grouped:
        for k in [k for k in m if k.startswith(("zero_variance_groups/", "advantages/", "rewards/distinct")) or
                  k in ("reward/group_std", "length/reward_corr")]:
            m.pop(k)
    b, mask = data.batch, batch.completion_mask
    sampler = b["rollout_log_probs"] if "rollout_log_probs" in b.keys() else None
    trainer = b["old_log_probs"] if "old_log_probs" in b.keys() else None
    lp = sampler if sampler is not None else trainer
    if lp is not None:
        m["entropy"] = float(-(lp.float() * mask).sum() / mask.sum().clamp(min=1.0))
    if sampler is not None and trainer is not None:
        m.update(mismatch_metrics(trainer, sampler, mask))
    if trainer is not None and "ref_log_prob" in b.keys():
        m["kl"] = float((kl_k3(trainer.float(), b["ref_log_prob"].float()) * mask).sum() / mask.sum().clamp(min=1))
    return m


def diagnose(data: Any) -> dict[str, float]:
    """postrl's monitors over one verl step: ``postrl/<metric>`` and ``postrl/alarm/<name>`` (1 for each active
    alarm, logged as a warning with its cause and fix); the step's own monitors (``Step.watchdog``)."""
    r = run()
    r.diagnostics_steps += 1
    m = {"step": r.diagnostics_steps, **batch_metrics(data)}
    out = {f"postrl/{k}": v for k, v in m.items() if k != "step"}
    alarms = r.step.watchdog.step(m)
    unmeasured = unmeasured_filter_alarm(r, "sampler/kept_mass_mean" in m)
    if unmeasured is not None:
        if not r.warned_unmeasured:  # the same every step: said once, reported every step
            _log.warning("postrl alarm (step %d) %s", r.diagnostics_steps, unmeasured.text())
            r.warned_unmeasured = True
        out[f"postrl/alarm/{unmeasured.name}"] = 1.0
    for alarm in alarms:
        _log.warning("postrl alarm (step %d) %s", r.diagnostics_steps, alarm.text())
        out[f"postrl/alarm/{alarm.name}"] = 1.0
    return out


def unmeasured_filter_alarm(r: Run, measured: bool) -> Any:
    """The ``filtered_sampling`` alarm when the postrl config samples with top-p / top-k, the trainer's log-probs
    are uncorrected (``rollout.logprobs: full``) and verl's batch does not show the kept mass; None otherwise."""
    s = r.sampling
    if measured or not s.filters or s.logprob_filter() or not r.config.diagnostics.filtered_sampling.enabled:
        return None
    return Alarm("filtered_sampling",
                 f"top_p={s.top_p}, top_k={s.top_k} sampling with log-probs of the unfiltered distribution "
                 "(rollout.logprobs=full): the importance ratio is off by the kept mass per token, unmeasured "
                 "here (no rollout log-probs in verl's batch)",
                 "vLLM samples from the filtered, renormalised distribution (and returns its log-probs, "
                 "logprobs_mode=processed_logprobs) while verl's trainer computes them over the whole vocabulary",
                 "set rollout.logprobs=filtered in the postrl config ($POSTRL_CONFIG: the plug-in then renormalises "
                 "verl's trainer log-probs), or sample without the filter (actor_rollout_ref.rollout.top_p=1.0, "
                 "top_k=-1); actor_rollout_ref.rollout.calculate_log_probs=true measures the kept mass")


# ------------------------------------------------------------------------------------------------ top-p / top-k

LOGPROB_CHUNK = 4096
"""Rows (tokens) per filter computation in :func:`filtered_logprobs_from_logits`: bounds the sort's memory."""


def filtered_logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, top_p: float = 1.0, top_k: int = 0,
                                  chunk: int = LOGPROB_CHUNK) -> torch.Tensor:
    """verl's ``logprobs_from_logits`` (temperature-scaled ``logits`` [..., V], ``labels`` [...]) for the top-p /
    top-k filtered, renormalised distribution: log q(label) = z_label - logsumexp over the kept tokens
    (:func:`postrl.logprobs.filtered_token_logprobs`; the label always kept), float32 [...], differentiable, in
    chunks of ``chunk`` rows."""
    V = logits.shape[-1]
    flat, lab = logits.reshape(-1, V), labels.reshape(-1)
    parts = [filtered_token_logprobs(flat[i:i + chunk].float(), lab[i:i + chunk], top_p, top_k)[0]
             for i in range(0, flat.shape[0], chunk)]
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.view(labels.shape)


def logprob_filter() -> dict:
    """``{'top_p': ..., 'top_k': ...}`` when the postrl config ($POSTRL_CONFIG) asks verl's trainer log-probs to be
    renormalised (``rollout.logprobs: filtered`` with a filter); ``{}`` otherwise, and without a config."""
    if not os.environ.get(ENV_CONFIG):
        return {}
    return run().sampling.logprob_filter()


def install_logprob_filter() -> list[str]:
    """Put the renormalising ``logprobs_from_logits`` in verl (idempotent): in ``verl.utils.torch_functional`` (so
    an engine module imported later imports it) and in every loaded ``verl.*`` module that holds verl's function
    by name; returns those modules. It calls verl's own function unless :func:`logprob_filter` is set."""
    from verl.utils import torch_functional

    current = torch_functional.logprobs_from_logits
    original = getattr(current, "original", current)
    if not getattr(current, "postrl_hook", False):
        @functools.wraps(original)
        def logprobs_from_logits(logits, labels, inplace_backward=True):
            f = logprob_filter()
            if not f:
                return original(logits, labels, inplace_backward=inplace_backward)
            return filtered_logprobs_from_logits(logits, labels, **f)

        logprobs_from_logits.postrl_hook = True
        logprobs_from_logits.original = original
        current = logprobs_from_logits
    patched = []
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "verl" and getattr(module, "logprobs_from_logits", None) in (original, current):
            setattr(module, "logprobs_from_logits", current)
            patched.append(name)
    return patched


def check_worker_config(config: Any) -> None:
    """With the correction on (:func:`logprob_filter`), what verl's worker config (``actor_rollout_ref``) must
    satisfy: its sampling is the postrl config's (``rollout.top_p`` / ``top_k``; ``do_sample=false`` samples
    greedily, no filter), and its trainer log-probs go through ``logprobs_from_logits`` (not Megatron's
    vocab-parallel ones, not ``use_fused_kernels``); with rollout log-probs, they are vLLM's processed ones. One-line
    :class:`ConfigError` naming the verl key; nothing to check with the correction off."""
    f = logprob_filter()
    if not f:
        return
    rollout = config.rollout
    do_sample = bool(rollout.get("do_sample", True))
    verl_top_p = float(rollout.get("top_p", 1.0)) if do_sample else 1.0
    verl_top_k = max(int(rollout.get("top_k", -1)), 0) if do_sample else 0
    if (verl_top_p, verl_top_k) != (f["top_p"], f["top_k"]):
        raise ConfigError(f"actor_rollout_ref.rollout.top_p={verl_top_p}, top_k={verl_top_k or -1} but the postrl "
                          f"config has rollout.top_p={f['top_p']}, top_k={f['top_k']}: the correction "
                          "(rollout.logprobs=filtered) must replay the sampler's filter; set them equal (postrl "
                          "export verl writes verl's from the postrl config)")
    strategy = str(config.actor.get("strategy", "fsdp"))
    if strategy == "megatron":
        raise ConfigError("actor_rollout_ref.actor.strategy=megatron computes the log-probs vocab-parallel "
                          "(vocab_parallel_log_probs_from_logits, no full logits), which the plug-in cannot "
                          "renormalise; use strategy fsdp / fsdp2, or rollout.logprobs=full (uncorrected: the "
                          "filtered_sampling alarm reports it)")
    if bool(config.model.get("use_fused_kernels", False)):
        raise ConfigError("actor_rollout_ref.model.use_fused_kernels=true computes the log-probs without the "
                          "logits, which the plug-in cannot renormalise; set it false, or rollout.logprobs=full")
    if rollout.get("calculate_log_probs", False) and rollout.get("logprobs_mode", "processed_logprobs") != \
            "processed_logprobs":
        raise ConfigError(f"actor_rollout_ref.rollout.logprobs_mode={rollout.get('logprobs_mode')}: with "
                          "rollout.logprobs=filtered the rollout log-probs must be of the filtered distribution "
                          "(processed_logprobs)")


def install_worker_check() -> None:
    """Run :func:`check_worker_config` when verl builds a worker (``ActorRolloutRefWorker.__init__``; idempotent).
    Installed by :func:`load` only with the correction on (importing verl's workers costs about a second)."""
    from verl.workers import engine_workers

    cls = engine_workers.ActorRolloutRefWorker
    init = cls.__init__
    if getattr(init, "postrl_hook", False):
        return

    @functools.wraps(init)
    def __init__(self, config, role, *args, **kwargs):
        check_worker_config(config)
        init(self, config, role, *args, **kwargs)

    __init__.postrl_hook = True
    cls.__init__ = __init__


def install_metrics_hook() -> None:
    """Wrap verl's ``metric_utils.compute_data_metrics`` (before the trainer modules import it) so each step's data
    metrics also carry postrl's metrics and alarms (:func:`diagnose`); idempotent."""
    from verl.trainer.ppo import metric_utils

    original = metric_utils.compute_data_metrics
    if getattr(original, "postrl_hook", False):
        return

    def compute_data_metrics(batch: Any, use_critic: bool = True) -> dict[str, Any]:
        metrics = original(batch=batch, use_critic=use_critic)
        try:
            metrics.update(diagnose(batch))
        except Exception as e:  # noqa: BLE001 - diagnostics must not stop training; the failure is reported
            _loud(f"postrl diagnostics failed on verl's batch: {type(e).__name__}: {e}")
            metrics["postrl/alarm/diagnostics_failed"] = 1.0
        return metrics

    compute_data_metrics.__doc__ = original.__doc__
    compute_data_metrics.postrl_hook = True
    compute_data_metrics.original = original
    metric_utils.compute_data_metrics = compute_data_metrics


# ------------------------------------------------------------------------------------------------ loading


def load() -> dict[str, list[str]]:
    """What verl's plug-in loading runs: register, install the metrics hook, check; loud on any failure."""
    import verl.trainer.ppo.core_algos  # noqa: F401 - without verl, a plain ImportError (pip install postrl[verl])

    try:
        names = register()
        install_metrics_hook()
        install_logprob_filter()
        check_registered()
        if os.environ.get(ENV_CONFIG):
            check_config(run_config())  # a wrong name or parameter fails here, at start-up, in one line
            if logprob_filter():
                install_worker_check()
    except Exception as e:
        _loud(f"postrl verl plug-in failed to load: {type(e).__name__}: {e}")
        raise
    return names


load()
