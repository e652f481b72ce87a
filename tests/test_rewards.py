"""Reward sources: verifiers, label-free and model-based sources, the judge, and fault isolation in score_batch."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from postrl import registry, stages
from postrl.errors import ConfigError, RewardError
from postrl.rewards import RewardContext, score_batch
from postrl.rewards.builtin import exact, extract_answer, format_reward, math_reward, numeric, parse_number
from postrl.rewards.core import group_chunks, run_parallel
from postrl.rewards.judge import judge
from postrl.rewards.label_free import majority_vote, novelty
from postrl.rewards.likelihood import likelihood
from fake_chat import ChatEndpoint

nan = math.nan


def spec(name, **params):
    return SimpleNamespace(name=name, params=params)


def isnan(x):
    return isinstance(x, float) and math.isnan(x)


# ------------------------------------------------------------------------------------------------ verifiers


def test_extract_answer_modes():
    t = "think <answer>41</answer> then \\boxed{\\frac{1}{2}} and 7"
    assert extract_answer(t, "boxed") == "\\frac{1}{2}"
    assert extract_answer(t, "answer_tag") == "41"
    assert extract_answer(t, "last_number") == "7"
    assert extract_answer(t, "auto") == "\\frac{1}{2}"
    assert extract_answer("<answer>3</answer>", "auto") == "3"
    assert extract_answer("plain", "auto") == "plain"
    assert extract_answer("no tag", "answer_tag") is None
    assert extract_answer("\\boxed{a{b}c}", "boxed") == "a{b}c"
    with pytest.raises(ValueError, match="extract"):
        extract_answer("x", "nope")


def test_exact_normalisation():
    comps = ["  Paris. ", "$paris$", "PARIS", "Lyon", "<answer> New   York </answer>"]
    ans = ["paris", "Paris", "paris", "paris", "new york"]
    assert exact(None, comps, answer=ans) == [1.0, 1.0, 1.0, 0.0, 1.0]
    assert exact(None, ["PARIS"], answer=["paris"], case_sensitive=True) == [0.0]
    assert exact(None, ["x"], answer=[None]) == [None]  # missing reference: a failure, not a 0


def test_numeric_tolerance_and_parsing():
    assert parse_number("1,234.5") == 1234.5 and parse_number("3/4") == 0.75 and parse_number("-2e3") == -2000.0
    assert parse_number("no number") is None
    comps = ["the answer is 0.5", "\\boxed{1/2}", "0.5000001", "0.51", "nothing", "1,000"]
    ans = ["1/2", "0.5", "0.5", "0.5", "0.5", "1000"]
    assert numeric(None, comps, answer=ans) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert numeric(None, ["0.51"], answer=["0.5"], abs_tol=0.02) == [1.0]
    assert numeric(None, ["3"], answer=["abc"]) == [None]  # unusable reference


def test_math_verify_equivalence():
    pytest.importorskip("math_verify")
    comps = ["so \\boxed{\\frac{1}{2}}", "the result is $0.5$", "\\boxed{\\frac{1}{3}}", "\\boxed{\\{1,2\\}}",
             "\\boxed{2}"]
    ans = ["1/2", "\\frac12", "1/2", "\\{2,1\\}", "$\\sqrt{4}$"]
    assert math_reward(None, comps, answer=ans) == [1.0, 1.0, 0.0, 1.0, 1.0]
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(None, ["\\boxed{3}"], answer=["3"])))
    t.start(), t.join()  # off the main thread math-verify's signal timeouts must be off, not crash
    assert out == [[1.0]]


def test_math_missing_package_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "math_verify":
            raise ImportError("no")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(Exception, match=r"postrl\[math\]") as e:
        math_reward(None, ["1"], answer=["1"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,score", [
    ("<think>reason</think>\n<answer>4</answer>", 1.0),
    ("  <think>a\nb</think><answer>4</answer>\n", 1.0),  # whitespace around and between is fine
    ("<think>a</think><answer>4</answer><answer>5</answer>", 0.0),  # repeated tag (tag spam)
    ("<think>a</think><answer>4</answer>" * 3, 0.0),  # spam of whole blocks
    ("<think><think>a</think></think><answer>4</answer>", 0.0),  # nesting
    ("<think>a<answer>4</answer></think><answer>4</answer>", 0.0),  # required tag inside a block
    ("<think>a</think><answer>4", 0.0),  # unclosed
    ("Sure! <think>a</think><answer>4</answer>", 0.0),  # text before
    ("<think>a</think> so <answer>4</answer>", 0.0),  # text between
    ("<think>a</think><answer>4</answer> done", 0.0),  # text after
    ("<answer>4</answer><think>a</think>", 0.0),  # wrong order
    ("<think> </think><answer>4</answer>", 0.0),  # empty block
    ("<answer>4</answer>", 0.0),  # missing block
])
def test_strict_tag_format(text, score):
    assert format_reward(None, [text], tags=["think", "answer"]) == [score]


def test_format_regex_default_and_bad_tags():
    assert format_reward(None, [" 12 ", "12a", "-3"]) == [1.0, 0.0, 1.0]
    assert format_reward(None, ["<think> </think><answer>4</answer>"], tags=["think", "answer"],
                         allow_empty=True) == [1.0]
    for params, message in [({"tags": "think"}, "rewards.0.tags: expected a list, got 'think'"),
                            ({"tags": []}, "rewards.0.tags: list should have at least 1 item"),
                            ({"tags": ["think", "a b"]}, "rewards.0.tags.1: expected a tag name"),
                            ({"pattern": "("}, "rewards.0.pattern: expected a valid regular expression"),
                            ({"pattern": 5}, "rewards.0.pattern: expected a string, got 5")]:
        with pytest.raises(ConfigError) as e:
            stages.check_params("reward", "format", params, "rewards.0")
        assert str(e.value).startswith(message), str(e.value)


def test_reasoning_gym_reward_uses_score_answer():
    pytest.importorskip("reasoning_gym")
    from postrl.data import load_source

    src = load_source({"name": "reasoning_gym", "dataset": "basic_arithmetic", "size": 30})
    rows = src.train_rows(0, 2, seed=0)
    fn = registry.get("reward", "reasoning_gym")
    cols = {k: [r[k] for r in rows] for k in ("rg_dataset", "rg_entry", "rg_config")}
    comps = [str(rows[0]["answer"]), "definitely wrong"]
    out = fn(None, comps, **cols)
    assert out[0] == 1.0 and out[1] < 1.0
    tagged = fn(None, [f"<answer>{rows[0]['answer']}</answer>"], **{k: v[:1] for k, v in cols.items()},
                extract="answer_tag")
    assert tagged == [1.0]
    assert fn(None, ["1"], rg_dataset=[None], rg_entry=[None]) == [None]  # row without rg columns: failure


# ------------------------------------------------------------------------------------------------ fault isolation


@registry.register("reward", "t_const", source="test")
def t_const(prompts, completions, **kw):
    return [1.0] * len(completions)


@registry.register("reward", "t_raise", source="test")
def t_raise(prompts, completions, **kw):
    raise RuntimeError("boom\nsecond line")


@registry.register("reward", "t_sleep", source="test")
def t_sleep(prompts, completions, *, seconds: float = 2.0):
    time.sleep(seconds)
    return [1.0] * len(completions)


@registry.register("reward", "t_bad_values", source="test")
def t_bad_values(prompts, completions, **kw):
    return [1.0, None, float("nan"), float("inf"), "x", 0.5][: len(completions)]


@registry.register("reward", "t_short", source="test")
def t_short(prompts, completions, **kw):
    return [1.0]


P = ["p0", "p1", "p2", "p3", "p4", "p5"]
C = ["c0", "c1", "c2", "c3", "c4", "c5"]
COLS = {"group_ids": [0, 0, 1, 1, 2, 2]}


def test_raise_fails_only_that_source():
    out = score_batch(P, C, COLS, [spec("t_const"), spec("t_raise")], workers=2, timeout=5.0)
    assert out.matrix[:, 0].tolist() == [1.0] * 6
    assert torch.isnan(out.matrix[:, 1]).all()
    assert out.failures == {"t_raise": 6} and out.failure_rate("t_raise") == 1.0
    msg = out.first_failure["t_raise"]
    assert "RuntimeError: boom second line" in msg and "'c0'" in msg and "'p0'" in msg and "\n" not in msg


def test_timeout_fails_entries_and_run_moves_on():
    t0 = time.monotonic()
    out = score_batch(P, C, COLS, [spec("t_sleep", seconds=3.0), spec("t_const")], workers=2, timeout=0.3)
    assert time.monotonic() - t0 < 2.0  # abandoned, not awaited
    assert torch.isnan(out.matrix[:, 0]).all() and out.matrix[:, 1].tolist() == [1.0] * 6
    assert out.failures == {"t_sleep": 6} and "timed out after 0.3s" in out.first_failure["t_sleep"]


def test_nan_inf_and_non_numbers_fail_per_entry_none_does_not_apply():
    out = score_batch(P, C, COLS, [spec("t_bad_values")], workers=1, timeout=None)
    col = out.matrix[:, 0].tolist()
    assert col[0] == 1.0 and col[5] == 0.5 and all(math.isnan(x) for x in col[1:5])
    # None (row 1) is TRL's "does not apply": skipped, not a failure; NaN, inf and "x" (rows 2-4) fail
    assert out.failures == {"t_bad_values": 3} and out.skipped[:, 0].tolist() == [False, True] + [False] * 4
    assert out.first_failure["t_bad_values"].startswith("returned nan on completion 'c2'")
    assert out.raised == {}  # none of them raised


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_wrong_count_or_no_list_is_an_error_not_a_failure(chunk_size):
    """A programming error stops the run (even without strict), naming the reward, expected and returned count."""
    with pytest.raises(RewardError) as e:
        score_batch(P, C, COLS, [spec("t_const"), spec("t_short")], workers=2, timeout=5.0, chunk_size=chunk_size)
    n = 2 if chunk_size else 6
    assert str(e.value).startswith(f"reward 't_short' returned 1 values for {n} completions")

    @registry.register("reward", "t_no_return", source="test")
    def t_no_return(prompts, completions):
        [len(c) for c in completions]  # forgot the return

    with pytest.raises(RewardError, match=r"^reward 't_no_return' returned NoneType, expected a list of 6 values"):
        score_batch(P, C, COLS, [spec("t_no_return")])


@pytest.mark.parametrize("name,params,fragment", [
    ("t_raise", {}, "raised RuntimeError: boom second line on completion 'c0' (prompt 'p0')"),
    ("t_sleep", {"seconds": 3.0}, "timed out after 0.2s on completion 'c0'"),
    ("t_bad_values", {}, "returned nan on completion 'c2' (prompt 'p2')"),
    ("t_short", {}, "returned 1 values for 6 completions"),
])
def test_strict_mode_fails_fast_with_one_line(name, params, fragment):
    with pytest.raises(RewardError) as e:
        score_batch(P, C, COLS, [spec(name, **params)], strict=True, workers=2, timeout=0.2)
    msg = str(e.value)
    assert msg.startswith(f"reward '{name}' ") and fragment in msg and "\n" not in msg


def test_sources_run_in_parallel_and_chunks_keep_groups():
    t0 = time.monotonic()
    out = score_batch(P, C, COLS, [spec("t_sleep", seconds=0.4), spec("t_sleep", seconds=0.4)], workers=2,
                      timeout=5.0)
    assert time.monotonic() - t0 < 0.75 and not out.failures  # serial would take 0.8 s
    assert group_chunks(8, [0, 0, 1, 1, 1, 2, 3, 3], 2) == [(0, 2), (2, 5), (5, 8)]  # >= 2 rows, whole groups
    assert group_chunks(4, [0, 0, 1, 1], None) == [(0, 4)]
    res = run_parallel([lambda: 1, lambda: 1 / 0], workers=2, timeout=1.0)
    assert res[0] == ("ok", 1) and res[1][0] == "error" and isinstance(res[1][1], ZeroDivisionError)


async def _async_trl(prompts, completions, **kw):
    await asyncio.sleep(0.05)
    return [len(c) / 10 for c in completions]


def test_async_trl_and_async_verl_rewards():
    registry.register("reward", "t_async_trl", source="test")(_async_trl)

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0.3)  # 6 calls awaited concurrently: well under 6 x 0.3 s
        return {"score": float(solution_str == ground_truth)}

    registry.register("reward", "t_async_verl", source="test")(compute_score)
    cols = {**COLS, "answer": ["c0", "x", "c2", "x", "x", "c5"]}
    t0 = time.monotonic()
    out = score_batch(P, C, cols, [spec("t_async_trl"), spec("t_async_verl")], workers=2, timeout=5.0)
    assert time.monotonic() - t0 < 1.2
    assert out.matrix[:, 0].tolist() == pytest.approx([0.2] * 6)
    assert out.matrix[:, 1].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_process_reward_step_scores():
    @registry.register("reward", "t_prm", source="test")
    def t_prm(prompts, completions, steps):
        return [[0.5] * len(s) if i != 1 else [0.1] for i, s in enumerate(steps)]

    comps = ["a\n\nb\n\nc", "x\n\ny", "one"]
    cols = {"group_ids": [0, 0, 1], "steps": [["a", "b", "c"], ["x", "y"], ["one"]]}
    out = score_batch(["q"] * 3, comps, cols, [spec("t_prm")])
    assert out.step_source == "t_prm"
    assert out.matrix[:, 0].tolist()[0] == 1.5 and isnan(out.matrix[1, 0].item()) and out.matrix[2, 0] == 0.5
    sr = out.step_rewards
    assert sr.shape == (3, 3) and sr[0].tolist() == [0.5] * 3 and sr[2, 0] == 0.5 and torch.isnan(sr[2, 1:]).all()
    assert "returned 1 step scores for 2 steps" in out.first_failure["t_prm"]


def test_context_only_for_rewards_that_declare_it():
    seen = []

    @registry.register("reward", "t_ctx", source="test")
    def t_ctx(prompts, completions, context=None):
        seen.append(context)
        return [1.0] * len(completions)

    ctx = RewardContext(model="m", tokenizer="t")
    score_batch(P, C, COLS, [spec("t_ctx"), spec("t_const")], context=ctx)
    assert seen == [ctx]


# ------------------------------------------------------------------------------------------------ isolating failures

BAD_ROWS = (3, 4, 11)
BAD_C = [f"bad{i}" if i in BAD_ROWS else f"c{i}" for i in range(16)]
BAD_P = [f"p{i}" for i in range(16)]
BAD_COLS = {"group_ids": [i // 2 for i in range(16)]}  # groups of 2 rows


def _raising_on_bad(calls: list):
    """A TRL-style batch function that raises when any of its completions contains 'bad' (else row i -> i)."""
    def fn(prompts, completions, **kw):
        calls.append(len(completions))
        if any("bad" in c for c in completions):
            raise ValueError("cannot parse " + next(c for c in completions if "bad" in c))
        return [float(c[1:]) for c in completions]
    return fn


@pytest.mark.parametrize("chunk_size,extra", [
    # whole batch: [0,16) -> 2 halves; both raise -> 4 quarters; [12,16) passes, 3 raise -> 6 pairs; [2,4), [4,6),
    # [10,12) raise -> 6 single rows: 2 + 4 + 6 + 6 = 18 extra calls (bound 2 f log2 n = 24)
    (None, 18),
    # chunks [0,4) [4,8) [8,12) [12,16): each of the first three -> 2 pairs -> 2 rows: 3 x 4 = 12 extra calls
    (4, 12),
])
def test_batch_reward_raising_on_some_rows_fails_only_those_rows(chunk_size, extra):
    calls = []
    out = score_batch(BAD_P, BAD_C, BAD_COLS, [spec("t_bad_rows"), spec("t_const")],
                      built=[(_raising_on_bad(calls), {}), (registry.get("reward", "t_const"), {})],
                      chunk_size=chunk_size, workers=3, timeout=5.0)
    col = out.matrix[:, 0].tolist()
    assert [i for i, v in enumerate(col) if math.isnan(v)] == list(BAD_ROWS)
    assert [v for i, v in enumerate(col) if i not in BAD_ROWS] == [float(i) for i in range(16) if i not in BAD_ROWS]
    assert out.matrix[:, 1].tolist() == [1.0] * 16
    assert out.failures == {"t_bad_rows": 3} and out.failure_rate("t_bad_rows") == 3 / 16
    assert out.first_failure["t_bad_rows"] == "raised ValueError: cannot parse bad3 on completion 'bad3' (prompt 'p3')"
    first_calls = 16 // (chunk_size or 16)
    assert out.isolation_calls == {"t_bad_rows": extra} and len(calls) == first_calls + extra


def test_group_aware_reward_is_isolated_by_whole_groups():
    seen = []

    def grouped(prompts, completions, group_ids):
        seen.append(list(group_ids))
        if any("bad" in c for c in completions):
            raise ValueError("bad group")
        return [1.0] * len(completions)

    out = score_batch(BAD_P, BAD_C, BAD_COLS, [spec("t_grouped")], built=[(grouped, {})])
    col = out.matrix[:, 0].tolist()
    assert [i for i, v in enumerate(col) if math.isnan(v)] == [2, 3, 4, 5, 10, 11]  # the groups of rows 3, 4, 11
    assert out.failures == {"t_grouped": 6}
    assert all(ids.count(g) == 2 for ids in seen for g in ids)  # every call saw whole groups


def test_isolation_stops_at_its_call_budget_and_strict_names_the_raising_input():
    calls = []
    out = score_batch(BAD_P, BAD_C, BAD_COLS, [spec("t_bad_rows")], built=[(_raising_on_bad(calls), {})],
                      isolate_calls=6)
    # halves (2 calls), quarters (4 more = 6): [0,4), [4,8), [8,12) raise and are not split further, [12,16) passes
    col = out.matrix[:, 0].tolist()
    assert [i for i, v in enumerate(col) if math.isnan(v)] == list(range(12)) and col[12:] == [12.0, 13.0, 14.0, 15.0]
    assert out.failures == {"t_bad_rows": 12} and len(calls) == 7
    assert "(not isolated further: 6 extra calls this step)" in out.first_failure["t_bad_rows"]
    with pytest.raises(RewardError, match=r"^reward 't_bad_rows' raised ValueError: cannot parse bad3 on completion "
                                          r"'bad3' \(prompt 'p3'\)$"):
        score_batch(BAD_P, BAD_C, BAD_COLS, [spec("t_bad_rows")], built=[(_raising_on_bad([]), {})], strict=True)


def _verl_sync(data_source, solution_str, ground_truth, extra_info=None):
    if "bad" in solution_str:
        raise KeyError("no answer in " + solution_str)
    return {"score": float(solution_str == ground_truth)}


async def _verl_async(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return _verl_sync(data_source, solution_str, ground_truth, extra_info)


@pytest.mark.parametrize("fn", [_verl_sync, _verl_async])
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_verl_reward_raising_on_30_percent_fails_exactly_those_rows(fn, chunk_size):
    bad = {1, 4, 7, 10, 13, 16}  # 6 of 20 rows
    comps = [f"bad{i}" if i in bad else f"c{i}" for i in range(20)]
    cols = {"group_ids": [i // 2 for i in range(20)], "answer": [f"c{i}" if i % 3 else "x" for i in range(20)]}
    out = score_batch([f"p{i}" for i in range(20)], comps, cols, [spec("t_verl")], built=[(fn, {})],
                      chunk_size=chunk_size, workers=2, timeout=5.0)
    col = out.matrix[:, 0].tolist()
    assert [i for i, v in enumerate(col) if math.isnan(v)] == sorted(bad)
    assert [v for i, v in enumerate(col) if i not in bad] == [float(i % 3 != 0) for i in range(20) if i not in bad]
    assert out.failures == {"t_verl": 6} and out.failure_rate("t_verl") == pytest.approx(0.3)
    assert out.first_failure["t_verl"] == "failed with KeyError: 'no answer in bad1' on completion 'bad1' (prompt 'p1')"
    assert out.isolation_calls == {}  # per-row calls fail alone: nothing to bisect


def test_reward_failing_on_every_row_alarms_at_its_first_step():
    from postrl.config import load_config
    from postrl.diagnostics.monitors import Watchdog

    out = score_batch(P, C, COLS, [spec("t_const"), spec("t_raise")])
    row = {"step": 1, "reward/t_const/failure_rate": out.failure_rate("t_const"),
           "reward/t_raise/failure_rate": out.failure_rate("t_raise"),
           "reward/t_raise/first_failure": out.first_failure["t_raise"]}
    cfg = load_config(None, []).model_dump(mode="json")
    alarms = [a for a in Watchdog(cfg).step(row) if a.name == "reward_all_failed"]
    assert len(alarms) == 1 and alarms[0].severity == "error" and alarms[0].step == 1
    msg = alarms[0].message
    assert msg.startswith("reward 't_raise' failed on 100% of the completions at step 1 (first failing input: "
                          "raised RuntimeError: boom second line on completion 'c0' (prompt 'p0'))")
    assert "t_const" not in msg
    w = Watchdog(cfg)
    assert not [a for a in w.step({"step": 1, "reward/x/failure_rate": 0.99}) if a.name == "reward_all_failed"]
    assert [a.step for a in w.step({"step": 2, "reward/x/failure_rate": 1.0}) if a.name == "reward_all_failed"] == [2]
    off = load_config(None, ["diagnostics.reward_all_failed.enabled=false"]).model_dump(mode="json")
    assert not [a for a in Watchdog(off).step(row) if a.name == "reward_all_failed"]


def test_completion_ids_and_trainer_state_reach_trl_style_functions():
    named, loose = [], []

    def trl_named(prompts, completions, completion_ids, trainer_state):
        named.append((completion_ids, trainer_state))
        return [float(len(ids)) for ids in completion_ids]

    def trl_kwargs(prompts, completions, **kwargs):
        loose.append(kwargs)
        return [1.0] * len(completions)

    def plain(prompts, completions, answer):  # takes neither: must not receive them
        return [0.5] * len(completions)

    comps = ["1", "2", "3", "4", "5", "x"]
    cols = {**COLS, "answer": ["1", "2", "0", "4", "5", "6"], "task": ["arithmetic"] * 6}
    ids = [[1], [1, 2], [3], [4, 5, 6], [7], [8, 9]]
    state = {"global_step": 3, "epoch": 0.5}
    built = [(trl_named, {}), (trl_kwargs, {}), (plain, {}), (registry.get("reward", "correct"), {}),
             (_verl_sync, {})]
    out = score_batch(P, comps, cols, [spec(n) for n in ("named", "kwargs", "plain", "correct", "verl")], built=built,
                      chunk_size=2, completion_ids=ids, trainer_state=state)
    assert not out.failures, out.first_failure
    assert named == [(ids[0:2], state), (ids[2:4], state), (ids[4:6], state)]  # sliced per chunk, the state whole
    assert [kw["completion_ids"] for kw in loose] == [ids[0:2], ids[2:4], ids[4:6]]
    assert all(kw["trainer_state"] is state and kw["answer"] for kw in loose)
    assert out.matrix.T.tolist() == [[1.0, 2.0, 1.0, 3.0, 1.0, 2.0], [1.0] * 6, [0.5] * 6,
                                     [1.0, 1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="5 completion_ids for 6 completions"):
        score_batch(P, comps, cols, [spec("named")], built=built[:1], completion_ids=ids[:5])


# ------------------------------------------------------------------------------------------------ label-free


def test_majority_vote_ttrl_and_rlccf():
    comps = ["<answer>3</answer>", "<answer>3.0</answer>", "<answer>4</answer>", "no answer",
             "<answer>5</answer>", "<answer>6</answer>"]
    gids = [0, 0, 0, 0, 1, 1]
    assert majority_vote(None, comps, gids) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # tie in group 1: first seen
    # RLCCF: voter A says 7,7,8 (SC 2/3 -> votes 7 with 0.667); voter B says 9,9 (SC 1 -> votes 9 with 1.0)
    comps = ["7", "7", "8", "9", "9"]
    voter = ["A", "A", "A", "B", "B"]
    assert majority_vote(None, comps, [0] * 5, voter, weighting="self_consistency") == [0, 0, 0, 1.0, 1.0]
    assert majority_vote(None, comps, [0] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]  # TTRL: 7 and 9 tie, 7 first
    # documented assumption: without a voter column the group is one voter, and the RLCCF mode equals TTRL
    assert majority_vote(None, comps, [0] * 5, None, weighting="self_consistency") == majority_vote(None, comps, [0] * 5)


def test_novelty_weight_below_majority_keeps_selection_first():
    """EVOL-RL's "majority drives selection" holds for the weighted sum when novelty's weight is below the vote's
    (documented in novelty's docstring); with a larger novelty weight a novel minority answer outranks it."""
    comps = ["so the answer is 3 <answer>3</answer>", "so the answer is 3 <answer>3</answer>",
             "so the answer is 3 <answer>3</answer>", "a different route via squares gives <answer>4</answer>"]
    vote = majority_vote(None, comps, [0] * 4)
    nov = novelty(None, comps, [0] * 4, n=1)
    assert vote == [1.0, 1.0, 1.0, 0.0] and nov[3] > nov[0]

    def total(w_nov):
        return [v + w_nov * u for v, u in zip(vote, nov)]

    assert min(total(0.5)[:3]) > total(0.5)[3]
    assert min(total(2.0)[:3]) < total(2.0)[3]


def test_novelty_ngram_values():
    comps = ["a b c d", "a b c e", "x y z w"]
    # word 3-grams: {abc, bcd}, {abc, bce}, {xyz, yzw}; J(0,1) = 1/3, J(0,2) = J(1,2) = 0
    out = novelty(None, comps, [0, 0, 0], n=3)
    assert out == pytest.approx([1 - (0.5 * (1 / 6) + 0.5 * (1 / 3)), 1 - (0.5 * (1 / 6) + 0.5 * (1 / 3)), 1.0])
    assert novelty(None, ["same", "same", "solo"], [0, 0, 1], n=1) == [0.0, 0.0, 1.0]


# ------------------------------------------------------------------------------------------------ likelihood


def test_likelihood_matches_direct_log_prob():
    from postrl.models.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(tok, size="nano", seed=0).eval()
    ctx = RewardContext(model=model, tokenizer=tok, device="cpu", chat_template="none")
    prompts, comps, ans = ["2+3=", "1+1="], ["think 5 <answer>9</answer>", "ok"], ["5", "2"]
    out = likelihood(prompts, comps, ans, ctx, answer_marker="<answer>")
    # direct: log p("5" | "2+3=" + "think 5 " + "<answer>") from one forward pass
    for i, (p, reasoning) in enumerate([(prompts[0], "think 5 <answer>"), (prompts[1], "ok<answer>")]):
        ids = tok(p, add_special_tokens=True)["input_ids"] + tok(reasoning, add_special_tokens=False)["input_ids"]
        a = tok(ans[i], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids + a])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        direct = sum(float(lp[len(ids) - 1 + j, a[j]]) for j in range(len(a)))
        assert out[i] == pytest.approx(direct, abs=1e-4)
    mean = likelihood(["x="], ["y"], ["12"], ctx, reduce="mean")[0]
    total = likelihood(["x="], ["y"], ["12"], ctx)[0]
    assert mean == pytest.approx(total / 2, abs=1e-5) and total < 0
    assert likelihood(["x="], ["y"], [None], ctx) == [None]


