"""Shaping stages: hand-computed values, invariants, stage state, and the trainer's scoring path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from postrl.config import load_config
from postrl.errors import ConfigError

from postrl import registry
from postrl.stages import Stage, call_stage
from postrl.reasoning_steps import split_steps, step_token_ends
from postrl.shaping import weighted_sum
from postrl.stages import StepEnd, build, load_state, reads, state_of
from postrl.shaping.length import (AdaptiveLengthCoef, LaserD, conciseness_gated, cosine_length, grpo_lambda,
                                   kimi_length, laser, overlong_soft, truncation_penalty)
from postrl.shaping.process import clip_prm, delta_prm, gated, min_form, potential
from postrl.shaping.transforms import (DatasetMedian, RunningNorm, centered, ensemble_mean, ensemble_min,
                                       ensemble_uwo, par)

nan = float("nan")
T = torch.tensor


def close(a, b, tol=1e-6):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    same_nan = torch.isnan(a) == torch.isnan(b)
    assert same_nan.all(), (a, b)
    assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=tol), (a, b)


# ------------------------------------------------------------------------------------------------ transforms


def stepped(stage, *args):
    """One training step of a stateful stage: its call, its observation of the same fields, its end of step."""
    names = reads(stage)
    out = stage(*args)
    call_stage(stage.observe, dict(zip(names, args)), {})
    Stage("shaping", "s", stage, {}, names).end_step(StepEnd())  # applies what it recorded, then forgets it
    return out


def test_par_hand_values_bounded_monotone():
    r = T([[0.0], [1.0], [nan], [-2.0]])
    out = par(r, ["rm"], {"ref_reward": [0.0, 0.0, 0.0, [0.0, 2.0]]})["rewards"][:, 0]
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    close(out, [0.5, s(1.0), nan, 0.5 * (s(-2.0) + s(-4.0))])
    x = torch.linspace(-10, 10, 41).unsqueeze(-1)  # (float32 saturates sigmoid beyond ~|17|)
    y = par(x, ["rm"], {"ref_reward": [0.3] * 41})["rewards"][:, 0]
    assert ((y > 0) & (y < 1)).all() and (y.diff() > 0).all()
    with pytest.raises(ValueError, match="row 1 has no usable reference"):
        par(T([[1.0], [2.0]]), ["rm"], {"ref_reward": [0.0, None]})
    with pytest.raises(ValueError, match="no 'ref_reward' column"):
        par(T([[1.0]]), ["rm"], {})


def test_centered_group_mean_excludes_nan():
    r = T([[1.0, 5.0], [3.0, nan], [2.0, 1.0], [4.0, 3.0]])
    out = centered(r, ["a", "b"], T([0, 0, 1, 1]))["rewards"]
    close(out, [[-1.0, 0.0], [1.0, nan], [-1.0, -1.0], [1.0, 1.0]])
    out = centered(r, ["a", "b"], T([0, 0, 1, 1]), {"ref": [1.0, 1.0, 0.0, 0.0]}, sources=["a"], ref_column="ref")
    close(out["rewards"][:, 0], [0.0, 2.0, 2.0, 4.0])


def test_running_norm_matches_full_sample_and_state_round_trip():
    rn = RunningNorm()
    a, b = T([[1.0], [2.0], [nan], [3.0]]), T([[10.0], [0.0]])
    stepped(rn, a, ["r"])
    out = stepped(rn, b, ["r"])["rewards"][:, 0]
    allv = torch.tensor([1.0, 2.0, 3.0, 10.0, 0.0], dtype=torch.float64)
    mu, sd = allv.mean(), allv.std(unbiased=False)
    close(out, (torch.tensor([10.0, 0.0], dtype=torch.float64) - mu) / (sd + 1e-8), 1e-5)
    rn2 = RunningNorm()
    rn2.load_state_dict(json.loads(json.dumps(rn.state_dict())))
    c = T([[4.0], [5.0]])
    close(rn2(c, ["r"])["rewards"], rn(c, ["r"])["rewards"])


def test_ensembles_hand_values():
    r = T([[1.0, 3.0, 1.0], [2.0, nan, 0.0]])
    names, w = ["rm1", "rm2", "correct"], T([1.0, 1.0, 0.5])
    out = ensemble_mean(r, names, w, sources=["rm1", "rm2"])
    assert out["reward_names"] == ["ensemble", "correct"] and out["reward_weights"].tolist() == [1.0, 0.5]
    close(out["rewards"], [[2.0, 1.0], [nan, 0.0]])
    close(ensemble_min(r, names, w, sources=["rm1", "rm2"])["rewards"][:, 0], [1.0, nan])
    # UWO: mean - lam * population variance = 2 - 0.5 * 1
    close(ensemble_uwo(r, names, w, sources=["rm1", "rm2"], lam=0.5)["rewards"][:, 0], [1.5, nan])
    with pytest.raises(ValueError, match="columns: rm1, rm2, correct"):
        ensemble_mean(r, names, w, sources=["rm1", "nope"])


def test_uwo_has_one_default_everywhere():
    """ensemble_uwo (shaping), aggregate_ensemble and the model reward source share UWO_LAMBDA (was 0.5 / 1.0)."""
    import inspect

    from postrl.reward_models.metrics import UWO_LAMBDA, aggregate_ensemble
    from postrl.rewards.model import model_reward

    s = T([[1.0, 3.0], [2.0, 2.0]])
    shaped = ensemble_uwo(s, ["a", "b"], T([1.0, 1.0]))["rewards"][:, 0]
    close(shaped, aggregate_ensemble(s, "uwo"))
    close(shaped, [2.0 - UWO_LAMBDA * 1.0, 2.0])
    assert inspect.signature(model_reward).parameters["uwo_lambda"].default == UWO_LAMBDA
    assert inspect.signature(ensemble_uwo).parameters["lam"].default == UWO_LAMBDA


def test_dataset_median_maps_median_to_target():
    dm = DatasetMedian(key="task", target=0.5)
    r = T([[0.0], [2.0], [4.0], [10.0], [20.0], [30.0]])
    out = stepped(dm, r, ["r"], {"task": ["a", "a", "a", "b", "b", "b"]})["rewards"][:, 0]
    # a: lo 0, med 2, hi 4 -> 0, 0.5, 1 ; b: lo 10, med 20, hi 30 -> 0, 0.5, 1
    close(out, [0.0, 0.5, 1.0, 0.0, 0.5, 1.0])
    out = stepped(dm, T([[1.0]]), ["r"], {"task": ["a"]})["rewards"][:, 0]  # window a = [0, 2, 4, 1]: med 1.5
    close(out, [0.5 * (1.0 - 0.0) / 1.5])
    st = dm.state_dict()
    assert st["history"]["r|a"] == [0.0, 2.0, 4.0, 1.0]
    dm2 = DatasetMedian()
    dm2.load_state_dict(st)
    assert dm2.history == dm.history


# ------------------------------------------------------------------------------------------------ process


SR = T([[0.9, 0.2, nan], [0.6, 0.7, 0.3]])
R2 = T([[1.1, 1.0], [1.6, 0.0]])  # columns: prm (sum of steps), correct
NAMES = ["prm", "correct"]


def test_clip_prm_hand_values():
    out = clip_prm(SR, R2, NAMES, "prm", eta=0.5)
    close(out["step_rewards"], [[0.0, -0.3, nan], [0.0, 0.0, -0.2]])
    close(out["rewards"][:, 0], [-0.3, -0.2])
    assert (out["rewards"][:, 0] <= 0).all()


def test_delta_prm_hand_values_sum_is_first_step():
    out = delta_prm(SR, R2, NAMES, "prm")
    close(out["step_rewards"], [[0.7, 0.2, nan], [-0.1, 0.4, 0.3]])
    close(out["rewards"][:, 0], [0.9, 0.6])


def _tail_sums(step_rewards):
    """sum_{k >= s} r'_k per step (the return the step_return advantage gives step s), NaN where no step."""
    x = torch.nan_to_num(step_rewards.double())
    tail = torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])
    return torch.where(torch.isfinite(step_rewards), tail, torch.full_like(tail, nan))


