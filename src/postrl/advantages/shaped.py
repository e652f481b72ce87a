"""Tier B advantage estimators from the seed papers (see METHODS.md section 3).

Where an abstract leaves the formula open, the docstring says "after <paper>" and states what was assumed.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import torch
from annotated_types import Ge, Gt, Interval, Le

from postrl.advantages import Eps, Singleton, grpo, singleton_stats, token_whiten
from postrl.groups import group_first_rows, group_index, group_stats, group_sum, valid_mask
from postrl.errors import ConfigError
from postrl.registry import register


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of x [N, T] over the mask (0 for rows without tokens), float64."""
    m = mask.to(x.dtype)
    return (x * m).sum(-1).to(torch.float64) / m.sum(-1).to(torch.float64).clamp(min=1.0)


# ------------------------------------------------------------------------------------------------------ GDPO
@register("advantage", "gdpo", source="GDPO: Group reward-Decoupled Normalization Policy Optimization; "
          "TRL multi_objective_aggregation='normalize_then_sum'; verl adv_estimator=gdpo (token_weighted, "
          "singleton=raw, eps=1e-6)", needs=("groups",))
def gdpo(rewards: torch.Tensor, reward_weights: torch.Tensor, group_ids: torch.Tensor,
         valid: torch.Tensor | None = None, completion_mask: torch.Tensor | None = None, *, eps: Eps = 1e-4,
         batch_norm: bool = True, token_weighted: bool = False, singleton: Singleton = "zero") -> torch.Tensor:
    """z-score every reward component within its group, sum with the weights, then normalise over the batch.

    "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization": GRPO on the
    summed reward maps distinct reward combinations to identical advantages (e.g. (0,0)/(1,0) and (0,0)/(1,1) both
    give +-0.707); normalising each component first keeps them apart.
      z_i^k = (r_i^k - mean_g r^k) / (std_g r^k + eps)    (unbiased std; 0 for a component constant in the group)
      s_i   = sum_k w_k z_i^k
      A_i   = (s_i - mean_B s) / (std_B s + eps)           (batch_norm=True; False: A_i = s_i)
    eps 1e-4 and the unbiased std over rows: TRL ``multi_objective_aggregation='normalize_then_sum'``, which this
    matches numerically (default).
    verl 0.9.1 ``adv_estimator=gdpo`` differs in three places, each an option: its components go through verl's
    GRPO (eps 1e-6: ``eps=1e-6``; a group of one gets mean 0 / std 1: ``singleton='raw'``, default 'zero' gives
    z = 0 there), and its final normalisation is ``masked_whiten`` over the tokens (``token_weighted=True``):
    A_i = (s_i - mu) / sqrt(var + 1e-8), mu and the unbiased var over all tokens of the batch, each row weighing
    its length |o_i| (eps inside the square root, not ``eps``). ``eps=1e-6, token_weighted=True, singleton=raw``
    reproduces verl.
    A NaN component is left out of that component's statistics and adds 0 to s_i (TRL nanmean / nansum); rows
    with ``valid`` False are excluded and get 0. Under DDP, "batch" is this process's rows (TRL and verl
    normalise over the gathered batch).
    Shapes: rewards [N, K], reward_weights [K], group_ids [N], valid [N], completion_mask [N, T] -> [N].
    """
    if token_weighted and completion_mask is None:
        raise ValueError("advantage.token_weighted: needs the batch's completion_mask")
    N, K = rewards.shape
    v = torch.isfinite(rewards).any(-1) if valid is None else (valid.bool() & torch.isfinite(rewards).any(-1))
    s = torch.zeros(N, dtype=torch.float64)
    for k in range(K):  # K reward components (a handful), not groups
        x = rewards[:, k]
        vk = v & torch.isfinite(x)
        mean, std, n = group_stats(x, group_ids, vk)
        mean, std = singleton_stats(mean, std, n, singleton)
        z = (x.to(torch.float64) - mean) / (std + eps)
        s = s + float(reward_weights[k]) * torch.where(vk, z, torch.zeros_like(z))
    if batch_norm and token_weighted:
        s = token_whiten(s, completion_mask.sum(-1), v)
    elif batch_norm:
        sv = s[v]
        mu = sv.mean() if sv.numel() else torch.zeros((), dtype=torch.float64)
        sd = sv.std() if sv.numel() > 1 else torch.zeros((), dtype=torch.float64)
        s = (s - mu) / (sd + eps)
    return torch.where(v, s, torch.zeros_like(s)).to(torch.float32)


