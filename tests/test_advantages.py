"""Advantage estimators: hand-computed values (all-equal rewards, G = 1, invalid rows), equivalence with the anchors'
loop-based formulas (verl core_algos, TRL normalize_then_sum) on random inputs, and invariants."""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

import pytest
import torch

from postrl import registry
from postrl.advantages import grpo, masked_whiten
from postrl.advantages.gae import GAE, gae_advantages_returns, token_rewards
from postrl.advantages.process import step_return
from postrl.advantages.outcome import dr_grpo, gpg, opo, pass_at_k, reinforce_pp, reinforce_pp_baseline, remax, rloo
from postrl.advantages.shaped import aem, confidence_scaled, gdpo, information_gain, mapo, riskpo, rl_zvp
from postrl.advantages.tournament import bracket_order, rank_tournament
from postrl import stages
from postrl.stages import call_stage

S2 = math.sqrt(0.5)  # 0.7071...
nan = float("nan")


def close(a, b, atol=1e-4):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=atol)


# ----------------------------------------------------------------------------------------------- hand values
def test_dr_grpo_and_rloo_hand_values_equal_rewards_g1_and_invalid():
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 5.0])
    assert close(dr_grpo(r, g), [0.5, -0.5, -0.5, 0.5, 0, 0, 0])  # all-equal group and G = 1: 0
    # rloo: A_i = r_i - mean of the others; group of 3 [1, 0, 0.5]
    g3 = torch.tensor([0, 0, 0, 1])
    assert close(rloo(torch.tensor([1.0, 0.0, 0.5, 7.0]), g3), [0.75, -0.75, 0.0, 0.0])
    # an invalid row (NaN reward or valid False) takes no part: the group is [1, 0] then
    r4 = torch.tensor([1.0, 0.0, nan, 3.0])
    assert close(rloo(r4, torch.zeros(4, dtype=torch.long), torch.tensor([True, True, True, False])),
                 [1.0, -1.0, 0.0, 0.0])


def test_reinforce_pp_hand_values():
    # r = [1, 0]; masks 2 and 1 tokens; gamma 0.5 -> returns [0.5, 1] and [0]: mean 0.5, unbiased std 0.5
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    a = reinforce_pp(torch.tensor([1.0, 0.0]), mask, gamma=0.5)
    assert close(a, [[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0]])
    # G = 1 is fine (no group), an invalid row is excluded and 0
    a = reinforce_pp(torch.tensor([1.0, 0.0, nan]), torch.ones(3, 2))
    assert close(a, [[1 / math.sqrt(4 / 3), 1 / math.sqrt(4 / 3)], [-1 / math.sqrt(4 / 3)] * 2, [0, 0]])


def test_reinforce_pp_baseline_hand_values():
    # c = r - mean_g = [0.5, -0.5, 0, 0]; token weights [2, 1, 1, 1]: mean 0.1, unbiased var 0.7 / 4
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    a = reinforce_pp_baseline(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), mask)
    sd = math.sqrt(0.175)
    assert close(a, [0.4 / sd, -0.6 / sd, -0.1 / sd, -0.1 / sd])
    # a singleton group is left out of the whitening and gets 0
    a = reinforce_pp_baseline(torch.tensor([1.0, 0.0, 9.0]), torch.tensor([0, 0, 1]), torch.ones(3, 1))
    assert close(a, [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0], atol=1e-3)  # c = +-0.5, var 0.5


def test_remax_opo_gpg_pass_at_k_hand_values():
    assert close(remax(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, nan])), [1.0, 0.0, 0.0])
    # opo: b = (3 * 1 + 1 * 0) / 4 = 0.75
    g = torch.tensor([0, 0, 1])
    assert close(opo(torch.tensor([1.0, 0.0, 4.0]), g, torch.tensor([3.0, 1.0, 2.0])), [0.25, -0.75, 0.0])
    # gpg: B = 6 valid rows, 5 non-zero rewards -> alpha 1.2; 'informative': 3 rows in varying groups -> alpha 2
    r = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 3.0])
    gg = torch.tensor([0, 0, 0, 1, 1, 2])
    assert close(gpg(r, gg), [0.6, -0.6, 0, 0, 0, 0])
    assert close(gpg(r, gg, count="informative"), [1.0, -1.0, 0, 0, 0, 0])
    # pass_at_k: only the best gets r_max - r_second (/ std + eps)
    r = torch.tensor([0.2, 0.9, 0.5, 1.0, 1.0, 3.0])
    gp = torch.tensor([0, 0, 0, 1, 1, 2])
    assert close(pass_at_k(r, gp, scale="none"), [0, 0.4, 0, 0, 0, 0])
    assert close(pass_at_k(r, gp), [0, 0.4 / (torch.tensor([0.2, 0.9, 0.5]).std() + 1e-6), 0, 0, 0, 0])


