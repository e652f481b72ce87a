"""Reward-noise budget planner: how many rollouts, and how many reward calls per rollout, a fixed budget should buy.

After "On Training in Imagination" (Timor, Shwartz-Ziv, Goldblum, LeCun, Harel 2026), part 2: zero-mean reward
noise leaves the REINFORCE gradient unbiased and adds a variance term that shrinks with the number of rollouts, so
under a fixed budget one trades rollouts against cleaner rewards; the paper reduces the choice to a one-dimensional
optimum. The abstract gives no formula; this module is the most faithful reading, with its assumptions stated.

The model (per prompt, G completions y_i ~ pi, score vectors s_i = grad log pi(y_i), clean rewards r_i, each reward
the mean of m independent calls of a scorer whose outputs scatter with sd ``noise_sd`` = sigma around r_i):

    g = 1/G sum_i (r_i + e_i - b_i) s_i,          e_i = mean of m zero-mean errors, Var(e_i) = sigma^2 / m

    E[g] = the clean expectation (the noise is zero-mean and independent of y_i: unbiased)
    tr Var(g) = (A + B sigma^2 / m) / (G - kappa)

with B = E||s||^2 (the score's second moment), A = the per-sample variance (trace) of the clean term
(r - b) s, and kappa = 0 without a baseline (plain REINFORCE: exact) or 1 with a leave-one-out baseline (RLOO:
exact for the noise term; the clean term is then a U-statistic whose variance is ~ A / (G - 1) for large G). Only
the ratio ``signal_var`` = A / B matters: when |r| and ||s||^2 are roughly uncorrelated, A / B ~ E[r^2] without a
baseline and ~ Var(r) (the reward's within-prompt variance) with one (:func:`signal_var`).

Costs: a rollout (generating one completion) costs ``rollout_cost`` c_r, a reward call ``call_cost`` c_q; a prompt's
budget C buys G = floor(C / (c_r + m c_q)) completions. Minimising the variance over m with G = C / (c_r + m c_q)
(continuous, kappa = 0) is the one-dimensional problem

    f(m) = (A + B sigma^2 / m) (c_r + m c_q) / C
    m* = sigma sqrt(B c_r / (A c_q)) = (sigma / sqrt(signal_var)) sqrt(c_r / c_q)
    C f(m*) = (sqrt(A c_r) + sigma sqrt(B c_q))^2

(f is convex in m; below m* = 1 one call per completion is best, and the extra budget buys rollouts). Choosing among
scorers (a cheap noisy judge, an expensive clean one) is the same formula per scorer: the one with the smallest
sqrt(A c_r) + sigma_k sqrt(B c_k) wins. :func:`plan_budget` solves the integer problem exactly (every m up to
``max_calls``, G the largest group the budget buys, at least ``min_group``) and reports the continuous m* beside it.

The noise is measured by scoring the same completion several times (:func:`estimate_noise`: the pooled
within-completion variance of repeated scores; the within-prompt spread of the completions' mean scores, less the
noise's share, is the clean reward's variance). ``postrl budget`` is the command.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Literal

from postrl.errors import ConfigError, DataError

__all__ = ["Plan", "optimal_calls", "gradient_variance", "signal_var", "plan_budget", "plan_options",
           "estimate_noise", "Baseline"]

Baseline = Literal["none", "loo"]
_KAPPA = {"none": 0, "loo": 1}


@dataclass(frozen=True)
class Plan:
    """One allocation of a prompt's budget: ``group_size`` completions, each scored ``calls`` times."""

    calls: int  # m: reward calls per completion (their mean is the reward)
    group_size: int  # G: completions of the prompt
    cost: float  # G (c_r + m c_q), at most the budget
    variance: float  # tr Var(g) / B = (signal_var + noise_sd^2 / m) / (G - kappa): the gradient variance per unit B
    clean_variance: float  # the same budget with a noiseless scorer at the same call cost: signal_var / (G0 - kappa)
    continuous_calls: float  # m* of the continuous problem (inf: calls are free; 0: no noise)
    option: str = ""  # the scorer's name when several were compared

    @property
    def noise_share(self) -> float:
        """Fraction of the planned variance that the reward noise adds (0 for a clean reward)."""
        return 1.0 - self.clean_variance / self.variance if self.variance > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "noise_share": self.noise_share}


