"""postrl's stages inside TRL: :class:`GRPOTrainer`, a subclass of TRL's ``GRPOTrainer`` (extra ``postrl[trl]``).

TRL keeps what it does well: generation (transformers or vLLM colocate / server), Accelerate with DeepSpeed / FSDP,
PEFT, gradient checkpointing, checkpoints, ``report_to``. postrl brings the one step every driver runs
(:class:`postrl.step.Step`), built by name from a postrl config section (a :class:`postrl.config.Config` or a dict
of its keys, merged on the defaults and checked like a YAML file):

* ``rewards`` / ``reward``: the reward sources, scored with postrl's fault isolation (``postrl.step.scoring.Scorer``:
  a source that raises or returns None / NaN fails only its entries, which are excluded from the advantage and
  counted), then the ``shaping`` stages;
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
  ``postrl/<key>`` (``postrl/reward/<source>/mean`` per reward component, ``postrl/alarm/<name>`` = 1 at a step where
  the alarm is active, with the alarm's text as a warning of the ``postrl.trl`` logger).

How it hooks into TRL (which has no advantage or loss hook): ``_calculate_rewards`` scores and shapes (and returns
the raw reward matrix, so TRL's own ``rewards/<name>/mean`` stay right), ``_generate_and_score_completions``
replaces TRL's advantages by the postrl stage's, ``_prepare_inputs`` adds the aggregation weights, ``_compute_loss``
evaluates the objective on TRL's log-probs, ``training_step`` ends the postrl step (stateful stages, KL controller,
metrics, alarms) after the last micro-batch of a generation.

TRL options the postrl section replaces are refused when set (``loss_type``, ``epsilon``, ``scale_rewards``, ...:
the error names the postrl key to use); ``beta`` follows ``kl.coef`` (TRL then keeps the reference model, or the
PEFT adapter disabled, as usual). A stage that needs what TRL's batch does not carry (logits, a differentiated
entropy, a greedy generation, a teacher's log-probs, a prompt selector or a sampling plan) is refused at
construction.

Several processes: every process gathers the completions of all of them (TRL spreads a group over processes),
scores and shapes that batch, runs the filters and the advantage on it and keeps its own rows, so every process
holds the same statistics and state; the reward sources therefore run on every process (cheap for verifiers; a
costly judge is called once per process). Only the one-process path is tested here (CPU).

Prompts and completions reach postrl's reward sources as text: a conversational prompt as its last message's
content, a conversational completion as its messages' contents joined.

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

from postrl.integrations.alarms import AlarmCallback  # noqa: E402,F401 - postrl's alarms on TRL's own trainer

# GRPOConfig fields whose job the postrl section does, with the postrl key that does it: set to anything but TRL's
# default they would be silently ignored, so they are refused.
_REPLACED = {
    "loss_type": "loss.agg (grpo: seq_mean_token_mean, dapo: token_mean, dr_grpo: dr_grpo) and loss.name",
    "epsilon": "loss.eps_low", "epsilon_high": "loss.eps_high", "delta": "loss (ppo_clip dual_clip)",
    "importance_sampling_level": "loss.name=gspo", "top_entropy_quantile": "regularizers (top_entropy_tokens)",
    "off_policy_mask_threshold": "loss / regularizers", "scale_rewards": "advantage (grpo scale)",
    "multi_objective_aggregation": "advantage.name=gdpo", "entropy_coef": "regularizers (entropy_bonus)",
    "use_adaptive_entropy": "regularizers (adaptive_entropy)", "reward_weights": "rewards.N.weight",
}
# fields a stage may read that TRL's batch cannot give
_UNAVAILABLE = {"logits": "the logits (TRL's forward returns log-probs and entropies only)",
                "greedy_reward": "a greedy generation (TRL owns generation)",
                "teacher_logp": "a teacher model's log-probs (TRL's GRPOTrainer runs no teacher; TRL's "
                                "DistillationTrainer distils with its full-vocabulary generalized JSD)"}


def _text(x: Any) -> str:
    """A prompt or completion as text: a conversation's last message (prompt) / its messages joined (completion)."""
    if isinstance(x, str):
        return x
    return "".join(m.get("content", "") if isinstance(m.get("content"), str) else str(m.get("content")) for m in x)


