"""Signal Reshaping for GRPO in Weak-Feedback Agentic Code Repair: step-level process scores outside the group
normalisation (``process_weighted``), failure causes of code-repair attempts and episodes, and the failure-cause-
aware rollout governance (``failure_governance``, ``code_repair``'s ``timeout_retries``)."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.advantages import grpo
from postrl.advantages.process import process_weighted
from postrl.config import load_config
from postrl.environments import episodes
from postrl.environments.code_repair import CodeRepairEnv, failure_cause
from postrl.errors import ConfigError
from postrl.models.tiny import build_tokenizer
from postrl.sandbox import Limits, run
from postrl.selection.filters import failure_governance
from test_multiturn import ctx_for, scripted

A = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO of rewards [1, 0]: +-0.70711


def test_process_weighted_turns_by_hand():
    # two episodes of one prompt, each: turn 0 = tokens 0-1, observation token 2, turn 1 = token 3
    ends = torch.tensor([[1, 3], [1, 3]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]])
    scores = torch.tensor([[0.2, 1.0], [0.0, 0.5]])
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    a = process_weighted(r, g, mask, None, scores, ends)
    # success (A > 0): u = 1 + 0.5 (2 p - 1) = [0.7, 1.5] -> tokens [0.7, 0.7, -, 1.5], mean over trained 0.96667
    w0 = torch.tensor([0.7, 0.7, 0.0, 1.5]) / (2.9 / 3)
    # failure (A < 0): q = 1 - p = [1, 0.5] -> u = [1.5, 1.0] -> [1.5, 1.5, -, 1.0], mean 4/3
    w1 = torch.tensor([1.5, 1.5, 0.0, 1.0]) / (4 / 3)
    assert torch.allclose(a, torch.stack([A * w0, -A * w1]), atol=1e-5)
    # each trajectory's total update is GRPO's; only its distribution over the steps changes
    assert torch.allclose(a.sum(-1), torch.tensor([3 * A, -3 * A]), atol=1e-5)
    # the process scores stay outside the group statistics: the sequence advantage is GRPO's of the outcome alone
    assert torch.allclose((a * mask).sum(-1) / mask.sum(-1), grpo(r, g), atol=1e-5)
    # without normalisation: A u; beta 0: plain GRPO on every trained token
    raw = process_weighted(r, g, mask, None, scores, ends, normalize=False)
    assert torch.allclose(raw, torch.stack([A * torch.tensor([0.7, 0.7, 0, 1.5]), -A * torch.tensor([1.5, 1.5, 0, 1.0])]),
                          atol=1e-5)
    plain = process_weighted(r, g, mask, None, scores, ends, beta=0.0)
    assert torch.allclose(plain, grpo(r, g)[:, None] * mask, atol=1e-6)


def test_process_weighted_steps_of_a_single_completion():
    # PRM step scores of two completions: steps end at tokens 1 and 3
    ends = torch.tensor([[1, 3], [1, 3]])
    sr = torch.tensor([[1.0, 0.0], [0.5, float("nan")]])
    r, g, mask = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 4)
    a = process_weighted(r, g, mask, step_rewards=sr, step_ends=ends, steps="steps")
    # row 0 (A > 0): u = [1.5, 0.5], mean 1 -> [1.5, 1.5, 0.5, 0.5]; row 1: neutral scores (0.5, missing) -> 1
    assert torch.allclose(a, torch.tensor([[1.5, 1.5, 0.5, 0.5], [-1.0, -1.0, -1.0, -1.0]]) * A, atol=1e-5)
    with pytest.raises(ConfigError, match="'turns' reads the episodes' turn_scores"):
        process_weighted(r, g, mask)


def test_failure_governance_by_hand():
    g = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    causes = ["semantic", None, "env_error", "compile", "no_tests", "timeout", "syntax", None]
    valid = torch.tensor([True, True, False, True, True, True, True, True])  # the env error's reward is NaN
    keep = failure_governance(g, causes, valid)
    # group 0: the env error leaves, 2 comparable remain; group 1: 1 comparable left (< 2) -> dropped whole;
    # group 2: a timeout and a syntax error are the policy's failures: all compared
    assert keep.tolist() == [True, True, False, False, False, True, True, True]
    # a stricter policy: a timeout is not comparable either; min_rows 3 drops group 2 then
    assert failure_governance(g, causes, valid, exclude=("env_error", "timeout"), min_rows=2).tolist()[5:] == \
        [False, True, True]
    assert not failure_governance(g, causes, valid, exclude=("env_error", "timeout"), min_rows=3)[5:].any()
    with pytest.raises(ConfigError, match="no failure_cause"):
        failure_governance(g)


def test_failure_governance_needs_an_environment():
    with pytest.raises(ConfigError, match="failure_governance reads the failure causes of multi-turn episodes"):
        load_config(None, ["filters=[{name: failure_governance}]"])
    cfg = load_config(None, ["environment={name: code_repair, max_turns: 2}",
                             "filters=[{name: failure_governance, min_rows: 3, max_attempts: 1}]"])
    assert cfg.filters[0].params["min_rows"] == 3


TESTS = "assert add(1, 2) == 3\nassert add(0, 0) == 0\n"


def test_failure_cause_of_attempts():
    lim = Limits(timeout=10.0)
    cases = {"def add(a, b) return a\n": "syntax", "import no_such_module\ndef add(a, b):\n    return a + b\n": "compile",
             "def add(a, b):\n    return a - b\n": "semantic", "def add(a, b):\n    return a / 0\n": "runtime",
             "def add(a, b):\n    return a + b\n": None}
    for code, cause in cases.items():
        assert failure_cause(run(code, TESTS, limits=lim)) == cause, code
    assert failure_cause(run("def add(a, b):\n    return a + b\n", "", limits=lim)) == "no_tests"


def test_code_repair_gives_process_scores_and_the_episode_its_failure_cause():
    from postrl.rewards.code import reshaped_score

    tok = build_tokenizer()
    buggy, fixed = "def add(a, b):\n    return a - b\n", "def add(a, b):\n    return a + b\n"
    w = dict(w_parse=0.05, w_compile=0.05, w_run=0.1, w_tests=0.75, w_lint=0.05)
    s0 = reshaped_score(run(buggy, TESTS, limits=Limits(timeout=10.0)), buggy, **w)
    rows = [{"prompt": "fix: " + buggy, "tests": TESTS}]
    b = episodes.rollout(ctx_for(tok, scripted(tok, [buggy + "</s>", fixed + "</s>"])), rows, 1, [0],
                         lambda: CodeRepairEnv(timeout=10.0), max_turns=3, max_total_tokens=400,
                         group_ids=torch.tensor([0]), chat_template="none")
    assert b.extra["turn_scores"][0, :2].tolist() == pytest.approx([s0, 1.0])
    assert math.isnan(b.extra["turn_scores"][0, 2]) and b.extra["failure_cause"] == [None]  # solved
    b = episodes.rollout(ctx_for(tok, scripted(tok, [buggy + "</s>", buggy + "</s>"])), rows, 1, [0],
                         lambda: CodeRepairEnv(timeout=10.0), max_turns=2, max_total_tokens=400,
                         group_ids=torch.tensor([0]), chat_template="none")
    assert b.extra["failure_cause"] == ["semantic"]  # compiles, wrong answers, turns used up


def test_code_repair_retries_an_attempt_that_timed_out():
    env = CodeRepairEnv(timeout=0.5, timeout_retries=1)
    env.reset({"prompt": "p", "tests": TESTS})
    obs, reward, done, info = env.step("import time\ntime.sleep(30)\ndef add(a, b):\n    return a + b\n")
    assert info["failure_cause"] == "timeout" and env.runs == 2 and not done  # run again once, timed out again
    env = CodeRepairEnv(timeout=10.0, timeout_retries=3)
    env.reset({"prompt": "p", "tests": TESTS})
    env.step("def add(a, b):\n    return a - b\n")
    assert env.runs == 1  # not a timeout: no retry
