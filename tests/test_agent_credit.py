"""Learned turn credit: SPA's progress estimator, ArCHer's hierarchical critic, OPRL's online implicit PRM
(hand-computed values, learning on small problems, the state rule and checkpoint round trips)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from postrl import stages
from postrl.advantages.turns import turn_mapo
from postrl.environments.credit import ArCHer, OPRL, SPA, turn_features, turn_starts
from postrl.errors import ConfigError
from postrl.models.tiny import build_local


def one_hot(*idx, H=4):
    out = torch.zeros(len(idx), H)
    out[torch.arange(len(idx)), torch.tensor(idx)] = 1.0
    return out


def test_turn_starts_and_features():
    # episode 0: model tokens 0-1 (turn 0), env 2-3, model 4-5 (turn 1); episode 1: one turn at 0-2
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.float)
    ends = torch.tensor([[1, 5], [2, -1]])
    assert turn_starts(ends, mask).tolist() == [[0, 4], [0, -1]]
    h = torch.arange(2 * 6, dtype=torch.float).reshape(2, 6, 1)
    s, x, has = turn_features(h, ends, mask)
    assert s[..., 0].tolist() == [[0.0, 4.0], [6.0, 0.0]] and x[..., 0].tolist() == [[1.0, 5.0], [8.0, 0.0]]
    assert has.tolist() == [[True, True], [True, False]]


def spa_batch(R=(1.0, 0.0)):
    """Two 2-turn episodes of one group; turn features one-hot at the turn's last token."""
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]], dtype=torch.float)
    ends = torch.tensor([[1, 4], [1, 4]])
    h = torch.zeros(2, 5, 4)
    h[0, 1], h[0, 4], h[1, 1], h[1, 4] = one_hot(0, 1, 0, 2)
    return {"reward": torch.tensor(R), "completion_hidden": h, "turn_ends": ends,
            "turn_tool_errors": torch.tensor([[0, 0], [1, 0]]), "turn_malformed_calls": torch.zeros(2, 2),
            "group_ids": torch.tensor([0, 0]), "completion_mask": mask}


def test_spa_untrained_contributions_split_the_outcome_and_feed_turn_mapo():
    spa = stages.build("advantage", "spa", {"grounding": 0.5, "scale": "none"})
    b = spa_batch()
    r = spa.fn.turn_rewards(b["reward"], b["completion_hidden"], b["turn_ends"], b["turn_tool_errors"],
                            b["turn_malformed_calls"], b["completion_mask"])
    # zero estimator, exact: c' = R / 2 per turn; + 0.5 * grounding (episode 1's turn 0 had a failing call)
    assert r.tolist() == [[0.5 + 0.5, 0.5 + 0.5], [0.0 + 0.0, 0.0 + 0.5]]
    adv = spa(b)
    want = turn_mapo(r, b["turn_ends"], b["group_ids"], b["completion_mask"], b["reward"], scale="none")
    assert torch.equal(adv, want)


def test_spa_learns_progress_and_keeps_the_sum():
    # feature 0 = progress worth 1, features 1 and 2 worth 0; R = the number of progress turns:
    # episode 0 turns (e0, e1): R = 1; episode 1 turns (e0, e0): R = 2
    spa = SPA(lr=0.1, epochs=300, exact=False)
    b = spa_batch()
    b["completion_hidden"][1, 4] = one_hot(0)[0]
    b["reward"] = torch.tensor([1.0, 2.0])
    spa(**b)  # creates the (zero) estimator
    before = copy.deepcopy(spa.state_dict())
    spa.observe(**b)
    spa(**b)
    assert spa.state_dict() == before  # __call__ and observe never change the state; end_step does
    m = spa.end_step(stages.StepEnd())
    assert m["loss"] == pytest.approx((1.0 + 4.0) / 2)  # zero head: ((0 - 1)^2 + (0 - 2)^2) / 2
    _, x, has = turn_features(b["completion_hidden"], b["turn_ends"], b["completion_mask"])
    c = spa.contributions(x, has, b["reward"])
    # learned: progress turns ~1, the other turn ~0 (episode 0: features 0, 1; episode 1: features 0, 0)
    assert c[0].tolist() == pytest.approx([1.0, 0.0], abs=0.05) and c[1].tolist() == pytest.approx([1.0, 1.0],
                                                                                                  abs=0.05)
    assert m["abs_error"] < 0.05
    # exact mode on top of the learned estimator: the sum is the outcome exactly
    spa.exact = True
    c = spa.contributions(x, has, torch.tensor([1.0, 3.0]))
    assert c.sum(-1).tolist() == pytest.approx([1.0, 3.0])
    fresh = SPA(lr=0.1, epochs=300, exact=False)
    fresh.load_state_dict(json.loads(json.dumps(spa.state_dict())))  # through JSON, as in trainer_state.json
    fresh.exact = True
    assert torch.equal(fresh.contributions(x, has, torch.tensor([1.0, 3.0])), c)


