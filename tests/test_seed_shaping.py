"""Seed methods of issue 31, section "Shaping and length": thought-level process rewards (TP-GRPO), PSPO-WRS,
GRSP, ThinkDial's budget modes, AutoThink's mode rewards, and token credit by occlusion (the occlusion_credit
advantage): hand-computed values, invariants, state once per step, configuration errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from postrl import registry
from postrl.batch import RolloutBatch
from postrl.config import load_config
from postrl.context import ModelContext
from postrl.errors import ConfigError
from postrl.fields import produce
from postrl.generation import encode_prompt, left_pad
from postrl.shaping.attribution import additive_credit, occlusion_units
from postrl.shaping.length import grsp
from postrl.shaping.modes import autothink, no_thinking, thinkdial_budget
from postrl.shaping.process import ThoughtReward, adjusted_weibull, pspo_wrs, thought_ends
from postrl.stages import Stage, StepEnd, build, call_stage, reads

nan = float("nan")
T = torch.tensor


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (torch.isnan(a) == torch.isnan(b)).all(), (a, b)
    assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=tol), (a, b)


def stepped(stage, *args):
    """One training step of a stateful stage: its call, its observation of the same fields, its end of step."""
    names = reads(stage)
    out = stage(*args)
    call_stage(stage.observe, dict(zip(names, args)), {})
    Stage("shaping", "s", stage, {}, names).end_step(StepEnd())
    return out


def tail_sums(step_rewards):
    """sum_{k >= s} r'_k (the return step_return gives step s), NaN where there is no step."""
    x = torch.nan_to_num(step_rewards.double())
    tail = torch.flip(torch.cumsum(torch.flip(x, [1]), 1), [1])
    return torch.where(torch.isfinite(step_rewards), tail, torch.full_like(tail, nan))


# ------------------------------------------------------------------------------------------------ TP-GRPO
SR = T([[0.9, 0.8, 0.2, 0.7], [0.1, 0.3, nan, nan], [nan, nan, nan, nan], [0.9, nan, nan, nan]])
NAMES = ["prm", "correct"]
R = T([[2.6, 1.0], [0.4, 0.0], [nan, 1.0], [0.9, 1.0]])
GIDS = T([0, 0, 1, 1])


def test_thought_units_merge_contiguous_steps_with_one_verdict():
    verdict, ends = thought_ends(SR, 0.5)
    # row 0: verdicts 1 1 0 1 -> thoughts {0, 1} (ends on 1), {2}, {3}; row 1: 0 0 -> one thought ending on 1
    assert verdict[0].tolist() == [True, True, False, True]
    assert ends.tolist() == [[False, True, True, True], [False, True, False, False], [False] * 4,
                             [True, False, False, False]]


def test_thought_reward_hand_values_and_running_proficiency():
    st = ThoughtReward()  # alpha 1, p = 0.5 before the first step
    out = stepped(st, SR, R, NAMES, GIDS, "prm")
    # p = 0.5: a correct thought earns 1 - p = 0.5, an incorrect one costs p = 0.5, on the thought's last step
    close(out["step_rewards"], [[0.0, 0.5, -0.5, 0.5], [0.0, -0.5, nan, nan], [nan] * 4, [0.5, nan, nan, nan]])
    close(out["rewards"][:, 0], [0.5, -0.5, nan, 0.5])  # the process column: the sum of the thought rewards
    close(out["rewards"][:, 1], R[:, 1])  # the outcome column is left as it is
    # every step of a thought has the same return (what step_return puts on its tokens): steps 0 and 1 of row 0
    tails = tail_sums(out["step_rewards"])
    assert tails[0, 0] == tails[0, 1] == 0.5
    # end of step: 3 of 4 outcomes correct -> p = 0.9 * 0.5 + 0.1 * 0.75 = 0.525
    assert st.p == pytest.approx(0.525)
    again = st(SR, R, NAMES, GIDS, "prm")
    st(SR, R, NAMES, GIDS, "prm")
    assert st.p == pytest.approx(0.525)  # calls read p; only the end of a step moves it
    close(again["step_rewards"][0], [0.0, 0.475, -0.525, 0.475])
    assert st.state_dict() == {"p": pytest.approx(0.525)}