def test_gae_hand_values():
    # one row: r = 1 on the last of 2 tokens, V = [0.5, 0.2]: delta_1 = 0.8, delta_0 = 0 + 0.2 - 0.5 = -0.3
    v = torch.tensor([[0.5, 0.2, 0.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = gae_advantages_returns(token_rewards(torch.tensor([1.0]), m), v, m, gamma=1.0, lam=1.0)
    assert close(adv[0, :2], [0.5, 0.8]) and close(ret[0, :2], [1.0, 1.0])
    adv, _ = gae_advantages_returns(token_rewards(torch.tensor([1.0]), m), v, m, gamma=1.0, lam=0.5)
    assert close(adv[0, :2], [-0.3 + 0.5 * 0.8, 0.8])
    est = GAE(lam=1.0, whiten=False)
    assert close(est.estimate(torch.tensor([1.0, nan]), torch.cat([v, v]), torch.cat([m, m])), [[0.5, 0.8, 0.0], [0, 0, 0]])


def test_gdpo_motivating_case_differs_from_grpo():
    # two binary rewards, G = 2: groups (0,0)/(1,0) and (0,0)/(1,1)
    rewards = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    g = torch.tensor([0, 0, 1, 1])
    w = torch.tensor([1.0, 1.0])
    a_grpo = grpo((rewards * w).sum(-1), g)
    assert close(a_grpo, [-S2, S2, -S2, S2])  # GRPO: identical advantages for different reward combinations
    a = gdpo(rewards, w, g)
    # per-component z: group 0 -> (-0.707, 0.707) + (0, 0); group 1 -> 2 x (-0.707, 0.707); batch std sqrt(5/3)
    s = math.sqrt(5 / 3)
    assert close(a, [-S2 / s, S2 / s, -2 * S2 / s, 2 * S2 / s], atol=1e-3)
    assert not close(a[2:], a_grpo[2:], atol=1e-2)
    # batch_norm=False keeps the summed z-scores; a NaN component adds 0 and leaves that component's statistics
    assert close(gdpo(rewards, w, g, batch_norm=False), [-S2, S2, -2 * S2, 2 * S2], atol=1e-3)
    r2 = rewards.clone()
    r2[3, 1] = nan
    assert close(gdpo(r2, w, g, batch_norm=False), [-S2, S2, -S2, S2], atol=1e-3)


def test_mapo_mix():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    g = torch.tensor([0, 0, 1, 1])
    assert close(mapo(r, g, mix=1.0), grpo(r, g))
    batch = (r - r.mean()) / (r.std() + 1e-6)
    assert close(mapo(r, g, mix=0.0), batch)
    assert close(mapo(r, g), 0.5 * grpo(r, g) + 0.5 * batch)


def test_rl_zvp_hand_values():
    r = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    H = torch.tensor([[1.0, 3.0], [2.0, 2.0], [1.0, 1.0], [4.0, 2.0], [5.0, 5.0], [5.0, 5.0]])
    m = torch.ones(6, 2)
    a = rl_zvp(r, g, m, H, alpha=0.1)
    # all-correct group: +0.1 * H / mean(H)=2; all-wrong group: -0.1 * H / 2; mixed group: GRPO on every token
    assert close(a[:2], [[0.05, 0.15], [0.1, 0.1]])
    assert close(a[2:4], [[-0.05, -0.05], [-0.2, -0.1]])
    assert close(a[4:], [[S2, S2], [-S2, -S2]])
    # a singleton group carries nothing; an invalid row is 0
    a = rl_zvp(torch.tensor([1.0, nan]), torch.tensor([0, 1]), torch.ones(2, 2), torch.ones(2, 2))
    assert torch.all(a == 0)


def test_confidence_scaled_hand_values():
    r = torch.tensor([1.0, 0.0])
    g = torch.zeros(2, dtype=torch.long)
    lp = torch.tensor([[-0.1, -0.1], [-1.0, -1.0]])
    m = torch.ones(2, 2)
    a = confidence_scaled(r, g, lp, m, torch.tensor([-2.0, -2.0]))
    assert close(a, [S2 * math.exp(-1.9), -S2])  # only the positive advantage is scaled
    a = confidence_scaled(r, g, lp, m, torch.tensor([-9.0, -9.0]), min_scale=0.1)
    assert close(a, [S2 * 0.1, -S2])
    a = confidence_scaled(r, g, lp, m, torch.tensor([0.0, 0.0]))  # answer less confident than the prompt: w = 1
    assert close(a, [S2, -S2])


def test_riskpo_hand_values():
    r = torch.tensor([0.0, 1.0, 2.0, 3.0])
    g = torch.zeros(4, dtype=torch.long)
    # alpha 0.5: q = 2nd smallest = 1; psi = (r - 1) 1{r <= 1} / 0.5 = [-2, 0, 0, 0]; u = 0.5 psi + 0.5 r
    u = torch.tensor([-1.0, 0.5, 1.0, 1.5])
    assert close(riskpo(r, g, alpha=0.5), grpo(u, g))
    assert close(riskpo(r, g, alpha=0.5, scale="none"), u - u.mean())
    assert close(riskpo(r, g, omega=0.0), grpo(r, g))
    assert torch.all(riskpo(torch.ones(3), torch.zeros(3, dtype=torch.long)) == 0)


def test_riskpo_bundling_hand_values():
    # two questions of three completions, one bundle of 2: papers j = (row j of q1, row j of q2)
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    g = torch.tensor([7, 7, 7, 3, 3, 3])  # q1 (id 7) appears first: ids need not be sorted
    # paper scores S = [1 + 0, 0 + 0, 1 + 1] = [1, 0, 2]; alpha 0.25 of 3 papers: q = the 1st smallest = 0,
    # psi = 0 everywhere (no paper below 0); u = 0.5 S = [0.5, 0, 1]; GRPO over papers: [0, -1, 1] (std 0.5)
    a = riskpo(r, g, bundle_size=2)
    assert close(a, [0.0, -1.0, 1.0, 0.0, -1.0, 1.0])
    # without bundling each question is its own risk pool: q1 [1, 0, 1] -> GRPO of 0.5 r
    assert close(riskpo(r, g), torch.cat([grpo(r[:3], g[:3]), grpo(r[3:], g[3:])]))
    assert not close(riskpo(r, g), a)
    # unequal questions: q2 has 2 valid completions -> 2 papers; q1's third completion is in none (0)
    v = torch.tensor([True, True, True, True, False, True])
    # papers: (r0 + r3) = 1, (r1 + r5) = 1 -> equal scores, advantage 0
    assert close(riskpo(r, g, v, bundle_size=2), [0.0] * 6)
    # bundle_size 1 is the unbundled estimator (exactly)
    r2 = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.5, 0.25])
    g2 = torch.tensor([0, 0, 0, 0, 1, 1])
    assert torch.equal(riskpo(r2, g2, alpha=0.5, bundle_size=1), riskpo(r2, g2, alpha=0.5))


def test_riskpo_rvar_cvar_is_the_authors_estimator():
    # one bundle of 5 papers S = [0, 1, 2, 3, 4] (one question, B = 1), alpha 0.2, beta 0.9:
    # torch.quantile: q_a = S at position 0.8 = 0.8, q_b = position 3.6 = 3.6
    S = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    g = torch.zeros(5, dtype=torch.long)
    eps = 1e-6
    rvar = torch.tensor([-2.8, 0.2 - 2.8, 1.2 - 2.8, 2.2 - 2.8, 3.2 - 0.4 - 2.8]) / (0.7 + eps)  # [-4, -3.71, ...]
    cvar = torch.tensor([-0.8, 0.0, 0.0, 0.0, 0.0]) / (0.2 + eps)  # only S = 0 lies below q_a
    mixed = (1.5 * cvar + rvar) / 2.5  # [-4.0, -1.4857, -0.9143, -0.3429, 0.0]
    sd = math.sqrt(2.5)  # unbiased std of 0..4
    a = riskpo(S, g, alpha=0.2, beta=0.9, form="rvar_cvar")
    assert close(a, mixed / (sd + eps))
    assert close(riskpo(S, g, alpha=0.2, beta=0.9, form="rvar_cvar", scale="none"), mixed)
    # credit 'std': divided by the question's reward std as well
    assert close(riskpo(S, g, alpha=0.2, beta=0.9, form="rvar_cvar", credit="std"), mixed / (sd + eps) / (sd + eps))
    # a single paper: q_a = q_b = S -> 0
    assert close(riskpo(torch.tensor([1.0]), torch.zeros(1, dtype=torch.long), form="rvar_cvar"), [0.0])
    from postrl.errors import ConfigError

    with pytest.raises(ConfigError, match="alpha < beta"):
        stages.build("advantage", "riskpo", {"form": "rvar_cvar", "alpha": 0.9, "beta": 0.5})


def test_r3l_positive_amplification_hand_values():
    from postrl.advantages.shaped import r3l

    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.2, 0.4, 0.5])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    # group 0: mean 0.375 -> success 1.0 gets 1; 0 -> -0.375 (unchanged); 0.5 -> 3 * 0.125 = 0.375
    # group 1: mean 0.3 -> 0.2: -0.1; 0.4: 3 * 0.1 = 0.3; group 2 (one completion): 0
    assert close(r3l(r, g), [1.0, -0.375, -0.375, 0.375, -0.1, 0.3, 0.0])
    assert close(r3l(r, g, singleton="raw")[-1:], [1.5])  # the code's baseline 0: 3 * 0.5
    assert close(r3l(r, g, success=None)[:4], [1.875, -0.375, -0.375, 0.375])  # 3 * (1 - 0.375)
    assert close(r3l(r, g, alpha=1.0, success=None), dr_grpo(r, g))  # alpha 1, no success rule: r - mean_g
    assert close(r3l(torch.ones(3), torch.zeros(3, dtype=torch.long)), [1.0, 1.0, 1.0])  # all-correct group: 1


