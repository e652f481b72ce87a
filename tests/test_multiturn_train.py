"""Multi-turn rollouts through the trainer: an environment run trains, logs turn metrics, and resumes exactly."""

from __future__ import annotations

import math

import yaml

from postrl.config import load_config
from postrl.train.trainer import Trainer
from test_train import metrics, model_dir, run_inprocess  # noqa: F401 - model_dir: the fixture


def env_args(model_dir, out, *extra):
    return [f"model.path={model_dir}", f"output_dir={out}", "task.name=calculator", "task.digits=2",
            "environment={name: calculator, max_turns: 2, max_total_tokens: 20, timeout: 2.0}",
            "rewards=[{name: environment}]", "advantage={name: turn_mapo, mix: 0.5}",
            "rollout.max_new_tokens=8", "rollout.group_size=4", "train.prompts_per_step=4", "train.steps=4",
            "train.save_every=2", "train.eval_size=4", "train.eval_k=1", "optim.lr=1e-3", *extra]


def test_environment_run_resumes_equal_to_the_uninterrupted_run(model_dir, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run_inprocess(env_args(model_dir, full))
    rows = metrics(full)
    assert len(rows) == 4
    for r in rows:
        assert 1.0 <= r["turns/per_episode"] <= 2.0 and math.isfinite(r["reward/environment/mean"])
        assert "turns/truncated_turns" in r and "turns/env_token_fraction" in r
    run_inprocess(env_args(model_dir, part, "train.steps=2"))
    cfg = load_config(None, ["train.steps=4"], base=yaml.safe_load((part / "config.yaml").read_text()))
    Trainer(cfg, part, resume=True).train()
    assert metrics(part) == rows


def test_single_completion_expansions_are_refused_with_an_environment(model_dir, tmp_path):
    import pytest

    from postrl.errors import ConfigError

    with pytest.raises(ConfigError, match="filters.0: the expansion stage 'retry_from_failure'"):
        load_config(None, env_args(model_dir, tmp_path, "filters=[{name: retry_from_failure}]"))
    with pytest.raises(ConfigError, match="environment: unknown parameter 'bogus'"):
        load_config(None, env_args(model_dir, tmp_path, "environment.bogus=1"))
