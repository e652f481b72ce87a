"""TopoCurate's selector: the error-branch ratio and strategic heterogeneity of a group's episode tree (by hand),
the per-prompt scores it learns once per step, and the selection (unseen first, then the highest)."""

from __future__ import annotations

import math

import pytest
import torch

from postrl import stages
from postrl.environments.topocurate import TopoCurate, action_signature, topology_scores
from postrl.selection.selectors import prompt_key

A, B, C = '<tool_call>f(x=1)</tool_call>', '<tool_call>g(y=2)</tool_call>', "<tool_call>h()</tool_call>"


def test_topology_scores_by_hand():
    paths = [[("A", "err"), ("B", "ok"), ("1", "ok")], [("A", "err"), ("C", "ok"), ("1", "ok")],
             [("B", "ok"), ("1", "ok")], [("B", "ok"), ("2", "ok")]]
    ebr, sh = topology_scores(paths, [True, True, True, False])
    # branch nodes: root {A/err, B/ok}, A/err {B, C}, B/ok {1, 2}: 6 branch edges; error edges: A/err (an error
    # observation) and B/ok -> 2 (no success through it): EBR = 2/6; SH = log 3 / log 4 (3 distinct wins of 4)
    assert ebr == pytest.approx(1 / 3) and sh == pytest.approx(math.log(3) / math.log(4))
    assert topology_scores([[("A", "ok")]] * 4, [True] * 4) == (0.0, 0.0)  # one path: no branch, one strategy
    assert action_signature(' <tool_call>f(x=1)</tool_call>') == action_signature('<tool_call>f( x=1 )</tool_call>')
    assert action_signature("The  Answer") == "answer:the answer"


def batch(prompt="p0"):
    acts = [[A, B, "42"], [A, C, "42"], [B, "42"], [B, "41"]]
    ends = torch.tensor([[1, 3, 5], [1, 3, 5], [1, 3, -1], [1, 3, -1]])
    errs = torch.tensor([[1, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]])
    return {"rewards": torch.tensor([[1.0], [1.0], [1.0], [0.0]]), "reward_names": ["environment"],
            "group_ids": torch.zeros(4, dtype=torch.long), "prompts": [prompt] * 4, "turn_actions": acts,
            "turn_tool_errors": errs, "turn_malformed_calls": torch.zeros(4, 3, dtype=torch.long), "turn_ends": ends}


def test_selector_learns_scores_once_per_step_and_selects():
    sel = stages.build("selector", "topocurate", {"ema": 0.5})
    sel.observe(batch())
    assert sel.fn.score == {}  # nothing changes before the end of the step
    sel.end_step(stages.StepEnd())
    (key, s), = sel.fn.score.items()
    assert s == pytest.approx(1 / 3 + math.log(3) / math.log(4))
    b = batch()
    b["rewards"] = torch.ones(4, 1)  # next step: every episode succeeds
    sel.observe(b)
    sel.end_step(stages.StepEnd())
    # EBR: error edges now only A/err: 1/6; SH: paths (A,B,42) (A,C,42) (B,42) (B,41) all distinct -> 1
    assert sel.fn.score[key] == pytest.approx(0.5 * s + 0.5 * (1 / 6 + 1.0))
    rows = [{"prompt": "low"}, {"prompt": "p0"}, {"prompt": "new"}]
    sel.fn.score[prompt_key("low")] = 0.0
    assert sel.fn.select(rows, 2, seed=0, group_size=4) == [2, 1]  # unseen first, then the highest score
    fresh = TopoCurate()
    fresh.load_state_dict(sel.fn.state_dict())
    assert fresh.score == sel.fn.score