def _check(noise_sd: float, signal: float, rollout_cost: float, call_cost: float) -> None:
    for key, v in (("noise_sd", noise_sd), ("signal_var", signal), ("rollout_cost", rollout_cost),
                   ("call_cost", call_cost)):
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"{key}: expected a finite number >= 0, got {v}")
    if rollout_cost + call_cost <= 0:
        raise ConfigError("rollout_cost, call_cost: a completion must cost something (both are 0)")


def optimal_calls(noise_sd: float, signal: float, rollout_cost: float, call_cost: float) -> float:
    """The continuous optimum m* = noise_sd sqrt(rollout_cost / (signal_var call_cost)) of the reward calls per
    completion (module docstring); inf when calls are free or the clean signal is 0 while noise is not, 0 without
    noise."""
    _check(noise_sd, signal, rollout_cost, call_cost)
    if noise_sd == 0:
        return 0.0
    if call_cost == 0 or signal == 0:
        return math.inf
    return noise_sd * math.sqrt(rollout_cost / (signal * call_cost))


def gradient_variance(group_size: int, calls: int, *, noise_sd: float, signal: float,
                      baseline: Baseline = "none") -> float:
    """tr Var(g) / E||s||^2 = (signal_var + noise_sd^2 / calls) / (group_size - kappa) (module docstring)."""
    k = _KAPPA[baseline]
    if group_size <= k:
        return math.inf
    return (signal + noise_sd ** 2 / calls) / (group_size - k)


def signal_var(reward_sd: float, reward_mean: float = 0.0, baseline: Baseline = "none") -> float:
    """A / B from the clean reward's moments within a prompt: E[r^2] = sd^2 + mean^2 without a baseline, Var(r) =
    sd^2 with one (assumes |r - b| and ||grad log pi||^2 uncorrelated)."""
    return reward_sd ** 2 + (reward_mean ** 2 if baseline == "none" else 0.0)


def plan_budget(budget: float, *, noise_sd: float, signal: float, rollout_cost: float = 1.0,
                call_cost: float = 0.0, baseline: Baseline = "none", max_calls: int = 64,
                min_group: int | None = None, option: str = "") -> Plan:
    """The integer allocation of ``budget`` (per prompt) with the least gradient variance: for each m in
    1..``max_calls`` the largest G with G (c_r + m c_q) <= budget (G >= ``min_group``, default 1 without a baseline,
    2 with the leave-one-out one), then the m of least :func:`gradient_variance` (ties: fewer calls).
    ConfigError when the budget cannot buy ``min_group`` completions scored once."""
    _check(noise_sd, signal, rollout_cost, call_cost)
    if baseline not in _KAPPA:
        raise ConfigError(f"baseline: expected one of {', '.join(_KAPPA)}, got '{baseline}'")
    if max_calls < 1:
        raise ConfigError(f"max_calls: expected an integer >= 1, got {max_calls}")
    k = _KAPPA[baseline]
    min_group = k + 1 if min_group is None else min_group
    if min_group < k + 1:
        raise ConfigError(f"min_group: expected at least {k + 1} with baseline '{baseline}', got {min_group}")
    best: tuple[float, int, int] | None = None
    for m in range(1, max_calls + 1):
        g = int(math.floor(budget / (rollout_cost + m * call_cost) + 1e-9))
        if g < min_group:
            break  # more calls only shrink the group
        v = gradient_variance(g, m, noise_sd=noise_sd, signal=signal, baseline=baseline)
        if best is None or v < best[0] * (1 - 1e-12):
            best = (v, m, g)
    if best is None:
        raise ConfigError(f"budget: {budget:g} does not buy {min_group} completion(s) at {rollout_cost:g} + "
                          f"{call_cost:g} per completion")
    v, m, g = best
    g0 = int(math.floor(budget / (rollout_cost + call_cost) + 1e-9))
    clean = signal / (g0 - k) if g0 > k else math.inf
    return Plan(calls=m, group_size=g, cost=g * (rollout_cost + m * call_cost), variance=v, clean_variance=clean,
                continuous_calls=optimal_calls(noise_sd, signal, rollout_cost, call_cost), option=option)


