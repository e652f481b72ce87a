"""End to end: `postrl train --recipe calculator` from the shipped warm-started model raises the success rate."""

from __future__ import annotations

import json

from postrl import recipes
from postrl.cli import main
from postrl.config import load_config
from postrl.models.builtin import SHIPPED, builtin_name
from postrl.train.builtin import ensure_builtin


def test_calculator_recipe_starts_from_the_shipped_model_and_its_success_rate_rises(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("POSTRL_CACHE", str(cache))
    cfg = load_config(None, [], base=recipes.load("calculator"))
    shipped = SHIPPED / builtin_name(cfg)
    assert ensure_builtin(cfg, log=lambda m: None) == shipped, "rebuild it: make builtin-calculator"
    out = tmp_path / "run"
    assert main(["train", "--recipe", "calculator", "--quiet", f"output_dir={out}", "train.steps=20"]) == 0
    assert not any(cache.iterdir())  # nothing was built: RL started from the shipped model
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    success = [r["reward/environment/mean"] for r in rows]
    calls = [r["turns/tool_calls"] for r in rows]
    assert len(success) == 20
    first, last = sum(success[:5]) / 5, sum(success[-5:]) / 5
    assert last >= first + 0.2, success  # the environment's success rate rises by a clear margin
    assert sum(calls[-5:]) / 5 > sum(calls[:5]) / 5, calls  # by calling the tool more often
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["scored_by"] for e in evals] == ["environment", "environment"]
    alarms = json.loads((out / "summary.json").read_text()).get("alarms", {})
    assert "proxy_gold_gap" not in alarms, alarms  # the held-out gold is the trained reward: no false alarm
