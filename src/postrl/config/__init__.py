"""Typed configuration: pydantic models, YAML files, dot-list overrides.

``load_config("run.yaml", ["optim.lr=1e-5", "rewards.0.weight=2"])`` reads the YAML file (or the embedded
default when no file is given), applies each override (the value is parsed as YAML, so ``1e-5``, ``true``,
``[a, b]`` work), validates everything, and checks every stage name and its parameters against the registry.
Any mistake is a one-line :class:`~postrl.errors.ConfigError` naming the key.

A stage is written ``{name: <registered name or module:attr>, <param>: <value>, ...}``; its parameters are the
stage function's keyword-only arguments.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from postrl import registry
from postrl.config.diagnostics import DiagnosticsConfig, LoggingConfig
from postrl.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-5`` (no dot) as a float, as YAML 1.2 and every user expects."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


# Limits on what one step may ask for (generous for real use; far beyond them a run exhausts memory or never ends).
MAX_GROUP_SIZE = 1024  # rollout.group_size
MAX_ROWS_PER_STEP = 65536  # train.prompts_per_step x rollout.group_size; train.eval_size x train.eval_k; sft.batch_size
MAX_NEW_TOKENS = 131072  # rollout.max_new_tokens
MAX_TOKENS_PER_STEP = 2**28  # rows per step x rollout.max_new_tokens (268,435,456: 2 GiB of int64 token ids)
MAX_LR = 1.0  # optim.lr, sft.lr: an AdamW step moves each weight by about lr; 1.0 per step is already no training
MAX_REWARD_WEIGHT = 1e6  # |rewards.N.weight|, |reward.weights[N]|: the weighted sum is float32 (max 3.4e38); a weight
# beyond a million is a unit mistake (scale the reward itself), and far beyond it the sum is inf / NaN for the row
MAX_SEED = 2**63 - 1  # seed: torch's generators take a 64-bit seed

# Strict types: a count is an int (not a bool, float or string), a switch is a bool (YAML's true/false/yes/no/on/off,
# not 1 or "true"), a float may be given as an int. Command-line overrides are parsed as YAML first, so
# `train.steps=3` is the int 3 and `reward.strict=yes` the bool True. load_config validates every section strictly,
# the ones defined elsewhere (diagnostics, logging) too. No NaN or inf anywhere (Config._check, _non_finite).


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class StageSpec(BaseModel):
    """A named stage plus its parameters (any other key)."""

    model_config = ConfigDict(extra="allow", strict=True)
    name: str

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RewardSpec(StageSpec):
    weight: float = Field(1.0, description="weight of the source in weighted_sum, in [-1e6, 1e6]")


class FilterSpec(StageSpec):
    """A batch-selection stage of the ``filters`` list; ``max_attempts`` belongs to the keep-mask filters."""

    max_attempts: int | None = Field(None, ge=1, description="a keep-mask filter (kind filter): generation rounds "
                                     "per step, refilling the groups it drops (default 10: DAPO, verl "
                                     "algorithm.filter_groups.max_num_gen_batches; 1: no refill, the shortfall is "
                                     "masked)")

    def attempts(self) -> int:
        return 10 if self.max_attempts is None else self.max_attempts


class LoraConfig(_Strict):
    """LoRA / QLoRA adapters through ``peft`` (postrl.models.lora): the base weights stay frozen, the optimizer
    steps the adapters only, and the reference model is the policy with its adapter disabled."""

    r: int | None = Field(None, ge=1, description="LoRA rank (None: no LoRA, every weight trains)")
    alpha: int = Field(16, ge=1, description="LoRA alpha: the update is (alpha / r) B A (peft lora_alpha)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input (peft lora_dropout)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names that get adapters, or all-linear (every linear layer but the "
        "output head; peft target_modules)")
    save: Literal["merged", "adapter", "both"] = Field(
        "both", description="RUN/final: merged (adapter folded into the weights, a plain from_pretrained folder), "
        "adapter (PeftModel.from_pretrained folder), both (merged in final/, adapter in final/adapter/)")
    quantize: Literal["none", "4bit"] = Field(
        "none", description="4bit: QLoRA, base weights in 4-bit NF4 (bitsandbytes; CUDA only); needs save=adapter")

    @model_validator(mode="after")
    def _check(self) -> "LoraConfig":
        if self.quantize == "4bit" and self.r is None:
            raise ValueError("model.lora.quantize=4bit is QLoRA: give the adapters' rank too (model.lora.r)")
        if self.quantize == "4bit" and self.save != "adapter":
            raise ValueError(f"model.lora.save={self.save}: a 4-bit base cannot be saved merged at full precision; "
                             f"use model.lora.save=adapter with model.lora.quantize=4bit")
        return self


class TeacherConfig(_Strict):
    """A frozen teacher model (on-policy distillation), loaded when ``path`` is set and a configured stage needs it
    (registered with ``needs=("teacher",)``); it must use the policy's vocabulary (its per-token log-probs are
    compared with the policy's on the same token ids)."""

    path: str | None = Field(None, description="a from_pretrained folder with the policy's vocabulary (None: no "
                             "teacher); its per-token log-probs of the batch's completions are the field teacher_logp "
                             "(regularizer distill) and it writes the hints of the expansion teacher_hint")


