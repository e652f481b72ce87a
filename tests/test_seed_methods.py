"""Seed methods of issue 17 section 4: hand-computed values for each (CANON, GTPO, GRPO-S, BRME, Co-Reward, ...)."""

from __future__ import annotations

import math

import pytest
import torch

from postrl import registry
from postrl.advantages.entropy import canon_entropy, canon_length, grpo_s, gtpo
from postrl.shaping.transforms import ensemble_brme
from postrl.errors import ConfigError
from postrl.stages import build

nan = float("nan")
T = torch.tensor


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (torch.isnan(a) == torch.isnan(b)).all(), (a, b)
    assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=tol), (a, b)


# ------------------------------------------------------------------------------------------------ BRME
def test_ensemble_brme_mixes_mean_and_min():
    r = T([[1.0, 3.0, 1.0], [0.0, nan, 0.0], [2.0, 4.0, 0.0]])
    names, w = ["rm1", "rm2", "correct"], T([1.0, 1.0, 0.5])
    out = ensemble_brme(r, names, w, sources=["rm1", "rm2"], lam=0.25)
    # row 0: 0.25 * 2 + 0.75 * 1 = 1.25; row 2: 0.25 * 3 + 0.75 * 2 = 2.25; a NaN member -> NaN
    close(out["rewards"][:, 0], [1.25, nan, 2.25])
    assert out["reward_names"] == ["ensemble", "correct"]
    close(ensemble_brme(r, names, w, sources=["rm1", "rm2"], lam=1.0)["rewards"][:, 0], [2.0, nan, 3.0])
    close(ensemble_brme(r, names, w, sources=["rm1", "rm2"], lam=0.0)["rewards"][:, 0], [1.0, nan, 2.0])
    with pytest.raises(ConfigError, match=r"^shaping.lam: expected a value >= 0 and <= 1, got 1.5$"):
        build("shaping", "ensemble_brme", {"lam": 1.5})
    assert registry.entry("shaping", "ensemble_brme").source.startswith("Reward-Robust RLHF")


# ------------------------------------------------------------------------------------------------ CANON
def test_canon_length_between_plus_within_half():
    r, g, lengths = T([1.0, 0.0, 0.0, 0.0]), T([0, 0, 0, 0]), T([10.0, 20.0, 30.0, 40.0])
    # halves by mean length 25: low {0, 1} mean reward 0.5, high {2, 3} mean 0
    # row 0: within 0.5 + between 0.5 = 1; row 1: -0.5 + 0.5 = 0; rows 2, 3: 0 + (0 - 0.5) = -0.5
    close(canon_length(r, g, lengths, scale="none"), [1.0, 0.0, -0.5, -0.5])
    # between = 0: plain within-half baseline
    close(canon_length(r, g, lengths, scale="none", between=0.0), [0.5, -0.5, 0.0, 0.0])
    # scale='group': divided by the unbiased std of [1, 0, 0, 0] = 0.5
    close(canon_length(r, g, lengths), [2.0, 0.0, -1.0, -1.0], tol=1e-4)
    # the direction of the metric is not presumed: with the reward on the long side, the long half wins
    close(canon_length(r.flip(0), g, lengths, scale="none"), [-0.5, -0.5, 0.0, 1.0])


def test_canon_equal_metric_is_grpo_and_invalid_rows_are_out():
    r, g = T([1.0, 0.0, 1.0, 5.0, 1.0, 0.0]), T([0, 0, 0, 0, 1, 1])
    lengths = T([7.0, 7.0, 7.0, 7.0, 3.0, 9.0])
    valid = T([True, True, True, False, True, True])
    out = canon_length(r, g, lengths, valid, scale="none")
    # group 0: one half only (all equal lengths) -> r - mean over the valid rows (2/3); row 3 invalid -> 0
    # group 1: halves of one each: within 0, between = own - other = +-1
    close(out, [1 / 3, -2 / 3, 1 / 3, 0.0, 1.0, -1.0])


def test_canon_entropy_splits_by_mean_token_entropy():
    r, g = T([1.0, 1.0, 0.0, 0.0]), T([0, 0, 0, 0])
    mask = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    H = T([[2.0, 4.0], [3.0, 99.0], [0.5, 0.5], [1.0, 2.0]])  # masked 99 ignored: means 3, 3, 0.5, 1.5
    # mean 2: high {0, 1} reward mean 1, low {2, 3} mean 0 -> A = r - other half's mean
    close(canon_entropy(r, g, H, mask, scale="none"), [1.0, 1.0, -1.0, -1.0])
    st = build("advantage", "canon_entropy", {"scale": "none"})
    assert "token_entropy" in st.reads and "groups" in st.needs