def test_thought_reward_group_proficiency_and_state_once_per_step():
    # group 0 (rows 0, 1): accuracy 1/2; group 1 (rows 2, 3): 2/2 -> a correct thought of row 3 earns 2 (1 - 1) = 0
    st = build("shaping", "thought_reward", {"proficiency": "group", "alpha": 2.0})
    out = st({"step_rewards": SR, "rewards": R, "reward_names": NAMES, "group_ids": GIDS, "step_reward_source": "prm"})
    close(out["step_rewards"], [[0.0, 1.0, -1.0, 1.0], [0.0, -1.0, nan, nan], [nan] * 4, [0.0, nan, nan, nan]])
    close(out["rewards"][:, 0], [1.0, -1.0, nan, 0.0])
    # running: two observed batches then one end of step = their union in one batch
    many, one = build("shaping", "thought_reward", {}), build("shaping", "thought_reward", {})
    f = {"step_rewards": SR, "rewards": R, "reward_names": NAMES, "group_ids": GIDS, "step_reward_source": "prm"}
    g = dict(f, rewards=T([[1.0, 0.0]] * 4))
    for x in (f, g):
        many(x)
        many.observe(x)
    assert many.fn.p == 0.5
    assert many.end_step(StepEnd()) == {"proficiency": 0.5}
    both = dict(f, rewards=torch.cat([f["rewards"], g["rewards"]]))
    one.observe(both)
    one.end_step(StepEnd())
    assert many.fn.p == pytest.approx(one.fn.p) == pytest.approx(0.9 * 0.5 + 0.1 * 3 / 8)
    with pytest.raises(ConfigError, match=r"^shaping.momentum: expected a value >= 0 and < 1, got 1.0$"):
        build("shaping", "thought_reward", {"momentum": 1.0})


# ------------------------------------------------------------------------------------------------ PSPO-WRS
def test_adjusted_weibull_peaks_at_one():
    n = torch.arange(1, 13, dtype=torch.float64)
    w = adjusted_weibull(n, 6.0, 2.0)
    assert float(w[5]) == pytest.approx(1.0) and float(w.max()) == pytest.approx(1.0)
    assert (w[:6].diff() > 0).all() and (w[5:].diff() < 0).all()  # rises to the peak, decays after it
    # k = 2, x = 2 / 4: 0.5 * exp(0.5 * (1 - 0.25))
    assert float(adjusted_weibull(T([2.0]), 4.0, 2.0)) == pytest.approx(0.5 * math.exp(0.375))


def test_pspo_wrs_hand_values():
    sr = T([[0.8, 0.6, 0.4, 1.0], [0.5, 0.5, nan, nan], [nan, nan, nan, nan]])
    r = T([[2.8, 1.0], [1.0, 0.0], [nan, 0.0]])
    w2 = 0.5 * math.exp(0.375)  # w(2) with peak 4, k 2; w(4) = 1
    out = pspo_wrs(sr, r, NAMES, "prm", peak_steps=4.0, shape=2.0)
    # row 0: a = 2.8 / 4 = 0.7, R = 0.7 * 1; step rewards w / n * r_s; row 1: a = 0.5, R = 0.5 * w(2)
    close(out["rewards"][:, 0], [0.7, 0.5 * w2, nan])
    close(out["step_rewards"], [[0.2, 0.15, 0.1, 0.25], [w2 / 4, w2 / 4, nan, nan], [nan] * 4])
    close(torch.nansum(out["step_rewards"], -1)[:2], out["rewards"][:2, 0])  # the steps sum to the column
    # 'fraction': the share of steps >= 0.5: row 0 3/4, row 1 2/2
    frac = pspo_wrs(sr, r, NAMES, "prm", peak_steps=4.0, shape=2.0, accuracy="fraction")
    close(frac["rewards"][:, 0], [0.75, w2, nan])
    close(frac["step_rewards"][0], [0.25, 0.25, 0.0, 0.25])
    # the same accuracy over more steps than the peak earns less
    long = pspo_wrs(T([[0.5] * 8]), T([[4.0]]), ["prm"], "prm", peak_steps=4.0)
    assert float(long["rewards"][0, 0]) < 0.5
    with pytest.raises(ConfigError, match=r"^shaping.shape: expected a value > 1, got 1.0$"):
        build("shaping", "pspo_wrs", {"shape": 1.0})