# ------------------------------------------------------------------------------------------------ judge


def _judge_reply(body: dict) -> str | int:
    user = body["messages"][-1]["content"]
    if "SLOW" in user:
        time.sleep(4.0)
    if "HTTP500" in user:
        return 500
    content = {"GOOD": '{"score": 8, "reason": "fine"}', "FENCED": '```json\n{"score": 10}\n```',
               "BADJSON": "I think it deserves a 7", "RANGE": '{"score": 42}', "NOSCORE": '{"grade": 3}'}
    return next((v for k, v in content.items() if k in user), '{"score": 0}')


@pytest.fixture()
def judge_server():
    with ChatEndpoint(_judge_reply) as srv:
        yield srv


def test_judge_against_local_server(judge_server, monkeypatch):
    monkeypatch.setenv("POSTRL_TEST_KEY", "sk-test")
    url = judge_server.url
    comps = ["GOOD", "FENCED", "BADJSON", "RANGE", "NOSCORE", "HTTP500", "SLOW", "meh"]
    registry.register("reward", "t_judge", source="test")(judge)
    out = score_batch(["q"] * 8, comps, {"group_ids": list(range(8)), "answer": ["42"] * 8},
                      [spec("t_judge", base_url=url, timeout=2.0, api_key_env="POSTRL_TEST_KEY")],
                      workers=1, timeout=10.0)
    col = out.matrix[:, 0].tolist()
    assert col[0] == pytest.approx(0.8) and col[1] == 1.0 and col[7] == 0.0
    assert all(math.isnan(x) for x in col[2:7])
    assert out.failures == {"t_judge": 5}
    assert "JudgeError: reply is not JSON" in out.first_failure["t_judge"]
    req = judge_server.requests[0]
    assert req["model"] == "judge" and req["messages"][0]["role"] == "system" and "42" in req["messages"][1]["content"]
    direct = judge(["q"], ["SLOW"], base_url=url, timeout=2.0)  # (a timeout a loaded machine cannot miss)
    assert "failed" in str(direct[0])  # a timeout is an entry failure, not an exception


