"""Issue 31's advantages, losses and regularisers through the real trainer (nano model, 1-digit arithmetic, 2
steps of 2 epochs): each trains without NaN with its state and metrics where they belong; GARDO's reference reset
reaches the trainer's reference model and its checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from postrl import registry
from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.models.tiny import build_local
from postrl.train.trainer import Trainer


@registry.register("reward", "adaptive_test_sevens", source="test: fraction of '7' characters")
def adaptive_test_sevens(prompts, completions, **_):
    """Fraction of '7' characters (varies across a group, so advantages are non-zero)."""
    return [c.count("7") / max(1, len(c)) + 0.1 * c.count("1") for c in completions]


@registry.register("reward", "adaptive_test_ones", source="test: fraction of '1' characters")
def adaptive_test_ones(prompts, completions, **_):
    """Fraction of '1' characters: a second ensemble member that disagrees with the first."""
    return [c.count("1") / max(1, len(c)) for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nano-adaptive")
    build_local(path, size="nano", seed=0)
    return path


def make(model_dir: Path, out: Path, *extra: str) -> Trainer:
    cfg = load_config(None, [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
                             "rollout.max_new_tokens=8", "rollout.group_size=4", "train.prompts_per_step=4",
                             "train.steps=2", "train.epochs=2", "train.micro_batch_size=8", "optim.lr=3e-3",
                             "train.save_every=0", "rewards=[{name: adaptive_test_sevens}]", *extra])
    return Trainer(cfg, out)


def run_steps(tr: Trainer, steps: int = 2) -> list[dict]:
    before = [p.detach().clone() for p in tr.policy.parameters()]
    metrics = [tr.train_step(s) for s in range(steps)]
    for m in metrics:
        mine = {k: v for k, v in m.items() if k in ("pg_loss", "grad_norm", "entropy", "kl", "kl_coef")
                or k.startswith(("reg/", "advantage/"))}
        assert not {k: v for k, v in mine.items() if not math.isfinite(v)}, mine
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.policy.parameters())), "no update"
    return metrics


ENSEMBLE = "rewards=[{name: adaptive_test_sevens}, {name: adaptive_test_ones}]"
METHODS = {
    "adora": ["advantage={name: adora, threshold: 0.2}"],
    "ares": ["advantage={name: ares, threshold: 0.2}", "regularizers=[{name: ares_kl, coef: 0.1}]"],
    "steer": ["regularizers=[{name: steer}]"],
    "chi2_occupancy": ["regularizers=[{name: chi2_occupancy, coef: 0.1}]"],
    "gardo": [ENSEMBLE, "shaping=[{name: gardo_diversity, ngram: 1}, {name: weighted_sum}]",
              "regularizers=[{name: gardo_kl, coef: 0.1, top: 0.5, reset_every: 1}]"],
    "pid": ["kl.coef=1.0", "kl.controller=pid", "kl.target=1e-4"],
}


@pytest.mark.parametrize("name", list(METHODS))
def test_each_method_trains_through_the_trainer(model_dir, tmp_path, name):
    tr = make(model_dir, tmp_path / name, *METHODS[name])
    m = run_steps(tr)
    if name == "adora":
        assert "advantage/adora/prompts_tracked" in m[1]
    elif name == "ares":
        # the estimator hands its windows and difficulties on to ares_kl through the batch; its threshold is state
        assert {"ares_hwe", "ares_difficulty"} <= tr.objective.reads and tr.ref_model is not None
        assert m[0]["advantage/ares/hwe_threshold"] > 0 and m[1]["reg/ares_kl"] > 0
    elif name == "steer":
        assert 0.8 <= m[0]["reg/steer/kept"] <= 1.2 and not tr.objective.entropy_grad  # the mean weight
    elif name == "chi2_occupancy":
        # features produced through the model context; the reference model loaded for the observed log-ratios
        assert "token_hidden" in tr.objective.reads and tr.ref_model is not None
        assert m[0]["reg/chi2_occupancy"] == 0.0 and m[1]["reg/chi2_occupancy"] != 0.0  # a discriminator from step 1
        assert m[0]["reg/chi2_occupancy/disc_loss"] > 0 and tr.objective.regularizers[0].fn.steps == 2
    elif name == "gardo":
        # reset after every step: the reference holds the policy's weights; the gate came from the two members
        assert m[1]["reg/gardo_kl/reference_resets"] == 2.0 and tr.ref_reset_step == 2
        assert all(torch.equal(a, b) for a, b in zip(tr.policy.state_dict().values(),
                                                     tr.ref_model.state_dict().values()))
    elif name == "pid":
        assert m[0]["kl_coef"] == 0.0 and m[1]["kl_coef"] > 0.0 and m[1]["kl_threshold"] > 0


def test_reset_reference_is_checkpointed_and_refused_with_lora(model_dir, tmp_path):
    out = tmp_path / "reset"
    extra = ("train.epochs=1", "kl.coef=0.1", "regularizers=[{name: gardo_kl, reset_every: 2, top: 1.0}]", ENSEMBLE)
    tr = make(model_dir, out, *extra)
    initial = [p.detach().clone() for p in tr.ref_model.parameters()]
    tr.train_step(0)
    assert tr.ref_reset_step is None and all(torch.equal(a, b) for a, b in zip(initial, tr.ref_model.parameters()))
    tr.train_step(1)
    assert tr.ref_reset_step == 2
    tr.save(2)
    assert (out / "checkpoints" / "step-00000002" / "reference" / "model.safetensors").is_file()
    resumed = Trainer(make(model_dir, out, *extra).cfg, out, resume=True)
    assert resumed.ref_reset_step == 2
    assert all(torch.equal(a, b) for a, b in zip(tr.ref_model.parameters(), resumed.ref_model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(initial, resumed.ref_model.parameters()))
    with pytest.raises(ConfigError, match="gardo_kl' resets the reference model.*model.lora"):
        make(model_dir, tmp_path / "lora", *extra, "model.lora.r=4")
