"""ToolRL's `tool_call` reward (hand-computed), its reward-scale schedules, gold parsing and the malformed-gold
error; the `tool_calls` task's verifier and noisy teacher."""

from __future__ import annotations

import random

import pytest

from postrl.config import load_config
from postrl.environments.function_calling import ToolCallsTask
from postrl.environments.toolrl import gold_calls, predicted_calls, scales, tool_call
from postrl.errors import ConfigError, DataError
from postrl.rewards import score_batch

GOLD = [{"name": "weather", "arguments": {"city": "paris", "unit": "c"}}]


def tc(name="weather", **kw):
    args = ", ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in kw.items())
    return f"<tool_call>{name}({args})</tool_call>"


def score(completions, gold=GOLD, **params):
    return tool_call(["q"] * len(completions), completions, tool_calls=[gold] * len(completions), **params)


def test_tool_call_reward_hand_computed():
    out = score([
        tc(city="paris", unit="f"),                   # 1
        tc(city="paris", unit="c"),                   # 2 exact
        '<tool_call>weather("paris", "c")</tool_call>',  # 3 positional args bind to the gold's keys in order
        tc("forecast", city="paris", unit="c"),       # 4 wrong tool
        "it is sunny",                                # 5 no call
        "<tool_call>weather(city=paris</tool_call>",  # 6 malformed
        tc(city="paris", unit="c", days=3),           # 7 extra parameter
        '<tool_call>{"name": "weather", "arguments": {"city": "paris", "unit": "c"}}</tool_call>',  # 8 JSON
        '<tool_call>{"name": "weather", "parameters": {"city": "paris", "unit": "c"}}',  # 9 unclosed
    ])
    # S_max = 1 + (1 + 2) = 4; R_correct = 6 S / 4 - 3; R_format in {0, 1}
    # 1: r_name 1, r_param 1 (same keys), r_value 1 (city) -> S = 3 -> 1.5; format 1 -> 2.5
    # 2, 3, 8: exact -> 3 + 1 = 4
    # 4: names differ -> r_name 0, no pair -> S = 0 -> -3; format 1 -> -2
    # 5: no call for a gold call -> format 0; r_name = J([weather], []) = 0 -> -3
    # 6, 9: a block that does not parse / is not closed -> format 0, correctness -3
    # 7: r_param = |{city, unit}| / |{city, unit, days}| = 2/3, r_value 2 -> S = 1 + 8/3 -> 6 (11/3) / 4 - 3 = 2.5; +1
    assert out == pytest.approx([2.5, 4.0, 4.0, -2.0, -3.0, -3.0, 3.5, 4.0, -3.0])


def test_tool_call_two_gold_calls_and_no_call_expected():
    gold = [GOLD[0], {"name": "timer", "arguments": {"minutes": 5}}]
    # pred = [timer(5)]: r_name = J([weather, timer], [timer]) = 1/2; timer pair: 1 + 1 -> S = 2.5,
    # S_max = 1 + 3 + 2 = 6 -> 6 * 2.5 / 6 - 3 = -0.5; format 1 -> 0.5
    assert score([tc("timer", minutes=5)], gold) == pytest.approx([0.5])
    # both, in the other order: greedy per gold call finds each -> S = 1 + 3 + 2 = S_max -> 3 + 1
    assert score([tc("timer", minutes=5) + tc(city="paris", unit="c")], gold) == pytest.approx([4.0])
    # no call expected: a plain answer scores format 1 + correctness 0; a call there loses the format point
    assert score(["sunny", tc(city="x", unit="c")], []) == [1.0, 0.0]
    # think=True: the completion must open with a <think> block
    assert score(["<think>ok</think>" + tc(city="paris", unit="c"), tc(city="paris", unit="c")], think=True) == \
        [4.0, 3.0]


