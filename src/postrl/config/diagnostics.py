"""Configuration of the diagnostics (``diagnostics:``) and of the metric sinks (``logging:``).

Every monitor of METHODS.md section 7 has a section with ``enabled``, ``patience`` (consecutive steps the
condition must hold before the alarm fires) and its thresholds; every default is stated here and documented in
docs/metrics.md. Kept free of other postrl imports so that ``postrl.config`` can import it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


def _patience(n: int):
    return Field(n, ge=1, description="consecutive steps the condition must hold before the alarm fires")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    enabled: bool = Field(True, description="run this monitor")
    patience: int = Field(1, ge=1, description="consecutive steps the condition must hold before the alarm fires")


class ZeroVarianceConfig(_Section):
    patience: int = _patience(3)
    max_frac: float = Field(0.8, ge=0.0, le=1.0, description="alarm when at least this fraction of groups has "
                            "identical rewards (no learning signal under group normalisation)")


class AdvantageCollapseConfig(_Section):
    patience: int = _patience(3)
    max_collapse: float = Field(0.25, ge=0.0, le=1.0, description="alarm when the advantage keeps fewer than "
                                "(1 - this) of the distinct reward combinations of a group (GDPO)")


class TruncationConfig(_Section):
    patience: int = _patience(2)
    max_frac: float = Field(0.3, ge=0.0, le=1.0, description="alarm when this fraction of completions hits "
                            "rollout.max_new_tokens")


class EnvErrorsConfig(_Section):
    max_per_episode: float = Field(0.05, ge=0.0, description="multi-turn runs: alarm when the environment's step "
                                   "raised (turns/env_errors, per episode) at least this often; such episodes fail "
                                   "their reward")


class ToolErrorsConfig(_Section):
    patience: int = _patience(3)
    max_frac: float = Field(0.3, ge=0.0, le=1.0, description="multi-turn runs: alarm when at least this fraction "
                            "of executed tool calls raised or timed out (1 - turns/tool_success)")


class TurnTruncationConfig(_Section):
    patience: int = _patience(2)
    max_frac: float = Field(0.3, ge=0.0, le=1.0, description="multi-turn runs: alarm when at least this fraction "
                            "of model turns hits the per-turn token limit (turns/truncated_turns)")


class MalformedCallsConfig(_Section):
    patience: int = _patience(3)
    max_per_episode: float = Field(0.5, ge=0.0, description="multi-turn runs: alarm when malformed tool calls "
                                   "(turns/malformed_calls, per episode) reach this mean")


class EntropyCollapseConfig(_Section):
    patience: int = _patience(3)
    min_entropy: float = Field(0.005, ge=0.0, description="alarm below this mean token entropy (nats)")
    max_drop: float = Field(0.95, ge=0.0, le=1.0, description="alarm when entropy fell by this fraction from "
                            "its mean over the first `window` steps")
    window: int = Field(5, ge=1, description="steps of the baseline")
    low_prob: float = Field(0.1, gt=0.0, lt=1.0, description="a sampled token with probability below this counts "
                            "in tokens/low_prob_frac")


class LengthDriftConfig(_Section):
    window: int = Field(10, ge=2, description="steps averaged at the start and at the end of the comparison")
    max_growth: float = Field(1.0, ge=0.0, description="alarm when mean length grew by more than this fraction")
    max_shrink: float = Field(0.6, ge=0.0, le=1.0, description="alarm when mean length fell by more than this "
                              "fraction")
    min_tokens: float = Field(2.0, ge=0.0, description="ignore changes smaller than this many tokens")


class LengthRewardCorrConfig(_Section):
    patience: int = _patience(5)
    max_corr: float = Field(0.6, ge=-1.0, le=1.0, description="alarm when the within-group correlation of reward "
                            "and length stays above this")


class ProxyGoldGapConfig(_Section):
    window: int = Field(5, ge=1, description="steps averaged at the start and at the end")
    min_proxy_rise: float = Field(0.2, description="proxy (training reward) rise that counts as 'up'")
    max_gold_rise: float = Field(0.02, description="gold (verifier accuracy / held-out eval) rise at or below "
                                 "which gold counts as 'flat'")


class KLBlowupConfig(_Section):
    max_kl: float = Field(0.5, gt=0.0, description="alarm when the per-token KL to the reference exceeds this")
    max_growth: float = Field(10.0, gt=1.0, description="alarm when KL grew this many times over `window` steps "
                              "(and exceeds max_kl / 4)")
    window: int = Field(10, ge=2)
    smooth: int = Field(3, ge=1, description="the KL compared with max_kl and its growth is the mean of this many "
                        "last steps (one step's estimate on a small batch is noisy; 1: the step's own)")
    max_ratio: float = Field(20.0, gt=1.0, description="alarm when the largest token ratio pi/pi_old exceeds this")
    max_ppo_kl: float = Field(0.2, gt=0.0, description="alarm when the KL between the policy before and during "
                              "the update (verl actor/ppo_kl) exceeds this")


class RewardAllFailedConfig(_Section):
    min_rate: float = Field(1.0, gt=0.0, le=1.0, description="alarm (error) at the first step where a reward source "
                            "fails on at least this fraction of the scored batch (1.0: on every completion)")


class NanGuardConfig(_Section):
    save_batches: bool = Field(True, description="save the batch of a skipped step to run_dir/bad_batches/ "
                               "(a reward source failing on more than reward.alarm_rate of a batch also alarms)")


class ClipFractionsConfig(_Section):
    patience: int = _patience(2)
    max_clip: float = Field(0.2, ge=0.0, le=1.0, description="alarm when the clipped token fraction "
                            "(low + high) exceeds this")


class LogprobMismatchConfig(_Section):
    patience: int = _patience(2)
    max_abs: float = Field(0.05, gt=0.0, description="alarm when the mean |sampler - trainer| token log-prob "
                           "difference exceeds this (nats)")


class FilteredSamplingConfig(_Section):
    patience: int = _patience(2)
    min_kept_mass: float = Field(0.95, gt=0.0, le=1.0, description="alarm when rollout.logprobs=full and the mean "
                                 "probability mass top-p / top-k kept per sampled token (sampler/kept_mass_mean) "
                                 "is below this: the importance ratio is off by log(mass) per token")


class EchoTrapConfig(_Section):
    window: int = Field(10, ge=3, description="steps of history for the cliff and the spike")
    max_std_ratio: float = Field(0.3, gt=0.0, lt=1.0, description="cliff: within-group reward std falls below "
                                 "this fraction of its maximum over the window")
    min_peak_std: float = Field(0.05, ge=0.0, description="ignore cliffs from a maximum std below this")
    spike: float = Field(5.0, gt=1.0, description="spike: grad norm above this multiple of its window median")


class EdgeOfStabilityConfig(_Section):
    every: int = Field(25, ge=0, description="estimate the sharpness at every N-th step (0: off); an estimate "
                       "is iters double-backward passes on up to batch_size rows (in the demo ~2 s, about 3 of its "
                       "steps), logged as time/sharpness")
    iters: int = Field(10, ge=1, description="Lanczos steps (Hessian-vector products)")
    batch_size: int = Field(32, ge=1, description="rows of the fixed batch (the sharpness of a much smaller batch "
                            "than the training batch overstates the training loss's)")
    max_ratio: float = Field(4.0, gt=0.0, description="alarm when sharpness / stability threshold reaches this "
                             "(Adam hovers about 1 at the edge of stability, which is common; the fixed-batch "
                             "estimate reads up to ~2 there; a diverging run reads 10 and more)")
    measurements: int = Field(2, ge=1, description="... on this many consecutive measurements")


class PassAtKConfig(_Section):
    patience: int = _patience(5)
    window: int = Field(10, ge=2, description="steps averaged at the start and at the end (narrowing)")
    min_pass_at_k: float = Field(0.0, ge=0.0, le=1.0, description="alarm when training pass@G stays at or "
                                 "below this (no group has a correct completion)")
    max_narrowing: float = Field(0.1, ge=0.0, description="alarm when pass@G fell by this while pass@1 rose")


class TeacherVarianceConfig(_Section):
    patience: int = _patience(5)
    min_std: float = Field(0.01, ge=0.0, description="alarm when the mean within-prompt reward std "
                           "(reward/group_std) stays below this (flat objective: 'What Makes a Reward Model a Good "
                           "Teacher?')")
    min_share: float = Field(0.1, ge=0.0, le=1.0, description="... or below this fraction of the batch reward std "
                             "(reward/std): the reward separates prompts, not the completions of a prompt")


class IntrinsicCollapseConfig(_Section):
    saturation: float = Field(0.95, ge=0.0, le=1.0, description="label-free runs: the intrinsic reward counts as "
                              "saturated when its batch mean reaches this ...")
    max_group_std: float = Field(0.05, ge=0.0, description="... while its mean within-group std is at most this "
                                 "(the policy agrees with itself: sharpening is complete)")
    window: int = Field(5, ge=1, description="steps averaged for the rise-then-fall of the verifier accuracy")
    max_drop: float = Field(0.1, gt=0.0, le=1.0, description="alarm when the verifier accuracy (when the data has "
                            "one) fell this much below its peak window mean while the intrinsic reward did not fall")


class DiagnosticsConfig(BaseModel):
    """Monitors with threshold alarms (METHODS.md section 7); see docs/metrics.md."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    enabled: bool = Field(True, description="compute alarms (metrics are always logged)")
    reward_all_failed: RewardAllFailedConfig = Field(default_factory=RewardAllFailedConfig)
    zero_variance_groups: ZeroVarianceConfig = Field(default_factory=ZeroVarianceConfig)
    advantage_collapse: AdvantageCollapseConfig = Field(default_factory=AdvantageCollapseConfig)
    truncation: TruncationConfig = Field(default_factory=TruncationConfig)
    env_errors: EnvErrorsConfig = Field(default_factory=EnvErrorsConfig)
    tool_errors: ToolErrorsConfig = Field(default_factory=ToolErrorsConfig)
    turn_truncation: TurnTruncationConfig = Field(default_factory=TurnTruncationConfig)
    malformed_calls: MalformedCallsConfig = Field(default_factory=MalformedCallsConfig)
    entropy_collapse: EntropyCollapseConfig = Field(default_factory=EntropyCollapseConfig)
    length_drift: LengthDriftConfig = Field(default_factory=LengthDriftConfig)
    length_reward_corr: LengthRewardCorrConfig = Field(default_factory=LengthRewardCorrConfig)
    proxy_gold_gap: ProxyGoldGapConfig = Field(default_factory=ProxyGoldGapConfig)
    kl_blowup: KLBlowupConfig = Field(default_factory=KLBlowupConfig)
    nan_guard: NanGuardConfig = Field(default_factory=NanGuardConfig)
    clip_fractions: ClipFractionsConfig = Field(default_factory=ClipFractionsConfig)
    logprob_mismatch: LogprobMismatchConfig = Field(default_factory=LogprobMismatchConfig)
    filtered_sampling: FilteredSamplingConfig = Field(default_factory=FilteredSamplingConfig)
    echo_trap: EchoTrapConfig = Field(default_factory=EchoTrapConfig)
    edge_of_stability: EdgeOfStabilityConfig = Field(default_factory=EdgeOfStabilityConfig)
    pass_at_k: PassAtKConfig = Field(default_factory=PassAtKConfig)
    teacher_variance: TeacherVarianceConfig = Field(default_factory=TeacherVarianceConfig)
    intrinsic_collapse: IntrinsicCollapseConfig = Field(default_factory=IntrinsicCollapseConfig)


class LoggingConfig(BaseModel):
    """Where metrics go besides run_dir/metrics.jsonl (always written)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    sinks: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="optional sinks: tensorboard (run_dir/tensorboard), wandb (offline, "
        "run_dir/wandb), mlflow (file store run_dir/mlruns)")
    project: str = Field("postrl", description="W&B project / MLflow experiment name")
    run_name: str | None = Field(None, description="run name in the sinks (default: the run directory's name)")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI (default: the file store run_dir/mlruns)")