class ModelConfig(_Strict):
    path: str = Field("builtin", description="local folder for from_pretrained, or 'builtin' (tiny model + SFT)")
    builtin_size: str = Field("tiny", description="size of the built-in model (nano/tiny/small/medium)")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="precision of the training forward: bfloat16 keeps float32 master weights (the "
        "optimizer's) and runs the update's forward under bf16 autocast; float16 is refused (no loss scaling)")
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="auto: use the tokenizer's chat template when it has one; none: plain prompt"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA / QLoRA adapters (model.lora.r enables)")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="a frozen teacher model "
                                   "(model.teacher.path enables; docs/losses.md, on-policy distillation)")


class TaskConfig(StageSpec):
    name: str = Field("arithmetic", description="prompt source: a task (arithmetic, countdown, reasoning_gym), file, dataset")


class RolloutConfig(_Strict):
    backend: Literal["hf"] = Field("hf", description="generation backend: hf, the KV-cache sampler over the "
                                   "policy's own forward (CPU/GPU); vLLM generation at scale runs through the TRL "
                                   "adapter or the verl plug-in (README, Scaling up)")
    group_size: int = Field(8, ge=1, le=MAX_GROUP_SIZE, description="G completions per prompt")
    max_new_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS,
                                description="completion length limit; longer ones are truncated")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature (0: greedy); log-probs use it too")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling (1.0: off)")
    top_k: int = Field(0, ge=0, description="top-k sampling (0: off)")
    logprobs: Literal["full", "filtered"] = Field(
        "full", description="log-probs of sampler and trainer with top_p / top_k: full (unfiltered softmax, TRL / "
        "verl; the ratio is off by the log of the kept mass) or filtered (the renormalised distribution sampled)")
    stop: list[str] = Field(default_factory=list, description="stop strings (cut from the text; EOS always stops); "
                            "each non-empty")
    batch_size: int | None = Field(None, ge=1, description="rows per generation batch (None: all at once)")
    ignore_eos: bool = Field(False, description="EOS does not end a completion: every completion runs to "
                             "max_new_tokens unless a stop string ends it (equal work per row, for benchmarks)")
    max_prompt_length: int | None = Field(None, ge=1, description="prompt tokens limit (None: no limit); a longer "
                                          "prompt is handled by prompt_overflow, in training and evaluation")
    prompt_overflow: Literal["truncate", "drop"] = Field(
        "truncate", description="a prompt over max_prompt_length: truncate (keep its last max_prompt_length tokens, "
        "TRL's left truncation) or drop (training: its group is masked out of the update; evaluation: the row is "
        "left out); counted as prompts/truncated or prompts/dropped")

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError(f"rollout.stop: an empty stop string ends every completion before its first token "
                             f"(got {v!r}); give non-empty strings or []")
        return v

    @field_validator("backend", mode="before")
    @classmethod
    def _no_vllm(cls, v: Any) -> Any:
        if v == "vllm":
            raise ValueError("rollout.backend: 'vllm' is not part of postrl's own trainer; vLLM generation at scale "
                             "runs through the TRL adapter (postrl.integrations.trl) or the verl plug-in "
                             "(postrl.integrations.verl), see README 'Scaling up'")
        return v