# ------------------------------------------------------------------------------------------------------ MAPO
@register("advantage", "mapo", source="MAPO: Mixed Advantage Policy Optimization for Long-Horizon Multi-Turn Dialogue")
def mapo(reward: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
         mix: Annotated[float, Ge(0), Le(1)] = 0.5, eps: Eps = 1e-6) -> torch.Tensor:
    """A_i = mix * (r_i - mean_g r)/(std_g r + eps) + (1 - mix) * (r_i - mean_B r)/(std_B r + eps).

    After "MAPO: Mixed Advantage Policy Optimization": a mixed estimator combining turn-level normalisation (over
    the rollouts that share a turn's state, i.e. a group) with batch-level normalisation. Assumed: the mix is a
    convex combination with weight ``mix`` (default 0.5; 1 = GRPO, 0 = batch whitening); unbiased stds, eps 1e-6.
    In a single-turn batch a turn is the prompt; multi-turn rollouts give each turn's completions their own group
    id and the turn's Monte-Carlo return as ``reward``. The batch term is defined for a singleton group, so such a
    row keeps it (its group term is 0).
    Shapes: reward [N], group_ids [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    turn = grpo(reward, group_ids, v, scale="group", eps=eps).to(torch.float64)
    rv = reward[v].to(torch.float64)
    mu = rv.mean() if rv.numel() else torch.zeros((), dtype=torch.float64)
    sd = rv.std() if rv.numel() > 1 else torch.zeros((), dtype=torch.float64)
    batch = (reward.to(torch.float64) - mu) / (sd + eps)
    adv = mix * turn + (1 - mix) * batch
    return torch.where(v, adv, torch.zeros_like(adv)).to(torch.float32)


# ------------------------------------------------------------------------------------------------------ RL-ZVP
@register("advantage", "rl_zvp", source="No Prompt Left Behind: Exploiting Zero-Variance Prompts in LLM RL via "
          "Entropy-Guided Advantage Shaping (RL-ZVP)", needs=("groups",))
def rl_zvp(reward: torch.Tensor, group_ids: torch.Tensor, completion_mask: torch.Tensor, token_entropy: torch.Tensor,
           valid: torch.Tensor | None = None, *, alpha: Annotated[float, Ge(0)] = 0.1,
           threshold: float = 0.5, eps: Eps = 1e-6) -> torch.Tensor:
    """GRPO on groups with reward variance; token advantages +- alpha * normalised entropy on zero-variance groups.

    "No Prompt Left Behind" (RL-ZVP): a group whose valid rewards are all equal (n >= 2) gets
      A_{i,t} = s_g * alpha * H_{i,t} / (mean_{j in g, t'} H_{j,t'} + eps),
    s_g = +1 when the group's reward is > ``threshold`` (all correct) and -1 otherwise (all wrong); H_{i,t} is the
    policy's token entropy (``token_entropy``, from a no-grad forward the trainer runs), normalised by the mean
    entropy of the group's tokens so that alpha is the mean magnitude. Every other group: the GRPO advantage
    (unbiased std, eps 1e-6) on all its tokens. Assumed (the abstract leaves them open): the normalisation by the
    group's mean token entropy, alpha 0.1, threshold 0.5 (rewards in [0, 1]).
    Shapes: reward [N], group_ids [N], completion_mask [N, T], token_entropy [N, T], valid [N] -> [N, T].
    """
    v = valid_mask(reward, valid)
    mean, std, n = group_stats(reward, group_ids, v)
    base = grpo(reward, group_ids, v, eps=eps).to(torch.float64)
    zvp = v & (n > 1) & (std == 0)
    inv, ng = group_index(group_ids)
    m = completion_mask.to(torch.float32) * v.unsqueeze(-1)
    H = torch.nan_to_num(token_entropy.to(torch.float32)).mul_(m)
    h_mean = group_sum(H.sum(-1), inv, ng) / group_sum(m.sum(-1), inv, ng).clamp(min=1.0)
    # per-row scale of the entropy (zero-variance groups) and per-row GRPO advantage (the others)
    scale = torch.where(zvp, torch.where(mean > threshold, 1.0, -1.0) * alpha / (h_mean[inv] + eps), 0.0)
    base = torch.where(zvp, 0.0, base)
    return torch.addcmul(base.to(torch.float32).unsqueeze(-1), H, scale.to(torch.float32).unsqueeze(-1)).mul_(m)


# ------------------------------------------------------------------------------------------------------ ProGRPO/ARM
@register("advantage", "confidence_scaled", source="Back to Basics: Revisiting Exploration in RL for LLM Reasoning "
          "via Generative Probabilities (ProGRPO / ARM)", needs=("groups",))
def confidence_scaled(reward: torch.Tensor, group_ids: torch.Tensor, sampler_logprobs: torch.Tensor,
                      completion_mask: torch.Tensor, prompt_logprob: torch.Tensor, valid: torch.Tensor | None = None,
                      *, gamma: Annotated[float, Ge(0)] = 1.0, min_scale: Annotated[float, Gt(0), Le(1)] = 0.1,
                      eps: Eps = 1e-6) -> torch.Tensor:
    """GRPO advantages; positive ones are scaled down for answers more confident than their prompt is familiar.

    After "Back to Basics: Revisiting Exploration in RL for LLM Reasoning via Generative Probabilities" (ARM:
    Prompt Perplexity and Answer Confidence in the advantage, attenuating over-confident correct paths):
      c_i = exp(mean_t log pi(o_{i,t}))  (answer confidence, from the sampler's log-probs)
      PPL(q) = exp(-mean_t log pi(q_t))  (prompt perplexity, ``prompt_logprob`` = mean_t log pi(q_t), trainer no-grad)
      w_i = clamp((c_i * PPL(q))^(-gamma), min_scale, 1);  A_i = w_i * A_i^GRPO if A_i^GRPO > 0, else A_i^GRPO.
    Assumed (the abstract gives no formula): this product form, gamma 1.0, min_scale 0.1; "correct" = positive
    GRPO advantage. Shapes: reward [N], group_ids [N], sampler_logprobs [N, T], completion_mask [N, T],
    prompt_logprob [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid) & torch.isfinite(prompt_logprob)
    base = grpo(reward, group_ids, v, eps=eps).to(torch.float64)
    conf_log = _seq_mean(sampler_logprobs, completion_mask)
    w = torch.exp(-gamma * (conf_log - prompt_logprob.to(torch.float64))).clamp(min_scale, 1.0)
    adv = torch.where(base > 0, base * w, base)
    return torch.where(v, adv, torch.zeros_like(adv)).to(torch.float32)


# ------------------------------------------------------------------------------------------------------ RiskPO
def group_lower_quantile(x: torch.Tensor, group_ids: torch.Tensor, v: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-row lower alpha-quantile of its group's valid values: the ceil(alpha n)-th smallest (n valid rows)."""
    inv, ng = group_index(group_ids)
    xv = torch.where(v, x.to(torch.float64), torch.full_like(x, math.inf, dtype=torch.float64))
    order = torch.sort(xv, stable=True).indices
    order = order[torch.sort(inv[order], stable=True).indices]  # by group, then value
    size = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, torch.ones_like(inv))
    start = torch.cumsum(size, 0) - size
    n = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, v.long())
    k = (torch.ceil(alpha * n.to(torch.float64)).long() - 1).clamp(min=0)
    q = xv[order[(start + k).clamp(max=len(x) - 1)]] if len(x) else torch.zeros(0, dtype=torch.float64)
    return q[inv]