def _section(postrl: Config | Mapping[str, Any] | None) -> Config:
    if isinstance(postrl, Config):
        return postrl.model_copy(deep=True)
    return load_config(base=dict(postrl or {}))


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
    ``aux_loss``), each [B, T]. ``kept``: a list that receives each call's kept log-mass [B, T] (0 where masked)."""

    def __init__(self, model: Any, T: int, temperature: float, top_p: float, top_k: int,
                 kept: list | None = None):
        self.model, self.T, self.temperature, self.top_p, self.top_k, self.kept = \
            model, T, temperature or 1.0, top_p, top_k, kept

    def __call__(self, *, labels: torch.Tensor, fused_lm_head: bool = True, **inputs: Any) -> SimpleNamespace:
        T = self.T
        out = self.model(**inputs, logits_to_keep=T + 1, use_cache=False)
        scaled = out.logits[:, -(T + 1):-1].float() / self.temperature
        target = labels[:, -T:]
        valid = target != -100
        logp, kept = filtered_token_logprobs(scaled, target.clamp(min=0), self.top_p, self.top_k)
        with torch.no_grad():
            entropy = logits_entropy(scaled)
        if self.kept is not None:
            self.kept.append(kept.masked_fill(~valid, 0.0))
        return SimpleNamespace(log_probs=logp.masked_fill(~valid, 0.0), entropy=entropy.masked_fill(~valid, 0.0),
                               aux_loss=getattr(out, "aux_loss", None))


