"""Hand-computed values and anchor equivalences for the foundation's stages."""

import math

import pytest
import torch

from postrl import registry
from postrl.groups import group_stats
from postrl.advantages import grpo
from postrl.losses import dr_grpo, kl_k1, kl_k2, kl_k3, ppo_clip, seq_mean_token_mean, seq_mean_token_sum, token_mean
from postrl.stages import call_stage
from postrl.shaping import weighted_sum


def test_weighted_sum_hand_values_and_nan_propagates():
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, float("nan")]])
    out = weighted_sum(r, torch.tensor([1.0, 0.5]))["reward"]
    assert out[:2].tolist() == [1.0, 0.5]
    assert math.isnan(out[2])  # a failed component excludes the row, it is not read as 0


def test_grpo_group_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = grpo(r, g, eps=0.0 + 1e-12)
    s = math.sqrt(1 / 3)  # unbiased std of [1,0,0,1]
    assert torch.allclose(a[:4], torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]), atol=1e-6)
    assert torch.all(a[4:] == 0)  # zero-variance group: no signal


def test_grpo_issue_example_two_rewards_g2():
    # completions (0,0)/(1,0) and (0,0)/(1,1): summed rewards 0/1 and 0/2 -> both +-0.707 under GRPO
    g = torch.tensor([0, 0, 1, 1])
    a = grpo(torch.tensor([0.0, 1.0, 0.0, 2.0]), g)
    assert torch.allclose(a, torch.tensor([-0.70710, 0.70710, -0.70710, 0.70710]), atol=1e-4)


@pytest.mark.parametrize("eps", [1e-6, 1e-4, 1e-9])
def test_grpo_matches_anchor_formula(eps):
    torch.manual_seed(0)
    r = torch.rand(24)
    g = torch.arange(6).repeat_interleave(4)
    a = grpo(r, g, eps=eps)
    rg = r.view(6, 4)
    ref = (rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + eps)  # torch.std is unbiased like verl/TRL
    assert torch.allclose(a, ref.flatten(), atol=1e-6)
    # sums to zero within every group (scale none and group)
    assert torch.allclose(a.view(6, 4).sum(1), torch.zeros(6), atol=1e-5)


def test_grpo_batch_and_none_scale():
    r = torch.tensor([1.0, 0.0, 3.0, 1.0])
    g = torch.tensor([0, 0, 1, 1])
    none = grpo(r, g, scale="none")
    assert none.tolist() == [0.5, -0.5, 1.0, -1.0]
    batch = grpo(r, g, scale="batch", eps=0.0)
    assert torch.allclose(batch, none / r.std(), atol=1e-6)


def test_grpo_excludes_invalid_rows_and_handles_g1():
    r = torch.tensor([1.0, float("nan"), 0.0, 5.0])
    g = torch.tensor([0, 0, 0, 1])
    a = grpo(r, g)
    assert a[1] == 0 and a[3] == 0  # invalid row and singleton group
    assert torch.allclose(a[[0, 2]], torch.tensor([0.70710, -0.70710]), atol=1e-4)  # stats over the 2 valid rows
    mean, std, cnt = group_stats(r, g, torch.isfinite(r))
    assert cnt.tolist() == [2, 2, 2, 1] and mean[0] == 0.5


def test_ppo_clip_hand_values_clip_higher_and_dual_clip():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 1.1, 1.5, 5.0]]))
    loss, info = ppo_clip(logp, old, torch.tensor([1.0]), eps_low=0.2, eps_high=0.28)
    # A>0: -min(rho, 1.28)
    assert torch.allclose(loss, -torch.tensor([[0.5, 1.1, 1.28, 1.28]]), atol=1e-6)
    assert info["clip_high"].tolist() == [[False, False, True, True]]
    loss, info = ppo_clip(logp, old, torch.tensor([-1.0]), eps_low=0.2, eps_high=0.28)
    # A<0: max(rho, clip(rho)) -> [0.8, 1.1, 1.5, 5.0]
    assert torch.allclose(loss, torch.tensor([[0.8, 1.1, 1.5, 5.0]]), atol=1e-6)
    assert info["clip_low"].tolist() == [[True, False, False, False]]
    loss, _ = ppo_clip(logp, old, torch.tensor([-1.0]), dual_clip=3.0)  # verl vanilla default c=3
    assert torch.allclose(loss, torch.tensor([[0.8, 1.1, 1.5, 3.0]]), atol=1e-6)