# ------------------------------------------------------------------------------------------------ config


def test_unknown_reward_lists_valid_and_weight_length_mismatch():
    from postrl.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, ["rewards=[{name: no_such_reward}]"])
    assert "unknown reward 'no_such_reward'" in str(e.value) and "majority_vote" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rewards=[{name: correct}, {name: format}]", "reward.weights=[1.0]"])
    assert "reward.weights has 1 values but rewards lists 2 sources" in str(e.value)
    cfg = load_config(None, ["rewards=[{name: format, tags: [think, answer]}]", "reward.strict=true"])
    assert cfg.reward.strict and cfg.rewards[0].params == {"tags": ["think", "answer"]}
    with pytest.raises(ConfigError, match="unknown parameter 'tag'.*tags"):
        load_config(None, ["rewards=[{name: format, tag: [think]}]"])


def test_reward_threads_are_reused_and_a_hung_call_does_not_block_later_ones():
    from postrl.rewards.core import run_parallel

    used = set()  # the Thread objects that ran a call (kept alive here: distinct objects, even if an OS id recurs)

    def call(v):
        def run():
            used.add(threading.current_thread())
            time.sleep(0.002)  # overlapping calls: each of the 3 needs a thread of its own
            return v
        return run

    for _ in range(20):
        assert run_parallel([call(1), call(2), call(3)], workers=3, timeout=5.0) == [("ok", 1), ("ok", 2), ("ok", 3)]
    assert 3 <= len(used) <= 3 + 2  # reused across the 20 calls (earlier tests may hold a hung one or two), not 60
    release = threading.Event()
    t0 = time.monotonic()
    out = run_parallel([lambda: release.wait(30), lambda: "fast"], workers=2, timeout=0.2)
    assert out == [("timeout", None), ("ok", "fast")] and time.monotonic() - t0 < 5
    # the hung thread is not handed new work: the next calls run on other threads, promptly
    t0 = time.monotonic()
    assert run_parallel([lambda: "a", lambda: "b"], workers=2, timeout=5.0) == [("ok", "a"), ("ok", "b")]
    assert time.monotonic() - t0 < 2
    release.set()
