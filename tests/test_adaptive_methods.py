"""Issue 31, advantages / losses / regularisers: ADORA, ARES (text part), the chi^2 occupancy regulariser
(Correlated Proxies / ORPO), STEER, SAFE's PID KL controller and GARDO, on hand-built tensors with hand-computed
values (the arithmetic in the comments). Through the trainer: tests/test_adaptive_methods_train.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from postrl import stages
from postrl.batch import RolloutBatch
from postrl.errors import ConfigError
from postrl.stages import StepEnd, build

SQRT3 = math.sqrt(3.0)


# ----------------------------------------------------------------------------------------------------- ADORA
def adora_fields(rewards, lengths, prompts):
    n = len(rewards)
    return {"reward": torch.tensor(rewards, dtype=torch.float32), "group_ids": torch.arange(n) // 3,
            "lengths": torch.tensor(lengths, dtype=torch.float32), "prompts": prompts,
            "valid": torch.ones(n, dtype=torch.bool)}


def test_adora_damps_the_groups_whose_correct_answers_are_short():
    st = build("advantage", "adora", {"eps": 0.0})
    # group 0 (prompt p): correct L 10 vs wrong 4, 6: u = 10 - 5 = 5 > 0 -> weight 1
    # group 1 (prompt q): correct L 2 vs wrong 6, 8: u = 2 - 7 = -5 <= 0 -> weight lambda = 0.1
    f = adora_fields([1, 0, 0, 1, 0, 0], [10, 4, 6, 2, 6, 8], ["p"] * 3 + ["q"] * 3)
    a = st(f)
    # GRPO of [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3): (2/3) sqrt(3) = 1.1547, (-1/3) sqrt(3) = -0.57735
    g = torch.tensor([2 / 3 * SQRT3, -1 / 3 * SQRT3, -1 / 3 * SQRT3])
    assert torch.allclose(a[:3], g, atol=1e-6) and torch.allclose(a[3:], 0.1 * g, atol=1e-6)


def test_adora_utility_evolves_per_prompt_across_steps():
    st = build("advantage", "adora", {"eps": 0.0, "momentum": 0.5})
    fn = st.fn
    bad = adora_fields([1, 0, 0], [2, 6, 8], ["q"] * 3)        # u = -5
    good = adora_fields([1, 0, 0], [10, 6, 8], ["q"] * 3)      # u = 10 - 7 = 3
    none = adora_fields([0, 0, 0.5], [10, 6, 8], ["q"] * 3)    # no correct answer: u undefined
    st.observe(bad)
    assert st(good)[0] > 1.0  # the state changes only at the end of the step: u' = u = 3 > 0, weight 1
    stages.end_step([st], StepEnd())
    assert fn.utility == {fn_key("q"): -5.0}
    # u' = 0.5 * (-5) + 0.5 * 3 = -1 <= 0: damped although this step's rollouts alone (u = 3) would not be
    assert st(good)[0] == pytest.approx(0.1 * 2 / 3 * SQRT3, abs=1e-6)
    assert st(none)[2] != 0 and st(none)[2] == pytest.approx(0.1 * 2 / 3 * SQRT3, abs=1e-6)  # U_q = -5 decides
    st.observe(good)
    stages.end_step([st], StepEnd())
    assert fn.utility[fn_key("q")] == pytest.approx(-1.0)
    assert st(good)[0] == pytest.approx(2 / 3 * SQRT3, abs=1e-6)  # u' = 0.5 * (-1) + 1.5 = 1 > 0: weight 1
    # momentum 1 is the released, stateless rule; the state is JSON and survives a checkpoint
    stateless = build("advantage", "adora", {"eps": 0.0, "momentum": 1.0})
    stateless.load_state_dict(json.loads(json.dumps(st.state_dict())))
    assert stateless.fn.utility == fn.utility and stateless(good)[0] == pytest.approx(2 / 3 * SQRT3, abs=1e-6)


def test_adora_keeps_at_most_max_prompts():
    st = build("advantage", "adora", {"max_prompts": 2})
    for p in ("a", "b", "c"):
        st.observe(adora_fields([1, 0, 0], [2, 6, 8], [p] * 3))
    out = stages.end_step([st], StepEnd())
    assert list(st.fn.utility) == [fn_key("b"), fn_key("c")]  # the least recently updated, 'a', dropped
    assert out["advantage/adora/prompts_tracked"] == 2.0


def fn_key(prompt):
    from postrl.advantages.adora import prompt_key

    return prompt_key(prompt)


# ----------------------------------------------------------------------------------------------------- ARES
def test_window_entropy_and_hwe_windows():
    from postrl.advantages.ares import hwe_windows, window_entropy

    H = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 9.0, 0.0, 0.0]])
    m = torch.tensor([[1.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0]])
    W = window_entropy(H, m, 2)
    # row 0: W_0 = (2 + 3) / 2, W_1 = (3 + 4) / 2, W_2 = (4 + 5) / 2; t = 3, 4 have no whole window after them
    assert torch.allclose(W[0, :3], torch.tensor([2.5, 3.5, 4.5], dtype=torch.float64))
    assert torch.isnan(W[0, 3:]).all()
    # row 1 (3 tokens): only t = 0 has 2 tokens after it: (1 + 9) / 2
    assert W[1, 0] == 5.0 and torch.isnan(W[1, 1:]).all()
    hwe = torch.tensor([[False, True, False, False, False], [False] * 5])
    assert hwe_windows(hwe, 2).tolist() == [[False, True, True, True, False], [False] * 5]


def ares_fields():
    """3 groups of 3, 7 tokens each; window 1 and tau 0.5: token t is an HWE token when H_{t+1} >= 0.5, so n_i =
    the number of entropies >= 0.5 among positions 1..6."""
    n = [0, 2, 5, 1, 3, 3, 0, 1, 4]
    H = torch.zeros(9, 7)
    for i, k in enumerate(n):
        H[i, 1:1 + k] = 1.0
    return {"reward": torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.float32),
            "group_ids": torch.arange(9) // 3, "token_entropy": H, "completion_mask": torch.ones(9, 7),
            "valid": torch.ones(9, dtype=torch.bool)}


def test_ares_difficulty_aware_entropy_reward():
    st = build("advantage", "ares", {"window": 1, "eps": 0.0})
    st.fn.tau = 0.5
    f = ares_fields()
    out = st(f)
    assert out["ares_difficulty"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # pass rates 1, 1/3, 0
    # easy (n = 0, 2, 5): T = 7/3, margin max(1, 0.15 T) = 1, scale T; only n = 5 exceeds T + 1:
    #   e = -0.5 min(1, (5 - 7/3 - 1) / (7/3)) = -0.5 * 5/7 = -0.357143
    # medium (n = 1, 3, 3; correct row n = 1): T = 7/3, margin 1: |1 - 7/3| - 1 = 1/3: e = -0.5 (1/3)/(7/3) = -1/14
    # hard (n = 0, 1, 4): T = 5/3, margin 1, scale 5/3: relu(n - 5/3 + 1) / (5/3) = 0, 0.2, 2 -> e = 0, 0.1, 0.5
    from postrl.advantages import grpo

    shaped = f["reward"].double() + torch.tensor([0, 0, -5 / 14, -1 / 14, 0, 0, 0, 0.1, 0.5], dtype=torch.float64)
    assert torch.allclose(out["advantages"], grpo(shaped, f["group_ids"], f["valid"], eps=0.0), atol=1e-6)
    # hard group: shaped [0, 0.1, 0.5], mean 0.2, unbiased std sqrt((0.04 + 0.01 + 0.09) / 2) = sqrt(0.07)
    assert out["advantages"][6:].tolist() == pytest.approx([-0.2 / math.sqrt(0.07), -0.1 / math.sqrt(0.07),
                                                            0.3 / math.sqrt(0.07)], abs=1e-5)
    # the windows ares_kl relaxes: row 1 has HWE tokens 0, 1 (H_1 = H_2 = 1) -> tokens 0..2
    assert out["ares_hwe"][1].tolist() == [1, 1, 1, 0, 0, 0, 0]


def test_ares_threshold_is_smoothed_once_per_step():
    st = build("advantage", "ares", {"window": 1, "quantile": 0.5, "momentum": 0.9})
    H = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 4.0, 5.0, 6.0]])
    f = {"reward": torch.ones(2), "group_ids": torch.zeros(2, dtype=torch.long), "token_entropy": H,
         "completion_mask": torch.ones(2, 4), "valid": torch.ones(2, dtype=torch.bool)}
    # window 1: W = H shifted: rows [1, 2, 3] and [4, 5, 6]; medians 2 and 5; their median 3.5
    assert st.fn.batch_threshold(torch.tensor([[1.0, 2.0, 3.0, math.nan], [4.0, 5.0, 6.0, math.nan]])) == 3.5
    st.observe(f)
    assert st.fn.tau is None  # not before the step's end
    assert stages.end_step([st], StepEnd())["advantage/ares/hwe_threshold"] == 3.5  # first step: the batch value
    f2 = dict(f, token_entropy=H + 1.0)  # batch value 4.5: tau = 0.9 * 3.5 + 0.1 * 4.5 = 3.6
    st.observe(f2)
    stages.end_step([st], StepEnd())
    assert st.fn.tau == pytest.approx(3.6) and json.loads(json.dumps(st.state_dict())) == {"tau": pytest.approx(3.6)}


def test_ares_kl_relaxes_inside_hwe_windows_per_difficulty():
    from postrl.losses.kl import kl_k3

    logp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.25], [0.25, 0.25]]))
    k = kl_k3(logp, ref)  # d = ref - logp = -ln 2: k3 = 1/2 + ln 2 - 1 = 0.193147
    assert k[0, 0] == pytest.approx(0.5 + math.log(2) - 1)
    st = build("regularizer", "ares_kl", {"relax": 0.25, "scales": [1.0, 2.0, 0.5]})
    hwe = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    r = st({"logp": logp, "ref_logp": ref, "ares_hwe": hwe, "ares_difficulty": torch.tensor([1.0, 2.0])})
    # row 0 medium (scale 2): inside 2 * 0.25 k, outside 2 k; row 1 hard (0.5): outside 0.5 k, inside 0.125 k
    assert torch.allclose(r, torch.tensor([[0.5, 2.0], [0.5, 0.125]]) * k[0, 0])
    with pytest.raises(ConfigError, match="regularizers.0: ares_kl reads .* set advantage.name=ares, got grpo"):
        from postrl.config import load_config

        load_config(None, ["regularizers=[{name: ares_kl}]"])


# ----------------------------------------------------------------------------------------------------- STEER
def steer_fields():
    p = torch.tensor([[0.5, 0.9, 0.2, 0.7]])
    H = torch.tensor([[math.log(2.0), 0.3, 1.0, 5.0]])
    return {"logp": p.log(), "old_logp": p.log(), "advantages": torch.ones(1), "entropy": H,
            "mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]])}


def test_steer_weights_from_the_first_order_entropy_change():
    # q = p (on policy): |Omega| = |(1 - p)(ln p + H)|: 0.5 (-ln2 + ln2) = 0; 0.1 (ln 0.9 + 0.3) = 0.0194639;
    # 0.8 (ln 0.2 + 1) = 0.8 * -0.6094379 -> 0.4875503; the 4th token is off the mask
    lin = build("regularizer", "steer")(steer_fields())["pg_mask"]
    # linear into [0.8, 1.2]: w = 1.2 - |Omega| * 0.4 / 0.4875503
    assert lin[0].tolist() == pytest.approx([1.2, 1.2 - 0.0194639 * 0.4 / 0.4875503, 0.8, 0.0], abs=1e-5)
    ex = build("regularizer", "steer", {"mapping": "exp"})(steer_fields())["pg_mask"]
    # k = -ln 0.8 / 0.4875503 = 0.4576831: exp(0) = 1, exp(-0.4576831 * 0.0194639) = 0.9911312, 0.8
    assert ex[0].tolist() == pytest.approx([1.0, 0.9911312, 0.8, 0.0], abs=1e-5)
    # the sign of the advantage does not matter (|Omega|), a uniform |Omega| gives the middle weight
    f = steer_fields()
    f["advantages"] = -torch.ones(1)
    assert torch.allclose(build("regularizer", "steer")(f)["pg_mask"], lin)
    f = dict(steer_fields(), mask=torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert build("regularizer", "steer")(f)["pg_mask"][0, 0] == pytest.approx(1.0)
    assert build("regularizer", "steer").fn.no_grad_fields == ("entropy",)
    with pytest.raises(ConfigError, match="regularizer.w_max: expected a value >= 1, got 0.9"):
        build("regularizer", "steer", {"w_max": 0.9})


# ----------------------------------------------------------------------------------------------------- chi^2 (ORPO)
def test_reward_to_go_and_prefix_log_ratio():
    from postrl.losses.occupancy import prefix_log_ratio, reward_to_go

    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert reward_to_go(x, m).tolist() == [[6.0, 5.0, 3.0, 0.0]]  # 1+2+3, 2+3, 3, off the mask
    ref = torch.tensor([[-1.0, -1.0, -4.0, -9.0]])
    b = torch.tensor([[-2.0, -1.0, -1.0, -1.0]])
    # cumulative (ref - b) on the mask: 1, 1, -2, -2 (clamped to [-1.5, 1.5])
    assert prefix_log_ratio(ref, b, m, 1.5).tolist() == [[1.0, 1.0, -1.5, -1.5]]


def test_chi2_discriminator_learns_the_occupancy_ratio_and_penalises_through_the_gradient():
    st = build("regularizer", "chi2_occupancy", {"hidden": 0, "lr": 0.1, "updates": 400})
    A, B = [1.0, 0.0], [0.0, 1.0]
    feats = torch.tensor([[A, A, A, B]])
    m = torch.ones(1, 4)
    # policy samples: A 3 times, B once (mu_pi = 3/4, 1/4). Prefix log-ratios log(pi_ref / pi_b) = 0, 0, 0, log 3:
    # the reference's occupancy is A: 3 * 1, B: 1 * 3 -> 1/2, 1/2
    b = torch.zeros(1, 4)
    ref = torch.tensor([[0.0, 0.0, 0.0, math.log(3.0)]])
    f = {"logp": torch.zeros(1, 4), "old_logp": torch.zeros(1, 4), "token_hidden": feats, "mask": m}
    assert torch.all(st(f) == 0)  # no discriminator before the first step's end: no penalty
    st.observe({"token_hidden": feats, "completion_mask": m, "ref_logprobs": ref, "sampler_logprobs": b,
                "valid": torch.ones(1, dtype=torch.bool)})
    out = stages.end_step([st], StepEnd())
    # optimum d = log(mu_pi / mu_ref): A log 1.5, B log 0.5; chi^2 = E_pi[mu_pi / mu_ref] - 1 = 0.75*1.5 + 0.25*0.5 - 1
    d = st.fn.logit(torch.tensor([A, B]))
    assert d.tolist() == pytest.approx([math.log(1.5), math.log(0.5)], abs=2e-2)
    assert out["reg/chi2_occupancy/chi2"] == pytest.approx(0.25, abs=2e-2)
    # penalty p = exp(d) - 1: A 0.5, B -0.5; a completion A, B, A: reward-to-go 0.5, 0, 0.5; R = G * ratio
    seq = {"logp": torch.zeros(1, 3, requires_grad=True), "old_logp": torch.zeros(1, 3),
           "token_hidden": torch.tensor([[A, B, A]]), "mask": torch.ones(1, 3)}
    r = st(seq)
    assert r.tolist()[0] == pytest.approx([0.5, 0.0, 0.5], abs=3e-2)
    r.sum().backward()
    assert seq["logp"].grad.tolist()[0] == pytest.approx([0.5, 0.0, 0.5], abs=3e-2)  # d R / d logp = G at ratio 1
    # the discriminator is in the checkpoint (JSON) and gives the same penalty after a reload
    again = build("regularizer", "chi2_occupancy", {"hidden": 0})
    again.load_state_dict(json.loads(json.dumps(st.state_dict())))
    assert torch.allclose(again(f), st(f))


def test_chi2_needs_the_sampling_policy_log_probs():
    st = build("regularizer", "chi2_occupancy")
    nan = torch.full((1, 2), math.nan)
    with pytest.raises(ValueError, match="chi2_occupancy.*log-probs of the policy that sampled"):
        st.observe({"token_hidden": torch.zeros(1, 2, 3), "completion_mask": torch.ones(1, 2),
                    "ref_logprobs": torch.zeros(1, 2), "sampler_logprobs": nan})


# ----------------------------------------------------------------------------------------------------- SAFE (pid)
def test_pid_kl_controller_by_hand():
    from postrl.losses.kl import KLController

    c = KLController(1.0, mode="pid", target=0.1)
    assert c.value == 0.0
    # step 1: Kbar = 0.1 * 0.5 = 0.05; first reward: Rbar = 0.2, e = 0, u = 0; tau = 0.1; g = max(.5, 2/(1.9+.1)) = 1
    #   coef = 1 * 1 * max(0, 0.05 - 0.1) / 0.1 = 0
    c.update(0.5, 8, reward=0.2, entropy=1.9)
    assert c.value == 0.0
    # step 2: Kbar = 0.045 + 0.15 = 0.195; Rbar = 0.95 * 0.2 + 0.05 * 0.4 = 0.21, v = 0.01, e = 0.009, I = 0.009;
    #   u = 0.3 * 0.009 + 0.01 * 0.009 + 0.05 * (0.009 - 0) = 0.00324; tau = 0.10324; g = 2 / 1.0 = 2
    #   coef = 2 * (0.195 - 0.10324) / 0.10324 = 1.7776056
    m = c.update(1.5, 8, reward=0.4, entropy=0.9)
    assert c.value == pytest.approx(1.7776056, rel=1e-6)
    assert m == {"kl_threshold": pytest.approx(0.10324), "kl_tracked": pytest.approx(0.195), "kl_entropy_gate": 2.0}
    # step 3: Kbar = 0.1755; Rbar = 0.1995, v = -0.0105, e = -0.0115, I = -0.0025;
    #   u = -0.00345 - 0.000025 + 0.05 * (-0.0115 - 0.009) = -0.0045; tau = 0.0955; g = max(0.5, 2/6) = 0.5
    #   coef = 0.5 * (0.1755 - 0.0955) / 0.0955 = 0.4188482
    c.update(0.0, 8, reward=0.0, entropy=5.9)
    assert c.value == pytest.approx(0.4188482, rel=1e-6)
    # the threshold stays within [target / 3, 2 target]; the trackers are in the checkpoint
    big = KLController(1.0, mode="pid", target=0.1, pid_gains=(1000.0, 0.0, 0.0))
    big.update(0.0, 1, reward=0.0)
    assert big.update(0.0, 1, reward=10.0)["kl_threshold"] == pytest.approx(0.2)
    again = KLController(1.0, mode="pid", target=0.1)
    again.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert again.pid == c.pid and again.value == c.value


def test_pid_is_a_kl_controller_choice_of_the_objective():
    from postrl.config import load_config
    from postrl.losses.objective import Objective

    with pytest.raises(ConfigError, match="kl.controller=pid needs kl.coef > 0"):
        load_config(None, ["kl.controller=pid"])
    cfg = load_config(None, ["kl.coef=1.0", "kl.controller=pid", "kl.target=0.1", "kl.pid_gains=[0.3,0.01,0.05]"])
    obj = Objective.from_config(cfg)
    out = obj.end_step(StepEnd({"kl": 0.5, "reward/mean": 0.2, "entropy": 1.9}), 8)
    assert out["kl_coef"] == 0.0 and out["kl_threshold"] == pytest.approx(0.1)  # the value step 1 used, then 0
    obj.end_step(StepEnd({"kl": 1.5, "reward/mean": 0.4, "entropy": 0.9}), 8)
    assert obj.kl_ctrl.value == pytest.approx(1.7776056, rel=1e-6)  # as the controller by hand above
    from postrl.cli.export import verl_overrides

    for placement in ("loss", "reward"):
        with pytest.raises(ConfigError, match="kl.controller=pid"):
            verl_overrides(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": "m"}),
                                                  "kl": cfg.kl.model_copy(update={"placement": placement})}),
                           "c.yaml", train_files="t", val_files="v", gpus=1, nodes=1)


# ----------------------------------------------------------------------------------------------------- GARDO
def gardo_batch(raw, valid=None):
    n = raw.shape[0]
    z = torch.zeros(n, 1)
    b = RolloutBatch(prompt_ids=z.long(), prompt_mask=z.long(), completion_ids=z.long(), completion_mask=z + 1,
                     group_ids=torch.zeros(n, dtype=torch.long), sampler_logprobs=z, truncated=z.bool()[:, 0],
                     prompts=["q"] * n, completions=["c"] * n, reward_names=["ens"], raw_rewards=raw,
                     valid=torch.ones(n, dtype=torch.bool) if valid is None else valid)
    b.extra["raw_reward_names"] = ("a", "b", "c")
    return b


def test_uncertainty_gate_marks_the_rows_the_ensemble_disagrees_on():
    from postrl.losses.gardo import uncertainty_gate

    raw = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.5], [0.0, 0.0, 1.0], [math.nan, 1.0, 1.0], [0.0, 1.0, 0.0]])
    valid = torch.tensor([True, True, True, False, True])
    # population stds: 0; sqrt(0.5/3) = 0.408248; sqrt(6/27) = 0.471405; NaN; sqrt(2/9) = 0.471405
    # top 0.5 over the valid finite rows [0, 0.408, 0.471, 0.471]: quantile_0.5 = (0.408 + 0.471) / 2 = 0.439827
    g = uncertainty_gate(None, gardo_batch(raw, valid), top=0.5)
    assert g.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]
    # top 1: every valid row with some disagreement (u > 0); sources restrict the members
    assert uncertainty_gate(None, gardo_batch(raw, valid), top=1.0).tolist() == [0, 1, 1, 0, 1]
    assert uncertainty_gate(None, gardo_batch(raw, valid), sources=["a", "b"], top=1.0).tolist() == [0, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="at least 2 member reward columns"):
        uncertainty_gate(None, gardo_batch(raw, valid), sources=["a"])


def test_gardo_kl_is_gated_and_resets_the_reference_periodically():
    from postrl.losses.kl import kl_k1

    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0], [-1.5, -1.0]])
    st = build("regularizer", "gardo_kl", {"estimator": "k1", "reset_every": 2, "top": 0.2})
    assert st.needs == ("reference_reset",) and st.field_params == {"top": 0.2}
    assert build("regularizer", "gardo_kl").needs == ()  # no reset: nothing asked of the driver
    r = st({"logp": logp, "ref_logp": ref, "uncertainty_gate": torch.tensor([0.0, 1.0])})
    assert r.tolist() == [[0.0, 0.0], kl_k1(logp, ref)[1].tolist()] == [[0.0, 0.0], [0.5, -1.0]]
    resets = []
    for _ in range(5):
        stages.end_step([st], StepEnd(reset_reference=lambda: resets.append(1)))
    assert len(resets) == 2 and st.state_dict() == {"steps": 5, "resets": 2}  # after steps 2 and 4
    with pytest.raises(ConfigError, match="reference reset"):
        stages.end_step([build("regularizer", "gardo_kl", {"reset_every": 1})], StepEnd())  # a driver without it


def test_reference_reset_is_refused_where_the_driver_cannot_do_it():
    from postrl.config import load_config
    from postrl.integrations import verl as plugin

    cfg = load_config(None, ["kl.coef=0", "regularizers=[{name: gardo_kl, reset_every: 10}]"])
    with pytest.raises(ConfigError, match="regularizer 'gardo_kl': resetting the reference model is not available on "
                                          "verl"):
        plugin.check_config(cfg)
    trl = pytest.importorskip("trl")
    from postrl.integrations.trl import GRPOTrainer

    with pytest.raises(ConfigError, match="gardo_kl.*not available in the TRL adapter.*sync_ref_model"):
        GRPOTrainer(model="unused", postrl={"rewards": [{"name": "format"}], "kl": {"coef": 0.1},
                                            "regularizers": [{"name": "gardo_kl", "reset_every": 10}]},
                    args=trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to="none", num_generations=4,
                                        per_device_train_batch_size=8, gradient_checkpointing=False))


def test_gardo_diversity_amplifies_good_and_diverse_completions():
    from postrl.shaping.diversity import nearest_distance

    comps = ["a b", "a b", "c d", "x y", "x y", "x z"]
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    # unigram Jaccard distances in group 0: d(0,1) = 0, d(0,2) = d(1,2) = 1 -> nearest 0, 0, 1;
    # group 1: {x,y},{x,y},{x,z}: d = 1 - 1/3 = 2/3 -> nearest 0, 0, 2/3
    d = nearest_distance(comps, g, torch.ones(6, dtype=torch.bool), 1)
    assert d.tolist() == pytest.approx([0, 0, 1, 0, 0, 2 / 3])
    rewards = torch.tensor([[0.0], [0.0], [1.0], [0.5], [0.5], [0.5]])
    out = build("shaping", "gardo_diversity", {"ngram": 1, "lam": 0.5})(
        {"rewards": rewards, "reward_names": ["r"], "group_ids": g, "completions": comps})["rewards"]
    # group 0: mean 1/3; row 2 (dn = 1) gains 0.5 * 1 * (1 - 1/3) = 1/3; rows 0, 1 are below the mean
    # group 1: all rewards equal: unchanged
    assert out[:, 0].tolist() == pytest.approx([0.0, 0.0, 4 / 3, 0.5, 0.5, 0.5])


def test_kl_estimator_choices_are_the_registered_estimators():
    import typing

    from postrl import registry
    from postrl.losses.regularizers import KLName

    assert set(typing.get_args(KLName)) == set(registry.names("kl"))  # ares_kl's and gardo_kl's `estimator`
