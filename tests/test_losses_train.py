"""Every policy loss, regulariser, TIS and KL option through the real trainer: a nano model, arithmetic (1 digit),
2 steps of 2 epochs (so ratios move off 1), no NaN, the weights move; KL in the reward and the adaptive controller
with their state in the checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from postrl import registry
from postrl.config import load_config
from postrl.models.tiny import build_local
from postrl.train.trainer import Trainer


@registry.register("reward", "loss_test_sevens", source="test: fraction of '7' characters")
def loss_test_sevens(prompts, completions, **_):
    """Fraction of '7' characters (varies across a group, so advantages are non-zero)."""
    return [c.count("7") / max(1, len(c)) + 0.1 * c.count("1") for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nano-losses")
    build_local(path, size="nano", seed=0)
    return path


def make(model_dir: Path, out: Path, *extra: str) -> Trainer:
    cfg = load_config(None, [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
                             "rollout.max_new_tokens=5", "rollout.group_size=4", "train.prompts_per_step=4",
                             "train.steps=2", "train.epochs=2", "train.micro_batch_size=8", "optim.lr=3e-3",
                             "train.save_every=0", "rewards=[{name: loss_test_sevens}]", *extra])
    return Trainer(cfg, out)


UPDATE_KEYS = {"pg_loss", "entropy", "grad_norm", "ratio_max", "kl", "kl_reward", "kl_coef", "kl_cov"}


def run_steps(trainer: Trainer, steps: int = 2) -> list[dict]:
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    metrics = [trainer.train_step(s) for s in range(steps)]
    for m in metrics:  # the update's metrics (other stages' diagnostics may be NaN by design, e.g. no EOS yet)
        mine = {k: v for k, v in m.items() if k in UPDATE_KEYS or k.startswith(("reg/", "tis/", "clip"))}
        assert {"pg_loss", "grad_norm", "entropy"} <= set(mine)
        bad = {k: v for k, v in mine.items() if not math.isfinite(v)}
        assert not bad, bad
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters())), "no update"
    assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())
    return metrics


LOSSES = [
    ("ppo_clip", ["loss.dual_clip=3.0", "loss.eps_high=0.28"]),
    ("gspo", ["loss.agg=sequence"]),
    ("gmpo", ["loss.agg=sequence"]),
    ("gpg", []),
    ("cispo", []),
    ("dispo", ["loss.mode=clip"]),
    ("sapo", ["loss.agg=seq_mean_token_mean"]),
    ("clip_cov", ["loss.clip_cov_ratio=0.2", "loss.clip_cov_lb=0.0"]),
    ("kl_cov", ["loss.kl_cov_ratio=0.2"]),
]


@pytest.mark.parametrize("name,extra", LOSSES, ids=[x[0] for x in LOSSES])
def test_each_loss_trains_without_nan(model_dir, tmp_path, name, extra):
    m = run_steps(make(model_dir, tmp_path / name, f"loss.name={name}", *extra))
    assert m[-1]["ratio_max"] >= 1.0 or name == "gpg"
    if name == "clip_cov":
        assert sum(x["clip_cov"] for x in m) > 0
    if name == "kl_cov":
        assert sum(x["kl_cov"] for x in m) > 0


def test_sequence_loss_with_token_aggregation_warns(model_dir, tmp_path):
    with pytest.warns(UserWarning, match="sequence-level"):
        make(model_dir, tmp_path / "w", "loss.name=gspo", "loss.agg=token_mean")


REGULARIZERS = [
    ("entropy_bonus", "{name: entropy_bonus, coef: 0.01}"),
    ("adaptive_entropy", "{name: adaptive_entropy, target: 10.0, delta: 0.01, max_alpha: 0.05}"),
    ("top_entropy_tokens", "{name: top_entropy_tokens, q: 0.5}"),
    ("entropy_band", "{name: entropy_band, coef: 0.1, low: 4.0, high: 4.2}"),
    ("lp_reg", "{name: lp_reg, coef: 0.1, min_p: 0.5}"),
    ("entropy_smoothing", "{name: entropy_smoothing, coef: 0.1, band: 0.0}"),
    ("f_divergence_fkl", "{name: f_divergence, coef: 0.1}"),
    ("f_divergence_js", "{name: f_divergence, coef: 0.1, divergence: js}"),
    ("srpo", "{name: srpo}"),  # arithmetic has no <evidence> / <perception> sections: every weight is 1
]


@pytest.mark.parametrize("name,spec", REGULARIZERS, ids=[x[0] for x in REGULARIZERS])
def test_each_regularizer_trains_without_nan(model_dir, tmp_path, name, spec):
    one_epoch = ["train.epochs=1"] if name.startswith("f_divergence") else []  # step 1 then starts at pi_ref
    tr = make(model_dir, tmp_path / name, f"regularizers=[{spec}]", *one_epoch)
    reg = tr.cfg.regularizers[0].name
    # fields are computed only when a stage needs them
    assert ("entropy" in tr.objective.reads) == (reg in ("entropy_bonus", "adaptive_entropy", "top_entropy_tokens",
                                                       "entropy_band", "entropy_smoothing"))
    assert tr.objective.entropy_grad == (reg in ("entropy_bonus", "adaptive_entropy", "entropy_band", "entropy_smoothing"))
    assert ("logits" in tr.objective.reads) == (reg == "lp_reg")
    assert (tr.ref_model is not None) == (reg == "f_divergence")
    m = run_steps(tr)
    if reg == "top_entropy_tokens":
        assert 0.3 < m[0][f"reg/{reg}/kept"] < 0.7  # about half the tokens (q = 0.5) keep their gradient
    elif reg == "srpo":
        assert m[0][f"reg/{reg}/kept"] == pytest.approx(1.0)  # the mean token weight: no role token here
    elif reg == "adaptive_entropy":
        # the alpha each step used: init 0, then +delta (entropy below the target of 10 nats)
        assert m[0][f"reg/{reg}/alpha"] == 0.0 and m[1][f"reg/{reg}/alpha"] == pytest.approx(0.01)
        assert tr.objective.regularizers[0].fn.alpha == pytest.approx(0.02)
    else:
        assert f"reg/{reg}" in m[0]
    if reg == "entropy_smoothing":
        assert m[0][f"reg/{reg}"] == 0.0 and m[1][f"reg/{reg}"] > 0.0  # history starts after step 1
    if reg == "f_divergence":
        assert m[0][f"reg/{reg}"] == pytest.approx(0.0, abs=1e-6) and m[1][f"reg/{reg}"] > 0.0  # drifts from ref


@registry.register("reward", "loss_test_short", source="test: 1 for a completion under 6 characters")
def loss_test_short(prompts, completions, **_):
    return [float(len(c) < 6) for c in completions]


def test_icr_trains_through_the_trainer(model_dir, tmp_path):
    """ICR's field is produced by the step, read by the objective: stop strings make lengths vary and the 'short'
    column (weight 0: the policy gradient ignores it) makes shorter completions the correct ones, so the batch
    overthinks and the regulariser pulls toward each group's shortest correct completion."""
    tr = make(model_dir, tmp_path / "icr", "regularizers=[{name: icr, coef: 0.1, source: loss_test_short}]",
              "rewards=[{name: loss_test_sevens}, {name: loss_test_short, weight: 0.0}]",
              "rollout.stop=['3', '5']", "rollout.max_new_tokens=8")
    m = run_steps(tr)
    assert m[0]["reg/icr"] > 0.0 and all(math.isfinite(x["reg/icr"]) for x in m)


