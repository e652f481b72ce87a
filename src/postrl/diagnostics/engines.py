"""postrl's metric and option names beside TRL's and verl's: the one mapping the readers of other engines' runs, the
alarms inside TRL / verl and docs/metrics.md use.

* :data:`SECTIONS`: every per-step metric postrl logs, its meaning, and the name TRL's ``GRPOTrainer`` and verl's
  trainer log it under. A name that maps exactly is *read* as the postrl key (``read`` is true: a TRL run's
  ``completions/clipped_ratio`` is read as ``truncated/frac``, so postrl's monitors run on it); a name shown for
  orientation only (a different definition) is not read. docs/metrics.md's tables are generated from it
  (:func:`update_doc`; ``python -m postrl.diagnostics docs/metrics.md`` rewrites them, a test keeps them
  equal).
* :data:`OPTIONS`: postrl config keys beside the TRL (``GRPOConfig``) and verl (Hydra) options that set the same
  thing, so an alarm on a TRL or verl run names that engine's option (``max_completion_length``,
  ``data.max_response_length``) and its value when the run's settings are known.
* :data:`FIXES`: per engine, the fix each alarm proposes in that engine's options (``{now:KEY}`` becomes
  " (now VALUE)" where the run's setting of postrl's KEY is known).

:func:`translate` turns one logged row of an engine into postrl's keys; this module imports nothing of postrl.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

ENGINES = {"postrl": "postrl", "trl": "TRL", "verl": "verl"}
"""engine id -> the name shown in messages."""


@dataclass(frozen=True)
class Alias:
    """One metric name of another engine: ``name`` (``<x>`` matches one path segment, carried to ``key``), the postrl
    ``key`` it is read as (None: shown in the table only), and ``how`` (``"1-x"``: read as one minus the value)."""

    name: str
    key: str | None = None
    how: str = ""

    @property
    def read(self) -> bool:
        return self.key is not None


@dataclass(frozen=True)
class Metric:
    """One row of the table: postrl's keys, their meaning, and the TRL / verl names (:class:`Alias`; a plain string
    is read as the postrl key at the same position), with a note shown after the names."""

    keys: tuple[str, ...]
    meaning: str
    trl: tuple = ()
    verl: tuple = ()
    trl_note: str = ""
    verl_note: str = ""
    show: str = ""  # the postrl column when it is not the keys (e.g. a sum)

    def aliases(self, engine: str) -> list[Alias]:
        names = self.trl if engine == "trl" else self.verl if engine == "verl" else ()
        out = []
        for i, n in enumerate(names):
            if isinstance(n, Alias):
                out.append(n)
            else:
                if len(names) != len(self.keys):
                    raise ValueError(f"{self.keys}: {engine} name '{n}' is not aligned with a postrl key")
                out.append(Alias(n, self.keys[i]))
        return out


def M(keys: str | tuple[str, ...], meaning: str, **kw) -> Metric:
    return Metric((keys,) if isinstance(keys, str) else tuple(keys), meaning, **kw)


A = Alias

SECTIONS: dict[str, tuple[str, list[Metric]]] = {
    "reward": ("Reward and accuracy", [
        M("reward/mean", "mean scalar reward (after shaping)", trl=("reward",), verl=("critic/rewards/mean",)),
        M("reward/std", "std of the scalar reward over the batch", trl=("reward_std",)),
        M("reward/<name>/mean", "mean of reward source `<name>` (raw, before shaping)",
          trl=(A("rewards/<name>/mean", "reward/<name>/mean"),), verl=(A("critic/score/mean", "reward/score/mean"),),
          verl_note="(one source, read as `reward/score/mean`)"),
        M("reward/<name>/std", "std of reward source `<name>`", trl=(A("rewards/<name>/std", "reward/<name>/std"),)),
        M("reward/<name>/failures", "entries of `<name>` that failed (raised, timed out, NaN / inf / not a number)"),
        M("reward/<name>/failure_rate", "failed fraction of the scored batch"),
        M("reward/<name>/skipped", "fraction of the scored batch `<name>` returned None for: it does not apply to those "
          "rows (TRL's semantics; not a failure, the other sources score them)"),
        M("reward/<name>/first_failure", "(text, only in steps where `<name>` failed; not sent to the sinks) the first "
          "failing input and why, as in the console warning"),
        M("reward/group_std", "mean within-group std of the scalar reward (the echo_trap signal)"),
        M("accuracy", "fraction of completions the verifier (`correct` reward) accepts",
          verl_note="- (validation: `val-core/<source>/reward/mean@N`)"),
        M(("pass@1", "pass@G"), "unbiased pass@k per group from its G samples (Chen et al. 2021), k = 1 and k = G",
          verl_note="- (validation: `val-core/<source>/reward/best@N/mean`)"),
        M("valid", "fraction of completions with a finite reward"),
    ]),
    "signal": ("Learning signal (groups and advantages)", [
        M("zero_variance_groups/frac", "fraction of groups whose rewards are all equal (no signal under group "
          "normalisation)", trl=("frac_reward_zero_std",),
          verl_note="- (read as 1 at a step where `critic/score/min` = `critic/score/max`: every reward equal)"),
        M("zero_variance_groups/all_correct", "... of which every completion is correct (task solved)"),
        M("zero_variance_groups/all_wrong", "... of which every completion is wrong (task too hard / reward never "
          "pays)"),
        M(("advantages/mean", "advantages/std", "advantages/abs_mean", "advantages/min", "advantages/max"),
          "advantage statistics (per completion; token advantages masked-averaged)",
          verl=(A("critic/advantages/mean"), A("critic/advantages/max"), A("critic/advantages/min")),
          verl_note="(over tokens)"),
        M("advantages/distinct_frac", "mean over groups of distinct advantage values / G"),
        M("rewards/distinct_frac", "mean over groups of distinct reward vectors (rows of the [N, K] matrix) / G"),
        M("advantages/collapse", "mean over groups of 1 - distinct advantages / distinct reward vectors (GDPO's "
          "collapse of distinct reward combinations)"),
    ]),
    "length": ("Length and truncation", [
        M(("length/mean", "length/min", "length/max"), "completion tokens",
          trl=("completions/mean_length", "completions/min_length", "completions/max_length"),
          verl=("response_length/mean", "response_length/min", "response_length/max")),
        M("length/terminated_mean", "mean length of completions that ended (EOS / stop)",
          trl=("completions/mean_terminated_length",)),
        M("truncated/frac", "fraction of completions that hit `rollout.max_new_tokens`",
          trl=("completions/clipped_ratio",), verl=("response_length/clip_ratio",)),
        M(("truncated/reward_mean", "finished/reward_mean"), "mean reward of truncated / finished completions"),
        M("length/reward_corr", "within-group Pearson correlation of reward with length (length and reward centred "
          "by group mean)"),
        M("length/accuracy_corr", "(with a `correct` reward) mean over groups of the within-group Pearson correlation "
          "of length with correctness (groups with a correct and a wrong completion and two lengths; absent in a step "
          "where no group has them); < 0: shorter "
          "completions are more often right (overthinking), > 0: underthinking (ICR's gate, `regularizers: [{name: "
          "icr}]`)"),
        M(("tokens/completion", "tokens/prompt"), "tokens in the step's completions / prompts",
          trl=(A("num_tokens"),), trl_note="(cumulative, both)", verl=(A("perf/total_num_tokens"),)),
        M(("prompts/truncated", "prompts/dropped"), "with `rollout.max_prompt_length`: prompts of the step (every "
          "generation round) longer than it, cut to their last tokens (`prompt_overflow=truncate`) or masked out of "
          "the update (`drop`)"),
    ]),
    "turns": ("Turns (multi-turn episodes: `environment` set)", [
        M("turns/per_episode", "mean model turns per episode", verl=("num_turns/mean",)),
        M("turns/tool_calls", "mean executed tool calls per episode", trl=("tools/call_frequency",),
          trl_note="(calls per completion)"),
        M("turns/tool_success", "executed calls that returned (no exception, no timeout) / executed calls; NaN "
          "without calls", trl=(A("tools/failure_frequency", "turns/tool_success", "1-x"),)),
        M("turns/malformed_calls", "mean malformed tool calls per episode (unparsable, unknown tool, bad arguments, "
          "unclosed tag)"),
        M("turns/env_errors", "mean environment failures per episode (`step` raised: the episode's reward fails)"),
        M(("turns/truncated_turns", "turns/truncated_turn_<k>"), "fraction of model turns (at turn k) that hit the "
          "token limit"),
        M("turns/env_token_fraction", "environment tokens / all completion tokens up to the last model token (outside "
          "the loss mask)"),
        M("turns/user_errors", "mean simulated-user failures per episode (`simulated_user`: the user model raised, "
          "timed out or returned no text; the episode ends, its reward fails)"),
        M("turns/judge_errors", "fraction of episodes whose StepTool contribution judge failed (their reward fails)"),
        M("turns/purified", "fraction of episodes CLEANER rewrote (`environment.purify=cleaner`: a failed tool call "
          "replaced by its correction)"),
    ]),
    "policy": ("Policy, entropy, KL, clipping", [
        M("pg_loss", "policy-gradient loss (aggregated)", trl=("loss",), verl=("actor/pg_loss",)),
        M("entropy", "mean token entropy of the policy (nats)", trl=("entropy",), verl=("actor/entropy",)),
        M("tokens/low_prob_frac", "fraction of sampled tokens with sampler probability < "
          "`diagnostics.entropy_collapse.low_prob` (0.1)"),
        M("tokens/logprob_mean", "mean sampler log-prob of the sampled tokens"),
        M("kl", "KL(policy ‖ reference) per token (`kl.estimator`), when `kl.coef > 0`", trl=("kl",),
          verl=("actor/kl_loss",)),
        M("kl_coef", "KL coefficient used this step (adaptive or pid controller)", verl=("actor/kl_coef",)),
        M("kl_threshold", "`kl.controller=pid`: the KL threshold the reward velocity's PID set this step"),
        M("kl_tracked", "`kl.controller=pid`: the tracked KL (0.9 / 0.1 moving average) compared with the threshold"),
        M("kl_entropy_gate", "`kl.controller=pid`: the entropy gate max(0.5, floor / (H + 0.1)) on the coefficient"),
        M("kl_reward", "KL penalty per token when `kl.placement=reward`", verl=("actor/reward_kl_penalty",)),
        M("ppo_kl", "mean (old log-prob - new log-prob) during the update: how far the policy moved within the step",
          verl=("actor/ppo_kl",)),
        M("clip_low", "fraction of tokens clipped below (ratio < 1 - eps_low, A < 0)", trl=("clip_ratio/low_mean",)),
        M("clip_high", "fraction of tokens clipped above (ratio > 1 + eps_high, A > 0)", trl=("clip_ratio/high_mean",),
          verl_note="(`actor/pg_clipfrac` counts both signs)"),
        M("clip_region", "region clip fraction (console `clip` column); read as `clip_region` from other engines",
          show="`clip_low + clip_high`", trl=("clip_ratio/region_mean",), verl=("actor/pg_clipfrac",)),
        M("clip_dual", "fraction of tokens where dual-clip binds (A < 0, `loss.dual_clip`)",
          verl=("actor/pg_clipfrac_lower",)),
        M(("ratio/mean", "ratio/min", "ratio/max"), "token ratio pi / pi_old over the loss tokens of every "
          "micro-batch"),
        M("ratio_max", "largest token ratio (the loss engine's own count)"),
        M(("grad_norm", "grad_norm_max"), "mean / max global grad norm (before clipping) over the step's optimizer "
          "steps", trl=(A("grad_norm", "grad_norm"),), verl=(A("actor/grad_norm", "grad_norm"),)),
        M("lr", "learning rate after the step", trl=("learning_rate",), verl=("actor/lr",)),
    ]),
    "mismatch": ("Sampler vs trainer (log-prob mismatch)", [
        M(("mismatch/logp_abs_mean", "mismatch/logp_abs_max"), "mean / max abs(log pi_sampler - log pi_trainer) per "
          "token", trl=("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")),
        M("mismatch/prob_abs_mean", "mean abs(pi_sampler - pi_trainer) per token",
          verl=("training/rollout_probs_diff_mean",)),
        M("mismatch/kl", "k3 estimate of KL(sampler ‖ trainer) per token", verl=("rollout_corr/kl",)),
        M(("mismatch/is_ratio_min", "mismatch/is_ratio_max"), "extremes of pi_trainer / pi_sampler",
          trl=("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max")),
        M(("sampler/kept_mass_mean", "sampler/kept_mass_min"), "with `rollout.top_p` < 1 or `rollout.top_k` > 0: "
          "mean / min over completion tokens of the unfiltered probability mass M_t the filter kept where each token "
          "was sampled (logged only with a filter)"),
        M("sampler/kept_logmass_seq", "mean over completions of sum_t log M_t: how far a sequence-level log-ratio is "
          "off with `rollout.logprobs=full` (per token: log M_t)"),
    ]),
    "stability": ("Stability, guard, throughput, memory", [
        M("stability/sharpness", "top eigenvalue of the Hessian of the training loss on a fixed batch (Adam: of "
          "P^-1 H), every `diagnostics.edge_of_stability.every` steps"),
        M("stability/threshold", "2/lr (SGD) or (2 + 2 beta1) / ((1 - beta1) lr) = 38/lr at beta1 = 0.9 (Adam)"),
        M("stability/ratio", "sharpness / threshold (edge of stability at 1)"),
        M(("stability/lr", "stability/preconditioned"), "lr used for the threshold; 1 when preconditioned by Adam's "
          "second moment"),
        M("time/sharpness", "seconds the sharpness estimate took at the steps that have one (not part of "
          "`time/step`)"),
        M("nan_guard/skipped", "optimizer steps skipped this step (non-finite grad norm)"),
        M("nan_guard/skipped_total", "... since the start of the run"),
        M("nan_guard/saved", "path of the saved batch (`bad_batches/step-N.pt`)"),
        M(("time/generation", "time/reward", "time/ref", "time/update", "time/step"), "seconds per phase",
          trl=(A("step_time", "time/step"),), trl_note="(total)",
          verl=("timing_s/gen", "timing_s/reward", "timing_s/ref", "timing_s/update_actor", "timing_s/step")),
        M("throughput/generation", "completion tokens / generation seconds"),
        M("throughput/reward", "completion tokens / reward (+ shaping, advantage) seconds"),
        M("throughput/reference", "(prompt + completion) tokens x frozen passes / reference seconds"),
        M("throughput/update", "(prompt + completion) tokens x epochs / update seconds",
          verl=(A("perf/throughput"),), verl_note="(whole step)"),
        M("time/tokens_per_s", "completion tokens / step seconds (console `tok/s`)"),
        M(("memory/rss_peak_gb", "memory/rss_gb"), "peak / current resident memory of the process",
          verl=(A("perf/cpu_memory_used_gb", "memory/rss_gb"),)),
        M(("memory/cuda_max_allocated_gb", "memory/cuda_max_reserved_gb"), "CUDA peak allocated / reserved memory "
          "during the step (GPU only)", verl=("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb")),
    ]),
}


# ------------------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class Option:
    """A postrl config key and the option of each engine that sets the same thing; ``exact``: the values mean the
    same (read back into postrl's key from the engine's settings), else the name is shown only."""

    key: str
    trl: str = ""
    verl: str = ""
    exact: bool = True
    note: str = ""

    def name(self, engine: str) -> str:
        return {"trl": self.trl, "verl": self.verl}.get(engine, self.key) or ""


OPTIONS: list[Option] = [
    Option("rollout.max_new_tokens", "max_completion_length", "data.max_response_length"),
    Option("rollout.group_size", "num_generations", "actor_rollout_ref.rollout.n"),
    Option("rollout.temperature", "temperature", "actor_rollout_ref.rollout.temperature"),
    Option("rollout.top_p", "top_p", "actor_rollout_ref.rollout.top_p"),
    Option("rollout.top_k", "top_k", "actor_rollout_ref.rollout.top_k", exact=False, note="off: postrl 0, TRL 0 / "
           "None, verl -1"),
    Option("optim.lr", "learning_rate", "actor_rollout_ref.actor.optim.lr"),
    Option("optim.max_grad_norm", "max_grad_norm", "actor_rollout_ref.actor.optim.clip_grad"),
    Option("optim.warmup_steps", "warmup_steps", "actor_rollout_ref.actor.optim.lr_warmup_steps"),
    Option("kl.coef", "beta", "actor_rollout_ref.actor.kl_loss_coef", note="verl: with "
           "actor_rollout_ref.actor.use_kl_loss=true (in the reward: algorithm.kl_ctrl.kl_coef)"),
    Option("loss.eps_low", "epsilon", "actor_rollout_ref.actor.clip_ratio_low"),
    Option("loss.eps_high", "epsilon_high", "actor_rollout_ref.actor.clip_ratio_high"),
    Option("train.epochs", "num_iterations", "actor_rollout_ref.actor.ppo_epochs"),
    Option("train.mini_batches", "steps_per_generation", "actor_rollout_ref.actor.ppo_mini_batch_size", exact=False,
           note="TRL: optimizer steps per generation batch; verl: prompts per mini-batch (mini-batches = "
           "data.train_batch_size / it)"),
    Option("train.steps", "max_steps", "trainer.total_training_steps"),
]
_OPTION = {o.key: o for o in OPTIONS}


def option(engine: str, key: str) -> str:
    """The name of postrl config ``key`` in ``engine`` (postrl: the key itself; unknown: the key)."""
    o = _OPTION.get(key)
    return (o.name(engine) if o is not None else "") or key


def settings_config(engine: str, settings: dict) -> dict:
    """An engine's settings (flat: ``{'max_completion_length': 16}``, ``{'data.max_response_length': 512}``) as a
    postrl-keyed nested config for the monitors (only :data:`OPTIONS` that are ``exact``)."""
    out: dict = {}
    for o in OPTIONS:
        name = o.name(engine)
        if not o.exact or not name or name not in settings:
            continue
        v = settings[name]
        if v is None or (o.key == "train.steps" and isinstance(v, (int, float)) and v <= 0):
            continue
        node = out
        *parents, last = o.key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def flatten(d: Any, prefix: str = "") -> dict:
    """A nested dict as dotted keys (lists kept as values)."""
    if not isinstance(d, dict):
        return {prefix: d} if prefix else {}
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


# ------------------------------------------------------------------------------------------------ reading


def _compile(engine: str) -> tuple[dict[str, Alias], list[tuple[re.Pattern, Alias]]]:
    exact: dict[str, Alias] = {}
    patterns = []
    for _, rows in SECTIONS.values():
        for m in rows:
            for a in m.aliases(engine):
                if not a.read:
                    continue
                if "<" in a.name:
                    parts = re.split(r"<(\w+)>", a.name)  # literal, name, literal, ...
                    rx = "".join(re.escape(x) if i % 2 == 0 else f"(?P<{x}>[^/]+)" for i, x in enumerate(parts))
                    patterns.append((re.compile(rx + r"\Z"), a))
                else:
                    exact[a.name] = a
    return exact, patterns


_READERS: dict[str, tuple] = {}


NONE_IS_NAN = {"trl"}
"""Engines whose logged None is a non-finite value: TRL's ``GRPOTrainer.log`` averages each metric over the values it
gathered, NaN left out, and logs None where every value was NaN (e.g. ``reward`` when no completion got a finite
reward, TRL 1.16)."""


def _value(v: Any, how: str) -> Any:
    if how == "1-x" and isinstance(v, (int, float)) and not isinstance(v, bool):
        return 1.0 - float(v)
    return v


def _derive_verl(raw: dict, out: dict) -> None:
    """verl logs no zero-variance fraction: every reward of the step equal (score min = max) means every group is
    zero-variance (1); otherwise the fraction is unknown (NaN: nothing to measure)."""
    lo, hi = raw.get("critic/score/min"), raw.get("critic/score/max")
    if "zero_variance_groups/frac" not in out and isinstance(lo, (int, float)) and isinstance(hi, (int, float)):
        out["zero_variance_groups/frac"] = 1.0 if lo == hi else math.nan


DERIVED: dict[str, Callable[[dict, dict], None]] = {"verl": _derive_verl}

POSTRL_PREFIX = "postrl/"
"""postrl's own metrics logged inside another engine (the TRL adapter, the verl plug-in, :mod:`postrl.integrations.
alarms`); ``postrl/alarm/<name>`` flags are not metrics."""


def translate(engine: str, raw: dict) -> dict:
    """One logged row of ``engine`` with postrl's keys: the names :data:`SECTIONS` reads are renamed (and converted),
    ``postrl/<key>`` (postrl's own metrics inside that engine) become ``<key>`` and win over a translated value,
    ``postrl/alarm/*`` flags are dropped, every other key is kept as it is; a None of an engine in
    :data:`NONE_IS_NAN` is NaN."""
    if engine == "postrl":
        return dict(raw)
    if engine not in _READERS:
        _READERS[engine] = _compile(engine)
    exact, patterns = _READERS[engine]
    out: dict = {}
    own: dict = {}
    for k, v in raw.items():
        if k.startswith(POSTRL_PREFIX):
            if not k.startswith(POSTRL_PREFIX + "alarm/"):
                own[k[len(POSTRL_PREFIX):]] = v
            continue
        if v is None and engine in NONE_IS_NAN:
            v = math.nan
        a = exact.get(k)
        if a is not None:
            out.setdefault(a.key, _value(v, a.how))
            continue
        for rx, pa in patterns:
            g = rx.match(k)
            if g:
                key = pa.key
                for name, val in g.groupdict().items():
                    key = key.replace(f"<{name}>", val)
                out.setdefault(key, _value(v, pa.how))
                break
        else:
            out.setdefault(k, v)
    derive = DERIVED.get(engine)
    if derive is not None:
        derive(raw, out)
    out.update(own)
    return out


def names_for(engine: str, key: str) -> list[str]:
    """The names ``engine`` logs that are read as postrl's ``key``."""
    out = []
    for _, rows in SECTIONS.values():
        for m in rows:
            out += [a.name for a in m.aliases(engine) if a.key == key]
    if engine == "verl" and key == "zero_variance_groups/frac":
        out.append("critic/score/min = critic/score/max")
    return out


# ------------------------------------------------------------------------------------------------ fixes

FIXES: dict[str, dict[str, str]] = {
    "trl": {
        "nan_guard": "lower learning_rate{now:optim.lr}, keep max_grad_norm set{now:optim.max_grad_norm}, train in "
                     "bf16 or float32 rather than fp16",
        "nan_guard:reward": "fix the reward function (a TRL reward function's None means 'not applicable', a NaN "
                            "propagates)",
        "logprob_mismatch": "set disable_dropout=True, use the same dtype in vLLM and the trainer, and keep "
                            "vllm_importance_sampling_correction=True (truncated importance sampling; "
                            "vllm_importance_sampling_mode / vllm_importance_sampling_cap)",
        "filtered_sampling": "sample without the filter (top_p=1.0, top_k=0): TRL computes the trainer's log-probs "
                             "of the unfiltered distribution",
        "truncation": "raise max_completion_length{now:rollout.max_new_tokens}, set mask_truncated_completions=True "
                      "(truncated completions then leave the loss), add a stop sequence (generation_kwargs), or "
                      "warm-start with SFT (TRL's SFTTrainer) so the model learns to stop",
        "tool_errors": "read the failing calls (log_completions=True); state the tool's arguments in its docstring "
                       "(the schema the model sees), warm-start on correct calls (SFTTrainer), or fix the tool",
        "kl_blowup": "lower learning_rate{now:optim.lr}, raise beta{now:kl.coef}, use fewer num_iterations"
                     "{now:train.epochs}, or keep max_grad_norm set{now:optim.max_grad_norm}",
        "entropy_collapse": "raise the upper clip (epsilon_high=0.28, clip-higher as in DAPO), lower learning_rate"
                            "{now:optim.lr}, add an entropy bonus (entropy_coef > 0, or use_adaptive_entropy=True), "
                            "a KL term (beta{now:kl.coef}), or raise temperature{now:rollout.temperature}",
        "zero_variance_groups": "raise num_generations{now:rollout.group_size} or temperature"
                                "{now:rollout.temperature}, use a graded reward, and check the reward functions on "
                                "a few completions (`postrl probe-reward`); TRL trains on such groups with zero "
                                "advantage (there is no option to drop and refill them)",
        "zero_variance_groups:solved": "use harder prompts (filter the dataset by pass rate), or raise "
                                       "num_generations{now:rollout.group_size}",
        "zero_variance_groups:too_hard": "warm-start with SFT (SFTTrainer), use easier prompts, raise "
                                         "num_generations{now:rollout.group_size}",
        "length_drift:grow": "use a length-robust loss (loss_type='dr_grpo' or 'dapo'), set "
                             "mask_truncated_completions=True, add a length penalty reward function, and probe the "
                             "reward with a very long completion (`postrl probe-reward`)",
        "length_drift:shrink": "probe the reward with empty and short completions (`postrl probe-reward`), use "
                               "loss_type='dapo' (token mean), and read short completions (log_completions=True)",
        "clip_fractions": "lower learning_rate{now:optim.lr}, use fewer num_iterations{now:train.epochs} or "
                          "steps_per_generation{now:train.mini_batches}, or widen the clip range (epsilon"
                          "{now:loss.eps_low} / epsilon_high{now:loss.eps_high})",
        "echo_trap": "lower learning_rate{now:optim.lr}, tighten max_grad_norm{now:optim.max_grad_norm}, raise "
                     "epsilon_high, or add a KL term (beta{now:kl.coef})",
        "teacher_variance": "raise temperature{now:rollout.temperature} or num_generations{now:rollout.group_size}, "
                            "prefer a reward with more within-prompt variance, or mix in a verifiable reward",
        "length_reward_corr": "probe the reward with a very long completion (`postrl probe-reward`), add a length "
                              "penalty reward function, or normalise the reward by length",
    },
    "verl": {
        "nan_guard": "lower actor_rollout_ref.actor.optim.lr{now:optim.lr}, keep "
                     "actor_rollout_ref.actor.optim.clip_grad set{now:optim.max_grad_norm}, train in bf16 or float32 "
                     "rather than fp16",
        "nan_guard:reward": "fix the reward function (reward.custom_reward_function)",
        "logprob_mismatch": "correct the rollout / trainer gap with algorithm.rollout_correction.rollout_is=token "
                            "(rollout_is_threshold), use the same dtype in the rollout and the actor, check "
                            "actor_rollout_ref.rollout.temperature",
        "filtered_sampling": "sample without the filter (actor_rollout_ref.rollout.top_p=1.0, top_k=-1)",
        "truncation": "raise data.max_response_length{now:rollout.max_new_tokens} (actor_rollout_ref.rollout."
                      "response_length follows it), penalise overlong responses (DAPO's overlong buffer: "
                      "reward.reward_manager.name=dapo with +reward.reward_kwargs.overlong_buffer_cfg.enable=true, "
                      "its len and penalty_factor, and +reward.reward_kwargs.max_resp_len), or warm-start with SFT (verl's sft trainer)",
        "tool_errors": "read the failing calls in the rollout dumps (trainer.rollout_data_dir), state the tool's "
                       "arguments in its schema (actor_rollout_ref.rollout.multi_turn.tool_config_path), or fix the "
                       "tool",
        "kl_blowup": "lower actor_rollout_ref.actor.optim.lr{now:optim.lr}, raise actor_rollout_ref.actor."
                     "kl_loss_coef{now:kl.coef} (with actor_rollout_ref.actor.use_kl_loss=true) or "
                     "algorithm.kl_ctrl.kl_coef (algorithm.use_kl_in_reward=true), use fewer "
                     "actor_rollout_ref.actor.ppo_epochs{now:train.epochs}, keep "
                     "actor_rollout_ref.actor.optim.clip_grad set",
        "entropy_collapse": "raise the upper clip (actor_rollout_ref.actor.clip_ratio_high=0.28, clip-higher as in "
                            "DAPO), lower actor_rollout_ref.actor.optim.lr{now:optim.lr}, add an entropy bonus "
                            "(actor_rollout_ref.actor.entropy_coeff > 0), a KL loss (actor_rollout_ref.actor."
                            "use_kl_loss=true), or raise actor_rollout_ref.rollout.temperature"
                            "{now:rollout.temperature}",
        "zero_variance_groups": "drop such groups and sample more (DAPO's dynamic sampling, in verl's v1 trainer: "
                                "trainer.use_v1=true, algorithm.filter_groups.enable=true, "
                                "algorithm.filter_groups.metric=reward or a reward_extra_info key such as acc), raise "
                                "actor_rollout_ref.rollout.n{now:rollout.group_size} or "
                                "actor_rollout_ref.rollout.temperature{now:rollout.temperature}, or use a graded "
                                "reward",
        "zero_variance_groups:solved": "drop solved groups (algorithm.filter_groups.enable=true) and use harder "
                                       "prompts",
        "zero_variance_groups:too_hard": "warm-start with SFT, use easier prompts, raise actor_rollout_ref.rollout.n"
                                         "{now:rollout.group_size}, or drop them (algorithm.filter_groups.enable=true)",
        "length_drift:grow": "penalise overlong responses (reward.reward_manager.name=dapo with "
                             "+reward.reward_kwargs.overlong_buffer_cfg.enable=true), use "
                             "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm (Dr. GRPO) or "
                             "token-mean, and probe the reward with a very long completion (`postrl probe-reward`)",
        "length_drift:shrink": "probe the reward with empty and short completions (`postrl probe-reward`) and use "
                               "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "clip_fractions": "lower actor_rollout_ref.actor.optim.lr{now:optim.lr}, use fewer "
                          "actor_rollout_ref.actor.ppo_epochs{now:train.epochs} or a larger "
                          "actor_rollout_ref.actor.ppo_mini_batch_size (fewer mini-batches), or widen the clip range "
                          "(actor_rollout_ref.actor.clip_ratio_low / clip_ratio_high)",
        "echo_trap": "drop low-variance groups (algorithm.filter_groups.enable=true), lower "
                     "actor_rollout_ref.actor.optim.lr{now:optim.lr}, tighten actor_rollout_ref.actor.optim.clip_grad",
        "teacher_variance": "raise actor_rollout_ref.rollout.temperature{now:rollout.temperature} or "
                            "actor_rollout_ref.rollout.n{now:rollout.group_size}, or mix in a verifiable reward",
        "length_reward_corr": "probe the reward with a very long completion (`postrl probe-reward`) and penalise "
                              "length (reward.reward_manager.name=dapo, +reward.reward_kwargs.overlong_buffer_cfg)",
    },
}
"""engine -> alarm (``name`` or ``name:variant``) -> the fix in that engine's options. An alarm without an entry
keeps postrl's fix, said to be in postrl's options (the run logged postrl's own metrics, e.g. through the TRL
adapter or the verl plug-in, whose configs take them)."""

_NOW = re.compile(r"\{now:([\w.]+)\}")


def fill(template: str, get: Callable[[str], Any]) -> str:
    """``{now:KEY}`` -> " (now VALUE)" where ``get(KEY)`` knows the run's value, else nothing."""
    def now(m: re.Match) -> str:
        v = get(m.group(1))
        return "" if v is None else f" (now {v})"

    return _NOW.sub(now, template)


# ------------------------------------------------------------------------------------------------ the docs


def _cell(aliases: list[Alias], note: str) -> str:
    parts: list[str] = []
    prefix = None
    for a in aliases:
        if prefix is not None and a.name.startswith(prefix):
            parts.append(f"`/{a.name[len(prefix):]}`")
        else:
            parts.append(f"`{a.name}`")
            prefix = a.name.rsplit("/", 1)[0] + "/" if "/" in a.name else None
        if a.how == "1-x":
            parts[-1] = f"1 - {parts[-1]}"
    text = ", ".join(parts)
    if note:
        text = f"{text} {note}" if text else note
    return text or "-"


def names_table(section: str) -> str:
    """The markdown table of one section of :data:`SECTIONS`."""
    _, rows = SECTIONS[section]
    lines = ["| postrl key | meaning | TRL | verl |", "|---|---|---|---|"]
    for m in rows:
        left = m.show or ", ".join(f"`{k}`" for k in m.keys)
        lines.append(f"| {left} | {m.meaning} | {_cell(m.aliases('trl'), m.trl_note)} | "
                     f"{_cell(m.aliases('verl'), m.verl_note)} |")
    return "\n".join(lines)


def options_table() -> str:
    """The markdown table of :data:`OPTIONS`."""
    lines = ["| postrl key | TRL (`GRPOConfig`) | verl | note |", "|---|---|---|---|"]
    for o in OPTIONS:
        lines.append(f"| `{o.key}` | `{o.trl}` | `{o.verl}` | {o.note if o.note else ''}"
                     f"{'' if o.exact else (' ' if o.note else '') + '(name only: values differ)'} |")
    return "\n".join(lines)


def _begin(name: str) -> str:
    return f"<!-- generated: {name} (python -m postrl.diagnostics docs/metrics.md) -->"


END = "<!-- end generated -->"


def generated_blocks() -> dict[str, str]:
    """Every generated block of docs/metrics.md: 'names:<section>' and 'options'."""
    out = {f"names:{s}": names_table(s) for s in SECTIONS}
    out["options"] = options_table()
    return out


def update_doc(text: str) -> str:
    """``text`` with every generated block replaced by the current table (a block missing from ``text`` is an
    error: the doc must place each)."""
    for name, table in generated_blocks().items():
        begin = _begin(name)
        i = text.find(begin)
        if i < 0:
            raise ValueError(f"docs/metrics.md has no block '{begin}'")
        j = text.find(END, i)
        if j < 0:
            raise ValueError(f"block '{name}' has no '{END}'")
        text = text[:i] + begin + "\n" + table + "\n" + text[j:]
    return text


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m postrl.diagnostics docs/metrics.md", file=sys.stderr)
        return 2
    from pathlib import Path

    p = Path(args[0])
    p.write_text(update_doc(p.read_text()))
    print(f"wrote {p}")
    return 0