# ------------------------------------------------------------------------------------------------ GRSP
ENDS = T([[0, 1, 2, -1], [4, 9, -1, -1], [1, -1, -1, -1], [0, 1, 2, 3]])


def test_grsp_hand_values():
    ones = T([[1.0]] * 4)
    out = grsp(ones, ["correct"], T([1.0]), GIDS, ENDS, edges=(2, 4), cluster_weights=(1.0, 0.5, 0.25), coef=1.0,
               eps=0.0)
    assert out["reward_names"] == ["correct", "grsp"]
    # segment lengths: row 0: 1, 1, 1 (cluster 0) -> S = 3; row 1: 5, 5 (cluster 2) -> 0.5; row 2: 2 (<= 2: cluster
    # 0) -> 1; row 3: four of 1 -> 4. Group 0: mean 1.75, unbiased std sqrt(2 * 1.25^2) = 1.7678 -> z = +-0.7071;
    # group 1: mean 2.5, std sqrt(2 * 1.5^2) = 2.1213 -> z = -+0.7071; the column is -z
    s = 1 / math.sqrt(2)
    close(out["rewards"][:, 1], [-s, s, s, -s])
    close(out["rewards"][:, 1].view(2, 2).sum(-1), [0.0, 0.0])  # zero-sum over every group
    # a segment of exactly edges[1] = 4 tokens is in cluster 1; more short segments cost more than fewer long ones
    ends = T([[3, 7, -1], [0, 1, 2]])
    few_long = grsp(T([[1.0]] * 2), ["c"], T([1.0]), T([0, 0]), ends, edges=(2, 4), coef=1.0)
    assert float(few_long["rewards"][0, 1]) > 0 > float(few_long["rewards"][1, 1])  # S = 1.0 vs 3.0


def test_grsp_correct_only_and_config_checks():
    r = T([[1.0], [1.0], [0.0], [nan]])
    out = grsp(r, ["correct"], T([1.0]), GIDS, ENDS, edges=(2, 4), coef=1.0, eps=0.0, source="correct")
    s = 1 / math.sqrt(2)
    # group 0: both correct, as before; group 1: row 2 wrong (0), row 3 failed (NaN), no correct pair
    close(out["rewards"][:, 1], [-s, s, 0.0, nan])
    same = grsp(T([[1.0]] * 2), ["c"], T([1.0]), T([0, 0]), T([[0, 1], [0, 1]]))
    close(same["rewards"][:, 1], [0.0, 0.0])  # equal segment counts: no penalty
    with pytest.raises(ConfigError, match=r"^shaping.cluster_weights: expected 3 weights"):
        build("shaping", "grsp", {"edges": [8, 32], "cluster_weights": [1.0, 0.5]})
    with pytest.raises(ConfigError, match=r"^shaping.edges: expected strictly increasing"):
        build("shaping", "grsp", {"edges": [32, 8], "cluster_weights": [1.0, 0.5, 0.2]})
    assert "step_ends" in build("shaping", "grsp", {}).reads  # (the scorer computes step ends for it)


# ------------------------------------------------------------------------------------------------ ThinkDial
def _dial(lengths, modes, step, max_steps, **kw):
    n = len(lengths)
    return thinkdial_budget(T([[1.0]] * n), ["correct"], T([1.0]), T(lengths), {"mode": modes}, step, max_steps,
                            max_length=100, **kw)


