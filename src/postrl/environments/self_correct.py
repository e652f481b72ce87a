"""SCoRe: two-attempt self-correction episodes, the reward-shaping bonus and the KL on the first attempt.

"Training Language Models to Self-Correct via Reinforcement Learning" (SCoRe): the model answers (attempt 1), reads
an instruction to find its mistake and try again, answers again (attempt 2); both attempts are verified. Stage I
trains attempt 2 for reward while a strong KL keeps attempt 1 near the base model (``attempt_kl`` on attempt 1
only); stage II trains both attempts with the bonus alpha (r2 - r1) on the second (``score_bonus``).

    environment: {name: self_correct, max_turns: 2}
    rewards: [{name: environment}]
    shaping: [{name: score_bonus, stage: II, alpha: 10}]     # or stage: I with the regulariser below
    regularizers: [{name: attempt_kl, coef: 0.1}]           # stage I: beta_2 KL(pi || pi_ref) on attempt 1
    advantage: {name: turn_mapo}                             # or grpo on the episode's reward
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge

from postrl import registry
from postrl.environments import Environment
from postrl.environments.turns import taken_turn_rewards
from postrl.registry import register
from postrl.data import verify_row

INSTRUCTION = ("There might be an error in the solution above because of lack of understanding of the question. "
               "Please correct the error, if any, and rewrite the solution.")


@register("environment", "self_correct", source="Training Language Models to Self-Correct via Reinforcement Learning "
          "(SCoRe)")
class SelfCorrect(Environment):
    """Two attempts at the row's problem; each attempt is verified (turn rewards r1, r2); ``max_turns: 2``.

    reset(row): the prompt. step(attempt 1): reward r1 = the row's task verifier (``postrl.data.verify_row``) on
    it, observation ``instruction`` (SCoRe's self-correction instruction), not done. step(attempt 2): reward r2,
    done. A row without a verifier raises in ``reset`` (an environment error: that episode fails, counted).
    ``attempts`` (2): the number of attempts (more than 2 repeats the instruction; SCoRe uses 2).
    """

    observation_role = "user"

    def __init__(self, *, instruction: str = INSTRUCTION, attempts: Annotated[int, Ge(2)] = 2):
        self.instruction, self.attempts = instruction, attempts
        self.row: dict = {}
        self.k = 0

    def reset(self, row: dict) -> str:
        if verify_row("", row) is None:
            raise ValueError(f"self_correct: the row has no task verifier (task={row.get('task')!r})")
        self.row, self.k = dict(row), 0
        return str(row["prompt"])

    def step(self, action: str) -> tuple[str, float | None, bool, dict]:
        self.k += 1
        reward = float(verify_row(action, self.row))
        done = self.k >= self.attempts
        return ("" if done else self.instruction), reward, done, {}


@register("shaping", "score_bonus", source="Training Language Models to Self-Correct via Reinforcement Learning "
          "(SCoRe): stage I / stage II rewards")
def score_bonus(turn_rewards: torch.Tensor, turn_ends: torch.Tensor, env_errors: torch.Tensor | None = None, *,
                stage: Literal["I", "II"] = "II", alpha: Annotated[float, Ge(0)] = 10.0) -> dict:
    """SCoRe's rewards of a two-attempt episode from the attempts' verified rewards r1, r2 (``turn_rewards``).

    Stage II (default): turn rewards (r1, r2 + alpha (r2 - r1)), reward = r1 + r2 + alpha (r2 - r1): both attempts
    trained for correctness, and the bonus pays for improving (alpha (r2 - r1) > 0 for a fix, < 0 for breaking a
    right answer). Stage I: turn rewards (0, r2), reward = r2 (only attempt 2 is trained for reward; attempt 1 is
    held near the base model by ``attempt_kl``). An episode with an environment error (``env_errors``) or a NaN
    attempt reward gets NaN (excluded); an attempt that did not happen (the episode was cut) scores 0. Sets
    ``reward`` and ``turn_rewards`` (turn_mapo reads them; grpo reads ``reward``). alpha 10.0 (SCoRe takes alpha > 1;
    the abstract gives no value: assumed). Shapes: turn_rewards [N, K >= 2], turn_ends [N, K] -> reward [N],
    turn_rewards [N, K].
    """
    r, has, failed = taken_turn_rewards(turn_rewards, turn_ends, env_errors)
    r1, r2 = r[:, 0], r[:, 1] if r.shape[1] > 1 else torch.zeros_like(r[:, 0])
    out = torch.zeros_like(r)
    if stage == "II":
        out[:, 0], reward = r1, r1 + r2 + alpha * (r2 - r1)
        if r.shape[1] > 1:
            out[:, 1] = r2 + alpha * (r2 - r1)
    else:
        reward = r2
        if r.shape[1] > 1:
            out[:, 1] = r2
    out = torch.where(has, out, torch.full_like(out, math.nan))
    nan = torch.full_like(reward, math.nan)
    return {"reward": torch.where(failed, nan, reward).float(), "turn_rewards": out.float()}


@register("regularizer", "attempt_kl", source="Training Language Models to Self-Correct via Reinforcement Learning "
          "(SCoRe): stage I's KL on the first attempt")
def attempt_kl(logp: torch.Tensor, ref_logp: torch.Tensor, turn_index: torch.Tensor, *,
               attempts: tuple[int, ...] = (0,), estimator: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = "k3"
               ) -> torch.Tensor:
    """R_t = KL_t(pi || pi_ref) on the tokens of the listed attempts, 0 elsewhere: SCoRe stage I's beta_2 term.

    KL_t = the ``estimator`` (kind ``kl``, default k3) of (logp_t, ref_logp_t); the attempt of token t is the
    per-token field ``turn_index`` (the model turn each completion token belongs to, -1 on environment tokens;
    written by the multi-turn rollout), so ``attempts: [0]`` (default) is the first attempt only. ``coef`` is
    beta_2; the loss adds coef * sum_t w_t R_t with the run's aggregation weights. Use it besides (or instead of)
    the run's ``kl`` (SCoRe's beta_1 on every turn). Shapes: logp, ref_logp, turn_index [N, T] -> [N, T].
    """
    sel = torch.zeros_like(turn_index, dtype=torch.bool)
    for a in attempts:
        sel |= turn_index == int(a)
    kl = registry.get("kl", estimator)(logp, ref_logp)
    return kl * sel.to(kl.dtype)