def _group_quantile(x: torch.Tensor, gid: torch.Tensor, q: float) -> torch.Tensor:
    """Per-row q-quantile of ``x`` over its group (every row counts), linear interpolation between order
    statistics as ``torch.quantile`` (position q (n - 1)); float64."""
    inv, ng = group_index(gid)
    x = x.to(torch.float64)
    order = torch.sort(x, stable=True).indices
    order = order[torch.sort(inv[order], stable=True).indices]  # by group, then value
    size = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, torch.ones_like(inv))
    start = torch.cumsum(size, 0) - size
    pos = q * (size - 1).clamp(min=0).to(torch.float64)
    lo, hi = torch.floor(pos).long(), torch.ceil(pos).long()
    xs = x[order]
    v = xs[start + lo] + (pos - lo.to(torch.float64)) * (xs[start + hi] - xs[start + lo])
    return v[inv]


def _papers(reward: torch.Tensor, group_ids: torch.Tensor, v: torch.Tensor, bundle_size: int):
    """RiskPO's bundling: (paper of each row [N] (-1: in none), paper scores [P], bundle of each paper [P]).

    Groups (questions) in order of first appearance form bundles of ``bundle_size``; paper j of a bundle takes the
    j-th valid completion (row order) of each of its questions, for j < the fewest valid completions of a question
    of the bundle (questions without a valid completion are left out); its score is the sum of their rewards."""
    N = len(reward)
    inv, ng = group_index(group_ids)
    first, _ = group_first_rows(group_ids)
    rank = torch.empty(ng, dtype=torch.long)
    rank[torch.argsort(first)] = torch.arange(ng)
    bundle = rank // bundle_size  # [ng]
    order = torch.sort(inv, stable=True).indices  # rows by group, row order within a group
    vv = v[order].long()
    csum = torch.cumsum(vv, 0)
    n_valid = torch.zeros(ng, dtype=torch.long).index_add_(0, inv, v.long())
    start = torch.cumsum(n_valid, 0) - n_valid  # valid rows before each group, in group order
    j = torch.empty(N, dtype=torch.long)
    j[order] = csum - vv - start[inv[order]]  # rank of a valid row among its group's valid rows
    nb = int(bundle.max()) + 1 if ng else 0
    big = torch.iinfo(torch.long).max
    m = torch.full((nb,), big, dtype=torch.long).scatter_reduce(
        0, bundle, torch.where(n_valid > 0, n_valid, torch.full_like(n_valid, big)), "amin")
    m = torch.where(m == big, torch.zeros_like(m), m)
    b_row = bundle[inv]
    inside = v & (j < m[b_row])
    width = int(m.max()) if nb else 0
    key = b_row * max(width, 1) + j
    paper = torch.full((N,), -1, dtype=torch.long)
    if bool(inside.any()):
        uniq, dense = torch.unique(key[inside], return_inverse=True)
        paper[inside] = dense
        scores = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, dense, reward[inside].to(torch.float64))
        return paper, scores, uniq // max(width, 1)
    return paper, torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long)


