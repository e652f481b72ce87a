"""Policy losses: ``loss(logp, old_logp, advantages, [mask, entropy, ...], *, params) -> ([N, T] loss, info)``.

Every loss returns the per-token loss matrix L (to be minimised) and a dict of per-token diagnostics (bool
tensors are reported as the aggregated fraction of tokens; ``ratio`` as its maximum). The scalar loss is
``sum(w * L)`` with the aggregation's weights ``w`` (see :mod:`postrl.losses.aggregation`).

Notation: rho_t = exp(logp_t - old_logp_t) (the log-ratio is clamped to [-20, 20] before the exp, as verl does),
A = advantages ([N] broadcast over tokens, or [N, T]), m = mask, |o_i| = sum_t m_it, sg = stop-gradient.

A *sequence-level* loss (``fn.sequence_level = True``: gspo, gmpo) puts the same per-sequence value on every
token of a row; its papers average over sequences, which is the ``sequence`` aggregation (alias of
``seq_mean_token_mean``; verl forces it for geo_mean and sapo, and passes ``loss_agg_mode`` through for gspo).
Under a token-level aggregation each sequence is weighted by its length instead: the trainer warns
(:func:`postrl.losses.check_aggregation`).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Lt

from postrl.registry import register

LOG_RATIO_CLAMP = 20.0


def _adv(advantages: torch.Tensor) -> torch.Tensor:
    """[N] -> [N, 1] (broadcast over tokens); [N, T] unchanged."""
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def _ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


ClipLow = Annotated[float, Ge(0), Lt(1)]  # a lower clip 1 - eps_low of a ratio: the bound stays positive
ClipHigh = Annotated[float, Ge(0)]
Positive = Annotated[float, Gt(0)]


# ---------------------------------------------------------------------------------------------- PPO family


@register("loss", "ppo_clip", source="PPO (Schulman et al. 2017); clip-higher from DAPO; verl vanilla; TRL grpo")
def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
             eps_low: ClipLow = 0.2, eps_high: ClipHigh = 0.2, dual_clip: Annotated[float, Gt(1)] | None = None):
    """L_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high)), rho_t = exp(logp_t - old_logp_t).

    Clip-higher (DAPO): eps_high > eps_low, e.g. 0.2 / 0.28 (verl ``clip_ratio_low/high``, TRL ``epsilon`` /
    ``epsilon_high``). Dual-clip (Ye et al. 2020): for A < 0, L_t = min(L_t, -A c) with c = ``dual_clip`` > 1;
    verl's ``vanilla`` loss applies c = 3 by default (``clip_ratio_c``), TRL none; postrl default: none.
    Shapes: logp, old_logp [N, T]; advantages [N] or [N, T] -> ([N, T] loss, diagnostics of [N, T] bools).
    """
    adv = _adv(advantages)
    ratio = _ratio(logp, old_logp)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    info = {
        "ratio": ratio.detach(),
        "clip_low": ((ratio < 1.0 - eps_low) & (adv < 0)).detach(),
        "clip_high": ((ratio > 1.0 + eps_high) & (adv > 0)).detach(),
    }
    if dual_clip is not None:
        pg3 = -adv * dual_clip
        info["clip_dual"] = ((loss > pg3) & (adv < 0)).detach()
        loss = torch.where(adv < 0, torch.minimum(loss, pg3), loss)
    return loss, info


@register("loss", "gspo", source="Group Sequence Policy Optimization (Zheng et al. 2025); verl gspo; "
          "TRL importance_sampling_level='sequence'")
def gspo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
         eps_low: ClipLow = 3e-4, eps_high: ClipHigh = 4e-4):
    """Sequence-level ratio s_i = exp((1/|o_i|) sum_t m_it (logp_it - old_logp_it)), clipped at sequence level.

    GSPO-token form (verl ``gspo``): s_it = sg(s_i) * pi_theta(o_it) / sg(pi_theta(o_it)), so the value of s_it is
    s_i and d s_it / d logp_it = s_i;  log s_it is clamped at 10 (verl).
    L_it = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high)).
    With the ``sequence`` (= seq_mean_token_mean) aggregation and one advantage per sequence this is exactly the
    paper's objective (1/G) sum_i min(s_i A_i, clip(s_i) A_i) with its gradient, and equal to TRL
    ``importance_sampling_level='sequence', loss_type='grpo'``. Defaults eps_low = 3e-4, eps_high = 4e-4 (GSPO
    paper section 5.1; TRL ``epsilon=3e-4, epsilon_high=4e-4``; verl ``clip_ratio_low/high``).
    A row with no token (|o_i| = 0) gets s_i = 1. Sequence-level: pair with ``loss.agg=sequence`` (verl 0.9.1
    passes ``loss_agg_mode`` through for gspo, so verl's equivalent is ``loss_agg_mode=seq-mean-token-mean``; its
    default token-mean weights each sequence by its length; postrl honours ``loss.agg`` and warns when it is a
    token-level one).
    """
    adv = _adv(advantages)
    lens = mask.sum(-1).clamp(min=1.0)
    log_s = ((logp - old_logp) * mask).sum(-1) / lens  # [N]
    log_sit = (logp - logp.detach() + log_s.detach().unsqueeze(-1)).clamp(max=10.0)
    s = torch.exp(log_sit)
    pg1 = -adv * s
    pg2 = -adv * s.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    sd = s.detach()
    info = {
        "ratio": sd,
        "clip_low": ((sd < 1.0 - eps_low) & (adv < 0)).expand_as(sd),
        "clip_high": ((sd > 1.0 + eps_high) & (adv > 0)).expand_as(sd),
    }
    return loss, info


gspo.sequence_level = True


@register("loss", "gmpo", source="Geometric-Mean Policy Optimization (Zhao et al. 2025); verl geo_mean")
def gmpo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
         eps_low: ClipHigh = 0.4, eps_high: ClipHigh = 0.4):
    """Geometric mean of the token ratios, clipped in log space (verl ``geo_mean``).

    d_t = logp_t - old_logp_t (clamped to [-20, 20]); c_t = clip(d_t, -eps_low, eps_high);
    d'_t = sgn(A) min(sgn(A) d_t, sgn(A) c_t)  (pessimistic: clipping only binds in the direction A favours);
    r_i = exp(sum_t m_it d'_t / (|o_i| + 1e-8));  A_i = sum_t m_it A_it / (|o_i| + 1e-8);
    sequence loss l_i = -A_i r_i, put on every token of row i (sequence-level loss).
    Defaults eps_low = eps_high = 0.4: the paper's clip range (e^-0.4, e^0.4) (verl ``clip_ratio_low/high``
    read in log space). verl forces seq-mean-token-mean for geo_mean whatever ``loss_agg_mode`` says: mean_i l_i
    over all rows, which postrl's ``sequence`` aggregation gives (``loss.agg_rows=all``, the default).
    """
    adv = _adv(advantages).expand_as(logp)
    d = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sgn = torch.sign(adv)
    c = d.clamp(-eps_low, eps_high)
    d_min = sgn * torch.minimum(sgn * d, sgn * c)
    n = mask.sum(-1)
    ratio = torch.exp((d_min * mask).sum(-1) / (n + 1e-8))
    a_seq = (adv * mask).sum(-1) / (n + 1e-8)
    seq_loss = -a_seq * ratio
    loss = seq_loss.unsqueeze(-1).expand_as(logp)
    clipped = (d != c).detach()
    info = {
        "ratio": ratio.detach().unsqueeze(-1).expand_as(logp),
        "clip_low": clipped & (adv < 0),
        "clip_high": clipped & (adv > 0),
    }
    return loss, info


gmpo.sequence_level = True


# ---------------------------------------------------------------------------------------------- REINFORCE family


@register("loss", "gpg", source="GPG: A Simple and Strong RL Baseline (Chu et al. 2025); verl gpg")
def gpg(logp: torch.Tensor, advantages: torch.Tensor):
    """L_t = -A_t logp_t (plain policy gradient, no ratio, no clipping; verl ``gpg``)."""
    return -_adv(advantages) * logp, {}


@register("loss", "cispo", source="MiniMax-M1 (CISPO); verl cispo; TRL loss_type='cispo'")
def cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
          eps_high: Annotated[float, Gt(-1)] = 4.0, eps_low: ClipLow | None = None):
    """L_t = -sg(min(rho_t, 1 + eps_high)) A_t logp_t: the IS weight is clipped and detached, so the gradient
    flows through log pi only (d L / d logp_t = -sg(min(rho_t, 1 + eps_high)) A_t) and no token is dropped.
    The cap 1 + eps_high is positive; below 1 (eps_high < 0) it scales every weight down (TRL's
    ``loss_type='cispo'`` with ``epsilon_high`` left at ``epsilon`` = 0.2 caps at 0.2).

    ``eps_low`` (default None: no lower bound, as MiniMax-M1 which sets eps_low^IS large and tunes eps_high^IS
    only) clips the weight from below at 1 - eps_low. Default eps_high = 4.0: an IS-weight cap of 5.0 (postrl's
    choice; the paper leaves it to tuning). Anchors: TRL ``loss_type='cispo'`` caps at ``epsilon_high`` itself
    (TRL ``epsilon_high = 1 + eps_high``, no lower bound); verl ``cispo`` clamps to
    [1 - clip_ratio_low, 1 + clip_ratio_high] (set ``eps_low`` to match).
    """
    adv = _adv(advantages)
    ratio = _ratio(logp, old_logp).detach()
    w = ratio.clamp(max=1.0 + eps_high) if eps_low is None else ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -w * adv * logp
    info = {"ratio": ratio, "clip_high": (ratio > 1.0 + eps_high).expand_as(logp)}
    if eps_low is not None:
        info["clip_low"] = (ratio < 1.0 - eps_low).expand_as(logp)
    return loss, info


@register("loss", "dispo", source="DISPO: Enhancing Training Efficiency and Stability in Reinforcement Learning "
          "for Large Language Model Mathematical Reasoning")
def dispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
          eps_pos_low: ClipLow = 0.2, eps_pos_high: ClipHigh = 0.28, eps_neg_low: ClipLow = 0.2,
          eps_neg_high: ClipHigh = 0.28, mode: Literal["mask", "clip"] = "mask"):
    """REINFORCE with IS-weight clipping and four bounds (after DISPO): L_t = -sg(w_t) A_t logp_t.

    Correct responses (A > 0) use the region [1 - eps_pos_low, 1 + eps_pos_high], incorrect ones (A < 0)
    [1 - eps_neg_low, 1 + eps_neg_high] (up-clip / down-clip decoupled for each: four regimes).
    ``mode='mask'`` (default): w_t = rho_t inside the region and 0 outside, i.e. no gradient outside the trust
    region (the abstract's fix of CISPO, which clips the weight but keeps a gradient there);
    ``mode='clip'``: w_t = clip(rho_t, lo, hi) (CISPO-style, four bounds).
    Assumed where the abstract is open: "correct" = positive advantage (binary verifiable reward under group
    normalisation); the exact bound values are not in the abstract, so the defaults are postrl's (DAPO's
    0.2 / 0.28 for both signs).
    """
    adv = _adv(advantages)
    ratio = _ratio(logp, old_logp).detach()
    pos = adv > 0
    lo = torch.where(pos, ratio.new_tensor(1.0 - eps_pos_low), ratio.new_tensor(1.0 - eps_neg_low))
    hi = torch.where(pos, ratio.new_tensor(1.0 + eps_pos_high), ratio.new_tensor(1.0 + eps_neg_high))
    if mode == "mask":
        w = ratio * ((ratio >= lo) & (ratio <= hi)).to(ratio.dtype)
    else:
        w = torch.maximum(torch.minimum(ratio, hi), lo)
    loss = -w * adv * logp
    info = {"ratio": ratio, "clip_low": (ratio < lo).expand_as(logp), "clip_high": (ratio > hi).expand_as(logp)}
    return loss, info


# ---------------------------------------------------------------------------------------------- soft gate


@register("loss", "sapo", source="Soft Adaptive Policy Optimization (SAPO); verl sapo; TRL loss_type='sapo'")
def sapo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
         tau_pos: Positive = 1.0, tau_neg: Positive = 1.05):
    """L_t = -f_t(rho_t) A_t with the soft gate f(r) = (4 / tau) sigmoid(tau (r - 1)) in place of hard clipping;
    tau = tau_pos where A_t > 0, tau_neg otherwise.

    f(1) = 2 / tau and f'(1) = 1, so on-policy the gradient equals PPO's; far off-policy tokens are smoothly
    down-weighted instead of cut. Defaults tau_pos = 1.0, tau_neg = 1.05 (verl ``tau_pos``/``tau_neg``, TRL
    ``sapo_temperature_pos/neg``). verl forces seq-mean-token-mean for sapo and TRL's ``loss_type='sapo'``
    aggregates the same way (postrl: ``loss.agg=seq_mean_token_mean``; postrl honours whatever ``loss.agg`` says).
    """
    adv = _adv(advantages)
    ratio = _ratio(logp, old_logp)
    tau = torch.where(adv > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv, {"ratio": ratio.detach()}


@register("loss", "vespo", source="VESPO: Variational Sequence-Level Soft Policy Optimization (arXiv 2602.10693); "
          "TRL loss_type='vespo'")
def vespo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
          k_pos: Annotated[float, Ge(0)] = 2.0, lambda_pos: Positive = 3.0, k_neg: Annotated[float, Ge(0)] = 3.0,
          lambda_neg: Positive = 2.0):
    """L_t = -sg(phi(w_i)) A_t logp_t: a REINFORCE term whose sequence weight phi is a gamma-shaped soft trust region
    on the sequence's importance ratio w_i (after VESPO, as TRL implements it).

    log w_i = clamp(sum_t m_it clamp(logp_it - old_logp_it, -20, 20), log 1e-8, 20) (a sum over the sequence, not a
    mean); phi(w) = exp(lambda + k log w - lambda w) = e^lambda w^k e^(-lambda w), so phi(1) = 1 and phi falls off
    for w far below or above 1; (k, lambda) = (k_pos, lambda_pos) where A >= 0, else (k_neg, lambda_neg); phi is
    detached (a gradient scale), NaN / inf -> 0. Defaults k_pos = 2, lambda_pos = 3, k_neg = 3, lambda_neg = 2
    (TRL's ``vespo_*`` defaults). Assumed where only TRL's code was read (the paper's abstract is not in postrl's
    notes): TRL's form and clamps. Equal to TRL ``loss_type='vespo'`` with ``loss.agg=token_mean`` (TRL's dapo
    normalisation), except that with vLLM TRL folds its sampler ratio into w, where postrl's ``loss.tis``
    multiplies the loss instead. Shapes: logp, old_logp, mask [N, T]; advantages [N] or [N, T].
    """
    adv = _adv(advantages)
    lower = math.log(1e-8)
    log_w = ((logp - old_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask).sum(-1, keepdim=True)
    log_w = log_w.clamp(lower, LOG_RATIO_CLAMP)
    pos = adv >= 0
    k = torch.where(pos, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))
    lam = torch.where(pos, log_w.new_tensor(lambda_pos), log_w.new_tensor(lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return -phi * adv * logp, {"ratio": _ratio(logp, old_logp).detach(), "phi": phi.expand_as(logp)}


# ---------------------------------------------------------------------------------------------- entropy mechanism


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / (mask.sum() + 1e-8)  # verl_F.masked_mean


@register("loss", "clip_cov", source="The Entropy Mechanism of Reinforcement Learning for Reasoning Language "
          "Models (Clip-Cov); verl clip_cov")
def clip_cov(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
             eps_low: ClipLow = 0.2, eps_high: ClipHigh = 0.2, clip_cov_ratio: Positive = 2e-4,
             clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0):
    """PPO-clip, except that a few tokens with high logp-advantage covariance get no gradient (Clip-Cov).

    cov_t = (A_t - mean(A)) (logp_t - mean(logp)) (means over the mask of the forward pass, logp detached);
    candidates: m_t = 1, not already clipped by PPO (clipped branch > unclipped) and lb < cov_t < ub;
    selected: min(k, #candidates) candidates drawn uniformly at random (torch's global RNG, like verl's
    ``randperm``), k = max(floor(clip_cov_ratio * sum_t m_t), 1);
    L_t = max(-A rho, -A clip(rho, 1-eps_low, 1+eps_high)) * (0 if selected else 1).
    Defaults = verl's (``clip_cov_ratio`` 2e-4, ``clip_cov_lb`` 1.0, ``clip_cov_ub`` 5.0; eps 0.2 =
    ``clip_ratio``). As in verl the selection is made per forward pass (micro-batch).
    Difference: postrl clamps the log-ratio to [-20, 20] before the exp (verl does not for clip_cov).
    """
    adv = _adv(advantages).expand_as(logp)
    ratio = _ratio(logp, old_logp)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    valid = mask > 0
    clipped = (pg2 > pg1) & valid
    with torch.no_grad():
        lp = logp.detach()
        cov = (adv - _masked_mean(adv, mask)) * (lp - _masked_mean(lp, mask))
        cand = valid & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        idx = torch.nonzero(cand)
        k = max(int(clip_cov_ratio * mask.sum().item()), 1)
        if len(idx) > 0:
            idx = idx[torch.randperm(len(idx))[: min(k, len(idx))].to(idx.device)]
        selected = torch.zeros_like(valid)
        selected[idx[:, 0], idx[:, 1]] = True
    corr = (~selected).to(logp.dtype)
    loss = torch.maximum(pg1, pg2) * corr
    info = {
        "ratio": ratio.detach(),
        "clip_low": ((ratio < 1.0 - eps_low) & (adv < 0)).detach(),
        "clip_high": ((ratio > 1.0 + eps_high) & (adv > 0)).detach(),
        "clip_cov": selected,
    }
    return loss, info


@register("loss", "kl_cov", source="The Entropy Mechanism of Reinforcement Learning for Reasoning Language "
          "Models (KL-Cov); verl kl_cov")
def kl_cov(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
           kl_cov_ratio: Positive = 2e-4, ppo_kl_coef: float = 0.1):
    """Unclipped policy gradient, plus a KL penalty on the tokens with the highest logp-advantage covariance.

    L_t = -A_t rho_t, and for the top-k tokens by cov_t = (A_t - mean A)(logp_t - mean logp) (means over the
    valid tokens of the forward pass, detached), L_t = -A_t rho_t + ppo_kl_coef |logp_t - old_logp_t|;
    k = max(1, floor(n_valid * kl_cov_ratio)); no valid token: no penalty.
    Defaults = verl's shipped config (``actor.policy_loss.kl_cov_ratio`` 2e-4, ``ppo_kl_coef`` 0.1; verl's code
    falls back to 1.0 only when the config value is None). Per forward pass (micro-batch), like verl.
    """
    adv = _adv(advantages).expand_as(logp)
    d = logp - old_logp
    ratio = _ratio(logp, old_logp)
    pg = -adv * ratio
    valid = mask > 0
    selected = torch.zeros_like(valid)
    with torch.no_grad():
        n = int(valid.sum())
        if n > 0:
            a = adv[valid].detach()
            lp = logp.detach()[valid]
            cov = (a - a.mean()) * (lp - lp.mean())
            k = max(1, int(n * kl_cov_ratio))
            top = torch.topk(cov, k, largest=True).indices
            flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
            selected.view(-1)[flat_valid[top]] = True
    loss = torch.where(selected, pg + ppo_kl_coef * d.abs(), pg)
    return loss, {"ratio": ratio.detach(), "kl_cov": selected}
