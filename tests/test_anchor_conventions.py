"""Issue 17 section 3: every anchor convention selectable (or gone), checked against the anchor's formula written
out here (verl 0.9.1 core_algos / TRL 1.16 GRPOTrainer) and against hand-computed values."""

import math

import pytest
import torch

from postrl import registry
from postrl.batch import RolloutBatch
from postrl.config import load_config
from postrl.losses import dr_grpo, seq_mean_token_mean, seq_mean_token_sum, token_mean
from postrl.losses.objective import Objective

# ---------------------------------------------------------------------------------------------- empty rows


def _mask_with_empty_row():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2: reward failed
    L = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [7.0, 7.0, 7.0, 7.0]])
    return mask, L


def verl_agg_loss(L, mask, mode, global_batch_size, loss_scale_factor=None):
    """verl 0.9.1 ``agg_loss`` (dp_size 1) with the trainer's ``global_batch_size``."""
    if mode == "seq-mean-token-mean":
        seq = (L * mask).sum(-1) / (mask.sum(-1) + 1e-8)
        return (seq * (mask.sum(-1) > 0)).sum() / global_batch_size
    seq = (L * mask).sum(-1)
    loss = (seq * (mask.sum(-1) > 0)).sum() / global_batch_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor or mask.shape[-1])
    return loss


def test_empty_row_counts_in_every_sequence_average_as_in_verl_and_trl():
    mask, L = _mask_with_empty_row()
    N = 3
    # hand values: the failed row adds 0 and counts
    assert float((seq_mean_token_mean(mask) * L).sum()) == pytest.approx((2.0 + 4.0) / 3)
    assert float((seq_mean_token_sum(mask) * L).sum()) == pytest.approx((6.0 + 4.0) / 3)
    assert float((dr_grpo(mask, max_len=8) * L).sum()) == pytest.approx(10.0 / (3 * 8))
    assert float((token_mean(mask) * L).sum()) == pytest.approx(10.0 / 4)
    # verl trainer: global_batch_size = all rows
    assert float((seq_mean_token_mean(mask) * L).sum()) == pytest.approx(
        float(verl_agg_loss(L, mask, "seq-mean-token-mean", N)))
    assert float((seq_mean_token_sum(mask) * L).sum()) == pytest.approx(
        float(verl_agg_loss(L, mask, "seq-mean-token-sum", N)))
    assert float((dr_grpo(mask, max_len=8) * L).sum()) == pytest.approx(
        float(verl_agg_loss(L, mask, "seq-mean-token-sum-norm", N, 8)))
    # TRL grpo / sapo and dr_grpo
    trl_grpo = ((L * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    trl_dr = (L * mask).sum() / (L.size(0) * 8)
    assert float((registry.get("aggregation", "sequence")(mask) * L).sum()) == pytest.approx(float(trl_grpo))
    assert float((dr_grpo(mask, max_len=8) * L).sum()) == pytest.approx(float(trl_dr))


def test_nonempty_rows_reproduce_verl_agg_loss_without_global_batch_size():
    mask, L = _mask_with_empty_row()
    rows = mask.sum(-1) > 0
    for name, mode in (("seq_mean_token_mean", "seq-mean-token-mean"), ("seq_mean_token_sum", "seq-mean-token-sum"),
                       ("dr_grpo", "seq-mean-token-sum-norm")):
        w = registry.get("aggregation", name)(mask, max_len=4, rows=rows)
        assert float((w * L).sum()) == pytest.approx(float(verl_agg_loss(L, mask, mode, 2, 4)))


def _batch(reward, valid, mask):
    n, t = mask.shape
    return RolloutBatch(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                        completion_ids=torch.ones(n, t, dtype=torch.long), completion_mask=mask,
                        group_ids=torch.zeros(n, dtype=torch.long), sampler_logprobs=torch.zeros(n, t),
                        truncated=torch.zeros(n, dtype=torch.bool), prompts=[""] * n, completions=[""] * n,
                        reward=reward, valid=valid)


def test_objective_counts_failed_rows_but_not_padding():
    """A failed reward (NaN, valid False) counts as a 0 row under loss.agg_rows=all, so it does not rescale the
    other rows' weights; a masked padding copy (valid False, finite reward) never counts; nonempty counts rows
    with a loss token."""
    mask = torch.ones(4, 2)
    batch = _batch(torch.tensor([1.0, 0.0, float("nan"), 1.0]), torch.tensor([True, True, False, False]), mask)
    obj = Objective(load_config(None, ["loss.agg=seq_mean_token_mean"]))
    assert obj.rows(batch).tolist() == [True, True, True, False]
    loss_mask = mask * batch.valid.unsqueeze(-1).float()
    w = obj.weights(loss_mask, obj.rows(batch))
    assert torch.allclose(w.sum(-1), torch.tensor([1 / 3, 1 / 3, 0.0, 0.0]))  # each trained row weighs 1/3
    obj2 = Objective(load_config(None, ["loss.agg=seq_mean_token_mean", "loss.agg_rows=nonempty"]))
    assert obj2.rows(batch).tolist() == [True, True, False, False]
    assert torch.allclose(obj2.weights(loss_mask, obj2.rows(batch)).sum(-1), torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert torch.allclose(obj2.weights(loss_mask).sum(-1), torch.tensor([0.5, 0.5, 0.0, 0.0]))