def test_aem_hand_values():
    r = torch.tensor([1.0, 0.0])
    lp = torch.tensor([[-1.0], [-3.0]])  # surprisal 1 and 3 -> z = -0.707 / +0.707
    a = aem(r, torch.zeros(2, dtype=torch.long), lp, torch.ones(2, 1), beta=0.2)
    f = 1 - 0.2 * S2  # confident correct and rare wrong: both damped
    assert close(a, [S2 * f, -S2 * f], atol=1e-3)
    lp = torch.tensor([[-3.0], [-1.0]])  # rare correct and confident wrong: both amplified
    a = aem(r, torch.zeros(2, dtype=torch.long), lp, torch.ones(2, 1), beta=0.2)
    assert close(a, [S2 * (1 + 0.2 * S2), -S2 * (1 + 0.2 * S2)], atol=1e-3)


def test_information_gain_hand_values():
    r = torch.tensor([1.0, 1.0, 0.0])
    ig = torch.tensor([2.0, 0.0, nan])
    a = information_gain(r, torch.zeros(3, dtype=torch.long), ig, ig_weight=0.5)
    assert close(a, [S2, -S2, 0.0])  # r + 0.5 IG = [2, 1]; the row without an answer is excluded


def test_information_gain_prior_term_cancels_in_the_group():
    """As the docstring states: log pi(a*|q) is one constant per group (single turn), so the advantage is GRPO on
    r + w log pi(a*|q, o) whatever that constant is."""
    g = torch.Generator().manual_seed(5)
    gid = torch.arange(3).repeat_interleave(4)
    r = (torch.rand(12, generator=g) > 0.5).float()
    lp_after = -torch.rand(12, generator=g) * 3  # log pi(a* | q, o_i)
    prior = torch.tensor([-2.0, -0.5, -7.0])[gid]  # log pi(a* | q), per group
    a = information_gain(r, gid, lp_after - prior, ig_weight=0.7)
    assert close(a, grpo(r + 0.7 * lp_after, gid), 1e-5)
    assert close(a, information_gain(r, gid, lp_after, ig_weight=0.7), 1e-5)


def test_rank_tournament_bracket_and_ranks():
    assert bracket_order(4) == [0, 3, 1, 2] and bracket_order(8) == [0, 7, 3, 4, 1, 6, 2, 5]
    r = torch.tensor([0.1, 0.4, 0.3, 0.2])
    g = torch.zeros(4, dtype=torch.long)
    a = rank_tournament(r, g, ["q"] * 4, ["a", "bb", "ccc", "dddd"])
    # seeds 0.4, 0.3, 0.2, 0.1: champion survives 2 rounds, finalist 1, semi-final losers 0
    assert close(a, grpo(torch.tensor([0.0, 2.0, 1.0, 0.0]), g))
    # 3 players: the best seed gets the bye; an invalid row does not play
    a3 = rank_tournament(torch.tensor([0.1, 0.4, 0.3, nan]), g, ["q"] * 4, ["a"] * 4)
    assert close(a3, grpo(torch.tensor([0.0, 2.0, 1.0, 0.0]), g, torch.tensor([True, True, True, False])))


