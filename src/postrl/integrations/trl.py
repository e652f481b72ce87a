"""postrl's stages inside TRL: :class:`GRPOTrainer`, a drop-in subclass of TRL's ``GRPOTrainer`` (extra ``postrl[trl]``).

A TRL user swaps the import (``from postrl.integrations.trl import GRPOTrainer``) and keeps every argument: the
same ``model``, ``reward_funcs``, ``args`` (a ``GRPOConfig``), datasets, ``processing_class``,
``reward_processing_classes``, ``peft_config``, ``tools``, ``environment_factory``...; the one addition is the keyword
``postrl``, a postrl config section (a :class:`postrl.config.Config` or a dict of its keys) naming postrl stages.

TRL keeps what it does well: generation (transformers or vLLM colocate / server), Accelerate with DeepSpeed / FSDP,
PEFT, gradient checkpointing, checkpoints, ``report_to``, its metric names. postrl brings the one step every driver
runs (:class:`postrl.step.Step`):

* rewards: TRL's ``reward_funcs`` exactly as TRL takes them (callables, sync or async, called by keyword with
  TRL's arguments: conversational prompts and completions as message lists, ``completion_ids``, the dataset's
  columns, ``trainer_state`` (TRL's ``TrainerState``), ``log_extra`` / ``log_metric`` into TRL's completions table
  and metrics, ``environments``; reward models as a hub id, a local folder or a ``PreTrainedModel``, scored as TRL
  scores a sequence-classification model, with ``reward_processing_classes``; an environment's ``get_reward``),
  weighted by ``reward_weights`` and logged under TRL's names (``rewards/<name>/mean``), become postrl reward sources
  of the step: scored with postrl's fault isolation (``postrl.step.scoring.Scorer``: a source that raises or returns
  NaN fails only its entries, which are excluded from the advantage and counted; None = does not apply, as in TRL),
  shaped by the ``shaping`` stages and diagnosed (``postrl/reward/<name>/...``). The section's ``rewards`` (a
  registered name or ``module:function``) are further sources, after TRL's; without ``reward_funcs`` they are the
  sources (default: postrl's ``correct`` and ``format``);
* ``filters``: keep-mask filters (kind ``filter``); a dropped group stays in TRL's batch with ``valid`` False (no
  advantage, no loss): TRL owns the sampling, so there is no refill (``max_attempts``);
* ``advantage``: any estimator (fields it reads from the model, e.g. ``token_entropy``, are produced through TRL's
  own forward);
* ``loss`` / ``loss.agg`` / ``loss.tis`` / ``kl`` / ``regularizers``: the same :class:`postrl.losses.objective.Objective`
  postrl's trainer uses. The aggregation's weights are computed over each optimizer step's whole batch (every
  micro-batch of the gradient accumulation, every process), so the loss does not change with the micro-batch size
  or the number of processes;
* ``diagnostics``: postrl's batch metrics (``postrl.diagnostics.metrics.batch_metrics``) and the monitors' alarms
  (``postrl.diagnostics.monitors.Watchdog``), once per generation, logged through TRL's logging under
  ``postrl/<key>`` (``postrl/alarm/<name>`` = 1 at a step where the alarm is active, with the alarm's text as a
  warning of the ``postrl.trl`` logger), beside TRL's own metrics (``reward``, ``rewards/<name>/mean``, ``entropy``,
  ``kl``, ``clip_ratio/*``, ``aux_loss``...).

TRL's algorithm options are the defaults of the section (:func:`trl_section`): ``loss_type``, ``epsilon``,
``epsilon_high``, ``delta``, ``importance_sampling_level``, ``scale_rewards``, ``multi_objective_aggregation``,
``top_entropy_quantile``, ``off_policy_mask_threshold``, ``beta`` (with ``use_bias_correction_kl``),
``sapo_temperature_*`` become the postrl stages that compute the same step; the section's own keys override them
(a TRL option set away from its default and a section key that disagrees with it is a one-line error naming both).
``entropy_coef`` / ``use_adaptive_entropy`` keep TRL's own entropy bonus (TRL's formula and controller, on top of
the objective). An option that cannot carry over is refused in one line that says what to do.

How it hooks into TRL (which has no advantage or loss hook): ``_calculate_rewards`` scores and shapes (and returns
the raw reward matrix, so TRL's own ``rewards/<name>/mean`` stay right), ``_generate_and_score_completions``
replaces TRL's advantages by the postrl stage's, ``_prepare_inputs`` adds the aggregation weights, ``_compute_loss``
evaluates the objective on TRL's log-probs, ``training_step`` ends the postrl step (stateful stages, KL controller,
metrics, alarms) after the last micro-batch of a generation.

A stage that needs what TRL's batch does not carry (logits, a greedy generation, a teacher's log-probs, a
reset of the reference model, a prompt selector or a sampling plan) is refused at construction.

Several processes: every process gathers the completions of all of them (TRL spreads a group over processes),
scores and shapes that batch, runs the filters and the advantage on it and keeps its own rows, so every process
holds the same statistics and state; the reward sources therefore run on every process (cheap for verifiers; a
costly judge or reward model is called once per process), and what they receive is gathered too (with
``environment_factory``, TRL's environment objects must then be picklable). Only the one-process path is tested here.

Errors are one line and are both :class:`postrl.errors.ConfigError` and ``ValueError`` (what TRL raises).

Top-p / top-k: the sampler draws from the filtered, renormalised distribution q = pi / M (M the probability mass
the filter kept), TRL's trainer computes log pi over the whole vocabulary, so with vLLM's processed log-probs every
token's importance ratio carries the factor M (TRL issue 6789), and without them the gradient is that of log pi,
not of the log q the tokens were drawn from. The adapter reads the sampling settings TRL samples with
(``GRPOConfig.top_p`` / ``top_k``, overridden by ``generation_kwargs``; vLLM's ``top_k=-1`` is off; greedy
``do_sample=False`` has no filter) into the section's ``rollout.top_p`` / ``rollout.top_k``, and with
``rollout.logprobs: filtered`` in the postrl section computes every trainer-side log-prob (the update's, the old and
the reference ones TRL computes, the field producers') of the renormalised filtered distribution, exactly as
postrl's own trainer (:func:`postrl.logprobs.filtered_token_logprobs`): TRL's fused LM head, which never forms
the logits, is replaced by the model's own forward for those calls (``_get_per_token_logps_and_entropies``, one
[rows, completion tokens, vocab] logits tensor per micro-batch). Neither HF ``generate`` nor TRL's vLLM client
returns the sampler's kept set, so the kept set is the same top-p / top-k applied to the trainer's logits (the
sampled token always kept). The kept mass is logged in both modes (``postrl/sampler/kept_mass_mean``, ``_min``,
``kept_logmass_seq``: one extra no-grad forward per generation while a filter is on) and the
``filtered_sampling`` alarm fires when it is low and the log-probs are uncorrected (``rollout.logprobs: full``,
the default, TRL's own behaviour). ``min_p`` is not replayed: with ``rollout.logprobs: filtered`` it is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import warnings
from types import SimpleNamespace
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from postrl.errors import ConfigError, PostrlError

try:
    import trl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise PostrlError(f"postrl.integrations.trl needs TRL: pip install 'postrl[trl]' ({e})") from None

from postrl.batch import RolloutBatch
from postrl.config import Config, load_config
from postrl.context import ModelContext
from postrl.diagnostics.metrics import mismatch_metrics
from postrl.generation import SamplingParams
from postrl.logprobs import filtered_token_logprobs, logits_entropy
from postrl.rewards import RewardContext
from postrl.step import Step
from postrl.train.processes import Processes

_log = logging.getLogger("postrl.trl")
_trl_log = logging.getLogger("trl.trainer.grpo_trainer")  # (TRL's own warnings keep their logger)


from postrl.integrations.alarms import AlarmCallback  # noqa: E402,F401 - postrl's alarms on TRL's own trainer


class TRLConfigError(ConfigError, ValueError):
    """A one-line configuration error of the TRL adapter: a postrl ``ConfigError`` and the ``ValueError`` TRL
    raises for a bad option, so code written for TRL catches it."""


# GRPOConfig options with no postrl counterpart under the adapter: (option, value) -> what to do instead (every
# loss_type of TRL 1.16 has one now; the other refusals depend on several options: see trl_section and _configure)
REFUSED: dict[tuple[str, Any], str] = {}
# fields a stage may read that TRL's batch cannot give
_UNAVAILABLE = {"logits": "the logits (TRL's forward returns log-probs and entropies only)",
                "greedy_reward": "a greedy generation (TRL owns generation)",
                "teacher_logp": "a teacher model's log-probs (TRL's GRPOTrainer runs no teacher; TRL's "
                                "DistillationTrainer distils with its full-vocabulary generalized JSD)"}


def _text(x: Any) -> str:
    """A completion as text: a string as it is, a conversation's messages' contents joined."""
    if isinstance(x, str):
        return x
    return "".join(m.get("content", "") if isinstance(m.get("content"), str) else str(m.get("content") or "")
                   for m in x)


# the multimodal fields of TRL's batch that its log-prob forward takes (keyword arguments of
# ``_get_per_token_logps_and_entropies``)
_FORWARD_FIELDS = ("num_images", "num_tiles", "pixel_values", "image_grid_thw", "pixel_attention_mask",
                   "spatial_shapes", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def trl_sampling(args: Any, logprobs: str = "full") -> SamplingParams:
    """The sampling TRL does with ``args`` (a ``GRPOConfig``) as :class:`~postrl.generation.SamplingParams`:
    ``temperature``, ``top_p``, ``top_k`` (``generation_kwargs`` override them, as TRL's generation does; a
    ``top_k`` <= 0, vLLM's -1 included, is off; ``do_sample=False``: greedy, temperature 0, no filter), with
    ``logprobs`` (postrl's ``rollout.logprobs``). ``min_p`` is not carried: with ``logprobs='filtered'`` a
    ``min_p`` > 0 is a :class:`ConfigError` (the correction would replay a different filter than the sampler's)."""
    gk = dict(args.generation_kwargs or {})
    top_p = gk.get("top_p", args.top_p)
    top_k = gk.get("top_k", args.top_k)
    min_p = gk.get("min_p", args.min_p)
    temperature = float(args.temperature) if gk.get("do_sample", True) else 0.0
    params = SamplingParams(max_new_tokens=args.max_completion_length, temperature=temperature,
                            top_p=1.0 if top_p is None else float(top_p), top_k=max(int(top_k or 0), 0),
                            logprobs=logprobs)
    if logprobs == "filtered" and min_p and temperature > 0:
        raise ConfigError(f"GRPOConfig.min_p={min_p}: the top-p / top-k correction (rollout.logprobs=filtered) does "
                          "not replay min_p; sample with top_p / top_k instead (min_p=None), or set "
                          "rollout.logprobs=full")
    return params


class _FilteredHead:
    """TRL's log-prob call ``model(**inputs, labels=labels, fused_lm_head=True)`` answered with the log-probs of the
    top-p / top-k filtered, renormalised distribution: the model's own forward (``fused_lm_head`` off: TRL's fused
    head never forms the logits) over the last ``T + 1`` positions, the logits divided by ``temperature``, then
    :func:`postrl.logprobs.filtered_token_logprobs` at the labels (the completion tokens; -100 where masked, given
    0). Returns what TRL reads of its fused output (``log_probs``, ``entropy`` of the unfiltered distribution,
    ``aux_loss``), each [B, T]. ``kept``: a list that receives each call's kept log-mass [B, T] (0 where masked).
    ``entropy_grad``: the entropy is differentiable (as TRL's fused head's is) for a stage or TRL's entropy bonus
    that differentiates it; otherwise it carries no gradient (one [B, T, V] tensor less kept for the backward)."""

    def __init__(self, model: Any, T: int, temperature: float, top_p: float, top_k: int,
                 kept: list | None = None, entropy_grad: bool = False):
        self.model, self.T, self.temperature, self.top_p, self.top_k, self.kept = \
            model, T, temperature or 1.0, top_p, top_k, kept
        self.entropy_grad = entropy_grad

    def __call__(self, *, labels: torch.Tensor, fused_lm_head: bool = True, **inputs: Any) -> SimpleNamespace:
        T = self.T
        out = self.model(**inputs, logits_to_keep=T + 1, use_cache=False)
        scaled = out.logits[:, -(T + 1):-1].float() / self.temperature
        target = labels[:, -T:]
        valid = target != -100
        logp, kept = filtered_token_logprobs(scaled, target.clamp(min=0), self.top_p, self.top_k)
        with torch.set_grad_enabled(self.entropy_grad and torch.is_grad_enabled()):
            entropy = logits_entropy(scaled)
        if self.kept is not None:
            self.kept.append(kept.masked_fill(~valid, 0.0))
        return SimpleNamespace(log_probs=logp.masked_fill(~valid, 0.0), entropy=entropy.masked_fill(~valid, 0.0),
                               aux_loss=getattr(out, "aux_loss", None))


def _trl_default(name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _changed(args: Any, name: str) -> bool:
    value = getattr(args, name)
    if name == "scale_rewards":  # (GRPOConfig turns True / False into "group" / "none")
        return {True: "group", False: "none"}.get(value, value) != "group"
    return value != _trl_default(name)


def trl_section(args: Any) -> tuple[dict, dict]:
    """The postrl section that computes TRL's step for ``args`` (a ``GRPOConfig``), and for each of its keys the
    GRPOConfig option that decided it: ``({"loss": {...}, "advantage": {...}, "kl": {...}, "regularizers": [...]},
    {("loss", "agg"): "loss_type", ...})``. Raises :class:`TRLConfigError` for an option with no postrl counterpart.

    loss_type -> ``loss.agg``: grpo / sapo ``seq_mean_token_mean``, dapo / bnpo / cispo ``token_mean`` (bnpo
    normalises by each micro-batch's tokens: equal when one micro-batch is one optimizer step), dr_grpo ``dr_grpo``,
    luspo ``seq_mean_token_sum``, vespo ``token_mean``; ``loss.name``: ``ppo_clip`` (``eps_low`` = epsilon,
    ``eps_high`` = epsilon_high or epsilon, ``dual_clip`` = delta), ``gspo`` with importance_sampling_level='sequence',
    ``cispo`` (cap = TRL's epsilon_high: ``eps_high`` = epsilon_high - 1), ``sapo`` (``tau_pos`` / ``tau_neg`` =
    sapo_temperature_pos / neg), ``vespo`` (``vespo_*``); scale_rewards -> ``advantage: {name: grpo, scale, eps: 1e-4}`` (TRL's epsilon); multi_objective_aggregation
    normalize_then_sum -> ``gdpo``; top_entropy_quantile -> regularizer ``top_entropy_tokens``;
    off_policy_mask_threshold -> regularizer ``off_policy_mask``; beta -> ``kl: {coef: beta, estimator: k3,
    placement: loss, is_correction}`` (``token`` / ``sequence`` with use_bias_correction_kl, TRL's default).
    """
    for (name, value), fix in REFUSED.items():
        if getattr(args, name) == value:
            raise TRLConfigError(f"GRPOConfig.{name}={value!r}: {fix}")
    why: dict[tuple, str] = {}
    lt = args.loss_type
    sequence = args.importance_sampling_level == "sequence"
    eps_low = float(args.epsilon)
    eps_high = float(args.epsilon_high if args.epsilon_high is not None else args.epsilon)
    agg = {"grpo": "seq_mean_token_mean", "sapo": "seq_mean_token_mean", "dapo": "token_mean", "bnpo": "token_mean",
           "cispo": "token_mean", "vespo": "token_mean", "dr_grpo": "dr_grpo", "luspo": "seq_mean_token_sum"}.get(lt)
    if agg is None:
        raise TRLConfigError(f"GRPOConfig.loss_type={lt!r}: not a loss type the adapter knows; use one of grpo, dapo, "
                             f"bnpo, dr_grpo, cispo, sapo, luspo, vespo, or set loss and loss.agg in the postrl "
                             f"section")
    if lt == "cispo":
        if eps_high <= 0.0:
            raise TRLConfigError(f"GRPOConfig.loss_type='cispo' caps the importance weight at epsilon_high "
                                 f"({eps_high:g}); set a positive cap (ScaleRL's 5.0)")
        loss = {"name": "cispo", "eps_high": eps_high - 1.0}
        keys = ("loss_type", "epsilon_high")
    elif lt == "vespo":
        loss = {"name": "vespo", "k_pos": float(args.vespo_k_pos), "lambda_pos": float(args.vespo_lambda_pos),
                "k_neg": float(args.vespo_k_neg), "lambda_neg": float(args.vespo_lambda_neg)}
        keys = ("loss_type", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    elif lt == "sapo":
        loss = {"name": "sapo", "tau_pos": float(args.sapo_temperature_pos),
                "tau_neg": float(args.sapo_temperature_neg)}
        keys = ("loss_type", "sapo_temperature_pos", "sapo_temperature_neg")
    elif sequence:
        loss = {"name": "gspo", "eps_low": eps_low, "eps_high": eps_high}
        keys = ("importance_sampling_level", "epsilon", "epsilon_high")
        if args.delta is not None:
            raise TRLConfigError("GRPOConfig.delta with importance_sampling_level='sequence': postrl's gspo has no "
                                 "two-sided clip; drop delta, or use importance_sampling_level='token'")
    else:
        loss = {"name": "ppo_clip", "eps_low": eps_low, "eps_high": eps_high}
        keys = ("epsilon", "epsilon_high")
        if args.delta is not None:
            if args.delta <= 1.0 + eps_high:
                raise TRLConfigError(f"GRPOConfig.delta={args.delta:g} must exceed 1 + epsilon_high "
                                     f"({1.0 + eps_high:g}) under postrl's adapter (postrl: loss.dual_clip)")
            loss["dual_clip"] = float(args.delta)
            keys = (*keys, "delta")
    params = " / ".join(o for o in keys if o != "loss_type")
    for k in loss:
        why[("loss", k)] = params
    why[("loss", "name")] = "loss_type / importance_sampling_level"
    loss["agg"] = agg
    why[("loss", "agg")] = "loss_type"
    if args.multi_objective_aggregation == "normalize_then_sum":
        advantage = {"name": "gdpo"}
        why[("advantage", "name")] = "multi_objective_aggregation"
    else:
        scale = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)
        advantage = {"name": "grpo", "scale": scale, "eps": 1e-4}
        for k in advantage:
            why[("advantage", k)] = "scale_rewards"
    regularizers = []
    if args.top_entropy_quantile < 1.0:
        regularizers.append({"name": "top_entropy_tokens", "q": float(args.top_entropy_quantile)})
    if args.off_policy_mask_threshold is not None:
        regularizers.append({"name": "off_policy_mask", "threshold": float(args.off_policy_mask_threshold)})
    kl = {"coef": float(args.beta)}
    why[("kl", "coef")] = "beta"
    if args.beta:
        kl.update(estimator="k3", placement="loss",
                  is_correction=("sequence" if sequence else "token") if args.use_bias_correction_kl else "none")
        for k in ("estimator", "placement", "is_correction"):
            why[("kl", k)] = "beta / use_bias_correction_kl"
    return {"loss": loss, "advantage": advantage, "kl": kl, "regularizers": regularizers}, why


# the GRPOConfig options trl_section reads (one of them away from its default makes its keys binding)
_TRANSLATED = ("loss_type", "epsilon", "epsilon_high", "delta", "importance_sampling_level", "scale_rewards",
               "multi_objective_aggregation", "top_entropy_quantile", "off_policy_mask_threshold", "beta",
               "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
               "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


def _explicit(postrl: Config | Mapping[str, Any] | None) -> dict:
    """The keys the user set in the postrl section (a Config: those set when it was made)."""
    if postrl is None:
        return {}
    if isinstance(postrl, Config):
        return postrl.model_dump(mode="python", exclude_unset=True)
    return copy.deepcopy(dict(postrl))


def _section(postrl: Config | Mapping[str, Any] | None, args: Any, rollout: dict, steps: int | None,
             trl_rewards: bool) -> Config:
    """The run's postrl config: TRL's options as defaults (:func:`trl_section`), the user's section over them
    (a disagreement with an option set away from TRL's default is an error), TRL's rollout settings; its
    ``rewards`` are the ones the section names (none: TRL's ``reward_funcs`` are the only reward sources; with
    neither, ``trl_rewards`` False, the error TRL raises, with the postrl way added)."""
    if not trl_rewards and "rewards" not in _explicit(postrl):
        raise TRLConfigError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
                             "environment defines a `get_reward` method, or name rewards in the postrl section")
    user = _explicit(postrl)
    base, why = trl_section(args)
    changed = {o for o in _TRANSLATED if _changed(args, o)}
    for (sec, key), opt in why.items():
        mine = user.get(sec)
        if not isinstance(mine, Mapping) or key not in mine or mine[key] == base[sec][key]:
            continue
        if changed & set(opt.split(" / ")):
            raise TRLConfigError(
                f"GRPOConfig.{' / '.join(o for o in opt.split(' / ') if o in changed)} sets {sec}.{key}="
                f"{base[sec][key]!r} but the postrl section sets {sec}.{key}={mine[key]!r}: set it in one place")
    merged = dict(user)
    for sec in ("loss", "advantage"):
        mine = dict(user.get(sec) or {})
        theirs = dict(base[sec])
        if "name" in mine and mine["name"] != theirs["name"]:  # another stage: TRL's parameters are not its own
            lost = sorted(changed & {o for (s_, k), o2 in why.items() if s_ == sec and k not in ("name", "agg")
                                     for o in o2.split(" / ")})
            if lost:
                raise TRLConfigError(f"GRPOConfig.{lost[0]} is a parameter of TRL's {sec} ({theirs['name']}) but the "
                                     f"postrl section sets {sec}.name={mine['name']!r}: set it in one place")
            theirs = {k: v for k, v in theirs.items() if k == "agg"}
        merged[sec] = {**theirs, **mine}
    merged["kl"] = {**base["kl"], **dict(user.get("kl") or {})}
    regs = list(user.get("regularizers") or [])
    mine_names = {r.get("name") for r in regs if isinstance(r, Mapping)}
    for r in base["regularizers"]:
        if r["name"] in mine_names:
            raise TRLConfigError(f"regularizers: '{r['name']}' is set both by GRPOConfig ("
                                 f"{'top_entropy_quantile' if r['name'] == 'top_entropy_tokens' else 'off_policy_mask_threshold'}"
                                 f") and in the postrl section: set it in one place")
        regs.append(r)
    merged["regularizers"] = regs
    merged["rollout"] = {**dict(user.get("rollout") or {}), **rollout}
    if steps is not None:
        merged["train"] = {**dict(user.get("train") or {}), "steps": steps}
    cfg = load_config(base=merged)
    if "rewards" not in user:  # TRL's reward_funcs are the sources (a config needs one: they come in the adapter)
        cfg = cfg.model_copy(update={"rewards": []})
    return cfg


class SequenceClassifierReward:
    """A reward model as TRL scores it: ``prompt + completion`` (a conversation: its chat template applied to the
    prompt's and the completion's messages, with TRL's ``chat_template_kwargs``) tokenised by its processing class
    (right padding, no special tokens added), one forward under ``torch.inference_mode``, the reward is ``logits[:,
    0]``. ``prepare`` moves the tokenised inputs where the model is (TRL: ``Trainer._prepare_inputs``)."""

    trl_format = True  # (postrl.rewards.core: conversational completions arrive as TRL's message lists)

    def __init__(self, model: Any, processing_class: Any, prepare: Any, chat_template_kwargs: dict | None = None):
        self.model = model
        self.processing_class = processing_class
        self.prepare = prepare
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = type(self).__name__

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        from trl.data_utils import apply_chat_template, is_conversational

        if is_conversational({"prompt": prompts[0]}):
            texts = [apply_chat_template({"messages": p + c}, self.processing_class, **self.chat_template_kwargs)["text"]
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = self.processing_class(text=texts, return_tensors="pt", padding=True, padding_side="right",
                                       add_special_tokens=False)
        inputs = self.prepare(inputs)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().tolist()


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer with postrl's rewards, shaping, filters, advantage, objective and diagnostics.

    Every argument is TRL's, in TRL's order; ``postrl`` (keyword only): the postrl section (a
    :class:`~postrl.config.Config` or a dict of its keys; sections TRL owns, such as ``model``, ``rollout``, ``optim``
    and ``train``, are not read: ``rollout.group_size``, ``rollout.max_new_tokens`` and ``rollout.temperature`` are
    taken from ``args``). See the module docstring.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: Any = None, rollout_func: Any = None,
                 environment_factory: Any = None, *, postrl: Config | Mapping[str, Any] | None = None):
        if args is None:  # TRL's default
            name = model if isinstance(model, str) else _model_id(model)
            args = trl.GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        funcs = None if reward_funcs is None else (list(reward_funcs) if isinstance(reward_funcs, list)
                                                   else [reward_funcs])
        try:
            args, cfg, rpc = self._configure(args, postrl, funcs, reward_processing_classes,
                                             trl_rewards=funcs is not None or environment_factory is not None)
            early = Step(cfg)  # every stage built and checked before TRL loads a model
            self._check_stages(early, cfg)
        except TRLConfigError:
            raise
        except ConfigError as e:
            raise TRLConfigError(str(e)) from None
        self.postrl_config = cfg
        self.alarms: list[dict] = []  # every alarm raised, as dicts (name, message, cause, fix, severity, step)
        self.postrl_steps = 0  # postrl steps ended (one per generation)
        # per mode (train / eval): the scored batch of the current generation, its reward outcome, local rows
        self._scored: dict[str, tuple[RolloutBatch, dict, int]] = {}
        self._step_metrics: dict[str, float] = {}
        self._loss_sums: dict[str, float] = {}
        self._filter_metrics: dict[str, float] = {}
        n_user = len(funcs or [])
        section = [s.fn for s in early.scorer.rewards]
        super().__init__(model=model, reward_funcs=(funcs or []) + section, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, reward_processing_classes=rpc,
                         callbacks=callbacks, optimizers=optimizers, quantization_config=quantization_config,
                         peft_config=peft_config, tools=tools, rollout_func=rollout_func,
                         environment_factory=environment_factory)
        # TRL's reward sources, as TRL loaded them (models prepared), then its environments' get_reward, then the
        # section's: the reward matrix's columns, in that order
        k = len(section)
        order = [*range(n_user), *range(n_user + k, len(self.reward_funcs)), *range(n_user, n_user + k)]
        trl_idx = [i for i in order if not n_user <= i < n_user + k]
        names = [self.reward_func_names[i] for i in trl_idx]
        weights = self.reward_weights.tolist()
        w_trl = [weights[i] for i in trl_idx]
        unique = [n if names.count(n) == 1 else f"{n}.{j}" for j, n in enumerate(names)]
        sources = []
        for i, name, w in zip(trl_idx, unique, w_trl):
            fn = self.reward_funcs[i]
            if isinstance(fn, torch.nn.Module):
                fn = SequenceClassifierReward(fn, self.reward_processing_classes[i], self._prepare_tensors,
                                              self.chat_template_kwargs)
            sources.append((name, fn, w))
        tok = self._tokenizer
        unwrapped = self.accelerator.unwrap_model(self.model)
        self.postrl = Step(cfg, sources=sources, tokenizer=tok,
                           context=RewardContext(model=unwrapped, tokenizer=tok, device=self.accelerator.device))
        for msg in self.postrl.warnings:
            warnings.warn(msg, stacklevel=2)
        scorer = self.postrl.scorer
        self.reward_funcs = [self.reward_funcs[i] for i in trl_idx] + [s.fn for s in scorer.rewards[len(sources):]]
        self.reward_processing_classes = [self.reward_processing_classes[i] for i in trl_idx] + [None] * k
        self.reward_func_names = names + [s.label for s in scorer.rewards[len(sources):]]
        self.reward_weights = scorer.weights.clone()
        self.procs = Processes(self.accelerator)
        self.ctx = ModelContext(unwrapped, tok, self.accelerator.device, temperature=float(args.temperature),
                                micro_batch_size=args.per_device_train_batch_size, sampling=self.postrl_sampling,
                                pad_id=tok.pad_token_id, logprob_fn=self._logprob_fn,
                                score=lambda b: self.postrl.score(b, observe=False))

    # ------------------------------------------------------------------------------------------------ config
    def _configure(self, args: Any, postrl: Any, funcs: list | None, rpc: Any,
                   trl_rewards: bool) -> tuple[Any, Config, Any]:
        """The GRPOConfig TRL gets, the postrl config, the reward processing classes TRL gets (one per reward source
        passed to it: TRL's, then the section's). ``trl_rewards``: TRL has reward sources of its own
        (``reward_funcs`` or an environment's ``get_reward``), so the section's ``rewards`` only add to them."""
        if funcs is None and args.reward_weights is not None:
            raise TRLConfigError("GRPOConfig.reward_weights weighs reward_funcs; the postrl section's reward sources "
                                 "take rewards.N.weight")
        rollout = {"group_size": args.num_generations, "max_new_tokens": args.max_completion_length,
                   "temperature": float(args.temperature)}
        cfg = _section(postrl, args, rollout, args.max_steps if args.max_steps > 0 else None,
                       trl_rewards=trl_rewards)
        # the sampling TRL does (top-p / top-k, generation_kwargs) is the section's rollout's too
        self.postrl_sampling = trl_sampling(args, cfg.rollout.logprobs)
        self._logprob_filter = self.postrl_sampling.logprob_filter()  # {} unless the log-probs are corrected
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
            "top_p": self.postrl_sampling.top_p, "top_k": self.postrl_sampling.top_k})})
        if cfg.kl.coef > 0 and cfg.kl.placement != "loss":
            raise TRLConfigError("kl.placement=reward is not available in the TRL adapter; use kl.placement=loss")
        if args.use_vllm and args.vllm_importance_sampling_correction and cfg.loss.tis.level == "none":
            raise TRLConfigError("GRPOConfig.vllm_importance_sampling_correction: with vLLM, correct the sampler/"
                                 "trainer mismatch with postrl's loss.tis (e.g. {level: token, mode: truncate, cap: "
                                 "2}) or set vllm_importance_sampling_correction=False")
        n_section = len(cfg.rewards)
        args = copy.copy(args)  # (dataclasses.replace would run GRPOConfig's checks again on resolved values)
        args.beta = cfg.kl.coef  # TRL keeps a reference model (or the PEFT adapter disabled) when it is > 0
        if n_section and funcs:
            n = len(funcs)
            if args.reward_weights is not None:
                if len(args.reward_weights) != n:
                    raise TRLConfigError(f"Number of reward weights ({len(args.reward_weights)}) must match number "
                                         f"of reward functions ({n})")
                args.reward_weights = [*args.reward_weights, *(r.weight for r in cfg.rewards)]
            if rpc is not None:
                rpc = rpc if isinstance(rpc, list) else [rpc]
                if len(rpc) != n:
                    raise TRLConfigError(f"The number of reward processing classes ({len(rpc)}) must match the "
                                         f"number of reward functions ({n}).")
                rpc = [*rpc, *[None] * n_section]
        return args, cfg, rpc

    @staticmethod
    def _check_stages(step: Step, cfg: Config) -> None:
        """Refuse the stages that need what TRL's batch does not carry."""
        objective = step.objective
        if "ref_logp" in objective.reads and cfg.kl.coef == 0:
            raise TRLConfigError("a loss or regularizer reads ref_logp: set kl.coef > 0 (or GRPOConfig.beta) so that "
                                 "TRL keeps a reference model")
        for i, (spec, s) in enumerate(zip(cfg.filters, step.selection)):
            if s.kind != "filter":
                raise TRLConfigError(f"filters.{i}: '{s.name}' is a {s.kind} stage; the TRL adapter runs keep-mask "
                                     f"filters (kind filter) only: TRL owns prompt sampling and generation")
            if spec.max_attempts is not None and spec.max_attempts > 1:
                warnings.warn(f"filters.{i}: max_attempts is not available under TRL (no refill): dropped groups are "
                              f"masked out of the update", stacklevel=3)
        for s in step.needing("reference_reset"):
            raise TRLConfigError(f"{s.kind} '{s.name}': resetting the reference model is not available in the TRL "
                                 "adapter (TRL owns the reference; its own GRPOConfig.sync_ref_model does that)")
        for s in [step.advantage, *objective.regularizers, objective.loss]:
            for field in set(s.reads) & set(_UNAVAILABLE):
                raise TRLConfigError(f"{s.kind} '{s.name}' reads {field}: the TRL adapter cannot give "
                                     f"{_UNAVAILABLE[field]}")

    def _prepare_tensors(self, inputs: Any) -> Any:
        """``transformers.Trainer._prepare_inputs`` (tensors to the device, DeepSpeed's dtype): what TRL does to a
        reward model's inputs."""
        from transformers import Trainer

        return Trainer._prepare_inputs(self, inputs)

    # ------------------------------------------------------------------------------------------------ model
    def _logprob_fn(self, model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    completion_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False, **_: Any):
        """``postrl.models.completion_logprobs``'s signature on TRL's forward (its temperature, its wrapped
        model; the filter, with ``rollout.logprobs=filtered``, applied by
        :meth:`_get_per_token_logps_and_entropies`): what the field producers (e.g. ``token_entropy``) use."""
        ids = torch.cat([prompt_ids, completion_ids], 1)
        attn = torch.cat([prompt_mask, torch.ones_like(completion_ids)], 1)
        logp, ent, _ = self._get_per_token_logps_and_entropies(self.model, ids, attn, completion_ids.shape[1],
                                                               compute_entropy=with_entropy)
        return logp, ent

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's log-prob function (every trainer-side log-prob goes through it: the update's, the old and the
        reference ones); with ``rollout.logprobs=filtered`` and a top-p / top-k filter, of the renormalised
        filtered distribution the tokens were drawn from (:class:`_FilteredHead`; TRL's chunking and multimodal
        inputs unchanged)."""
        if self._logprob_filter:
            entropy_grad = self._entropy_bonus_enabled or self.postrl.objective.entropy_grad
            model = _FilteredHead(model, logits_to_keep, self.postrl_sampling.temperature, **self._logprob_filter,
                                  entropy_grad=entropy_grad)
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                          **kwargs)

    def _sampler_kept_logmass(self, out: dict) -> torch.Tensor:
        """log M [n, T] of this process's rows of a generation ``out``: the log of the unfiltered probability mass
        the top-p / top-k filter keeps at each completion token, from the trainer's logits (no gradient, in
        micro-batches of ``per_device_train_batch_size``; 0 where masked)."""
        from trl.models.utils import disable_gradient_checkpointing

        T = out["completion_ids"].shape[1]
        kept: list[torch.Tensor] = []
        sp = self.postrl_sampling
        head = _FilteredHead(self.model, T, sp.temperature, sp.top_p, sp.top_k, kept=kept)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            trl.GRPOTrainer._get_per_token_logps_and_entropies(
                self, head, ids, attn, T, batch_size=self.args.per_device_train_batch_size,
                **{k: out[k] for k in _FORWARD_FIELDS if k in out})
        return torch.cat(kept).float()

    @property
    def _generate_every(self) -> int:
        return self.args.steps_per_generation * self.num_iterations

    # ------------------------------------------------------------------------------------------------ rewards
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """postrl's rewards (fault isolation) and shaping, then the keep-mask filters, on the batch of every
        process; returns the raw reward matrix [N, K] of all processes (what TRL's own method returns). Reward
        functions receive what TRL gives them: its prompts and completions (message lists when conversational),
        ``completion_ids``, the columns, ``trainer_state``, ``log_extra`` / ``log_metric`` (into TRL's logs) and
        ``environments``."""
        mode = "train" if self.model.training else "eval"
        pad = self._tokenizer.pad_token_id
        ends = [*self.eos_token_ids, pad]
        n = len(completion_ids_list)
        T = max((len(c) for c in completion_ids_list), default=0)
        ids = torch.full((n, T), pad, dtype=torch.long)
        mask = torch.zeros(n, T)
        for i, c in enumerate(completion_ids_list):
            ids[i, :len(c)] = torch.tensor(list(c), dtype=torch.long)
            mask[i, :len(c)] = 1.0
        keys = [k for k in inputs[0] if k not in ("prompt", "completion", "completion_ids")]
        columns = {k: [x.get(k) for x in inputs] for k in keys}
        if self.environments is not None:
            columns["environments"] = list(self.environments)
        local = RolloutBatch(
            prompt_ids=torch.zeros(n, 0, dtype=torch.long), prompt_mask=torch.zeros(n, 0, dtype=torch.long),
            completion_ids=ids, completion_mask=mask, group_ids=torch.zeros(n, dtype=torch.long),
            sampler_logprobs=torch.full((n, T), float("nan")),
            truncated=torch.tensor([len(c) > 0 and c[-1] not in ends for c in completion_ids_list], dtype=torch.bool),
            prompts=list(prompts), completions=[_text(c) for c in completions], columns=columns)
        if completions and not isinstance(completions[0], str):
            local.extra["completion_messages"] = list(completions)
        batch = RolloutBatch.concat(self.procs.gather(local), pad)
        G = self.num_generations if mode == "train" else self.num_generations_eval
        batch.group_ids = torch.arange(len(batch)) // G + self.postrl_steps * len(batch)
        batch.extra.update(step=self.state.global_step, max_steps=self.state.max_steps, trainer_state=self.state)
        info = self.postrl.score(batch, observe=mode == "train")
        rank = self.accelerator.process_index
        for key, values in batch.extra.items():  # log_extra: TRL's completions table (this process's rows)
            if key.startswith("log_extra:"):
                self._pending_extra_logs[key[len("log_extra:"):]].extend(values[rank * n:(rank + 1) * n])
        for name, value in info.get("metrics", {}).items():  # log_metric: TRL's metrics
            self._pending_metrics[name].append(value)
        skipped = batch.extra.get("reward_skipped")
        if skipped is not None and skipped.shape[1] and bool(skipped.all(-1).any()):  # (TRL's own warning)
            row = int(skipped.all(-1).nonzero()[0])
            kwargs = {k: v[row] for k, v in batch.columns.items()}
            kwargs.update(prompt=batch.prompts[row], completion=batch.completions[row])
            _trl_log.warning(f"All reward functions returned None for the following kwargs:\n{kwargs}\n"
                             "Please ensure that at least one reward function returns a valid reward.")
        keep = self.postrl.keep(batch, observe=mode == "train")
        if not keep.all():
            batch.valid = batch.valid & keep
        self._filter_metrics = {"filter/dropped_groups": float(len(torch.unique(batch.group_ids[~keep])))} \
            if self.postrl.selection else {}
        self._scored[mode] = (batch, info, n)
        return batch.raw_rewards.to(self.accelerator.device)

    def _gather_padded(self, t: torch.Tensor, left: bool = False) -> torch.Tensor:
        """Every process's rows of ``t`` [n, W] (padded with 0 to the widest, left or right), in rank order."""
        parts = self.procs.gather(t.detach().cpu())
        W = max(p.shape[1] for p in parts)
        return torch.cat([F.pad(p, (W - p.shape[1], 0) if left else (0, W - p.shape[1])) for p in parts])

    # ------------------------------------------------------------------------------------------------ advantages
    def _generate_and_score_completions(self, inputs):
        """TRL's generation and scoring, then postrl's advantage stage in place of TRL's advantages, and the
        batch's metrics."""
        out = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        batch, info, n = self._scored[mode]
        mask = out["completion_mask"].float()
        if "tool_mask" in out:
            mask = mask * out["tool_mask"].float()
        batch.prompt_ids = self._gather_padded(out["prompt_ids"], left=True)
        batch.prompt_mask = self._gather_padded(out["prompt_mask"], left=True)
        batch.completion_ids = self._gather_padded(out["completion_ids"])
        batch.completion_mask = self._gather_padded(mask)
        T = batch.completion_ids.shape[1]
        sampler = out.get("sampling_per_token_logps", out.get("old_per_token_logps"))
        if sampler is not None:
            batch.sampler_logprobs = self._gather_padded(sampler.float())
        elif "sampler_logprobs" in self.postrl.advantage.reads or "sampler_logp" in self.postrl.objective.reads:
            # the policy that sampled is the current one (an estimator or a regulariser's observe reads it)
            batch.sampler_logprobs = self.ctx.logprobs(batch)[0]
        else:
            batch.sampler_logprobs = torch.full((len(batch), T), float("nan"))
        if mode == "train" and self.postrl_sampling.filters:  # top-p / top-k: the kept mass (sampler/kept_mass_*)
            batch.extra["sampler_kept_logmass"] = self._gather_padded(self._sampler_kept_logmass(out))
        adv = self.postrl.advantages(self.ctx, batch, observe=mode == "train").float()
        adv = torch.where(batch.valid.view(-1, *[1] * (adv.dim() - 1)), adv, torch.zeros_like(adv))
        batch.advantages = adv
        for key, attr in (("ref_per_token_logps", "ref_logprobs"), ("old_per_token_logps", "old_logprobs")):
            if out.get(key) is not None:
                setattr(batch, attr, self._gather_padded(out[key].float()))
        if mode == "train":
            self.postrl.observe_objective(batch)
        rank = self.accelerator.process_index
        rows = torch.arange(rank * n, (rank + 1) * n)
        local = adv[rows]
        out["advantages"] = (local[:, :out["completion_ids"].shape[1]] if local.dim() == 2 else local).to(
            out["completion_ids"].device)
        out["postrl_row"] = rows.to(out["completion_ids"].device)
        # the completions table shows postrl's advantages (one value per completion)
        seq_adv = adv if adv.dim() == 1 else (adv * batch.completion_mask).sum(-1) / \
            batch.completion_mask.sum(-1).clamp(min=1)
        logged = self._logs["advantages"]  # (a bounded deque: TRL's own values for this batch are its last N)
        for _ in range(min(len(seq_adv), len(logged))):
            logged.pop()
        logged.extend(seq_adv.tolist())
        # postrl's metrics of the batch (docs/metrics.md)
        m = self.postrl.metrics(batch, info)
        if sampler is None:
            for k in ("tokens/low_prob_frac", "tokens/logprob_mean"):
                m.pop(k, None)
        if "sampling_per_token_logps" in out and "old_per_token_logps" in out:
            m.update(mismatch_metrics(out["old_per_token_logps"], out["sampling_per_token_logps"], mask))
        m.update(self._filter_metrics)
        if mode == "train":
            self._step_metrics = m
        else:
            for k, v in m.items():
                self._metrics[mode][f"postrl/{k}"].append(float(v))
        return out

    # ------------------------------------------------------------------------------------------------ loss
    def _prepare_inputs(self, generation_batch):
        """TRL's batch, plus ``postrl_weights``: the aggregation's token weights over each optimizer step's batch
        (its gradient-accumulation micro-batches on every process), times the number of processes (DDP averages
        the gradients). When ``steps_per_generation`` is not a multiple of ``gradient_accumulation_steps`` an
        optimizer step can span two generations, whose masks are not known together: the weights are then those of
        the generation's whole batch times steps_per_generation / gradient_accumulation_steps, i.e. each optimizer
        step is normalised by the generation's average per optimizer step (TRL's own normalisation in that case:
        ``dapo`` divides by the generation's tokens times GA / steps_per_generation; ``grpo``, ``dr_grpo``, the
        sequence means, are per micro-batch and so unchanged)."""
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        spg, ga = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        if not self.model.training:
            self._weigh([inputs], 1)
        elif self._buffered_inputs is not before:
            if spg % ga == 0:
                self._weigh(self._buffered_inputs, ga)
            else:
                self._weigh(self._buffered_inputs, spg, scale=spg / ga)
        return inputs

    def _loss_mask(self, piece: dict) -> torch.Tensor:
        m = piece["completion_mask"].float()
        if "tool_mask" in piece:
            m = m * piece["tool_mask"].float()
        valid = self._scored["train" if self.model.training else "eval"][0].valid
        return m * valid[piece["postrl_row"].cpu()].to(m.device).unsqueeze(-1).float()

    def _weigh(self, pieces: list[dict], per_step: int, scale: float = 1.0) -> None:
        world = self.accelerator.num_processes * scale
        for s in range(0, len(pieces), per_step):
            group = pieces[s:s + per_step]
            local = torch.cat([self._loss_mask(p) for p in group])
            everyone = self._gather_padded(local)
            w = self.postrl.objective.weights(everyone)
            rank, n = self.accelerator.process_index, local.shape[0]
            w = w[rank * n:(rank + 1) * n, :local.shape[1]] * world
            for p, wp in zip(group, w.split([p["completion_mask"].shape[0] for p in group])):
                p["postrl_weights"] = wp.to(p["completion_mask"].device)

    def _compute_loss(self, model, inputs):
        """postrl's objective (policy loss x TIS x masks + KL + regularisers, aggregated with ``postrl_weights``) on
        TRL's per-token log-probs and entropies (differentiable, TRL's fused head), then TRL's entropy bonus
        (``entropy_coef`` / ``use_adaptive_entropy``: TRL's formula and controller) and the MoE router's
        auxiliary loss, as TRL adds them; TRL's metrics (``entropy``, ``kl``, ``clip_ratio/*``, ``aux_loss``,
        ``policy_loss``, ``entropy_coef``) and postrl's (``postrl/...``)."""
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        T = completion_ids.size(1)
        logp, entropy, aux_loss = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), T,
            compute_entropy=True, compute_aux_loss=self.aux_loss_enabled,
            pixel_values=inputs.get("pixel_values"), image_grid_thw=inputs.get("image_grid_thw"),
            num_images=inputs.get("num_images"), pixel_attention_mask=inputs.get("pixel_attention_mask"),
            spatial_shapes=inputs.get("spatial_shapes"), num_tiles=inputs.get("num_tiles"),
            image_sizes=inputs.get("image_sizes"), token_type_ids=inputs.get("token_type_ids"),
            mm_token_type_ids=inputs.get("mm_token_type_ids"), image_position_ids=inputs.get("image_position_ids"))
        rows = inputs["postrl_row"].cpu()
        fields = {k: (v[:, :T] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v)  # (per-token: [n, T, ...])
                  for k, v in self.postrl.objective.batch_fields(self._scored[mode][0], rows, logp.device).items()}
        mask = self._loss_mask(inputs)
        fields["mask"] = mask
        fields["lengths"] = mask.sum(-1)
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old
        fields.update(logp=logp, old_logp=old, entropy=entropy, logits=None, advantages=inputs["advantages"],
                      ref_logp=inputs.get("ref_per_token_logps"),
                      sampler_logp=inputs.get("sampling_per_token_logps", old))
        loss, stats, info = self.postrl.objective(fields, inputs["postrl_weights"])
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self._entropy_bonus_enabled:
            loss = self._entropy_bonus(loss, entropy, mask, ga, mode)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / ga
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())
        self._trl_metrics(mode, mask, entropy, info)
        if mode == "train":
            for k, v in stats.items():
                self._loss_sums[k] = max(self._loss_sums.get(k, v), v) if k == "ratio_max" else \
                    self._loss_sums.get(k, 0.0) + v
        else:
            for k, v in stats.items():
                self._metrics["eval"][f"postrl/{k}"].append(float(v))
        return loss

    def _entropy_bonus(self, loss: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, ga: int,
                       mode: str) -> torch.Tensor:
        """TRL's entropy bonus: loss - c * (sum_t m_t H_t / sum_t m_t) / GA on the micro-batch (with
        top_entropy_quantile, on the same high-entropy tokens), c = ``entropy_coef``; with ``use_adaptive_entropy``
        c applies only while the last optimizer step's entropy is <= ``entropy_target``, and c moves by
        ``entropy_coef_delta`` within [``entropy_coef_min``, ``entropy_coef_max``] once per optimizer step (the
        controller is TRL's attributes, saved in TRL's checkpoints)."""
        eff = mask
        if self.top_entropy_quantile < 1.0:
            eff = mask * self.get_high_entropy_mask(entropy, mask, 1 - self.top_entropy_quantile).float()
        self._metrics[mode]["policy_loss"].append(float(loss.detach()) * ga)
        h = (entropy * eff).sum() / eff.sum().clamp(min=1.0) / ga
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        else:
            coef = self.entropy_coef
        loss = loss - coef * h
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([(entropy * eff).sum(), eff.sum()]).detach()
            self._entropy_window_stats = stats if self._entropy_window_stats is None \
                else self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = float(total[0] / total[1].clamp(min=1.0))
                a = self.args
                self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max) \
                    if world <= a.entropy_target else max(self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min)
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

    def _trl_metrics(self, mode: str, mask: torch.Tensor, entropy: torch.Tensor, info: dict) -> None:
        """TRL's per-micro-batch metrics under TRL's names, masked means over every process's loss tokens."""
        def mean(x: torch.Tensor) -> float:
            tot = self.accelerator.reduce(torch.stack([(x.detach() * mask).sum(), mask.sum()]), reduction="sum")
            return float(tot[0] / tot[1].clamp(min=1.0))

        m = self._metrics[mode]
        m["entropy"].append(mean(entropy))
        if "kl_token" in info:
            m["kl"].append(mean(info["kl_token"]))
        if "phi" in info:  # vespo: the sequences' weight
            phi = info["phi"][:, 0].detach()
            tot = self.accelerator.reduce(torch.stack([phi.sum(), phi.new_tensor(float(phi.numel()))]),
                                          reduction="sum")
            m["vespo/phi_seq_mean"].append(float(tot[0] / tot[1].clamp(min=1.0)))
        low, high = info.get("clip_low"), info.get("clip_high")
        if low is not None and high is not None:
            low, high = low.float().expand_as(mask), high.float().expand_as(mask)
            m["clip_ratio/low_mean"].append(mean(low))
            m["clip_ratio/high_mean"].append(mean(high))
            m["clip_ratio/region_mean"].append(mean(torch.maximum(low, high)))
            seq = mask.sum(-1).clamp(min=1.0)
            lo = self.accelerator.gather((low * mask).sum(-1) / seq)
            hi = self.accelerator.gather((high * mask).sum(-1) / seq)
            m["clip_ratio/low_min"].append(float(lo.min()) if lo.numel() else math.nan)
            m["clip_ratio/high_max"].append(float(hi.max()) if hi.numel() else math.nan)

    # ------------------------------------------------------------------------------------------------ end of step
    def training_step(self, model, inputs, num_items_in_batch):
        out = super().training_step(model, inputs, num_items_in_batch)
        if self._step % self._generate_every == 0:
            self._end_postrl_step()
        return out

    def _end_postrl_step(self) -> None:
        """Once per generation, after its last micro-batch: the objective's statistics (averaged over the
        generation's optimizer steps), the batch metrics, reduced over processes; every stateful stage's and the
        KL controller's end of step; the monitors' alarms; all logged through TRL (``postrl/<key>``)."""
        opt_steps = self._generate_every / self.args.gradient_accumulation_steps
        m = dict(self._step_metrics)
        m.update({k: (v if k == "ratio_max" else v / opt_steps) for k, v in self._loss_sums.items()})
        m = self.procs.reduce_metrics(m)
        batch, info, _ = self._scored["train"]
        # every process scored and observed the whole gathered batch: its records are already every process's, so the
        # end of the step does not gather them again (which would count each record once per process)
        m.update(self.postrl.end(m, len(batch), all_reduce_mean=self.procs.all_reduce_mean, gather=lambda obj: [obj]))
        self.postrl_steps += 1
        m["step"] = self.postrl_steps
        for name, rate in info.get("failure_rate", {}).items():
            if rate > 0:
                m[f"reward/{name}/first_failure"] = info["first_failure"][name]
        alarms = self.postrl.watchdog.step(m)
        for a in alarms:
            self.alarms.append(a.to_dict())
            self._metrics["train"][f"postrl/alarm/{a.name}"].append(1.0)
            if self.accelerator.is_main_process:
                _log.warning("postrl alarm at step %d: %s", self.postrl_steps, a.text())
        for k, v in m.items():
            if isinstance(v, (int, float)) and k != "step":
                self._metrics["train"][f"postrl/{k}"].append(float(v))
        self._loss_sums = {}

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            import json
            import os

            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            state = {"step": self.postrl_steps, "stages": self.postrl.state_dict()}
            with open(os.path.join(folder, "postrl_state.json"), "w") as f:
                json.dump(state, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            import json
            import os

            path = os.path.join(checkpoint, "postrl_state.json")
            if os.path.exists(path):
                with open(path) as f:
                    state = json.load(f)
                self.postrl_steps = int(state["step"])
                self.postrl.load_state_dict(state["stages"])


def _model_id(model: Any) -> str:
    """TRL's name for a model object (``get_config_model_id``: its config's ``_name_or_path``)."""
    try:
        from trl.trainer.utils import get_config_model_id
    except ImportError:  # pragma: no cover - older TRL
        return getattr(model.config, "_name_or_path", "model") or "model"
    return get_config_model_id(model.config)