def plan_options(budget: float, options: Iterable[tuple[str, float, float]], *, signal: float,
                 rollout_cost: float = 1.0, baseline: Baseline = "none", max_calls: int = 64,
                 min_group: int | None = None) -> list[Plan]:
    """One :func:`plan_budget` per scorer ``(name, noise_sd, call_cost)``, best (least variance) first: buy more
    rollouts with a cheap noisy scorer, or fewer with an expensive clean one. A scorer whose single call the budget
    cannot afford for ``min_group`` completions is left out."""
    plans = []
    for name, sd, cost in options:
        try:
            plans.append(plan_budget(budget, noise_sd=sd, signal=signal, rollout_cost=rollout_cost, call_cost=cost,
                                     baseline=baseline, max_calls=max_calls, min_group=min_group, option=name))
        except ConfigError as e:
            if not str(e).startswith("budget:"):
                raise
    if not plans:
        raise ConfigError(f"budget: {budget:g} buys no allocation with any of the scorers")
    return sorted(plans, key=lambda p: (p.variance, p.cost))


def estimate_noise(rows: Iterable[dict], *, score_key: str = "score") -> dict:
    """The reward's noise and clean spread from repeated scores of the same completions.

    ``rows``: dicts with ``prompt``, ``completion`` and ``score``; the rows of one (prompt, completion) are repeated
    calls of the scorer on it (at least one completion needs two). Returns

    - ``noise_sd``: sqrt of the pooled within-completion variance sum_c sum_j (x_cj - xbar_c)^2 / sum_c (n_c - 1);
    - ``reward_sd``: sqrt(max(0, V_w - noise_var * mean_c(1 / n_c))), V_w the pooled within-prompt variance of the
      completions' mean scores (ddof 1 per prompt, prompts with one completion skipped): the clean reward's spread
      within a prompt (a mean of n_c calls carries noise_var / n_c of noise);
    - ``reward_mean``: the mean of the completions' mean scores; ``completions``, ``prompts``, ``calls`` (rows).
    """
    by_completion: dict[tuple[str, str], list[float]] = {}
    for i, row in enumerate(rows):
        try:
            key = (str(row["prompt"]), str(row["completion"]))
            x = float(row[score_key])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"row {i + 1}: expected 'prompt', 'completion' and a numeric '{score_key}'") from None
        if not math.isfinite(x):
            raise DataError(f"row {i + 1}: '{score_key}' is not finite ({x})")
        by_completion.setdefault(key, []).append(x)
    ss, dof = 0.0, 0
    for xs in by_completion.values():
        mu = sum(xs) / len(xs)
        ss += sum((x - mu) ** 2 for x in xs)
        dof += len(xs) - 1
    if dof == 0:
        raise DataError("no completion was scored twice: repeat the scorer's calls on the same completions to "
                        "measure its noise")
    noise_var = ss / dof
    by_prompt: dict[str, list[tuple[float, int]]] = {}
    for (prompt, _), xs in by_completion.items():
        by_prompt.setdefault(prompt, []).append((sum(xs) / len(xs), len(xs)))
    wss, wdof, inv_n = 0.0, 0, []
    for items in by_prompt.values():
        if len(items) < 2:
            continue
        mu = sum(x for x, _ in items) / len(items)
        wss += sum((x - mu) ** 2 for x, _ in items)
        wdof += len(items) - 1
        inv_n += [1.0 / n for _, n in items]
    means = [sum(xs) / len(xs) for xs in by_completion.values()]
    out = {"noise_sd": math.sqrt(noise_var), "reward_mean": sum(means) / len(means),
           "reward_sd": float("nan"), "completions": len(by_completion), "prompts": len(by_prompt),
           "calls": sum(len(xs) for xs in by_completion.values())}
    if wdof:
        out["reward_sd"] = math.sqrt(max(0.0, wss / wdof - noise_var * sum(inv_n) / len(inv_n)))
    return out
