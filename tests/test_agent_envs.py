"""Agent environments and per-turn rewards: the rollout's per-turn records and fault isolation, StepTool's turn
rewards, SCoRe's self-correction episode / bonus / first-attempt KL, UserRL's simulated user (a fake endpoint on
localhost, a callable, a tiny local model) and trajectory scores."""

from __future__ import annotations

import math
import sys
import time

import pytest
import torch

from agent_helpers import ctx_for, scripted
from fake_chat import ChatEndpoint
from postrl import stages
from postrl.environments import Environment, episodes, make
from postrl.environments.calculator import CalculatorEnv
from postrl.environments.reward import environment as env_reward
from postrl.errors import ConfigError
from postrl.models.tiny import build_local, build_tokenizer

TOK = build_tokenizer()


def roll(turns, env, rows=None, G=1, max_turns=3, **kw):
    rows = rows or [{"prompt": "q", "answer": "6"}]
    return episodes.rollout(ctx_for(TOK, scripted(TOK, turns)), rows, G, list(range(len(rows))), env,
                            max_turns=max_turns, max_total_tokens=400,
                            group_ids=torch.arange(len(rows)).repeat_interleave(G), **kw)


# ------------------------------------------------------------------------------------------------ rollout records


def test_per_turn_tool_counters_turn_index_and_texts():
    turns = ['<tool_call>calc("1/0")</tool_call>', '<tool_call>calc("2*3")</tool_call>', "6</s>"]
    b = roll(turns, CalculatorEnv)
    ex = b.extra
    assert ex["turn_tool_calls"][0].tolist() == [1, 1, 0] and ex["turn_tool_errors"][0].tolist() == [1, 0, 0]
    assert ex["turn_malformed_calls"][0].tolist() == [0, 0, 0] and ex["tool_calls"].tolist() == [2]
    assert ex["turn_actions"][0] == turns[:2] + ["6"]
    assert ex["turn_observations"][0][0].startswith("<result>error: ") and ex["turn_observations"][0][1] == \
        "<result>6</result>"
    ti, m = ex["turn_index"][0], b.completion_mask[0]
    ends = ex["turn_ends"][0].tolist()
    # model tokens of turn k carry k, environment tokens and padding -1
    assert ti[: ends[0] + 1].tolist() == [0] * (ends[0] + 1)
    assert set(ti[m == 0].tolist()) == {-1} and ti[ends[2]].item() == 2 and ti[ends[1]].item() == 1
    assert int(ex["episode_length"][0]) == ends[2] + 1


class BadReset(Environment):
    def reset(self, row):
        if row["prompt"] == "bad":
            raise RuntimeError("no such user")
        return row["prompt"]

    def step(self, action):
        return "", 1.0, True, {}


class Garbage(Environment):
    """Per row: a reward that is not a number, an info that is not a dict, a hang, or a fine answer."""

    def reset(self, row):
        self.kind = row["prompt"]
        return row["prompt"]

    def step(self, action):
        if self.kind == "text":
            return "", "great", True, {}
        if self.kind == "info":
            return "", 1.0, True, ["tool_calls"]
        if self.kind == "hang":
            time.sleep(3)
        return "", 1.0, True, {}


def test_reset_failure_garbage_and_hang_end_that_episode_only():
    b = roll(["a</s>"], BadReset, rows=[{"prompt": "bad"}, {"prompt": "fine"}])
    assert b.extra["env_errors"].tolist() == [1, 0] and b.extra["num_turns"].tolist() == [0, 1]
    assert env_reward(None, None, b.columns["env_turn_rewards"]) == [None, 1.0]  # the failed one is excluded
    rows = [{"prompt": p} for p in ("text", "info", "hang", "ok")]
    t0 = time.time()
    b = roll(["a</s>"], Garbage, rows=rows, step_timeout=0.5)
    assert time.time() - t0 < 2.5  # the hung step was abandoned after 0.5 s
    assert b.extra["env_errors"].tolist() == [1, 1, 1, 0]
    assert env_reward(None, None, b.columns["env_turn_rewards"]) == [None, None, None, 1.0]


