"""GARDO's gated and adaptive regularisation, carried over to language models: the KL only on the samples whose
reward is uncertain (a reward ensemble disagrees), and a reference model that is periodically reset to the policy.

"GARDO: Reinforcing Diffusion Models without Reward Hacking" (Gated and Adaptive Regularization with
Diversity-aware Optimization). Its third part, the diversity-amplified reward, is the shaping stage
``gardo_diversity`` (``postrl.shaping.diversity``).
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Ge, Gt, Le

from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl.losses.regularizers import KLName
from postrl.registry import get, register
from postrl.stages import StepEnd, Stateful

GARDO_SOURCE = "GARDO: Reinforcing Diffusion Models without Reward Hacking"


def ensemble_spread(raw_rewards: torch.Tensor, names: list[str], sources: list[str] | None) -> torch.Tensor:
    """Population std over the ensemble's member columns per row [N] float64 (NaN where a member failed)."""
    if sources is None:
        idx = list(range(len(names)))
    else:
        missing = [s for s in sources if s not in names]
        if missing:
            raise ValueError(f"field 'uncertainty_gate': sources '{missing[0]}' is not a reward column; columns: "
                             f"{', '.join(names) or '(none)'}")
        idx = [names.index(s) for s in sources]
    if len(idx) < 2:
        raise ValueError(f"field 'uncertainty_gate': an ensemble needs at least 2 member reward columns, got "
                         f"{len(idx)} ({', '.join(names[i] for i in idx) or 'none'}); list the members in 'sources'")
    return raw_rewards[:, idx].to(torch.float64).std(-1, unbiased=False)


@register("field", "uncertainty_gate", source=GARDO_SOURCE + " (uncertainty gate)")
def uncertainty_gate(ctx: ModelContext, batch: RolloutBatch, *, sources: list[str] | None = None,
                     top: Annotated[float, Gt(0), Le(1)] = 0.1) -> torch.Tensor:
    """1 for the rows whose reward ensemble disagrees most, 0 elsewhere [N] (GARDO's gate; no model is run).


    u_i = population std of the row's member rewards: the columns ``sources`` (default every reward source) of the
    reward matrix as scored (``raw_rewards``, so an ensemble shaping stage that merged the members into one column
    does not hide them); gate_i = 1 where u_i >= quantile_{1 - top}(u over the batch's valid rows with finite u)
    and u_i > 0 (linear interpolation; ties at the threshold included; ``top`` 0.1). A row that is not valid or
    whose member failed (NaN) gets 0."""
    names = list(batch.extra.get("raw_reward_names", batch.reward_names))
    u = ensemble_spread(batch.raw_rewards, names, sources)
    ok = torch.isfinite(u) & (batch.valid.bool() if batch.valid is not None else torch.ones_like(u, dtype=torch.bool))
    gate = torch.zeros_like(u)
    if bool(ok.any()):
        thr = torch.quantile(u[ok], 1.0 - top)
        gate = (ok & (u >= thr) & (u > 0)).to(torch.float64)
    return gate.float()


def _reset_needs(params: dict) -> tuple[str, ...]:
    return ("reference_reset",) if params.get("reset_every") is not None else ()


@register("regularizer", "gardo_kl", source=GARDO_SOURCE, needs=_reset_needs)
class GardoKL(Stateful):
    """KL only on the samples whose reward ensemble disagrees; optional periodic reference reset (after GARDO).

    ``coef`` is the KL coefficient (set ``kl.coef: 0`` to use this KL alone); the reference is reset to the policy
    every ``reset_every`` steps.

    R_{i,t} = gate_i * k(logp_t, ref_logp_t), k the ``estimator`` (kind ``kl``, default k3), gate_i = 1 for the
    batch's most uncertain rows (``uncertainty_gate``: the top ``top`` fraction, 0.1, by the spread of the reward
    ensemble's member columns ``sources``; both are this entry's parameters), 0 elsewhere: the regularisation
    falls on the samples whose proxy reward is least trustworthy, the others explore freely.
    ``reset_every`` (default none): after every reset_every-th step the reference becomes a copy of the policy, so
    the regularisation target keeps up with the policy's capability. How the reset reaches the reference: this
    stage then declares ``needs=('reference_reset',)``; the driver that owns the reference model copies the policy
    into it when the stage asks (``StepEnd.reset_reference``, at the end of the step, on every process alike);
    postrl's trainer saves the reset reference in its checkpoints (``reference/``) and refuses the option with
    ``model.lora`` (its reference is the base weights); the TRL adapter and the verl plug-in refuse it.
    Assumed where the abstract is open (GARDO's uncertainty comes from auxiliary reward models of images): the
    ensemble's std as the uncertainty, the top fraction 0.1 and a fixed period (postrl's defaults).
    Shapes: logp, ref_logp [N, T]; uncertainty_gate [N] -> [N, T].
    """

    _state = ("steps", "resets")

    def __init__(self, *, estimator: KLName = "k3", reset_every: Annotated[int, Ge(1)] | None = None):
        self.estimator, self.reset_every = estimator, reset_every
        self.steps = 0
        self.resets = 0

    def __call__(self, logp: torch.Tensor, ref_logp: torch.Tensor, uncertainty_gate: torch.Tensor) -> torch.Tensor:
        k = get("kl", self.estimator)(logp, ref_logp)
        return uncertainty_gate.to(k.dtype).unsqueeze(-1) * k

    def end_step(self, step: StepEnd) -> dict:
        self.steps += 1
        if self.reset_every is not None and self.steps % self.reset_every == 0:
            step.reset_reference()
            self.resets += 1
        return {"reference_resets": float(self.resets)}
