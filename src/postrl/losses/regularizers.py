"""Regularisers (kind ``regularizer``), configured as ``regularizers: [{name: ..., coef: ..., <params>}]``.

A regulariser reads per-token fields by positional parameter name (``logp``, ``old_logp``, ``ref_logp``,
``advantages``, ``mask``, ``entropy`` (differentiable), ``logits`` ([N, T, V], differentiable, temperature
applied; computed only when a stage asks for it), ``sampler_logp``, ``lengths``) and returns either
- a tensor R [N, T]: the trainer adds ``coef * sum(w * R)`` to the loss (w = the aggregation's weights), or
- a dict with ``pg_mask`` [N, T] (multiplies the policy-loss matrix; ``coef`` is not used) and/or ``loss``,
  and/or ``unweighted`` [N, T]: summed as it is (``coef * sum(U)``), for a term the stage normalises itself
  (``f_divergence_rehearsal``, on rows outside the loss mask).
A stateful regulariser is a :class:`postrl.stages.Stateful` class: ``__init__`` takes the keyword parameters,
``__call__`` the fields; ``end_step(step)`` runs once per training step with the step's metrics reduced over
processes (``step.metrics['entropy']`` = aggregated token entropy) and returns the values the step used, and
``state_dict`` / ``load_state_dict`` put its state in the checkpoint.
A stage that only selects on a field lists it in ``no_grad_fields`` (the trainer then computes it without
gradient). Selections (top-q tokens) are made per forward pass (micro-batch), as verl and TRL do per batch they see.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
from annotated_types import Ge, Gt, Le, Lt

from postrl.errors import ConfigError
from postrl.registry import get, register
from postrl.stages import StepEnd, Stateful, parameters

Quantile = Annotated[float, Gt(0), Le(1)]  # the top-q fraction of tokens
NonNegative = Annotated[float, Ge(0)]


def _with_defaults(stage: Any, params: dict) -> dict:
    """``params`` completed with the stage's defaults (for a registered ``check``)."""
    return {**{k: d for k, (_, d) in parameters(stage).items()}, **params}


def _top_quantile_mask(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """1[H_t >= quantile_{1-q}(H over valid tokens)] on valid tokens (TRL ``get_high_entropy_mask``), 0 < q <= 1."""
    valid = mask > 0
    h = entropy.detach()
    if not bool(valid.any()):
        return torch.zeros_like(valid)
    thr = torch.quantile(h[valid].float(), 1.0 - q)
    return (h >= thr) & valid


# ---------------------------------------------------------------------------------------------- entropy


@register("regularizer", "entropy_bonus", source="Williams & Peng 1991 entropy regularisation; "
          "verl actor.entropy_coeff")
def entropy_bonus(entropy: torch.Tensor) -> torch.Tensor:
    """R_t = -H_t (token entropy of the temperature-scaled policy); loss += coef * agg(R), i.e. -alpha H with
    alpha = ``coef`` (verl ``entropy_coeff``: pg_loss - entropy_coeff * agg_loss(entropy), same aggregation)."""
    return -entropy


def _alpha_range(params: dict, run: Any, where: str) -> dict:
    """``adaptive_entropy``: alpha starts within its range, ``init`` <= ``max_alpha``."""
    p = _with_defaults(AdaptiveEntropy, params)
    if p["max_alpha"] < p["init"]:
        raise ConfigError(f"{where}.max_alpha: expected a value >= init ({p['init']}), got {p['max_alpha']}")
    return params


@register("regularizer", "adaptive_entropy", source="Skywork Open Reasoner 1 (adaptive entropy control)",
          check=_alpha_range)
class AdaptiveEntropy(Stateful):
    """R_t = -alpha H_t with alpha adapted toward a target entropy (after Skywork-OR1's adaptive entropy control).

    After each step, with H the step's aggregated token entropy:
    alpha <- clip(alpha + delta * sgn(target - H), 0, max_alpha) (H == target: unchanged).
    Defaults target = 0.2 nats, delta = 0.005, init = 0.0, max_alpha = 0.1 (postrl's; target and step follow the
    Skywork-OR1 report's scale). alpha is saved in the checkpoint. ``coef`` multiplies the term (default 1).
    target, delta, init >= 0 and max_alpha >= init.
    """

    def __init__(self, *, target: NonNegative = 0.2, delta: NonNegative = 0.005, init: NonNegative = 0.0,
                 max_alpha: NonNegative = 0.1):
        self.target, self.delta, self.max_alpha = float(target), float(delta), float(max_alpha)
        self.alpha = float(init)

    def __call__(self, entropy: torch.Tensor) -> torch.Tensor:
        return -self.alpha * entropy

    def end_step(self, step: StepEnd) -> dict:
        h = step.metrics.get("entropy")
        used = {"alpha": self.alpha}  # the value this step used
        if h is None or h != h:  # no measurement (or NaN): keep alpha
            return used
        d = self.delta if h < self.target else (-self.delta if h > self.target else 0.0)
        self.alpha = min(max(self.alpha + d, 0.0), self.max_alpha)
        return used

    def state_dict(self) -> dict:
        return {"alpha": self.alpha}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = float(state["alpha"])


@register("regularizer", "top_entropy_tokens", source="Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive "
          "Effective RLVR (Wang et al. 2025); TRL top_entropy_quantile")
def top_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, *, q: Quantile = 0.2) -> dict:
    """Update only the top-q fraction of tokens by entropy ("forking tokens"): pg_mask_t = 1[H_t >= tau],
    tau = torch.quantile(H over the valid tokens, 1 - q) (linear interpolation); the policy-loss matrix is
    multiplied by the mask, the aggregation's normaliser is unchanged (TRL ``top_entropy_quantile=q``, which
    multiplies ``per_token_loss`` by the same mask). Default q = 0.2 (the paper's top 20%). ``coef`` unused."""
    return {"pg_mask": _top_quantile_mask(entropy, mask, q).to(entropy.dtype)}