class EnvironmentConfig(StageSpec):
    """A multi-turn environment (kind ``environment``); any other key is the environment's parameter."""

    max_turns: int = Field(4, ge=1, le=64, description="model turns per episode")
    max_total_tokens: int = Field(256, ge=1, le=MAX_NEW_TOKENS, description="completion tokens per episode, "
                                  "model and environment tokens together (each turn's max_new_tokens is "
                                  "min(rollout.max_new_tokens, what is left))")
    step_timeout: float | None = Field(None, gt=0.0, description="seconds an environment's step may take (None: "
                                       "no limit); a step past it ends its episode as an environment error (each "
                                       "step then runs in its own thread)")
    purify: Literal["none", "cleaner"] = Field("none", description="cleaner: train on episodes whose failed tool "
                                               "calls were later corrected with the failure replaced by the "
                                               "correction, re-scored by the policy (CLEANER; docs/agents.md)")
    purify_similarity: float = Field(0.8, ge=0.0, le=1.0, description="purify=cleaner: the similarity of a failed "
                                     "turn's reasoning to its correction's at or above which only the call is "
                                     "replaced (shallow repair); below it the whole turn is (deep substitution)")


class RewardConfig(_Strict):
    """How the reward sources are evaluated (postrl.rewards.core) and how failures are handled."""

    strict: bool = Field(False, description="fail fast: the first failing reward entry (raise, timeout, None/NaN/"
                         "inf, wrong count) stops the run with a one-line RewardError naming the reward and input")
    timeout: float | None = Field(60.0, gt=0.0, description="wall-clock seconds per reward call (None: no limit); "
                                  "a call past it fails its entries")
    workers: int = Field(4, ge=1, description="threads evaluating reward sources / chunks in parallel")
    chunk_size: int | None = Field(None, ge=1, description="rows per reward call (None: the whole batch); chunks "
                                   "end at group boundaries")
    alarm_rate: float = Field(0.1, ge=0.0, le=1.0, description="a source failing on more than this fraction of a "
                              "batch logs a warning (metric reward/<name>/failure_rate)")
    on_all_failed: Literal["stop", "continue"] = Field(
        "stop", description="a source that raises on every completion of the run's first scored batch is a bug in "
        "the reward, not a data fault: stop (one line naming the reward and the exception) or continue (a notice; "
        "its entries are excluded while it fails)")
    weights: list[float] | None = Field(None, description="weight per reward source, in order (TRL reward_weights); "
                                        "overrides rewards.N.weight; one per source; each in [-1e6, 1e6]")
    step_delimiter: str = Field("\n\n", min_length=1, description="text that ends a reasoning step (process "
                                "rewards, step_ends)")


class AdvantageConfig(StageSpec):
    name: str = Field("grpo", description="advantage estimator (postrl methods --kind advantage)")


class TISConfig(_Strict):
    level: Literal["none", "token", "sequence"] = Field(
        "none", description="truncated importance sampling for the sampler/trainer mismatch (none: off)")
    mode: Literal["truncate", "mask"] = Field("truncate",
                                              description="weights above cap: truncate to cap, or mask to 0")
    cap: float = Field(2.0, gt=0.0, description="cap C on the importance weight (verl rollout_is_threshold)")