# ------------------------------------------------------------------------------------------------ StepTool


def steptool_batch():
    # episode 0: turn 0 one call that raised, turn 1 two calls (one ran, one malformed), turn 2 the answer
    # episode 1: turn 0 one call that ran, turn 1 the answer
    return {"reward": torch.tensor([1.0, 0.0]), "turn_ends": torch.tensor([[3, 9, 12], [4, 8, -1]]),
            "turn_tool_calls": torch.tensor([[1, 1, 0], [1, 0, 0]]),
            "turn_tool_errors": torch.tensor([[1, 0, 0], [0, 0, 0]]),
            "turn_malformed_calls": torch.tensor([[0, 1, 0], [0, 0, 0]]), "prompts": ["p0", "p1"],
            "turn_actions": [["a0", "a1", "ans"], ["b0", "ans"]], "turn_observations": [["e", "o", ""], ["o", ""]]}


def judge_mod(tmp_path, monkeypatch, body, name="postrl_test_contrib"):
    """A user's module ``name`` (an import path target) holding ``body``."""
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_steptool_turn_rewards(tmp_path, monkeypatch):
    out = stages.build("shaping", "steptool", {"alpha": 0.5})(steptool_batch())
    # SC = ran / made: episode 0 turn 0: 0/1, turn 1: 1/2; episode 1 turn 0: 1/1; the last turn = the outcome
    r = out["turn_rewards"]
    assert r[0].tolist() == pytest.approx([0.0, 0.25, 1.0]) and r[1, :2].tolist() == pytest.approx([0.5, 0.0])
    assert math.isnan(r[1, 2]) and out["reward"].tolist() == [1.0, 0.0]
    judge_mod(tmp_path, monkeypatch, "def contrib(prompt, actions, observations):\n"
              "    if prompt == 'p1':\n        raise RuntimeError('judge down')\n"
              "    return [0.2 * (k + 1) for k in range(len(actions))]\n")
    out = stages.build("shaping", "steptool", {"alpha": 0.5, "contribution": "postrl_test_contrib:contrib"})(
        steptool_batch())
    # contributions 0.2, 0.4 added on episode 0's first two turns; episode 1's judge failed: its reward is NaN
    assert out["turn_rewards"][0].tolist() == pytest.approx([0.2, 0.65, 1.0])
    assert math.isnan(out["reward"][1]) and out["turn_judge_errors"].tolist() == [0, 1]
    with pytest.raises(ConfigError, match="contribution .* or judge_url, not both"):
        stages.build("shaping", "steptool", {"contribution": "a:b", "judge_url": "http://x"})


def _step_judge(body: dict) -> str:
    text = body["messages"][-1]["content"]
    return "not json" if "Task:\np1" in text else '{"score": 5}' if "Step 1:" in text else '{"score": 10}'


def test_steptool_contribution_from_an_llm_judge_endpoint():
    with ChatEndpoint(_step_judge) as srv:
        out = stages.build("shaping", "steptool", {"alpha": 0.5, "judge_url": srv.url, "judge_timeout": 5.0})(
            steptool_batch())
    # episode 0: judge 5/10 on step 1, 10/10 on step 2 -> (0 + 0.5, 0.25 + 1.0, outcome 1); episode 1's judge
    # answered something that is not JSON: its reward fails, counted
    assert out["turn_rewards"][0].tolist() == pytest.approx([0.5, 1.25, 1.0])
    assert math.isnan(out["reward"][1]) and out["turn_judge_errors"].tolist() == [0, 1]


