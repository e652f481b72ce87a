"""turn_mapo: per-turn returns, cells (group, turn), G-RA gate, token broadcast; hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.advantages.turns import turn_mapo, turn_of_token
from postrl.errors import ConfigError
from postrl.stages import build

# two episodes of one prompt, two turns each; completion: turn 0 = tokens 0-1, observation 2, turn 1 = tokens 3-4
ENDS = torch.tensor([[1, 4], [1, 4]])
MASK = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 0]], dtype=torch.float)
GIDS = torch.tensor([0, 0])


def test_turn_of_token():
    assert turn_of_token(ENDS, 6)[0].tolist() == [0, 0, 1, 1, 1, 1]
    assert turn_of_token(torch.tensor([[2, -1]]), 4)[0].tolist() == [0, 0, 0, 1]


def test_returns_per_turn_cell_centred():
    tr = torch.tensor([[0.5, 0.0], [0.5, 1.0]])
    a = turn_mapo(tr, ENDS, GIDS, MASK, tr.sum(-1), scale="none")
    # G0 = [0.5, 0], G1 = [1.5, 1]; cell turn 0 mean 1.0, turn 1 mean 0.5
    assert a[0].tolist() == [-0.5, -0.5, 0.0, -0.5, -0.5, 0.0]
    assert a[1].tolist() == [0.5, 0.5, 0.0, 0.5, 0.5, 0.0]
    # gamma 0.5: G1 = [0.5 + 0.5, 1] -> turn 0 cell mean (0.5 + 1) / 2
    a = turn_mapo(tr, ENDS, GIDS, MASK, tr.sum(-1), scale="none", gamma=0.5)
    assert a[:, 0].tolist() == [-0.25, 0.25] and a[:, 3].tolist() == [-0.5, 0.5]


def test_gra_gate_drops_immediate_rewards_of_failed_episodes():
    tr = torch.tensor([[0.5, 0.0], [0.5, 1.0]])
    a = turn_mapo(tr, ENDS, GIDS, MASK, tr.sum(-1), scale="none", gate=1.0)
    # episode 0 (R = 0.5 < 1): r' = [0, 0], G0 = [0, 0]; episode 1 keeps [0.5, 1], G1 = [1.5, 1]
    assert a[:, 0].tolist() == [-0.75, 0.75] and a[:, 3].tolist() == [-0.5, 0.5]


def test_group_scale_mix_and_validity():
    tr = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    ends, mask = torch.tensor([[1, 4]] * 3), torch.ones(3, 6)
    a = turn_mapo(tr, ends, torch.tensor([0, 0, 1]), mask, tr.sum(-1))
    s = 1 / math.sqrt(0.5)  # G = 1 and 0 in a cell of two: mean 0.5, unbiased std sqrt(0.5)
    assert a[0, 0].item() == pytest.approx(0.5 * s, abs=1e-5) and a[1, 0].item() == pytest.approx(-0.5 * s, abs=1e-5)
    assert a[2].abs().max().item() == 0.0  # a cell of one episode
    a = turn_mapo(tr, ends, torch.tensor([0, 0, 1]), mask, torch.tensor([1.0, float("nan"), 1.0]), mix=0.0)
    assert a[1].abs().max().item() == 0.0  # a failed reward: excluded and 0
    # batch term over the valid (episode, turn) entries: G = 1, 1, 1, 1 -> 0
    assert a.abs().max().item() == 0.0


def test_registered_and_reads_batch_extra_fields():
    st = build("advantage", "turn_mapo", {"mix": 0.5})
    assert {"turn_rewards", "turn_ends"} <= set(st.reads)
    with pytest.raises(ConfigError, match=r"^advantage.mix: expected a value >= 0 and <= 1, got 2.0$"):
        build("advantage", "turn_mapo", {"mix": 2.0})
