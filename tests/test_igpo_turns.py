"""IGPO: the per-turn information gain producer (probabilities from the nano model) and turn_igpo's advantages."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.advantages.turns import turn_igpo
from postrl.batch import RolloutBatch
from postrl.context import ModelContext
from postrl import registry
from postrl.errors import ConfigError
from postrl.fields import produce, turn_info_gain
from postrl.models.tiny import build_model, build_tokenizer
from postrl.stages import build
from test_train import model_dir  # noqa: F401 - the fixture


def multiturn_batch(tok):
    """Two episodes: ep 0 = turn 0 (2 tokens), observation (2), turn 1 (2 tokens), pad;
    ep 1 = one turn (3 tokens) then pad."""
    p = tok("12+3=", add_special_tokens=False)["input_ids"]
    c0 = tok("4a<b7x", add_special_tokens=False)["input_ids"][:6]
    c1 = tok("15z", add_special_tokens=False)["input_ids"][:3]
    pad = tok.pad_token_id
    comp = torch.tensor([c0 + [pad], c1 + [pad] * 4])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0]], dtype=torch.float)
    ends = torch.tensor([[1, 5], [2, -1]])
    b = RolloutBatch(prompt_ids=torch.tensor([p, p]), prompt_mask=torch.ones(2, len(p), dtype=torch.long),
                     completion_ids=comp, completion_mask=mask, group_ids=torch.tensor([0, 0]),
                     sampler_logprobs=torch.zeros(2, 7), truncated=torch.tensor([False, False]),
                     prompts=["12+3=", "12+3="], completions=["", ""], columns={"answer": ["15", "15"]},
                     extra={"turn_ends": ends})
    return b, p, comp


@pytest.fixture(scope="module")
def ctx():
    tok = build_tokenizer()
    return ModelContext(build_model(tok, size="nano", seed=0), tok, pad_id=tok.pad_token_id)


def test_turn_info_gain_is_the_probability_increase_per_turn(ctx):
    b, p, comp = multiturn_batch(ctx.tokenizer)
    a = ctx.tokenizer("15", add_special_tokens=False)["input_ids"]
    ig = turn_info_gain(ctx, b)
    # by hand: h_{-1} = (), h_0 = turn 0 + its observation (tokens 0..3), h_1 = up to turn 1's last token (0..5)
    c0 = comp[0].tolist()
    lp = ctx.sequence_logprob([p, p + c0[:4], p + c0[:6], p + comp[1, :3].tolist()], [a] * 4, mean=False)
    pr = lp.exp()
    assert ig.shape == (2, 2)
    assert ig[0, 0].item() == pytest.approx((pr[1] - pr[0]).item(), abs=1e-7)
    assert ig[0, 1].item() == pytest.approx((pr[2] - pr[1]).item(), abs=1e-7)
    assert ig[1, 0].item() == pytest.approx((pr[3] - pr[0]).item(), abs=1e-7)
    assert math.isnan(ig[1, 1].item())  # beyond the episode
    # a probability, not a log-probability difference
    assert ig[0, 0].item() != pytest.approx((lp[1] - lp[0]).item(), abs=1e-4)
    # per_token: the geometric mean per answer token
    lpm = ctx.sequence_logprob([p, p + c0[:4]], [a] * 2, mean=True)
    ig_m = turn_info_gain(ctx, b, answer_prob="per_token")
    assert ig_m[0, 0].item() == pytest.approx((lpm[1].exp() - lpm[0].exp()).item(), abs=1e-7)


def test_turn_info_gain_errors_and_missing_answers(ctx):
    b, _, _ = multiturn_batch(ctx.tokenizer)
    with pytest.raises(ValueError, match="answer_column"):
        turn_info_gain(ctx, b, answer_column="gold")
    with pytest.raises(ConfigError, match="answer_prob: expected 'joint' or 'per_token'"):
        build("advantage", "turn_igpo", {"answer_prob": "log"})
    b.columns["answer"] = [None, "15"]
    ig = turn_info_gain(ctx, b)
    assert torch.isnan(ig[0]).all() and torch.isfinite(ig[1, 0])
    del b.extra["turn_ends"]
    with pytest.raises(ValueError, match="turn_ends"):
        turn_info_gain(ctx, b)


def test_turn_igpo_hand_computed():
    # one group of two episodes, two turns each; completion: turn 0 = 0-1, observation 2, turn 1 = 3-4, pad 5
    ends = torch.tensor([[1, 4], [1, 4]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 0]] * 2, dtype=torch.float)
    ig = torch.tensor([[0.3, 9.0], [0.1, 9.0]])  # the last turn's gain is replaced by the outcome
    R = torch.tensor([1.0, 0.0])
    a = turn_igpo(ig, ends, torch.tensor([0, 0]), mask, R, scale="none")
    # r = [[0.3, 1], [0.1, 0]], group mean 0.35: r^ = [[-0.05, 0.65], [-0.25, -0.35]]
    # returns: G = [[0.6, 0.65], [-0.6, -0.35]]
    assert a[0].tolist() == pytest.approx([0.6, 0.6, 0.0, 0.65, 0.65, 0.0], abs=1e-6)
    assert a[1].tolist() == pytest.approx([-0.6, -0.6, 0.0, -0.35, -0.35, 0.0], abs=1e-6)
    a = turn_igpo(ig, ends, torch.tensor([0, 0]), mask, R, scale="none", gamma=0.5)
    assert a[0, 0].item() == pytest.approx(-0.05 + 0.5 * 0.65, abs=1e-6)
    s = torch.tensor([0.3, 1.0, 0.1, 0.0]).std().item()
    a = turn_igpo(ig, ends, torch.tensor([0, 0]), mask, R)
    assert a[1, 3].item() == pytest.approx(-0.35 / (s + 1e-6), abs=1e-5)


def test_turn_igpo_uneven_turns_groups_and_validity():
    ends = torch.tensor([[1, 4], [2, -1], [1, 4]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 1, 1]], dtype=torch.float)
    ig = torch.tensor([[0.2, 0.0], [float("nan"), float("nan")], [0.5, 0.0]])
    R = torch.tensor([1.0, 0.0, 1.0])
    a = turn_igpo(ig, ends, torch.tensor([0, 0, 1]), mask, R, scale="none")
    # group 0 entries: ep0 [0.2, 1], ep1 [0] (its only turn is the answer turn): mean 0.4
    assert a[0, 0].item() == pytest.approx((0.2 - 0.4) + (1 - 0.4), abs=1e-6)
    assert a[1].tolist() == pytest.approx([-0.4, -0.4, -0.4, 0.0, 0.0], abs=1e-6)
    # group 1, one episode: r = [0.5, 1], mean 0.75
    assert a[2, 0].item() == pytest.approx(-0.25 + 0.25, abs=1e-6) and a[2, 3].item() == pytest.approx(0.25)
    a = turn_igpo(ig, ends, torch.tensor([0, 0, 1]), mask, torch.tensor([1.0, float("nan"), 1.0]), scale="none")
    assert a[1].abs().max().item() == 0.0  # a failed reward: excluded and 0
    assert a[0, 0].item() == pytest.approx((0.2 - 0.6) + (1 - 0.6), abs=1e-6)  # group 0 now ep0 alone


def test_registered_reads_the_producer_field(ctx):
    st = build("advantage", "turn_igpo", {"gamma": 0.9, "answer_prob": "per_token"})
    assert "turn_info_gain" in st.reads and "turn_info_gain" in registry.names("field")
    b, _, _ = multiturn_batch(ctx.tokenizer)
    produce(ctx, b, st)
    assert b.extra["turn_info_gain"].shape == (2, 2)
    assert b.extra["turn_info_gain"][0, 0].item() == pytest.approx(
        turn_info_gain(ctx, b, answer_prob="per_token")[0, 0].item(), abs=1e-7)


class TwoTurns:
    """Two model turns with an observation between them; outcome 0 (an untrained model's answers are wrong)."""

    def reset(self, row):
        self.k = 0
        return row["prompt"]

    def step(self, action):
        self.k += 1
        return "=?", (0.0 if self.k == 2 else None), self.k == 2, {}


def test_turn_igpo_trains_through_the_trainer(model_dir, tmp_path, monkeypatch):
    """A two-turn run with advantage turn_igpo: the trainer produces turn_info_gain each step from the policy, and
    the dense turn rewards give a gradient although every outcome is 0 (GRPO's advantage would collapse)."""
    import dataclasses

    from test_train import metrics, run_inprocess

    seen = []
    entry = registry.entry("field", "turn_info_gain")

    def recording(ctx, batch, *, answer_column="answer", answer_prob="joint"):
        out = entry.fn(ctx, batch, answer_column=answer_column, answer_prob=answer_prob)
        seen.append((out, batch.extra["turn_ends"].clone(), {"answer_prob": answer_prob}))
        return out

    monkeypatch.setitem(registry._REGISTRY["field"], "turn_info_gain", dataclasses.replace(entry, fn=recording))
    run_inprocess([f"model.path={model_dir}", f"output_dir={tmp_path}", "task.name=calculator", "task.digits=2",
                   "environment={name: %s:TwoTurns, max_turns: 2, max_total_tokens: 30}" % __name__,
                   "rewards=[{name: environment}]", "advantage={name: turn_igpo, answer_prob: per_token}",
                   "rollout.max_new_tokens=8", "rollout.group_size=4", "train.prompts_per_step=2", "train.steps=2",
                   "train.eval_size=2", "train.eval_k=1"])
    assert len(seen) == 2 and all(p["answer_prob"] == "per_token" for _, _, p in seen)
    for ig, ends, _ in seen:
        assert ig.shape == (8, 2) and (ends >= 0).all() and torch.isfinite(ig).all()
    rows = metrics(tmp_path)
    assert all(math.isfinite(r["pg_loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert all(r["reward/mean"] == 0.0 and r["turns/per_episode"] == 2.0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)  # dense turn rewards: a gradient even when outcomes tie
