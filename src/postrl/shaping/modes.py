"""Reasoning modes: budget modes with a token budget each (ThinkDial) and thinking / no-thinking modes (AutoThink).

Both read the completion's length in tokens (``lengths``) and its correctness from the column ``source`` (default
'correct'; correct = r >= ``correct_threshold``, default 1.0). A completion whose correctness failed (NaN) gets
NaN.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import torch
from annotated_types import Ge, Gt, Le

from postrl.errors import ConfigError
from postrl.groups import group_stats
from postrl.registry import register
from postrl.shaping._util import NAN, append_column, col, correctness, with_column
from postrl.stages import parameters

# ------------------------------------------------------------------------------------------------ ThinkDial
THINKDIAL_RATIOS = {"high": 1.0, "medium": 0.5, "low": 0.25}  # ThinkDial: medium -50 %, low -75 % tokens


def _thinkdial_budget(params: dict, run: Any, where: str) -> dict:
    """``thinkdial_budget``: in a config, ``max_length`` defaults to ``rollout.max_new_tokens``."""
    if run is not None and "max_length" not in params:
        params = {**params, "max_length": run.rollout.max_new_tokens}
    p = {**{k: d for k, (_, d) in parameters(thinkdial_budget).items()}, **params}
    if not p["ratios"]:
        raise ConfigError(f"{where}.ratios: expected at least one mode, e.g. {{high: 1.0, medium: 0.5, low: 0.25}}")
    return params


def mode_budgets(ratios: dict[str, float], max_length: int) -> dict[str, int]:
    """{mode (lower case): token budget B_m = max(1, round(ratio_m * max_length))}."""
    return {str(m).lower(): max(1, round(r * max_length)) for m, r in ratios.items()}


def in_phase_two(step: int, max_steps: int, phase1_steps: int | None, phase1_fraction: float) -> bool:
    """Whether training step ``step`` (0-based) is in ThinkDial's second phase: step >= phase1_steps, or, without
    it, step >= round(phase1_fraction * max_steps) (``max_steps``: train.steps, 0 when the driver does not say)."""
    if phase1_steps is None:
        if max_steps <= 0:
            raise ValueError("shaping 'thinkdial_budget': the batch does not say the run's length (max_steps; set "
                             "by postrl's trainer from train.steps); set phase1_steps (the steps of phase 1)")
        phase1_steps = round(phase1_fraction * max_steps)
    return step >= phase1_steps


@register("shaping", "thinkdial_budget", source="ThinkDial: An Open Recipe for Controlling Reasoning Effort in Large "
                                                "Language Models", check=_thinkdial_budget)
def thinkdial_budget(rewards, reward_names, reward_weights, lengths, columns, step=0, max_steps=0, *,
                     mode_column: str = "mode",
                     ratios: dict[str, Annotated[float, Gt(0)]] = THINKDIAL_RATIOS,
                     max_length: Annotated[int, Ge(1)] = 4096, penalty: Annotated[float, Ge(0)] = 1.0,
                     phase1_penalty: Annotated[float, Ge(0)] = 0.0,
                     phase1_fraction: Annotated[float, Ge(0), Le(1)] = 0.5,
                     phase1_steps: Annotated[int, Ge(0)] | None = None, source: str = "correct",
                     correct_threshold: float = 1.0, name: str = "thinkdial_budget", weight: float = 1.0):
    """ThinkDial budget modes: a length penalty relative to the token budget of the row's mode, in two phases.

    After ThinkDial (the abstract: discrete modes High (full reasoning), Medium (50 % fewer tokens) and Low (75 %
    fewer), "budget-mode supervised fine-tuning" and "two-phase budget-aware reinforcement learning with adaptive
    reward shaping"; no formula). Every row is tagged with its mode in the data column ``mode_column`` (default
    'mode': 'high' / 'medium' / 'low', any case; the prompt itself carries the mode's instruction, e.g. its system
    prompt, as in the paper's budget-mode SFT). Mode m has the token budget

        B_m = max(1, round(ratios[m] * max_length))     (ratios: high 1.0, medium 0.5, low 0.25 = the paper's
                                                          targets; max_length: rollout.max_new_tokens in a config)

    and completion i (L_i tokens, mode m_i) gets the appended column

        r_i = -c * min(1, max(0, L_i - B_{m_i}) / B_{m_i})     (0 within the budget, -c at twice the budget)
        c   = phase1_penalty (default 0) in phase 1, ``penalty`` (default 1) in phase 2

    Phase 1 is the training steps before ``phase1_steps`` (default: round(phase1_fraction * train.steps),
    phase1_fraction 0.5), read from the batch's ``step`` (0-based) and ``max_steps``; phase 2 the rest. Assumed:
    phase 1 trains the modes' accuracy without length pressure (the correctness reward alone; set
    ``phase1_penalty`` for a softer first phase), phase 2 adds the budget penalty; the linear, capped penalty on
    the excess over the budget; lengths are the completion's tokens (thinking and answer). The penalty applies to
    correct and wrong completions alike; the total is the correctness reward plus this column. ThinkDial's
    further terms (e.g. against reasoning leaking into the answer) are not included. A row whose mode is missing or
    not in ``ratios`` is an error naming the row; a failed correctness (``source``) gives NaN.
    Shapes: lengths [N], columns[mode_column] (N values) -> an appended column [N].
    """
    if mode_column not in columns:
        raise ValueError(f"shaping 'thinkdial_budget': the rows have no '{mode_column}' column (each row's budget "
                         f"mode: {', '.join(ratios)}); columns: {', '.join(columns) or '(none)'}")
    budgets = mode_budgets(ratios, max_length)
    B = []
    for i, m in enumerate(columns[mode_column]):
        key = str(m).lower() if m is not None else None
        if key not in budgets:
            raise ValueError(f"shaping 'thinkdial_budget': row {i} has mode {m!r} in '{mode_column}'; expected one "
                             f"of {', '.join(budgets)}")
        B.append(budgets[key])
    B = torch.tensor(B, dtype=torch.float64)
    c = penalty if in_phase_two(int(step), int(max_steps), phase1_steps, phase1_fraction) else phase1_penalty
    L = lengths.to(torch.float64)
    r = -c * ((L - B).clamp(min=0.0) / B).clamp(max=1.0)
    _, known = correctness(rewards, reward_names, source, correct_threshold, "thinkdial_budget")
    r = torch.where(known, r, torch.full_like(r, NAN))
    return append_column(rewards, reward_names, reward_weights, r, name, weight, "thinkdial_budget")


# ------------------------------------------------------------------------------------------------ AutoThink
_ELLIPSIS = re.compile(r"(<think>|\.\.\.|…|\s)+")


def no_thinking(text: str, think_end: str = "</think>") -> bool:
    """AutoThink's no-thinking mode: the text before the first ``think_end`` holds nothing but white space, a
    ``<think>`` tag and ellipses ("..." / "…"), i.e. the reasoning was closed at once (the released code: the
    response starts with "</think>" or holds "<think>\\n...\\n</think>"). A text without ``think_end`` is thinking
    mode (its reasoning was never closed)."""
    head, sep, _ = text.partition(think_end)
    return bool(sep) and _ELLIPSIS.sub("", head) == ""


@register("shaping", "autothink", source="Learning When to Think: Shaping Adaptive Reasoning in R1-Style Models via "
                                         "Multi-Stage RL (AutoThink)")
def autothink(rewards, reward_names, group_ids, lengths, completions, *, think_correct: float = 1.0,
              think_wrong: float = 0.0, nothink_correct: float = 2.0, nothink_wrong: float = -1.0,
              balance_rate: Annotated[float, Ge(0), Le(1)] = 0.5, balance_slope: Annotated[float, Ge(0)] = 2.0,
              balance_drop: float = 1.0, length_alpha: Annotated[float, Ge(0)] = 0.0,
              length_beta: Annotated[float, Ge(0)] = 0.0, think_end: str = "</think>", source: str = "correct",
              correct_threshold: float = 1.0):
    """AutoThink: rewards that keep thinking and no-thinking modes alive and favour no-thinking when it is correct.

    "Learning When to Think" (the abstract: an ellipsis in the prompt makes an R1-style model answer with or
    without explicit reasoning at random; "stage-wise reward shaping" over three RL stages learns when to think;
    the constants below are the authors' released code, ``RewardConfig`` and ``_reweight_rewards``). The
    ``source`` column (the correctness reward) is replaced by, for completion i (t_i: it thinks, see
    :func:`no_thinking`; c_i: it is correct):

      base     r_i = think_correct (1) / think_wrong (0) if t_i, nothink_correct (2) / nothink_wrong (-1) if not
      length   (stage 3: length_alpha, length_beta > 0) within the group's correct completions (two or more),
               z_i = (L_i - mean) / max(std, 1e-6) (unbiased std), r_i += exp(-length_alpha z_i) - 1;
               within its wrong ones, r_i += 1 - exp(-length_beta z_i)
      balance  (stage 1: balance_rate < 1) with f = the share of thinking completions in the batch: if
               f > balance_rate, lam = clip(balance_slope (f - balance_rate), 0, 1) and every thinking completion
               moves toward its base reward minus ``balance_drop``: r_i <- (1 - lam) r_i + lam (base_i - drop);
               the same for no-thinking completions when 1 - f > balance_rate

    (the released code's targets 0 / -1 for thinking and 1 / -2 for no-thinking completions are each base reward
    minus 1). The base rewards pay a correct answer without reasoning most and a wrong one least: no-thinking is
    favoured where it suffices; the balance term lowers the rewards of whichever mode dominates the batch, so
    neither collapses. The paper's stages: 1 (defaults: balance_rate 0.5, slope 2, no length term); 2
    (balance_rate 1.0: no balance, rewards per mode only); 3 (balance_rate 1.0, length_alpha = length_beta =
    0.05: shorter correct and longer wrong completions gain). The mode is read from the completion's text (the
    prompt ends with the ellipsis prompt, e.g. "<think>\\n...\\n" in the chat template); ``think_end`` '</think>'.
    The batch is the one this process scores (with several processes, its share of the step's prompts).
    Not included: the released code's -2 for degenerate repetitions (a reward source's matter). A failed
    correctness gives NaN (and takes no part in the shares and statistics).
    Shapes: lengths [N], completions (N texts), group_ids [N] -> the ``source`` column rewritten.
    """
    k = col(reward_names, source, "autothink")
    ok, known = correctness(rewards, reward_names, source, correct_threshold, "autothink")
    think = torch.tensor([not no_thinking(t or "", think_end) for t in completions], dtype=torch.bool)
    base = torch.where(think, torch.where(ok, torch.tensor(think_correct, dtype=torch.float64),
                                          torch.tensor(think_wrong, dtype=torch.float64)),
                       torch.where(ok, torch.tensor(nothink_correct, dtype=torch.float64),
                                   torch.tensor(nothink_wrong, dtype=torch.float64)))
    r = base.clone()
    L = lengths.to(torch.float64)
    for want, coef, sign in ((True, length_alpha, -1.0), (False, length_beta, 1.0)):
        if coef <= 0:
            continue
        rows = known & (ok == want)
        mean, std, cnt = group_stats(L, group_ids, rows)
        z = (L - mean) / std.clamp(min=1e-6)
        # correct: exp(-alpha z) - 1 (shorter than the group's correct ones: > 0); wrong: 1 - exp(-beta z)
        bonus = -sign * (torch.exp(-coef * z) - 1.0)
        r = torch.where(rows & (cnt > 1), r + bonus, r)
    n = int(known.sum())
    if n and balance_rate < 1.0:
        f = float((think & known).sum()) / n
        for mode, share in ((think, f), (~think, 1.0 - f)):
            if share > balance_rate:
                lam = min(1.0, max(0.0, balance_slope * (share - balance_rate)))
                r = torch.where(mode, (1.0 - lam) * r + lam * (base - balance_drop), r)
    r = torch.where(known, r, torch.full_like(r, NAN))
    return {"rewards": with_column(rewards, k, r)}


__all__ = ["thinkdial_budget", "autothink", "no_thinking", "mode_budgets", "in_phase_two", "THINKDIAL_RATIOS"]
