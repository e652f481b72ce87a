"""Offline preference losses (kind ``preference``): one value per (prompt, chosen, rejected) pair.

``postrl dpo`` (:mod:`postrl.train.preference`) computes, for each pair, the summed log-probability of each
completion's tokens under the policy (and, when the loss reads them, under the frozen reference) and calls the
configured stage with these fields (positional parameters, by name):

=====================================  =====  ==========================================================
field                                  shape  meaning
=====================================  =====  ==========================================================
``chosen_logps``, ``rejected_logps``   [B]    sum_t log pi_theta(y_t | x, y_<t) over the completion's
                                              tokens (EOS included), differentiable
``ref_chosen_logps``,                  [B]    the same under the reference model (no gradient); a stage
``ref_rejected_logps``                        that does not name them is reference-free (no reference is
                                              loaded)
``chosen_lengths``, ``rejected_lengths`` [B]  the completions' token counts |y|
``margin``                             [B]    the pair file's ``margin`` column (0 where absent); RPO
                                              reads it as the reward gap r(x, y_c) - r(x, y_r)
=====================================  =====  ==========================================================

Every stage returns ``(loss [B], {"chosen_rewards": [B], "rejected_rewards": [B]})``: the per-pair loss (the
driver minimises its mean over the batch, TRL's ``per_sequence_loss.mean()``) and the implicit rewards that
TRL logs as ``rewards/chosen`` / ``rewards/rejected`` (``rewards/margins`` = their difference,
``rewards/accuracies`` = the fraction with chosen > rejected), detached.

Notation: for a pair, rho_c = chosen_logps - ref_chosen_logps, rho_r = rejected_logps - ref_rejected_logps (the
log-ratios), Delta = rho_c - rho_r, a_c = chosen_logps / |y_c| and a_r = rejected_logps / |y_r| (the average
per-token log-probs), sigma the logistic function, log sigma computed by ``F.logsigmoid``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from annotated_types import Ge, Gt, Lt

from postrl.registry import register

Beta = Annotated[float, Gt(0)]


def _smoothed(z: torch.Tensor, eps: float) -> torch.Tensor:
    """-(1 - eps) log sigma(z) - eps log sigma(-z): the logistic loss with labels smoothed by eps."""
    loss = -F.logsigmoid(z)
    if eps:
        loss = (1.0 - eps) * loss - eps * F.logsigmoid(-z)
    return loss


def _out(loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor):
    return loss, {"chosen_rewards": chosen.detach(), "rejected_rewards": rejected.detach()}


def _lengths(lengths: torch.Tensor) -> torch.Tensor:
    return lengths.to(torch.float32).clamp(min=1.0)


# ---------------------------------------------------------------------------------------------- with a reference


@register("preference", "sigmoid", source="Direct Preference Optimization: Your Language Model is Secretly a Reward "
          "Model (Rafailov et al. 2023); cDPO (Mitchell 2023); TRL DPOTrainer loss_type='sigmoid'")
def sigmoid(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
            ref_rejected_logps: torch.Tensor, *, beta: Beta = 0.1,
            label_smoothing: Annotated[float, Ge(0), Lt(0.5)] = 0.0):
    """DPO: L = -log sigma(beta * Delta), Delta = (logp_c - ref_c) - (logp_r - ref_r); cDPO with label smoothing.

    With label_smoothing = eps > 0 (conservative DPO, "cDPO", Mitchell 2023, "A note on DPO with noisy
    preferences and relationship to IPO": each label is flipped with probability eps):
    L = -(1 - eps) log sigma(beta Delta) - eps log sigma(-beta Delta).
    Rewards: beta * rho_c, beta * rho_r. Defaults beta = 0.1, eps = 0 (TRL ``DPOConfig``).
    Equal (values and gradients, ``tests/test_preference.py``) to TRL ``DPOTrainer`` ``loss_type='sigmoid'``
    (eps = 0; TRL 1.x has no label smoothing for sigmoid) and, for eps > 0, to TRL ``CPOTrainer.cpo_loss``
    ``loss_type='sigmoid', label_smoothing=eps`` fed the log-ratios (the formula older TRL DPOTrainers applied).
    Shapes: every field [B] -> loss [B].
    """
    rho_c = chosen_logps - ref_chosen_logps
    rho_r = rejected_logps - ref_rejected_logps
    return _out(_smoothed(beta * (rho_c - rho_r), label_smoothing), beta * rho_c, beta * rho_r)


@register("preference", "ipo", source="A General Theoretical Paradigm to Understand Learning from Human Preferences "
          "(Azar et al. 2023, IPO); TRL DPOTrainer loss_type='ipo'")
def ipo(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
        ref_rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor, rejected_lengths: torch.Tensor, *,
        beta: Beta = 0.1, length_normalize: bool = True):
    """IPO: L = (h - 1 / (2 beta))^2, h = rho_c / |y_c| - rho_r / |y_r| (the squared loss of the paper's Eq. 17).

    beta is the paper's regulariser tau. ``length_normalize`` (default True) divides each log-ratio by its
    completion's token count, as TRL does ("confirmed with the IPO authors": the paper's results use this form);
    False uses the summed log-ratios, h = Delta (the paper's equation as written). Rewards: beta * rho_c,
    beta * rho_r (TRL logs these for every loss type). Default beta = 0.1 (TRL). Equal to TRL ``DPOTrainer``
    ``loss_type='ipo'`` (length_normalize=True), values and gradients. Shapes: [B] -> [B].
    """
    rho_c = chosen_logps - ref_chosen_logps
    rho_r = rejected_logps - ref_rejected_logps
    h = rho_c / _lengths(chosen_lengths) - rho_r / _lengths(rejected_lengths) if length_normalize else rho_c - rho_r
    return _out((h - 1.0 / (2.0 * beta)) ** 2, beta * rho_c, beta * rho_r)


@register("preference", "hinge", source="SLiC-HF: Sequence Likelihood Calibration with Human Feedback (Zhao et al. "
          "2023); TRL DPOTrainer loss_type='hinge'")
def hinge(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
          ref_rejected_logps: torch.Tensor, *, beta: Beta = 0.1):
    """SLiC hinge: L = max(0, 1 - beta * Delta) (beta is the reciprocal of the SLiC margin delta = 1 / beta).

    Rewards: beta * rho_c, beta * rho_r. Default beta = 0.1 (TRL). Equal to TRL ``DPOTrainer``
    ``loss_type='hinge'``, values and (sub)gradients (at beta Delta = 1 both take relu's 0). Shapes: [B] -> [B].
    """
    rho_c = chosen_logps - ref_chosen_logps
    rho_r = rejected_logps - ref_rejected_logps
    return _out(torch.relu(1.0 - beta * (rho_c - rho_r)), beta * rho_c, beta * rho_r)


@register("preference", "robust", source="Provably Robust DPO: Aligning Language Models with Noisy Feedback "
          "(Chowdhury et al. 2024, rDPO); TRL DPOTrainer loss_type='robust'")
def robust(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
           ref_rejected_logps: torch.Tensor, *, beta: Beta = 0.1,
           label_smoothing: Annotated[float, Ge(0), Lt(0.5)] = 0.1):
    """rDPO: L = [-(1 - eps) log sigma(beta Delta) + eps log sigma(-beta Delta)] / (1 - 2 eps).

    eps = ``label_smoothing``, the probability that a preference label is flipped, in [0, 0.5); the unbiased
    estimate of the clean DPO loss under that noise (eps = 0 is DPO). Default eps = 0.1 (the value the rDPO paper
    recommends, TRL's docs; TRL's own default is 0.0), beta = 0.1. Rewards: beta * rho_c, beta * rho_r. Equal to
    TRL ``DPOTrainer`` ``loss_type='robust', label_smoothing=eps``, values and gradients. For the *conservative*
    (cDPO) label smoothing, which does not divide by 1 - 2 eps and adds the flipped term, see ``sigmoid``'s
    ``label_smoothing``. Shapes: [B] -> [B].
    """
    rho_c = chosen_logps - ref_chosen_logps
    rho_r = rejected_logps - ref_rejected_logps
    z = beta * (rho_c - rho_r)
    eps = label_smoothing
    loss = (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)
    return _out(loss, beta * rho_c, beta * rho_r)


@register("preference", "rpo", source="Reward-aware Preference Optimization: A Unified Mathematical Framework for "
          "Model Alignment (Sun et al. 2025, RPO); NeMo RL dpo.preference_loss=rpo_sq|rpo_bwd_kl|rpo_fwd_kl")
def rpo(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
        ref_rejected_logps: torch.Tensor, margin: torch.Tensor, chosen_lengths: torch.Tensor,
        rejected_lengths: torch.Tensor, *, beta: Beta = 0.1, eta: Annotated[float, Gt(0)] = 1.0,
        distance: Literal["sq", "bwd_kl", "fwd_kl"] = "bwd_kl", length_normalize: bool = False):
    """RPO: the policy's implicit reward gap matched to an explicit one, L = D(beta Delta || eta m).

    What RPO adds to DPO / IPO / SimPO: the *reward-aware* objective. The pair's explicit reward gap
    m = r(x, y_c) - r(x, y_r) (the pair file's ``margin`` column, e.g. a reward model's or a judge's scores;
    ``postrl pairs`` writes it) scaled by ``eta``, D_r = eta m, and the implicit gap D_pi = beta Delta are
    compared by a distance:

    * ``sq``:     L = (D_pi - D_r)^2
    * ``bwd_kl``: L = KL(Bern(sigma(D_r)) || Bern(sigma(D_pi)))
                    = sigma(D_r) (log sigma(D_r) - log sigma(D_pi)) + sigma(-D_r) (log sigma(-D_r) - log sigma(-D_pi))
    * ``fwd_kl``: L = KL(Bern(sigma(D_pi)) || Bern(sigma(D_r))) (the same with the two swapped)

    As m -> infinity ``bwd_kl`` becomes DPO's -log sigma(beta Delta) (plus a vanishing constant); with m equal for
    every pair ``sq`` is IPO-like with a target eta m. ``length_normalize``: the log-ratios divided by the
    completions' token counts (the framework's length-normalised implicit reward, NeMo RL
    ``preference_average_log_probs``). Defaults beta = 0.1, eta = 1.0 (NeMo ``gt_reward_scale``), distance
    ``bwd_kl`` (the form NeMo names rpo_bwd_kl), length_normalize False. After the RPO paper (its abstract names
    the framework; the three distances and their names follow NVIDIA's NeMo RL / NeMo-Aligner implementation,
    which this is not tested against: NeMo is not a dependency; values are checked by hand in the tests). The
    paper's multi-response and REINFORCE-LOO members of the framework are not part of this pairwise stage.
    Rewards: beta * rho_c, beta * rho_r. Shapes: [B] -> [B].
    """
    rho_c = chosen_logps - ref_chosen_logps
    rho_r = rejected_logps - ref_rejected_logps
    if length_normalize:
        delta = rho_c / _lengths(chosen_lengths) - rho_r / _lengths(rejected_lengths)
    else:
        delta = rho_c - rho_r
    d_pi = beta * delta
    d_r = eta * margin.to(d_pi.dtype)
    if distance == "sq":
        loss = (d_pi - d_r) ** 2
    else:
        lp_pos, lp_neg = F.logsigmoid(d_pi), F.logsigmoid(-d_pi)
        lr_pos, lr_neg = F.logsigmoid(d_r), F.logsigmoid(-d_r)
        if distance == "bwd_kl":
            loss = lr_pos.exp() * (lr_pos - lp_pos) + lr_neg.exp() * (lr_neg - lp_neg)
        else:
            loss = lp_pos.exp() * (lp_pos - lr_pos) + lp_neg.exp() * (lp_neg - lr_neg)
    return _out(loss, beta * rho_c, beta * rho_r)


# ---------------------------------------------------------------------------------------------- reference-free


@register("preference", "simpo", source="SimPO: Simple Preference Optimization with a Reference-Free Reward (Meng "
          "et al. 2024); TRL CPOTrainer loss_type='simpo', cpo_alpha=0")
def simpo(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
          rejected_lengths: torch.Tensor, *, beta: Beta = 2.0, gamma: Annotated[float, Ge(0)] = 1.0,
          label_smoothing: Annotated[float, Ge(0), Lt(0.5)] = 0.0):
    """SimPO: L = -log sigma(beta a_c - beta a_r - gamma), a = logp / |y| (reference-free, length-normalised).

    The reward is the average log-probability beta * logp / |y| (no reference model); gamma > 0 is the target
    reward margin. With label_smoothing eps: L = -(1 - eps) log sigma(z) - eps log sigma(-z), z = beta (a_c - a_r)
    - gamma (TRL's option). Rewards: beta a_c, beta a_r. Defaults beta = 2.0, gamma = 1.0 (postrl's: the SimPO
    paper's beta is of order 2 and gamma / beta of order 0.5; TRL ``CPOConfig`` defaults beta = 0.1,
    simpo_gamma = 0.5). Equal to TRL ``CPOTrainer.cpo_loss`` with ``loss_type='simpo', simpo_gamma=gamma,
    cpo_alpha=0`` (no NLL term) on the average log-probs, values and gradients. Shapes: [B] -> [B].
    """
    r_c = beta * chosen_logps / _lengths(chosen_lengths)
    r_r = beta * rejected_logps / _lengths(rejected_lengths)
    return _out(_smoothed(r_c - r_r - gamma, label_smoothing), r_c, r_r)


@register("preference", "alphapo", source="AlphaPO -- Reward shape matters for LLM alignment (Gupta et al. 2025); "
          "TRL CPOTrainer loss_type='alphapo' (simpo with alpha)")
def alphapo(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor,
            rejected_lengths: torch.Tensor, *, alpha: float = 0.25, beta: Beta = 2.0,
            gamma: Annotated[float, Ge(0)] = 1.0, label_smoothing: Annotated[float, Ge(0), Lt(0.5)] = 0.0):
    """AlphaPO: SimPO with the alpha-shaped reward r = beta (1 - p^-alpha) / alpha, p = exp(logp / |y|).

    p = pi(y | x)^(1 / |y|) is the length-normalised sequence probability, so p^-alpha = exp(-alpha logp / |y|);
    L = -log sigma(r_c - r_r - gamma) (with label smoothing eps as in ``simpo``). alpha shapes the reward: alpha -> 0
    gives SimPO's log reward beta logp / |y| (alpha = 0 is computed as that limit); alpha > 0 bends it so that
    the gradient weighs unlikely responses less, the paper's control of likelihood displacement and
    over-optimisation; alpha < 0 the other way. Rewards: r_c, r_r. Defaults alpha = 0.25, beta = 2.0, gamma = 1.0
    (postrl's; the paper tunes alpha per model). Equal to TRL ``CPOTrainer.cpo_loss`` with ``alpha=alpha,
    loss_type='simpo', simpo_gamma=gamma, cpo_alpha=0`` (what TRL's ``loss_type='alphapo'`` sets) on the average
    log-probs, values and gradients. Shapes: [B] -> [B].
    """
    a_c = chosen_logps / _lengths(chosen_lengths)
    a_r = rejected_logps / _lengths(rejected_lengths)
    if alpha == 0.0:
        r_c, r_r = beta * a_c, beta * a_r
    else:
        r_c = beta * (1.0 - torch.exp(-alpha * a_c)) / alpha
        r_r = beta * (1.0 - torch.exp(-alpha * a_r)) / alpha
    return _out(_smoothed(r_c - r_r - gamma, label_smoothing), r_c, r_r)



# ---------------------------------------------------------------------------------------------- distillation


@register("preference", "ssb", source="Semantic Soft Bootstrapping: Long Context Reasoning in LLMs without "
          "Reinforcement Learning (Mitra & Ulukus 2025)")
def ssb(chosen_logits: torch.Tensor, ref_chosen_logits: torch.Tensor, chosen_mask: torch.Tensor,
        chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
        ref_rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor, *,
        temperature: Annotated[float, Gt(0)] = 2.0, kd_weight: Annotated[float, Ge(0)] = 1.0,
        ce_weight: Annotated[float, Ge(0)] = 0.0):
    """SSB: the student (policy, bare prompt) matches the teacher's (reference, hinted prompt) token distributions.

    Semantic Soft Bootstrapping (abstract: "the same base language model plays the role of both teacher and
    student, but receives different semantic contexts about the correctness of its outcome"; the teacher sees the
    problem with a correct and the most common incorrect rollout and writes a robust solution y, "a sequence of
    logits ... which the student model tries to match ... from the bare question alone"). The pair file of
    ``postrl pairs --ssb``: ``chosen`` = y, ``ref_prompt`` = the hinted teacher prompt x_T (the reference reads it),
    ``prompt`` = the bare question x; ``rejected`` (the incorrect rollout) only enters the logged rewards. For
    temperature T and the reply's tokens t (mask m):

        KL_t = sum_v p_T(v) (log p_T(v) - log p_S(v)),  p_T = softmax(z_ref(x_T, y_<t) / T),  p_S = softmax(z(x, y_<t) / T)
        L    = kd_weight * T^2 * sum_t m_t KL_t / sum_t m_t  +  ce_weight * (-chosen_logps / |y|)

    (the teacher's distribution is fixed: no gradient reaches the reference). Defaults from the authors' code:
    T = 2.0, kd_weight 1, ce_weight 0 (pure logit distillation). The teacher is the frozen initial model (the
    reference: a copy of ``--model``, or with LoRA the policy with its adapter disabled, the paper's set-up: "same
    base weights as teacher (frozen), LoRA adapters on student"); its logits are computed when needed instead of
    stored (equal, for the same weights). The KD term of one pair equals T^2 times TRL's
    ``GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=0, temperature=T)`` ('batchmean' over the
    reply tokens) on the same logits (``tests/test_ssb_dapo.py``). Assumed: the per-pair token mean (the authors'
    'batchmean' pools the tokens of a batch; equal when the replies have one length). Rewards (TRL's logged
    names): log pi(y_c | x) - log pi_ref(y_c | x_T) and the same for the rejected rollout.
    Shapes: logits [B, T, V], chosen_mask [B, T], the rest [B] -> [B].
    """
    t = float(temperature)
    log_s = F.log_softmax(chosen_logits.float() / t, dim=-1)
    log_t = F.log_softmax(ref_chosen_logits.float().detach() / t, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)  # [B, T]
    m = chosen_mask.to(kl.dtype)
    loss = kd_weight * t * t * (kl * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    if ce_weight:
        loss = loss + ce_weight * (-chosen_logps / _lengths(chosen_lengths))
    return _out(loss, chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps)


# ---------------------------------------------------------------------------------------------- step-level, with a critic


@register("preference", "dapo_step", source="Improving Multi-Step Reasoning Abilities of Large Language Models with "
          "Direct Advantage Policy Optimization (Liu et al. 2024)")
def dapo_step(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
              ref_rejected_logps: torch.Tensor, chosen_advantage: torch.Tensor, rejected_advantage: torch.Tensor, *,
              beta: Beta = 1.0):
    """DAPO (step level, offline): each step's log-ratio regressed onto its critic advantage scaled by 1 / beta.

    Direct Advantage Policy Optimization (abstract: "a novel step-level offline RL algorithm" whose critic
    "predict[s] the reasoning accuracy at each step, thereby generating dense signals", actor and critic trained
    independently; its objective is "a quadratic loss that aligns scaled advantages with log-policy ratios"). A
    pair of ``postrl pairs --dapo`` is a state s (prompt + ``prefix``, the steps so far) and two next steps a_c, a_r
    sampled there from the reference policy, each with its advantage A(s, a) = V(s + a) - V(s) under a critic V
    (a PRM: ``postrl prm train``; the verifier's outcome after a final step). With rho = log pi_theta(a | s) - log
    pi_ref(a | s) summed over the step's tokens:

        L = 1/2 [ (rho_c - A_c / beta)^2 + (rho_r - A_r / beta)^2 ]

    the mean of DAPO's per-action loss over the state's two actions; its minimiser pi(a | s) = pi_ref(a | s)
    exp(A(s, a) / beta) is the KL-regularised improvement of pi_ref at every step (the partition function is 1 to
    first order because E_{a ~ pi_ref} A = 0 for the reference's own value). Rewards (TRL's logged names): beta
    rho_c, beta rho_r. Default beta 1.0. Assumed where the abstract is silent: the quadratic's exact form (log-ratio
    minus advantage / beta), beta, two actions per state, and the critic's form (a PRM's step score as V).
    Shapes: every field [B] -> [B].
    """
    rho_c = chosen_logps - ref_chosen_logps
    rho_r = rejected_logps - ref_rejected_logps
    loss = 0.5 * ((rho_c - chosen_advantage / beta) ** 2 + (rho_r - rejected_advantage / beta) ** 2)
    return _out(loss, beta * rho_c, beta * rho_r)
