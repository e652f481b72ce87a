"""End to end: `postrl train --recipe tool_calls` (ToolRL's tool_call reward) from the shipped warm-started model
raises the success rate of the sampled tool calls."""

from __future__ import annotations

import json

from postrl import recipes
from postrl.cli import main
from postrl.config import load_config
from postrl.models.builtin import SHIPPED, builtin_name
from postrl.train.builtin import ensure_builtin


def test_tool_calls_recipe_starts_from_the_shipped_model_and_its_success_rate_rises(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("POSTRL_CACHE", str(cache))
    cfg = load_config(None, [], base=recipes.load("tool_calls"))
    shipped = SHIPPED / builtin_name(cfg)
    assert ensure_builtin(cfg, log=lambda m: None) == shipped, "rebuild it: make builtin-tool-calls"
    out = tmp_path / "run"
    assert main(["train", "--recipe", "tool_calls", "--quiet", f"output_dir={out}", "train.steps=20"]) == 0
    assert not any(cache.iterdir())  # nothing was built: RL started from the shipped model
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    success = [r["accuracy"] for r in rows]  # the `correct` reward (weight 0): exact gold call, sampled
    reward = [r["reward/tool_call/mean"] for r in rows]
    assert len(success) == 20
    first, last = sum(success[:5]) / 5, sum(success[-5:]) / 5
    assert last >= first + 0.12, success  # the success rate rises by a clear margin
    assert sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 0.2, reward  # with the ToolRL reward that drives it
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["scored_by"] for e in evals] == ["verifier", "verifier"]
    assert evals[-1]["accuracy"] >= 0.9  # the greedy calls stay right
    alarms = json.loads((out / "summary.json").read_text()).get("alarms", {})
    assert "proxy_gold_gap" not in alarms, alarms