def test_ppo_clip_on_policy_gradient_is_policy_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = ppo_clip(logp, logp.detach(), torch.tensor([2.0]))
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2.0, -2.0]]))  # d/dlogp of -A*exp(logp-old) at ratio 1


def test_aggregations_hand_values_and_anchor_equivalence():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    L = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    assert float((token_mean(mask) * L).sum()) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert float((seq_mean_token_mean(mask) * L).sum()) == pytest.approx((2.0 + 4.0) / 2)
    assert float((seq_mean_token_sum(mask) * L).sum()) == pytest.approx((6.0 + 4.0) / 2)
    # TRL dr_grpo: sum / (B * max_completion_length)
    assert float((dr_grpo(mask, max_len=8) * L).sum()) == pytest.approx(10.0 / (2 * 8))
    # TRL loss_type='grpo' == verl seq-mean-token-mean: mean over sequences of per-sequence token means
    trl_grpo = ((L * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    assert float((seq_mean_token_mean(mask) * L).sum()) == pytest.approx(float(trl_grpo))


def test_micro_batch_split_equals_whole_batch():
    torch.manual_seed(1)
    mask = (torch.rand(6, 5) > 0.3).float()
    L = torch.randn(6, 5)
    w = token_mean(mask)
    whole = (w * L).sum()
    parts = sum((w[i:i + 2] * L[i:i + 2]).sum() for i in range(0, 6, 2))
    assert torch.allclose(whole, parts)


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert kl_k1(logp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_k3(ref, ref).item() == 0.0
    # k3 is unbiased for KL(p||q): E_p[k3] over a full distribution equals the exact KL
    p = torch.tensor([0.1, 0.6, 0.3])
    q = torch.tensor([0.3, 0.3, 0.4])
    est = (p * kl_k3(p.log(), q.log())).sum()
    assert est.item() == pytest.approx(float((p * (p / q).log()).sum()), abs=1e-6)


def test_call_stage_fills_fields_by_name():
    out = call_stage(grpo, {"reward": torch.tensor([1.0, 0.0]), "group_ids": torch.tensor([0, 0])}, {"scale": "none"})
    assert out.tolist() == [0.5, -0.5]
    with pytest.raises(ValueError, match="group_ids"):
        call_stage(grpo, {"reward": torch.tensor([1.0])}, {})


def test_registry_lists_and_gets_builtins():
    assert "grpo" in registry.names("advantage")
    assert "ppo_clip" in registry.names("loss")
    assert {"token_mean", "seq_mean_token_mean", "dr_grpo"} <= set(registry.names("aggregation"))
    assert registry.get("advantage", "grpo") is grpo
    assert registry.get("advantage", "postrl.advantages:grpo") is grpo  # import path
    e = registry.entry("advantage", "grpo")
    assert "GRPO" in e.source and e.description.startswith("A_i")


def test_registry_user_decorator_and_errors():
    @registry.register("reward", "test_len_reward", source="test")
    def test_len_reward(prompts, completions, **kw):
        """Length of the completion."""
        return [float(len(c)) for c in completions]

    assert registry.get("reward", "test_len_reward") is test_len_reward
    assert "test_len_reward" in registry.names("reward")
    from postrl.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown advantage 'nope'; valid: .*grpo"):
        registry.get("advantage", "nope")
    with pytest.raises(ConfigError, match="cannot import module"):
        registry.get("reward", "no_such_module_x:f")