# ------------------------------------------------------------------------------------------------ GTPO / GRPO-S
def test_gtpo_token_rewards_weighted_by_entropy():
    r, g = T([1.0, 1.0, 0.0]), T([0, 0, 0])
    mask = torch.ones(3, 2)
    H = T([[1.0, 3.0], [3.0, 1.0], [2.0, 2.0]])
    out = gtpo(r, g, H, mask, alpha=0.1, eps=0.0)
    # positives {0, 1}: mean entropy 2 at both positions -> w = [[0.5, 1.5], [1.5, 0.5]]; negative {2}: w = 1
    rt = T([[1.05, 1.15], [1.15, 1.05], [-0.1, -0.1]], dtype=torch.float64)
    want = (rt - rt.mean()) / rt.flatten().std()
    close(out, want)
    # higher-entropy tokens of a correct completion get more credit
    assert out[0, 1] > out[0, 0] and out[1, 0] > out[1, 1]
    # all-equal rewards: no bonus, advantage 0
    close(gtpo(T([1.0, 1.0]), T([0, 0]), T([[1.0, 5.0], [2.0, 2.0]]), torch.ones(2, 2)), torch.zeros(2, 2))


def test_gtpo_negatives_blame_confident_tokens_and_respects_alive_tokens():
    r, g = T([1.0, 0.0, 0.0]), T([0, 0, 0])
    mask = T([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    H = T([[1.0, 1.0], [1.0, 0.5], [0.25, 7.0]])
    out = gtpo(r, g, H, mask, alpha=1.0, eps=0.0)
    # negatives at t=0: 1/H = [1, 4], mean 2.5 -> w = [0.4, 1.6]; t=1 only row 1 alive -> w = 1
    rt = T([[1.0 + 1.0, 1.0 + 1.0], [-0.4, -1.0], [-1.6, 0.0]], dtype=torch.float64)
    tok = T([2.0, 2.0, -0.4, -1.0, -1.6], dtype=torch.float64)
    want = (rt - tok.mean()) / tok.std() * mask
    close(out, want)
    assert out[2, 1] == 0.0


def test_grpo_s_sequence_bonus():
    r, g = T([1.0, 1.0, 0.0, 0.0]), T([0, 0, 0, 0])
    mask = torch.ones(4, 2)
    H = T([[1.0, 1.0], [3.0, 3.0], [2.0, 2.0], [0.5, 0.5]])
    out = grpo_s(r, g, H, mask, alpha=0.1, eps=0.0)
    # positives Hbar 1, 3 (mean 2): w 0.5, 1.5; negatives 1/Hbar = 0.5, 2 (mean 1.25): w 0.4, 1.6
    shaped = T([1.05, 1.15, -0.04, -0.16], dtype=torch.float64)
    close(out, (shaped - shaped.mean()) / shaped.std())
    assert out[1] > out[0] and out[3] < out[2]


# ------------------------------------------------------------------------------------------------ Co-Reward
def test_co_reward_cross_references_the_paraphrase_majority():
    from postrl.rewards.label_free import co_reward

    comp = [r"\boxed{3}", r"\boxed{3}", r"\boxed{4}",      # question A (group 0): own majority 3
            r"\boxed{4}", r"\boxed{4}", r"\boxed{3}",      # paraphrase A' (group 1): own majority 4
            r"\boxed{7}", "no answer",                    # question B (group 2)
            r"\boxed{7.0}", r"\boxed{8}"]                  # paraphrase B' (group 3)
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    para = ["a"] * 6 + ["b"] * 4
    out = co_reward([""] * 10, comp, groups, para)
    # group 0 is rewarded against A''s majority (4), group 1 against A's (3): the cross reference
    assert out[:6] == [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    # B' votes 7.0 and 8 (tie: first seen, 7 by value); B votes only 7 (no answer does not vote)
    assert out[6:] == [1.0, 0.0, 1.0, 0.0]


def test_co_reward_without_partner_fails_the_group_and_missing_column_is_named():
    from postrl.rewards.label_free import co_reward

    out = co_reward(["", "", ""], [r"\boxed{1}", r"\boxed{1}", r"\boxed{1}"], [0, 1, 2], ["a", "a", "b"])
    assert out[:2] == [1.0, 1.0] and isinstance(out[2], ValueError) and "'b'" in str(out[2])
    with pytest.raises(ValueError, match="neither a 'paraphrase_id' column .* nor a 'paraphrase' column"):
        co_reward(["x"], ["y"], [0])


def test_co_reward_samples_the_paraphrase_when_it_is_not_in_the_batch():
    from postrl.models.tiny import build_tokenizer
    from postrl.rewards.core import RewardContext
    from postrl.rewards.label_free import co_reward

    tok = build_tokenizer()

    class Policy:  # returns, after the prompt, the answers 5, 6, 5 for the n = 3 samples
        def generate(self, input_ids, **kw):
            self.kw = kw
            outs = [tok(a, add_special_tokens=False)["input_ids"] for a in ("5", "6", "5")]
            return torch.cat([input_ids, torch.tensor(outs)], 1)

    ctx = RewardContext(model=Policy(), tokenizer=tok, chat_template="none")
    comp = ["5", "6", "5.0"]
    out = co_reward(["q"] * 3, comp, [0, 0, 0], None, ["q paraphrased"] * 3, ctx, votes=3, max_new_tokens=4,
                    extract="none")
    assert out == [1.0, 0.0, 1.0]  # label = the sampled paraphrase completions' majority, 5
    assert ctx.model.kw["max_new_tokens"] == 4 and ctx.model.kw["do_sample"]
    # in-batch partners take precedence: group 1's partner is group 0 (answers 5, 6, 5 -> 5)
    out = co_reward(["q"] * 4, comp + ["6"], [0, 0, 0, 1], ["a"] * 4, ["p"] * 4, ctx, votes=3, extract="none")
    assert out[3] == 0.0 and out[:3] == [0.0, 1.0, 0.0]  # group 0 against group 1's label 6
    # no partner, no policy: the group fails with the reason
    out = co_reward(["q"], ["5"], [0], None, ["p"], None, extract="none")
    assert isinstance(out[0], ValueError) and "no policy" in str(out[0])


# ------------------------------------------------------------------------------------------------ alarms
def _run(rows, config):
    from postrl.diagnostics.monitors import Watchdog

    w = Watchdog(config)
    return [[a for a in w.step(m)] for m in rows]


def test_teacher_variance_alarm_on_low_within_prompt_variance():
    cfg = {"rewards": [{"name": "model"}], "diagnostics": {"teacher_variance": {"patience": 2}}}
    # within-prompt std 0.3 of a batch std 0.5: fine; 0.02 of 0.5 (4%): the reward scores prompts, not completions
    rows = [{"step": i + 1, "reward/group_std": g, "reward/std": 0.5} for i, g in enumerate([0.3, 0.02, 0.02, 0.3])]
    got = [[a.name for a in s if a.name == "teacher_variance"] for s in _run(rows, cfg)]
    assert got == [[], [], ["teacher_variance"], []]
    # absolute floor: std 0.005 < min_std 0.01 fires even when the batch std is as small
    rows = [{"step": i + 1, "reward/group_std": 0.005, "reward/std": 0.005} for i in range(5)]
    alarms = [a for s in _run(rows, {"rewards": [{"name": "model"}]}) for a in s if a.name == "teacher_variance"]
    assert [a.step for a in alarms] == [5] and "0.005" in alarms[0].message
    # groups whose rewards are all identical are zero_variance_groups' case, not this one
    for m in rows:
        m["zero_variance_groups/frac"] = 0.9
    assert not any(a.name == "teacher_variance" for s in _run(rows, {"rewards": [{"name": "model"}]}) for a in s)


def test_intrinsic_collapse_names_the_collapse_step():
    lf = {"rewards": [{"name": "majority_vote"}]}
    means = [0.5, 0.7, 0.9, 0.97, 0.99]
    stds = [0.4, 0.3, 0.1, 0.04, 0.01]
    rows = [{"step": 10 * (i + 1), "reward/mean": r, "reward/group_std": s}
            for i, (r, s) in enumerate(zip(means, stds))]
    got = _run(rows, lf)
    names = [[a.name for a in s if a.name == "intrinsic_collapse"] for s in got]
    assert names == [[], [], [], ["intrinsic_collapse"], ["intrinsic_collapse"]]
    last = [a for a in got[-1] if a.name == "intrinsic_collapse"][0]
    assert "since step 40, the model collapse step" in last.message
    # a run with a verifiable reward is not label-free: no alarm
    assert not any(a.name == "intrinsic_collapse" for s in _run(rows, {"rewards": [{"name": "correct"}]}) for a in s)
    # ... but a verifier of weight 0 is only logged (the gold column of a label-free run): the run is label-free
    gold = {"rewards": [{"name": "majority_vote"}, {"name": "correct", "weight": 0.0}]}
    assert [[a.name for a in s if a.name == "intrinsic_collapse"] for s in _run(rows, gold)] == names
    trained = {"rewards": [{"name": "majority_vote"}, {"name": "correct", "weight": 0.5}]}
    assert not any(a.name == "intrinsic_collapse" for s in _run(rows, trained) for a in s)


def test_intrinsic_collapse_rise_then_fall_of_accuracy():
    cfg = {"rewards": [{"name": "co_reward"}], "diagnostics": {"intrinsic_collapse": {"window": 2, "max_drop": 0.2}}}
    acc = [0.3, 0.5, 0.6, 0.6, 0.4, 0.3]
    rows = [{"step": i + 1, "reward/mean": 0.5 + 0.05 * i, "reward/group_std": 0.3, "accuracy": a}
            for i, a in enumerate(acc)]
    got = [[a for a in s if a.name == "intrinsic_collapse"] for s in _run(rows, cfg)]
    # window means (end step): 0.4 (2), 0.55 (3), 0.6 (4), 0.5 (5), 0.35 (6): drop 0.25 >= 0.2 at step 6
    assert [len(s) for s in got] == [0, 0, 0, 0, 0, 1]
    assert "0.600 (window mean at step 4" in got[-1][0].message


# ------------------------------------------------------------------------------------------------ teacher variance
def test_teacher_variance_metric_hand_computed():
    from postrl.reward_models.metrics import teacher_variance

    r = [1.0, 3.0, 10.0, 10.0, 10.0, 7.0]
    groups = ["a", "a", "b", "b", "b", "c"]  # c has one completion: left out
    out = teacher_variance(r, groups)
    # a: var 2 (unbiased), b: 0 -> mean 1; within SS 2 of total SS around the mean 6.8 of the five kept entries:
    # (1-6.8)^2 + (3-6.8)^2 + 3 * 3.2^2 = 33.64 + 14.44 + 30.72 = 78.8
    assert out["teacher/prompts"] == 2
    assert math.isclose(out["teacher/variance"], 1.0)
    assert math.isclose(out["teacher/variance_share"], 2.0 / 78.8)
    assert math.isnan(teacher_variance([1.0, 2.0], ["a", "b"])["teacher/variance"])


def test_rm_eval_samples_reports_teacher_variance(tmp_path, capsys):
    import json

    from postrl.cli import main as cli_main
    from postrl.reward_models.backbones import load_backbone
    from postrl.reward_models.metrics import teacher_variance
    from postrl.reward_models.model import RewardModel

    bb, tok = load_backbone("bag:4", seed=0)
    rm = RewardModel(bb, tok, max_length=64, chat_template="none")
    rm.save_pretrained(tmp_path / "rm")
    rows = [{"prompt": p, "completion": c} for p in ("1+1=", "2+2=") for c in ("2", "4", "22 4")]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli_main(["rm", "eval", str(tmp_path / "rm"), "--samples", str(tmp_path / "s.jsonl"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s = rm.score([r["prompt"] for r in rows], [r["completion"] for r in rows])[:, 0]
    want = teacher_variance(s, [r["prompt"] for r in rows])
    assert res["samples"] == 6 and res["teacher/prompts"] == 2
    assert math.isclose(res["teacher/variance"], want["teacher/variance"], rel_tol=1e-5)
    assert res["teacher/variance"] > 0
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    assert cli_main(["rm", "eval", str(tmp_path / "rm"), "--samples", str(tmp_path / "bad.jsonl")]) == 2
    assert "row 0 has no text 'completion'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- RED / attention credit
@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    from postrl.reward_models.backbones import load_backbone
    from postrl.reward_models.model import RewardModel

    bb, tok = load_backbone("tiny:nano", seed=0)
    rm = RewardModel(bb, tok, max_length=128, chat_template="none", seed=3)
    with torch.no_grad():
        rm.heads.bias.fill_(0.25)
    path = tmp_path_factory.mktemp("rm") / "rm"
    rm.save_pretrained(path)
    from postrl.rewards.model import load_cached

    return str(path), load_cached(str(path)), tok


def _batch(tok, prompts, texts, width):
    from postrl.batch import RolloutBatch

    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width)
    for i, t in enumerate(texts):
        x = tok(t, add_special_tokens=False)["input_ids"]
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1.0
    n = len(texts)
    return RolloutBatch(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1),
                        completion_ids=ids, completion_mask=mask, group_ids=torch.arange(n),
                        sampler_logprobs=torch.zeros(n, width), truncated=torch.zeros(n, dtype=torch.bool),
                        prompts=list(prompts), completions=list(texts))


def test_red_token_rewards_are_prefix_score_differences(tiny_rm):
    from postrl.context import ModelContext
    from postrl.fields import produce

    path, rm, tok = tiny_rm
    prompts, texts = ["1+1=", "3*3="], ["2 is it", "9"]
    batch = _batch(tok, prompts, texts, 8)
    stage = build("advantage", "red", {"reward_model": path, "whiten": False})
    assert "red_token_reward" in stage.reads
    produce(ModelContext(model=None, tokenizer=tok), batch, stage)
    r = batch.extra["red_token_reward"]
    for i, (p, t) in enumerate(zip(prompts, texts)):
        # the tiny tokenizer is one token per character: the prefix o_<=k is t[:k + 1]
        want = [float(rm.score([p], [t[:k + 1]])[0, 0] - rm.score([p], [t[:k]])[0, 0]) for k in range(len(t))]
        close(r[i, :len(t)], want, tol=1e-4)
        assert (r[i, len(t):] == 0).all()
        # telescoping: the token rewards sum to RM(q, o) - RM(q)
        assert math.isclose(float(r[i].sum()), float(rm.score([p], [t])[0, 0] - rm.score([p], [""])[0, 0]),
                            abs_tol=1e-4)
    # the advantage: undiscounted returns G_t = sum_{s >= t} r_s = RM(q, o) - RM(q, o_<t)
    adv = stage(batch)
    G = r.flip(-1).cumsum(-1).flip(-1) * batch.completion_mask
    close(adv, G, tol=1e-5)
    s1 = rm.score([prompts[0]], [texts[0]])[0, 0] - rm.score([prompts[0]], [texts[0][:2]])[0, 0]
    assert math.isclose(float(adv[0, 2]), float(s1), abs_tol=1e-4)
    # whitened (default): zero mean, unit variance over the valid tokens
    w = build("advantage", "red", {"reward_model": path})(batch)
    m = batch.completion_mask.bool()
    assert abs(float(w[m].mean())) < 1e-5 and math.isclose(float(w[m].std()), 1.0, rel_tol=1e-3)


def test_attention_credit_spreads_the_score_by_last_layer_attention(tiny_rm):
    from postrl.context import ModelContext
    from postrl.fields import produce

    path, rm, tok = tiny_rm
    prompts, texts = ["1+1=", "2+5="], ["2 ok", "7"]
    batch = _batch(tok, prompts, texts, 6)
    stage = build("advantage", "attention_credit", {"reward_model": path, "whiten": False})
    produce(ModelContext(model=None, tokenizer=tok), batch, stage)
    r = batch.extra["attention_token_reward"]
    for i, (p, t) in enumerate(zip(prompts, texts)):
        R = float(rm.score([p], [t])[0, 0])
        assert math.isclose(float(r[i].sum()), R, rel_tol=1e-4)  # the whole score is redistributed
        ids = torch.tensor([tok(p + t, add_special_tokens=False)["input_ids"]])
        att = rm.backbone(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True).attentions[-1]
        a = att[0].mean(0)[-1, len(p):].detach()
        close(r[i, :len(t)], R * a / a.sum(), tol=1e-5)
    batch.extra.pop("attention_token_reward")
    sparse = build("advantage", "attention_credit", {"reward_model": path, "beta": 0.0, "whiten": False})
    produce(ModelContext(model=None, tokenizer=tok), batch, sparse)
    r0 = batch.extra["attention_token_reward"]
    assert (r0[0, :3] == 0).all() and math.isclose(float(r0[0, 3]), float(rm.score([prompts[0]], [texts[0]])[0, 0]),
                                                    rel_tol=1e-4)


def test_token_reward_estimators_name_a_missing_or_wrong_reward_model(tiny_rm, tmp_path):
    from postrl.errors import PostrlError

    path, rm, tok = tiny_rm
    with pytest.raises(PostrlError, match="advantage.reward_model: required parameter missing"):
        build("advantage", "red", {})
    from postrl.reward_models.backbones import load_backbone
    from postrl.reward_models.model import RewardModel
    from postrl.rewards.dense import attention_token_rewards

    bb, _ = load_backbone("bag:4")
    RewardModel(bb, tok, max_length=32).save_pretrained(tmp_path / "bag")
    with pytest.raises(PostrlError, match="no attention weights"):
        attention_token_rewards(str(tmp_path / "bag"), ["x"], torch.tensor([[5]]), torch.ones(1, 1), tok)


# ------------------------------------------------------------------------------------------------ end to end
@registry.register("reward", "seed_methods_sevens", source="test: sevens and length")
def _sevens(prompts, completions, **_):
    """Fraction of '7' characters plus 0.1 per character (varies within every group)."""
    return [c.count("7") / max(1, len(c)) + 0.1 * len(c) for c in completions]


@pytest.mark.parametrize("name", ["gtpo", "canon_entropy", "red", "attention_credit"])
def test_trainer_produces_the_fields_and_trains(name, tiny_rm, tmp_path):
    import json

    from postrl.config import load_config
    from postrl.models.tiny import build_local
    from postrl.train.trainer import Trainer

    build_local(tmp_path / "nano", size="nano", seed=0)
    extra = [f"advantage.reward_model={tiny_rm[0]}"] if name in ("red", "attention_credit") else []
    cfg = load_config(None, [f"model.path={tmp_path / 'nano'}", f"output_dir={tmp_path / 'run'}",
                             "task.name=arithmetic", "task.digits=1", "rollout.max_new_tokens=4",
                             "rollout.group_size=4", "rollout.temperature=1.5", "train.prompts_per_step=4",
                             "train.steps=2", "train.eval_size=4", "rewards=[{name: seed_methods_sevens}]",
                             f"advantage.name={name}", *extra])
    Trainer(cfg, cfg.output_dir).train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(r["advantages/std"] > 0 and math.isfinite(r["advantages/abs_mean"]) for r in rows)


class _PieceTokenizer:
    """A policy tokenizer whose tokens are multi-character pieces (id k = PIECES[k]); id 0 is a special token."""

    PIECES = ["<eos>", "2 ", "is", " it", "9"]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))

    def batch_decode(self, seqs, skip_special_tokens=False):
        return [self.decode(s, skip_special_tokens) for s in seqs]


def test_red_and_attention_align_other_tokenizers_by_characters(tiny_rm):
    from postrl.rewards.dense import attention_token_rewards, red_token_rewards

    path, rm, tok = tiny_rm
    pol = _PieceTokenizer()
    ids = torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0]])  # "2 " "is" " it" <eos> ; "9" <eos>
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    prompts = ["1+1=", "3*3="]
    r = red_token_rewards(path, prompts, ids, mask, pol)
    # policy token t covers characters (c_{t-1}, c_t]: the reward model scores the prefixes at those boundaries
    ends = [[0, 2, 4, 7, 7], [0, 1, 1]]
    text = ["2 is it", "9"]
    for i in range(2):
        S = [float(rm.score([prompts[i]], [text[i][:c]])[0, 0]) for c in ends[i]]
        close(r[i, :len(ends[i]) - 1], [b - a for a, b in zip(S, S[1:])], tol=1e-4)
    assert r[0, 3] == 0.0 and r[1, 1] == 0.0  # the special token adds no characters: no reward
    a = attention_token_rewards(path, prompts, ids, mask, pol)
    R = float(rm.score([prompts[0]], [text[0]])[0, 0])
    full = tok(prompts[0] + text[0], add_special_tokens=False)["input_ids"]
    x = torch.tensor([full])
    att = rm.backbone(input_ids=x, attention_mask=torch.ones_like(x), output_attentions=True).attentions[-1]
    w = att[0].mean(0)[-1, len(prompts[0]):].detach()
    w = w / w.sum()  # per character of "2 is it"; a piece gets the attention of its characters
    close(a[0], [R * float(w[0:2].sum()), R * float(w[2:4].sum()), R * float(w[4:7].sum()), 0.0], tol=1e-5)
