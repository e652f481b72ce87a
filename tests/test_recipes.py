"""Recipes: every bundled recipe trains end-to-end on a nano model with finite metrics; --recipe on the CLI, its
precedence (recipe < YAML file < overrides), unknown names, headers and the examples/ pointers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from postrl import recipes, registry
from postrl.cli import main
from postrl.config import load_config
from postrl.seeding import stable_hash
from postrl.models.tiny import build_local
from postrl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "gdpo", "dler", "ppo"}


@registry.register("reward", "recipes_coin", source="test: a reward with variance for an untrained model")
def recipes_coin(prompts, completions, **_):
    """1.0 for about half of the completions (hash of prompt and text)."""
    return [float(stable_hash(p, c) % 2) for p, c in zip(prompts, completions)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nano-recipes")
    build_local(path, size="nano", seed=0)
    return path


def tiny(model_dir: Path, out: Path, name: str) -> list[str]:
    args = [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
            "rollout.max_new_tokens=4", "train.steps=2", "train.save_every=0", "train.eval_size=4", "train.eval_k=1",
            "optim.lr=1e-3", "rewards=[{name: correct}, {name: recipes_coin, weight: 0.5}]",
            # stop at any digit, so that some completions finish (every length/finish metric is defined)
            "rollout.stop=['0','1','2','3','4','5','6','7','8','9']"]
    args += ["train.prompts_per_step=8"] if name == "ppo" else ["rollout.group_size=4", "train.prompts_per_step=4"]
    if name in ("dapo", "dler"):  # an untrained model is never `correct`: let dynamic sampling judge the coin
        args += ["filters.0.reward=recipes_coin", "filters.0.max_attempts=3"]
    return args


def test_the_issue_recipes_are_bundled():
    # task recipes: calculator (tests/test_calculator_learns.py), tool_calls (tests/test_tool_calls_learns.py),
    # scratchpad (the reasoning testbed, tests/test_scratchpad.py)
    assert set(recipes.names()) == EXPECTED | {"calculator", "tool_calls", "scratchpad"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_trains_end_to_end(name, model_dir, tmp_path):
    out = tmp_path / name
    cfg = load_config(None, tiny(model_dir, out, name), base=recipes.load(name))
    rec = recipes.load(name)
    assert cfg.advantage.name == rec["advantage"]["name"] and cfg.loss.name == rec["loss"]["name"]
    Trainer(cfg, out).train()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        bad = [k for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)]
        if name == "ppo":  # one completion per prompt: the within-group length/reward correlation is undefined
            bad.remove("length/reward_corr")
        assert not bad, (name, bad)
        assert r["valid"] > 0 and r["grad_norm"] >= 0
    if "filters" in rec:
        assert all(r["filter/cap_hit"] == 0.0 for r in rows)
    if name == "ppo":
        assert all("value/loss" in r for r in rows)


def test_recipe_headers_name_the_paper_and_examples_point_to_them():
    for name in recipes.names():
        text = recipes.path(name).read_text()
        header = [line for line in text.splitlines() if line.startswith("#")]
        assert len(header) >= 3 and ('"' in header[0] or "(" in header[0]), name  # the paper's title / authors
        assert "Sets" in " ".join(header), name  # and what the recipe sets
        ex = ROOT / "examples" / "recipes" / f"{name}.yaml"
        assert ex.is_file() and yaml.safe_load(ex.read_text()) == yaml.safe_load(text)
    assert "--recipe" in (ROOT / "examples" / "recipes" / "README.md").read_text()


def test_recipe_precedence_yaml_then_overrides(tmp_path):
    user = tmp_path / "run.yaml"
    user.write_text("loss: {eps_high: 0.3}\ntrain: {steps: 7}\n")
    cfg = load_config(user, ["loss.eps_low=0.1"], base=recipes.load("dapo"))
    assert cfg.loss.params == {"eps_low": 0.1, "eps_high": 0.3}  # recipe 0.2 / 0.28, then the file, then overrides
    assert cfg.loss.agg == "token_mean" and cfg.filters[0].name == "dynamic_sampling" and cfg.train.steps == 7
    assert [s.name for s in cfg.shaping] == ["overlong_soft", "weighted_sum"]


def test_cli_recipe_unknown_lists_valid_and_known_runs(model_dir, tmp_path, capsys):
    assert main(["train", "--recipe", "nope", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("postrl: error: unknown recipe 'nope'; valid: calculator, cispo, dapo, dler, dr_grpo, gdpo, grpo")
    assert main(["train", "--recipe", "grpo", "--resume", str(tmp_path)]) == 2  # --resume keeps the run's config
    out = tmp_path / "cli"
    assert main(["train", "--recipe", "gspo", "--quiet", *tiny(model_dir, out, "gspo")]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["loss"]["name"] == "gspo" and saved["loss"]["agg"] == "sequence"


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("max_new_tokens", [16, 256, 20480])
def test_recipe_length_stages_apply_within_max_new_tokens(name, max_new_tokens):
    """A length stage must be able to act on the completions the run can generate: overlong_soft punishes a
    completion of rollout.max_new_tokens tokens (DAPO: -penalty at Lmax) and none of a fifth of that length (the
    DAPO recipe once punished only beyond 16384 tokens while generating 16)."""
    import torch

    from postrl.shaping.length import overlong_soft

    cfg = load_config(None, [f"rollout.max_new_tokens={max_new_tokens}", "train.prompts_per_step=8"],
                      base=recipes.load(name))
    for i, s in enumerate(cfg.shaping):
        if s.name != "overlong_soft":
            continue
        lengths = torch.tensor([max_new_tokens // 5, max_new_tokens])
        out = overlong_soft(torch.ones(2, 1), ["correct"], torch.ones(1), lengths, **s.params)
        penalty = s.params.get("penalty", 1.0)
        assert out["rewards"][:, 1].tolist() == [0.0, -penalty], (name, i, s.params)