def test_thinkdial_budget_modes_and_two_phases():
    L = [80.0, 60.0, 75.0, 30.0, 20.0, 60.0]
    modes = ["high", "medium", "MEDIUM", "low", "low", "low"]
    # budgets 100 / 50 / 25; phase 2 from step round(0.5 * 10) = 5: -min(1, (L - B)+ / B)
    out = _dial(L, modes, 6, 10)
    assert out["reward_names"] == ["correct", "thinkdial_budget"]
    close(out["rewards"][:, 1], [0.0, -0.2, -0.5, -0.2, 0.0, -1.0])
    close(_dial(L, modes, 4, 10)["rewards"][:, 1], [0.0] * 6)  # phase 1: correctness alone
    close(_dial(L, modes, 4, 10, phase1_penalty=0.5)["rewards"][:, 1], [0.0, -0.1, -0.25, -0.1, 0.0, -0.5])
    close(_dial(L, modes, 6, 10, phase1_steps=7)["rewards"][:, 1], [0.0] * 6)  # an explicit phase-1 length
    close(_dial(L, modes, 6, 0, phase1_steps=3, penalty=2.0)["rewards"][:, 1], [0.0, -0.4, -1.0, -0.4, 0.0, -2.0])
    custom = _dial([30.0], ["fast"], 9, 10, ratios={"fast": 0.2})
    close(custom["rewards"][:, 1], [-0.5])  # budget 20: (30 - 20) / 20


def test_thinkdial_budget_errors_and_config_default():
    with pytest.raises(ValueError, match="row 1 has mode 'turbo'.*expected one of high, medium, low"):
        _dial([10.0, 10.0], ["high", "turbo"], 6, 10)
    with pytest.raises(ValueError, match="set phase1_steps"):
        _dial([10.0], ["high"], 6, 0)
    with pytest.raises(ValueError, match="no 'mode' column"):
        thinkdial_budget(T([[1.0]]), ["correct"], T([1.0]), T([3.0]), {}, 0, 10)
    nan_row = thinkdial_budget(T([[nan]]), ["correct"], T([1.0]), T([300.0]), {"mode": ["low"]}, 9, 10)
    close(nan_row["rewards"][:, 1], [nan])
    cfg = load_config(None, ["shaping=[{name: thinkdial_budget}, {name: weighted_sum}]", "rollout.max_new_tokens=64"])
    assert cfg.shaping[0].params["max_length"] == 64  # the budgets are fractions of rollout.max_new_tokens
    with pytest.raises(ConfigError, match=r"ratios"):
        build("shaping", "thinkdial_budget", {"ratios": {"high": 0.0}})
    st = build("shaping", "thinkdial_budget", {"max_length": 100})
    assert {"step", "max_steps", "columns", "lengths"} <= set(st.reads)


# ------------------------------------------------------------------------------------------------ AutoThink
THINK_OK, NOTHINK = "<think>\nlet me see\n</think> 4", "</think>\n\n4"


def test_no_thinking_mode_from_the_text():
    assert no_thinking("</think>\n\n4") and no_thinking("<think>\n...\n</think>\n\n4") and no_thinking("…</think>x")
    assert not no_thinking(THINK_OK) and not no_thinking("still thinking, never closed")
    assert not no_thinking("... but wait</think> 4")


def test_autothink_base_rewards_and_batch_balance():
    texts = [THINK_OK, "<think>hmm</think> 5", THINK_OK, NOTHINK]
    r = T([[1.0], [0.0], [1.0], [1.0]])
    L, g = T([10.0, 10.0, 10.0, 3.0]), T([0, 0, 0, 0])
    # stage 2 (no balance): think 1 / 0, no-think correct 2
    close(autothink(r, ["correct"], g, L, texts, balance_rate=1.0)["rewards"][:, 0], [1.0, 0.0, 1.0, 2.0])
    # stage 1 (defaults): 3 of 4 think > 0.5 -> lam = min(1, 2 (0.75 - 0.5)) = 0.5; thinking rows move halfway to
    # base - 1: 0.5 * 1 + 0.5 * 0 = 0.5, 0.5 * 0 + 0.5 * -1 = -0.5; no-thinking (share 0.25) unchanged
    close(autothink(r, ["correct"], g, L, texts)["rewards"][:, 0], [0.5, -0.5, 0.5, 2.0])
    # the other way round: 3 of 4 no-thinking; a wrong no-think answer -1 -> 0.5 * -1 + 0.5 * -2 = -1.5
    texts2 = [NOTHINK, NOTHINK, NOTHINK, THINK_OK]
    r2 = T([[1.0], [0.0], [1.0], [1.0]])
    close(autothink(r2, ["correct"], g, L, texts2)["rewards"][:, 0], [1.5, -1.5, 1.5, 1.0])
    close(autothink(T([[nan], [1.0]]), ["correct"], T([0, 0]), T([1.0, 1.0]), [THINK_OK, NOTHINK],
                    balance_rate=1.0)["rewards"][:, 0], [nan, 2.0])


