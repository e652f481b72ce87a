"""Data filters, prompt selectors and rollout options: hand-computed values, the trainer's refill loop (regenerates
until full, hits its cap with a warning, judges the raw reward), checkpointed state, and the expanding options."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from postrl import registry
from postrl.batch import RolloutBatch
from postrl.config import load_config
from postrl.seeding import stable_hash
from postrl.selection.expansions import CureBranching, ExpandContext, RetryFromFailure
from postrl.selection.filters import dynamic_sampling, range_filter
from postrl.selection.sampling import MultiTemperature, generate_multi_temperature
from postrl.selection.selectors import InSight, PassRateCurriculum, PromptCurriculum, beta_mutual_information, prompt_key
from postrl.errors import ConfigError
from postrl.models.tiny import build_local
from postrl.generation import Generation, SamplingParams, left_pad
from postrl import stages
from postrl.step import Step
from postrl.train.trainer import Trainer
from test_train import crash_in_step

nan = float("nan")


@registry.register("reward", "filters_coin", source="test: 1 for about a quarter of the completions")
def filters_coin(prompts, completions, **_):
    """1.0 when hash(prompt, completion) % 4 == 0 (so a group of 4 is all-zero about a third of the time)."""
    return [float(stable_hash(p, c) % 4 == 0) for p, c in zip(prompts, completions)]


# ----------------------------------------------------------------------------------------------- keep masks
def test_dynamic_sampling_keeps_groups_with_raw_variance_only():
    # columns: correct (raw, verifiable), length bonus (makes the shaped reward vary in every group)
    rewards = torch.tensor([[1.0, 0.1], [1.0, 0.9], [0.0, 0.2], [1.0, 0.3], [0.0, 0.5], [nan, 0.1], [1.0, 0.0],
                            [0.0, 0.0]])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    keep = dynamic_sampling(rewards, ["correct", "len"], g)
    assert keep.tolist() == [False, False, True, True, False, False, True, True]  # all-right / NaN-only: dropped
    assert dynamic_sampling(rewards, ["correct", "len"], g, reward="len").tolist() == [True] * 6 + [False] * 2
    # a shaping stage rewrote the correct column (e.g. a truncation penalty): the filter reads the raw matrix
    shaped = rewards.clone()
    shaped[:, 0] = 0.0
    keep = dynamic_sampling(shaped, ["correct", "len"], g, raw_rewards=rewards, raw_reward_names=("correct", "len"))
    assert keep.tolist() == [False, False, True, True, False, False, True, True]
    with pytest.raises(ValueError, match="no reward source named 'acc' in this run; rewards: correct, len"):
        dynamic_sampling(rewards, ["correct", "len"], g, reward="acc")


def test_dynamic_sampling_singletons_keep_is_verl_convention():
    # groups: 0 = one completion (r=1), 1 = two equal (0, 0), 2 = varies (0, 1), 3 = one finite value (1, NaN)
    rewards = torch.tensor([[1.0], [0.0], [0.0], [0.0], [1.0], [1.0], [nan]])
    g = torch.tensor([0, 1, 1, 2, 2, 3, 3])
    # default (postrl): a group with fewer than two finite values is dropped -> only group 2 trains
    assert dynamic_sampling(rewards, ["correct"], g).tolist() == [False, False, False, True, True, False, False]
    # verl: evict only len >= 2 with std 0 -> the group of one is kept; so is the group with one finite value
    keep = dynamic_sampling(rewards, ["correct"], g, singletons="keep")
    assert keep.tolist() == [True, False, False, True, True, True, True]


def _verl_dapo_keep(values_by_uid: dict) -> dict:
    """verl 0.9.1 ReplayBuffer._dapo_filtered_keys: a group is evicted iff len(values) > 1 and np.std == 0."""
    import numpy as np

    return {uid: not (len(v) > 1 and float(np.std(v)) == 0.0) for uid, v in values_by_uid.items()}


def test_dynamic_sampling_singletons_keep_equals_verl_on_random_tensors():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        sizes = torch.randint(1, 5, (12,), generator=gen).tolist()  # groups of 1..4 completions
        g = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
        g = g[torch.randperm(len(g), generator=gen)]  # groups need not be contiguous
        if trial % 2:
            r = torch.randint(0, 2, (len(g),), generator=gen).float()  # 0/1 accuracy (many zero-std groups)
        else:
            r = torch.randint(0, 3, (len(g),), generator=gen).float() / 2  # graded scores
        by_uid: dict = {}
        for uid, val in zip(g.tolist(), r.tolist()):
            by_uid.setdefault(uid, []).append(val)
        ref = _verl_dapo_keep(by_uid)
        keep = dynamic_sampling(r[:, None], ["correct"], g, singletons="keep")
        assert keep.tolist() == [ref[uid] for uid in g.tolist()]
        # the default differs exactly on the groups of one
        default = dynamic_sampling(r[:, None], ["correct"], g)
        differ = {uid for uid, v in by_uid.items() if len(v) == 1}
        assert [a != b for a, b in zip(keep.tolist(), default.tolist())] == [uid in differ for uid in g.tolist()]


def test_range_filter_hand_values():
    r = torch.tensor([[0.0], [0.0], [1.0], [0.0], [1.0], [1.0], [1.0], [0.5]])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # means 0, 0.5, 1, 0.75
    assert range_filter(r, ["correct"], g).tolist() == [False, False, True, True, False, False, True, True]
    assert range_filter(r, ["correct"], g, low=0.6).tolist() == [False] * 6 + [True, True]
    with pytest.raises(ConfigError, match=r"^filters.0.high: expected a value > low \(0.5\), got 0.5$"):
        load_config(None, ["filters=[{name: range_filter, low: 0.5, high: 0.5}]"])
    with pytest.raises(ConfigError, match=r"^filter.high: expected a value > low \(0.0\), got -1.0$"):
        stages.build("filter", "range_filter", {"high": -1})
    with pytest.raises(ConfigError, match=r"^filter.max_attempts: expected a value >= 1, got 0$"):
        stages.build("filter", "range_filter", {"max_attempts": 0})


# ----------------------------------------------------------------------------------------------- selectors
def test_beta_mutual_information_hand_values():
    one = torch.tensor([1.0])
    assert torch.allclose(beta_mutual_information(one, one, 1), torch.tensor([math.log(2) - 0.5], dtype=torch.float64))
    # n = 2 under Beta(1, 1): P(00) = P(11) = 1/3, P(01) = P(10) = 1/6; E[H_b(p)] = 1/2 per rollout
    h = 2 / 3 * math.log(3) + 1 / 3 * math.log(6)
    assert torch.allclose(beta_mutual_information(one, one, 2), torch.tensor([h - 1.0], dtype=torch.float64))
    # more evidence at the same mean belief: less to learn
    mi = beta_mutual_information(torch.tensor([1.0, 5.0, 50.0]), torch.tensor([1.0, 5.0, 50.0]), 8)
    assert mi[0] > mi[1] > mi[2] > 0


def test_insight_posterior_selection_and_state():
    sel = InSight()
    rows = [{"prompt": p} for p in ("easy", "hard", "new", "mid")]
    sel.update([(prompt_key("easy"), 8.0, 8.0), (prompt_key("hard"), 0.0, 8.0), (prompt_key("mid"), 4.0, 8.0)])
    assert sel.post[prompt_key("easy")] == [8.0, 0.0]
    pick = sel.select(rows, 2, seed=0, group_size=8)
    assert sorted(pick) == [2, 3]  # the unseen prompt and the mid-difficulty one; solved / hopeless ones wait
    s = sel.scores([prompt_key(p) for p in ("easy", "hard", "new", "mid")], 8)
    assert s[2] > s[3] > s[0] and torch.isclose(s[0], s[1])
    sel2 = InSight(decay=0.5)
    sel2.update([("k", 2.0, 4.0)])
    sel2.update([("k", 4.0, 4.0)])
    assert sel2.post["k"] == [5.0, 1.0]  # 0.5 * [2, 2] + [4, 0]
    other = InSight()
    other.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert other.select(rows, 2, seed=0, group_size=8) == pick


def test_pass_rate_curriculum_ema_and_sampling():
    sel = PassRateCurriculum(target=0.5, width=0.05, ema=0.5)
    sel.update([("k", 1.0, 2.0)])
    sel.update([("k", 2.0, 2.0)])
    assert sel.rate["k"] == 0.75  # first sets 0.5, then 0.5 * 0.5 + 0.5 * 1
    rows = [{"prompt": p} for p in ("a", "b", "c")]
    sel.update([(prompt_key("a"), 0.0, 4.0), (prompt_key("b"), 2.0, 4.0), (prompt_key("c"), 4.0, 4.0)])
    assert sel.select(rows, 1, seed=1, group_size=4) == [1]  # the one at the target difficulty
    other = PassRateCurriculum()
    other.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert other.rate == sel.rate


def test_pcl_value_probe_learns_and_selects_mid_difficulty():
    torch.manual_seed(0)
    sel = PromptCurriculum(lr=0.1, epochs=100)
    rows = [{"prompt": f"p{i}"} for i in range(4)]
    feats = torch.eye(4)
    first = sel.select(rows, 4, seed=0, group_size=4, features=feats)
    assert sorted(first) == [0, 1, 2, 3]
    assert torch.allclose(sel.predict(feats), torch.full((4,), 0.5))  # zero-initialised probe
    sel.update([(prompt_key(f"p{i}"), r * 4, 4.0) for i, r in enumerate([0.0, 0.25, 0.5, 1.0])])
    pred = sel.predict(feats)
    assert pred[0] < 0.2 and pred[3] > 0.8 and abs(float(pred[2]) - 0.5) < 0.1
    assert sel.select(rows, 1, seed=0, group_size=4, features=feats) == [2]
    other = PromptCurriculum(lr=0.1, epochs=100)
    other.load_state_dict(json.loads(json.dumps(sel.state_dict())))
    assert torch.equal(other.predict(feats), pred)


def test_selector_summary_counts_fresh_groups_only():
    b = fake_batch(rewards=[1.0, 0.0, 1.0, 1.0], groups=[0, 0, 1, 1])
    b.extra["branch"] = torch.tensor([False, False, True, True])
    sel = stages.build("selector", "insight")
    sel.observe(b)
    assert sel.fn.observed == [(prompt_key("q"), 1.0, 2.0)]
    assert sel.fn.post == {}  # recorded, applied at the end of the step
    stages.end_step([sel], stages.StepEnd())
    assert sel.fn.post == {prompt_key("q"): [1.0, 1.0]} and sel.fn.observed == []


# ----------------------------------------------------------------------------------------------- rollout options
class FakeBackend:
    """Generates completion tokens that encode (temperature, prompt, sample): 100*T + 10*prompt + j."""

    pad_id = 0

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, n, params, seed):
        self.calls.append((len(prompt_ids), n, params.temperature))
        N = len(prompt_ids) * n
        comp = torch.tensor([[int(100 * params.temperature) + 10 * i + j, 1] for i in range(len(prompt_ids))
                             for j in range(n)])
        pid, pmask = left_pad([p for p in prompt_ids for _ in range(n)], 0)
        return Generation(prompt_ids=pid, prompt_mask=pmask, completion_ids=comp,
                          completion_mask=torch.ones(N, 2), logprobs=torch.full((N, 2), -0.5),
                          truncated=torch.zeros(N, dtype=torch.bool), texts=[f"t{x[0]}" for x in comp.tolist()])


def test_multi_temperature_interleaves_groups():
    mt = MultiTemperature(temperatures=[0.5, 1.0])
    assert mt.plan(5) == [0.5, 1.0, 0.5, 1.0, 0.5]
    with pytest.raises(ConfigError, match="group_size=1 is smaller than the 2 temperatures"):
        mt.plan(1)
    # ... and when the config is read, against rollout.group_size
    with pytest.raises(ConfigError, match=r"^filters.0.temperatures: rollout.group_size=2 is smaller than the 3 "):
        load_config(None, ["rollout.group_size=2", "filters=[{name: multi_temperature}]"])
    with pytest.raises(ConfigError, match=r"^filters.0.temperatures.1: .*greater than or equal to 0, got -1"):
        load_config(None, ["filters=[{name: multi_temperature, temperatures: [0.5, -1]}]"])
    with pytest.raises(ConfigError, match=r"^filters.0.temperatures: .*at least 1 item"):
        load_config(None, ["filters=[{name: multi_temperature, temperatures: []}]"])
    assert stages.build("sampling", "multi_temperature", {"temperatures": [1, 0.5]}).fn.temperatures == [1.0, 0.5]
    be = FakeBackend()
    gen, temps = generate_multi_temperature(be.generate, [[5], [6]], SamplingParams(), mt.plan(3), [1, 2])
    assert sorted(be.calls) == [(2, 1, 1.0), (2, 2, 0.5)]
    # prompt-major rows: prompt 0 -> j = 0 (T 0.5, first sample), 1 (T 1.0), 2 (T 0.5, second sample)
    assert gen.completion_ids[:, 0].tolist() == [50, 100, 51, 60, 110, 61]
    assert temps.tolist() == [0.5, 1.0, 0.5, 0.5, 1.0, 0.5]
    assert gen.prompt_ids[:, 0].tolist() == [5, 5, 5, 6, 6, 6]


def fake_batch(rewards, groups, comp=None, lens=None, logp=None):
    N = len(rewards)
    comp = torch.tensor(comp) if comp is not None else torch.arange(N * 3).reshape(N, 3) + 10
    T = comp.shape[1]
    lens = torch.tensor(lens) if lens is not None else torch.full((N,), T)
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    r = torch.tensor(rewards).unsqueeze(-1)
    return RolloutBatch(prompt_ids=torch.tensor([[0, 5, 6]] * N), prompt_mask=torch.tensor([[0, 1, 1]] * N),
                        completion_ids=comp, completion_mask=mask, group_ids=torch.tensor(groups),
                        sampler_logprobs=torch.tensor(logp) if logp is not None else -torch.ones(N, T) * mask,
                        truncated=torch.zeros(N, dtype=torch.bool), prompts=["q"] * N,
                        completions=[f"c{i}" for i in range(N)], columns={"answer": [str(i) for i in range(N)]},
                        reward_names=["correct"], rewards=r, reward=r[:, 0], valid=torch.ones(N, dtype=torch.bool))


def fake_ctx(be, G=2):
    return ExpandContext(generate=lambda ids, n, seeds: be.generate(ids, n, SamplingParams(), seeds),
                         decode=lambda ids: "".join("\n" if i == 3 else f"<{i}>" for i in ids), group_size=G, seed=0)


def test_cure_branches_at_the_highest_entropy_token():
    b = fake_batch([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], comp=[[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 0]],
                   lens=[3, 3, 3, 2])
    b.extra["token_entropy"] = torch.tensor([[0.1, 0.9, 2.0], [5.0, 5.0, 5.0], [0.7, 0.2, 9.0], [0.1, 0.2, 0.0]])
    be = FakeBackend()
    out = CureBranching(branches=1, group_size=3).expand(b, fake_ctx(be))
    # first row of each group; the last token is never the branch point: row 0 -> t* = 1, row 2 -> t* = 0
    assert out.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert out.prompt_ids[0].tolist() == [5, 6, 10] and out.prompt_ids[3, -2:].tolist() == [5, 6]
    assert out.completions[0] == "<10>" + "t100" and out.completions[3] == "t110"
    assert out.extra["branch"].all() and out.columns["answer"] == ["0"] * 3 + ["2"] * 3


def test_retry_restarts_at_the_failing_step_and_trains_the_suffix():
    # row 0 failed: tokens 7, '\n', 8, 9 with the most surprising token at 3 -> restart after the newline (t = 2)
    b = fake_batch([0.0, 1.0], [0, 0], comp=[[7, 3, 8, 9], [7, 7, 7, 7]],
                   logp=[[-0.1, -0.1, -0.2, -3.0], [-1.0, -1.0, -1.0, -1.0]])
    be = FakeBackend()
    out = RetryFromFailure(retries=2).expand(b, fake_ctx(be))
    assert out.group_ids.tolist() == [0, 0, 0]  # the failed suffix + 2 retries form one group
    assert out.prompt_ids[0].tolist()[-4:] == [5, 6, 7, 3]  # prompt + shared prefix: no gradient on it
    assert out.completion_ids[0, :2].tolist() == [8, 9] and out.completion_mask[0].tolist()[:2] == [1.0, 1.0]
    assert out.sampler_logprobs[0, :2].tolist() == pytest.approx([-0.2, -3.0])
    assert out.completions[0] == "c0" and out.completions[1] == "<7>\nt100"
    assert RetryFromFailure().expand(fake_batch([1.0, 1.0], [0, 0]), fake_ctx(be)) is None  # nothing failed


class ReflectBackend(FakeBackend):
    """The first call (one sample per failed row) is the reflection: it returns ``replies``; later calls retry."""

    def __init__(self, replies):
        super().__init__()
        self.replies, self.contexts = replies, []

    def generate(self, prompt_ids, n, params, seed):
        self.contexts.append([list(p) for p in prompt_ids])
        gen = super().generate(prompt_ids, n, params, seed)
        if len(self.calls) == 1:
            gen.texts = list(self.replies)
        return gen


def test_retry_reflects_then_retries_from_the_diagnosed_step_with_guidance():
    # row 0 failed: steps [7 '\n'] [8 '\n'] [9 9]; the most surprising token (8) is in step 1
    b = fake_batch([0.0, 1.0], [0, 0], comp=[[7, 3, 8, 3, 9, 9], [7, 7, 7, 7, 7, 7]],
                   logp=[[-0.1, -0.1, -3.0, -0.1, -0.2, -0.2], [-1.0] * 6])
    encoded = []

    def encode(text):
        encoded.append(text)
        return [1000 + len(encoded)]  # one token per encoded text: 1001 the reflection prompt, 1002 the guidance

    be = ReflectBackend(['ok {"retry_from_step": 2, "improvement_suggestion": "check the 9s"}'])
    ctx = fake_ctx(be)
    ctx.encode = encode
    out = RetryFromFailure(retries=2, reflect=True).expand(b, ctx)
    # the reflection read prompt + failed completion + the template listing the numbered steps
    assert be.contexts[0] == [[5, 6, 7, 3, 8, 3, 9, 9, 1001]]
    assert "Step 0: <7>\nStep 1: <8>\nStep 2: <9><9>\n" in encoded[0] and "0 to 2" in encoded[0]
    assert encoded[1] == "\n(Hint from a previous attempt: check the 9s)\n"
    # retries generated from prompt + guidance + the kept steps 0 and 1 ...
    assert be.contexts[1] == [[5, 6, 1002, 7, 3, 8, 3]]
    # ... and trained as continuations of prompt + prefix, without the guidance
    assert out.prompt_ids[1].tolist()[-6:] == [5, 6, 7, 3, 8, 3] and 1002 not in out.prompt_ids.flatten().tolist()
    assert out.completion_ids[0, :2].tolist() == [9, 9]  # the failed suffix from step 2
    assert out.group_ids.tolist() == [0, 0, 0]
    assert out.extra["guided"].tolist() == [False, True, True]
    assert out.extra["retry_step"].tolist() == [2, 2, 2] and out.extra["reflected"].all()
    # a reply without a usable step: the surprisal pivot (step 1, token 2) and no guidance
    be = ReflectBackend(["I am not sure"])
    ctx = fake_ctx(be)
    ctx.encode = lambda text: [1]
    out = RetryFromFailure(retries=2, reflect=True).expand(b, ctx)
    assert be.contexts[1] == [[5, 6, 7, 3]] and out.completion_ids[0, :4].tolist() == [8, 3, 9, 9]
    assert out.extra["retry_step"].tolist() == [-1, -1, -1] and not out.extra["reflected"].any()
    assert "guided" not in out.extra


def test_parse_reflection():
    from postrl.selection.expansions import parse_reflection

    assert parse_reflection('{"retry_from_step": 1, "improvement_suggestion": "x"}', 3) == (1, "x")
    assert parse_reflection('retry_from_step: 2, improvement_suggestion: "y"', 3) == (2, "y")  # not JSON
    assert parse_reflection('{"retry_from_step": 3}', 3) == (None, "")  # out of range
    assert parse_reflection('{"retry_from_step": true}', 3) == (None, "")


def test_stage_checks():
    cfg = load_config(None, ["rollout.group_size=1", "filters=[{name: dynamic_sampling}]"])
    with pytest.raises(ConfigError, match="group_size must be >= 2.*postrl methods dynamic_sampling"):
        Step(cfg)
    # singletons: keep (verl's convention) keeps every group of one: the stage then needs no group (its needs follow
    # its parameters), so it is accepted without a warning
    cfg = load_config(None, ["rollout.group_size=1", "filters=[{name: dynamic_sampling, singletons: keep}]",
                             "advantage.name=reinforce_pp"])
    assert Step(cfg).warnings == []
    assert stages.build("filter", "dynamic_sampling", {"singletons": "keep"}).needs == ()
    assert stages.build("filter", "dynamic_sampling").needs == ("groups",)
    cfg = load_config(None, ["rollout.group_size=1"])
    assert "has no baseline" in Step(cfg).warnings[0]
    assert Step(load_config(None, ["rollout.group_size=1", "advantage.name=reinforce_pp"])).warnings == []
    cfg = load_config(None, ["filters=[{name: insight}, {name: pass_rate_curriculum}]"])
    with pytest.raises(ConfigError, match="at most one prompt selector"):
        Step(cfg)
    with pytest.raises(ConfigError, match="filters.0.max_attempts: 'insight' is a selector stage"):
        load_config(None, ["filters=[{name: insight, max_attempts: 3}]"])
    assert Step(load_config(None, ["filters=[{name: dynamic_sampling}]"])).attempts == 10  # DAPO's default
    assert Step(load_config(None, ["filters=[{name: dynamic_sampling, max_attempts: 2}]"])).attempts == 2


# ----------------------------------------------------------------------------------------------- in the trainer
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nano-filters")
    build_local(path, size="nano", seed=0)
    return path


def small(model_dir, out, *extra):
    return [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
            "rollout.max_new_tokens=3", "rollout.group_size=4", "train.prompts_per_step=8", "train.steps=2",
            "train.save_every=0", "train.eval_size=4", "train.eval_k=1", "optim.lr=1e-3", *extra]


def group_ranges(b: RolloutBatch, col: torch.Tensor) -> list[float]:
    out = []
    for gid in dict.fromkeys(b.group_ids.tolist()):
        v = col[b.group_ids == gid]
        out.append(float(v.max() - v.min()))
    return out


def test_dynamic_sampling_regenerates_until_full(model_dir, tmp_path):
    cfg = load_config(None, small(model_dir, tmp_path / "ds", "rewards=[{name: correct}, {name: filters_coin}]",
                                  "filters=[{name: dynamic_sampling, reward: filters_coin, max_attempts: 10}]"))
    tr = Trainer(cfg, tmp_path / "ds")
    b = tr.batches.rollout(0)
    tr.step.score(b)
    first = group_ranges(b, b.rewards[:, 1])
    assert 0.0 in first  # some groups of the first round carry no signal...
    out = tr.batches.filter(b)
    m = tr.batches.metrics
    assert m["filter/attempts"] >= 2 and m["filter/cap_hit"] == 0.0 and m["filter/target_groups"] == 8
    assert m["filter/dropped_groups"] >= first.count(0.0)
    assert out.num_groups == 8 and len(out) == 32 and out.valid.all()  # ...the batch is full again
    assert min(group_ranges(out, out.raw_rewards[:, 1])) > 0  # every kept group varies in the raw reward


def test_dynamic_sampling_cap_uses_raw_reward_and_warns(model_dir, tmp_path, caplog):
    # the shaped reward (correct + coin) varies, the raw `correct` column is all 0 for an untrained model
    cfg = load_config(None, small(model_dir, tmp_path / "cap", "rewards=[{name: correct}, {name: filters_coin}]",
                                  "filters=[{name: dynamic_sampling, max_attempts: 3}]"))
    tr = Trainer(cfg, tmp_path / "cap")
    b = tr.batches.rollout(0)
    tr.step.score(b)
    assert max(group_ranges(b, b.reward)) > 0  # the shaped reward alone would have kept some groups
    with caplog.at_level(logging.WARNING, logger="postrl.filters"):
        out = tr.batches.filter(b)
    assert "kept 0 of 8 groups after 3 generation rounds (max_attempts=3)" in caplog.text
    m = tr.batches.metrics
    assert m["filter/cap_hit"] == 1.0 and m["filter/attempts"] == 3 and m["filter/padded_groups"] == 8
    assert m["filter/dropped_groups"] == 24
    assert out.num_groups == 8 and len(out) == 32 and not out.valid.any()  # full shape, masked out of the update
    tr.step.advantages(tr.ctx, out)
    assert torch.all(out.advantages == 0)


def test_stateful_filters_and_value_head_resume_exactly(model_dir, tmp_path, monkeypatch):
    extra = ["rewards=[{name: filters_coin}]", "filters=[{name: insight, reward: filters_coin}]",
             "advantage.name=gae", "train.steps=4", "train.save_every=2", "train.prompts_per_step=4"]
    a, b = tmp_path / "a", tmp_path / "b"
    Trainer(load_config(None, small(model_dir, a, *extra)), a).train()
    state = json.loads((a / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert len(state["stages"]["filters"]["0:insight"]["post"]) == 8  # 2 steps x 4 prompts observed
    assert state["stages"]["advantage"]["0:gae"]["head"]["weight"]["shape"] == [1, 64]

    crash_in_step(monkeypatch, small(model_dir, b, *extra), step=2)
    cfg = load_config(None, [], base=__import__("yaml").safe_load((b / "config.yaml").read_text()))
    Trainer(cfg, b, resume=True).train()

    def rows(run):
        # timings vary; the diagnostics' alarm history is theirs to checkpoint
        skip = ("time/", "throughput/", "memory/", "alarms")
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(skip)}
                for x in (run / "metrics.jsonl").read_text().splitlines()]

    # selector posterior and value head (weights + optimizer) restored exactly (json: a NaN-safe comparison)
    assert json.dumps(rows(a)) == json.dumps(rows(b))


def test_rollout_options_train_end_to_end(model_dir, tmp_path):
    out = tmp_path / "opts"
    cfg = load_config(None, small(model_dir, out, "rewards=[{name: correct}, {name: filters_coin}]",
                                  "filters=[{name: pass_rate_curriculum, reward: filters_coin}, "
                                  "{name: multi_temperature, temperatures: [0.7, 1.3]}, {name: cure_branching}, "
                                  "{name: retry_from_failure, reward: filters_coin}, "
                                  "{name: range_filter, reward: filters_coin, low: 0.0, high: 1.0, max_attempts: 2}]",
                                  "advantage.name=rl_zvp"))
    tr = Trainer(cfg, out)
    b = tr.batches.rollout(0)
    assert b.extra["temperature"].tolist()[:4] == pytest.approx([0.7, 1.3, 0.7, 1.3])
    tr.step.score(b)
    n0 = b.num_groups
    f = tr.batches.filter(b)
    assert f.extra["branch"].any() and f.num_groups >= n0  # branched and retried groups were added
    tr.step.advantages(tr.ctx, f)
    assert torch.isfinite(f.advantages).all()
    tr.train()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["pg_loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert all(r["filter/curriculum/tracked"] > 0 for r in rows)


def test_state_changes_once_per_step_under_dynamic_sampling_and_remax(model_dir, tmp_path, monkeypatch):
    """adaptive_length_coef's lambda moves once per step, however many times the step scores: refill rounds of
    dynamic_sampling and remax's greedy baselines call the stage; only the batches that train are observed."""
    from postrl.shaping.length import AdaptiveLengthCoef

    calls, observed, ends = [], [], []
    real_call, real_obs, real_end = AdaptiveLengthCoef.__call__, AdaptiveLengthCoef.observe, AdaptiveLengthCoef.end_step

    def call(self, rewards, reward_names, reward_weights, lengths):
        calls.append(len(rewards))
        return real_call(self, rewards, reward_names, reward_weights, lengths)

    def observe(self, rewards, reward_names):
        observed.append(len(rewards))
        return real_obs(self, rewards, reward_names)

    def end_step(self, step):
        ends.append(self.lam)
        return real_end(self, step)

    monkeypatch.setattr(AdaptiveLengthCoef, "__call__", call)
    monkeypatch.setattr(AdaptiveLengthCoef, "observe", observe)
    monkeypatch.setattr(AdaptiveLengthCoef, "end_step", end_step)
    out = tmp_path / "once"
    cfg = load_config(None, small(model_dir, out, "rewards=[{name: filters_coin}]",
                                  "shaping=[{name: adaptive_length_coef, source: filters_coin, lr: 0.5, "
                                  "target_accuracy: 0.0}, {name: weighted_sum}]",
                                  "filters=[{name: dynamic_sampling, reward: filters_coin, max_attempts: 5}]",
                                  "advantage.name=remax"))
    Trainer(cfg, out).train()
    rounds = [json.loads(x)["filter/attempts"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(ends) == 2  # one state change per step...
    assert max(rounds) >= 2 and len(calls) >= sum(rounds) + 2  # ...for many calls: refills and greedy baselines
    assert len(observed) == sum(rounds) and set(observed) == {32}  # every training round observed, no baseline
    lam = [json.loads(x)["shaping/adaptive_length_coef/lambda"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lam == [0.0, ends[1]] and ends[1] > 0  # the value each step used; moved by the step's accuracy > 0
