"""The reward-noise budget planner (postrl.diagnostics.budget, `postrl budget`): closed-form optimum, the variance
model it rests on (Monte Carlo), the noise estimate from repeated scores, the command."""

from __future__ import annotations

import json
import math
import random

import pytest

from postrl.cli import main
from postrl.diagnostics.budget import (estimate_noise, gradient_variance, optimal_calls, plan_budget, plan_options,
                                       signal_var)
from postrl.errors import ConfigError, DataError


def test_synthetic_optimum_known_in_closed_form():
    # sigma = 2, A/B = 1, c_r = 1, c_q = 0.25: m* = 2 sqrt(1 / (1 * 0.25)) = 4; a budget of 64 buys
    # G = 64 / (1 + 4 * 0.25) = 32 completions; variance (1 + 4/4) / 32 = 0.0625 = (sqrt(1*1) + 2 sqrt(0.25))^2 / 64
    assert optimal_calls(2.0, 1.0, 1.0, 0.25) == pytest.approx(4.0)
    p = plan_budget(64, noise_sd=2.0, signal=1.0, rollout_cost=1.0, call_cost=0.25, baseline="none")
    assert (p.calls, p.group_size, p.cost) == (4, 32, 64.0)
    assert p.variance == pytest.approx(0.0625) == pytest.approx((1.0 + 2.0 * 0.5) ** 2 / 64)
    # the neighbours are worse: m=3 -> G=floor(64/1.75)=36, (1+4/3)/36 = 0.0648; m=5 -> G=28, 1.8/28 = 0.0643
    assert gradient_variance(36, 3, noise_sd=2.0, signal=1.0) == pytest.approx(0.064815, abs=1e-6)
    assert gradient_variance(28, 5, noise_sd=2.0, signal=1.0) == pytest.approx(0.064286, abs=1e-6)
    # the clean reference at the same budget: one call, G = 64 / 1.25 = 51, variance 1/51; noise share 1 - (1/51)/0.0625
    assert p.clean_variance == pytest.approx(1 / 51)
    assert p.noise_share == pytest.approx(1 - (1 / 51) / 0.0625)


def test_continuous_optimum_is_the_minimum_of_the_one_dimensional_problem():
    rng = random.Random(0)
    for _ in range(20):
        sd, a, cr, cq = rng.uniform(0.1, 3), rng.uniform(0.05, 2), rng.uniform(0.1, 5), rng.uniform(0.01, 2)
        f = lambda m: (a + sd ** 2 / m) * (cr + m * cq)  # noqa: E731  (B = 1, C = 1)
        m_star = optimal_calls(sd, a, cr, cq)
        grid = [m_star * (1 + d) for d in (-0.2, -0.05, -0.01, 0.01, 0.05, 0.2)]
        assert all(f(m_star) <= f(m) for m in grid)
        assert f(m_star) == pytest.approx((math.sqrt(a * cr) + sd * math.sqrt(cq)) ** 2)


def test_integer_plan_with_large_budget_approaches_the_continuous_optimum():
    # m* = 1.5 * sqrt(2 / (0.5 * 0.1)) = 9.49: with a large budget the integer optimum is 9 or 10
    p = plan_budget(10_000, noise_sd=1.5, signal=0.5, rollout_cost=2.0, call_cost=0.1, baseline="none")
    assert p.continuous_calls == pytest.approx(1.5 * math.sqrt(2 / 0.05))
    assert p.calls in (9, 10)
    assert p.cost <= 10_000


def test_no_noise_or_expensive_calls_score_once_and_free_calls_score_often():
    assert plan_budget(32, noise_sd=0.0, signal=0.25, call_cost=0.5).calls == 1
    # m* = 0.1 * sqrt(1 / (0.25 * 1)) = 0.2 < 1: one call, G = 32 / 2 = 16
    p = plan_budget(32, noise_sd=0.1, signal=0.25, call_cost=1.0)
    assert (p.calls, p.group_size) == (1, 16)
    # free calls: every m buys the same G, the variance only falls -> the cap
    assert plan_budget(32, noise_sd=1.0, signal=0.25, call_cost=0.0, max_calls=12).calls == 12


def test_cheap_noisy_scorer_vs_expensive_clean_one():
    # signal 0.25, c_r = 1, budget 1000 (large: the continuous formula holds):
    #   clean verifier (sd 0, cost 1): C f = 0.25 * (1 + 1) = 0.5
    #   judge (sd 1, cost 0.01): C f = (sqrt(0.25) + 1 * sqrt(0.01))^2 = 0.36 -> the judge wins
    #   judge (sd 1, cost 0.05): (0.5 + 0.2236)^2 = 0.5236 -> the verifier wins
    plans = plan_options(1000, [("verifier", 0.0, 1.0), ("judge", 1.0, 0.01)], signal=0.25, baseline="none")
    assert [p.option for p in plans] == ["judge", "verifier"]
    assert plans[0].variance * 1000 == pytest.approx(0.36, rel=0.02)
    assert plans[1].variance * 1000 == pytest.approx(0.5, rel=0.01)
    plans = plan_options(1000, [("verifier", 0.0, 1.0), ("judge", 1.0, 0.05)], signal=0.25, baseline="none")
    assert [p.option for p in plans] == ["verifier", "judge"]