top_entropy_tokens.no_grad_fields = ("entropy",)  # selection only: the trainer need not differentiate the entropy


def _band(params: dict, run: Any, where: str) -> dict:
    """``entropy_band``: ``low`` <= ``high``."""
    p = _with_defaults(entropy_band, params)
    if p["high"] < p["low"]:
        raise ConfigError(f"{where}.high: expected a value >= low ({p['low']}), got {p['high']}")
    return params


@register("regularizer", "entropy_band", source="SPINE: Token-Selective Test-Time Reinforcement Learning with "
          "Entropy-Band Regularization", check=_band)
def entropy_band(entropy: torch.Tensor, mask: torch.Tensor, *, q: Quantile = 0.2, low: float = 0.7,
                 high: float = 2.0) -> torch.Tensor:
    """Entropy-band regulariser on forking tokens (after SPINE):
    R_t = f_t * (relu(low - H_t) + relu(H_t - high)), f_t = 1[H_t in the top-q by entropy] (as
    ``top_entropy_tokens``): entropy is pushed up below the band (sustain exploration) and down above it
    (suppress noisy updates), untouched inside. SPINE also updates only forking tokens: combine with
    ``top_entropy_tokens``. Assumed where the abstract is open: a hinge (linear) penalty and an absolute band in
    nats; defaults q = 0.2, low = 0.7 (about the 80th-percentile token entropy reported by the 80/20 paper),
    high = 2.0 are postrl's, to tune per model; low <= high."""
    fork = _top_quantile_mask(entropy, mask, q).to(entropy.dtype)
    return fork * (torch.relu(low - entropy) + torch.relu(entropy - high))


@register("regularizer", "entropy_smoothing", source="EPO: Entropy-regularized Policy Optimization for LLM Agents "
          "Reinforcement Learning")
