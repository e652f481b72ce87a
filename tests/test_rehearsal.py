"""DPH-RL's form of the f-divergence: completions pre-sampled once from the initial policy (``postrl presample``),
appended unscored by the ``rehearsal`` expansion, turned into the term by ``f_divergence_rehearsal``; no reference
model. Hand-computed values, the file's checks, and two training steps through the real trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from postrl import registry
from postrl.batch import RolloutBatch
from postrl.cli import main
from postrl.config import load_config
from postrl.errors import ConfigError, DataError
from postrl.losses.regularizers import f_divergence_rehearsal
from postrl.models.tiny import build_local
from postrl.selection.expansions import ExpandContext, Rehearsal
from postrl.train.trainer import Trainer


def test_f_divergence_rehearsal_is_the_divergence_on_initial_policy_samples():
    p0 = torch.tensor([0.1, 0.6, 0.3])  # initial policy over 3 tokens
    pt = torch.tensor([0.3, 0.3, 0.4])  # current policy
    fwd = float((p0 * (p0 / pt).log()).sum())  # KL(p0 || pt) = 0.1 ln(1/3) + 0.6 ln 2 + 0.3 ln(0.75) = 0.2954
    m = (p0 + pt) / 2
    js = float(0.5 * (p0 * (p0 / m).log()).sum() + 0.5 * (pt * (pt / m).log()).sum())
    # one rehearsal row per token value, weighted by its pi_0 probability: the sum is E_{pi_0}[f]
    logp, logp0 = pt.log()[:, None], p0.log()[:, None]
    for div, exact in (("forward_kl", fwd), ("js", js)):
        out = f_divergence_rehearsal(logp, logp0, torch.ones(3, 1), p0, divergence=div)
        assert float(out["unweighted"].sum()) == pytest.approx(exact, rel=1e-5)
    # the rollouts' rows (mask 0, weight 0) add nothing; equal policies give 0
    out = f_divergence_rehearsal(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-0.5, -2.0]]),
                                 torch.tensor([[1.0, 0.0]]), torch.tensor([0.5]))
    t = math.exp(-0.5)  # first token only: f = t - 1 - log t = e^-0.5 - 1 + 0.5, times weight 0.5
    assert float(out["unweighted"].sum()) == pytest.approx(0.5 * (t - 1 + 0.5), rel=1e-6)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def small_batch() -> RolloutBatch:
    return RolloutBatch(prompt_ids=torch.tensor([[5, 6]]), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                        completion_ids=torch.tensor([[7, 8, 9]]), completion_mask=torch.ones(1, 3),
                        group_ids=torch.tensor([0]), sampler_logprobs=torch.zeros(1, 3),
                        truncated=torch.zeros(1, dtype=torch.bool), prompts=["q"], completions=["c"],
                        columns={"answer": ["1"]}, reward_names=["correct"], rewards=torch.ones(1, 1),
                        reward_weights=torch.ones(1), reward=torch.ones(1), valid=torch.ones(1, dtype=torch.bool))


def test_rehearsal_appends_presampled_rows_with_their_fields(tmp_path):
    f = write_rows(tmp_path / "r.jsonl", [
        {"prompt": "a", "prompt_ids": [1, 2], "completion_ids": [3], "logprobs": [-0.5], "temperature": 1.0},
        {"prompt": "b", "prompt_ids": [4], "completion_ids": [5, 6, 7], "logprobs": [-1.0, -2.0, -3.0]},
    ])
    ctx = ExpandContext(generate=None, decode=lambda ids: "x" * len(ids), group_size=2, seed=3)
    out = Rehearsal(path=str(f), per_step=3, temperature=1.0).expand(small_batch(), ctx)
    assert len(out) == 3  # 2 rows in the file: one pass, then wrap-around
    assert not out.valid.any() and out.extra["rehearsal"].all() and torch.isnan(out.rewards).all()
    lens = out.completion_mask.sum(-1)
    assert sorted(lens.tolist()) in ([1.0, 1.0, 3.0], [1.0, 3.0, 3.0])
    # token-mean normaliser over the appended rows: 1 / (their tokens)
    assert torch.allclose(out.extra["rehearsal_weight"], torch.full((3,), 1.0 / float(lens.sum())))
    assert torch.equal(out.extra["rehearsal_logp"], out.sampler_logprobs)
    row_b = int(torch.nonzero(lens == 3)[0])
    assert out.extra["rehearsal_logp"][row_b].tolist() == [-1.0, -2.0, -3.0]
    assert out.columns == {"answer": [None] * 3}
    with pytest.raises(DataError, match="row 1: log-probs at temperature 1.0, the run samples at 0.7"):
        Rehearsal(path=str(f), temperature=0.7)
    bad = write_rows(tmp_path / "bad.jsonl", [{"prompt_ids": [1], "completion_ids": [2, 3], "logprobs": [-1.0]}])
    with pytest.raises(DataError, match="row 1: 1 logprobs for 2 completion tokens"):
        Rehearsal(path=str(bad))


@registry.register("reward", "rehearsal_test_sevens", source="test: fraction of '7' characters")
def rehearsal_test_sevens(prompts, completions, **_):
    return [c.count("7") / max(1, len(c)) + 0.1 * c.count("1") for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nano-rehearsal")
    build_local(path, size="nano", seed=0)
    return path


BASE = ["task.name=arithmetic", "task.digits=1", "rollout.max_new_tokens=5", "rollout.group_size=4",
        "train.prompts_per_step=2", "train.steps=2", "train.micro_batch_size=8", "optim.lr=3e-2",
        "train.save_every=0", "rewards=[{name: rehearsal_test_sevens}]"]


def test_presample_then_train_without_a_reference_model(model_dir, tmp_path):
    out = tmp_path / "rehearsal.jsonl"
    assert main(["presample", f"model.path={model_dir}", *BASE, "--out", str(out), "--prompts", "3",
                 "--samples", "2"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert 1 <= len(rows) <= 6 and all(len(r["logprobs"]) == len(r["completion_ids"]) for r in rows)
    assert all(r["temperature"] == 1.0 for r in rows)
    cfg = load_config(None, [f"model.path={model_dir}", f"output_dir={tmp_path / 'run'}", *BASE,
                             f"filters=[{{name: rehearsal, path: {out}, per_step: 3}}]",
                             "regularizers=[{name: f_divergence_rehearsal, coef: 1.0}]"])
    tr = Trainer(cfg, tmp_path / "run")
    assert tr.ref_model is None and "ref_logp" not in tr.objective.reads  # no online reference model
    m0 = tr.train_step(0)
    m1 = tr.train_step(1)
    # step 1: the policy is the initial one, so its log-probs of the presampled tokens are the file's: term ~ 0
    assert m0["reg/f_divergence_rehearsal"] == pytest.approx(0.0, abs=1e-4)
    assert m1["reg/f_divergence_rehearsal"] > 1e-4  # the update moved the policy away from pi_0
    assert m0["rehearsal/rows"] == 3.0  # the rows are in the batch, but not in the rollout metrics
    assert m0["valid"] == 1.0


def test_f_divergence_rehearsal_needs_the_rehearsal_expansion():
    with pytest.raises(ConfigError, match="regularizers.0: f_divergence_rehearsal needs the pre-sampled"):
        load_config(None, ["regularizers=[{name: f_divergence_rehearsal, coef: 0.1}]"])


def test_presample_of_the_builtin_model_samples_the_policy_train_starts_from(tmp_path):
    """model.path=builtin is the built-in warm start postrl train loads (shipped / cached), not a fresh random
    init: with --only-correct it keeps completions that the verifier scores 1 (a random init solves none)."""
    out = tmp_path / "rehearsal.jsonl"
    assert main(["presample", "--out", str(out), "--prompts", "8", "--samples", "8", "--only-correct"]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows and all(r["correct"] == 1.0 for r in rows)