def test_min_form_hand_values_and_invariant():
    out = min_form(T([[0.9, 0.2, 0.5], [0.4, nan, nan]]), T([[1.6], [0.4]]), ["prm"], "prm")
    assert set(out) == {"step_rewards", "rewards"}  # no step_returns: the sums of step_rewards are the returns
    close(out["step_rewards"], [[0.0, -0.3, 0.5], [0.4, nan, nan]])
    close(_tail_sums(out["step_rewards"]), [[0.2, 0.2, 0.5], [0.4, nan, nan]])
    close(out["rewards"][:, 0], [0.2, 0.4])
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 7, generator=g)
    x[torch.arange(7).expand(16, 7) >= torch.randint(1, 8, (16, 1), generator=g)] = nan  # rows of 1..7 steps
    ret = _tail_sums(min_form(x, torch.zeros(16, 1), ["p"], "p")["step_rewards"])
    for t in range(7):  # the return from step t is min_{k >= t} r_k
        tail_min = torch.where(torch.isfinite(x[:, t:]), x[:, t:], torch.full_like(x[:, t:], 9.0)).min(-1).values
        fin = torch.isfinite(x[:, t])
        close(ret[fin, t], tail_min[fin], 1e-5)


def test_min_form_temperature_is_pures_softmin_weighting():
    # PURE's code: r'_t = softmax(-r / tau)_t r_t; [0.8, 0.3] with tau 0.1: weights e^-8, e^-3 (normalised)
    out = min_form(T([[0.8, 0.3], [0.5, nan]]), T([[1.1], [0.5]]), ["prm"], "prm", temperature=0.1)
    w = [math.exp(-8) / (math.exp(-8) + math.exp(-3)), math.exp(-3) / (math.exp(-8) + math.exp(-3))]
    close(out["step_rewards"], [[0.8 * w[0], 0.3 * w[1]], [0.5, nan]], 1e-6)
    close(out["rewards"][:, 0], [0.8 * w[0] + 0.3 * w[1], 0.5], 1e-6)
    small = min_form(T([[0.8, 0.3, 0.6]]), T([[0.0]]), ["prm"], "prm", temperature=1e-3)["rewards"][0, 0]
    assert small.item() == pytest.approx(0.3, abs=1e-6)  # -> min as tau -> 0
    with pytest.raises(ConfigError, match=r"^shaping.temperature: expected a value >= 0, got -1.0$"):
        build("shaping", "min_form", {"temperature": -1.0})


