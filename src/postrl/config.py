"""Typed configuration: pydantic models, YAML files, dot-list overrides.

``load_config("run.yaml", ["optim.lr=1e-5", "rewards.0.weight=2"])`` reads the YAML file (or the embedded
default when no file is given), applies each override (the value is parsed as YAML, so ``1e-5``, ``true``,
``[a, b]`` work), validates everything, and checks every stage name and its parameters against the registry.
Any mistake is a one-line :class:`~postrl.errors.ConfigError` naming the key.

A stage is written ``{name: <registered name or module:attr>, <param>: <value>, ...}``; its parameters are the
stage function's keyword-only arguments.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StageSpec(BaseModel):
    """A named stage plus its parameters (any other key)."""

    model_config = ConfigDict(extra="allow")
    name: str

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RewardSpec(StageSpec):
    weight: float = 1.0


class ModelConfig(_Strict):
    path: str = Field("builtin", description="local folder for from_pretrained, or 'builtin' (tiny model + SFT)")
    builtin_size: str = Field("tiny", description="size of the built-in model (nano/tiny/small/medium)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="auto: use the tokenizer's chat template when it has one; none: plain prompt"
    )


class TaskConfig(StageSpec):
    name: str = "arithmetic"


class RolloutConfig(_Strict):
    backend: Literal["hf", "vllm"] = "hf"
    group_size: int = Field(8, ge=1, description="G completions per prompt")
    max_new_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    batch_size: int | None = Field(None, ge=1, description="rows per generation batch (None: all at once)")


class AdvantageConfig(StageSpec):
    name: str = "grpo"


class LossConfig(StageSpec):
    name: str = "ppo_clip"
    agg: str = Field("token_mean", description="aggregation: token_mean, seq_mean_token_mean, ...")


class KLConfig(_Strict):
    coef: float = Field(0.0, ge=0.0, description="0 disables the reference model and the KL term")
    estimator: str = "k3"


class OptimConfig(_Strict):
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    max_grad_norm: float | None = Field(1.0, description="clip the global grad norm (None: no clipping)")


class TrainConfig(_Strict):
    steps: int = Field(60, ge=1, description="RL steps (one rollout batch each)")
    prompts_per_step: int = Field(16, ge=1, description="prompts per step over all processes")
    epochs: int = Field(1, ge=1, description="optimisation passes over each rollout batch")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per epoch (batch split in this many)")
    micro_batch_size: int = Field(64, ge=1, description="rows per forward/backward (gradient accumulation)")
    save_every: int = Field(20, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep_last: int = Field(2, ge=1)
    samples_every: int = Field(10, ge=1, description="log sample completions every N steps")
    eval_every: int = Field(0, ge=0, description="held-out eval every N steps (0: only before and after)")
    eval_size: int = Field(200, ge=1)
    eval_k: int = Field(4, ge=1, description="samples per prompt for pass@k in evaluations")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (None: torch default)")


class SFTConfig(_Strict):
    steps: int = Field(300, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0.0)
    warmup_steps: int = 20
    weight_decay: float = 0.0


class Config(_Strict):
    seed: int = 0
    output_dir: str | None = Field(None, description="run directory (default: runs/<task>-<time>)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="correct", weight=1.0), RewardSpec(name="format", weight=0.2)]
    )
    shaping: list[StageSpec] = Field(default_factory=lambda: [StageSpec(name="weighted_sum")])
    filters: list[StageSpec] = Field(default_factory=list)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if not self.rewards:
            raise ValueError("rewards: at least one reward source is required")
        return self


# ----------------------------------------------------------------------------------------------------------------
# loading


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
                node[part] = value
            else:
                if not isinstance(node.get(part), (dict, list)):
                    node[part] = {}
                node = node[part]


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "config"
    if e["type"] == "extra_forbidden":
        return f"unknown key '{loc}'"
    got = e.get("input")
    got_s = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    return f"{loc}: {e['msg'].lower()} (got {got_s})"


def default_dict() -> dict:
    return Config().model_dump(mode="json")


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    try:
        data = yaml_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file '{p}'{where}: invalid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}': expected a mapping of keys at the top level")
    return data


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
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
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None
    check_stages(cfg)
    return cfg


def check_stages(cfg: Config) -> None:
    """Every stage name must exist and every parameter must be one the stage accepts."""
    from postrl import registry
    from postrl.data import load_source

    for i, r in enumerate(cfg.rewards):
        registry.entry("reward", r.name)
        registry.check_params("reward", r.name, r.params, where=f"rewards.{i}")
    for i, s in enumerate(cfg.shaping):
        registry.entry("shaping", s.name)
        registry.check_params("shaping", s.name, s.params, where=f"shaping.{i}")
    for i, s in enumerate(cfg.filters):
        registry.entry("filter", s.name)
        registry.check_params("filter", s.name, s.params, where=f"filters.{i}")
    registry.entry("advantage", cfg.advantage.name)
    registry.check_params("advantage", cfg.advantage.name, cfg.advantage.params, where="advantage")
    registry.entry("loss", cfg.loss.name)
    registry.check_params("loss", cfg.loss.name, cfg.loss.params, where="loss")
    registry.entry("aggregation", cfg.loss.agg)
    registry.entry("regularizer", f"kl_{cfg.kl.estimator}")
    load_source(cfg.task.model_dump())  # validates the task name and its parameters


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