class LossConfig(StageSpec):
    name: str = Field("ppo_clip", description="policy loss (postrl methods --kind loss)")
    agg: str = Field("token_mean", description="aggregation: token_mean, seq_mean_token_mean, sequence, "
                     "seq_mean_token_sum, dr_grpo")
    agg_rows: Literal["all", "nonempty"] = Field(
        "all", description="rows a sequence average divides by: all (every row of the mini-batch, a failed reward "
        "or empty completion counting as a 0 row: verl, TRL) or nonempty (rows with a loss token)")
    tis: TISConfig = Field(default_factory=TISConfig, description="truncated importance sampling (docs/losses.md)")


class RegularizerSpec(StageSpec):
    coef: float = Field(1.0, description="weight of the regulariser's aggregated term in the loss")


class KLConfig(_Strict):
    coef: float = Field(0.0, ge=0.0, description="0 disables the reference model and the KL term (initial value "
                        "when adaptive)")
    estimator: str = Field("k3", description="KL estimator: k1, k2, k3 (TRL), low_var_kl (verl's k3, clamped to "
                           "10), abs, or straight-through k1+, k3+, low_var_kl+, abs+ (regularizer kl_<name>)")
    placement: Literal["loss", "reward"] = Field(
        "loss", description="loss: coef * agg(KL) in the loss; reward: r - coef * sum_t KL_t before advantages")
    controller: Literal["fixed", "adaptive", "pid"] = Field(
        "fixed", description="adaptive: coef moves toward target KL (Ziegler et al.; verl kl_ctrl.type); pid: coef "
        "from the tracked KL above a threshold that a PID on the reward velocity moves, gated by the entropy (after "
        "SAFE; postrl.losses.kl.KLController)")
    target: float = Field(0.1, gt=0.0, description="target KL of the adaptive controller; base KL threshold of the "
                          "pid controller")
    horizon: int = Field(10000, ge=1, description="horizon of the adaptive controller (in sequences)")
    is_correction: Literal["none", "token", "sequence"] = Field(
        "none", description="kl.placement=loss: multiply each token's KL estimate by the importance ratio "
        "pi_theta/pi_old, differentiable (token: per token; sequence: exp of the sequence's mean log-ratio), so the "
        "KL of the sampling policy's tokens estimates the current policy's (DeepSeek-V3.2; TRL "
        "use_bias_correction_kl, TRL's default); none: the plain estimate")
    pid_gains: tuple[float, float, float] = Field(
        (0.3, 0.01, 0.05), description="pid controller: (kp, ki, kd) on the reward-velocity error (SAFE's)")
    reward_velocity: float = Field(0.001, description="pid controller: target velocity of the reward's moving "
                                   "average per step (SAFE's)")
    entropy_floor: float = Field(2.0, gt=0.0, description="pid controller: entropy (nats) under which the "
                                 "coefficient is amplified, gate max(0.5, floor / (H + 0.1)) (SAFE's)")

    @field_validator("pid_gains", mode="before")
    @classmethod
    def _gains_from_list(cls, v: Any) -> Any:
        """YAML has no tuples: a three-item list is the triple."""
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _check_controller(self) -> "KLConfig":
        if self.controller != "fixed" and self.coef <= 0:
            raise ValueError(f"kl.controller={self.controller} needs kl.coef > 0 (the initial coefficient; pid: its "
                             "gain)")
        if self.is_correction != "none" and self.placement == "reward":
            raise ValueError("kl.is_correction weighs the KL term of the loss; with kl.placement=reward set it to none")
        return self