def test_reward_scale_schedules():
    # smooth: ranges move from [-2, 2] to the configured ones over schedule_steps; halfway (75 of 150):
    # format [-2 + 2 * 0.5, 2 - 1 * 0.5] = [-1, 1.5]; correctness [-2 - 0.5, 2 + 0.5] = [-2.5, 2.5]
    assert scales(75, "smooth", (0.0, 1.0), (-3.0, 3.0), 150, 30) == ((-1.0, 1.5), (-2.5, 2.5))
    assert scales(400, "smooth", (0.0, 1.0), (-3.0, 3.0), 150, 30) == ((0.0, 1.0), (-3.0, 3.0))
    # completion 1 above (S / S_max = 3/4) at step 75: 1.5 + (5 * 0.75 - 2.5) = 2.75
    assert tool_call(["q"], [tc(city="paris", unit="f")], {"global_step": 75}, tool_calls=[GOLD],
                     schedule="smooth") == pytest.approx([2.75])
    # two_stage: correctness / 3 before switch_step (1 + (2 * 0.75 - 1) = 1.5), then format / 2 (0.5 + 1.5)
    two = [tool_call(["q"], [tc(city="paris", unit="f")], {"global_step": s}, tool_calls=[GOLD],
                     schedule="two_stage")[0] for s in (10, 30)]
    assert two == pytest.approx([1.5, 2.0])


def test_gold_forms_and_malformed_gold_is_one_line_error_naming_the_row():
    assert gold_calls('[{"name": "weather", "parameters": {"city": "paris", "unit": "c"}}]') == GOLD
    assert gold_calls('weather(city="paris", unit="c")') == GOLD
    assert gold_calls(tc(city="paris", unit="c")) == GOLD
    assert gold_calls("") == [] and gold_calls([]) == []
    calls, error = predicted_calls('x <tool_call>a(1)\nb(k="v")</tool_call>')
    assert [c["name"] for c in calls] == ["a", "b"] and error is None
    bad = [GOLD, '{"name": 3}']
    with pytest.raises(DataError) as e:
        tool_call(["ok", "weather in rome?"], ["", ""], tool_calls=bad)
    msg = str(e.value)
    assert "\n" not in msg and "row 1" in msg and "weather in rome?" in msg and "tool_calls" in msg
    # through the scoring core the data error stops the run (it is not a failure of one completion)
    from postrl.config import RewardSpec

    with pytest.raises(DataError, match="row 1"):
        score_batch(["ok", "weather in rome?"], ["", ""], {"tool_calls": bad, "group_ids": [0, 1]},
                    [RewardSpec(name="tool_call")])
    with pytest.raises(DataError, match="no column 'gold'"):
        tool_call(["q"], [""], tool_calls=[GOLD], gold_column="gold")


def test_config_validates_the_reward_parameters():
    cfg = load_config(None, ["rewards=[{name: tool_call, schedule: smooth}]"])
    assert cfg.rewards[0].params == {"schedule": "smooth"}
    with pytest.raises(ConfigError, match="rewards.0.schedule: expected 'none', 'smooth' or 'two_stage'"):
        load_config(None, ["rewards=[{name: tool_call, schedule: fast}]"])
    with pytest.raises(ConfigError, match="rewards.0.format_range: expected .low, high. with low < high"):
        load_config(None, ["rewards=[{name: tool_call, format_range: [1, 0]}]"])
    with pytest.raises(ConfigError, match="unknown parameter 'gold'"):
        load_config(None, ["rewards=[{name: tool_call, gold: x}]"])


def test_tool_calls_task_teacher_noise_and_verifier():
    rows = [ToolCallsTask(noise=0.5).sample(random.Random(i)) for i in range(400)]
    ok = [ToolCallsTask.verify(r["solution"], r) for r in rows]
    assert 0.4 < sum(ok) / len(ok) < 0.75  # about half the demonstrations are wrong (a mistake can be a no-op)
    clean = [ToolCallsTask(noise=0.0).sample(random.Random(i)) for i in range(50)]
    assert all(ToolCallsTask.verify(r["solution"], r) == 1.0 for r in clean)
    r = clean[0]
    assert tool_call([r["prompt"]], [r["solution"]], tool_calls=[r["tool_calls"]]) == [4.0]
    assert ToolCallsTask.verify("no call", r) == 0.0