def _riskpo_check(params: dict, run, where: str) -> dict:
    if params.get("form") == "rvar_cvar" and not params.get("alpha", 0.25) < params.get("beta", 0.9):
        raise ConfigError(f"{where}: form rvar_cvar needs alpha < beta, got alpha={params.get('alpha', 0.25)}, "
                          f"beta={params.get('beta', 0.9)}")
    return params


@register("advantage", "riskpo", source="RiskPO: Risk-based Policy Optimization via Verifiable Reward for LLM "
          "Post-Training", needs=("groups",), check=_riskpo_check)
def riskpo(reward: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
           alpha: Annotated[float, Gt(0), Le(1)] = 0.25, omega: Annotated[float, Ge(0), Le(1)] = 0.5,
           scale: Literal["group", "none"] = "group", eps: Eps = 1e-6,
           form: Literal["mean_cvar", "rvar_cvar"] = "mean_cvar", beta: Annotated[float, Interval(gt=0, le=1)] = 0.9,
           mix: Annotated[float, Ge(0)] = 1.5, bundle_size: Annotated[int, Ge(1)] = 1,
           credit: Literal["uniform", "std"] = "uniform") -> torch.Tensor:
    """RiskPO: a Mixed Value-at-Risk advantage over bundles of questions ("papers"), every completion of a paper
    getting the paper's advantage.

    "RiskPO: Risk-based Policy Optimization" (a Mixed Value-at-Risk objective weighting several regions of the
    reward distribution; a bundling scheme aggregating several questions into bundles to enrich the feedback).

    Bundling (``bundle_size`` B, default 1 = no bundling; the authors' scripts use 5): groups (questions) in order
    of first appearance form bundles of B; paper j of a bundle is the j-th valid completion of each of its
    questions (j < the fewest valid completions of a question in it), with score S = the sum of their rewards
    (the authors' ``compute_grpo_bundle_rvar_outcome_advantage*``: papers "without replacement"). The risk
    measure is taken over the papers of a bundle; with B = 1 a paper is one completion and a bundle its group.
    Completions left out of every paper (a bundle's questions with more valid completions than its fewest) get 0.

    ``form='mean_cvar'`` (default; postrl's earlier reading, kept): MVaR = omega CVaR_alpha + (1 - omega) mean,
    score-function weight psi_alpha(S) = (S - q_alpha) 1{S <= q_alpha} / alpha (q_alpha = the bundle's lower
    alpha-quantile, the ceil(alpha n)-th smallest); u = omega psi_alpha(S) + (1 - omega) S;
    A = (u - mean_b u) / (std_b u + eps) (scale='group') or u - mean_b u (scale='none'); omega = 0 gives GRPO.

    ``form='rvar_cvar'`` (the authors' released estimator, ``grpo_bundle_RVaR_quantile_tracking`` with
    ``use_mixing_risk_measure=True``, ``natural_baseline_adv=True``, quantiles of the batch rather than tracked):
        q_a, q_b = quantile_b(S, alpha), quantile_b(S, beta)              (linear, as torch.quantile)
        rvar = (max(S - q_a, 0) - max(S - q_b, 0) + q_a - q_b) / (beta - alpha + eps)   (range VaR part)
        cvar = -max(q_a - S, 0) / (alpha + eps)                           (lower-tail CVaR part)
        A = (mix cvar + rvar) / (mix + 1), divided by (std_b S + eps) when scale='group' (std 1 for one paper)
    defaults beta 0.9, mix 1.5 (the code's w_mix); the authors' scripts use alpha 0.2, beta 0.9, B 5. Not
    reproduced: their stochastic-approximation tracking of the quantiles across steps (``use_q_track_mode``).

    ``credit``: 'uniform' (default) gives each completion its paper's A; 'std' divides it by the completion's
    question's reward std (unbiased, 1 when <= 1e-3) + eps (the code's ``credit_assign_mode='std'``).
    Unbiased stds; rows with ``valid`` False or a NaN reward take no part and get 0.
    Shapes: reward [N], group_ids [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    paper, S, pb = _papers(reward, group_ids, v, bundle_size)
    if len(S) == 0:
        return torch.zeros(len(reward))
    if form == "mean_cvar":
        ones = torch.ones(len(S), dtype=torch.bool)
        q = group_lower_quantile(S, pb, ones, alpha)
        psi = torch.where(S <= q, S - q, torch.zeros_like(S)) / alpha
        adv = grpo(omega * psi + (1 - omega) * S, pb, ones, scale=scale, eps=eps).to(torch.float64)
    else:
        _riskpo_check({"form": form, "alpha": alpha, "beta": beta}, None, "advantage")
        qa, qb = _group_quantile(S, pb, alpha), _group_quantile(S, pb, beta)
        rvar = ((S - qa).clamp(min=0) - (S - qb).clamp(min=0) + qa - qb) / (beta - alpha + eps)
        cvar = -(qa - S).clamp(min=0) / (alpha + eps)
        adv = (mix * cvar + rvar) / (mix + 1)
        if scale == "group":
            _, sd, n = group_stats(S, pb)
            adv = adv / (torch.where(n > 1, sd, torch.ones_like(sd)) + eps)
    out = torch.where(paper >= 0, adv[paper.clamp(min=0)], torch.zeros(len(reward), dtype=torch.float64))
    if credit == "std":
        _, sd, _ = group_stats(reward, group_ids, v)
        out = out / (torch.where(sd > 1e-3, sd, torch.ones_like(sd)) + eps)
    return torch.where(v, out, torch.zeros_like(out)).to(torch.float32)


# ------------------------------------------------------------------------------------------------------ AEM
@register("advantage", "aem", source="AEM: Adaptive Entropy Modulation for Multi-Turn Agentic Reinforcement Learning", needs=("groups",))
def aem(reward: torch.Tensor, group_ids: torch.Tensor, sampler_logprobs: torch.Tensor, completion_mask: torch.Tensor,
        valid: torch.Tensor | None = None, *, beta: Annotated[float, Ge(0)] = 0.2,
        eps: Eps = 1e-6) -> torch.Tensor:
    """A_i = A_i^GRPO * max(0, 1 + beta * sign(A_i^GRPO) * z_i), z_i = relative response surprisal in the group.

    After "AEM: Adaptive Entropy Modulation" (entropy drift is governed by the product of a response's advantage
    and its relative surprisal; a response-level uncertainty proxy rescales advantages). Response surprisal
    s_i = -mean_t log pi_old(o_{i,t}) (sampler log-probs, response level rather than token level);
    z_i = (s_i - mean_g s) / (std_g s + eps). Rare correct responses (A > 0, z > 0) and confident wrong ones
    (A < 0, z < 0) are amplified, confident correct and rare wrong ones damped: the updates that would collapse
    entropy weigh less, and as positives come to dominate the net effect moves toward exploitation. The factor is
    clipped at 0 so a sign never flips. Assumed: this linear form and beta 0.2.
    Shapes: reward [N], group_ids [N], sampler_logprobs [N, T], completion_mask [N, T], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    base = grpo(reward, group_ids, v, eps=eps).to(torch.float64)
    s = -_seq_mean(sampler_logprobs, completion_mask)
    mean, std, _ = group_stats(s, group_ids, v)
    z = (s - mean) / (std + eps)
    adv = base * (1 + beta * torch.sign(base) * z).clamp(min=0)
    return torch.where(v, adv, torch.zeros_like(adv)).to(torch.float32)


