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
from postrl.advantages.outcome import dr_grpo, gpg, opo, pass_at_k, reinforce_pp, reinforce_pp_baseline, remax, rloo
from postrl.advantages.shaped import (aem, confidence_scaled, gdpo, information_gain, mapo, riskpo, rl_zvp,
                                      role_aware)
from postrl.advantages.tournament import bracket_order, rank_tournament
from postrl.pipeline import call_stage

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


def test_role_aware_per_role_statistics_and_weights():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 1.0], [1.0, 1.0]])
    names, w = ["acc", "fmt"], torch.tensor([1.0, 0.0])
    cols = {"role": ["a", "a", "b", "b"]}
    a = role_aware(rewards, names, w, torch.zeros(4, dtype=torch.long), cols)
    assert close(a, [S2, -S2, S2, -S2])  # each role normalised on its own
    # role b weighs only fmt -> its rewards are equal (1, 1): no signal; role a unchanged
    a = role_aware(rewards, names, w, torch.zeros(4, dtype=torch.long), cols,
                   role_weights={"b": {"acc": 0.0, "fmt": 1.0}})
    assert close(a, [S2, -S2, 0.0, 0.0])
    with pytest.raises(ValueError, match="no column 'role'.*columns: task"):
        role_aware(rewards, names, w, torch.zeros(4, dtype=torch.long), {"task": ["x"] * 4})
    with pytest.raises(ValueError, match="unknown reward 'len'; rewards: acc, fmt"):
        role_aware(rewards, names, w, torch.zeros(4, dtype=torch.long), cols, role_weights={"a": {"len": 1.0}})


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


CALLS: list[int] = []


def shorter_wins(prompts, first, second):
    """Test judge: the shorter completion wins."""
    CALLS.append(len(first))
    return [1.0 if len(a) < len(b) else 0.0 for a, b in zip(first, second)]


def test_rank_tournament_custom_judge_batched_per_round():
    if "tests.test_advantages" in sys.modules:
        sys.modules["tests.test_advantages"].CALLS.clear()
    r = torch.tensor([0.1, 0.4, 0.3, 0.2, 0.5, 0.6, 0.7, 0.8])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    comps = ["a", "bb", "ccc", "dddd", "eeeee", "ff", "ggg", "h"]
    a = rank_tournament(r, g, ["q"] * 8, comps, judge="tests.test_advantages:shorter_wins")
    calls = sys.modules["tests.test_advantages"].CALLS  # the judge's module as the import path loads it
    assert calls == [4, 2]  # one judge call per round, with every match of every group; n - 1 matches per group
    # group 0 (seeds by reward: bb, ccc, dddd, a): a beats bb, ccc beats dddd, a beats ccc in the final
    # group 1 (seeds h, ggg, ff, eeeee): h beats eeeee, ff beats ggg, h beats ff
    assert close(a[:4], grpo(torch.tensor([2.0, 0.0, 1.0, 0.0]), g[:4]))
    assert close(a[4:], grpo(torch.tensor([0.0, 1.0, 0.0, 2.0]), g[4:]))
    with pytest.raises(ValueError, match="module:function"):
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
            "prompts": ["q"] * N, "completions": [f"c{i}" for i in range(N)]}


def make(name):
    fn = registry.get("advantage", name)
    return fn() if isinstance(fn, type) else fn


@pytest.mark.parametrize("name", registry.names("advantage"))
def test_every_estimator_excludes_invalid_rows_and_is_finite(name):
    f = batch_fields()
    f["reward"] = f["reward"].clone()
    f["reward"][1] = nan  # a failed reward
    f["rewards"] = f["rewards"].clone()
    f["rewards"][1] = nan
    f["valid"] = torch.isfinite(f["reward"])
    f["valid"][4] = False  # excluded by a filter
    a = call_stage(make(name), f, {})
    assert a.shape[0] == 12 and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.all(a[1] == 0) and torch.all(a[4] == 0)


@pytest.mark.parametrize("name", sorted(set(registry.names("advantage")) - {"rl_zvp", "remax", "reinforce_pp", "gae",
                                                                            "red", "attention_credit"}))
def test_all_equal_rewards_and_g1_give_zero(name):
    a = call_stage(make(name), batch_fields(equal=True), {})
    assert torch.all(a.abs() < 1e-6), name  # all-equal rewards: no signal (rl_zvp's entropy shaping aside)
    a = call_stage(make(name), batch_fields(N=4, G=1, seed=3), {})
    if name != "mapo":  # mapo's batch term is defined for singleton groups
        assert torch.all(a.abs() < 1e-6), name


def test_unknown_parameter_values_are_errors():
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="advantage.count"):
        gpg(r, g, count="bad")
    with pytest.raises(ValueError, match="advantage.scale"):
        pass_at_k(r, g, scale="batch")
    with pytest.raises(ValueError, match="advantage.gamma"):
        GAE(gamma=2.0)
    with pytest.raises(ValueError, match="advantage.mix"):
        mapo(r, g, mix=1.5)
    with pytest.raises(registry.ConfigError, match="unknown parameter 'lambda' for advantage 'gae'; valid: gamma, lam"):
        registry.check_params("advantage", "gae", {"lambda": 0.9}, where="advantage")


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