def test_gated_adds_steps_only_when_outcome_passes():
    out = gated(SR, R2, NAMES, "prm", outcome="correct", threshold=1.0)
    close(out["rewards"][:, 0], [1.1, 0.0])
    close(out["step_rewards"], [[0.9, 0.2, nan], [0.0, 0.0, 0.0]])
    r = R2.clone()
    r[0, 1] = nan
    assert math.isnan(gated(SR, r, NAMES, "prm")["rewards"][0, 0])


def test_potential_hand_values_and_telescoping():
    out = potential(T([[1.0, 2.0]]), T([[3.0]]), ["v"], "v", gamma=0.5, phi0=0.0)
    close(out["step_rewards"], [[0.5, 0.0]])  # F1 = .5*1 - 0, F2 = .5*2 - 1
    close(out["rewards"][:, 0], [0.5])  # = gamma^2 Phi(s_2) - Phi(s_0) = .25 * 2
    g = torch.Generator().manual_seed(1)
    phi = torch.randn(10, 6, generator=g)
    lens = torch.randint(1, 7, (10,), generator=g)
    phi[torch.arange(6).expand(10, 6) >= lens.unsqueeze(-1)] = nan
    for gamma, phi0 in ((1.0, 0.0), (0.9, 0.7)):
        o = potential(phi, torch.zeros(10, 1), ["v"], "v", gamma=gamma, phi0=phi0)
        last = phi[torch.arange(10), lens - 1]
        close(o["rewards"][:, 0], gamma ** lens.double() * last - phi0, 1e-5)
        disc = gamma ** torch.arange(6, dtype=torch.float64)
        close((torch.nan_to_num(o["step_rewards"].double()) * disc).sum(-1), o["rewards"][:, 0], 1e-5)


def test_process_stage_without_step_scores_is_loud():
    with pytest.raises(ValueError, match="no reward source returned step scores"):
        clip_prm(SR, R2, NAMES, None)


# ------------------------------------------------------------------------------------------------ length