@pytest.mark.parametrize("baseline,group", [("none", 4), ("loo", 4), ("loo", 8)])
def test_noise_variance_term_matches_monte_carlo(baseline, group):
    # only noise (r = 0), scalar scores s ~ N(0, 1) (B = 1), e ~ N(0, sd^2 / m): the noise term of
    # g = 1/G sum (e_i - b_i) s_i has variance sd^2 / (m (G - kappa)), kappa = 1 for the leave-one-out baseline
    rng = random.Random(1)
    sd, m, n = 1.3, 2, 40_000
    xs = []
    for _ in range(n):
        e = [rng.gauss(0, sd / math.sqrt(m)) for _ in range(group)]
        s = [rng.gauss(0, 1) for _ in range(group)]
        b = [(sum(e) - e[i]) / (group - 1) if baseline == "loo" else 0.0 for i in range(group)]
        xs.append(sum((e[i] - b[i]) * s[i] for i in range(group)) / group)
    var = sum(x * x for x in xs) / n
    assert var == pytest.approx(gradient_variance(group, m, noise_sd=sd, signal=0.0, baseline=baseline), rel=0.05)


def test_signal_var_from_reward_moments():
    assert signal_var(0.5, 0.5, "none") == pytest.approx(0.5)  # E[r^2] = 0.25 + 0.25
    assert signal_var(0.5, 0.5, "loo") == pytest.approx(0.25)


def test_estimate_noise_by_hand():
    rows = [{"prompt": "p", "completion": "a", "score": 1}, {"prompt": "p", "completion": "a", "score": 3},
            {"prompt": "p", "completion": "b", "score": 4}, {"prompt": "p", "completion": "b", "score": 6}]
    est = estimate_noise(rows)
    # within-completion: ((1-2)^2 + (3-2)^2 + (4-5)^2 + (6-5)^2) / (1 + 1) = 2
    assert est["noise_sd"] == pytest.approx(math.sqrt(2))
    # means 2 and 5: within-prompt variance 4.5, minus noise 2 * mean(1/2, 1/2) = 1 -> 3.5
    assert est["reward_sd"] == pytest.approx(math.sqrt(3.5))
    assert est["reward_mean"] == pytest.approx(3.5)
    assert (est["completions"], est["prompts"], est["calls"]) == (2, 1, 4)


def test_estimate_noise_recovers_a_simulated_judge():
    rng = random.Random(3)
    rows = []
    for p in range(40):
        for c in range(6):
            r = float(rng.random() < 0.4)
            rows += [{"prompt": str(p), "completion": str(c), "score": r + rng.gauss(0, 0.7)} for _ in range(4)]
    est = estimate_noise(rows)
    assert est["noise_sd"] == pytest.approx(0.7, rel=0.08)
    assert est["reward_sd"] == pytest.approx(math.sqrt(0.4 * 0.6), rel=0.2)


def test_errors_name_the_problem():
    with pytest.raises(DataError, match="scored twice"):
        estimate_noise([{"prompt": "p", "completion": "a", "score": 1}])
    with pytest.raises(DataError, match="row 1"):
        estimate_noise([{"prompt": "p", "score": 1}])
    with pytest.raises(ConfigError, match="budget"):
        plan_budget(1.5, noise_sd=1.0, signal=0.25, call_cost=0.5, baseline="loo")  # 2 completions cost 3
    with pytest.raises(ConfigError, match="noise_sd"):
        plan_budget(10, noise_sd=-1.0, signal=0.25)


def test_command(capsys, tmp_path):
    assert main(["budget", "--budget", "64", "--noise-sd", "2", "--signal-var", "1", "--call-cost", "0.25",
                 "--baseline", "none", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["plans"][0]["calls"], out["plans"][0]["group_size"]) == (4, 32)
    scores = tmp_path / "scores.jsonl"
    scores.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "p", "completion": "a", "score": 1}, {"prompt": "p", "completion": "a", "score": 3},
        {"prompt": "p", "completion": "b", "score": 4}, {"prompt": "p", "completion": "b", "score": 6}]))
    assert main(["budget", "--budget", "40", "--scores", str(scores), "--call-cost", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "noise sd 1.414" in text and "set rollout.group_size:" in text
    assert main(["budget", "--budget", "40"]) == 2
    assert "--noise-sd" in capsys.readouterr().err