def test_steptool_turn_rewards_feed_turn_mapo():
    b = steptool_batch()
    out = stages.build("shaping", "steptool", {"alpha": 1.0})(b)
    adv = stages.build("advantage", "turn_mapo", {"scale": "none"})(
        {"turn_rewards": out["turn_rewards"], "turn_ends": b["turn_ends"], "group_ids": torch.tensor([0, 0]),
         "completion_mask": torch.ones(2, 13), "reward": out["reward"]})
    # returns: episode 0 (0 + 0.5 + 1, 0.5 + 1, 1) = (1.5, 1.5, 1); episode 1 (1 + 0, 0); centred per turn cell:
    # turn 0: 1.5 - (1.5 + 1)/2 = 0.25; turn 1: 1.5 - 0.75 = 0.75; turn 2 (alone): 0
    assert adv[0, [0, 5, 12]].tolist() == pytest.approx([0.25, 0.75, 0.0])
    assert adv[1, [0, 5]].tolist() == pytest.approx([-0.25, -0.75])


# ------------------------------------------------------------------------------------------------ SCoRe


def test_self_correct_episode_bonus_and_first_attempt_kl():
    rows = [{"prompt": "2*3=", "answer": "6", "task": "arithmetic"}]
    env = lambda: make("self_correct")  # noqa: E731
    b = roll([["5</s>", "6</s>", "6</s>"], ["6</s>", "6</s>", "7</s>"]], env, rows=rows, G=3, max_turns=2)
    assert b.extra["turn_rewards"].tolist() == [[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
    assert "correct the error" in b.extra["turn_observations"][0][0]
    f = {"turn_rewards": b.extra["turn_rewards"], "turn_ends": b.extra["turn_ends"],
         "env_errors": b.extra["env_errors"]}
    two = stages.build("shaping", "score_bonus", {"stage": "II", "alpha": 2.0})(f)
    # stage II: reward r1 + r2 + alpha (r2 - r1): fix 0 + 1 + 2 = 3; keep 1 + 1 + 0 = 2; break 1 + 0 - 2 = -1
    assert two["reward"].tolist() == [3.0, 2.0, -1.0]
    assert two["turn_rewards"].tolist() == [[0.0, 3.0], [1.0, 1.0], [1.0, -2.0]]
    one = stages.build("shaping", "score_bonus", {"stage": "I"})(f)
    assert one["reward"].tolist() == [1.0, 1.0, 0.0] and one["turn_rewards"][:, 0].tolist() == [0.0] * 3
    f["env_errors"] = torch.tensor([0, 1, 0])
    assert math.isnan(stages.build("shaping", "score_bonus", {})(f)["reward"][1])
    # KL on attempt 1 only (k1 = logp - ref_logp), through the turn_index field the rollout wrote
    ti = b.extra["turn_index"]
    logp, ref = torch.full(ti.shape, -1.0), torch.full(ti.shape, -1.5)
    reg = stages.build("regularizer", "attempt_kl", {"estimator": "k1"})
    R = reg({"logp": logp, "ref_logp": ref, "turn_index": ti})
    assert set(R[ti == 0].tolist()) == {0.5} and set(R[ti != 0].tolist()) == {0.0}
    both = stages.build("regularizer", "attempt_kl", {"attempts": [0, 1], "estimator": "k1"})
    assert both({"logp": logp, "ref_logp": ref, "turn_index": ti})[ti == 1].eq(0.5).all()


def test_self_correct_without_verifier_is_an_environment_error():
    b = roll(["5</s>"], lambda: make("self_correct"), rows=[{"prompt": "hi"}], max_turns=2)
    assert b.extra["env_errors"].tolist() == [1]


# ------------------------------------------------------------------------------------------------ UserRL


def _user_reply(body: dict) -> str | int:
    last = body["messages"][-1]["content"]
    if "SLOW" in last:
        time.sleep(1.0)
    if "HTTP500" in last:
        return 500
    return "" if "EMPTY" in last else "ok thanks ###STOP###" if "bye" in last else "my city is oslo"


@pytest.fixture()
def user_server():
    with ChatEndpoint(_user_reply) as srv:
        yield srv.url, srv


def test_simulated_user_over_a_local_endpoint(user_server):
    url, srv = user_server
    rows = [{"prompt": p, "user_goal": "weather in oslo", "tool_calls": [{"name": "weather",
                                                                          "arguments": {"city": "oslo"}}],
             "task": "tool_calls"} for p in ("what city?", "x")]
    env = lambda: make("simulated_user", {"base_url": url, "timeout": 0.5})  # noqa: E731
    # row 0: asks, the user answers, then the agent calls right (verifier 1: done)
    # row 1: HTTP500 -> a user failure ends the episode (NaN reward, user_errors 1)
    turns = [["which city?", "HTTP500"], ['<tool_call>weather(city="oslo")</tool_call>', "z"]]
    b = roll(turns, env, rows=rows, max_turns=3)
    assert b.extra["num_turns"].tolist() == [2, 1] and b.extra["user_errors"].tolist() == [0, 1]
    assert b.extra["turn_observations"][0][0] == "my city is oslo"
    assert env_reward(None, None, b.columns["env_turn_rewards"]) == [1.0, None]
    req = srv.requests[0]
    assert req["messages"][0]["role"] == "system" and "weather in oslo" in req["messages"][0]["content"]
    assert [m["role"] for m in req["messages"][1:]] == ["assistant", "user"]  # the user's side of the talk
    # a timeout and an empty reply are failures too; the stop marker ends the episode without error
    b = roll([["SLOW", "EMPTY", "bye"]], env, rows=[{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    assert b.extra["user_errors"].tolist() == [1, 1, 0] and b.truncated.tolist() == [False, False, False]
    assert b.extra["turn_observations"][2] == ["ok thanks"]
    with pytest.raises(ConfigError, match="set exactly one of base_url"):
        make("simulated_user", {"base_url": url, "user_fn": "a:b"})


def test_simulated_user_callable_and_tiny_local_model(tmp_path, monkeypatch):
    judge_mod(tmp_path, monkeypatch, "def user(messages, row):\n"
              "    return 42 if 'garbage' in messages[-1]['content'] else 'tell me more'\n", name="postrl_test_user")
    env = lambda: make("simulated_user", {"user_fn": "postrl_test_user:user"})  # noqa: E731
    b = roll([["hello", "garbage"], ["more", "x"]], env, rows=[{"prompt": "a"}, {"prompt": "b"}], max_turns=2)
    assert b.extra["user_errors"].tolist() == [0, 1] and b.extra["turn_observations"][0][0] == "tell me more"
    build_local(tmp_path / "user", size="nano")
    env = lambda: make("simulated_user", {"user_model": str(tmp_path / "user"), "max_tokens": 5})  # noqa: E731
    b = roll(["hello", "x"], env, rows=[{"prompt": "a"}], max_turns=2)
    assert b.extra["user_errors"].tolist() == [0] and b.extra["num_turns"].tolist() == [2]
    assert len(b.extra["turn_observations"][0][0]) > 0  # the tiny model's reply became the next message


def test_trajectory_scores():
    f = {"turn_rewards": torch.tensor([[0.0, 0.5, 1.0], [1.0, float("nan"), float("nan")],
                                       [0.2, float("nan"), float("nan")]]),
         "turn_ends": torch.tensor([[1, 3, 5], [1, -1, -1], [1, 3, -1]]), "env_errors": torch.tensor([0, 0, 0])}
    s = lambda **p: stages.build("shaping", "trajectory_score", p)(f)["reward"].tolist()  # noqa: E731
    assert s(mode="sum")[:2] == pytest.approx([1.5, 1.0])
    assert s(mode="discounted", gamma=0.5)[:2] == pytest.approx([0.0 + 0.25 + 0.25, 1.0])  # 0.5*0.5 + 0.25*1
    assert s(mode="final")[:2] == pytest.approx([1.0, 1.0])
    assert math.isnan(s(mode="sum")[2])  # a turn inside the episode failed (NaN): the episode fails