def test_overlong_soft_three_regions_and_verl_anchor():
    L = T([5.0, 6.0, 8.0, 10.0, 12.0])
    out = overlong_soft(T([[1.0]] * 5), ["c"], T([1.0]), L, max_length=10, buffer=4)
    assert out["reward_names"] == ["c", "overlong_soft"]
    close(out["rewards"][:, 1], [0.0, 0.0, -0.5, -1.0, -1.0])
    # verl DAPO reward manager: min(-(L - (Lmax - Lc)) / Lc * factor, 0) for L <= Lmax
    verl = [min(-(x - (10 - 4)) / 4 * 1.0, 0.0) for x in L[:4].tolist()]
    close(out["rewards"][:4, 1], verl)
    with pytest.raises(ConfigError, match=r"^shaping.buffer: expected an integer in \[1, max_length = 4\], got 8$"):
        build("shaping", "overlong_soft", {"max_length": 4, "buffer": 8})
    with pytest.raises(ConfigError, match=r"^shaping.buffer: .* = 20480\], got 30000$"):  # against the default
        build("shaping", "overlong_soft", {"buffer": 30000})


def test_truncation_penalty_zeroes_over_cap():
    r = T([[1.0, 0.5], [1.0, 0.5], [nan, 1.0]])
    out = truncation_penalty(r, ["correct", "fmt"], T([3.0, 9.0, 9.0]), T([False, False, True]), max_length=8)
    close(out["rewards"], [[1.0, 0.5], [0.0, 0.0], [nan, 0.0]])
    out = truncation_penalty(r, ["correct", "fmt"], T([3.0, 9.0, 9.0]), T([False, False, True]),
                             sources=["correct"])
    close(out["rewards"], [[1.0, 0.5], [1.0, 0.5], [nan, 1.0]])


def test_difficulty_truncation_tightens_cap_on_easy_prompts():
    from postrl.shaping.length import difficulty_truncation

    # max_length 100, tighten 0.5: group 0 all correct -> cap floor(100 (1 - 0.5)) = 50; group 1 half correct
    # -> 75; group 2 none correct -> 100 (the plain truncation cap)
    r = T([[1.0], [1.0], [1.0], [0.0], [0.0], [0.0]])
    L = T([40.0, 60.0, 70.0, 80.0, 90.0, 99.0])
    tr = T([False] * 6)
    g = T([0, 0, 1, 1, 2, 2])
    out = difficulty_truncation(r, ["correct"], L, tr, g, max_length=100)
    close(out["truncation_cap"], [50, 50, 75, 75, 100, 100])
    close(out["rewards"], [[1.0], [0.0], [1.0], [0.0], [0.0], [0.0]])  # 60 > 50 zeroed; 70 <= 75 kept
    # the plain DLER truncation with the same cap zeroes nothing here
    close(truncation_penalty(r, ["correct"], L, tr, max_length=100)["rewards"], r)
    # min_length floors the cap; a truncated completion is over the cap; NaN stays NaN
    out = difficulty_truncation(T([[1.0], [nan]]), ["correct"], T([30.0, 5.0]), T([False, True]), T([0, 0]),
                                max_length=100, tighten=0.9, min_length=40)
    close(out["truncation_cap"], [40, 40])  # acc over finite entries = 1 -> floor(100 * 0.1) = 10 -> 40
    close(out["rewards"], [[1.0], [nan]])
    with pytest.raises(ConfigError, match="max_length: required"):
        difficulty_truncation(r, ["correct"], L, tr, g)


def test_difficulty_truncation_cap_defaults_to_max_new_tokens():
    from postrl.config import load_config

    cfg = load_config(None, ["rollout.max_new_tokens=48",
                             "shaping=[{name: difficulty_truncation}, {name: weighted_sum}]"])
    assert cfg.shaping[0].params["max_length"] == 48
    with pytest.raises(ConfigError, match="tighten: expected a value >= 0 and < 1, got 1.5"):
        load_config(None, ["shaping=[{name: difficulty_truncation, tighten: 1.5}, {name: weighted_sum}]"])
    with pytest.raises(ConfigError, match="expected min_length <= max_length"):
        load_config(None, ["rollout.max_new_tokens=16",
                           "shaping=[{name: difficulty_truncation, min_length: 20}, {name: weighted_sum}]"])