def test_rank_tournament_rubric_judge_is_lexicographic_over_columns():
    # columns (correct, format); scalar reward = correct + 2 format pays format more than correctness
    cols = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])  # A, B, C, D
    r = cols[:, 0] + 2 * cols[:, 1]  # A 1, B 3, C 2, D 0 -> seeds B, C, A, D
    g = torch.zeros(4, dtype=torch.long)
    args = (r, g, ["q"] * 4, ["a"] * 4, None, cols, ["correct", "format"])
    # round 1: B vs D, C vs A; reward judge: C beats A (2 > 1), final B beats C
    assert close(rank_tournament(*args), grpo(torch.tensor([0.0, 2.0, 1.0, 0.0]), g))
    # rubric: correctness decides first: A beats C; final B vs A ties on correct, B wins on format
    assert close(rank_tournament(*args, judge="rubric"), grpo(torch.tensor([1.0, 2.0, 0.0, 0.0]), g))
    # rubric order reversed (format first): C beats A again
    assert close(rank_tournament(*args, judge="rubric", rubric=["format", "correct"]),
                 grpo(torch.tensor([0.0, 2.0, 1.0, 0.0]), g))
    # margin: differences up to the margin do not decide; the next level does
    near = torch.tensor([[0.9, 0.0], [1.0, 1.0], [0.2, 1.0], [0.0, 0.0]])
    a = rank_tournament(near[:, 0] + 2 * near[:, 1], g, ["q"] * 4, ["a"] * 4, None, near,
                        ["correct", "format"], judge="rubric", margin=0.15)
    # round 1: B (3) vs D, C (2.2) vs A (0.9): correct 0.7 apart > 0.15 -> A; final B vs A: 0.1 <= 0.15 -> format: B
    assert close(a, grpo(torch.tensor([1.0, 2.0, 0.0, 0.0]), g))
    # completions with identical rubric vectors share their mean score
    same = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    a = rank_tournament(torch.tensor([1.0, 0.9, 0.2, 0.1]), g, ["q"] * 4, ["a"] * 4, None, same,
                        ["correct", "format"], judge="rubric")
    assert close(a, grpo(torch.tensor([1.5, 1.5, 0.0, 0.0]), g))  # seeds 1, 2 reach the final: 2 and 1 -> 1.5
    with pytest.raises(registry.ConfigError, match="advantage.rubric: expected reward columns of this run"):
        rank_tournament(*args, judge="rubric", rubric=["length"])
    stage = stages.build("advantage", "rank_tournament", {"judge": "rubric", "rubric": ["correct", "format"]})
    assert {"rewards", "reward_names"} <= set(stage.reads)


JUDGE = (
    "CALLS = []\n\n\n"
    "def shorter_wins(prompts, first, second):\n"
    "    CALLS.append(len(first))  # one call per round\n"
    "    return [1.0 if len(a) < len(b) else 0.0 for a, b in zip(first, second)]\n"
)


def test_rank_tournament_custom_judge_batched_per_round(tmp_path, monkeypatch):
    # the judge as a user writes it, in a module of their own named by an import path (not a `tests.` path, which
    # resolves to whichever installed package ships a top-level `tests`, such as verl)
    (tmp_path / "postrl_test_judge.py").write_text(JUDGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "postrl_test_judge", raising=False)
    r = torch.tensor([0.1, 0.4, 0.3, 0.2, 0.5, 0.6, 0.7, 0.8])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    comps = ["a", "bb", "ccc", "dddd", "eeeee", "ff", "ggg", "h"]
    a = rank_tournament(r, g, ["q"] * 8, comps, judge="postrl_test_judge:shorter_wins")
    calls = sys.modules["postrl_test_judge"].CALLS  # the judge's module as the import path loaded it
    assert calls == [4, 2]  # one judge call per round, with every match of every group; n - 1 matches per group
    # group 0 (seeds by reward: bb, ccc, dddd, a): a beats bb, ccc beats dddd, a beats ccc in the final
    # group 1 (seeds h, ggg, ff, eeeee): h beats eeeee, ff beats ggg, h beats ff
    assert close(a[:4], grpo(torch.tensor([2.0, 0.0, 1.0, 0.0]), g[:4]))
    assert close(a[4:], grpo(torch.tensor([0.0, 1.0, 0.0, 2.0]), g[4:]))
    with pytest.raises(registry.ConfigError, match="advantage.judge: expected an import path 'module:attribute'"):
        rank_tournament(r, g, ["q"] * 8, comps, judge="nocolon")


# ----------------------------------------------------------------------------------------------- anchors
def random_groups(seed: int, sizes=(2, 3, 5, 4, 2, 6)):
    gen = torch.Generator().manual_seed(seed)
    g = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
    perm = torch.randperm(len(g), generator=gen)  # groups interleaved in the batch
    g = g[perm]
    r = torch.rand(len(g), generator=gen)
    T = 7
    lens = torch.randint(1, T + 1, (len(g),), generator=gen)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    return r, g, mask


def verl_token_rewards(r, mask):
    tlr = torch.zeros_like(mask)
    tlr[torch.arange(len(r)), mask.sum(-1).long() - 1] = r
    return tlr


def verl_masked_whiten(values, mask):  # verl.utils.torch_functional: unbiased var, eps 1e-8
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_rloo(scores, index):
    id2 = defaultdict(list)
    for i in range(len(scores)):
        id2[int(index[i])].append(scores[i])
    out = scores.clone()
    for i in range(len(scores)):
        n = len(id2[int(index[i])])
        mean = torch.stack(id2[int(index[i])]).mean()
        out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out


