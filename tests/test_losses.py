"""Policy losses, aggregations, TIS, KL estimators/controller and regularisers: hand-computed values, edge
cases, equivalence with verl / TRL formulas (re-implemented here from their documented semantics) and gradients.
ppo_clip / aggregation basics are in test_stages.py; end-to-end runs are in test_losses_train.py."""

import math

import pytest
import torch

from postrl import registry
from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.stages import build, call_stage
from postrl.stages import StepEnd
from postrl.stages import reads as _reads
from postrl.losses import (AdaptiveEntropy, EntropySmoothing, KLController, check_aggregation, cispo, clip_cov,
                           dispo, dr_grpo, entropy_band, entropy_bonus, f_divergence, gmpo, gpg, gspo, kl_abs,
                           kl_abs_st, kl_cov, kl_k1, kl_k1_st, kl_k2, kl_k3, kl_k3_st, kl_reward_penalty, lp_reg,
                           ppo_clip, sapo, seq_mean_token_mean, seq_mean_token_sum, tis_weights,
                           token_mean, top_entropy_tokens)

LOG = math.log


def rand_batch(seed=0, n=6, t=5, spread=0.5, empty_row=False):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3 - 0.05
    logp = old + torch.randn(n, t, generator=g) * spread
    adv = torch.randn(n, generator=g)
    mask = (torch.rand(n, t, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    if empty_row:
        mask[-1] = 0.0
    return logp.requires_grad_(True), old, adv, mask


def num(x):
    return float(x.detach())


def grad_of(scalar, x):
    (g,) = torch.autograd.grad(scalar, x, retain_graph=True)
    return g


# ---------------------------------------------------------------------------------------------- ppo_clip anchors


def verl_vanilla(old, logp, adv, mask, lo=0.2, hi=0.2, c=3.0):
    """verl compute_policy_loss_vanilla (token-mean), re-implemented: dual-clip with clip_ratio_c for A < 0."""
    ratio = torch.exp((logp - old).clamp(-20, 20))
    a = adv.unsqueeze(-1).expand_as(logp)
    l1 = torch.maximum(-a * ratio, -a * ratio.clamp(1 - lo, 1 + hi))
    l2 = torch.minimum(-a * c, l1)
    pg = torch.where(a < 0, l2, l1)
    return (pg * mask).sum() / mask.sum()


def test_ppo_clip_dual_clip_3_reproduces_verl_vanilla_default():
    logp, old, adv, mask = rand_batch(1, spread=1.5)  # wide ratios so the dual clip binds
    loss, info = ppo_clip(logp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    ours = (token_mean(mask) * loss).sum()
    ref = verl_vanilla(old, logp, adv, mask, 0.2, 0.28, 3.0)
    assert float(info["clip_dual"].sum()) > 0
    assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.allclose(grad_of(ours, logp), grad_of(ref, logp), atol=1e-6)
    # without dual_clip the two differ exactly where verl's c = 3 binds
    plain = (token_mean(mask) * ppo_clip(logp, old, adv, eps_low=0.2, eps_high=0.28)[0]).sum()
    assert float(plain.detach()) > float(ref.detach())


# ---------------------------------------------------------------------------------------------- GSPO


def test_gspo_hand_values_and_sequence_clipping():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[LOG(1.1), LOG(1.3), 5.0], [LOG(0.5), 7.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, info = gspo(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    s0 = math.sqrt(1.1 * 1.3)  # geometric mean of the token ratios = 1.19583
    assert torch.allclose(info["ratio"][:, 0], torch.tensor([s0, 0.5]), atol=1e-5)
    # row 0: A > 0, s0 < 1.2 -> -s0; row 1: A < 0, s = 0.5 < 0.8 -> clipped: max(0.5, 0.8) = 0.8
    assert torch.allclose(loss[0, :2], torch.full((2,), -s0), atol=1e-5)
    assert torch.allclose(loss[1, 0], torch.tensor(0.8))
    total = (seq_mean_token_mean(mask) * loss).sum()
    assert total.item() == pytest.approx((-s0 + 0.8) / 2, abs=1e-5)
    g = grad_of(total, logp)
    # d/dlogp_t of (1/2)(1/2) sum_t -s0 = -s0/4 on row 0's tokens; clipped row and padding: 0
    assert torch.allclose(g, torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [0.0, 0.0, 0.0]]), atol=1e-5)


def trl_sequence_grpo(logp, old, adv, mask, lo, hi):
    """TRL importance_sampling_level='sequence', loss_type='grpo', re-implemented."""
    log_w = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    c1 = torch.exp(log_w).unsqueeze(-1)
    c2 = c1.clamp(1 - lo, 1 + hi)
    a = adv.unsqueeze(-1)
    per_tok = -torch.minimum(c1 * a, c2 * a).expand_as(logp)
    return ((per_tok * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_trl_sequence_level_value_and_gradient(seed):
    logp, old, adv, mask = rand_batch(seed, spread=0.02)
    lo, hi = 3e-3, 4e-3  # some sequences inside, some clipped
    loss, info = gspo(logp, old, adv, mask, eps_low=lo, eps_high=hi)
    ours = (registry.get("aggregation", "sequence")(mask) * loss).sum()
    ref = trl_sequence_grpo(logp, old, adv, mask, lo, hi)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.allclose(grad_of(ours, logp), grad_of(ref, logp), atol=1e-6)
    # the sequence ratio is the geometric mean of the token ratios
    s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
    assert torch.allclose(info["ratio"][:, 0], s.detach(), atol=1e-6)


def test_sequence_level_losses_warn_under_token_aggregation():
    assert check_aggregation("gspo", gspo, "token_mean") is not None
    assert "loss.agg=sequence" in check_aggregation("gmpo", gmpo, "dr_grpo")
    assert check_aggregation("gspo", gspo, "sequence") is None
    assert check_aggregation("gspo", gspo, "seq_mean_token_mean") is None
    assert check_aggregation("ppo_clip", ppo_clip, "token_mean") is None
    assert registry.get("aggregation", "sequence") is seq_mean_token_mean


# ---------------------------------------------------------------------------------------------- CISPO


def test_cispo_hand_values_and_stop_gradient():
    ratios = torch.tensor([[0.5, 1.0, 3.0, 10.0]])
    old = torch.full((1, 4), -2.0)
    logp = (old + ratios.log()).requires_grad_(True)
    loss, info = cispo(logp, old, torch.tensor([2.0]), eps_high=1.0)  # cap 2
    w = torch.tensor([[0.5, 1.0, 2.0, 2.0]])
    assert torch.allclose(loss, -w * 2.0 * logp.detach(), atol=1e-6)
    assert info["clip_high"].tolist() == [[False, False, True, True]]
    # gradient flows through log pi only: dL/dlogp = -sg(min(rho, 1 + eps)) A
    assert torch.allclose(grad_of(loss.sum(), logp), -w * 2.0, atol=1e-6)
    # optional lower bound (verl cispo clamps both sides)
    loss2, _ = cispo(logp, old, torch.tensor([2.0]), eps_high=1.0, eps_low=0.2)
    assert torch.allclose(grad_of(loss2.sum(), logp), -torch.tensor([[0.8, 1.0, 2.0, 2.0]]) * 2.0, atol=1e-6)


def test_cispo_matches_trl_and_verl():
    logp, old, adv, mask = rand_batch(3, spread=1.0)
    a = adv.unsqueeze(-1)
    rho = torch.exp(logp - old)
    trl = -torch.clamp(rho, max=5.0).detach() * a * logp  # TRL loss_type='cispo', epsilon_high=5.0
    ours, _ = cispo(logp, old, adv, eps_high=4.0)
    assert torch.allclose(ours, trl, atol=1e-5)
    verl = -torch.clamp(rho, 1 - 0.2, 1 + 0.28).detach() * a * logp  # verl cispo, clip_ratio_low/high
    ours2, _ = cispo(logp, old, adv, eps_high=0.28, eps_low=0.2)
    assert torch.allclose(ours2, verl, atol=1e-5)
    assert torch.allclose(grad_of((ours2 * mask).sum(), logp), grad_of((verl * mask).sum(), logp), atol=1e-5)


# ---------------------------------------------------------------------------------------------- SAPO


def test_sapo_hand_values_and_on_policy_gradient():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.0, 2.0, 1.0]]))
    loss, _ = sapo(logp, old, torch.tensor([[1.0, 1.0, -1.0]]))
    sig1 = 1 / (1 + math.exp(-1.0))
    # A>0, rho=1: -(4/1) sigmoid(0) = -2; rho=2: -4 sigmoid(1); A<0, tau=1.05, rho=1: +(4/1.05) * 0.5
    assert torch.allclose(loss, torch.tensor([[-2.0, -4 * sig1, 2 / 1.05]]), atol=1e-6)
    # on-policy the gate's slope is 1: the gradient equals PPO's (-A)
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = sapo(lp, lp.detach(), torch.tensor([1.5]))
    assert torch.allclose(grad_of(loss.sum(), lp), torch.tensor([[-1.5, -1.5]]), atol=1e-6)
    with pytest.raises(ConfigError, match=r"^loss.tau_pos: expected a value > 0, got 0.0$"):
        build("loss", "sapo", {"tau_pos": 0.0})


def test_sapo_matches_verl_formula():
    logp, old, adv, mask = rand_batch(4, spread=1.0)
    a = adv.unsqueeze(-1)
    r = torch.exp(logp - old)
    tau = torch.where(a > 0, torch.tensor(1.0), torch.tensor(1.05))
    verl = -(torch.sigmoid(tau * (r - 1)) * 4 / tau) * a
    ours, _ = sapo(logp, old, adv)
    assert torch.allclose(ours, verl, atol=1e-6)


# ---------------------------------------------------------------------------------------------- GMPO


def test_gmpo_hand_values():
    d = torch.tensor([[0.1, 0.6, -0.5], [0.1, 0.6, -0.5]])
    loss, info = gmpo(d.clone(), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    # A>0: min(d, clip(d, -.4, .4)) = [0.1, 0.4, -0.5] -> mean 0 -> ratio 1 -> -1
    # A<0: max(d, clip(d)) = [0.1, 0.6, -0.4] -> mean 0.1 -> ratio e^0.1 -> +e^0.1
    assert torch.allclose(loss[:, 0], torch.tensor([-1.0, math.exp(0.1)]), atol=1e-6)
    assert torch.allclose(loss, loss[:, :1].expand(2, 3))  # sequence-level: same value on every token
    # verl's clip fractions: tokens whose log-ratio lies outside [-eps_low, eps_high], split by the sign of A
    assert info["clip_high"][0].tolist() == [False, True, True] and info["clip_low"][1].tolist() == [False, True, True]


def verl_geo_mean(old, logp, adv_tok, mask, lo, hi):
    d = logp - old
    sgn = torch.sign(adv_tok)
    dmin = sgn * torch.min(sgn * d, sgn * d.clamp(-lo, hi))
    n = mask.sum(-1)
    ratio = torch.exp((dmin * mask).sum(-1) / (n + 1e-8))
    a = (adv_tok * mask).sum(-1) / (n + 1e-8)
    return torch.mean(-a * ratio)


def test_gmpo_matches_verl_geo_mean():
    logp, old, adv, mask = rand_batch(5, spread=0.6)
    a_tok = adv.unsqueeze(-1).expand_as(logp) * mask
    loss, _ = gmpo(logp, old, adv, mask, eps_low=0.4, eps_high=0.4)
    ours = (registry.get("aggregation", "sequence")(mask) * loss).sum()
    ref = verl_geo_mean(old, logp, a_tok, mask, 0.4, 0.4)
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.allclose(grad_of(ours, logp), grad_of(ref, logp), atol=1e-5)


# ---------------------------------------------------------------------------------------------- GPG, DISPO


def test_gpg_is_minus_advantage_log_pi():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    loss, info = gpg(logp, torch.tensor([2.0, -1.0]))
    assert torch.allclose(loss, torch.tensor([[2.0, 4.0], [-0.5, -0.1]]))
    assert torch.allclose(grad_of(loss.sum(), logp), torch.tensor([[-2.0, -2.0], [1.0, 1.0]]))
    assert info == {}


def test_dispo_four_bounds_mask_and_clip():
    rho = torch.tensor([[0.5, 0.95, 1.5, 3.0], [0.5, 0.95, 1.5, 3.0]])
    old = torch.full((2, 4), -1.0)
    logp = (old + rho.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    kw = dict(eps_pos_low=0.1, eps_pos_high=1.0, eps_neg_low=0.6, eps_neg_high=0.2)
    # correct rows: region [0.9, 2.0]; incorrect rows: region [0.4, 1.2]
    loss, info = dispo(logp, old, adv, **kw)
    w = torch.tensor([[0.0, 0.95, 1.5, 0.0], [0.5, 0.95, 0.0, 0.0]])
    g = grad_of(loss.sum(), logp)
    assert torch.allclose(g, -w * adv.unsqueeze(-1), atol=1e-6)  # no gradient outside the trust region
    assert info["clip_low"].tolist() == [[True, False, False, False], [False, False, False, False]]
    assert info["clip_high"].tolist() == [[False, False, False, True], [False, False, True, True]]
    loss, _ = dispo(logp, old, adv, mode="clip", **kw)
    wc = torch.tensor([[0.9, 0.95, 1.5, 2.0], [0.5, 0.95, 1.2, 1.2]])
    assert torch.allclose(grad_of(loss.sum(), logp), -wc * adv.unsqueeze(-1), atol=1e-6)
    with pytest.raises(ConfigError, match=r"^loss.mode: expected 'mask' or 'clip', got 'nope'$"):
        build("loss", "dispo", {"mode": "nope"})
    with pytest.raises(ConfigError, match=r"^loss.eps_neg_low: expected a value >= 0 and < 1, got 1$"):
        build("loss", "dispo", {"eps_neg_low": 1})


# ---------------------------------------------------------------------------------------------- Clip-Cov / KL-Cov


def verl_clip_cov(old, logp, adv_tok, mask, lo, hi, ratio_, lb, ub):
    """verl compute_policy_loss_clip_cov (token-mean), re-implemented; uses torch's global RNG like verl."""
    ratio = torch.exp(logp - old)
    pg1 = -adv_tok * ratio
    pg2 = -adv_tok * ratio.clamp(1 - lo, 1 + hi)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    mm = lambda x: (x * mask).sum() / (mask.sum() + 1e-8)  # noqa: E731
    cov = (adv_tok - mm(adv_tok)) * (logp.detach() - mm(logp.detach()))
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    k = max(int(ratio_ * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    if len(idx):
        idx = idx[torch.randperm(len(idx))[: min(k, len(idx))]]
    corr = torch.ones_like(adv_tok)
    corr[idx[:, 0], idx[:, 1]] = 0
    pg = torch.maximum(pg1, pg2) * corr
    return (pg * mask).sum() / mask.sum()


def test_clip_cov_matches_verl_with_same_rng():
    logp, old, adv, mask = rand_batch(6, n=8, t=6, spread=0.3)
    adv = adv * 3
    a_tok = adv.unsqueeze(-1).expand_as(logp)
    kw = dict(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0)
    torch.manual_seed(7)
    loss, info = clip_cov(logp, old, adv, mask, **kw)
    ours = (token_mean(mask) * loss).sum()
    torch.manual_seed(7)
    ref = verl_clip_cov(old, logp, a_tok, mask, 0.2, 0.2, kw["clip_cov_ratio"], kw["clip_cov_lb"], kw["clip_cov_ub"])
    assert 0 < int(info["clip_cov"].sum()) == max(int(0.1 * mask.sum()), 1)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.allclose(grad_of(ours, logp), grad_of(ref, logp), atol=1e-6)


def test_clip_cov_detaches_exactly_the_selected_tokens():
    # logp - mean(logp) = [[1, -1], [1, -1]], A - mean(A) = [[2, 2], [-2, -2]]: cov = +2 on (0,0), (1,1); -2 elsewhere
    logp = torch.tensor([[-1.0, -3.0], [-1.0, -3.0]], requires_grad=True)
    adv = torch.tensor([[2.0, 2.0], [-2.0, -2.0]])
    mask = torch.ones(2, 2)
    loss, info = clip_cov(logp, logp.detach(), adv, mask, clip_cov_ratio=1.0, clip_cov_lb=1.0, clip_cov_ub=5.0)
    assert info["clip_cov"].tolist() == [[True, False], [False, True]]
    g = grad_of(loss.sum(), logp)
    ppo = grad_of(ppo_clip(logp, logp.detach(), adv)[0].sum(), logp)
    assert torch.allclose(g, ppo * torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    assert loss[0, 0] == 0 and loss[1, 1] == 0
    # nothing in (lb, ub): no token is touched
    loss2, info2 = clip_cov(logp, logp.detach(), adv, mask, clip_cov_lb=3.0)
    assert not info2["clip_cov"].any() and torch.equal(loss2, ppo_clip(logp, logp.detach(), adv)[0])


def verl_kl_cov(old, logp, adv_tok, mask, ratio_, coef):
    d = logp - old
    pg = -adv_tok * torch.exp(d)
    pg_kl = pg + coef * d.abs()
    out = pg.clone()
    valid = mask > 0
    vidx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv_tok[valid].detach(), logp[valid].detach()
    cov = (a - a.mean()) * (lp - lp.mean())
    top = torch.topk(cov, max(1, int(len(cov) * ratio_))).indices
    flat = vidx[top]
    out[flat // logp.shape[1], flat % logp.shape[1]] = pg_kl[flat // logp.shape[1], flat % logp.shape[1]]
    return (out * mask).sum() / mask.sum()


def test_kl_cov_hand_values_and_verl():
    logp = torch.tensor([[-1.0, -3.0], [-3.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -3.0], [-3.0, -1.0]])
    adv = torch.tensor([[2.0, 2.0], [-2.0, -2.0]])
    loss, info = kl_cov(logp, old, adv, torch.ones(2, 2), kl_cov_ratio=0.25, ppo_kl_coef=2.0)
    assert info["kl_cov"].sum() == 1 and bool(info["kl_cov"][0, 0])  # the top-covariance token
    assert loss[0, 0].item() == pytest.approx(-2 * math.exp(0.5) + 2 * 0.5, abs=1e-5)
    assert loss[1, 1].item() == pytest.approx(2.0)  # -A rho, no penalty
    lp2, old2, adv2, mask2 = rand_batch(8, n=10, t=8)
    a_tok = adv2.unsqueeze(-1).expand_as(lp2)
    ours = (token_mean(mask2) * kl_cov(lp2, old2, adv2, mask2, kl_cov_ratio=0.1)[0]).sum()
    ref = verl_kl_cov(old2, lp2, a_tok, mask2, 0.1, 0.1)  # verl actor.yaml ppo_kl_coef
    assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.allclose(grad_of(ours, lp2), grad_of(ref, lp2), atol=1e-6)


# ---------------------------------------------------------------------------------------------- edge cases


ALL_LOSSES = ["ppo_clip", "gspo", "gmpo", "gpg", "cispo", "dispo", "sapo", "clip_cov", "kl_cov"]


def _call(name, logp, old, adv, mask):
    return call_stage(registry.get("loss", name), {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask}, {})


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_every_loss_edge_cases(name):
    logp, old, adv, mask = rand_batch(9, empty_row=True)
    # extreme ratios: finite loss and gradient
    wild = (old + torch.tensor([100.0, -100.0, 0.0, 30.0, -30.0]) * torch.ones(6, 1)).requires_grad_(True)
    loss, _ = _call(name, wild, old, adv, mask)
    agg = (token_mean(mask) * loss).sum()
    assert torch.isfinite(agg) and torch.isfinite(grad_of(agg, wild)).all()
    # empty mask: every aggregation gives 0, no NaN
    zero = torch.zeros_like(mask)
    loss, _ = _call(name, logp, old, adv, zero)
    for agg_name in registry.names("aggregation"):
        val = (registry.get("aggregation", agg_name)(zero, max_len=5) * loss).sum()
        assert val.item() == 0.0 and torch.isfinite(grad_of(val, logp)).all()
    # all-equal advantages (zero after group normalisation): no policy signal
    loss, _ = _call(name, logp, old, torch.zeros(6), mask)
    agg = (token_mean(mask) * loss).sum()
    if name == "kl_cov":  # only the KL penalty on the selected token remains, and it is >= 0
        assert agg.item() >= 0.0
    else:
        assert agg.item() == 0.0 and float(grad_of(agg, logp).abs().max()) == 0.0
    # [N, T] advantages are accepted everywhere
    loss, _ = _call(name, logp, old, adv.unsqueeze(-1).expand(6, 5).contiguous(), mask)
    assert loss.shape == (6, 5)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_every_loss_on_policy_gradient_is_policy_gradient(name):
    """On-policy (old = logp), summed over tokens, every loss has d/dlogp_t = -A: the policy gradient (gspo /
    gmpo spread the sequence value over |o| tokens; clip_cov's covariance is 0 < lb; kl_cov's |d| = 0)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.ones(1, 3)
    loss, _ = _call(name, logp, logp.detach(), torch.tensor([0.7]), mask)
    g = grad_of((seq_mean_token_sum(mask) * loss).sum(), logp)
    assert torch.allclose(g, torch.full((1, 3), -0.7), atol=1e-6)


# ---------------------------------------------------------------------------------------------- aggregation anchors


def test_aggregations_match_trl_and_verl_on_random_inputs():
    torch.manual_seed(2)
    mask = (torch.rand(7, 9) > 0.3).float()
    mask[:, 0] = 1
    L = torch.randn(7, 9)
    # TRL dr_grpo: sum / (B * max_completion_length)
    trl_dr = (L * mask).sum() / (L.size(0) * 16)
    assert torch.allclose((dr_grpo(mask, max_len=16) * L).sum(), trl_dr)
    # verl seq-mean-token-mean == TRL grpo
    verl_smtm = ((L * mask).sum(-1) / mask.sum(-1)).mean()
    trl_grpo = ((L * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    assert torch.allclose((seq_mean_token_mean(mask) * L).sum(), verl_smtm)
    assert torch.allclose(verl_smtm, trl_grpo)
    # verl token-mean == TRL dapo / bnpo on one micro-batch
    assert torch.allclose((token_mean(mask) * L).sum(), (L * mask).sum() / mask.sum())
    # verl seq-mean-token-sum
    assert torch.allclose((seq_mean_token_sum(mask) * L).sum(), (L * mask).sum(-1).mean())
    # TRL grpo over 2 equal micro-batches / accumulation steps == postrl weights over the whole mini-batch
    halves = [(m, x) for m, x in zip(mask[:6].chunk(2), L[:6].chunk(2))]
    trl_acc = sum(((x * m).sum(-1) / m.sum(-1)).mean() / 2 for m, x in halves)
    assert torch.allclose((seq_mean_token_mean(mask[:6]) * L[:6]).sum(), trl_acc)


# ---------------------------------------------------------------------------------------------- TIS


def test_tis_token_and_sequence_truncate_and_mask():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.1]]))
    sampler = torch.log(torch.tensor([[0.1, 0.5, 0.4], [0.3, 0.9, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    tok = tis_weights(old, sampler, mask, level="token", cap=2.0)
    assert torch.allclose(tok, torch.tensor([[2.0, 1.0, 1.25], [2.0, 1.0, 1.0]]), atol=1e-6)
    tokm = tis_weights(old, sampler, mask, level="token", mode="mask", cap=2.0)
    assert torch.allclose(tokm, torch.tensor([[0.0, 1.0, 1.25], [0.0, 1.0, 1.0]]), atol=1e-6)
    seq = tis_weights(old, sampler, mask, level="sequence", cap=10.0)  # products 5 * 1 * 1.25 and 3 * 1
    assert torch.allclose(seq, torch.tensor([[6.25] * 3, [3.0] * 3]), atol=1e-5)
    seqm = tis_weights(old, sampler, mask, level="sequence", mode="mask", cap=5.0)
    assert torch.allclose(seqm, torch.tensor([[0.0] * 3, [3.0] * 3]), atol=1e-5)
    with pytest.raises(ValueError, match="cap"):
        tis_weights(old, sampler, mask, cap=0.0)
    with pytest.raises(ConfigError, match=r"^loss.tis.cap: "):  # the run's loss.tis section holds cap > 0
        load_config(None, ["loss.tis.level=token", "loss.tis.cap=0"])


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_tis_matches_trl_vllm_importance_sampling(mode):
    _, old, _, mask = rand_batch(11, spread=0.0)
    sampler = old + torch.randn_like(old) * 0.4
    diff = (old - sampler) * mask
    level, how = mode.split("_")
    r = torch.exp(diff.sum(-1, keepdim=True) if level == "sequence" else diff)
    r = r.clamp(max=3.0) if how == "truncate" else r.masked_fill(r > 3.0, 0.0)
    ours = tis_weights(old, sampler, mask, level=level, mode=how, cap=3.0)
    assert torch.allclose(ours * mask, r.expand_as(ours) * mask, atol=1e-5)


# ---------------------------------------------------------------------------------------------- KL


def test_straight_through_kl_has_k2_gradient_and_estimator_value():
    logp = torch.tensor([-0.2, -1.5, -3.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -0.5])
    for st, base in ((kl_k3_st, kl_k3), (kl_k1_st, kl_k1), (kl_abs_st, kl_abs)):
        val = st(logp, ref)
        assert torch.allclose(val, base(logp, ref))
        assert torch.allclose(grad_of(val.sum(), logp), grad_of(kl_k2(logp, ref).sum(), logp))
        assert torch.allclose(grad_of(val.sum(), logp), (logp - ref).detach())  # d k2 / d logp = logp - ref
    assert registry.get("kl", "k3+") is kl_k3_st
    assert {"k1+", "abs+"} <= set(registry.names("kl"))


def test_kl_is_correction_weights_the_kl_by_the_differentiable_ratio():
    """kl.is_correction=token: the loss's KL term is k3_t * exp(logp_t - old_logp_t) (TRL use_bias_correction_kl).
    On policy (old = sg(logp)) its value is the plain k3 but its gradient gains k3_t (d exp(logp - sg(logp)) = 1):
    d/dlogp [k3 * r] = (1 - exp(ref - logp)) + k3 per token, times the token_mean weight 1/2 (two tokens)."""
    from postrl.losses.objective import Objective

    def run(correction: str):
        cfg = load_config(None, ["kl.coef=1.0", f"kl.is_correction={correction}", "loss.agg=token_mean"])
        obj = Objective.from_config(cfg)
        logp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
        ref = torch.tensor([[-1.0, -1.0]])
        mask = torch.ones(1, 2)
        fields = {"logp": logp, "old_logp": logp.detach(), "ref_logp": ref, "advantages": torch.zeros(1),
                  "mask": mask, "lengths": mask.sum(-1)}
        loss, stats, info = obj(fields, obj.weights(mask))
        return loss, grad_of(loss, logp), stats["kl"]

    k3 = torch.exp(torch.tensor([-0.5, 1.0])) - torch.tensor([-0.5, 1.0]) - 1  # ref - logp = -0.5, 1.0
    plain_loss, plain_grad, plain_kl = run("none")
    loss, grad, kl = run("token")
    assert kl == pytest.approx(plain_kl) == pytest.approx(float(k3.mean()), abs=1e-6)  # same value on policy
    dk3 = 1 - torch.exp(torch.tensor([[-0.5, 1.0]]))
    assert torch.allclose(plain_grad, dk3 / 2, atol=1e-6)
    assert torch.allclose(grad, (dk3 + k3) / 2, atol=1e-6)
    with pytest.raises(ConfigError, match="kl.is_correction weighs the KL term of the loss"):
        load_config(None, ["kl.coef=0.1", "kl.placement=reward", "kl.is_correction=token"])


def test_off_policy_mask_hand_values():
    """off_policy_mask: d_i = mean over the row's tokens of sampler_logp - logp; keep A >= 0 or d_i <= threshold."""
    logp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    sampler = torch.tensor([[0.0, 0.0], [-1.0, float("nan")], [0.0, -2.0]])  # d = 1, 0 (NaN counts 0), 0
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    adv = torch.tensor([-1.0, -1.0, -1.0])
    out = build("regularizer", "off_policy_mask", {"threshold": 0.5})(
        {"advantages": adv, "logp": logp, "sampler_logp": sampler, "mask": mask})["pg_mask"]
    assert out.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    out = build("regularizer", "off_policy_mask", {"threshold": 0.5})(
        {"advantages": -adv, "logp": logp, "sampler_logp": sampler, "mask": mask})["pg_mask"]
    assert out.sum() == 6  # positive advantages are always kept


def test_vespo_hand_values():
    """vespo: on policy phi(1) = e^lambda 1^k e^-lambda = 1, so L = -A logp; a sequence whose log-ratios sum to
    log 2 (A > 0: k = 2, lambda = 3) has phi = exp(3 + 2 log 2 - 3 * 2) = 4 e^-3; the weight is detached."""
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    loss, info = build("loss", "vespo")({"logp": logp, "old_logp": logp.detach(), "advantages": torch.tensor([2.0]),
                                         "mask": mask})
    assert torch.allclose(loss, torch.tensor([[2.0, 4.0]]))
    old = logp.detach() - torch.tensor([[LOG(2) / 2, LOG(2) / 2]])
    loss, info = build("loss", "vespo")({"logp": logp, "old_logp": old, "advantages": torch.tensor([1.0]),
                                         "mask": mask})
    phi = 4 * math.exp(-3)
    assert torch.allclose(info["phi"], torch.full((1, 2), phi), atol=1e-6)
    assert torch.allclose(grad_of(loss.sum(), logp), torch.full((1, 2), -phi), atol=1e-6)  # d(-phi A logp) = -phi A
    # A < 0 (k = 3, lambda = 2): exp(2 + 3 log 2 - 2 * 2) = 8 e^-2
    _, info = build("loss", "vespo")({"logp": logp, "old_logp": old, "advantages": torch.tensor([-1.0]),
                                      "mask": mask})
    assert torch.allclose(info["phi"], torch.full((1, 2), 8 * math.exp(-2)), atol=1e-6)


def test_kl_reward_penalty_hand_values():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.9, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.3], [0.4, 0.9, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    seq, tok, current = kl_reward_penalty(logp, ref, mask, kl_k1)
    assert torch.allclose(seq, torch.tensor([LOG(2), LOG(0.5)]), atol=1e-6)
    assert tok[0, 2] == 0  # masked token contributes nothing
    assert current == pytest.approx((LOG(2) / 2 + LOG(0.5) / 3) / 2, abs=1e-6)  # verl current_kl


def test_adaptive_kl_controller_matches_ziegler_update():
    c = KLController(0.1, adaptive=True, target=0.1, horizon=100)
    c.update(0.15, n_steps=10)  # error +0.5 clipped to +0.2: coef * (1 + 0.2 * 10 / 100)
    assert c.value == pytest.approx(0.1 * 1.02)
    c.update(0.09, n_steps=10)  # error -0.1
    assert c.value == pytest.approx(0.1 * 1.02 * 0.99)
    c2 = KLController(0.5, adaptive=False)
    c2.update(10.0, 1000)
    assert c2.value == 0.5
    c2.load_state_dict(c.state_dict())
    assert c2.value == c.value
    with pytest.raises(ValueError):
        KLController(0.1, adaptive=True, target=0.0)
    with pytest.raises(ConfigError, match=r"^kl.target: "):  # the run's kl section holds target > 0
        load_config(None, ["kl.controller=adaptive", "kl.coef=0.1", "kl.target=0"])


# ---------------------------------------------------------------------------------------------- regularisers


def test_entropy_bonus_and_adaptive_entropy():
    h = torch.tensor([[0.5, 1.0]], requires_grad=True)
    assert torch.equal(entropy_bonus(h), -h)
    reg = AdaptiveEntropy(target=0.3, delta=0.01, init=0.0, max_alpha=0.015)
    assert num(reg(h).abs().sum()) == 0.0
    reg.end_step(StepEnd({"entropy": 0.5}))  # above target: alpha stays at its floor 0
    assert reg.alpha == 0.0
    reg.end_step(StepEnd({"entropy": 0.1}))
    reg.end_step(StepEnd({"entropy": 0.1}))  # below target twice: +0.01 then capped at 0.015
    assert reg.alpha == pytest.approx(0.015)
    assert torch.allclose(reg(h), -0.015 * h)
    reg.end_step(StepEnd({"entropy": 0.4}))
    assert reg.alpha == pytest.approx(0.005)
    other = AdaptiveEntropy()
    other.load_state_dict(reg.state_dict())
    assert other.alpha == reg.alpha
    assert _fields(AdaptiveEntropy) == {"entropy"} and _fields(other) == {"entropy"}


def test_top_entropy_tokens_matches_trl_quantile_rule():
    ent = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0]])
    out = top_entropy_tokens(ent, mask, q=0.2)["pg_mask"]
    # 9 valid tokens, quantile 0.8 (linear) = 0.74: keeps 0.8 and 0.9; the padded 5.0 never counts
    assert out.tolist() == [[0, 0, 0, 0, 0], [0, 0, 1, 1, 0]]
    thr = torch.quantile(ent[mask.bool()], 0.8)  # TRL get_high_entropy_mask
    assert torch.equal(out.bool(), (ent >= thr) & mask.bool())
    assert top_entropy_tokens(ent, mask, q=1.0)["pg_mask"].sum() == 9
    assert top_entropy_tokens(ent, torch.zeros_like(mask))["pg_mask"].sum() == 0
    with pytest.raises(ConfigError, match=r"^regularizer.q: expected a value > 0 and <= 1, got 0.0$"):
        build("regularizer", "top_entropy_tokens", {"q": 0.0})


def test_entropy_band_hand_values():
    ent = torch.tensor([[0.2, 0.5, 1.0, 3.0, 0.1]], requires_grad=True)
    mask = torch.ones(1, 5)
    r = entropy_band(ent, mask, q=0.8, low=0.6, high=2.0)  # forking = top 80%: all but 0.1
    assert torch.allclose(r, torch.tensor([[0.4, 0.1, 0.0, 1.0, 0.0]]), atol=1e-6)
    assert torch.allclose(grad_of(r.sum(), ent), torch.tensor([[-1.0, -1.0, 0.0, 1.0, 0.0]]))


def test_lp_reg_value_and_gradient():
    p = torch.tensor([0.7, 0.29, 0.01])
    logits = p.log().view(1, 1, 3).clone().requires_grad_(True)
    r = lp_reg(logits, torch.tensor([1.0]), min_p=0.02)  # drops 0.01 < 0.02 * 0.7
    assert num(r) == pytest.approx(-math.log(0.99), abs=1e-6)
    q = torch.tensor([0.7, 0.29, 0.0]) / 0.99
    assert torch.allclose(grad_of(r.sum(), logits).view(3), p - q, atol=1e-6)  # mass moves to the kept tokens
    assert num(lp_reg(logits, torch.tensor([1.0]), negative_only=True)) == 0.0
    assert num(lp_reg(logits, torch.tensor([1.0]), min_p=0.0)) == pytest.approx(0.0, abs=1e-6)  # proxy = policy


def test_entropy_smoothing_band_and_history():
    reg = EntropySmoothing(window=2, band=0.1)
    ent = torch.tensor([[1.5, 0.5]], requires_grad=True)
    mask = torch.ones(1, 2)
    assert num(reg(ent, mask).abs().sum()) == 0.0  # no history yet
    reg.end_step(StepEnd({"entropy": 1.0}))
    reg.end_step(StepEnd({"entropy": 0.6}))
    reg.end_step(StepEnd({"entropy": 0.8}))  # window 2: history [0.6, 0.8] -> reference 0.7
    assert reg.reference == pytest.approx(0.7)
    r = reg(ent, mask)  # batch mean 1.0 > 0.7 * 1.1: s = +1, R = H - 0.7
    assert torch.allclose(r, torch.tensor([[0.8, -0.2]]), atol=1e-6)
    assert num((r * 0.5).sum()) == pytest.approx(0.3)  # aggregated: |1.0 - 0.7|
    assert torch.allclose(grad_of(r.sum(), ent), torch.ones(1, 2))
    inside = reg(torch.tensor([[0.72, 0.72]]), mask)
    assert num(inside.abs().sum()) == 0.0
    copy = EntropySmoothing(window=2)
    copy.load_state_dict(reg.state_dict())
    assert copy.reference == reg.reference


def test_entropy_smoothing_phase_weight_is_epos_schedule():
    from postrl.losses.regularizers import phase_weight

    # K = 10, h = 5: w_k = 1 - 0.2 (1 - exp(-2 k / 5)) up to k = 5, then 0.8 exp(-3 (k - 5) / 5)
    assert phase_weight(0, 10) == 1.0
    assert phase_weight(5, 10) == pytest.approx(1 - 0.2 * (1 - math.exp(-2.0)))  # 0.827067
    assert phase_weight(6, 10) == pytest.approx(0.8 * math.exp(-0.6))  # 0.439049
    assert phase_weight(10, 10) == pytest.approx(0.8 * math.exp(-3.0)) == phase_weight(25, 10)  # 0.039829, clamped
    assert phase_weight(7, None) == 1.0
    reg = EntropySmoothing(window=2, band=0.1, phase_steps=10)
    for h in (1.0, 0.6, 0.8):  # history [0.6, 0.8] -> reference 0.7; three steps taken
        reg.end_step(StepEnd({"entropy": h}))
    w = 1 - 0.2 * (1 - math.exp(-2 * 3 / 5))  # 0.860239
    assert reg.phase_weight == pytest.approx(w)
    r = reg(torch.tensor([[1.5, 0.5]]), torch.ones(1, 2))  # s = +1 as without phases, scaled by w
    assert torch.allclose(r, w * torch.tensor([[0.8, -0.2]]), atol=1e-6)
    assert reg.end_step(StepEnd({"entropy": 0.7}))["phase_weight"] == pytest.approx(w)  # the weight the step used
    copy = EntropySmoothing(window=2, phase_steps=10)
    copy.load_state_dict(reg.state_dict())
    assert copy.steps == 4 and copy.phase_weight == pytest.approx(reg.phase_weight)


def test_f_divergence_unbiased_for_forward_kl_and_js():
    p_ref = torch.tensor([0.1, 0.6, 0.3])
    p_th = torch.tensor([0.3, 0.3, 0.4])
    fwd = num((p_ref * (p_ref / p_th).log()).sum())
    m = (p_ref + p_th) / 2
    js = num(0.5 * (p_ref * (p_ref / m).log()).sum() + 0.5 * (p_th * (p_th / m).log()).sum())
    for div, exact in (("forward_kl", fwd), ("js", js)):
        # samples of the initial policy: E_ref[f(t)]
        est = (p_ref * f_divergence(p_th.log(), p_ref.log(), p_ref.log(), divergence=div)).sum()
        assert num(est) == pytest.approx(exact, abs=1e-6)
        # samples of the current policy, importance-weighted toward pi_ref (cap large enough not to bind)
        est = (p_th * f_divergence(p_th.log(), p_th.log(), p_ref.log(), divergence=div, cap=100.0)).sum()
        assert num(est) == pytest.approx(exact, abs=1e-6)
        # each term >= 0 and 0 (with zero gradient) where pi_theta = pi_ref
        lp = p_ref.log().clone().requires_grad_(True)
        r = f_divergence(lp, lp.detach(), p_ref.log(), divergence=div)
        assert num(r.abs().max()) < 1e-7 and num(grad_of(r.sum(), lp).abs().max()) < 1e-6
    with pytest.raises(ConfigError, match=r"^regularizer.divergence: expected 'forward_kl' or 'js', got 'tv'$"):
        build("regularizer", "f_divergence", {"divergence": "tv"})


def test_regularizers_registered_with_fields():
    names = set(registry.names("regularizer"))
    assert {"f_divergence", "entropy_bonus", "adaptive_entropy", "top_entropy_tokens", "entropy_band", "lp_reg",
            "entropy_smoothing"} <= names
    assert _fields(f_divergence) == {"logp", "old_logp", "ref_logp"}
    assert _fields(lp_reg) == {"logits", "advantages"}
    assert _fields(gspo) == {"logp", "old_logp", "advantages", "mask"}


def test_loss_kl_regularizer_config_validation():
    from postrl.config import load_config
    from postrl.errors import ConfigError

    cfg = load_config(None, ["kl.estimator=k3+", "kl.coef=0.1", "kl.placement=reward", "loss.tis.level=sequence",
                             "regularizers=[{name: entropy_bonus, coef: 0.01}, {name: adaptive_entropy, target: 0.3}]"])
    assert cfg.loss.tis.level == "sequence" and cfg.loss.params == {} and cfg.regularizers[1].params == {"target": 0.3}
    with pytest.raises(ConfigError, match="regularizers.0: unknown parameter 'tgt'.*target"):
        load_config(None, ["regularizers=[{name: adaptive_entropy, tgt: 0.3}]"])
    with pytest.raises(ConfigError, match="unknown regularizer 'nope'"):
        load_config(None, ["regularizers=[{name: nope}]"])
    with pytest.raises(ConfigError, match="unknown kl 'k2\\+'"):
        load_config(None, ["kl.estimator=k2+"])
    with pytest.raises(ConfigError, match="kl.controller=adaptive needs kl.coef > 0"):
        load_config(None, ["kl.controller=adaptive"])
    with pytest.raises(ConfigError, match="loss.tis.level"):
        load_config(None, ["loss.tis.level=tokens"])
    # a rule over two parameters, checked when the config is read
    with pytest.raises(ConfigError, match=r"^regularizers.0.high: expected a value >= low \(0.7\), got 0.5$"):
        load_config(None, ["regularizers=[{name: entropy_band, high: 0.5}]"])
    with pytest.raises(ConfigError, match=r"^regularizers.0.max_alpha: expected a value >= init \(0.2\), got 0.1$"):
        load_config(None, ["regularizers=[{name: adaptive_entropy, init: 0.2}]"])
    with pytest.raises(ConfigError, match=r"^regularizers.0.window: expected a value >= 1, got 0$"):
        load_config(None, ["regularizers=[{name: entropy_smoothing, window: 0}]"])
    with pytest.raises(ConfigError, match="unknown aggregation"):
        load_config(None, ["loss.agg=token-mean"])


def _fields(fn) -> set:
    return set(_reads(fn))