def _trl_default(name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer with postrl's rewards, shaping, filters, advantage, objective and diagnostics.

    ``postrl``: the postrl section (a :class:`~postrl.config.Config` or a dict of its keys; sections TRL owns,
    such as ``model``, ``rollout``, ``optim`` and ``train``, are not read: ``rollout.group_size``,
    ``rollout.max_new_tokens`` and ``rollout.temperature`` are taken from ``args``). Every other argument is TRL's,
    except ``reward_funcs``: the reward sources are the section's ``rewards`` (a registered name, or
    ``module:function`` for your own, TRL-style or verl-style).
    """

    def __init__(self, model: Any, postrl: Config | Mapping[str, Any] | None = None, args: Any = None,
                 reward_funcs: Any = None, **kwargs: Any):
        if reward_funcs is not None:
            raise ConfigError("postrl.integrations.trl.GRPOTrainer: name the reward sources in the postrl section's "
                              "rewards (a registered name or module:function), not in reward_funcs")
        args = args if args is not None else trl.GRPOConfig(output_dir="trl-postrl")
        cfg = _section(postrl)
        for name, key in _REPLACED.items():
            if getattr(args, name) != _trl_default(name):
                raise ConfigError(f"GRPOConfig.{name}={getattr(args, name)!r}: under postrl's TRL adapter the postrl "
                                  f"section decides this; set {key} there and leave GRPOConfig.{name} at its default")
        if args.beta != 0.0:
            raise ConfigError(f"GRPOConfig.beta={args.beta}: set the KL term in the postrl section (kl.coef, "
                              f"kl.estimator); the adapter sets beta from it")
        if args.use_vllm and args.vllm_importance_sampling_correction and cfg.loss.tis.level == "none":
            raise ConfigError("GRPOConfig.vllm_importance_sampling_correction: with vLLM, correct the sampler/trainer "
                              "mismatch with postrl's loss.tis (e.g. {level: token, mode: truncate, cap: 2}) or set "
                              "vllm_importance_sampling_correction=False")
        if args.steps_per_generation % args.gradient_accumulation_steps:
            raise ConfigError(f"GRPOConfig.steps_per_generation={args.steps_per_generation} must be a multiple of "
                              f"gradient_accumulation_steps={args.gradient_accumulation_steps} (an optimizer step "
                              f"within one generation: the aggregation weighs the optimizer step's whole batch)")
        if cfg.kl.coef > 0 and cfg.kl.placement != "loss":
            raise ConfigError("kl.placement=reward is not available in the TRL adapter; use kl.placement=loss")
        # what TRL's args decide for the postrl stages (a new config: the caller's stays as it was)
        self.postrl_sampling = trl_sampling(args, cfg.rollout.logprobs)
        self._logprob_filter = self.postrl_sampling.logprob_filter()  # {} unless the log-probs are corrected
        cfg = cfg.model_copy(update={
            "rollout": cfg.rollout.model_copy(update={"group_size": args.num_generations,
                                                      "max_new_tokens": args.max_completion_length,
                                                      "temperature": float(args.temperature),
                                                      "top_p": self.postrl_sampling.top_p,
                                                      "top_k": self.postrl_sampling.top_k}),
            "train": cfg.train.model_copy(update={"steps": args.max_steps if args.max_steps > 0 else cfg.train.steps})})
        self.postrl_config = cfg
        self.postrl = Step(cfg)  # the reward context and tokenizer reach it once TRL has loaded the model
        for msg in self.postrl.warnings:
            warnings.warn(msg, stacklevel=2)
        objective = self.postrl.objective
        if "ref_logp" in objective.reads and cfg.kl.coef == 0:
            raise ConfigError("a loss or regularizer reads ref_logp: set kl.coef > 0 so that TRL keeps a reference")
        if objective.entropy_grad:
            raise ConfigError("a loss or regularizer differentiates the entropy; the TRL adapter reads TRL's entropy, "
                              "which carries no gradient")
        for i, (spec, s) in enumerate(zip(cfg.filters, self.postrl.selection)):
            if s.kind != "filter":
                raise ConfigError(f"filters.{i}: '{s.name}' is a {s.kind} stage; the TRL adapter runs keep-mask "
                                  f"filters (kind filter) only: TRL owns prompt sampling and generation")
            if spec.max_attempts is not None and spec.max_attempts > 1:
                warnings.warn(f"filters.{i}: max_attempts is not available under TRL (no refill): dropped groups are "
                              f"masked out of the update", stacklevel=2)
        for s in self.postrl.needing("reference_reset"):
            raise ConfigError(f"{s.kind} '{s.name}': resetting the reference model is not available in the TRL "
                              "adapter (TRL owns the reference; its own GRPOConfig.sync_ref_model does that)")
        for s in [self.postrl.advantage, *objective.regularizers, objective.loss]:
            for field in set(s.reads) & set(_UNAVAILABLE):
                raise ConfigError(f"{s.kind} '{s.name}' reads {field}: the TRL adapter cannot give "
                                  f"{_UNAVAILABLE[field]}")
        self.alarms: list[dict] = []  # every alarm raised, as dicts (name, message, cause, fix, severity, step)
        self.postrl_steps = 0  # postrl steps ended (one per generation)
        # per mode (train / eval): the scored batch of the current generation, its reward outcome, local rows
        self._scored: dict[str, tuple[RolloutBatch, dict, int]] = {}
        self._step_metrics: dict[str, float] = {}
        self._loss_sums: dict[str, float] = {}
        args = copy.copy(args)  # (dataclasses.replace would run GRPOConfig's checks again on resolved values)
        args.beta = cfg.kl.coef
        self._filter_metrics: dict[str, float] = {}
        scorer = self.postrl.scorer
        # TRL's reward functions are postrl's sources (TRL never calls them here; they give TRL its names and count)
        super().__init__(model=model, reward_funcs=[s.fn for s in scorer.rewards], args=args, **kwargs)
        self.reward_func_names = [s.label for s in scorer.rewards]
        self.reward_weights = scorer.weights.clone()
        self.procs = Processes(self.accelerator)
        tok = self._tokenizer
        scorer.context = RewardContext(model=self.accelerator.unwrap_model(self.model), tokenizer=tok,
                                       device=self.accelerator.device)
        scorer.tokenizer = tok
        self.ctx = ModelContext(self.accelerator.unwrap_model(self.model), tok, self.accelerator.device,
                                temperature=float(args.temperature), micro_batch_size=args.per_device_train_batch_size,
                                sampling=self.postrl_sampling, pad_id=tok.pad_token_id, logprob_fn=self._logprob_fn,
                                score=lambda b: self.postrl.score(b, observe=False))

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
            model = _FilteredHead(model, logits_to_keep, self.postrl_sampling.temperature, **self._logprob_filter)
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
        process; returns the raw reward matrix [N, K] of all processes (what TRL's own method returns)."""
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
        local = RolloutBatch(
            prompt_ids=torch.zeros(n, 0, dtype=torch.long), prompt_mask=torch.zeros(n, 0, dtype=torch.long),
            completion_ids=ids, completion_mask=mask, group_ids=torch.zeros(n, dtype=torch.long),
            sampler_logprobs=torch.full((n, T), float("nan")),
            truncated=torch.tensor([len(c) > 0 and c[-1] not in ends for c in completion_ids_list], dtype=torch.bool),
            prompts=[_text(p) for p in prompts], completions=[_text(c) for c in completions],
            columns={k: [x.get(k) for x in inputs] for k in keys})
        batch = RolloutBatch.concat(self.procs.gather(local), pad)
        G = self.num_generations if mode == "train" else self.num_generations_eval
        batch.group_ids = torch.arange(len(batch)) // G + self.postrl_steps * len(batch)
        batch.extra.update(step=self.state.global_step, max_steps=self.state.max_steps)
        info = self.postrl.score(batch, observe=mode == "train")
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
        the gradients)."""
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training:
            self._weigh([inputs], 1)
        elif self._buffered_inputs is not before:
            self._weigh(self._buffered_inputs, self.args.gradient_accumulation_steps)
        return inputs

    def _loss_mask(self, piece: dict) -> torch.Tensor:
        m = piece["completion_mask"].float()
        if "tool_mask" in piece:
            m = m * piece["tool_mask"].float()
        valid = self._scored["train" if self.model.training else "eval"][0].valid
        return m * valid[piece["postrl_row"].cpu()].to(m.device).unsqueeze(-1).float()

    def _weigh(self, pieces: list[dict], per_step: int) -> None:
        world = self.accelerator.num_processes
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
        TRL's per-token log-probs and entropies."""
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
                  for k, v in self.postrl.objective.batch_fields(
                      self._scored["train" if self.model.training else "eval"][0], rows, logp.device).items()}
        fields["mask"] = self._loss_mask(inputs)
        fields["lengths"] = fields["mask"].sum(-1)
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old
        fields.update(logp=logp, old_logp=old, entropy=entropy, logits=None, advantages=inputs["advantages"],
                      ref_logp=inputs.get("ref_per_token_logps"),
                      sampler_logp=inputs.get("sampling_per_token_logps", old))
        loss, stats, _ = self.postrl.objective(fields, inputs["postrl_weights"])
        if self.aux_loss_enabled:
            ga = self.current_gradient_accumulation_steps if self.model.training else 1
            loss = loss + self.router_aux_loss_coef * aux_loss / ga
        if self.model.training:
            for k, v in stats.items():
                self._loss_sums[k] = max(self._loss_sums.get(k, v), v) if k == "ratio_max" else \
                    self._loss_sums.get(k, 0.0) + v
        else:
            for k, v in stats.items():
                self._metrics["eval"][f"postrl/{k}"].append(float(v))
        return loss

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
        opt_steps = self._generate_every // self.args.gradient_accumulation_steps
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