# ------------------------------------------------------------------------------------------------------ R^3L
@register("advantage", "r3l", source="R^3L: Reflect-then-Retry Reinforcement Learning with Language-Guided "
          "Exploration, Pivotal Credit, and Positive Amplification (Positive Amplification)", needs=("groups",))
def r3l(reward: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
        alpha: Annotated[float, Ge(1)] = 3.0, success: float | None = 1.0,
        singleton: Singleton = "zero") -> torch.Tensor:
    """R^3L's Positive Amplification: successes get a fixed positive advantage, other above-baseline completions
    are scaled up by alpha, below-baseline ones are left as they are.

    "R^3L" (Positive Amplification "upweights successful trajectories to ensure positive signals guide the
    optimization", against failure-dominated groups and off-policy retries). The abstract gives no formula; this
    is the rule of the authors' released code (``StepWiseOPMDReweightAdvAdvantageFn``, R^3L's
    ``opmd_reweight_adv`` family), with the group-mean (OPMD) baseline, no std normalisation:
        b_g = mean_{j in g} r_j                                      (valid rows)
        A_i = 1                    if r_i >= success                 (a success: ``success`` 1.0; None: no rule)
        A_i = alpha (r_i - b_g)    else if r_i - b_g >= 0            (alpha 3.0)
        A_i = r_i - b_g            otherwise
    A group with one valid completion: 0 (``singleton='zero'``, postrl's convention) or the code's baseline 0
    (``singleton='raw'``: A from r_i alone). Pair with ``retry_from_failure`` (``reflect: true``) for the whole
    method; the code trains with OPMD's loss, postrl with the configured one. Rows with ``valid`` False or a NaN
    reward get 0. Shapes: reward [N], group_ids [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid)
    mean, std, n = group_stats(reward, group_ids, v)
    mean, _ = singleton_stats(mean, std, n, singleton)
    r = reward.to(torch.float64)
    d = r - mean
    adv = torch.where(d >= 0, alpha * d, d)
    if success is not None:
        adv = torch.where(r >= success, torch.ones_like(adv), adv)
    if singleton == "zero":
        adv = torch.where(n > 1, adv, torch.zeros_like(adv))
    return torch.where(v, adv, torch.zeros_like(adv)).to(torch.float32)


# ------------------------------------------------------------------------------------------------------ IGPO
@register("advantage", "information_gain", source="Information Gain-based Policy Optimization (IGPO)", needs=("groups",))
def information_gain(reward: torch.Tensor, group_ids: torch.Tensor, info_gain: torch.Tensor,
                     valid: torch.Tensor | None = None, *, ig_weight: float = 1.0,
                     eps: Eps = 1e-6) -> torch.Tensor:
    """A_i = GRPO(r_i + ig_weight * IG_i), IG_i = log pi(a* | q, o_i) - log pi(a* | q); single turn, see below.

    What is computed: ``info_gain`` (a no-grad forward of the current policy, ``postrl.fields.info_gain``) is
    IG_i = log pi(a* | q, o_i) - log pi(a* | q), the log-probability of the ground-truth answer a* (data column
    ``answer_column``, a parameter of the producer, default 'answer'; teacher-forced, summed over a*'s tokens) after the prompt and the whole
    completion, minus the same before the completion. The outcome reward and ig_weight * IG_i (default 1.0) are
    added and group-normalised as GRPO (unbiased std, eps 1e-6); rows with a NaN IG (no answer) are excluded.
    With postrl's single-turn rollouts every completion of a group shares q, so log pi(a* | q) is one constant
    per group and cancels in the group normalisation: the advantage is exactly GRPO(r_i + ig_weight *
    log pi(a* | q, o_i)), a reward for completions after which the policy finds the reference answer likely
    (the subtraction changes only the logged value, not the training signal).
    IGPO ("Information Gain-based Policy Optimization") differs: its reward is turn-level in multi-turn agent
    rollouts, the increase of the policy's *probability* (not log-probability) of producing a* across each turn,
    pi(a* | h_t) - pi(a* | h_{t-1}), combined with the outcome reward into a dense per-turn reward trajectory.
    Single-turn, IGPO's increase also has a group-constant subtrahend, but exp makes it the probability
    pi(a* | q, o_i) rather than its log; the turn-level form needs multi-turn rollouts, which this stage does not
    see. Shapes: reward [N], group_ids [N], info_gain [N], valid [N] -> [N].
    """
    v = valid_mask(reward, valid) & torch.isfinite(info_gain)
    r = reward.to(torch.float64) + ig_weight * torch.nan_to_num(info_gain.to(torch.float64))
    return grpo(r, group_ids, v, eps=eps)