def test_laser_step_bonus():
    r = T([[1.0], [1.0], [0.0], [nan]])
    out = laser(r, ["correct"], T([1.0]), T([3.0, 9.0, 2.0, 2.0]), target_length=5, alpha=0.5)
    close(out["rewards"][:, 1], [0.5, 0.0, 0.0, nan])


def test_laser_d_difficulty_targets_adapt():
    stage = LaserD(alpha=1.0, max_length=100, update_every=1, coverage=0.5)
    # group 0 (easy, 4/4 correct): lengths 10, 20, 30, 40 ; group 1 (hard, 1/4 correct): 50 correct
    r = T([[1.0]] * 4 + [[1.0], [0.0], [0.0], [0.0]])
    gids, L = T([0, 0, 0, 0, 1, 1, 1, 1]), T([10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0])
    out = stepped(stage, r, ["correct"], T([1.0]), gids, L)
    close(out["rewards"][:, 1], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # initial target 100 for all levels
    # easy: ExCR(L) >= 0.5 first at L = 20 (2 of 4) ; hard: accuracy 1/4 < 0.5 -> max_length ; medium unseen
    assert stage.targets == [20, 100, 100] and stage.calls == 1
    out = stepped(stage, r, ["correct"], T([1.0]), gids, L)
    close(out["rewards"][:4, 1], [1.0, 1.0, 0.0, 0.0])
    st = json.loads(json.dumps(stage.state_dict()))
    s2 = LaserD(alpha=1.0, max_length=100, update_every=1, coverage=0.5)
    s2.load_state_dict(st)
    assert s2.targets == stage.targets and s2.calls == 2


def test_kimi_length_hand_values():
    r = T([[1.0], [1.0], [0.0], [0.0], [1.0], [1.0]])
    L = T([10.0, 20.0, 15.0, 30.0, 7.0, 7.0])
    out = kimi_length(r, ["correct"], T([1.0]), T([0, 0, 0, 0, 1, 1]), L)["rewards"][:, 1]
    # group 0: Lmin 10, Lmax 30 -> lambda = .5, 0, .25, -.5 ; wrong -> min(0, lambda) ; group 1: equal -> 0
    close(out, [0.5, 0.0, 0.0, -0.5, 0.0, 0.0])


def test_grpo_lambda_threshold_and_top_fraction():
    r = T([[1.0], [1.0], [1.0], [0.0], [0.0], [1.0]])
    gids, L = T([0, 0, 0, 1, 1, 1]), T([10.0, 20.0, 30.0, 10.0, 20.0, 30.0])
    out = grpo_lambda(r, ["correct"], T([1.0]), gids, L, threshold=0.8)["rewards"][:, 1]
    close(out, [0.5, 0.0, -0.5, 0.0, 0.0, 0.0])  # group 0 (3/3) penalised; group 1 (1/3) plain 0/1
    out = grpo_lambda(r, ["correct"], T([1.0]), gids, L, threshold=None, top_fraction=1.0)["rewards"][:, 1]
    close(out, [0.5, 0.0, -0.5, 0.0, -0.0, -0.5])
    for params in ("threshold: null", "top_fraction: 0.5"):  # neither; both (threshold defaults to 0.8)
        with pytest.raises(ConfigError, match=r"^shaping.0: set exactly one of shaping.0.threshold and "):
            load_config(None, [f"shaping=[{{name: grpo_lambda, {params}}}, {{name: weighted_sum}}]"])
    with pytest.raises(ConfigError, match=r"^shaping.top_fraction: expected a value > 0 and <= 1, got 1.5$"):
        build("shaping", "grpo_lambda", {"threshold": None, "top_fraction": 1.5})


def test_cosine_length_hand_values():
    r = T([[1.0], [1.0], [1.0], [0.0], [0.0], [1.0]])
    L = T([0.0, 500.0, 1000.0, 0.0, 1000.0, 1500.0])
    out = cosine_length(r, ["correct"], L)["rewards"][:, 0]
    close(out, [1.0, 0.75, 0.5, -1.0, -0.5, 0.5])
    out = cosine_length(r, ["correct"], L, exceed_length=-2.0)["rewards"][:, 0]
    close(out[[2, 5]], [-2.0, -2.0])


def test_conciseness_gated():
    r = T([[1.0, 0.9], [1.0, 0.2], [0.0, 0.8]])
    gids, L = T([0, 0, 0]), T([10.0, 30.0, 5.0])
    out = conciseness_gated(r, ["correct", "crm"], T([1.0, 0.0]), gids, L, score_source="crm")
    close(out["rewards"][:, 1], [0.9, 0.2, 0.0])
    out = conciseness_gated(r, ["correct", "crm"], T([1.0, 0.0]), gids, L)
    close(out["rewards"][:, 2], [1.0, 0.0, 0.0])  # over the correct ones: (30 - L) / (30 - 10)


def test_adaptive_length_coef_rises_and_relaxes():
    st = AdaptiveLengthCoef(max_length=10, lambda_init=0.0, lr=0.5, target_accuracy=0.5)
    hi, lo = T([[1.0], [1.0]]), T([[0.0], [0.0]])
    close(stepped(st, hi, ["correct"], T([1.0]), T([5.0, 10.0]))["rewards"][:, 1], [0.0, 0.0])
    assert st.lam == pytest.approx(0.25)  # 0 + 0.5 * (1 - 0.5)
    close(stepped(st, hi, ["correct"], T([1.0]), T([5.0, 10.0]))["rewards"][:, 1], [-0.125, -0.25])
    assert st.lam == pytest.approx(0.5)
    stepped(st, lo, ["correct"], T([1.0]), T([5.0, 10.0]))
    assert st.lam == pytest.approx(0.25)  # accuracy dropped: relaxed
    for _ in range(5):
        stepped(st, lo, ["correct"], T([1.0]), T([5.0, 10.0]))
    assert st.lam == 0.0
    st(hi, ["correct"], T([1.0]), T([5.0, 10.0]))
    st(hi, ["correct"], T([1.0]), T([5.0, 10.0]))
    assert st.lam == 0.0  # calls read lambda; only the end of a step moves it


@pytest.mark.parametrize("name, state", [("adaptive_length_coef", "lam"), ("running_norm", "stats"),
                                         ("laser_d", "targets"), ("dataset_median", "history")])
def test_stateful_shaping_changes_state_once_per_step(name, state):
    """However often a step calls a stage (refill rounds, greedy baselines), its state moves at end_step only, by
    the batches it observed: three observed calls then one end of step equal one call on their union."""
    params = {"laser_d": {"update_every": 1, "max_length": 100}}.get(name, {})
    parts = [T([[1.0], [1.0], [0.0], [1.0]]), T([[1.0], [0.0], [1.0], [1.0]]), T([[1.0], [1.0], [1.0], [1.0]])]
    def fields(r):
        return {"rewards": r, "reward_names": ["correct"], "reward_weights": T([1.0]), "group_ids": T([0, 0, 1, 1]),
                "lengths": T([3.0, 9.0, 4.0, 6.0]), "columns": {"task": ["a", "a", "b", "b"]}}
    many, one = build("shaping", name, params), build("shaping", name, params)
    before = json.dumps(many.state_dict())
    for r in parts:
        many(fields(r))
        many.observe(fields(r))
    assert json.dumps(many.state_dict()) == before  # nothing moved during the step
    many.end_step(StepEnd())
    union = fields(torch.cat(parts))
    union.update(group_ids=T([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]), lengths=T([3.0, 9.0, 4.0, 6.0] * 3),
                 columns={"task": ["a", "a", "b", "b"] * 3})
    one(union)
    one.observe(union)
    one.end_step(StepEnd())
    assert json.dumps(many.state_dict(), sort_keys=True) != before
    assert getattr(many.fn, state) == getattr(one.fn, state)


# ------------------------------------------------------------------------------------------------ steps


def test_step_split_and_token_ends():
    from postrl.models.tiny import build_tokenizer

    assert split_steps("a\n\nb\n\n\n\nc\n\n") == ["a", "b", "c"]
    assert split_steps("one step") == ["one step"] and split_steps("") == [] and split_steps(" \n\n ") == []
    assert split_steps("x;y", ";") == ["x", "y"]
    tok = build_tokenizer()
    texts = ["ab;;cd", "xyz", ""]  # (the tiny char tokenizer has no token for "\n\n")
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    eos = tok.eos_token_id
    rows = [ids[0] + [eos], ids[1], []]
    width = max(len(r) for r in rows)
    cids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    ends = step_token_ends(cids, T([len(r) for r in rows]), texts, tok, ";;")
    # "ab;;" ends on token 3; the last step runs to the end (EOS at 6); "xyz": one step ending at 2
    assert ends.tolist() == [[3, 6], [2, -1], [-1, -1]]


# ------------------------------------------------------------------------------------------------ registry / state


def test_every_methods_md_shaping_entry_is_registered_with_a_docstring():
    want = ["weighted_sum", "par", "centered", "running_norm", "clip_prm", "delta_prm", "min_form", "gated",
            "ensemble_mean", "ensemble_min", "ensemble_uwo", "dataset_median", "overlong_soft", "truncation_penalty",
            "laser", "laser_d", "grpo_lambda", "kimi_length", "cosine_length", "conciseness_gated",
            "adaptive_length_coef", "potential"]
    for name in want:
        e = registry.entry("shaping", name)
        assert e.description and e.source, name


def test_stage_state_helpers_and_call_stage_with_class():
    stages = [build("shaping", "running_norm", {}), build("shaping", "weighted_sum", {})]
    batch = {"rewards": T([[1.0], [3.0]]), "reward_names": ["r"], "reward_weights": T([1.0])}
    out = stages[0](batch)
    close(out["rewards"][:, 0], [-1.0, 1.0], 1e-6)
    assert state_of(stages) == {"0:running_norm": {"stats": {}}}  # a call reads the state, never changes it
    stages[0].observe(batch)
    stages[0].end_step(StepEnd())
    st = state_of(stages)
    assert list(st) == ["0:running_norm"] and st["0:running_norm"]["stats"]["r"] == [2.0, 2.0, 2.0]
    fresh = [build("shaping", "running_norm", {}), build("shaping", "weighted_sum", {})]
    load_state(fresh, json.loads(json.dumps(st)))
    assert fresh[0].fn.stats == stages[0].fn.stats
    with pytest.raises(ConfigError, match=r"^shaping.clip: expected a value > 0, got -1$"):
        build("shaping", "running_norm", {"clip": -1})
    close(weighted_sum(T([[1.0, nan]]), T([1.0, 0.0]))["reward"], [nan])  # failed component is excluded


# ------------------------------------------------------------------------------------------------ trainer


@registry.register("reward", "steps_prm", source="test: per-step scores")
def steps_prm(prompts, completions, steps):
    """One score per step: 1 / (step index + 1)."""
    return [[1.0 / (j + 1) for j in range(len(s))] for s in steps]


@pytest.fixture(scope="module")
def nano_dir(tmp_path_factory) -> Path:
    from postrl.models.tiny import build_local

    path = tmp_path_factory.mktemp("nano_shaping")
    build_local(path, size="nano", seed=0)
    return path


def _cfg(nano_dir, out, *extra):
    from postrl.config import load_config

    return load_config(None, [f"model.path={nano_dir}", f"output_dir={out}", "task.name=arithmetic",
                              "task.digits=1", "rollout.max_new_tokens=6", "rollout.group_size=4",
                              "train.prompts_per_step=4", "train.steps=2", "train.save_every=1",
                              "train.eval_size=4", "train.eval_k=1", "reward.step_delimiter='1'", *extra])


def test_trainer_step_return_puts_step_returns_on_tokens(nano_dir, tmp_path):
    """End to end: a process reward, min_form and the step_return advantage train; every token of a step gets
    the same advantage (its step's min-form return minus the baseline, plus the outcome part)."""
    from postrl.train.trainer import Trainer

    out = tmp_path / "run"
    cfg = _cfg(nano_dir, out, "rewards=[{name: correct}, {name: steps_prm}]",
               "shaping=[{name: min_form}, {name: weighted_sum}]", "advantage.name=step_return", "train.steps=1",
               "rollout.max_new_tokens=24")
    tr = Trainer(cfg, out)
    batch = tr.batches.rollout(0)
    tr.step.score(batch)
    tr.step.advantages(tr.ctx, batch)
    A = batch.advantages
    assert A.shape == batch.completion_mask.shape and torch.isfinite(A).all()
    assert (A[batch.completion_mask == 0] == 0).all()
    multi = 0
    for i in range(len(batch)):
        ends = [int(e) for e in batch.step_ends[i] if e >= 0]
        if not batch.valid[i] or not ends:
            continue
        multi += len(ends) > 1
        start = 0
        for e in ends:  # constant within a step
            assert torch.allclose(A[i, start:e + 1], A[i, start].expand(e + 1 - start), atol=1e-6)
            start = e + 1
    assert multi > 0 and A.abs().sum() > 0  # the batch has valid multi-step completions and a signal
    tr.train()
    assert (out / "checkpoints" / "step-00000001").exists()


def test_trainer_scores_steps_shapes_and_checkpoints_state(nano_dir, tmp_path):
    from postrl.train.trainer import Trainer

    out = tmp_path / "run"
    cfg = _cfg(nano_dir, out, "rewards=[{name: correct}, {name: steps_prm}]",
               "shaping=[{name: min_form}, {name: running_norm, sources: [correct]}, {name: kimi_length}, "
               "{name: weighted_sum}]")
    tr = Trainer(cfg, out)
    batch = tr.batches.rollout(0)
    info = tr.step.score(batch)
    n = len(batch)
    assert batch.reward_names == ["correct", "steps_prm", "kimi_length"]
    assert batch.extra["raw_reward_names"] == ("correct", "steps_prm") and batch.raw_rewards.shape == (len(batch), 2)
    assert batch.step_rewards is not None and batch.step_ends.shape[0] == n
    assert batch.extra["step_reward_source"] == "steps_prm" and "step_returns" not in batch.extra
    for i in range(n):  # the process column is the min-form return = min_j 1/(j+1) = 1/#steps
        nsteps = len(split_steps(batch.completions[i], "1"))
        assert int((batch.step_ends[i] >= 0).sum()) == nsteps
        if nsteps:
            assert batch.rewards[i, 1].item() == pytest.approx(1.0 / nsteps)
            first_return = torch.nan_to_num(batch.step_rewards[i].double()).sum().item()
            assert first_return == pytest.approx(1.0 / nsteps)  # the step_rewards sum to the min-form return
        else:  # no step to score: the process reward failed for this completion (excluded, counted)
            assert math.isnan(batch.rewards[i, 1].item()) and not batch.valid[i]
    no_steps = sum(not split_steps(c, "1") for c in batch.completions) / n
    assert info["failure_rate"] == {"correct": 0.0, "steps_prm": pytest.approx(no_steps)}
    tr.train()
    state = json.loads((out / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    saved = state["stages"]["shaping"]["1:running_norm"]["stats"]["correct"]
    assert saved[0] == 3 * n  # the score() above + two training steps, merged into the running statistics
    tr2 = Trainer(cfg, out, resume=True)
    assert tr2.step.scorer.shaping[1].fn.stats["correct"] == pytest.approx(saved)


@registry.register("reward", "half_nan", source="test: fails on every other completion")
def half_nan(prompts, completions, **kw):
    return [float("nan") if i % 2 else 1.0 for i in range(len(completions))]  # NaN fails (None: does not apply)


def test_trainer_failure_rate_metric_and_alarm(nano_dir, tmp_path, caplog):
    from postrl.train.trainer import Trainer

    out = tmp_path / "run"
    tr = Trainer(_cfg(nano_dir, out, "rewards=[{name: correct}, {name: half_nan}]", "reward.alarm_rate=0.25"), out)
    batch = tr.batches.rollout(0)
    with caplog.at_level("WARNING", logger="postrl.rewards"):
        info = tr.step.score(batch)
    assert info["failure_rate"] == {"correct": 0.0, "half_nan": 0.5}
    assert batch.valid.tolist() == [i % 2 == 0 for i in range(len(batch))]  # failed entries excluded, not 0
    alarms = [r.getMessage() for r in caplog.records if "half_nan" in r.getMessage()]
    assert len(alarms) == 1 and "failed on 50% of the batch" in alarms[0] and "returned nan" in alarms[0]
    m = tr.step.metrics(batch, info)
    assert m["reward/half_nan/failure_rate"] == 0.5 and m["reward/correct/failure_rate"] == 0.0