def verl_opo(scores, lengths, index):
    id2s, id2l = defaultdict(list), defaultdict(list)
    for i in range(len(scores)):
        id2s[int(index[i])].append(scores[i])
        id2l[int(index[i])].append(lengths[i])
    out = scores.clone()
    for i in range(len(scores)):
        s, L = torch.stack(id2s[int(index[i])]), torch.stack(id2l[int(index[i])])
        out[i] = scores[i] - (L * s).sum() / L.sum()
    return out


def verl_gpg(scores, index):
    m = torch.count_nonzero(scores)
    alpha = len(scores) / m.clamp(min=1)
    id2 = defaultdict(list)
    for i in range(len(scores)):
        id2[int(index[i])].append(scores[i])
    return torch.stack([alpha * (scores[i] - torch.stack(id2[int(index[i])]).mean()) for i in range(len(scores))])


def verl_passk(scores, index, eps=1e-6, norm=True):
    adv = torch.zeros_like(scores)
    id2s, id2i = defaultdict(list), defaultdict(list)
    for i in range(len(scores)):
        id2s[int(index[i])].append(scores[i])
        id2i[int(index[i])].append(i)
    for k in id2s:
        rw = torch.stack(id2s[k])
        top, ti = torch.topk(rw, 2)
        a = top[0] - top[1]
        if norm:
            a = a / (torch.std(rw) + eps)
        adv[id2i[k][int(ti[0])]] = a
    return adv


