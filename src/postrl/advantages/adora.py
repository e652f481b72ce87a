"""ADORA: GRPO advantages reweighted per group by an evolving utility signal (stateful).

"ADORA: Training Reasoning Models with Dynamic Advantage Estimation on Reinforcement Learning" (Advantage Dynamics
via Online Rollout Adaptation). The abstract gives no formula; the utility signal and the weights follow the
authors' released GRPO variant (a length-advantage test per group, disadvantageous groups scaled by lambda), and
the "evolving" part is a per-prompt moving average of that signal across the prompt's visits (see the class).
"""

from __future__ import annotations

import hashlib
import math
from typing import Annotated

import torch
from annotated_types import Ge, Gt, Le

from postrl.advantages import Eps, grpo
from postrl.groups import group_first_rows, group_sum, valid_mask
from postrl.registry import register
from postrl.stages import StepEnd, Stateful

_SOURCE = "ADORA: Training Reasoning Models with Dynamic Advantage Estimation on Reinforcement Learning"


def prompt_key(prompt: str) -> str:
    """A short stable key of a prompt's text (the utility's state is kept per prompt, JSON-serialisable)."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def length_utility(reward: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor,
                   threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u [ng] float64, first row [ng], group number of each row [N]): u_g = max length of the group's correct
    completions (r >= threshold) - mean length of its incorrect ones; NaN when the group has no correct or no
    incorrect valid completion."""
    first, inv = group_first_rows(group_ids)
    ng = int(first.numel())
    L = lengths.to(torch.float64)
    correct = valid & (reward.to(torch.float64) >= threshold)
    wrong = valid & ~correct
    max_pos = torch.full((ng,), -math.inf, dtype=torch.float64).scatter_reduce(
        0, inv, torch.where(correct, L, torch.full_like(L, -math.inf)), "amax")
    n_neg = group_sum(wrong.to(torch.float64), inv, ng)
    mean_neg = group_sum(torch.where(wrong, L, torch.zeros_like(L)), inv, ng) / n_neg.clamp(min=1.0)
    u = torch.where((n_neg > 0) & torch.isfinite(max_pos), max_pos - mean_neg, torch.full_like(mean_neg, math.nan))
    return u, first, inv


@register("advantage", "adora", source=_SOURCE, needs=("groups",))
class Adora(Stateful):
    """GRPO advantages damped (x lambda) in temporarily disadvantageous groups, by an evolving utility (after ADORA).

    Each group's weight is 1 (temporarily advantageous) or lambda (disadvantageous), the category decided by a
    per-prompt utility signal that evolves over the prompt's visits.

    Per group g of prompt q, with correct = r >= ``threshold`` (default 1.0) and L the completion lengths:
      u_g     = max_{i in g, correct} L_i - mean_{i in g, incorrect} L_i     (the rollouts' utility signal; NaN when
                the group has no correct or no incorrect completion)
      U_q     = the prompt's utility from earlier steps (state; none on a first visit)
      u'_g    = (1 - beta) U_q + beta u_g   (U_q and u_g known);  U_q (u_g NaN);  u_g (first visit)
      w_g     = lambda if u'_g <= 0 else 1   (an undefined utility, NaN: 1)
      A_i     = w_g * (r_i - mean_g r) / (std_g r + eps)   (``grpo``, unbiased std, eps 1e-6)
    and after the step (``end_step``, every process's groups gathered): U_q <- u_g on a first visit, else
    (1 - beta) U_q + beta u_g (groups with a NaN utility leave U_q as it is); at most ``max_prompts`` prompts are
    kept (the least recently updated dropped first). A group is "advantageous" while its correct answers are longer
    than its wrong ones on average (the model is still learning to reason longer on it), "disadvantageous" when the
    correct answers are the short ones; the latter's advantages are damped, not removed.
    Defaults: threshold 1.0, lambda (``weight``) 0.1 and the length signal are the authors' released GRPO variant
    (``compute_grpo_outcome_advantage_length_weight``); beta (``momentum``) 0.5 and the per-prompt memory are
    assumed: the abstract's "evolving utility during online model rollouts" read as the prompt's utility averaged
    over its visits (beta = 1 forgets the past: exactly the released, stateless rule). The prompt is identified by
    its text (``prompts``; a 16-hex-digit hash in the state). Rows with ``valid`` False or a NaN reward take part in
    nothing and get 0. Shapes: reward [N], group_ids [N], lengths [N], prompts list[str] of N, valid [N] -> [N].
    """

    _state = ("utility",)

    def __init__(self, *, threshold: float = 1.0, weight: Annotated[float, Ge(0), Le(1)] = 0.1,
                 momentum: Annotated[float, Gt(0), Le(1)] = 0.5, max_prompts: Annotated[int, Ge(1)] = 100_000,
                 eps: Eps = 1e-6):
        self.threshold, self.weight, self.momentum = float(threshold), float(weight), float(momentum)
        self.max_prompts, self.eps = int(max_prompts), float(eps)
        self.utility: dict[str, float] = {}

    def _signal(self, reward, group_ids, lengths, prompts, valid):
        v = valid_mask(reward, valid)
        u, first, inv = length_utility(reward, group_ids, lengths, v, self.threshold)
        keys = [prompt_key(prompts[int(i)]) for i in first]
        return v, u, keys, inv

    def weights(self, u: torch.Tensor, keys: list[str]) -> torch.Tensor:
        """w_g [ng] from the rollouts' utilities u [ng] and the state (see the class docstring)."""
        b = self.momentum
        used = []
        for k, x in zip(keys, u.tolist()):
            old = self.utility.get(k)
            if old is None:
                used.append(x)
            elif math.isnan(x):
                used.append(old)
            else:
                used.append((1.0 - b) * old + b * x)
        used_t = torch.tensor(used, dtype=torch.float64)
        return torch.where(used_t <= 0, torch.full_like(used_t, self.weight), torch.ones_like(used_t))

    def __call__(self, reward: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, prompts: list,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
        v, u, keys, inv = self._signal(reward, group_ids, lengths, prompts, valid)
        w = self.weights(u, keys)
        adv = grpo(reward, group_ids, v, eps=self.eps).to(torch.float64) * w[inv]
        return torch.where(v, adv, torch.zeros_like(adv)).to(torch.float32)

    def observe(self, reward: torch.Tensor, group_ids: torch.Tensor, lengths: torch.Tensor, prompts: list,
                valid: torch.Tensor | None = None) -> None:
        _, u, keys, _ = self._signal(reward, group_ids, lengths, prompts, valid)
        for k, x in zip(keys, u.tolist()):
            self.record((k, x))

    def end_step(self, step: StepEnd) -> dict:
        b = self.momentum
        seen = [(k, x) for k, x in self.observed if not math.isnan(x)]
        for k, x in seen:  # every process's groups of this step, in rank order
            old = self.utility.pop(k, None)  # (re-inserted last: the most recently updated)
            self.utility[k] = x if old is None else (1.0 - b) * old + b * x
        while len(self.utility) > self.max_prompts:
            self.utility.pop(next(iter(self.utility)))
        out = {"prompts_tracked": float(len(self.utility))}
        if self.observed:
            out["disadvantageous_frac"] = sum(1 for k, _ in self.observed if self.utility.get(k, 1.0) <= 0) / \
                len(self.observed)
        return out
