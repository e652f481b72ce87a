"""RL-PLUS: external demonstrations (a column of the prompt rows) joined to their groups by the expansion
``demonstrations``, weighed by the loss ``rl_plus`` (multiple importance sampling against the mixture behaviour
policy, exploration-based advantage). Hand-computed values, the expansion's rows, the one-line errors, and the real
trainer with a nano model."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from postrl.batch import RolloutBatch
from postrl.cli import main
from postrl.config import load_config
from postrl.errors import ConfigError, DataError
from postrl.losses.hybrid import rl_plus
from postrl.models.tiny import build_local
from postrl.selection.expansions import ExpandContext
from postrl.selection.guidance import Demonstrations
from postrl.train.trainer import Trainer


# ------------------------------------------------------------------------------------------------ the loss
def test_rl_plus_by_hand():
    # row 0: a rollout, rho = 0.5 / 0.25 = 2, A = 1; row 1: a demonstration token with pi_theta = pi_old = 0.2, A = 2
    logp = torch.tensor([[math.log(0.5)], [math.log(0.2)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25)], [math.log(0.2)]])
    adv, demo = torch.tensor([1.0, 2.0]), torch.tensor([False, True])
    loss, info = rl_plus(logp, old, adv, demo)
    # rollout: PPO clip, max(-2, -1.2) = -1.2 (no gradient)
    # demonstration: pi_omega = (0.2 + 1) / 2 = 0.6 (the released code's estimate); mixture 0.5 * 0.2 + 0.5 * 0.6 = 0.4;
    # r^m = 0.2 / 0.4 = 0.5; C = (1 - 0.2)^0.5 = 0.894427; L = -0.5 * 2 * 0.894427 = -0.894427
    c = math.sqrt(0.8)
    assert loss[0, 0].item() == pytest.approx(-1.2) and loss[1, 0].item() == pytest.approx(-c, rel=1e-6)
    assert info["ratio"].flatten().tolist() == pytest.approx([2.0, 0.5])
    assert info["clip_high"].flatten().tolist() == [True, False]
    loss.sum().backward()
    # d r^m / d logp = r^m (pi_theta in the numerator only), C detached: dL/dlogp = -A C r^m = -0.894427
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[1, 0].item() == pytest.approx(-c, rel=1e-6)
    # a known demonstrator probability: pi_omega = 1 -> mixture 0.6, r^m = 1/3, L = -(1/3) 2 C
    loss, _ = rl_plus(logp.detach(), old, adv, demo, external_prob=1.0)
    assert loss[1, 0].item() == pytest.approx(-2 * c / 3, rel=1e-6)
    # gamma 0: no exploration weight; clip off: the rollout's -A rho = -2
    loss, _ = rl_plus(logp.detach(), old, adv, demo, gamma=0.0, clip=False)
    assert loss[0, 0].item() == pytest.approx(-2.0) and loss[1, 0].item() == pytest.approx(-1.0)


def test_exploration_weight_favours_correct_low_probability_tokens():
    # same advantage, same ratio: a token the policy finds unlikely (0.05) keeps more of the advantage than a likely one
    logp = torch.tensor([[math.log(0.05), math.log(0.9)]])
    loss, _ = rl_plus(logp, logp, torch.tensor([1.0]), torch.tensor([True]), external_prob=1.0)
    per_adv = -loss / (torch.exp(logp) / (0.5 * torch.exp(logp) + 0.5))  # C_t
    assert per_adv[0].tolist() == pytest.approx([0.95 ** 0.5, 0.1 ** 0.5], rel=1e-6)


def test_without_demonstrations_rl_plus_is_ppo():
    torch.manual_seed(0)
    logp, old, adv = -torch.rand(3, 4), -torch.rand(3, 4), torch.randn(3)
    from postrl.losses.policy import ppo_clip

    mine, _ = rl_plus(logp, old, adv, torch.zeros(3, dtype=torch.bool), eps_low=0.1, eps_high=0.3)
    assert torch.equal(mine, ppo_clip(logp, old, adv, eps_low=0.1, eps_high=0.3)[0])


# ------------------------------------------------------------------------------------------------ the expansion
def _batch(columns: dict) -> RolloutBatch:
    """Groups 4 (two rollouts, prompt [1, 2]) and 6 (two rollouts, prompt [3]), and a branched row of group 8."""
    return RolloutBatch(prompt_ids=torch.tensor([[1, 2], [1, 2], [0, 3], [0, 3], [0, 3]]),
                        prompt_mask=torch.tensor([[1, 1], [1, 1], [0, 1], [0, 1], [0, 1]]),
                        completion_ids=torch.tensor([[5, 6, 0], [6, 0, 0], [5, 5, 5], [6, 0, 0], [7, 0, 0]]),
                        completion_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0]]).float(),
                        group_ids=torch.tensor([4, 4, 6, 6, 8]), sampler_logprobs=torch.zeros(5, 3),
                        truncated=torch.zeros(5, dtype=torch.bool), prompts=["p", "p", "q", "q", "q"],
                        completions=["x"] * 5, columns=columns, valid=torch.ones(5, dtype=torch.bool),
                        extra={"branch": torch.tensor([False, False, False, False, True])})


def _ctx(**kw) -> ExpandContext:
    vocab = {"a": 10, "b": 11, "c": 12}
    return ExpandContext(generate=None, decode=lambda ids: "".join({v: k for k, v in vocab.items()}.get(i, "") for i in ids),
                         encode=lambda text: [vocab[ch] for ch in text], group_size=2, seed=0, pad_id=0, eos_id=2,
                         logprobs=lambda b: torch.full(b.completion_ids.shape, -0.7), **kw)


def test_demonstrations_join_their_groups_with_the_behaviour_policys_logprobs():
    batch = _batch({"demonstration": ["ab", "ab", ["c", "abc"], ["c", "abc"], "zz"]})
    out = Demonstrations(max_tokens=3).expand(batch, _ctx())
    # group 4: 'ab' + EOS; group 6: 'c' + EOS and 'abc' (+ EOS cut at 3 tokens: truncated); group 8 (branched): none
    assert out.group_ids.tolist() == [4, 6, 6]
    assert out.completion_ids.tolist() == [[10, 11, 2], [12, 2, 0], [10, 11, 12]]
    assert out.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    assert out.truncated.tolist() == [False, False, True] and out.completions == ["ab", "c", "abc"]
    assert out.prompt_ids.tolist() == [[1, 2], [0, 3], [0, 3]] and out.prompt_mask.tolist() == [[1, 1], [0, 1], [0, 1]]
    # sampler log-probs: the policy's at rollout time on the demonstration tokens, 0 on padding
    want = torch.tensor([[-0.7] * 3, [-0.7, -0.7, 0.0], [-0.7] * 3])
    torch.testing.assert_close(out.sampler_logprobs, want)
    assert out.extra["demonstration"].all() and out.extra["branch"].all()
    assert out.columns["demonstration"][0] == "ab" and Demonstrations.joins
    # a prompt without a demonstration (None, empty) gets none; none at all: nothing to add
    assert Demonstrations().expand(_batch({"demonstration": [None, None, "", "", "a"]}), _ctx()) is None
    with pytest.raises(DataError, match="filters.demonstrations.column: the prompt rows have no column 'demonstration' "
                                        r"\(columns: answer\)"):
        Demonstrations().expand(_batch({"answer": ["1"] * 5}), _ctx())


def test_config_needs_the_expansion_for_rl_plus():
    run = ["task.name=arithmetic", "rewards=[{name: correct}]", "loss.name=rl_plus"]
    with pytest.raises(ConfigError, match=r"loss: rl_plus mixes external demonstrations into the groups: add filters"):
        load_config(None, run)
    cfg = load_config(None, [*run, "filters=[{name: demonstrations, column: solution}]", "rollout.max_new_tokens=7"])
    assert cfg.filters[0].params["max_tokens"] == 7  # the run's completion budget


# ------------------------------------------------------------------------------------------------ the trainer
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rl-plus")
    build_local(path, size="nano", seed=0)
    return path


def make(model_dir: Path, out: Path, *extra: str) -> Trainer:
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(None, [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
                             "rollout.max_new_tokens=4", "rollout.group_size=4", "train.prompts_per_step=4",
                             "train.micro_batch_size=32", "optim.lr=3e-3", "train.save_every=0",
                             "rewards=[{name: correct}]", "loss.name=rl_plus", *extra])
    return Trainer(cfg, out)


def demo_logprob(tr: Trainer, batch: RolloutBatch) -> float:
    """Mean log-prob per token of the batch's demonstration rows under the current policy."""
    rows = torch.nonzero(batch.extra["demonstration"]).flatten()
    lp = tr.ctx.logprobs(batch.select(rows))[0]
    m = batch.completion_mask[rows]
    return float((lp * m).sum() / m.sum())


