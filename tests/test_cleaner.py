"""CLEANER: a corrected tool-call failure is replaced by its correction (shallow or deep, by similarity), the
episode's records follow, and the rewritten tokens are re-scored by the policy (not assumed sampled)."""

from __future__ import annotations

import torch

from agent_helpers import ctx_for, scripted
from postrl.environments import episodes
from postrl.environments.calculator import CalculatorEnv
from postrl.environments.reward import environment as env_reward
from postrl.models.tiny import build_model, build_tokenizer

TOK = build_tokenizer()
MODEL = build_model(TOK, size="nano", seed=0)

FAIL = 'aaaa<tool_call>calc("1/0")</tool_call>'
FIX = 'aaab<tool_call>calc("2*3")</tool_call>'
RESULT = "<result>6</result>"


def roll(turns, similarity=0.8, purify="cleaner"):
    ctx = ctx_for(TOK, scripted(TOK, turns), model=MODEL)
    return episodes.rollout(ctx, [{"prompt": "2*3=", "answer": "6"}], 2, [0], CalculatorEnv, max_turns=4,
                            max_total_tokens=400, group_ids=torch.tensor([0, 0]), purify=purify,
                            purify_similarity=similarity), ctx


def test_deep_substitution_removes_the_failure_and_rescores():
    # episode 0: fail, fix, answer; episode 1: fix, answer, (nothing)
    turns = [[FAIL, FIX], [FIX, "6</s>"], ["6</s>", "x</s>"]]
    raw, _ = roll(turns, purify="none")
    b, ctx = roll(turns)
    assert b.extra["purified"].tolist() == [True, False] and b.extra["purified_turns"].tolist() == [1, 0]
    # "aaaa" vs "aaab": ratio 2 * 3 / 8 = 0.75 < 0.8 -> the whole failed turn is replaced by the correction
    assert b.completions[0] == FIX + RESULT + "6" and b.completions[1] == raw.completions[1]
    assert b.extra["turn_actions"][0] == [FIX, "6"] and b.extra["num_turns"].tolist() == [2, 2]
    assert b.extra["tool_calls"].tolist() == [1, 1] and b.extra["tool_errors"].tolist() == [0, 0]
    assert b.extra["turn_tool_errors"][0].tolist()[:2] == [0, 0]
    assert env_reward(None, None, b.columns["env_turn_rewards"]) == [1.0, 1.0]
    # the purified row holds the same ids as the clean episode 1 of the raw batch (same turns, same results)
    L = int(b.extra["episode_length"][0])
    assert b.completion_ids[0, :L].tolist() == raw.completion_ids[1, :L].tolist()
    assert b.completion_mask[0, :L].tolist() == raw.completion_mask[1, :L].tolist()
    # its sampler log-probs are the policy's, recomputed in the purified context (the scripted sampler said -0.5)
    lp, _ = ctx.logprobs(b.select([0]))
    m = b.completion_mask[0].bool()
    assert torch.allclose(b.sampler_logprobs[0][m], lp[0][m], atol=1e-5)
    assert not torch.allclose(b.sampler_logprobs[0][m], torch.full_like(lp[0][m], -0.5))
    assert (b.sampler_logprobs[0][~m] == 0).all()
    # the untouched episode keeps its sampled log-probs
    assert torch.equal(b.sampler_logprobs[1], raw.sampler_logprobs[1][: b.sampler_logprobs.shape[1]])
    ti, ends = b.extra["turn_index"][0], b.extra["turn_ends"][0].tolist()
    assert ti[ends[0]] == 0 and ti[ends[1]] == 1 and ends[2:] == [-1, -1]


def test_shallow_repair_keeps_the_failed_turns_reasoning():
    turns = [[FAIL, FIX], [FIX, "6</s>"], ["6</s>", "x</s>"]]
    b, _ = roll(turns, similarity=0.5)  # 0.75 >= 0.5: only the call is replaced
    assert b.completions[0] == 'aaaa<tool_call>calc("2*3")</tool_call>' + RESULT + "6"


def test_uncorrected_failures_and_chains():
    # episode 0: two failures then the fix: both removed; episode 1: a failure never corrected (answer next): kept
    turns = [[FAIL, FAIL], [FAIL, "7</s>"], [FIX, "x</s>"], ["6</s>", "x</s>"]]
    b, _ = roll(turns)
    assert b.extra["purified"].tolist() == [True, False] and b.extra["purified_turns"].tolist() == [2, 0]
    assert b.completions[0] == FIX + RESULT + "6"
    assert b.extra["tool_errors"].tolist() == [0, 1]
