"""scripts/alarm_rates.py: the counting behind docs/metrics.md's "How often each alarm is right" tables."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("alarm_rates", ROOT / "scripts" / "alarm_rates.py")
ar = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ar)


def _run(engine, recipe, fault, seed, steps, active):
    return {"engine": engine, "recipe": recipe, "fault": fault, "seed": seed, "steps": steps, "steps_done": steps,
            "error": None, "active": active, "wall_s": 1.0}


def test_onsets_are_the_first_steps_of_streaks():
    assert ar.onsets([3, 4, 5, 9, 11, 12]) == [3, 9, 11]
    assert ar.onsets([]) == []


def test_firings_per_100_healthy_steps_and_fault_delays():
    results = [_run("postrl", "grpo", None, 0, 40, {"kl_blowup": [5, 6, 20]}),   # two streaks: two firings
               _run("postrl", "ppo", None, 0, 40, {}),
               _run("postrl", "grpo", "lr_100x", 0, 30, {"kl_blowup": [2, 3], "truncation": [7]}),
               _run("postrl", "grpo", "lr_100x", 1, 30, {"kl_blowup": [4]})]
    s = ar.summarise(results)
    k = s["healthy"]["postrl"]["alarms"]["kl_blowup"]
    assert (k["firings"], k["per_100_steps"], k["runs_with"], k["where"]) == (2, 2.5, 1, ["grpo"])  # 2 in 80 steps
    first = s["faults"]["lr_100x"]["postrl"]["first_step"]
    assert first == {"kl_blowup": [2, 4], "truncation": [7]}
    assert ar._delay(first["kl_blowup"], 2) == "3 (2-4)" and ar._delay(first["truncation"], 2) == "7 in 1/2"
    assert ar._delay(None, 2) == "never"


def test_docs_tables_are_the_committed_measurement():
    """docs/metrics.md's block is what the script writes from docs/alarm_rates.json (regenerate both together)."""
    summary = json.loads((ROOT / "docs" / "alarm_rates.json").read_text())
    doc = (ROOT / "docs" / "metrics.md").read_text()
    block = doc[doc.index(ar.BEGIN) + len(ar.BEGIN):doc.index(ar.END)].strip()
    assert block == ar.tables(summary).strip()