def test_rl_plus_learns_the_demonstrations_in_the_trainer(model_dir, tmp_path):
    """A random nano model never solves a sum, so every group's only correct completion is its demonstration (the
    arithmetic rows' 'answer' column: the number, then EOS): GRPO gives it the positive advantage, rl_plus raises
    its likelihood."""
    tr = make(model_dir, tmp_path / "run", "filters=[{name: demonstrations, column: answer}]")
    batch, _ = tr.batches.next_batch(0, 20)
    demo = batch.extra["demonstration"].bool()
    assert int(demo.sum()) == 4 and len(batch) == 4 * 4 + 4  # one demonstration per group
    assert batch.reward[demo].tolist() == [1.0] * 4 and batch.reward[~demo].max() == 0  # scored: correct
    for g in batch.group_ids[demo].tolist():  # each joined its prompt's group
        assert int((batch.group_ids == g).sum()) == 5
    # their sampler log-probs are the policy's at rollout time (what the trainer's forward gives before any update)
    lp = tr.ctx.logprobs(batch)[0]
    m = batch.completion_mask.bool()
    torch.testing.assert_close(batch.sampler_logprobs[m], lp[m], rtol=0, atol=1e-5)
    before = demo_logprob(tr, batch)
    metrics = [tr.train_step(s) for s in range(20)]
    after = demo_logprob(tr, batch)
    assert all(x["demonstration/rows"] == 4 for x in metrics)
    assert all(math.isfinite(x["pg_loss"]) for x in metrics)
    assert after > before + 0.5, (before, after)