class OptimConfig(_Strict):
    lr: float = Field(3e-4, gt=0.0, description="peak learning rate, at most 1")
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas (beta1, beta2), each in [0, 1)")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    warmup_ratio: float | None = Field(None, ge=0.0, le=1.0, description="linear warmup over this fraction of the "
                                       "run's optimizer steps (train.steps x epochs x mini_batches), rounded up "
                                       "(TRL/transformers warmup_ratio); exclusive with warmup_steps")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="lr after warmup")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="clip the global grad norm (None: no clipping)")

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_list(cls, v: Any) -> Any:
        """YAML has no tuples: a two-item list is the pair."""
        return tuple(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _check(self) -> "OptimConfig":
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas: each beta must be in [0, 1), got {list(self.betas)}")
        if self.warmup_ratio is not None and self.warmup_steps > 0:
            raise ValueError(f"optim.warmup_ratio: set either optim.warmup_steps ({self.warmup_steps}) or "
                             f"optim.warmup_ratio ({self.warmup_ratio}), not both")
        return self

    def warmup_for(self, total: int) -> int:
        """Warmup optimizer steps of a run of ``total`` optimizer steps: ``warmup_steps``, or
        ``ceil(warmup_ratio * total)`` when the ratio is set (transformers ``TrainingArguments.get_warmup_steps``)."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        return math.ceil(self.warmup_ratio * total)


class TrainConfig(_Strict):
    steps: int = Field(60, ge=1, description="RL steps (one rollout batch each)")
    prompts_per_step: int = Field(32, ge=1, le=MAX_ROWS_PER_STEP, description="prompts per step over all processes; "
                                  "rows per step = prompts_per_step x rollout.group_size")
    epochs: int = Field(1, ge=1, description="optimisation passes over each rollout batch")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch (batch split in this many)")
    micro_batch_size: int = Field(64, ge=1, description="rows per forward/backward (gradient accumulation)")
    save_every: int = Field(20, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_last: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")
    samples_every: int = Field(10, ge=1, description="log sample completions every N steps")
    eval_every: int = Field(0, ge=0, description="held-out eval every N steps (0: only before and after)")
    eval_size: int = Field(200, ge=1, le=MAX_ROWS_PER_STEP, description="held-out prompts per evaluation")
    eval_k: int = Field(4, ge=1, description="samples per prompt for pass@k in evaluations")
    gradient_checkpointing: bool = Field(False, description="recompute the policy's activations in the backward "
                                         "instead of keeping them (less memory, one more forward of each layer; "
                                         "transformers gradient_checkpointing_enable, non-reentrant)")


class AccelConfig(_Strict):
    """The CPU speed layer (postrl.accel): the same functions as the plain Hugging Face path, computed faster."""

    mode: Literal["auto", "off"] = Field(
        "auto", description="auto: the speed layer where it applies (CPU, float32, Llama-family models); off: the "
        "plain Hugging Face forward and KV-cache decoding everywhere, torch's thread count")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (None: with mode auto on a CPU "
                                "chosen per phase by a short measurement, postrl.accel.cpu, else torch's default; "
                                "fix it for bitwise-reproducible runs)")
    matmul: Literal["auto", "torch", "onednn"] = Field(
        "auto", description="library for the policy's linear layers on CPU (float32): torch's default (MKL), "
        "oneDNN, or auto = oneDNN on AMD CPUs with AVX-512, where it is up to ~2x faster than MKL "
        "(postrl.accel.matmul); same function, float rounding differs")
    fused: bool = Field(True, description="the policy's forward and backward in the update as one hand-written "
                        "function for Llama-family float32 models on a CPU in one process, up to 192 positions "
                        "(same log-probs and gradients up to float rounding, fewer operators; postrl.accel.fused)")
    keep_freed_memory: bool = Field(True, description="on a CPU, make glibc's malloc reuse freed memory instead of "
                                    "returning it to the OS (no page faults on each step's new buffers; the process "
                                    "keeps its peak heap; postrl.accel.cpu.keep_freed_memory)")
    decode: Literal["auto", "numpy", "torch"] = Field(
        "auto", description="library of the static decoder's prefill and decode steps for Llama-family models "
        "(auto: numpy for a float32 model on a CPU, torch otherwise; the same function, numpy's operations cost "
        "less; postrl.accel.decoder)")

    @model_validator(mode="before")
    @classmethod
    def _bare_off(cls, data: Any) -> Any:
        """YAML reads a bare ``off`` as false: ``accel.mode=off`` means the mode 'off'."""
        if isinstance(data, dict) and data.get("mode") is False:
            data = {**data, "mode": "off"}
        return data


class SFTConfig(_Strict):
    """`postrl sft` and the built-in model's warm start."""

    steps: int = Field(800, ge=1, description="SFT steps (the built-in model trains this many on first use)")
    batch_size: int = Field(64, ge=1, le=MAX_ROWS_PER_STEP, description="demonstrations per SFT step")
    lr: float = Field(3e-3, gt=0.0, description="peak lr (warmup, then cosine to 10%), at most 1")
    warmup_steps: int = Field(20, ge=0, description="linear warmup steps")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")


class Config(_Strict):
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seeds prompts, sampling, shuffling and init; same seed + "
                      "config = same metrics")
    output_dir: str | None = Field(None, description="run directory (default: runs/<task>-<time>)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy")
    task: TaskConfig = Field(default_factory=lambda: TaskConfig(name="arithmetic", chatty=0.6),
                             description="prompt source and its parameters (the main job: arithmetic whose "
                                         "demonstrations come from a hedging teacher, see README)")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    environment: EnvironmentConfig | None = Field(None, description="multi-turn episodes: {name, max_turns: 4, "
                                                  "max_total_tokens: 256, step_timeout: null (seconds per step), "
                                                  "purify: none | cleaner (CLEANER, docs/agents.md), "
                                                  "purify_similarity: 0.8, the environment's parameters} (README "
                                                  "'Multi-turn and tools'); null: one completion per row")
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="correct", weight=1.0), RewardSpec(name="format", weight=0.2)],
        description="named reward sources, each {name, weight, params}; every completion keeps all K values",
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="reward evaluation and fault handling")
    shaping: list[StageSpec] = Field(default_factory=lambda: [StageSpec(name="weighted_sum")],
                                     description="reward transforms in order; one must produce the scalar reward")
    filters: list[FilterSpec] = Field(default_factory=list, description="batch-selection stages in order: prompt "
                                      "selectors, sampling plans, expansions, keep-mask filters")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="advantage estimator + params")
    loss: LossConfig = Field(default_factory=LossConfig, description="policy loss + params; agg: aggregation")
    kl: KLConfig = Field(default_factory=KLConfig)
    regularizers: list[RegularizerSpec] = Field(default_factory=list,
                                                description="loss regularisers in order, each {name, coef, params}")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    accel: AccelConfig = Field(default_factory=AccelConfig, description="the CPU speed layer (auto | off)")
    sft: SFTConfig = Field(default_factory=SFTConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig,
                                           description="monitors and alarm thresholds (docs/metrics.md)")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="metric sinks besides metrics.jsonl")

    @model_validator(mode="after")
    def _check(self) -> "Config":
        bad = _non_finite(self.model_dump(), "")
        if bad is not None:
            raise ValueError(f"{bad[0]}: expected a finite number, got {bad[1]}")
        if not self.rewards:
            raise ValueError("rewards: at least one reward source is required")
        # (after the finite check, so NaN and inf keep its message; the bounds: MAX_LR, MAX_REWARD_WEIGHT)
        weights = [(f"rewards.{i}.weight", r.weight) for i, r in enumerate(self.rewards)]
        weights += [(f"reward.weights.{i}", w) for i, w in enumerate(self.reward.weights or [])]
        for key, w in weights:
            if not -MAX_REWARD_WEIGHT <= w <= MAX_REWARD_WEIGHT:
                raise ValueError(f"{key}: {w:g} is outside [-{MAX_REWARD_WEIGHT:g}, {MAX_REWARD_WEIGHT:g}] (the "
                                 f"weighted sum is float32; scale the reward itself, not its weight)")
        for key, lr in (("optim.lr", self.optim.lr), ("sft.lr", self.sft.lr)):
            if lr > MAX_LR:
                raise ValueError(f"{key}: {lr:g} is above {MAX_LR:g} (an AdamW step moves each weight by about "
                                 f"lr: the run would diverge to NaN); typical RL values are 1e-6 to 1e-4")
        rows = self.train.prompts_per_step * self.rollout.group_size
        if rows > MAX_ROWS_PER_STEP:
            raise ValueError(f"train.prompts_per_step: {self.train.prompts_per_step} prompts x rollout.group_size "
                             f"{self.rollout.group_size} = {rows} rows per step, more than {MAX_ROWS_PER_STEP}")
        if rows * self.rollout.max_new_tokens > MAX_TOKENS_PER_STEP:
            raise ValueError(f"rollout.max_new_tokens: {rows} rows per step x {self.rollout.max_new_tokens} new "
                             f"tokens = {rows * self.rollout.max_new_tokens} tokens per step, more than "
                             f"{MAX_TOKENS_PER_STEP}")
        if self.train.mini_batches > rows:
            raise ValueError(f"train.mini_batches: {self.train.mini_batches} optimizer steps per epoch but only "
                             f"{rows} rows per step (each mini-batch needs at least one row)")
        eval_rows = self.train.eval_size * self.train.eval_k
        if eval_rows > MAX_ROWS_PER_STEP:
            raise ValueError(f"train.eval_size: {self.train.eval_size} prompts x train.eval_k {self.train.eval_k} "
                             f"= {eval_rows} rows per evaluation, more than {MAX_ROWS_PER_STEP}")
        return self