def test_autothink_stage3_length_terms():
    texts = [THINK_OK, THINK_OK, "<think>x</think> 5", NOTHINK]
    r = T([[1.0], [1.0], [0.0], [0.0]])
    L, g = T([10.0, 30.0, 40.0, 20.0]), T([0, 0, 0, 0])
    out = autothink(r, ["correct"], g, L, texts, balance_rate=1.0, length_alpha=0.05, length_beta=0.05)
    # correct rows: lengths 10, 30 -> z = -+0.7071 (unbiased std 14.14); r += exp(-0.05 z) - 1
    # wrong rows: lengths 40, 20 -> z = +-0.7071; r += 1 - exp(-0.05 z): the longer wrong one gains
    a = 0.05 / math.sqrt(2)
    close(out["rewards"][:, 0], [1 + math.exp(a) - 1, 1 + math.exp(-a) - 1, 0 + 1 - math.exp(-a), -1 + 1 - math.exp(a)])
    one = autothink(T([[1.0], [0.0]]), ["correct"], T([0, 0]), T([5.0, 50.0]), [THINK_OK, THINK_OK],
                    balance_rate=1.0, length_alpha=0.05, length_beta=0.05)
    close(one["rewards"][:, 0], [1.0, 0.0])  # one completion per outcome in the group: no length term


# ------------------------------------------------------------------------------------------------ occlusion credit
@pytest.fixture(scope="module")
def tok():
    from postrl.models.tiny import build_tokenizer

    return build_tokenizer()


