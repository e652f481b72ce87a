"""Config loading, overrides and one-line errors (through the CLI too)."""

import subprocess
import sys

import pytest

from postrl.cli import main
from postrl.config import Config, load_config
from postrl.errors import ConfigError


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  lr: 0.001\nrollout:\n  group_size: 4\n")
    cfg = load_config(f, ["optim.lr=1e-5", "train.steps=7", "rewards.0.weight=2", 'rollout.stop=["\\n"]'])
    assert cfg.optim.lr == 1e-5 and cfg.train.steps == 7 and cfg.rollout.group_size == 4
    assert cfg.rewards[0].weight == 2.0 and cfg.rollout.stop == ["\n"]
    assert cfg.advantage.name == "grpo" and cfg.loss.agg == "token_mean"


def test_stage_params_travel():
    cfg = load_config(None, ["advantage.scale=batch", "advantage.eps=1e-4", "loss.eps_high=0.28"])
    assert cfg.advantage.params == {"scale": "batch", "eps": 1e-4}
    assert cfg.loss.params == {"eps_high": 0.28}


@pytest.mark.parametrize("override, message", [
    (["optim.lrr=1"], "unknown key 'optim.lrr'"),
    (["bogus=1"], "unknown key 'bogus'"),
    (["optim.lr=abc"], "optim.lr: input should be a valid number"),
    (["train.steps=0"], "train.steps"),
    (["advantage.name=grpoo"], "unknown advantage 'grpoo'; valid: .*grpo"),
    (["advantage.scal=batch"], "advantage: unknown parameter 'scal' for advantage 'grpo'; valid: scale, eps"),
    (["loss.agg=nope"], "unknown aggregation 'nope'; valid: .*token_mean"),
    (["task.name=nosuchtask"], "unknown task 'nosuchtask'; valid: .*arithmetic"),
    (["rewards.0.name=nosuch"], "unknown reward 'nosuch'"),
    (["optim.lr"], "expected KEY=VALUE"),
])
def test_config_errors_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, override)
    assert "\n" not in str(e.value)


def test_missing_and_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="config file .* does not exist"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_cli_prints_one_line_error_without_traceback():
    r = subprocess.run([sys.executable, "-m", "postrl", "train", "optim.lrr=1"], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "postrl: error: unknown key 'optim.lrr'"
    r = subprocess.run([sys.executable, "-m", "postrl", "train", "model.path=/no/such/model", "--quiet"],
                       capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == ("postrl: error: model.path '/no/such/model': no such folder "
                                "(expected a folder written by save_pretrained)")


def test_config_show_resolves(capsys):
    assert main(["config", "show", "train.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out
    Config.model_validate(__import__("yaml").safe_load(out))  # what it prints is itself a valid config


def test_methods_json(capsys):
    import json

    assert main(["methods", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {(r["kind"], r["name"]) for r in rows}
    assert ("advantage", "grpo") in names and ("loss", "ppo_clip") in names and ("task", "arithmetic") in names
    from postrl import registry

    own = {(e.kind, e.name) for e in registry.all_entries() if getattr(e.fn, "__module__", "").startswith("postrl.")}
    assert all(r["description"] for r in rows if (r["kind"], r["name"]) in own)  # every postrl stage says what it is


def test_config_reference_doc_is_current():
    """docs/config.md is generated from the code (postrl config reference > docs/config.md): keep it true."""
    from pathlib import Path

    from postrl.config import reference_markdown

    doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert doc.read_text().strip() == reference_markdown().strip(), "regenerate: postrl config reference > docs/config.md"


def test_changing_a_stage_name_drops_the_old_stage_params(tmp_path):
    # the default task is arithmetic with chatty=0.6; countdown has no such parameter
    assert load_config(None, ["task.name=countdown"]).task.params == {}
    assert load_config(None, ["task.digits=3"]).task.params == {"chatty": 0.6, "digits": 3}  # same stage: merged
    f = tmp_path / "run.yaml"
    f.write_text("task: {name: countdown, numbers: 4}\n")
    assert load_config(f).task.params == {"numbers": 4}