def test_a_missing_demonstration_column_is_one_line(model_dir, tmp_path, capsys):
    argv = ["train", f"model.path={model_dir}", "task.name=arithmetic", "rollout.max_new_tokens=4",
            "train.steps=1", "train.prompts_per_step=2", "filters=[{name: demonstrations}]", "loss.name=rl_plus",
            f"output_dir={tmp_path / 'o'}", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("postrl: error: filters.demonstrations.column: the prompt rows have no column "
                          "'demonstration' (columns: answer, solution, task)"), err


def test_step_concat_keeps_row_flags_only_some_batches_carry():
    """The step's concat gives rows without an expansion's per-row field its zero / None (RolloutBatch.concat alone
    keeps only the first batch's keys: a flag like 'guided' or 'demonstration' would be dropped)."""
    from postrl.step.sampling import concat

    own = _batch({"answer": ["1"] * 5})
    more = own.select([0, 1])
    more.extra.update(guided=torch.tensor([True, False]), hint=["h", "g"])
    plain = RolloutBatch.concat([own.select([0]), more.select([0])])
    assert "guided" not in plain.extra  # (what RolloutBatch.concat does on its own)
    out = concat([own, more])
    assert out.extra["guided"].tolist() == [False] * 5 + [True, False]
    assert out.extra["hint"] == [None] * 5 + ["h", "g"] and len(out.extra["branch"]) == 7