class EntropySmoothing(Stateful):
    """Keep the policy's entropy near its running historical mean (EPO's smoothing), with EPO's phase weighting.

    H_hist = mean of the last ``window`` steps' aggregated token entropies; H_b = mean token entropy of the
    current forward pass (detached); s = sgn(H_b - H_hist) if |H_b - H_hist| > band * H_hist, else 0;
    R_t = w_k s (H_t - H_hist). Aggregated (weights summing to 1) the term is w_k |H - H_hist| while the entropy
    is out of the band and 0 inside, and its gradient moves the entropy back toward H_hist; 0 before any history.
    Assumed where the abstract is open: a hinge on the batch-mean entropy (a per-token band would flatten the
    forking structure), relative band; defaults window = 10, band = 0.1 are postrl's. Entropy regularisation, EPO's
    first part, is ``entropy_bonus``. History in the checkpoint.

    Phase-based weighting ("adaptive phase-based weighting that balances exploration and exploitation across
    training"; the abstract gives no formula: this is the schedule of the authors' released code,
    ``DataParallelPPOActor._calculate_epoch_based_entropy_weight`` with ``enable_smooth_weights``, which multiplies
    the smoothing penalty). With K = ``phase_steps`` training steps, h = floor(K / 2) and k = the number of steps
    already taken (clamped to [0, K]):
        w_k = 1 - 0.2 (1 - exp(-phase_slow k / h))             k <= h   (slow decay 1 -> ~0.83; h = 0: 1)
        w_k = 0.8 exp(-phase_fast (k - h) / (K - h))           k > h    (fast decay 0.8 -> 0.8 e^-phase_fast)
    defaults phase_slow 2.0, phase_fast 3.0 (the code's; its K default is 150 epochs). ``phase_steps`` None
    (default) keeps w_k = 1 (no phase weighting). The code's schedule is not continuous at k = h (0.83 -> 0.8).
    The v2 abstract words the weighting as moving "from conservative exploration to strong stabilization";
    the released schedule lowers the smoothing weight over training, and that schedule is what is implemented.
    Not reproduced: the code applies smoothing only to turns past half of an episode's step budget.
    """

    def __init__(self, *, window: Annotated[int, Ge(1)] = 10, band: NonNegative = 0.1,
                 phase_steps: Annotated[int, Ge(1)] | None = None,
                 phase_slow: NonNegative = 2.0, phase_fast: NonNegative = 3.0):
        self.window, self.band = int(window), float(band)
        self.phase_steps, self.phase_slow, self.phase_fast = phase_steps, float(phase_slow), float(phase_fast)
        self.history: list[float] = []
        self.steps = 0

    @property
    def reference(self) -> float | None:
        return sum(self.history) / len(self.history) if self.history else None

    @property
    def phase_weight(self) -> float:
        """w_k of the current step (1.0 without ``phase_steps``)."""
        return phase_weight(self.steps, self.phase_steps, self.phase_slow, self.phase_fast)

    def __call__(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ref = self.reference
        if ref is None or not bool((mask > 0).any()):
            return torch.zeros_like(entropy)
        hb = float((entropy.detach() * mask).sum() / mask.sum())
        s = 0.0 if abs(hb - ref) <= self.band * ref else (1.0 if hb > ref else -1.0)
        return (self.phase_weight * s) * (entropy - ref)

    def end_step(self, step: StepEnd) -> dict:
        h = step.metrics.get("entropy")
        ref = self.reference
        used = {"reference": ref} if ref is not None else {}  # the values this step used
        if self.phase_steps is not None:
            used["phase_weight"] = self.phase_weight
        if h is not None and h == h:
            self.history = (self.history + [float(h)])[-self.window:]
        self.steps += 1
        return used

    def state_dict(self) -> dict:
        return {"history": list(self.history), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.history = [float(x) for x in state["history"]][-self.window:]
        self.steps = int(state.get("steps", 0))


def phase_weight(k: int, total: int | None, slow: float = 2.0, fast: float = 3.0) -> float:
    """EPO's phase weight w_k after k of ``total`` steps (see :class:`EntropySmoothing`); 1.0 when total is None."""
    if total is None:
        return 1.0
    k = max(0, min(int(k), int(total)))
    half = total // 2
    if k <= half:
        return 1.0 if half == 0 else 1.0 - 0.2 * (1.0 - math.exp(-slow * k / half))
    return 0.8 * math.exp(-fast * (k - half) / (total - half))


# ---------------------------------------------------------------------------------------------- distributions


@register("regularizer", "lp_reg", source="Low-probability Tokens Sustain Exploration in Reinforcement Learning with "
          "Verifiable Reward (Lp-Reg)")
def lp_reg(logits: torch.Tensor, advantages: torch.Tensor, *, min_p: Annotated[float, Ge(0), Lt(1)] = 0.02,
           negative_only: bool = False) -> torch.Tensor:
    """KL toward a proxy that drops presumed-noise tokens and renormalises (after Lp-Reg):

    p = softmax(logits) at each position (detached for the proxy); kept set K = {v : p_v >= min_p * max_u p_u};
    proxy q_v = p_v 1[v in K] / sum_{u in K} p_u (detached); R_t = KL(q || pi_theta) = sum_{v in K} q_v
    (log q_v - log pi_theta(v)) (= -log sum_{v in K} pi_theta(v) in value). Its gradient moves probability from
    the dropped tokens to the kept ones in proportion, so kept low-probability tokens ("reasoning sparks") are
    shielded from elimination. ``negative_only``: apply only where A_t < 0 (where over-penalisation happens).
    Assumed where the abstract is open: a min-p style relative threshold (default min_p = 0.02, postrl's) and
    KL(proxy || policy) direction. Needs the full logits [N, T, V] (memory: N T V floats).
    """
    logq = torch.log_softmax(logits.float(), dim=-1)
    with torch.no_grad():
        p = logq.exp()
        keep = p >= min_p * p.max(-1, keepdim=True).values
        proxy = torch.where(keep, p, torch.zeros_like(p))
        proxy = proxy / proxy.sum(-1, keepdim=True)
        log_proxy = torch.where(keep, proxy.clamp(min=1e-30).log(), torch.zeros_like(p))
    r = (proxy * (log_proxy - logq)).sum(-1)
    if negative_only:
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        r = r * (adv < 0).to(r.dtype)
    return r


@register("regularizer", "f_divergence", source="The Choice of Divergence: A Neglected Key to Mitigating Diversity "
          "Collapse in Reinforcement Learning with Verifiable Reward (DPH-RL)")
def f_divergence(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, *,
                 divergence: Literal["forward_kl", "js"] = "forward_kl", importance_weight: bool = True,
                 cap: Annotated[float, Gt(0)] = 2.0) -> torch.Tensor:
    """Mass-covering f-divergence to the initial policy, on the policy's rollouts (DPH-RL's form: f_divergence_rehearsal).

    After DPH-RL; unlike DPH-RL it needs an online reference model (see below; ``f_divergence_rehearsal`` is the
    paper's form, on pre-sampled completions of the initial policy, with no reference model).

    D_f = E_{y ~ pi_ref}[f(t)], t = pi_theta(y_t) / pi_ref(y_t) per token:
    ``forward_kl`` = KL(pi_ref || pi_theta): f(t) = t - 1 - log t (the generator -log t plus t - 1, which leaves
    the divergence unchanged since E_ref[t] = 1, makes each term >= 0 and its gradient 0 where pi_theta = pi_ref);
    ``js`` = Jensen-Shannon: f(t) = (t log t - (1 + t) log((1 + t) / 2)) / 2.
    The batch is sampled from the policy that generated it, not pi_ref: each token is importance-weighted
    toward pi_ref by w_t = sg(min(exp(ref_logp_t - old_logp_t), cap)) (token level, truncated at ``cap`` = 2.0);
    R_t = w_t f(t_t). With cap = inf the expectation of w_t f over the sampled token equals pi_ref's expectation
    of f given the same prefix (prefixes stay the policy's: token-level weights, as token-level TIS); a finite cap
    trades that unbiasedness for variance. ``importance_weight=False`` treats the rows as samples of pi_ref
    (w = 1), which is exact only for rows that pi_ref generated.
    Difference from DPH-RL, which computes the f-divergence with generator functions on completions pre-sampled
    once from the initial policy (with their initial-policy log-probs), so it needs only those samples and no
    online reference model: this stage evaluates the term on the current rollouts, so ``ref_logp`` of every
    rollout is needed and a reference model is loaded and run every step (one extra forward per step), and
    DPH-RL's choice of prompts for the term (those the initial model already solves) is not part of this stage.
    """
    f = f_generator(logp - ref_logp, divergence)
    if not importance_weight:
        return f
    w = torch.exp((ref_logp - old_logp).clamp(-20.0, 20.0)).clamp(max=cap).detach()
    return w * f


# ---------------------------------------------------------------------------------------------- off-policy masking


@register("regularizer", "off_policy_mask", source="DeepSeek-V3.2 (off-policy sequence masking, eq. 9); TRL "
          "off_policy_mask_threshold")
def off_policy_mask(advantages: torch.Tensor, logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, *,
                    threshold: Annotated[float, Gt(0)] = 0.5) -> dict:
    """Drop the sequences that both lower the policy (A < 0) and have drifted far from the policy that sampled them.

    After DeepSeek-V3.2's off-policy sequence masking: d_i = sum_t m_it (sampler_logp_it - sg(logp_it)) /
    max(1, sum_t m_it) (the sequence's mean KL(pi_sampler || pi_theta) estimate on its own tokens; a NaN sampler
    log-prob counts 0), pg_mask_it = 1[A_it >= 0 or d_i <= threshold]; the policy-loss matrix is multiplied by the
    mask, the aggregation's normaliser is unchanged. Equal to TRL ``off_policy_mask_threshold=threshold``
    (``get_off_policy_mask``: TRL's ``sampling_per_token_logps`` when the sampler gave them, else its old
    log-probs; postrl's ``sampler_logp`` is the same). Default threshold = 0.5 (TRL's documented example; the paper
    tunes it). ``coef`` unused. Shapes: advantages [N] or [N, T], the rest [N, T] -> {"pg_mask": [N, T]}.
    """
    kl = torch.nan_to_num(sampler_logp - logp.detach(), nan=0.0)
    d = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
    keep = (adv >= 0) | (d <= threshold)
    return {"pg_mask": keep.to(logp.dtype).expand_as(logp)}


def f_generator(log_t: torch.Tensor, divergence: str) -> torch.Tensor:
    """The generator terms of D_f(pi_ref || pi_theta) at t = pi_theta / pi_ref (``log_t``, clamped to [-20, 20]):
    ``forward_kl`` t - 1 - log t; ``js`` (t log t - (1 + t) log((1 + t) / 2)) / 2."""
    log_t = log_t.clamp(-20.0, 20.0)
    t = torch.exp(log_t)
    if divergence == "forward_kl":
        return t - 1.0 - log_t
    return 0.5 * (t * log_t - (1.0 + t) * torch.log((1.0 + t) / 2.0))


def _rehearsal_needed(params: dict, run, where: str) -> dict:
    """The regulariser reads the rows the ``rehearsal`` expansion appends: the run must list it."""
    if run is not None and not any(f.name == "rehearsal" for f in run.filters):
        raise ConfigError(f"{where}: f_divergence_rehearsal needs the pre-sampled completions of the initial policy: "
                          f"add filters: [{{name: rehearsal, path: <file written by postrl presample>}}]")
    return params


@register("regularizer", "f_divergence_rehearsal", source="The Choice of Divergence: A Neglected Key to Mitigating "
          "Diversity Collapse in Reinforcement Learning with Verifiable Reward (DPH-RL)", check=_rehearsal_needed)
def f_divergence_rehearsal(logp: torch.Tensor, rehearsal_logp: torch.Tensor, rehearsal_mask: torch.Tensor,
                           rehearsal_weight: torch.Tensor, *,
                           divergence: Literal["forward_kl", "js"] = "forward_kl") -> dict:
    """DPH-RL's f-divergence to the initial policy on its own pre-sampled completions: no reference model.

    "The Choice of Divergence" (DPH-RL): a mass-covering f-divergence (forward KL, Jensen-Shannon) to the initial
    policy pi_0 acts as rehearsal; it "computes f-divergence using generator functions, requiring only sampling
    from the initial policy and no online reference model". The samples y ~ pi_0 and their log-probs
    log pi_0(y_t | y_<t) are drawn once, before training (``postrl presample``), and the ``rehearsal`` expansion
    (``filters: [{name: rehearsal, path: ..., per_step: 8}]``, required) appends some to every batch; the
    trainer's forward gives log pi_theta of their tokens with the rollouts' (the rows are ``valid`` False: no
    advantage, no policy loss, no metric). With t = pi_theta(y_t) / pi_0(y_t) per token (y_t ~ pi_0 given the
    prefix, so E_{pi_0}[t] = 1):
        forward_kl: f(t) = t - 1 - log t         (E_{pi_0}[f] = KL(pi_0 || pi_theta) per token; the gradient of
                                                  -log t is behaviour cloning of pi_0's samples)
        js:         f(t) = (t log t - (1 + t) log((1 + t) / 2)) / 2   (E_{pi_0}[f] = JS(pi_0, pi_theta))
        term = sum over rehearsal tokens of f(t) / (rehearsal tokens in the batch)   (``rehearsal_weight``)
    so ``coef`` x term is added to the loss as a token mean over the rehearsal completions, independent of the
    aggregation of the policy loss (which never sees these rows). Per-token generator terms with the prefix from
    pi_0 are an unbiased estimate of each divergence's per-token (chain-rule) form. Assumed where the abstract
    is silent: token-level generator terms, this token-mean normalisation, and which rows are rehearsed (the
    file's: ``postrl presample --only-correct`` keeps the completions the initial model got right, DPH-RL's
    rehearsal on solved prompts). The log-probs must be at the run's ``rollout.temperature`` (checked against
    the file's ``temperature``). With ``train.mini_batches`` > 1 each optimizer step sees the rehearsal rows of
    its mini-batch.
    Shapes: logp, rehearsal_logp, rehearsal_mask [N, T], rehearsal_weight [N] -> {'unweighted': [N, T]}.
    """
    f = f_generator(logp - rehearsal_logp, divergence)
    return {"unweighted": f * rehearsal_mask * rehearsal_weight.unsqueeze(-1)}

# ---------------------------------------------------------------------------------------------- entropy change


@register("regularizer", "steer", source="Rethinking Entropy Interventions in RLVR: An Entropy Change Perspective "
          "(STEER)")
def steer(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, entropy: torch.Tensor,
          mask: torch.Tensor, *, w_min: Annotated[float, Gt(0), Le(1)] = 0.8, w_max: Annotated[float, Ge(1)] = 1.2,
          mapping: Literal["linear", "exp"] = "linear") -> dict:
    """Token weights from each token's first-order contribution to the entropy change (STEER).

    The weights multiply the policy-loss matrix (``pg_mask``; ``coef`` unused).

    For the sampled token a_t with probability p_t = pi_theta(a_t | s_t) (clamped to [1e-8, 1 - 1e-8]), old
    probability q_t = pi_old(a_t | s_t) (clamped to [1e-8, 1]) and entropy H_t:
      Omega_t = (A_t / q_t) p_t (1 - p_t) (log p_t + H_t)
    is the first-order change of H at s_t that one policy-gradient step on the token causes (up to the step size and
    sign: a likely token, log p_t > -H_t, pushed up sharpens the distribution; an unlikely one widens it). The
    larger |Omega_t|, the more the token moves the entropy, the less it weighs:
      ``linear`` (default): w_t = w_max - (|Omega_t| - min |Omega|) (w_max - w_min) / (max |Omega| - min |Omega|),
        min and max over the micro-batch's loss tokens (all equal: (w_min + w_max) / 2), clamped to [w_min, w_max];
      ``exp``: w_t = clamp(exp(-k |Omega_t|), w_min, 1), k = -ln(w_min) / max(max |Omega|, 0.02).
    Non-finite Omega counts as 0; w = 0 off the mask; no gradient flows through w. Defaults w_min 0.8, w_max 1.2,
    linear (the authors' run_linear script; their exponential run uses w_min 0.8 with w_max 1). Selection per
    forward pass (micro-batch), as the authors' verl loss computes it per micro-batch.
    Shapes: logp, old_logp, entropy, mask [N, T]; advantages [N] or [N, T] -> {"pg_mask": [N, T]}.
    """
    with torch.no_grad():
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        p = logp.detach().float().exp().clamp(1e-8, 1.0 - 1e-8)
        q = old_logp.detach().float().exp().clamp(1e-8, 1.0)
        omega = (adv.float() / q) * p * (1.0 - p) * (p.log() + entropy.detach().float())
        omega = torch.where(torch.isfinite(omega), omega, torch.zeros_like(omega)).abs()
        valid = mask > 0
        w = torch.zeros_like(omega)
        if bool(valid.any()):
            om = omega[valid]
            lo, hi = om.min(), om.max()
            if mapping == "linear":
                if hi > lo:
                    wv = w_max - (om - lo) * (w_max - w_min) / (hi - lo)
                else:
                    wv = torch.full_like(om, (w_min + w_max) / 2.0)
                wv = wv.clamp(w_min, w_max)
            else:
                k = -math.log(w_min) / max(float(hi), 0.02)
                wv = torch.exp(-k * om).clamp(w_min, 1.0)
            w[valid] = wv
    return {"pg_mask": w.to(logp.dtype)}


steer.no_grad_fields = ("entropy",)  # weights only: the trainer need not differentiate the entropy


# ---------------------------------------------------------------------------------------------- ARES dynamic KL

KLName = Literal["k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "low_var_kl+", "abs+"]  # kind kl's names


def _after_ares(params: dict, run: Any, where: str) -> dict:
    """``ares_kl`` reads what the ``ares`` advantage hands on."""
    if run is not None and getattr(getattr(run, "advantage", None), "name", "ares") != "ares":
        raise ConfigError(f"{where}: ares_kl reads the HWE windows and difficulties of advantage 'ares' (ares_hwe, "
                          f"ares_difficulty); set advantage.name=ares, got {run.advantage.name}")
    return params


@register("regularizer", "ares_kl", source="ARES: Multimodal Adaptive Reasoning via Difficulty-Aware Token-Level "
          "Entropy Shaping (dynamic KL)", check=_after_ares)
def ares_kl(logp: torch.Tensor, ref_logp: torch.Tensor, ares_hwe: torch.Tensor, ares_difficulty: torch.Tensor, *,
            estimator: KLName = "k3", relax: Annotated[float, Ge(0), Le(1)] = 0.5,
            scales: tuple[NonNegative, NonNegative, NonNegative] = (1.0, 1.0, 1.0)) -> torch.Tensor:
    """KL to the reference, relaxed inside high window-entropy windows, scaled per difficulty (after ARES's dynamic KL).

    ``coef`` is the base coefficient (set ``kl.coef: 0`` to use this KL alone).

    R_{i,t} = s_{d(i)} * (relax if t is in a validated HWE window of row i else 1) * k(logp_t, ref_logp_t)
    with k the ``estimator`` (kind ``kl``, default k3), the windows and the difficulty d(i) (easy, medium, hard)
    handed on by the ``ares`` advantage (``ares_hwe``, ``ares_difficulty``: that estimator must be configured), s =
    ``scales`` per difficulty. Defaults relax 0.5, scales (1, 1, 1) are postrl's: the abstract says the KL budget is
    "dynamic" and the authors' summary that it "relaxes inside validated HWE windows"; their released code also
    adapts a coefficient per difficulty toward per-bucket KL targets, which is not implemented (fixed ``scales``).
    Shapes: logp, ref_logp, ares_hwe [N, T]; ares_difficulty [N] -> [N, T].
    """
    k = get("kl", estimator)(logp, ref_logp)
    s = torch.tensor(scales, dtype=k.dtype, device=k.device)[ares_difficulty.long().clamp(0, 2)]
    inside = ares_hwe.to(k.dtype)
    return s.unsqueeze(-1) * (relax * inside + (1.0 - inside)) * k