def _non_finite(value: Any, key: str) -> tuple[str, float] | None:
    """(dotted key, value) of the first NaN or inf float in a nested dict / list / tuple, else None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (key, value)
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        found = _non_finite(v, f"{key}.{k}" if key else str(k))
        if found is not None:
            return found
    return None


# ----------------------------------------------------------------------------------------------------------------
# loading


def _unreadable_yaml(e: BaseException) -> str | None:
    """Why YAML that parses cannot be read into values (one line), or None for an error that is not that: an
    integer over Python's limit of digits (``sys.get_int_max_str_digits``), nesting deeper than the parser's
    recursion."""
    if isinstance(e, RecursionError):
        return "nested too deeply (more levels of lists / mappings than the YAML reader allows)"
    if isinstance(e, ValueError) and "integer string conversion" in str(e):
        import sys

        return f"an integer with more than {sys.get_int_max_str_digits()} digits (Python's limit)"
    return None


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected KEY=VALUE (e.g. optim.lr=1e-5)")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}': empty key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except (ValueError, RecursionError) as e:
        why = _unreadable_yaml(e)
        if why is None:
            raise
        raise ConfigError(f"override {key}: {why}") from None
    return key.split("."), value


def _set_path(data: dict, path: list[str], value: Any, full: str) -> None:
    node: Any = data
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                raise ConfigError(f"override '{full}': '{part}' is not a valid index (list has {len(node)} items)")
            idx = int(part)
            if idx == len(node):
                node.append({} if not last else value)
            if last:
                node[idx] = value
            else:
                if not isinstance(node[idx], (dict, list)):
                    node[idx] = {}
                node = node[idx]
        else:
            if last:
                if part == "name" and _other_stage(node, {"name": value}):
                    node.clear()  # another stage: the old stage's parameters do not carry over
                node[part] = value
            else:
                if not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
                node = node[part]


def _format_error(err: ValidationError) -> str:
    """One line naming the key: pydantic's first error, or a validator's message (which names its keys itself)."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "config"
    if e["type"] == "extra_forbidden":
        return f"unknown key '{loc}'"
    if e["type"] == "value_error":
        text = str(e["ctx"]["error"])
        return text if not e["loc"] or text.startswith(loc) else f"{loc}: {text}"
    got = e.get("input")
    got_s = _short_repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return f"{loc}: {e['msg'].lower()} (got {got_s})"


