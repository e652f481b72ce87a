"""Process-reward shaping: transforms of the per-step scores ``step_rewards`` [N, S] (NaN padded).

A process reward source returns one score per reasoning step (steps: ``reward.step_delimiter``); its column of
the reward matrix holds the scalar that the stage derives (the sum of the shaped step rewards, or the min-form
return), and ``step_rewards`` holds the shaped per-step rewards, whose sum from step s is step s's return: the
``step_return`` advantage gives every token of step s (tokens up to ``step_ends``) that return. ``source``
(default: the source that returned the step scores) names that column. Rows without steps (a failed process
reward) stay NaN.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Le, Lt

from postrl.registry import register
from postrl.shaping._util import NAN, col, correctness, group_mean, process_column, with_column
from postrl.stages import StepEnd, Stateful

_GAO = "On Designing Effective RL Reward at Training Time for LLM Reasoning"


def _finish(step_rewards: torch.Tensor, new_steps: torch.Tensor, rewards, k: int, total: torch.Tensor) -> dict:
    known = torch.isfinite(step_rewards).any(-1) & torch.isfinite(rewards[:, k])
    total = torch.where(known, total.to(rewards.dtype), torch.full_like(total, NAN, dtype=rewards.dtype))
    steps = torch.where(torch.isfinite(step_rewards), new_steps, torch.full_like(new_steps, NAN))
    return {"step_rewards": steps.to(step_rewards.dtype), "rewards": with_column(rewards, k, total)}


@register("shaping", "clip_prm", source=_GAO + " (Clip)")
def clip_prm(step_rewards, rewards, reward_names, step_reward_source=None, *, eta: float = 0.5,
             source: str | None = None):
    """Clip mechanism: r'_t = min(r_t - eta, 0) for every step; the column becomes sum_t r'_t <= 0.

    The summed process reward is bounded above by 0, so repeating steps (the reward hack the paper reports)
    cannot raise it. Default eta=0.5 (assumed: the abstract gives no value; take a score a good step reaches,
    e.g. 0.5 for a PRM that outputs P(step correct)). Shapes: step_rewards [N, S] -> [N, S].
    """
    k = process_column(reward_names, step_reward_source, source, "clip_prm")
    new = torch.clamp(step_rewards - eta, max=0.0)
    return _finish(step_rewards, new, rewards, k, torch.nan_to_num(new, nan=0.0).sum(-1))


@register("shaping", "delta_prm", source=_GAO + " (Delta)")
def delta_prm(step_rewards, rewards, reward_names, step_reward_source=None, *, source: str | None = None):
    """Delta mechanism: r'_t = r_t - r_{t+1} for t < T, r'_T = r_T (T = the row's last step).

    The sum over steps telescopes to r_1, so it is bounded whatever the number of steps; the return from step t
    is r_t. The column becomes sum_t r'_t (= r_1).
    """
    k = process_column(reward_names, step_reward_source, source, "delta_prm")
    nxt = torch.cat([step_rewards[:, 1:], torch.full_like(step_rewards[:, :1], NAN)], dim=1)
    new = torch.where(torch.isfinite(nxt), step_rewards - nxt, step_rewards)
    return _finish(step_rewards, new, rewards, k, torch.nan_to_num(new, nan=0.0).sum(-1))


@register("shaping", "min_form", source="Stop Summation: Min-Form Credit Assignment Is All Process Reward Model "
                                        "Needs for Reasoning (PURE)")
def min_form(step_rewards, rewards, reward_names, step_reward_source=None, *,
             temperature: Annotated[float, Ge(0)] = 0.0,
             source: str | None = None):
    """Min-form credit assignment (PURE): return_t = min_{k >= t} r_k instead of sum_{k >= t} gamma^(k-t) r_k.

    temperature = 0 (default, the paper's definition): ``step_rewards`` become r'_t = return_t - return_{t+1}
    (return_{T+1} = 0), so that their undiscounted sum from step t is the min-form return, and the column becomes
    return_1 = min_t r_t. The value is bounded by the worst step: return_t <= r_k for every k >= t.
    temperature = tau > 0 (PURE's code, ``turn_process_reward_logits_to_reward``, tau 0.1 there): the approximation
    r'_t = softmax_k(-r_k / tau)_t * r_t over the row's steps, so that sum_t r'_t -> min_t r_t as tau -> 0; the
    column becomes sum_t r'_t (and the sum from step t is the return of step t).
    The token-level credit assignment is the ``step_return`` advantage (each token gets its step's return). To mix
    in a verifiable reward (PURE's best setting), list it as another reward source: the weighted sum adds it to
    this column, and ``step_return`` adds its leave-one-out advantage to every token.
    """
    k = process_column(reward_names, step_reward_source, source, "min_form")
    valid = torch.isfinite(step_rewards)
    if temperature > 0:
        x = torch.where(valid, step_rewards.to(torch.float64), torch.full_like(step_rewards, float("inf"),
                                                                              dtype=torch.float64))
        wts = torch.softmax(-x / temperature, dim=-1)  # a row without steps: NaN, excluded by _finish
        new = torch.where(valid, wts * torch.nan_to_num(x, posinf=0.0), torch.full_like(x, NAN))
        return _finish(step_rewards, new.to(step_rewards.dtype), rewards, k, torch.nan_to_num(new, nan=0.0).sum(-1))
    x = torch.where(valid, step_rewards, torch.full_like(step_rewards, float("inf")))
    ret = torch.flip(torch.cummin(torch.flip(x, [1]), dim=1).values, [1])
    ret = torch.where(valid, ret, torch.full_like(ret, NAN))
    nxt = torch.cat([ret[:, 1:], torch.full_like(ret[:, :1], NAN)], dim=1)
    new = ret - torch.nan_to_num(nxt, nan=0.0)
    return _finish(step_rewards, new, rewards, k, ret[:, 0] if ret.shape[1] else torch.full_like(rewards[:, k], NAN))


@register("shaping", "gated", source="Stabilizing Long-term Multi-turn Reinforcement Learning with Gated Rewards "
                                     "(G-RA)")
def gated(step_rewards, rewards, reward_names, step_reward_source=None, *, outcome: str = "correct",
          threshold: float = 1.0, source: str | None = None):
    """Gated reward accumulation (G-RA): the step rewards count only when the outcome reward >= threshold.

    g_i = 1[r_i^outcome >= threshold]; r'_t = g_i r_t; the process column becomes g_i sum_t r_t, so the total is
    r^outcome + g sum_t r_t (with unit weights). Defaults: outcome='correct', threshold=1.0. A failed outcome
    makes the gate unknown: the column is NaN (excluded).
    """
    k = process_column(reward_names, step_reward_source, source, "gated")
    ro = rewards[:, col(reward_names, outcome, "gated", "outcome")]
    g = (ro >= threshold).to(step_rewards.dtype).unsqueeze(-1)
    new = step_rewards * g
    out = _finish(step_rewards, new, rewards, k, torch.nan_to_num(new, nan=0.0).sum(-1))
    out["rewards"][~torch.isfinite(ro), k] = NAN
    return out


@register("shaping", "potential", source="potential-based reward shaping (Ng, Harada & Russell 1999)")
def potential(step_rewards, rewards, reward_names, step_reward_source=None, *,
              gamma: Annotated[float, Gt(0), Le(1)] = 1.0,
              phi0: float = 0.0, source: str | None = None):
    """Potential-based shaping over steps: F_t = gamma * Phi(s_t) - Phi(s_{t-1}), t = 1..T.

    Phi(s_t) = the step score after step t (``step_rewards``, e.g. a PRM's value estimate), Phi(s_0) = phi0
    (default 0). The discounted sum telescopes: sum_{t=1..T} gamma^(t-1) F_t = gamma^T Phi(s_T) - Phi(s_0); this
    is the column's new value (added to the outcome reward by the weighted sum), and ``step_rewards`` becomes
    F [N, S]. Shaping of this form leaves the optimal policy unchanged. Default gamma=1.0.
    """
    k = process_column(reward_names, step_reward_source, source, "potential")
    phi = step_rewards.to(torch.float64)
    prev = torch.cat([torch.full_like(phi[:, :1], phi0), phi[:, :-1]], dim=1)
    F = gamma * phi - prev
    S = phi.shape[1]
    disc = gamma ** torch.arange(S, dtype=torch.float64)
    total = (torch.nan_to_num(F, nan=0.0) * disc).sum(-1)
    return _finish(step_rewards, F.to(step_rewards.dtype), rewards, k, total)



_TP_GRPO = ("Good Learners Think Their Thinking: Generative PRM Makes Large Reasoning Model More Efficient Math "
            "Learner (TP-GRPO)")


def thought_ends(step_rewards: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(verdict [N, S] bool, last step of its thought [N, S] bool) of the scored steps of ``step_rewards`` [N, S]
    (NaN padded): verdict = score >= threshold; a thought is a maximal run of consecutive steps with the same
    verdict, and it ends on a step whose next step is absent or has the other verdict."""
    valid = torch.isfinite(step_rewards)
    verdict = valid & (step_rewards >= threshold)
    nxt_valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
    nxt_verdict = torch.cat([verdict[:, 1:], torch.zeros_like(verdict[:, :1])], dim=1)
    return verdict, valid & (~nxt_valid | (nxt_verdict != verdict))


@register("shaping", "thought_reward", source=_TP_GRPO)
class ThoughtReward(Stateful):
    """Thought-level process reward (TP-GRPO): runs of steps with one verdict form a thought, rewarded as one unit.

    After "Good Learners Think Their Thinking" (the abstract: step verdicts are aggregated so that "contiguous
    correct/incorrect steps" form "'thought' units" that are rewarded, and "a capability-adaptive reward mechanism
    ... balances exploration and exploitation based on the LRM's current proficiency"; no formula). The step
    verdicts are those of the run's process reward source (``step_rewards``: a PRM's or a generative judge's score
    per step, e.g. P(step correct)); for completion i with steps s = 1..S_i:

        v_s   = 1[r_s >= step_threshold]                      the step's verdict
        thought j = a maximal run of consecutive steps with the same verdict v_j, ending on step e_j
        R_j   = alpha * (1 - p)   if v_j = 1                  a correct thought
                -alpha * p        if v_j = 0                  an incorrect thought
        r'_s  = R_j on s = e_j, 0 on the other steps of thought j

    so the sum of r'_k from any step of thought j on is the same for every step of the thought: the
    ``step_return`` advantage gives all its tokens one credit. The process column becomes sum_j R_j (the
    outcome column, ``outcome``, is left as it is and the weighted sum adds both). p is the model's proficiency
    (assumed reading of "capability-adaptive"): with low proficiency correct thoughts earn much and wrong ones
    cost little (exploration: trial and error is not punished), with high proficiency the reverse
    (exploitation). ``proficiency='running'`` (default): p = an exponential moving average of the training
    accuracy (share of the step's completions with ``outcome`` >= ``correct_threshold`` among those whose outcome
    is known), p <- momentum * p + (1 - momentum) * acc_step, updated once per step from every process's batches
    (``initial_proficiency`` before the first step); ``proficiency='group'``: p = the accuracy of the
    completion's own group (the prompt's difficulty for the current model; no state). Defaults: step_threshold
    0.5, alpha 1.0, momentum 0.9, initial_proficiency 0.5, outcome 'correct', correct_threshold 1.0; ``source``
    (default: the source that returned the step scores) names the process column. The generative PRM that judges
    the steps from intrinsic signals is the process reward source's business (e.g. ``judge`` or ``model``).
    Shapes: step_rewards [N, S] (NaN padded) -> step_rewards [N, S], rewards [N, K]. Rows without steps, or with a
    proficiency that is unknown (a group whose outcomes all failed), get NaN. State (p) is saved with the
    checkpoint.
    """

    _state = ("p",)

    def __init__(self, *, step_threshold: float = 0.5, alpha: Annotated[float, Ge(0)] = 1.0,
                 proficiency: Literal["running", "group"] = "running",
                 momentum: Annotated[float, Ge(0), Lt(1)] = 0.9,
                 initial_proficiency: Annotated[float, Ge(0), Le(1)] = 0.5, outcome: str = "correct",
                 correct_threshold: float = 1.0, source: str | None = None):
        self.thr, self.alpha, self.mode, self.momentum = step_threshold, alpha, proficiency, momentum
        self.outcome, self.correct_threshold, self.source = outcome, correct_threshold, source
        self.p = float(initial_proficiency)

    def _outcome(self, rewards, reward_names):
        return correctness(rewards, reward_names, self.outcome, self.correct_threshold, "thought_reward")

    def __call__(self, step_rewards, rewards, reward_names, group_ids, step_reward_source=None):
        k = process_column(reward_names, step_reward_source, self.source, "thought_reward")
        if self.mode == "group":
            ok, known = self._outcome(rewards, reward_names)
            p = group_mean(ok.to(torch.float64), group_ids, known)  # NaN for a group without a known outcome
        else:
            p = torch.full((step_rewards.shape[0],), self.p, dtype=torch.float64)
        verdict, ends = thought_ends(step_rewards, self.thr)
        p = p.unsqueeze(-1)
        R = torch.where(verdict, self.alpha * (1.0 - p), -self.alpha * p)
        new = torch.where(ends, R, torch.zeros_like(R)).to(step_rewards.dtype)
        total = torch.where(ends, R, torch.zeros_like(R)).sum(-1)
        out = _finish(step_rewards, new, rewards, k, total)
        if self.mode == "group":  # an unknown proficiency: the row's process reward is unknown
            unknown = torch.isnan(p.squeeze(-1))
            out["rewards"][unknown, k] = NAN
            out["step_rewards"][unknown] = NAN
        return out

    def observe(self, rewards, reward_names) -> None:
        if self.mode == "running":
            ok, known = self._outcome(rewards, reward_names)
            self.record((float((ok & known).sum()), float(known.sum())))

    def end_step(self, step: StepEnd) -> dict:
        used = {"proficiency": self.p}  # the value this step used
        right = sum(r for r, _ in self.observed)  # every process's counts of this step
        known = sum(n for _, n in self.observed)
        if known:
            self.p = self.momentum * self.p + (1.0 - self.momentum) * right / known
        return used if self.mode == "running" else {}


_PSPO = "PSPO*: An Effective Process-supervised Policy Optimization for Reasoning Alignment (PSPO-WRS)"


def adjusted_weibull(n: torch.Tensor, peak: float, shape: float) -> torch.Tensor:
    """The Weibull density of shape k and mode ``peak``, divided by its value at the mode (so the peak is 1):

        w(n) = f(n) / f(peak) = x^(k-1) exp(((k - 1) / k) (1 - x^k)),   x = n / peak,   k = ``shape`` > 1

    (f(n) = (k / lam) (n / lam)^(k-1) exp(-(n / lam)^k), whose mode is lam ((k - 1) / k)^(1/k) = ``peak``)."""
    x = n.to(torch.float64) / peak
    k = shape
    return x.pow(k - 1.0) * torch.exp((k - 1.0) / k * (1.0 - x.pow(k)))


@register("shaping", "pspo_wrs", source=_PSPO)
def pspo_wrs(step_rewards, rewards, reward_names, step_reward_source=None, *,
             peak_steps: Annotated[float, Gt(0)] = 8.0, shape: Annotated[float, Gt(1)] = 2.0,
             accuracy: Literal["mean", "fraction"] = "mean", step_threshold: float = 0.5,
             source: str | None = None):
    """PSPO-WRS: a nonlinear reward of the chain's PRM accuracy and its number of steps, by an adjusted Weibull.

    After PSPO* (the abstract: the reward depends nonlinearly on "both the accuracy and the length of reasoning
    chains"; PSPO-WRS "considers the number of reasoning steps in determining reward scores and utilizes an
    adjusted Weibull distribution for nonlinear reward shaping"; no formula). For completion i with n_i scored
    steps r_1..r_n (the process reward source's ``step_rewards``, e.g. a PRM's P(step correct) in [0, 1]):

        a_i = (1/n_i) sum_s r_s                      (``accuracy='mean'``, default)
              (1/n_i) sum_s 1[r_s >= step_threshold] ('fraction': the share of steps the PRM judges correct)
        w(n) = x^(k-1) exp(((k-1)/k) (1 - x^k)),  x = n / peak_steps   (the Weibull density of shape k whose mode
               is ``peak_steps``, divided by its value there: the "adjusted" curve, w(peak_steps) = 1, rising below
               and decaying above it)
        R_i = a_i * w(n_i)

    The process column becomes R_i and ``step_rewards`` become r'_s = w(n_i) r_s / n_i (or w(n_i) 1[r_s >=
    threshold] / n_i), whose sum is R_i, so the ``step_return`` advantage sees the same total. Assumed (the
    abstract gives neither): the product form, the PRM accuracy as the mean step score, and the normalisation to
    a peak of 1. Defaults: peak_steps 8 (the preferred number of steps; set it from the task), shape 2.0 (k > 1:
    a unimodal curve), accuracy 'mean', step_threshold 0.5; ``source`` (default: the source that returned the
    step scores) names the process column. Rows without steps get NaN.
    Shapes: step_rewards [N, S] (NaN padded) -> step_rewards [N, S], rewards [N, K].
    """
    k = process_column(reward_names, step_reward_source, source, "pspo_wrs")
    valid = torch.isfinite(step_rewards)
    n = valid.sum(-1).to(torch.float64)
    x = step_rewards.to(torch.float64)
    s = (x >= step_threshold).to(torch.float64) if accuracy == "fraction" else x
    s = torch.where(valid, s, torch.zeros_like(s))
    w = adjusted_weibull(n, peak_steps, shape)
    per = (w / n.clamp(min=1.0)).unsqueeze(-1) * s
    new = torch.where(valid, per, torch.full_like(per, NAN))
    return _finish(step_rewards, new.to(step_rewards.dtype), rewards, k, per.sum(-1))