def verl_reinforce_pp(tlr, mask, gamma):
    returns = torch.zeros_like(tlr)
    running = 0
    for t in reversed(range(tlr.shape[1])):
        running = tlr[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask


def verl_reinforce_pp_baseline(scores, mask, index):
    id2 = defaultdict(list)
    for i in range(len(scores)):
        id2[int(index[i])].append(scores[i])
    s = torch.stack([scores[i] - torch.stack(id2[int(index[i])]).mean() for i in range(len(scores))])
    s = s.unsqueeze(-1).tile([1, mask.shape[1]]) * mask
    return verl_masked_whiten(s, mask) * mask


def verl_gae(tlr, values, mask, gamma, lam):
    nextvalues, lastgaelam, rev = 0, 0, []
    for t in reversed(range(tlr.shape[-1])):
        delta = tlr[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    return verl_masked_whiten(adv, mask), adv + values


def trl_normalize_then_sum(rewards_per_func, weights, G, eps=1e-4):
    def nanstd(t, dim):
        var = torch.nanmean((t - torch.nanmean(t, dim=dim, keepdim=True)) ** 2, dim=dim, keepdim=True)
        cnt = (~torch.isnan(t)).sum(dim=dim, keepdim=True)
        return torch.sqrt(var * cnt / (cnt - 1))

    grouped = rewards_per_func.view(-1, G, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    reward_k = (grouped - mean_k) / (nanstd(grouped, 1) + eps)
    rewards = (reward_k.view(-1, rewards_per_func.shape[1]) * weights.unsqueeze(0)).nansum(dim=1)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outcome_estimators_match_verl_loops(seed):
    r, g, mask = random_groups(seed)
    lens = mask.sum(-1)
    assert close(rloo(r, g), verl_rloo(r, g), atol=1e-5)
    assert close(opo(r, g, lens), verl_opo(r, lens, g), atol=1e-5)
    assert close(gpg(r, g), verl_gpg(r, g), atol=1e-5)
    r0 = r.clone()
    r0[::3] = 0.0  # verl's alpha counts non-zero rewards
    assert close(gpg(r0, g), verl_gpg(r0, g), atol=1e-5)
    assert close(pass_at_k(r, g), verl_passk(r, g), atol=1e-4)
    assert close(pass_at_k(r, g, scale="none"), verl_passk(r, g, norm=False), atol=1e-6)
    tlr = verl_token_rewards(r, mask)
    for gamma in (1.0, 0.9):
        assert close(reinforce_pp(r, mask, gamma=gamma), verl_reinforce_pp(tlr, mask, gamma), atol=1e-5)
    base = reinforce_pp_baseline(r, g, mask)
    assert close(base.unsqueeze(-1) * mask, verl_reinforce_pp_baseline(r, mask, g), atol=1e-5)
    greedy = torch.rand(len(r), generator=torch.Generator().manual_seed(seed + 10))
    verl_remax = tlr.flip(-1).cumsum(-1).flip(-1) - greedy.unsqueeze(-1) * mask  # returns - baseline
    assert close(remax(r, greedy).unsqueeze(-1) * mask, verl_remax, atol=1e-6)
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed + 20))
    for lam in (1.0, 0.95):
        adv_ref, ret_ref = verl_gae(tlr, values, mask, 1.0, lam)
        assert close(GAE(gamma=1.0, lam=lam).estimate(r, values, mask), adv_ref * mask, atol=1e-5)
        _, ret = gae_advantages_returns(token_rewards(r, mask), values, mask, 1.0, lam)
        assert close(ret * mask, ret_ref * mask, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_gdpo_matches_trl_normalize_then_sum(seed):
    gen = torch.Generator().manual_seed(seed)
    G, n_prompts = 4, 6
    rewards = torch.cat([(torch.rand(G * n_prompts, 1, generator=gen) > 0.5).float(),
                         torch.rand(G * n_prompts, 1, generator=gen),
                         torch.randint(0, 3, (G * n_prompts, 1), generator=gen).float()], 1)
    w = torch.tensor([1.0, 0.5, 2.0])
    g = torch.arange(n_prompts).repeat_interleave(G)
    assert close(gdpo(rewards, w, g), trl_normalize_then_sum(rewards, w, G), atol=1e-4)


def test_grpo_matches_verl_loop_with_unequal_groups():
    r, g, _ = random_groups(3)
    id2 = defaultdict(list)
    for i in range(len(r)):
        id2[int(g[i])].append(r[i])
    ref = torch.stack([(r[i] - torch.stack(id2[int(g[i])]).mean()) / (torch.stack(id2[int(g[i])]).std() + 1e-6)
                       for i in range(len(r))])
    assert close(grpo(r, g), ref, atol=1e-5)


# ----------------------------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_baselines_sum_to_zero(seed):
    r, g, mask = random_groups(seed)
    valid = torch.rand(len(r), generator=torch.Generator().manual_seed(seed)) > 0.2
    for fn in (lambda: grpo(r, g, valid), lambda: rloo(r, g, valid), lambda: dr_grpo(r, g, valid),
               lambda: opo(r, g, mask.sum(-1), valid) * mask.sum(-1)):
        a = fn().double()
        sums = torch.zeros(int(g.max()) + 1, dtype=torch.float64).index_add_(0, g, a)
        assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-5)
        assert torch.all(a[~valid] == 0)


def batch_fields(N=12, G=3, T=5, seed=0, equal=False):
    """Every field any estimator reads, for call_stage."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.arange(N // G).repeat_interleave(G)
    rewards = (torch.rand(N, 2, generator=gen) > 0.5).float()
    if equal:
        rewards = torch.ones(N, 2)
    lens = torch.randint(1, T + 1, (N,), generator=gen)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    reward = rewards.sum(-1)
    return {"reward": reward, "rewards": rewards, "reward_names": ["a", "b"], "reward_weights": torch.ones(2),
            "group_ids": g, "valid": torch.isfinite(reward), "completion_mask": mask, "lengths": mask.sum(-1),
            "sampler_logprobs": -torch.rand(N, T, generator=gen) * mask, "token_entropy": torch.rand(N, T) * mask,
            "greedy_reward": torch.zeros(N), "prompt_logprob": -torch.rand(N, generator=gen) - 1,
            "info_gain": torch.zeros(N), "values": torch.zeros(N, T), "completion_hidden": torch.randn(N, T, 8), "columns": {"role": ["r"] * N},
            "red_token_reward": torch.randn(N, T, generator=gen) * mask,
            "attention_token_reward": torch.rand(N, T, generator=gen) * mask,
            "critic_token_reward": torch.randn(N, T, generator=gen) * mask,
            "mle_token_reward": -torch.rand(N, T, generator=gen) * mask,
            "occlusion_token_reward": torch.randn(N, T, generator=gen) * mask,
            "prompts": ["q"] * N, "completions": [f"c{i}" for i in range(N)],
            # process reward in column a: one step per completion, scored a, ending on its last token
            "step_rewards": rewards[:, :1].clone(), "step_ends": (lens - 1).unsqueeze(-1), "step_reward_source": "a",
            # multi-turn: one turn per episode, rewarded with the episode's reward
            "turn_rewards": reward.unsqueeze(-1).clone(), "turn_ends": (lens - 1).unsqueeze(-1),
            "turn_info_gain": torch.zeros(N, 1), "turn_scores": torch.rand(N, 1, generator=gen),
            "turn_tool_errors": torch.zeros(N, 1, dtype=torch.long),
            "turn_malformed_calls": torch.zeros(N, 1, dtype=torch.long),
            # token ids (an implicit PRM scores them: oprl)
            "prompt_ids": torch.randint(5, 40, (N, 3), generator=gen), "prompt_mask": torch.ones(N, 3, dtype=torch.long),
            "completion_ids": torch.randint(5, 40, (N, T), generator=gen)}


_PRM: list = []


def make(name):
    fn = registry.get("advantage", name)
    if name == "oprl":  # its one required parameter: an implicit PRM's model folder (a nano model, built once)
        if not _PRM:
            import atexit
            import shutil
            import tempfile

            from postrl.models.tiny import build_local

            _PRM.append(tempfile.mkdtemp(prefix="postrl-prm-"))
            atexit.register(shutil.rmtree, _PRM[0], True)
            build_local(_PRM[0], size="nano", seed=0)
        return fn(prm_model=_PRM[0])
    return fn() if isinstance(fn, type) else fn


def advantages_of(out):
    """An estimator's advantages (one that hands on more fields, e.g. ares, returns a dict with them)."""
    return out["advantages"] if isinstance(out, dict) else out


@pytest.mark.parametrize("name", registry.names("advantage"))
def test_every_estimator_excludes_invalid_rows_and_is_finite(name):
    f = batch_fields()
    f["reward"] = f["reward"].clone()
    f["reward"][1] = nan  # a failed reward
    f["rewards"] = f["rewards"].clone()
    f["rewards"][1] = nan
    f["valid"] = torch.isfinite(f["reward"])
    f["valid"][4] = False  # excluded by a filter
    a = advantages_of(call_stage(make(name), f, {}))
    assert a.shape[0] == 12 and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.all(a[1] == 0) and torch.all(a[4] == 0)


@pytest.mark.parametrize("name", sorted(set(registry.names("advantage")) - {"rl_zvp", "remax", "reinforce_pp", "gae",
                                                                            "red", "attention_credit",
                                                                            "critic_dense", "teacher_forcing",
                                                                            "occlusion_credit", "ares"}))
def test_all_equal_rewards_and_g1_give_zero(name):
    # (step_return's default baseline is per token, PURE's: equal totals over unequal lengths do carry signal;
    # r3l's success rule pays every success, an all-correct group included, as R^3L's code does; ares adds its
    # entropy reward to equal rewards)
    params = {"baseline": "step"} if name == "step_return" else {"success": None} if name == "r3l" else {}
    a = advantages_of(call_stage(make(name), batch_fields(equal=True), params))
    assert torch.all(a.abs() < 1e-6), name  # all-equal rewards: no signal (rl_zvp's entropy shaping aside)
    a = advantages_of(call_stage(make(name), batch_fields(N=4, G=1, seed=3), params))
    if name != "mapo":  # mapo's batch term is defined for singleton groups
        assert torch.all(a.abs() < 1e-6), name


def test_unknown_parameter_values_are_errors():
    # refused from the annotations when the stage is built (and when a config is read), in one line
    cases = [("gpg", {"count": "bad"}, "advantage.count: expected 'nonzero_reward' or 'informative', got 'bad'"),
             ("pass_at_k", {"scale": "batch"}, "advantage.scale: expected 'group' or 'none', got 'batch'"),
             ("gae", {"gamma": 2.0}, "advantage.gamma: expected a value >= 0 and <= 1, got 2.0"),
             ("gae", {"value_clip": 0}, "advantage.value_clip: expected a value > 0, got 0"),
             ("mapo", {"mix": 1.5}, "advantage.mix: expected a value >= 0 and <= 1, got 1.5"),
             ("riskpo", {"alpha": 0}, "advantage.alpha: expected a value > 0 and <= 1, got 0"),
             ("grpo", {"eps": -1}, "advantage.eps: expected a value >= 0, got -1"),
             ("grpo", {"scale": "sideways"}, "advantage.scale: expected 'group', 'batch' or 'none', got 'sideways'"),
             ("turn_mapo", {"gamma": -0.1}, "advantage.gamma: expected a value >= 0 and <= 1, got -0.1")]
    for name, params, message in cases:
        with pytest.raises(registry.ConfigError) as e:
            stages.build("advantage", name, params)
        assert str(e.value) == message
    assert stages.build("advantage", "grpo", {"eps": 0, "scale": "none"}).params == {"eps": 0.0, "scale": "none"}
    with pytest.raises(registry.ConfigError, match="unknown parameter 'lambda' for advantage 'gae'; valid: gamma, lam"):
        stages.check_params("advantage", "gae", {"lambda": 0.9}, where="advantage")


# ----------------------------------------------------------------------------------------------- value head
def test_value_head_fits_returns_and_state_round_trips():
    torch.manual_seed(0)
    est = GAE(lam=1.0, value_epochs=50, value_lr=0.05, value_clip=None)
    N, T, H = 8, 4, 6
    hidden = torch.randn(N, T, H)
    mask = torch.ones(N, T)
    reward = hidden[:, -1, 0].clone()  # learnable from the features
    v0 = est.values(hidden)
    assert torch.all(v0 == 0)  # zero-initialised head
    m1 = est.fit(hidden, reward, mask, None, v0)
    m2 = est.fit(hidden, reward, mask, None, est.values(hidden))
    assert m2["value/loss"] < m1["value/loss"]
    state = json.loads(json.dumps(est.state_dict()))  # through JSON, as in trainer_state.json
    other = GAE(lam=1.0, value_epochs=50, value_lr=0.05, value_clip=None)
    other.load_state_dict(state)
    assert torch.equal(other.values(hidden), est.values(hidden))
    a = est.fit(hidden, reward, mask, None, est.values(hidden))
    b = other.fit(hidden, reward, mask, None, other.values(hidden))
    assert a == b  # optimizer state restored too: identical next update


def test_masked_whiten_matches_verl():
    x = torch.randn(4, 6)
    m = (torch.rand(4, 6) > 0.3).float()
    assert close(masked_whiten(x, m) * m, verl_masked_whiten(x, m) * m, atol=1e-5)


# ----------------------------------------------------------------------------------------------- step_return (PURE)
def _process_fields(raw_steps, ends, outcome, mask_len, T, stage="min_form", **kw):
    """Batch fields after a process shaping stage: columns [prm, correct] (weights 1, 1)."""
    from postrl.shaping.process import clip_prm, delta_prm, min_form

    shape = {"min_form": min_form, "clip_prm": clip_prm, "delta_prm": delta_prm}[stage]
    raw = torch.tensor(raw_steps)
    rewards = torch.stack([torch.nan_to_num(raw).sum(-1), torch.tensor(outcome)], -1)
    out = shape(raw, rewards, ["prm", "correct"], "prm", **kw)
    mask = (torch.arange(T).expand(len(mask_len), T) < torch.tensor(mask_len).unsqueeze(-1)).float()
    return {"step_rewards": out["step_rewards"], "step_ends": torch.tensor(ends), "rewards": out["rewards"],
            "reward_names": ["prm", "correct"], "reward_weights": torch.tensor([1.0, 1.0]),
            "group_ids": torch.tensor([0] * len(mask_len)), "completion_mask": mask, "step_reward_source": "prm"}


def test_step_return_hand_values_two_steps():
    from postrl.stages import build

    # row 0: steps of 2 and 3 tokens (ends 1, 4), PRM 0.8, 0.3, correct; row 1: one step of 3 tokens, 0.6, wrong
    f = _process_fields([[0.8, 0.3], [0.6, nan]], [[1, 4], [2, -1]], [1.0, 0.0], [5, 3], T=6)
    # min-form returns: row 0 [0.3, 0.3] (P = 0.3, L = 5), row 1 [0.6] (P = 0.6, L = 3); outcome RLOO: +1, -1
    # token baseline: b_0 = 0.6 / 3 = 0.2, b_1 = 0.3 / 5 = 0.06; process part G_s - b * (tokens from step start)
    adv = build("advantage", "step_return", {})(f)
    assert adv.shape == (2, 6)
    expect = [[0.3 - 0.2 * 5 + 1] * 2 + [0.3 - 0.2 * 3 + 1] * 3 + [0.0],
              [0.6 - 0.06 * 3 - 1] * 3 + [0.0] * 3]
    assert close(adv, expect, 1e-6), adv
    # step baseline: b_0 = 0.6 / 1 step, b_1 = 0.3 / 2 steps; process part G_s - b * (steps from s to the end)
    adv = build("advantage", "step_return", {"baseline": "step"})(f)
    expect = [[0.3 - 0.6 * 2 + 1] * 2 + [0.3 - 0.6 * 1 + 1] * 3 + [0.0],
              [0.6 - 0.15 * 1 - 1] * 3 + [0.0] * 3]
    assert close(adv, expect, 1e-6), adv
    # the two steps of row 0 get different credit: the min-form return is the same (0.3), the baseline is not
    # a singleton group, an invalid row, a bad option
    assert close(step_return(**{**f, "group_ids": torch.tensor([0, 1])}), torch.zeros(2, 6))
    assert close(step_return(**{**f, "valid": torch.tensor([True, False])}), torch.zeros(2, 6))
    with pytest.raises(registry.ConfigError, match="^advantage.baseline: expected 'token' or 'step', got 'mean'$"):
        stages.build("advantage", "step_return", {"baseline": "mean"})
    with pytest.raises(ValueError, match="advantage.source"):
        step_return(**{**f, "step_reward_source": None})


def test_step_return_tokens_get_their_steps_return_clip_delta_min():
    # the other row scores 0 everywhere, so row 0's baseline is 0 and its tokens carry the step returns exactly
    # (plus its outcome advantage, 0 here); steps: tokens 0-1, 2, 3-5
    ends = [[1, 2, 5], [5, -1, -1]]
    raw = [[0.9, 0.2, 0.5], [0.0, nan, nan]]
    for stage, kw, ret in (("min_form", {}, [0.2, 0.2, 0.5]),  # min_{k >= s} r_k
                           ("delta_prm", {}, [0.9, 0.2, 0.5]),  # sum of deltas from s = r_s
                           ("clip_prm", {"eta": 0.5}, [-0.3, -0.3, 0.0])):  # sum of min(r - eta, 0) from s
        f = _process_fields(raw, ends, [0.0, 0.0], [6, 6], T=6, stage=stage, **kw)
        if stage == "clip_prm":  # row 1's clipped score is -0.5: shift it back to a zero total
            f["step_rewards"][1, 0] = 0.0
        adv = step_return(**f)
        assert close(adv[0], [ret[0]] * 2 + [ret[1]] + [ret[2]] * 3, 1e-6), (stage, adv)


def _pure_reference(step_scores, ends, lengths, verifier, n, baseline):
    """PURE's OpenRLHF code (process_experiences + reverse cumsum), loop by loop, for shaped step scores."""
    N, T = len(lengths), max(lengths)
    pr = torch.zeros(N, T, dtype=torch.float64)
    for i in range(N):
        for s, e in enumerate(ends[i]):
            pr[i, e] = step_scores[i][s]
    out_r = pr.sum(-1).reshape(-1, n)
    if baseline == "step":
        steps = torch.tensor([len(e) for e in ends], dtype=torch.float64).reshape(-1, n)
        avg = out_r / steps
        b = ((avg.sum(-1, keepdim=True) - avg) / (n - 1)).flatten()
        for i in range(N):
            for e in ends[i]:
                pr[i, e] -= b[i]
    else:
        L = torch.tensor(lengths, dtype=torch.float64).reshape(-1, n)
        b = ((out_r.sum(-1, keepdim=True) - out_r) / (L.sum(-1, keepdim=True) - L)).flatten()
        for i in range(N):
            prev = -1
            for e in ends[i]:
                pr[i, e] -= b[i] * (e - prev)
                prev = e
    v = torch.tensor(verifier, dtype=torch.float64).reshape(-1, n)
    v = (v - (v.sum(-1, keepdim=True) - v) / (n - 1)).flatten()
    for i in range(N):
        pr[i, lengths[i] - 1] += v[i]
    ret = pr.fliplr().cumsum(1).fliplr()
    mask = torch.arange(T).expand(N, T) < torch.tensor(lengths).unsqueeze(-1)
    return ret * mask


@pytest.mark.parametrize("baseline", ["token", "step"])
def test_step_return_matches_pure_code(baseline):
    g = torch.Generator().manual_seed(3)
    n, groups = 4, 3
    N = n * groups
    ends, scores, lengths = [], [], []
    for _ in range(N):
        S = int(torch.randint(1, 5, (1,), generator=g))
        sizes = torch.randint(1, 5, (S,), generator=g)
        e = (torch.cumsum(sizes, 0) - 1).tolist()
        ends.append(e)
        lengths.append(e[-1] + 1)
        scores.append(torch.rand(S, generator=g).tolist())
    S, T = max(len(e) for e in ends), max(lengths)
    sr = torch.full((N, S), nan)
    se = torch.full((N, S), -1, dtype=torch.long)
    for i in range(N):
        sr[i, : len(ends[i])] = torch.tensor(scores[i])
        se[i, : len(ends[i])] = torch.tensor(ends[i])
    verifier = torch.randint(0, 2, (N,), generator=g).double()
    rewards = torch.stack([torch.nan_to_num(sr).sum(-1).double(), verifier], -1)
    mask = (torch.arange(T).expand(N, T) < torch.tensor(lengths).unsqueeze(-1)).float()
    adv = step_return(sr, se, rewards, ["prm", "vr"], torch.tensor([1.0, 1.0]),
                      torch.arange(groups).repeat_interleave(n), mask, "prm", baseline=baseline)
    ref = _pure_reference(scores, ends, lengths, verifier.tolist(), n, baseline)
    assert close(adv, ref, 1e-5), (adv - ref).abs().max()
    # verifiable_reward_coef = the verifier's weight; whiten = verl masked_whiten of the same advantages
    adv2 = step_return(sr, se, rewards, ["prm", "vr"], torch.tensor([1.0, 0.5]),
                       torch.arange(groups).repeat_interleave(n), mask, "prm", baseline=baseline, whiten=True)
    ref2 = _pure_reference(scores, ends, lengths, (0.5 * verifier).tolist(), n, baseline)
    assert close(adv2, masked_whiten(ref2.float(), mask), 1e-5)