def _short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (an integer of thousands of digits stays one short line)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 40:
        return f"an integer of {len(str(abs(value)))} digits"
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def default_dict() -> dict:
    return Config().model_dump(mode="json")


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{p}': not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                          f"{e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file '{p}': cannot read it ({e.strerror or e})") from None
    try:
        data = yaml_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file '{p}'{where}: invalid YAML") from None
    except (ValueError, RecursionError) as e:
        why = _unreadable_yaml(e)
        if why is None:
            raise
        raise ConfigError(f"config file '{p}': {why}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}': expected a mapping of keys at the top level")
    return data


def _other_stage(old: Any, new: dict) -> bool:
    """True when ``new`` names a different stage than ``old``: its parameters then replace old's, not merge."""
    return isinstance(old, dict) and "name" in new and new["name"] != old.get("name")


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not _other_stage(out[k], v):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None) -> Config:
    """Resolve a config: defaults <- ``base`` (e.g. a recipe) <- YAML file <- overrides; then validate."""
    data: dict = {}
    if base:
        data = _merge(data, base)
    if path is not None:
        data = _merge(data, read_yaml(path))
    for text in overrides or []:
        keys, value = _parse_override(text)
        if keys[0] not in Config.model_fields:
            raise ConfigError(f"unknown key '{'.'.join(keys)}' in override '{text}'")
        if keys[0] not in data and isinstance(getattr(Config(), keys[0]), (BaseModel, list)):
            data[keys[0]] = default_dict()[keys[0]]
        _set_path(data, keys, value, text)
    try:
        cfg = Config.model_validate(data, strict=True)  # strict in every section, the ones defined elsewhere too
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None
    except RecursionError:
        raise ConfigError("config: a value nested too deeply (more levels of lists / mappings than can be "
                          "checked)") from None
    check_stages(cfg)
    return cfg