def _batch(tok, texts, rewards=None, width=6):
    P, pm = left_pad([encode_prompt(tok, "q", "auto") for _ in texts], tok.pad_token_id)
    ids = torch.full((len(texts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(texts), width)
    for i, t in enumerate(texts):
        x = tok(t, add_special_tokens=False)["input_ids"]
        ids[i, :len(x)] = torch.tensor(x)
        mask[i, :len(x)] = 1.0
    b = RolloutBatch(prompt_ids=P, prompt_mask=pm, completion_ids=ids, completion_mask=mask,
                     group_ids=torch.arange(len(texts)), sampler_logprobs=torch.zeros(len(texts), width),
                     truncated=torch.zeros(len(texts), dtype=torch.bool), prompts=["q"] * len(texts),
                     completions=list(texts), extra={"step": 3, "max_steps": 10})
    return b


def score_a(text: str) -> float:
    """1 + the number of 'a' + 2 if 'ab' occurs (an interaction between tokens)."""
    return 1.0 + text.count("a") + 2.0 * ("ab" in text)


def fake_score(seen):
    def score(b):
        seen.append(list(b.completions))
        a = T([t.count("a") for t in b.completions], dtype=torch.float32)
        rest = T([score_a(t) for t in b.completions], dtype=torch.float32) - a
        b.raw_rewards = torch.stack([a, rest], -1)
        b.rewards, b.reward_names = b.raw_rewards.clone(), ["a_count", "rest"]
        b.extra["raw_reward_names"] = ("a_count", "rest")
        b.reward = b.raw_rewards.sum(-1)
    return score


def test_occlusion_units_and_additive_credit():
    assert occlusion_units(5, None, 2) == [(0, 2), (2, 4), (4, 5)]
    assert occlusion_units(5, [2, 4], 1) == [(0, 3), (3, 5)]
    c = additive_credit(5.0, [4.0, 4.0, 3.0], 5.0)  # d = 1, 1, 2; residual (5 - 4) / 3 on each
    assert c == pytest.approx([4 / 3, 4 / 3, 7 / 3]) and sum(c) == pytest.approx(5.0)


def test_occlusion_token_reward_hand_values_and_advantage(tok):
    seen = []
    batch = _batch(tok, ["aab", "ba", "ab"])
    fake_score(seen)(batch)
    batch.reward = batch.reward.clone()
    batch.reward[2] = nan  # a failed reward
    stage = build("advantage", "occlusion_credit", {"whiten": False})
    assert "occlusion_token_reward" in stage.reads and stage.field_params == {}
    ctx = ModelContext(model=None, tokenizer=tok, score=fake_score(seen))
    seen.clear()
    produce(ctx, batch, stage)
    r = batch.extra["occlusion_token_reward"]
    # "aab": R = 5; without a token: "ab" 4, "ab" 4, "aa" 3 -> d = 1, 1, 2; c = d + (5 - 4) / 3 = 4/3, 4/3, 7/3;
    # r = 0.5 c, plus 0.5 * R on the last token
    close(r[0], [2 / 3, 2 / 3, 7 / 6 + 2.5, 0.0, 0.0, 0.0])
    # "ba": R = 2; "a" 2, "b" 1 -> d = 0, 1; c = 0.5, 1.5 -> r = 0.25, 0.75 + 1.0
    close(r[1], [0.25, 1.75, 0.0, 0.0, 0.0, 0.0])
    close(r[2], [nan, nan, 0.0, 0.0, 0.0, 0.0])  # its reward failed
    close(r[:2].sum(-1), batch.reward[:2])  # the token rewards sum to the sequence reward
    # one scoring call with every copy: each row whole, then without each of its units
    assert seen == [["aab", "ab", "ab", "aa", "ba", "a", "b", "ab", "b", "a"]]
    adv = stage(batch)
    # undiscounted returns: G_t = sum_{s >= t} r_s; G_0 = R; the failed row gets 0
    close(adv[0], [5.0, 13 / 3, 11 / 3, 0.0, 0.0, 0.0])
    close(adv[1], [2.0, 1.75, 0.0, 0.0, 0.0, 0.0])
    close(adv[2], [0.0] * 6)


def test_occlusion_by_steps_of_a_raw_column(tok):
    batch = _batch(tok, ["ab;ab", "b;b"])
    fake_score([])(batch)
    stage = build("advantage", "occlusion_credit", {"unit": "step", "delimiter": ";", "beta": 1.0,
                                                    "source": "a_count", "whiten": False})
    produce(ModelContext(model=None, tokenizer=tok, score=fake_score([])), batch, stage)
    r = batch.extra["occlusion_token_reward"]
    # "ab;ab": steps "ab;" (tokens 0-2) and "ab" (3-4); the a-count R = 2; without either step: 1 -> d = 1, 1
    # (no residual) -> c = 1 per step, spread over its tokens (beta 1: nothing on the last token)
    close(r[0], [1 / 3, 1 / 3, 1 / 3, 0.5, 0.5, 0.0])
    close(r[1], [0.0] * 6)  # no 'a': nothing to attribute
    with pytest.raises(ValueError, match="'nope' is not a reward source"):
        b = _batch(tok, ["ab"])
        fake_score([])(b)
        st = build("advantage", "occlusion_credit", {"source": "nope"})
        produce(ModelContext(model=None, tokenizer=tok, score=fake_score([])), b, st)
    with pytest.raises(ConfigError, match=r"^advantage.beta: expected a value >= 0 and <= 1, got 2.0$"):
        build("advantage", "occlusion_credit", {"beta": 2.0}, where="advantage")


@registry.register("reward", "count_a_test", source="test: occlusion through the run's scoring")
def count_a_test(prompts, completions, **kw):
    """1 + the number of 'a' + 2 if 'ab' occurs."""
    return [score_a(c) for c in completions]


def test_occlusion_credit_through_the_runs_step(tok):
    """The producer re-scores the copies with the run's own Step (rewards then shaping), as the trainer's
    ModelContext.score does; the credit sums to the reward the run gave."""
    from postrl.rewards import RewardContext
    from postrl.step import Step

    cfg = load_config(None, ["rewards=[{name: count_a_test}]", "shaping=[{name: weighted_sum}]",
                             "advantage={name: occlusion_credit, whiten: false}"])
    step = Step(cfg, context=RewardContext(tokenizer=tok), tokenizer=tok)
    batch = _batch(tok, ["aab", "ba"])
    step.score(batch)
    close(batch.reward, [5.0, 2.0])
    ctx = ModelContext(model=None, tokenizer=tok, score=lambda b: step.score(b, observe=False))
    adv = step.advantages(ctx, batch)
    close(batch.extra["occlusion_token_reward"][0, :3], [2 / 3, 2 / 3, 7 / 6 + 2.5])
    close(adv[:, 0], [5.0, 2.0])


@registry.register("reward", "steps_verdict_test", source="test: a step's verdict")
def steps_verdict_test(prompts, completions, steps):
    """One score per step: 1.0 for a step with an 'a', else 0.0."""
    return [[1.0 if "a" in x else 0.0 for x in st] for st in steps]


@registry.register("reward", "has_b_test", source="test: an outcome")
def has_b_test(prompts, completions, **kw):
    """1 if the completion holds a 'b'."""
    return [float("b" in c) for c in completions]


def test_stages_in_the_runs_step(tok):
    """Through Step.score: the process reward's step scores and the step ends reach thought_reward and grsp, the
    batch's step and max_steps reach thinkdial_budget, the mode column the rows carry; thought_reward's
    proficiency moves at the end of the step only."""
    from postrl.rewards import RewardContext
    from postrl.step import Step

    cfg = load_config(None, [
        "rewards=[{name: has_b_test, weight: 1.0}, {name: steps_verdict_test, weight: 1.0}]",
        "reward.step_delimiter=';'",
        "shaping=[{name: thought_reward, outcome: has_b_test}, {name: grsp, edges: [2], cluster_weights: [1.0, 0.5],"
        " coef: 1.0}, {name: thinkdial_budget, max_length: 8, source: has_b_test}, {name: weighted_sum}]"])
    step = Step(cfg, context=RewardContext(tokenizer=tok), tokenizer=tok)
    batch = _batch(tok, ["a;a;x", "b;xyz", "ab"], width=6)
    batch.group_ids = T([0, 0, 1])
    batch.columns = {"mode": ["high", "low", "low"]}  # budgets 8, 2 (and 2)
    step.score(batch)
    assert batch.reward_names == ["has_b_test", "steps_verdict_test", "grsp", "thinkdial_budget"]
    # "a;a;x": verdicts 1 1 0 -> thoughts {a;, a;} then {x}: 0.5 on step 1, -0.5 on step 2 (p = 0.5)
    close(batch.step_rewards[0], [0.0, 0.5, -0.5])
    close(batch.step_rewards[1], [0.0, -0.5, nan])  # "b;", "xyz": both 0 -> one wrong thought, ending on "xyz"
    close(batch.rewards[:, 1], [0.0, -0.5, 0.5])
    # grsp: steps of 2, 2, 1 tokens (cluster 0, 0, 0) -> S = 3 vs "b;" 2 + "xyz" 3 (clusters 0, 1) -> S = 1.5
    s = 1 / math.sqrt(2)
    close(batch.rewards[:, 2], [-s, s, 0.0])
    # step 3 of 10: phase 1 (before step 5): no budget penalty yet
    close(batch.rewards[:, 3], [0.0, 0.0, 0.0])
    close(batch.reward, [-s, 1 - 0.5 + s, 1.5])
    out = step.end({}, len(batch))
    assert out["shaping/thought_reward/proficiency"] == 0.5
    assert step.scorer.shaping[0].fn.p == pytest.approx(0.9 * 0.5 + 0.1 * 2 / 3)  # 2 of 3 hold a 'b'
    later = _batch(tok, ["a;a;x", "b;xyz", "ab"], width=6)
    later.group_ids, later.columns, later.extra["step"] = T([0, 0, 1]), {"mode": ["high", "low", "low"]}, 7
    step.score(later, observe=False)
    close(later.rewards[:, 3], [0.0, -1.0, 0.0])  # phase 2: "b;xyz" is 5 tokens for a budget of 2


# ------------------------------------------------------------------------------------------------ registry
def test_every_stage_is_registered_with_its_paper():
    for kind, name in (("shaping", "thought_reward"), ("shaping", "pspo_wrs"), ("shaping", "grsp"),
                       ("shaping", "thinkdial_budget"), ("shaping", "autothink"), ("field", "occlusion_token_reward"),
                       ("advantage", "occlusion_credit")):
        e = registry.entry(kind, name)
        assert e.description and e.source, name
    st = build("shaping", "thought_reward", {"initial_proficiency": 0.3})
    assert json.loads(json.dumps(st.state_dict())) == {"p": 0.3}