def test_spa_every_process_ends_with_the_same_state():
    b = spa_batch()
    fields = [b[k] for k in ("reward", "completion_hidden", "turn_ends", "turn_tool_errors", "turn_malformed_calls",
                             "group_ids", "completion_mask")]
    ranks = [SPA(), SPA()]
    ranks[0].observe(*fields)
    ranks[1].observe(*[f.flip(0) for f in fields])  # the other process's rows
    gathered = [list(r.observed) for r in ranks]
    for r in ranks:  # what postrl.stages.end_step does: every process's records, in rank order
        r.__dict__["_observed"] = [item for rank in gathered for item in rank]
        r.end_step(stages.StepEnd())
    assert ranks[0].state_dict() == ranks[1].state_dict()


# ------------------------------------------------------------------------------------------------ ArCHer


def archer_batch():
    # episodes of 2 turns: turn 0 state s=e0, action x=e3 (always the same); turn 1 state e1, action good (e2,
    # R = 1) or bad (e3 + e1: R = 0)
    mask = torch.tensor([[1, 1, 0, 1, 1]] * 2, dtype=torch.float)
    ends = torch.tensor([[1, 4], [1, 4]])
    h = torch.zeros(2, 5, 4)
    for i in range(2):
        h[i, 0], h[i, 1], h[i, 3] = one_hot(0)[0], one_hot(3)[0], one_hot(1)[0]
    h[0, 4] = one_hot(2)[0]
    h[1, 4] = torch.tensor([0.0, 1.0, 0.0, 1.0])
    return {"reward": torch.tensor([1.0, 0.0]), "completion_hidden": h, "turn_ends": ends,
            "turn_rewards": torch.zeros(2, 2), "completion_mask": mask}


def test_archer_advantage_is_q_minus_v_per_turn():
    a = ArCHer()
    b = archer_batch()
    a._make(4)
    with torch.no_grad():
        a.q.weight.copy_(torch.tensor([[0.0, 0.0, 2.0, 1.0]]))
        a.v.weight.copy_(torch.tensor([[0.5, 1.0, 0.0, 0.0]]))
    adv = a(**b)
    # turn 0: Q(e3) - V(e0) = 1 - 0.5 = 0.5; turn 1: good Q(e2) - V(e1) = 2 - 1 = 1; bad Q(e1 + e3) - V(e1) = 1 - 1
    assert adv[0].tolist() == [0.5, 0.5, 0.0, 1.0, 1.0] and adv[1].tolist() == [0.5, 0.5, 0.0, 0.0, 0.0]


def test_archer_td_step_by_hand():
    a = ArCHer(gamma=0.5, tau=0.25, lr=0.1)
    a._make(2)
    with torch.no_grad():
        for net in (a.q, a.v, a.q_target, a.v_target):
            net.weight.fill_(1.0)
    a.add({"s": torch.tensor([[1.0, 0.0]]), "x": torch.tensor([[0.0, 1.0]]), "r": torch.tensor([1.0]),
           "s_next": torch.tensor([[1.0, 1.0]]), "done": torch.tensor([0.0])})
    old_q = copy.deepcopy(a.q)
    lq, lv = a.td_step(torch.tensor([0]))
    # target Q = 1 + 0.5 * V'(1, 1) = 1 + 0.5 * 2 = 2; Q(x) = 1 -> L_Q = 1; target V = Q'(x) = 1, V(s) = 1 -> 0
    assert lq == pytest.approx(1.0) and lv == pytest.approx(0.0)
    # Polyak: Q' = 0.75 * Q'_old + 0.25 * Q_new
    want = 0.75 * old_q.weight + 0.25 * a.q.weight
    assert torch.allclose(a.q_target.weight, want) and not torch.equal(a.q.weight, old_q.weight)