def check_stages(cfg: Config) -> None:
    """Every stage name must exist and every parameter must be one the stage accepts, of its type and range
    (``postrl.stages.check_params``: the annotations of the stage's keyword-only parameters, and its registered
    ``check``); what a check derives from the run (e.g. a length from ``rollout.max_new_tokens``) is written
    into the config, so ``postrl config show`` shows it."""
    # stages, data and rewards load torch: postrl.config stays importable without it (the CLI, the alarms)
    from postrl import stages
    from postrl.data import load_source
    from postrl.rewards import columns_in_kwargs

    def check(kind, spec, where: str, **kw) -> None:
        resolved = stages.check_params(kind, spec.name, spec.params, where, run=cfg, **kw)
        for k, v in resolved.items():
            if k not in type(spec).model_fields:
                spec.model_extra[k] = v

    for i, r in enumerate(cfg.rewards):
        check("reward", r, f"rewards.{i}", any_keyword=not columns_in_kwargs(registry.get("reward", r.name)))
    if cfg.environment is not None:
        check("environment", cfg.environment, "environment")
    if cfg.reward.weights is not None and len(cfg.reward.weights) != len(cfg.rewards):
        raise ConfigError(f"reward.weights has {len(cfg.reward.weights)} values but rewards lists "
                          f"{len(cfg.rewards)} sources; give one weight per reward source")
    for i, s in enumerate(cfg.shaping):
        check("shaping", s, f"shaping.{i}")
    for i, s in enumerate(cfg.filters):
        check(stages.FILTER_KINDS, s, f"filters.{i}")
        kind = registry.find(stages.FILTER_KINDS, s.name).kind
        if s.max_attempts is not None and kind != "filter":
            raise ConfigError(f"filters.{i}.max_attempts: '{s.name}' is a {kind} stage; max_attempts belongs to "
                              f"keep-mask filters (kind filter)")
        if cfg.environment is not None and kind in ("sampling", "expansion"):
            raise ConfigError(f"filters.{i}: the {kind} stage '{s.name}' generates single completions; it cannot "
                              f"be combined with environment '{cfg.environment.name}' (multi-turn episodes)")
    check("advantage", cfg.advantage, "advantage")
    check("loss", cfg.loss, "loss")
    registry.find("aggregation", cfg.loss.agg)
    registry.find("kl", cfg.kl.estimator)
    for i, s in enumerate(cfg.regularizers):
        check("regularizer", s, f"regularizers.{i}")
    load_source(cfg.task.model_dump())  # validates the task name and its parameters


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