def test_default_run_keeps_entropy_a_diagnostic(model_dir, tmp_path):
    tr = make(model_dir, tmp_path / "plain")
    assert tr.objective.reads == {"logp", "old_logp", "advantages"} and tr.ref_model is None and not tr.objective.entropy_grad


@pytest.mark.parametrize("tis", ["level=token", "level=sequence", "level=token,mode=mask,cap=1.01"])
def test_tis_trains_and_reports_weights(model_dir, tmp_path, tis):
    opts = [f"loss.tis.{kv}" for kv in tis.split(",")]
    m = run_steps(make(model_dir, tmp_path / "tis", *opts))
    # the HF sampler and the trainer compute the same probabilities up to float noise: weights ~ 1
    assert m[0]["tis/weight"] == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("estimator", ["k3+", "k1+", "abs"])
def test_kl_in_loss_estimators_train(model_dir, tmp_path, estimator):
    m = run_steps(make(model_dir, tmp_path / "kl", "kl.coef=0.1", f"kl.estimator={estimator}", "train.epochs=1"))
    assert m[0]["kl"] == pytest.approx(0.0, abs=1e-6) and m[1]["kl"] > 0.0  # first step: policy == reference
    assert m[1]["kl_coef"] == 0.1


def test_kl_in_reward_subtracts_per_sequence_kl_before_advantages(model_dir, tmp_path):
    """The advantage stage sees r_i - coef * sum_t KL_t, KL from the batch's own policy/reference log-probs."""
    tr = make(model_dir, tmp_path / "klr", "kl.coef=0.5", "kl.placement=reward", "kl.estimator=k1")
    seen = []
    real = tr.step.advantages

    def spy(ctx, batch, observe=True):
        kl = ((batch.old_logprobs - batch.ref_logprobs) * batch.completion_mask).sum(-1)
        seen.append((batch.reward.clone(), batch.rewards[:, 0].clone(), kl))
        return real(ctx, batch, observe)

    tr.step.advantages = spy
    m = run_steps(tr)
    for reward, raw, kl in seen:
        assert torch.allclose(reward, raw - 0.5 * kl, atol=1e-6)
    assert float(seen[0][2].abs().max()) < 1e-5 and float(seen[1][2].abs().sum()) > 0  # policy moved at step 2
    assert "kl" not in m[1] and m[1]["kl_reward"] > 0.0 and m[1]["kl_coef"] == 0.5


def test_adaptive_kl_and_regularizer_state_survive_checkpoint(model_dir, tmp_path):
    out = tmp_path / "ckpt"
    extra = ("train.epochs=1", "kl.coef=0.2", "kl.controller=adaptive", "kl.target=1e-6", "kl.horizon=8",
             "regularizers=[{name: adaptive_entropy, target: 10.0, delta: 0.01}, {name: entropy_smoothing}]")
    tr = make(model_dir, out, *extra)
    m = run_steps(tr)
    # step 1: KL = 0 -> error clipped to -0.2: coef * (1 - 0.2 * 16 / 8); step 2: KL >> target -> * (1 + 0.4)
    assert m[0]["kl_coef"] == 0.2 and m[1]["kl_coef"] == pytest.approx(0.2 * 0.6)
    assert tr.objective.kl_ctrl.value == pytest.approx(0.2 * 0.6 * 1.4)
    tr.save(2)
    again = make(model_dir, out, *extra)
    assert again.objective.kl_ctrl.value == 0.2  # a fresh run starts from kl.coef
    resumed = Trainer(again.cfg, out, resume=True)
    assert resumed.objective.kl_ctrl.value == pytest.approx(tr.objective.kl_ctrl.value)
    assert resumed.objective.regularizers[0].fn.alpha == pytest.approx(0.02)
    assert resumed.objective.regularizers[1].fn.history == pytest.approx(tr.objective.regularizers[1].fn.history)