def test_archer_critic_learns_off_policy_and_round_trips():
    a = ArCHer(gamma=0.5, lr=0.05, critic_steps=200, batch_size=8, buffer_size=8)
    b = archer_batch()
    for _ in range(3):
        a.observe(**b)
        a.end_step(stages.StepEnd())
        a.__dict__["_observed"] = []
    assert len(a.buffer["r"]) == 8  # 4 transitions per step, the oldest left beyond buffer_size
    with torch.no_grad():
        good, bad = float(a.q(one_hot(2))), float(a.q(torch.tensor([[0.0, 1.0, 0.0, 1.0]])))
        v1, q3 = float(a.v(one_hot(1))), float(a.q(one_hot(3)))
    # Q(good) -> 1, Q(bad) -> 0, V(e1) -> mean of the logged actions' Q ~ 0.5; Q(e3) (turn 0) -> gamma V(e1)
    assert good == pytest.approx(1.0, abs=0.1) and bad == pytest.approx(0.0, abs=0.1)
    assert v1 == pytest.approx(0.5, abs=0.1) and q3 == pytest.approx(0.25, abs=0.1)
    adv = a(**b)
    assert adv[0, 3] > 0.3 and adv[1, 3] < -0.3  # the good turn is credited, the bad one blamed
    c = ArCHer(gamma=0.5, lr=0.05, critic_steps=200, batch_size=8, buffer_size=8)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert torch.equal(c(**b), adv) and c.updates == a.updates == 600
    for k in a.buffer:
        assert torch.equal(c.buffer[k], a.buffer[k])


# ------------------------------------------------------------------------------------------------ OPRL


@pytest.fixture(scope="module")
def prm_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("prm") / "m"
    build_local(path, size="nano", seed=3)
    return str(path)


def oprl_batch():
    # one group of two 2-turn episodes; prompt "a", completions of 6 tokens (turn 0: 0-1, env 2-3, turn 1: 4-5)
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 12, 13, 24, 25]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]] * 2, dtype=torch.float)
    return {"reward": torch.tensor([1.0, 0.0]), "prompt_ids": torch.tensor([[5], [5]]),
            "prompt_mask": torch.ones(2, 1, dtype=torch.long), "completion_ids": ids, "completion_mask": mask,
            "turn_ends": torch.tensor([[1, 5], [1, 5]]), "group_ids": torch.tensor([0, 0])}


def test_oprl_starts_as_grpo_and_dpo_moves_step_rewards(prm_folder):
    o = stages.build("advantage", "oprl", {"prm_model": prm_folder, "lr": 1e-2, "beta": 0.5, "epochs": 5}).fn
    b = oprl_batch()
    adv = o(**b)
    # pi_prm = pi_ref: step rewards 0, so A = A^E = (1 - 0.5) / std([1, 0]) = 0.5 / 0.7071 on model tokens
    assert adv[0].tolist() == pytest.approx([0.7071068, 0.7071068, 0, 0, 0.7071068, 0.7071068], abs=1e-5)
    assert adv[1, 0] == pytest.approx(-0.7071068, abs=1e-5)
    assert o.pairs([(0, 1.0, [], [], []), (0, 0.0, [], [], []), (1, 0.5, [], [], []), (0, 1.0, [], [], [])]) == \
        [(0, 1), (3, 1)]
    o.observe(**b)
    m = o.end_step(stages.StepEnd())
    assert m["pairs"] == 1.0 and m["dpo_loss"] == pytest.approx(math.log(2), abs=1e-5)  # margin 0 at the start
    r = o.step_rewards(b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"], b["turn_ends"])
    assert r[0].sum() > r[1].sum()  # the preferred trajectory's implicit reward rose above the other's
    adv = o(**b)
    assert adv[0, 0] > 0.7071068 or adv[0, 4] > 0.7071068  # its better turn is credited beyond the outcome
    fresh = OPRL(prm_model=prm_folder, lr=1e-2, beta=0.5)
    fresh.load_state_dict(json.loads(json.dumps(o.state_dict())))
    assert torch.allclose(fresh(**b), adv)


def test_oprl_config_errors(prm_folder, tmp_path):
    with pytest.raises(ConfigError, match="advantage.prm_model: '.*' is not a model folder"):
        stages.build("advantage", "oprl", {"prm_model": str(tmp_path)}, where="advantage")
    o = OPRL(prm_model=prm_folder)
    b = oprl_batch()
    b["completion_ids"][0, 0] = 10_000
    with pytest.raises(ConfigError, match="does not cover the policy's token ids"):
        o(**b)
