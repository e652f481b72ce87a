"""Monitors: threshold alarms over the per-step metrics that name the symptom, the likely cause and the fix.

A monitor is a function ``check(history, ctx, params) -> Alarm | None`` over the metric rows seen so far
(``history[-1]`` is the current step) and the held-out evaluations (``ctx.evals``). It depends on nothing else,
so the same code runs live in the trainer and offline over a run directory (``postrl doctor``, ``postrl
report``) and gives the same alarms. :class:`Watchdog` applies each monitor's ``patience`` (consecutive steps
the condition must hold) and returns, per step, the alarms active at that step.

Monitors are listed in :data:`MONITORS` in diagnosis order: root causes (a non-finite loss, a sampler that
is not the trainer, truncated completions) before their symptoms (groups without signal, pass@k at zero).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from pydantic import BaseModel

from postrl.config.diagnostics import DiagnosticsConfig
from postrl.diagnostics import engines

SEVERITIES = ("error", "warn", "info")


@dataclass
class Alarm:
    """One alarm: ``message`` states the symptom with numbers, ``cause`` the likely cause, ``fix`` the config
    change that usually fixes it."""

    name: str
    message: str
    cause: str
    fix: str
    severity: str = "warn"
    step: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        return f"{self.name}: {self.message} - likely cause: {self.cause} - fix: {self.fix}"


@dataclass
class Context:
    """What monitors may read besides the metric history: the run's config (plain dict, as in config.yaml; for a run
    of another engine, the settings known of it under postrl's keys), the evaluations so far (eval.jsonl rows) and
    the engine that trained the run (``postrl``, ``trl``, ``verl``): an alarm names that engine's options
    (:meth:`opt`, :meth:`setting`) and proposes its fix (:meth:`fix`, from ``postrl.diagnostics.engines.FIXES``)."""

    config: dict
    evals: list[dict] = field(default_factory=list)
    engine: str = "postrl"

    def opt(self, key: str) -> str:
        """The engine's name of postrl config ``key`` (``rollout.max_new_tokens`` -> TRL's
        ``max_completion_length``)."""
        return engines.option(self.engine, key)

    def setting(self, key: str) -> str:
        """``name=value`` of postrl config ``key`` in the engine's names; the name alone when the value is not
        known."""
        v = self.get(key)
        return f"{self.opt(key)}={v}" if v is not None else self.opt(key)

    def fix(self, alarm: str, text: str) -> str:
        """The fix of ``alarm`` (``name`` or ``name:variant``): ``text`` (postrl's options) for a postrl run, else
        the engine's fix; an alarm the engine's table lacks keeps postrl's text, said to be postrl's options."""
        if self.engine == "postrl":
            return text
        table = engines.FIXES.get(self.engine, {})
        t = table.get(alarm) or table.get(alarm.split(":")[0])
        if t is None:
            return f"{text} (postrl's options: set them in the postrl config of postrl's " \
                   f"{engines.ENGINES.get(self.engine, self.engine)} integration)"
        return engines.fill(t, self.get)

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            else:
                return default
        return node


def _num(m: dict, key: str) -> float | None:
    v = m.get(key)
    if v is None or isinstance(v, bool):
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _series(h: list[dict], key: str) -> list[float]:
    return [v for v in (_num(m, key) for m in h) if v is not None]


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, 2, ... (per step)."""
    n = len(ys)
    if n < 2:
        return 0.0
    xm, ym = (n - 1) / 2, _avg(ys)
    return sum((i - xm) * (y - ym) for i, y in enumerate(ys)) / sum((i - xm) ** 2 for i in range(n))


def _trained(m: dict) -> bool:
    """False for a step where no completion had a finite reward (``valid`` = 0): nothing trained, so the update's
    statistics (entropy, ...) were not measured (the trainer logs them as 0) and no group has rewards to compare;
    the reward alarms (``reward_all_failed``, ``nan_guard``) name that step's cause."""
    v = _num(m, "valid")
    return v is None or v > 0.0


def _single(ctx: Context) -> bool:
    """One completion per prompt (``rollout.group_size`` = 1, PPO with a critic): every group is a single reward, so
    'groups with identical rewards' and within-group statistics say nothing."""
    g = ctx.get("rollout.group_size")
    return isinstance(g, int) and not isinstance(g, bool) and g == 1


def _pass_k_key(m: dict) -> str | None:
    ks = [k for k in m if k.startswith("pass@") and k != "pass@1" and k[5:].isdigit()]
    return max(ks, key=lambda k: int(k[5:])) if ks else None


# ------------------------------------------------------------------------------------------------- monitors


def zero_variance_groups(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    z = _num(cur, "zero_variance_groups/frac")
    if z is None or z < p.max_frac or not _trained(cur) or _single(ctx):
        return None
    ac, aw = _num(cur, "zero_variance_groups/all_correct"), _num(cur, "zero_variance_groups/all_wrong")
    G = ctx.get("rollout.group_size", "?")
    sd = _num(cur, "reward/std")
    head = f"{z:.0%} of groups have identical rewards"
    tail = ("; they get zero advantage, so most of the batch carries no learning signal")
    if aw is not None and ac is not None and ac > aw:
        return Alarm("zero_variance_groups", f"{head} ({ac:.0%} all correct, {aw:.0%} all wrong){tail}",
                     "the task is (nearly) solved: every sample of most prompts is correct",
                     ctx.fix("zero_variance_groups:solved", "use a harder task or a curriculum (filters: [{name: "
                             "pass_rate_curriculum}]), or drop solved groups (filters: [{name: dynamic_sampling}], "
                             "DAPO)"),
                     severity="info")
    if aw is not None:
        acc = _num(cur, "accuracy")
        return Alarm("zero_variance_groups",
                     f"{head} ({aw:.0%} all wrong, {ac or 0:.0%} all correct; accuracy {acc or 0:.2f}){tail}",
                     "the task is too hard for the current policy (every sample fails), or the reward never pays "
                     "(check truncation, and the reward with `postrl probe-reward`)",
                     ctx.fix("zero_variance_groups:too_hard",
                             f"warm-start with SFT (`postrl sft`), use an easier task or a curriculum, raise "
                             f"rollout.group_size (now {G}), drop all-wrong groups (filters: [{{name: "
                             f"dynamic_sampling}}], DAPO) or learn from them (advantage: {{name: rl_zvp}})"))
    same = f"; the batch's reward std is 0: every completion got reward {_num(cur, 'reward/mean') or 0:g}" \
        if sd == 0.0 and _num(cur, "reward/mean") is not None else ""
    return Alarm("zero_variance_groups", f"{head}{tail}{same}",
                 "the reward does not discriminate between the completions of a prompt (binary or saturated reward, "
                 "a constant reward function, or near-identical samples)",
                 ctx.fix("zero_variance_groups", f"raise rollout.group_size (now {G}) or rollout.temperature (now "
                         f"{ctx.get('rollout.temperature')}), or use a graded reward"))


def advantage_collapse(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    c = _num(cur, "advantages/collapse")
    if c is None or c < p.max_collapse:
        return None
    da, dr = _num(cur, "advantages/distinct_frac"), _num(cur, "rewards/distinct_frac")
    weights = ", ".join(f"{r.get('name')}={r.get('weight', 1.0)}" for r in ctx.get("rewards", []) or [])
    return Alarm("advantage_collapse",
                 f"the advantage merges {c:.0%} of the distinct reward combinations within groups (distinct "
                 f"advantages per group / G = {da or 0:.2f}, distinct reward vectors / G = {dr or 0:.2f}): "
                 f"completions that differ in their reward components get the same advantage",
                 "the rewards are summed before group normalisation, which maps different combinations to the same "
                 "total (GDPO's reward-combination collapse)",
                 ctx.fix("advantage_collapse", f"normalise each reward component separately before combining them "
                         f"(advantage: {{name: gdpo}}), or change the reward weights (now {weights}) so that "
                         f"different combinations get different totals"))


def truncation(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    t = _num(cur, "truncated/frac")
    if t is None or t < p.max_frac:
        return None
    L = ctx.get("rollout.max_new_tokens", "?")
    tr, fr = _num(cur, "truncated/reward_mean"), _num(cur, "finished/reward_mean")
    pay = f"their mean reward is {tr:.2f}" if tr is not None else "their rewards failed"
    pay += f" vs {fr:.2f} for finished ones" if fr is not None else " (no completion finished)"
    if "truncated/reward_mean" not in cur and "finished/reward_mean" not in cur:
        pay = ""  # another engine's run: it logs no reward per class
    return Alarm("truncation", f"{t:.0%} of completions truncated at {ctx.setting('rollout.max_new_tokens')}"
                 + (f"; {pay}" if pay else ""),
                 "completions need more tokens than allowed (or the policy never emits EOS): a truncated answer is "
                 "cut before it is complete and earns nothing",
                 ctx.fix("truncation", f"raise rollout.max_new_tokens (now {L}), add a stop string (rollout.stop), "
                         "warm-start with SFT so the model learns to stop, or penalise overlong completions (shaping: "
                         "overlong_soft)"))


def _env(ctx: Context) -> str:
    return str(ctx.get("environment.name", "?"))


def env_errors(h: list[dict], ctx: Context, p) -> Alarm | None:
    """Multi-turn runs: the environment's ``step`` raised at least ``max_per_episode`` times per episode."""
    e = _num(h[-1], "turns/env_errors")
    if e is None or e <= 0.0 or e < p.max_per_episode:
        return None
    return Alarm("env_errors", f"the environment '{_env(ctx)}' raised {e:.2f} times per episode (its episodes end "
                 f"there and their reward fails)",
                 "a bug in the environment's step, an action it does not handle, or a resource it cannot reach",
                 "run the environment on the logged completions (samples.jsonl) to see the exception, make step "
                 "handle any text (return an observation, or a reward of 0), or fix its parameters (environment.*)",
                 "error")


def tool_errors(h: list[dict], ctx: Context, p) -> Alarm | None:
    """Multi-turn runs: the fraction of executed tool calls that raised or timed out is >= ``max_frac``."""
    ok = _num(h[-1], "turns/tool_success")
    if ok is None or 1.0 - ok < p.max_frac:
        return None
    calls = _num(h[-1], "turns/tool_calls")
    per = f" ({calls:.2f} calls per episode)" if calls is not None else ""
    return Alarm("tool_errors", f"{1.0 - ok:.0%} of tool calls failed (raised or timed out){per}",
                 "the model passes arguments the tool rejects (it has not learned the tool's contract), or the tool "
                 "is too slow for its timeout or broken",
                 ctx.fix("tool_errors", "read the failing calls in samples.jsonl; warm-start on demonstrations of "
                         "correct calls (sft), state the tool's arguments in its docstring (the schema the model "
                         "sees), raise the environment's timeout, or fix the tool"))


def turn_truncation(h: list[dict], ctx: Context, p) -> Alarm | None:
    """Multi-turn runs: at least ``max_frac`` of model turns hit the per-turn token limit."""
    t = _num(h[-1], "turns/truncated_turns")
    if t is None or t < p.max_frac:
        return None
    L, T = ctx.get("rollout.max_new_tokens", "?"), ctx.get("environment.max_total_tokens", "?")
    return Alarm("turn_truncation", f"{t:.0%} of model turns truncated ({ctx.setting('rollout.max_new_tokens')} "
                 f"per turn, environment.max_total_tokens={T} per episode)",
                 "turns need more tokens than allowed, or the policy never ends a turn: a cut tool call is "
                 "malformed and a cut answer earns nothing",
                 f"raise rollout.max_new_tokens (now {L}) or environment.max_total_tokens (now {T}), add a stop "
                 "string (rollout.stop), or warm-start with SFT so the model ends its turns")


def malformed_calls(h: list[dict], ctx: Context, p) -> Alarm | None:
    """Multi-turn runs: malformed tool calls per episode reach ``max_per_episode``."""
    m = _num(h[-1], "turns/malformed_calls")
    if m is None or m <= 0.0 or m < p.max_per_episode:
        return None
    return Alarm("malformed_calls", f"{m:.2f} malformed tool calls per episode (unparsable, unknown tool, bad "
                 f"arguments or unclosed tag) in environment '{_env(ctx)}'",
                 "the model does not produce the tool-call format the environment parses (the chat template's "
                 "format, or <tool_call>name(args)</tool_call>), or its calls are cut by the token limit",
                 "warm-start on demonstrations of well-formed calls (sft), check that the chat template shows the "
                 "tools (model.chat_template), or penalise malformed calls in the environment's reward")


def entropy_collapse(h: list[dict], ctx: Context, p) -> Alarm | None:
    if not _trained(h[-1]):
        return None
    h = [m for m in h if _trained(m)]  # a step where nothing trained measured no entropy (nor the baseline)
    ent = _series(h, "entropy")
    e = _num(h[-1], "entropy")
    if e is None or not ent:
        return None
    base = _avg(ent[:p.window])
    low = e < p.min_entropy
    drop = len(ent) > p.window and base > 0 and e < (1.0 - p.max_drop) * base
    if not (low or drop):
        return None
    lp = _series(h, "tokens/low_prob_frac")
    lp_txt = f"; low-probability tokens {lp[-1]:.1%} of samples (was {_avg(lp[:p.window]):.1%})" if lp else ""
    recent = ent[-p.window:]
    slope = _slope(recent)
    slope_txt = f", slope {slope:+.4f} nats/step over the last {len(recent)} steps" if len(recent) > 1 else ""
    return Alarm("entropy_collapse",
                 f"token entropy {e:.4f} nats (mean {base:.3f} over the first {min(p.window, len(ent))} steps, "
                 f"{(e - base) / base:+.0%}{slope_txt}){lp_txt}" if base > 0 else f"token entropy {e:.4f} nats{lp_txt}",
                 "the policy has become near-deterministic: exploration collapsed, so the samples of a prompt stop "
                 "differing and the learning signal goes with them",
                 ctx.fix("entropy_collapse", f"raise the upper clip (loss.eps_high=0.28, clip-higher as in DAPO), "
                         f"lower optim.lr (now {ctx.get('optim.lr')}), add an entropy term (regularizers: [{{name: "
                         f"entropy_bonus}}] or adaptive_entropy) or a KL term (kl.coef, now {ctx.get('kl.coef')}), or "
                         f"raise rollout.temperature (now {ctx.get('rollout.temperature')})"))


def length_drift(h: list[dict], ctx: Context, p) -> Alarm | None:
    lens = _series(h, "length/mean")
    if len(lens) < 2 * p.window:
        return None
    first, last = _avg(lens[:p.window]), _avg(lens[-p.window:])
    if first <= 0:
        return None
    change = last / first - 1.0
    L = ctx.get("rollout.max_new_tokens")
    if change > p.max_growth and last - first >= p.min_tokens:
        of = f" ({last / L:.0%} of {ctx.setting('rollout.max_new_tokens')})" if isinstance(L, (int, float)) and L \
            else ""
        return Alarm("length_drift",
                     f"mean completion length grew {first:.1f} -> {last:.1f} tokens ({change:+.0%}) between the first "
                     f"and the last {p.window} steps{of}",
                     "the reward or the loss favours longer completions (length hacking; with token-mean "
                     "aggregation a long wrong answer is penalised less per token)",
                     ctx.fix("length_drift:grow", "add length control to the shaping (overlong_soft, "
                             "cosine_length, laser), use loss.agg=seq_mean_token_sum or dr_grpo, and probe the reward "
                             "with a very long completion (`postrl probe-reward`)"))
    if -change > p.max_shrink and first - last >= p.min_tokens:
        return Alarm("length_drift",
                     f"mean completion length fell {first:.1f} -> {last:.1f} tokens ({change:+.0%}) between the first "
                     f"and the last {p.window} steps",
                     "the reward favours short completions or the policy learned to stop early (with sequence-mean "
                     "aggregation short wrong answers are penalised more per token)",
                     ctx.fix("length_drift:shrink", "probe the reward with empty and short completions (`postrl "
                             "probe-reward`), use loss.agg=token_mean, and read short samples with `postrl samples "
                             "RUN`"))
    return None


def length_reward_corr(h: list[dict], ctx: Context, p) -> Alarm | None:
    c = _num(h[-1], "length/reward_corr")
    if c is None or c < p.max_corr:
        return None
    return Alarm("length_reward_corr",
                 f"within-group correlation of reward with completion length is {c:+.2f} (mean length "
                 f"{_num(h[-1], 'length/mean') or 0:.1f}): for the same prompt, longer completions are paid more",
                 "the reward pays for length (a verbosity bias of a reward model or rubric); RL will inflate the "
                 "length rather than the quality ('A Long Way to Go')",
                 ctx.fix("length_reward_corr", "probe the reward with a very long completion (`postrl "
                         "probe-reward`), add length-controlled shaping (cosine_length, overlong_soft, kimi_length), "
                         "or normalise the reward by length"))


def _proxy_is_gold(ctx: Context) -> bool:
    """The run's only weighted reward is the gold measure itself: the verifier (``correct``), or the environment's
    reward (``environment``), which is what a multi-turn run's held-out episodes are scored by."""
    rewards = [r for r in (ctx.get("rewards", []) or []) if float(r.get("weight", 1.0)) != 0.0]
    return len(rewards) == 1 and rewards[0].get("name") in ("correct", "environment")


def _gold_could_rise(g0: float, g1: float, p) -> bool:
    """False when the gold started at its ceiling (within ``max_gold_rise`` of 1: no room to rise) and held there:
    a flat gold is then no evidence of hacking. A gold that fell (by more than ``max_gold_rise``) always counts."""
    return g0 < 1.0 - p.max_gold_rise or g1 < g0 - p.max_gold_rise


def proxy_gold_gap(h: list[dict], ctx: Context, p) -> Alarm | None:
    if _proxy_is_gold(ctx):
        return None
    proxy = _series(h, "reward/mean")
    w = p.window
    cause = ("the policy raises the proxy reward in ways the gold measure does not reward: reward hacking / "
             "over-optimisation (Goodhart; 'Scaling Laws for Reward Model Overoptimization')")
    fix = ("probe the reward for exploits (`postrl probe-reward`), raise the weight of the verifiable reward, add "
           f"a KL term (kl.coef, now {ctx.get('kl.coef')}), or keep an earlier checkpoint (before the gap opened)")
    gold = _series(h, "accuracy")
    if len(proxy) >= 2 * w and len(gold) >= 2 * w:
        p0, p1 = _avg(proxy[:w]), _avg(proxy[-w:])
        g0, g1 = _avg(gold[:w]), _avg(gold[-w:])
        if p1 - p0 >= p.min_proxy_rise and g1 - g0 <= p.max_gold_rise and _gold_could_rise(g0, g1, p):
            return Alarm("proxy_gold_gap",
                         f"training reward rose {p0:.2f} -> {p1:.2f} ({p1 - p0:+.2f}) while verifier accuracy went "
                         f"{g0:.2f} -> {g1:.2f} ({g1 - g0:+.2f}) (first vs last {w} steps)", cause, fix)
    a = eval_gap(h, ctx, p)
    return a


def eval_gap(h: list[dict], ctx: Context, p) -> Alarm | None:
    """proxy_gold_gap against the held-out evaluations (eval.jsonl): the gold is held-out accuracy."""
    if _proxy_is_gold(ctx) or len(ctx.evals) < 2:
        return None
    e0, e1 = ctx.evals[0], ctx.evals[-1]
    a0, a1 = _num(e0, "accuracy"), _num(e1, "accuracy")
    s1 = int(e1.get("step", 0))
    proxy = [(int(m.get("step", 0)), _num(m, "reward/mean")) for m in h]
    proxy = [(s, v) for s, v in proxy if v is not None and s <= max(s1, 1)]
    if a0 is None or a1 is None or len(proxy) < 2 * p.window:
        return None
    p0 = _avg([v for _, v in proxy[:p.window]])
    p1 = _avg([v for _, v in proxy[-p.window:]])
    if p1 - p0 >= p.min_proxy_rise and a1 - a0 <= p.max_gold_rise and _gold_could_rise(a0, a1, p):
        return Alarm("proxy_gold_gap",
                     f"training reward rose {p0:.2f} -> {p1:.2f} ({p1 - p0:+.2f}) while held-out accuracy went "
                     f"{a0:.2f} -> {a1:.2f} ({a1 - a0:+.2f}) (evaluations at steps {e0.get('step', 0)} and {s1})",
                     "the policy raises the proxy reward in ways the held-out verifier does not reward: reward "
                     "hacking / over-optimisation (Goodhart; 'Scaling Laws for Reward Model Overoptimization')",
                     "probe the reward for exploits (`postrl probe-reward`), raise the weight of the verifiable "
                     f"reward, add a KL term (kl.coef, now {ctx.get('kl.coef')}), or keep an earlier checkpoint")
    return None


def kl_blowup(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    parts = []
    kls = _series(h, "kl")
    if _num(cur, "kl") is not None:
        # the mean of the last `smooth` steps: one step's KL estimate on a small batch is noisy (healthy runs of
        # scripts/alarm_rates.py had single steps at 5x their neighbours, 0.05 -> 0.25 -> 0.06)
        n = p.smooth
        kl = _avg(kls[-n:])
        over = f"mean of the last {min(n, len(kls))} steps " if n > 1 and len(kls) > 1 else ""
        # the growth's base: the same mean `window` steps earlier, over steps after the first (where the policy is
        # the reference: the KL is 0 by construction, and the first updates' KL is small against any later one)
        base = _avg(kls[-p.window - n:-p.window]) if len(kls) > p.window + n else 0.0
        if kl > p.max_kl:
            parts.append(f"KL to the reference {kl:.3f} nats/token ({over}now {kls[-1]:.3f}) > {p.max_kl} "
                         f"({ctx.setting('kl.coef')})" if over else
                         f"KL to the reference {kl:.3f} nats/token > {p.max_kl} ({ctx.setting('kl.coef')})")
        elif base > 0 and kl > p.max_kl / 4 and kl / base > p.max_growth:
            parts.append(f"KL to the reference grew {base:.4f} -> {kl:.4f} in {p.window} steps"
                         + (f" (means of {n} steps)" if n > 1 else ""))
    rmax = _num(cur, "ratio/max")
    if rmax is None:
        rmax = _num(cur, "ratio_max")
    if rmax is not None and rmax > p.max_ratio:
        parts.append(f"largest token ratio pi/pi_old {rmax:.1f} > {p.max_ratio}")
    pk = _num(cur, "ppo_kl")
    if pk is not None and pk > p.max_ppo_kl:
        parts.append(f"KL between the policy before and during the update {pk:.3f} > {p.max_ppo_kl}")
    if not parts:
        return None
    return Alarm("kl_blowup", "; ".join(parts),
                 "the policy moves too far per step (large learning rate, many epochs) or drifts away from the "
                 "reference without enough KL pressure",
                 ctx.fix("kl_blowup", f"lower optim.lr (now {ctx.get('optim.lr')}), raise kl.coef (now "
                         f"{ctx.get('kl.coef')}), use fewer train.epochs (now {ctx.get('train.epochs')}), or keep "
                         f"optim.max_grad_norm set"))


def reward_all_failed(h: list[dict], ctx: Context, p) -> Alarm | None:
    """Every reward source whose ``reward/<name>/failure_rate`` this step is at least ``min_rate`` (default 1.0:
    it failed on every completion), named with its first failing input (``reward/<name>/first_failure``, a string
    the trainer adds to the row) when the row has it. Fires at the first such step (patience 1)."""
    cur = h[-1]
    dead = []
    for k in cur:
        if k.startswith("reward/") and k.endswith("/failure_rate"):
            v = _num(cur, k)
            if v is not None and v >= p.min_rate:
                dead.append((k[len("reward/"):-len("/failure_rate")], v))
    if not dead:
        return None
    step = int(cur.get("step", len(h)))
    parts = []
    for name, v in dead:
        first = cur.get(f"reward/{name}/first_failure")
        parts.append(f"reward '{name}' failed on {v:.0%} of the completions at step {step}"
                     + (f" (first failing input: {first})" if isinstance(first, str) and first else ""))
    return Alarm("reward_all_failed", "; ".join(parts) + ": none of them reaches the advantage, the reward gives "
                 "no learning signal",
                 "the reward function raises (or returns None / NaN) on every input: a bug, a column it expects "
                 "that the data does not have (e.g. answer), a wrong verifier for the task, or an unreachable "
                 "service (judge, sandbox)",
                 "run it on a few completions (`postrl probe-reward`), fix the function or the data columns; "
                 "reward.strict=true stops the run at the first failing input", severity="error")


def nan_guard(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    step = int(cur.get("step", 0))
    skipped = _num(cur, "nan_guard/skipped") or 0.0
    if skipped > 0:
        total = _num(cur, "nan_guard/skipped_total") or skipped
        saved = cur.get("nan_guard/saved")
        where = f"; the batch is saved in {saved}" if saved else ""
        return Alarm("nan_guard",
                     f"{skipped:.0f} optimizer step(s) skipped at step {step} because the gradient norm was "
                     f"non-finite ({total:.0f} skipped so far){where}",
                     "a non-finite loss: an exploding update (learning rate), overflow in float16, or an inf/NaN "
                     "value reaching the loss",
                     ctx.fix("nan_guard", f"lower optim.lr (now {ctx.get('optim.lr')}), keep optim.max_grad_norm "
                             f"set (now {ctx.get('optim.max_grad_norm')}), use model.dtype=float32 or bfloat16 rather "
                             "than float16; inspect the saved batch with torch.load"), severity="error")
    bad = [k for k in ("reward/mean", "pg_loss", "entropy", "grad_norm") if k in cur and _num(cur, k) is None
           and cur[k] is not None]
    if bad == ["reward/mean"]:  # the model's metrics are finite: no completion got a finite reward
        return Alarm("nan_guard", f"non-finite metric(s) at step {step}: reward/mean: no completion got a finite "
                     f"reward, so none carries a learning signal",
                     "every reward function failed (raised, or returned None / NaN) on every completion",
                     ctx.fix("nan_guard:reward", "fix the reward functions (reward/<name>/failures; run them on a few "
                             "completions with `postrl probe-reward`)"), severity="error")
    if bad:
        return Alarm("nan_guard", f"non-finite metric(s) at step {step}: {', '.join(bad)}",
                     "every reward failed (reward/mean), or the model's outputs overflowed",
                     ctx.fix("nan_guard", "check the reward functions (reward/<name>/failures) and lower optim.lr"),
                     severity="error")
    limit = float(ctx.get("reward.alarm_rate", 0.1))
    for k, v in cur.items():
        if k.startswith("reward/") and k.endswith("/failure_rate") and isinstance(v, (int, float)) and v > limit:
            name = k[len("reward/"):-len("/failure_rate")]
            n = _num(cur, f"reward/{name}/failures") or 0
            return Alarm("nan_guard",
                         f"reward '{name}' failed (raised, or returned None/NaN) on {n:.0f} completions ({v:.0%}) at "
                         f"step {step} (reward.alarm_rate={limit:g}): they are excluded from the advantage",
                         "a bug or an unhandled input in the reward function (the first failing input is printed "
                         "in the console)",
                         ctx.fix("nan_guard:reward", "fix the reward function; read the failing completions with "
                                 "`postrl samples RUN`"))
    return None


def clip_fractions(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    lo, hi = _num(cur, "clip_low"), _num(cur, "clip_high")
    low, high = lo or 0.0, hi or 0.0
    dual = _num(cur, "clip_dual") or 0.0
    split = lo is not None or hi is not None
    region = low + high if split else _num(cur, "clip_region")  # another engine may log only the sum (verl)
    if region is None or region <= p.max_clip:
        return None
    side = ""
    if split and high > 3 * max(low, 1e-9):
        side = "; mostly positive-advantage tokens hitting the upper clip (exploration is capped)"
    elif split and low > 3 * max(high, 1e-9):
        side = "; mostly negative-advantage tokens hitting the lower clip"
    parts = f" (low, A<0: {low:.1%}; high, A>0: {high:.1%}; dual: {dual:.1%})" if split else \
        (f" (dual-clip: {dual:.1%})" if "clip_dual" in cur else "")
    with_ = ", ".join(ctx.setting(k) for k in ("train.epochs", "train.mini_batches")
                      if ctx.get(k) is not None or ctx.engine == "postrl")
    return Alarm("clip_fractions",
                 f"{region:.0%} of tokens clipped{parts}" + (f" with {with_}" if with_ else "") + side,
                 "the policy leaves the trust region within one batch: later epochs / mini-batches are mostly "
                 "clipped, wasted updates",
                 ctx.fix("clip_fractions", f"lower optim.lr (now {ctx.get('optim.lr')}), use fewer train.epochs or "
                         f"train.mini_batches, or widen the clip range (loss.eps_low / loss.eps_high; clip-higher for "
                         f"the upper side)"))


def logprob_mismatch(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    d = _num(cur, "mismatch/logp_abs_mean")
    if d is None or d <= p.max_abs:
        return None
    mx, kl = _num(cur, "mismatch/logp_abs_max"), _num(cur, "mismatch/kl")
    return Alarm("logprob_mismatch",
                 f"sampler and trainer log-probs of the same tokens differ by {d:.3f} nats on average (max "
                 f"{mx or 0:.2f}, KL {kl or 0:.4f}) before any update: the batch is off-policy",
                 "the sampling program's policy is not the trainer's: dropout active in the trainer's forward, a "
                 "different dtype or kernel (vLLM bf16 vs trainer fp32), stale sampler weights, or a "
                 "temperature / logits-processing mismatch",
                 ctx.fix("logprob_mismatch", f"disable dropout in the model config (attention_dropout / "
                         f"hidden_dropout = 0), use the same model.dtype (now {ctx.get('model.dtype')}) in sampler and "
                         f"trainer, check rollout.temperature; correct a remaining gap with truncated importance "
                         f"sampling (loss.tis.level=token, now {ctx.get('loss.tis.level', 'none')})"))


def filtered_sampling(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    kept = _num(cur, "sampler/kept_mass_mean")
    if kept is None or kept >= p.min_kept_mass or ctx.get("rollout.logprobs", "full") == "filtered":
        return None
    seq = _num(cur, "sampler/kept_logmass_seq")
    return Alarm("filtered_sampling",
                 f"top-p / top-k kept {kept:.3f} of the probability mass per sampled token on average (log-mass "
                 f"{seq or 0:.2f} per completion) while sampler and trainer log-probs are of the unfiltered "
                 f"distribution: the importance ratio is off by log(kept mass) per token",
                 f"the tokens are drawn from the filtered, renormalised distribution ({ctx.setting('rollout.top_p')}, "
                 f"{ctx.setting('rollout.top_k')}) but the ratio treats them as samples of the full policy, a known "
                 "cause of collapse in TRL / vLLM runs with top_p < 1",
                 ctx.fix("filtered_sampling", "set rollout.logprobs=filtered (sampler and trainer then use the "
                         "renormalised filtered distribution), or sample without the filter (rollout.top_p=1.0, "
                         "rollout.top_k=0)"))


def echo_trap(h: list[dict], ctx: Context, p) -> Alarm | None:
    if len(h) < p.window:
        return None
    win = h[-p.window:]
    stds = [_num(m, "reward/group_std") for m in win]
    s = stds[-1]
    prev = [x for x in stds[:-1] if x is not None]
    if s is None or not prev:
        return None
    peak = max(prev)
    if peak < p.min_peak_std or s > p.max_std_ratio * peak:
        return None
    gns = [_num(m, "grad_norm") for m in win]
    recent = [g for g in gns[-3:] if g is not None]
    base = [g for g in gns[:-3] if g is not None]
    if not recent or not base:
        return None
    med = statistics.median(base)
    g = max(recent)
    if med <= 0 or g < p.spike * med:
        return None
    return Alarm("echo_trap",
                 f"within-group reward std fell {peak:.3f} -> {s:.3f} ({s / peak:.0%} of its peak) within "
                 f"{p.window} steps while the grad norm spiked to {g:.2f} ({g / med:.1f}x its median {med:.2f})",
                 "Echo Trap (RAGEN): the policy collapsed onto a few repeated outputs; rewards stop varying "
                 "within groups and gradients spike",
                 ctx.fix("echo_trap", f"keep only high-variance groups (filters: [{{name: dynamic_sampling}}] or "
                         f"range_filter; RAGEN StarPO-S), lower optim.lr (now {ctx.get('optim.lr')}), tighten "
                         f"optim.max_grad_norm (now {ctx.get('optim.max_grad_norm')}), raise the upper clip, or add a "
                         f"KL term"))


def edge_of_stability(h: list[dict], ctx: Context, p) -> Alarm | None:
    measured = [m for m in h if _num(m, "stability/sharpness") is not None][-p.measurements:]
    if len(measured) < p.measurements:
        return None
    for m in measured:  # the last `measurements` measurements must all be above
        s, thr = _num(m, "stability/sharpness"), _num(m, "stability/threshold")
        if thr is None or thr <= 0 or s / thr < p.max_ratio:
            return None
    last = measured[-1]
    s, thr = _num(last, "stability/sharpness"), _num(last, "stability/threshold")
    lr = _num(last, "stability/lr") or ctx.get("optim.lr")
    if last.get("stability/preconditioned"):
        b1 = (ctx.get("optim.betas") or [0.9])[0]
        what = (f"preconditioned sharpness {s:.4g} = {s / thr:.1f} x the Adam stability threshold "
                f"(2+2*beta1)/((1-beta1)*lr) = {thr:.4g} (beta1={b1}, lr={lr:g})")
    else:
        what = f"sharpness {s:.4g} = {s / thr:.1f} x the stability threshold 2/lr = {thr:.4g} (lr={lr:g})"
    steps = ", ".join(str(m.get("step")) for m in measured)
    return Alarm("edge_of_stability",
                 f"{what} at step {last.get('step')}; above {p.max_ratio:g} x the threshold at steps {steps}",
                 "the optimizer is at or past the edge of stability: along the sharpest direction each step "
                 "overshoots, so the loss oscillates or spikes (Cohen et al. 2022, arXiv:2207.14484)",
                 ctx.fix("edge_of_stability", f"lower optim.lr (now {ctx.get('optim.lr')}), add "
                         f"optim.warmup_steps (now {ctx.get('optim.warmup_steps')}), keep optim.max_grad_norm set"))


def pass_at_k(h: list[dict], ctx: Context, p) -> Alarm | None:
    cur = h[-1]
    key = _pass_k_key(cur)
    if key is not None:
        v = _num(cur, key)
        if v is not None and v <= p.min_pass_at_k:
            return Alarm("pass_at_k",
                         f"training {key} = {v:.2f}: no group has a correct completion among its {key[5:]} samples",
                         "the task is beyond the policy at this temperature (or the verifier rejects the answer "
                         "format): RL has nothing to reinforce",
                         ctx.fix("pass_at_k", f"warm-start with SFT (`postrl sft`), use an easier task, raise "
                                 f"rollout.group_size (now {ctx.get('rollout.group_size')}), and check the verifier "
                                 f"with `postrl probe-reward`"))
        p1s, pks = _series(h, "pass@1"), _series(h, key)
        w = p.window
        if len(p1s) >= 2 * w and len(pks) >= 2 * w:
            a0, a1, k0, k1 = _avg(p1s[:w]), _avg(p1s[-w:]), _avg(pks[:w]), _avg(pks[-w:])
            if a1 > a0 and k0 - k1 >= p.max_narrowing:
                return _narrowing(f"training pass@1 rose {a0:.2f} -> {a1:.2f} while {key} fell {k0:.2f} -> {k1:.2f}",
                                  ctx)
    if len(ctx.evals) >= 2:
        e0, e1 = ctx.evals[0], ctx.evals[-1]
        ek = _pass_k_key(e1)
        if ek and ek in e0:
            a0, a1 = _num(e0, "pass@1"), _num(e1, "pass@1")
            k0, k1 = _num(e0, ek), _num(e1, ek)
            if None not in (a0, a1, k0, k1) and a1 >= a0 and k0 - k1 >= p.max_narrowing:
                return _narrowing(f"held-out pass@1 went {a0:.2f} -> {a1:.2f} while {ek} fell {k0:.2f} -> {k1:.2f}",
                                  ctx)
    return None


def teacher_variance(h: list[dict], ctx: Context, p) -> Alarm | None:
    """Low within-prompt reward variance under the current policy: a flat objective however accurate the reward
    ("What Makes a Reward Model a Good Teacher? An Optimization Perspective")."""
    cur = h[-1]
    gs, sd = _num(cur, "reward/group_std"), _num(cur, "reward/std")
    zv = _num(cur, "zero_variance_groups/frac")
    if _single(ctx):
        return None
    if gs is None or (zv is not None and zv >= ctx.get("diagnostics.zero_variance_groups.max_frac", 0.8)):
        return None  # identical rewards in most groups: zero_variance_groups names that cause
    low = gs < p.min_std
    share = gs / sd if sd is not None and sd > 0 else None
    if not low and (share is None or share >= p.min_share):
        return None
    what = f"mean within-prompt reward std {gs:.4g}" + (f" ({share:.0%} of the batch reward std {sd:.4g})"
                                                         if share is not None else "")
    return Alarm("teacher_variance",
                 f"{what}: the reward hardly varies among the completions of a prompt, so the policy-gradient "
                 f"objective is flat in every direction the policy can move",
                 "the reward model induces low reward variance for this policy ('What Makes a Reward Model a Good "
                 "Teacher?'): an accurate reward can still teach slowly; a reward that mostly scores the prompt "
                 "(difficulty, topic) gives no within-prompt signal",
                 ctx.fix("teacher_variance", f"measure it before training (`postrl rm eval --samples "
                         f"<completions.jsonl>`, teacher/variance), prefer a reward model with higher within-prompt "
                         f"variance for this policy, raise rollout.temperature (now {ctx.get('rollout.temperature')}) "
                         f"or rollout.group_size (now {ctx.get('rollout.group_size')}), or mix in a verifiable reward"))


INTRINSIC_REWARDS = ("majority_vote", "co_reward", "novelty")


def _label_free(ctx: Context) -> bool:
    """Every reward that trains (weight != 0) is intrinsic; a weight-0 reward is only logged (a verifier kept as the
    gold column, which gives the run its ``accuracy`` curve) and does not make the run supervised."""
    specs = [r for r in ctx.get("rewards", []) or [] if isinstance(r, dict)]
    names = [r.get("name") for r in specs if r.get("weight", 1.0) != 0]
    return bool(names) and all(n in INTRINSIC_REWARDS for n in names)


def intrinsic_collapse(h: list[dict], ctx: Context, p) -> Alarm | None:
    """Model collapse of a label-free run ("How Far Can Unsupervised RLVR Scale LLM Training?"): intrinsic rewards
    sharpen the initial distribution; the reward saturates (the policy agrees with itself) and, where a verifier
    column exists, accuracy rises then falls. The message names the model collapse step."""
    if not _label_free(ctx):
        return None

    def saturated(m: dict) -> bool:
        r, gs = _num(m, "reward/mean"), _num(m, "reward/group_std")
        return r is not None and gs is not None and r >= p.saturation and gs <= p.max_group_std

    step = lambda m, i: int(m.get("step", i + 1))  # noqa: E731
    if saturated(h[-1]):
        first = len(h) - 1
        while first > 0 and saturated(h[first - 1]):
            first -= 1
        return Alarm("intrinsic_collapse",
                     f"the intrinsic reward saturated (mean {_num(h[-1], 'reward/mean'):.3f}, within-group std "
                     f"{_num(h[-1], 'reward/group_std'):.3f}) since step {step(h[first], first)}, the model collapse "
                     f"step: every completion agrees with the policy's own consensus and no signal is left",
                     "label-free rewards only sharpen the initial distribution; once it is sharp, training can only "
                     "reinforce the consensus, right or wrong ('How Far Can Unsupervised RLVR Scale LLM Training?')",
                     "stop here (keep the checkpoint before the collapse step), add a verifiable or external reward, "
                     "use more diverse data or a cross-paraphrase reward (rewards: [{name: co_reward}])")
    acc = [(i, _num(m, "accuracy")) for i, m in enumerate(h)]
    acc = [(i, a) for i, a in acc if a is not None]
    if len(acc) < 2 * p.window:
        return None
    means = [(acc[j + p.window - 1][0], _avg([a for _, a in acc[j:j + p.window]]))
             for j in range(len(acc) - p.window + 1)]
    peak_i, peak = max(means, key=lambda x: x[1])
    now = means[-1][1]
    rw = _series(h[peak_i:], "reward/mean")
    if peak - now < p.max_drop or not rw or rw[-1] < rw[0]:
        return None
    return Alarm("intrinsic_collapse",
                 f"verifier accuracy fell from {peak:.3f} (window mean at step {step(h[peak_i], peak_i)}, the model "
                 f"collapse step) to {now:.3f} while the intrinsic reward kept rising ({rw[0]:.3f} -> {rw[-1]:.3f})",
                 "rise-then-fall of intrinsic rewards: the policy's confidence no longer aligns with correctness, "
                 "and sharpening now reinforces wrong consensus ('How Far Can Unsupervised RLVR Scale LLM Training?')",
                 "stop and keep the checkpoint at the collapse step, or switch to an external / verifiable reward")


def _narrowing(what: str, ctx: Context) -> Alarm:
    return Alarm("pass_at_k", f"{what}: RL sharpens onto fewer solutions and coverage shrinks",
                 "exploration collapse: probability mass concentrates on answers already found ('Does RL really "
                 "incentivize reasoning capacity beyond the base model?', Yue et al. 2025)",
                 f"optimise pass@k directly (advantage: {{name: pass_at_k}}), raise the upper clip (loss.eps_high) or "
                 f"rollout.temperature (now {ctx.get('rollout.temperature')}), or add an entropy term; stop earlier "
                 "if pass@k matters more than pass@1")


@dataclass(frozen=True)
class MonitorSpec:
    """A monitor: its name (the ``diagnostics.<name>`` section), function, what it watches, and ``reads``: the
    metrics it needs, every entry required, ``a|b`` either of them, ``*`` any path segment(s) (a run that logs none
    of an entry cannot raise the alarm: :func:`unread`)."""

    name: str
    fn: Callable
    what: str
    reads: tuple[str, ...] = ()


MONITORS: list[MonitorSpec] = [  # diagnosis order: root causes first
    MonitorSpec("reward_all_failed", reward_all_failed, "a reward source failing on every completion of a step",
                ("reward/*/failure_rate",)),
    MonitorSpec("nan_guard", nan_guard, "non-finite loss / gradient (step skipped, batch saved); failing rewards",
                ("nan_guard/skipped|reward/mean|pg_loss|entropy|grad_norm|reward/*/failure_rate",)),
    MonitorSpec("filtered_sampling", filtered_sampling, "top-p / top-k kept mass with unfiltered log-probs",
                ("sampler/kept_mass_mean",)),
    MonitorSpec("logprob_mismatch", logprob_mismatch, "sampler vs trainer log-prob difference",
                ("mismatch/logp_abs_mean",)),
    MonitorSpec("truncation", truncation, "fraction of completions hitting rollout.max_new_tokens",
                ("truncated/frac",)),
    MonitorSpec("env_errors", env_errors, "multi-turn: environment step failures per episode", ("turns/env_errors",)),
    MonitorSpec("tool_errors", tool_errors, "multi-turn: fraction of tool calls that raised or timed out",
                ("turns/tool_success",)),
    MonitorSpec("turn_truncation", turn_truncation, "multi-turn: fraction of model turns hitting the token limit",
                ("turns/truncated_turns",)),
    MonitorSpec("malformed_calls", malformed_calls, "multi-turn: malformed tool calls per episode",
                ("turns/malformed_calls",)),
    MonitorSpec("edge_of_stability", edge_of_stability, "top Hessian eigenvalue vs 2/lr (Adam: 38/lr)",
                ("stability/sharpness",)),
    MonitorSpec("kl_blowup", kl_blowup, "KL to the reference, token-ratio and policy-KL extremes",
                ("kl|ratio/max|ratio_max|ppo_kl",)),
    MonitorSpec("echo_trap", echo_trap, "reward-variance cliff together with a grad-norm spike (RAGEN)",
                ("reward/group_std", "grad_norm")),
    MonitorSpec("entropy_collapse", entropy_collapse, "entropy level and drop; low-probability-token rate",
                ("entropy",)),
    MonitorSpec("advantage_collapse", advantage_collapse, "distinct advantages vs distinct reward combinations",
                ("advantages/collapse",)),
    MonitorSpec("zero_variance_groups", zero_variance_groups, "groups with identical rewards (all-correct/all-wrong)",
                ("zero_variance_groups/frac",)),
    MonitorSpec("pass_at_k", pass_at_k, "pass@G at zero; pass@k falling while pass@1 rises", ("pass@*",)),
    MonitorSpec("intrinsic_collapse", intrinsic_collapse, "label-free runs: intrinsic reward saturated, or accuracy "
                "rising then falling (model collapse step)", ("reward/mean", "reward/group_std|accuracy")),
    MonitorSpec("teacher_variance", teacher_variance, "within-prompt reward variance too low (flat objective)",
                ("reward/group_std",)),
    MonitorSpec("proxy_gold_gap", proxy_gold_gap, "proxy reward up while gold accuracy flat or down",
                ("reward/mean", "accuracy")),
    MonitorSpec("length_reward_corr", length_reward_corr, "within-group correlation of reward with length",
                ("length/reward_corr",)),
    MonitorSpec("length_drift", length_drift, "mean length trend", ("length/mean",)),
    MonitorSpec("clip_fractions", clip_fractions, "clipped token fractions by advantage sign",
                ("clip_low|clip_high|clip_region",)),
]
ORDER = {m.name: i for i, m in enumerate(MONITORS)}


def _logged(pattern: str, keys: set[str]) -> bool:
    if "*" not in pattern:
        return pattern in keys
    import fnmatch

    return any(fnmatch.fnmatchcase(k, pattern) for k in keys)


def unread(keys: set[str] | dict) -> list[tuple[MonitorSpec, list[str]]]:
    """The monitors that cannot fire on a run logging (only) ``keys`` (postrl keys, e.g. a row's or every row's,
    plus the evaluations'), each with the entries of its ``reads`` the run lacks."""
    keys = set(keys)
    out = []
    for spec in MONITORS:
        missing = [e for e in spec.reads if not any(_logged(alt, keys) for alt in e.split("|"))]
        if missing:
            out.append((spec, missing))
    return out


def unread_text(missing: list[tuple[MonitorSpec, list[str]]], engine: str) -> str:
    """One line naming the monitors skipped for lack of metrics: those whose metrics ``engine`` could log (with the
    engine's names), then those it has no counterpart for."""
    name = engines.ENGINES.get(engine, engine)
    could, cannot = [], []
    for spec, entries in missing:
        theirs = [n for e in entries for alt in e.split("|") for n in engines.names_for(engine, alt)]
        if theirs:
            could.append(f"{spec.name} ({' or '.join(theirs)})")
        else:
            cannot.append(spec.name)
    parts = []
    if could:
        parts.append(f"not in this run's logs: {', '.join(could)}")
    if cannot:
        parts.append(f"{name} logs no counterpart of what they read: {', '.join(cannot)}")
    return ("monitors skipped, " + "; ".join(parts)) if parts else ""


def sort_key(alarm: Alarm | dict) -> tuple:
    a = alarm if isinstance(alarm, dict) else alarm.to_dict()
    sev = SEVERITIES.index(a.get("severity", "warn")) if a.get("severity", "warn") in SEVERITIES else 1
    return (sev, ORDER.get(a["name"], len(ORDER)))


def lenient_config(data: dict) -> DiagnosticsConfig:
    """The diagnostics section of a run's config.yaml, read leniently: a run written by another postrl version
    may hold keys or values this one does not know; those fall back to the defaults instead of failing."""
    from pydantic import ValidationError

    try:
        return DiagnosticsConfig.model_validate(data)
    except ValidationError:
        pass
    clean: dict = {}
    for name, f in DiagnosticsConfig.model_fields.items():
        if name not in data:
            continue
        v = data[name]
        sub = f.annotation if isinstance(f.annotation, type) else None
        if isinstance(v, dict) and sub is not None and issubclass(sub, BaseModel):
            ok = {}
            for k, x in v.items():
                if k in sub.model_fields:
                    try:
                        sub.model_validate({**ok, k: x})
                        ok[k] = x
                    except ValidationError:
                        continue
            clean[name] = ok
        elif isinstance(v, bool):
            clean[name] = v
    try:
        return DiagnosticsConfig.model_validate(clean)
    except ValidationError:
        return DiagnosticsConfig()


class Watchdog:
    """Runs every enabled monitor at each step with its patience; ``step(metrics)`` returns the active alarms."""

    def __init__(self, run_config: dict, diagnostics: DiagnosticsConfig | dict | None = None,
                 engine: str = "postrl"):
        if diagnostics is None:
            diagnostics = run_config.get("diagnostics") or {}
        self.cfg = diagnostics if isinstance(diagnostics, DiagnosticsConfig) else lenient_config(diagnostics)
        self.ctx = Context(run_config, engine=engine)
        self.history: list[dict] = []
        self.streak: dict[str, int] = {}

    def observe_eval(self, res: dict) -> None:
        self.ctx.evals.append(res)

    def step(self, metrics: dict) -> list[Alarm]:
        self.history.append({k: v for k, v in metrics.items() if k != "alarms"})
        if not self.cfg.enabled:
            return []
        out = []
        for spec in MONITORS:
            params = getattr(self.cfg, spec.name)
            if not params.enabled:
                continue
            try:
                alarm = spec.fn(self.history, self.ctx, params)
            except Exception as e:  # noqa: BLE001 - a monitor bug must not stop training; it is reported instead
                alarm = Alarm(spec.name, f"monitor failed: {type(e).__name__}: {e}", "a bug in the monitor",
                              "report it; disable with diagnostics." + spec.name + ".enabled=false", "info")
            if alarm is None:
                self.streak[spec.name] = 0
                continue
            self.streak[spec.name] = self.streak.get(spec.name, 0) + 1
            if self.streak[spec.name] >= params.patience:
                alarm.step = int(metrics.get("step", len(self.history)))
                if params.patience > 1:
                    alarm.message += f" (for {self.streak[spec.name]} steps)"
                out.append(alarm)
        return out

    def final(self) -> list[Alarm]:
        """Alarms that only the evaluations can raise once training is over (held-out gap, pass@k narrowing)."""
        if not self.cfg.enabled or not self.history:
            return []
        out = []
        last = int(self.history[-1].get("step", len(self.history)))
        if self.cfg.proxy_gold_gap.enabled:
            out.append(eval_gap(self.history, self.ctx, self.cfg.proxy_gold_gap))
        if self.cfg.pass_at_k.enabled:  # only the evaluation branch: a row without training pass@k
            out.append(pass_at_k([{"step": last}], self.ctx, self.cfg.pass_at_k))
        out = [a for a in out if a is not None]
        for a in out:
            a.step = last
        return out


def replay(rows: list[dict], evals: list[dict], run_config: dict,
           engine: str = "postrl") -> tuple[list[list[Alarm]], list[Alarm]]:
    """Run the monitors over a finished (or partial) run offline: per-step alarms and the final ones. ``rows`` are
    in postrl's keys; ``engine`` names the trainer whose options the alarms propose.

    Each evaluation is observed before the first step after it (the 'before' evaluation, at step 0, first).
    """
    w = Watchdog(run_config, engine=engine)
    pending = sorted(evals, key=lambda e: int(e.get("step", 0)))
    per_step = []
    for m in rows:
        s = int(m.get("step", 0))
        while pending and int(pending[0].get("step", 0)) < s:
            w.observe_eval(pending.pop(0))
        per_step.append(w.step(m))
    for e in pending:
        w.observe_eval(e)
    return per_step, w.final()
