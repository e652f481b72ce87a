"""postrl's diagnostics on runs postrl did not train: TRL's own GRPOTrainer (a real run on a tiny model, CPU), verl's
own file logger, a W&B offline run; the alarms inside plain TRL (AlarmCallback) and verl (verl_step, the Tracking
hook); the one metric-name mapping and the doc tables generated from it."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import pickle
import re
from pathlib import Path

import pytest

from postrl.cli import main as cli_main
from postrl.diagnostics import engines
from postrl.diagnostics.foreign import ForeignWatchdog
from postrl.diagnostics.monitors import MONITORS, unread
from postrl.errors import PostrlError
from postrl.report.doctor import diagnose
from postrl.report.foreign import read_training_args
from postrl.report.rundir import load_run

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
POSTRL_KEY = re.compile(r"(?<![\w.])(rollout|optim|loss|train)\.\w|(?<![\w.])kl\.coef|\b(filters|shaping|regularizers|"
                        r"advantage): ")  # a postrl config key (not the tail of an engine's dotted option)


def _doctor_json(path) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["doctor", str(path), "--json"]) == 0
    return json.loads(out.getvalue())


def _doctor_text(path) -> str:
    from rich.console import Console

    from postrl.report.doctor import render

    con = Console(record=True, width=200, file=io.StringIO())
    render(diagnose(path), con)
    return con.export_text()


# ------------------------------------------------------------------------------------------------ the mapping


def test_metrics_doc_tables_are_generated_from_the_mapping():
    """docs/metrics.md's name tables are engines.SECTIONS / OPTIONS (python -m postrl.diagnostics docs/metrics.md)."""
    text = DOC.read_text()
    assert engines.update_doc(text) == text, "regenerate: python -m postrl.diagnostics docs/metrics.md"
    for name in engines.generated_blocks():
        assert f"<!-- generated: {name} " in text


def test_translate_reads_exact_names_converts_and_keeps_postrl_own_metrics():
    row = engines.translate("trl", {"rewards/acc/mean": 0.5, "completions/clipped_ratio": 0.25,
                                    "tools/failure_frequency": 0.2, "loss": 0.1, "frac_reward_zero_std": 0.75,
                                    "postrl/entropy": 1.5, "entropy": 9.0, "postrl/alarm/truncation": 1.0,
                                    "num_tokens": 300.0})
    assert row["reward/acc/mean"] == 0.5 and row["truncated/frac"] == 0.25 and row["pg_loss"] == 0.1
    assert row["turns/tool_success"] == pytest.approx(0.8)  # 1 - failures / calls
    assert row["zero_variance_groups/frac"] == 0.75
    assert row["entropy"] == 1.5  # postrl's own metric (adapter / plug-in) wins over the engine's
    assert not any(k.startswith("postrl/") for k in row)  # alarm flags are not metrics
    assert row["num_tokens"] == 300.0 and "tokens/completion" not in row  # cumulative: shown, not read
    v = engines.translate("verl", {"critic/score/min": 1.0, "critic/score/max": 1.0, "response_length/clip_ratio": 0.5,
                                   "actor/pg_clipfrac": 0.3, "actor/kl_loss": 0.01, "critic/advantages/mean": 0.0})
    assert v["zero_variance_groups/frac"] == 1.0 and v["truncated/frac"] == 0.5 and v["clip_region"] == 0.3
    assert v["kl"] == 0.01 and "advantages/mean" not in v  # verl's advantages are over tokens: not read
    w = engines.translate("verl", {"critic/score/min": 0.0, "critic/score/max": 1.0})
    assert math.isnan(w["zero_variance_groups/frac"])  # some rewards differ: the fraction is unknown


def test_every_alarm_an_engine_can_feed_has_that_engines_fix():
    for engine in ("trl", "verl"):
        fed = {a.key for _, rows in engines.SECTIONS.values() for m in rows for a in m.aliases(engine) if a.read}
        fed.add("zero_variance_groups/frac")  # verl: derived
        feedable = {s.name for s in MONITORS} - {s.name for s, _ in unread(fed)}
        assert {"truncation", "zero_variance_groups", "entropy_collapse", "kl_blowup", "clip_fractions",
                "length_drift", "nan_guard"} <= feedable
        missing = [n for n in feedable if not any(k == n or k.startswith(n + ":") for k in engines.FIXES[engine])]
        assert not missing, f"{engine}: no fix in its options for {missing}"


def _rows(engine: str, n: int, **series) -> list[dict]:
    return [{k: (v(i) if callable(v) else v) for k, v in series.items()} for i in range(n)]


@pytest.mark.parametrize("engine,alarm,series", [
    ("trl", "truncation", {"completions/clipped_ratio": 0.9}),
    ("trl", "zero_variance_groups", {"frac_reward_zero_std": 1.0, "reward": 0.0, "reward_std": 0.0}),
    ("trl", "entropy_collapse", {"entropy": lambda i: 2.0 if i < 5 else 0.001}),
    ("trl", "kl_blowup", {"kl": 2.0}),
    ("trl", "clip_fractions", {"clip_ratio/low_mean": 0.2, "clip_ratio/high_mean": 0.2}),
    ("trl", "length_drift", {"completions/mean_length": lambda i: 5.0 if i < 10 else 40.0}),
    ("trl", "nan_guard", {"loss": float("nan")}),
    ("trl", "logprob_mismatch", {"sampling/sampling_logp_difference/mean": 0.3}),
    ("trl", "tool_errors", {"tools/failure_frequency": 0.9, "tools/call_frequency": 2.0}),
    ("verl", "truncation", {"response_length/clip_ratio": 0.9}),
    ("verl", "zero_variance_groups", {"critic/score/min": 0.0, "critic/score/max": 0.0}),
    ("verl", "entropy_collapse", {"actor/entropy": lambda i: 2.0 if i < 5 else 0.001}),
    ("verl", "kl_blowup", {"actor/ppo_kl": 1.0}),
    ("verl", "clip_fractions", {"actor/pg_clipfrac": 0.5}),
    ("verl", "length_drift", {"response_length/mean": lambda i: 40.0 if i < 10 else 5.0}),
    ("verl", "nan_guard", {"actor/grad_norm": float("nan")}),
])
def test_alarms_on_engine_metrics_name_that_engines_options(engine, alarm, series):
    said = []
    w = ForeignWatchdog(engine, {"max_completion_length": 64, "num_generations": 8} if engine == "trl" else
                        {"data": {"max_response_length": 512}}, say=said.append)
    fired = []
    for i, row in enumerate(_rows(engine, 20, **series)):
        fired += [a for a in w.step(row, i + 1) if a.name == alarm]
    assert fired, f"{alarm} did not fire on {engine}'s metrics"
    a = fired[-1]
    assert "postrl's options" not in a.fix and not POSTRL_KEY.search(a.fix), a.fix
    assert not any(k in a.message for k in ("rollout.max_new_tokens", "kl.coef", "train.epochs")), a.message
    if alarm == "truncation":
        assert ("max_completion_length=64" if engine == "trl" else "data.max_response_length=512") in a.message
        assert ("mask_truncated_completions=True" if engine == "trl" else "data.max_response_length") in a.fix
    if alarm == "zero_variance_groups":
        assert ("num_generations (now 8)" if engine == "trl" else "algorithm.filter_groups.enable=true") in a.fix
    assert sum("monitors skipped" in s for s in said) == 1  # said once, whatever the number of steps


def test_trl_rows_of_a_reward_that_is_never_finite_raise_nan_guard():
    """TRL 1.16 logs None for a metric whose every value was NaN: a reward function returning NaN (or None) on every
    completion gives rows like these (copied from a plain GRPOTrainer run of scripts/alarm_rates.py): every
    completion unscorable, advantages 0, nothing learns, frac_reward_zero_std 0. No alarm fired before."""
    said = []
    w = ForeignWatchdog("trl", {"learning_rate": 3e-4, "max_completion_length": 16}, say=said.append)
    row = {"loss": 0.0, "grad_norm": 0.0, "learning_rate": 3e-4, "completions/mean_length": 8.7,
           "completions/clipped_ratio": 0.0, "rewards/nan/mean": None, "rewards/nan/std": None, "reward": None,
           "reward_std": None, "frac_reward_zero_std": 0.0, "kl": 0.0, "entropy": 0.236, "clip_ratio/region_mean": 0.0}
    assert math.isnan(engines.translate("trl", row)["reward/mean"])
    fired = w.step(dict(row), 1)
    assert [a.name for a in fired] == ["nan_guard"] and fired[0].severity == "error"
    a = fired[0]
    assert "no completion got a finite reward" in a.message and "fix the reward function" in a.fix
    assert "learning_rate" not in a.fix  # the model is fine: not the fix of an overflow
    assert not POSTRL_KEY.search(a.fix), a.fix
    # a reward function returning None for a whole batch beside one that scores (a multi-task run: None is "does
    # not apply") is no alarm
    ok = {**row, "rewards/other/mean": 0.4, "reward": 0.4, "reward_std": 0.3, "frac_reward_zero_std": 0.2}
    assert ForeignWatchdog("trl", say=said.append).step(ok, 1) == []


def test_skipped_monitors_name_the_engines_metric():
    said = []
    w = ForeignWatchdog("trl", say=said.append)
    w.step({"completions/clipped_ratio": 0.0, "reward": 1.0}, 1)
    w.step({"completions/clipped_ratio": 0.0, "reward": 1.0}, 2)
    assert len(said) == 1
    assert "kl_blowup (kl)" in said[0] and "entropy_collapse (entropy)" in said[0]
    assert "truncation" not in said[0].replace("turn_truncation", "")  # it reads completions/clipped_ratio
    assert w.step({"eval_reward": 1.0}, 3) == []  # an evaluation row is not a training step


class _Evil:
    """Unpickling it calls os.system (what a hostile training_args.bin could do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _Args:
    pass


def test_training_args_are_read_without_running_code(tmp_path):
    marker = tmp_path / "pwned"
    a = _Args()
    a.__dict__.update(max_completion_length=16, num_generations=4, hook=_Evil(marker))
    f = tmp_path / "training_args.bin"
    f.write_bytes(pickle.dumps(a, protocol=2))
    got = read_training_args(f)
    assert got["max_completion_length"] == 16 and got["num_generations"] == 4
    assert not marker.exists()  # os.system was never called: the pickle's classes become plain records
    f.write_bytes(b"not a pickle")
    with pytest.raises(PostrlError, match="unreadable training arguments"):
        read_training_args(f)


def test_trl_folder_uses_the_checkpoint_with_most_steps(tmp_path):
    def state(d: Path, steps: int):
        d.mkdir(parents=True)
        d.joinpath("trainer_state.json").write_text(json.dumps({
            "global_step": steps, "max_steps": 10, "log_history": [
                {"step": s, "completions/clipped_ratio": 1.0, "frac_reward_zero_std": 0.0, "entropy": 1.0}
                for s in range(1, steps + 1)] + [{"step": steps, "eval_reward": 0.5}]}))

    state(tmp_path / "out" / "checkpoint-2", 2)
    state(tmp_path / "out" / "checkpoint-6", 6)
    run = load_run(tmp_path / "out")
    assert run.engine == "trl" and run.steps_done == 6 and run.steps_planned == 10 and not run.finished
    assert [c for c, _ in run.checkpoints()] == [2, 6] and run.evals[0]["reward/mean"] == 0.5
    d = diagnose(tmp_path / "out")
    assert d.status in ("running", "stopped") and [a["name"] for a in d.alarms] == ["truncation"]
    assert any("no training_args.bin" in n for n in d.notes)
    assert "trainer.train(resume_from_checkpoint=" in _doctor_text(tmp_path / "out")


def test_not_a_run_is_one_line(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(PostrlError, match="not a run postrl reads"):
        load_run(tmp_path)


# ------------------------------------------------------------------------------------------------ TRL


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """TRL's own GRPOTrainer, no postrl stage: a constant reward and max_completion_length=3 (a random tiny model
    never ends within 3 tokens), AlarmCallback attached, W&B offline when wandb is installed."""
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import importlib.util

    from accelerate.state import AcceleratorState
    from trl import GRPOConfig, GRPOTrainer

    from postrl.integrations.alarms import AlarmCallback
    from postrl.models.tiny import build_local

    root = tmp_path_factory.mktemp("trl-foreign")
    build_local(root / "model", size="nano")
    wandb = importlib.util.find_spec("wandb") is not None
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(root), "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    said: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    handler = Grab(level=logging.WARNING)
    logging.getLogger("postrl.alarms").addHandler(handler)
    try:
        args = GRPOConfig(output_dir=str(root / "out"), use_cpu=True, report_to="wandb" if wandb else "none",
                          save_strategy="steps", save_steps=4, disable_tqdm=True, seed=7, max_steps=4,
                          logging_steps=1, num_generations=4, per_device_train_batch_size=8, max_completion_length=3,
                          learning_rate=1e-3, gradient_checkpointing=False)
        cb = AlarmCallback()
        trainer = GRPOTrainer(model=str(root / "model"), reward_funcs=lambda prompts, completions, **kw:
                              [1.0] * len(completions), args=args, callbacks=[cb], train_dataset=datasets.Dataset
                              .from_list([{"prompt": f"{i} + {i + 1} ="} for i in range(16)]))
        trainer.train()
        if wandb:
            import wandb as wb

            wb.finish()  # what the end of the user's process does: the offline run is complete on disk
    finally:
        logging.getLogger("postrl.alarms").removeHandler(handler)
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        AcceleratorState._reset_state(True)
    return {"out": root / "out", "wandb": root / "wandb" if wandb else None, "callback": cb, "trainer": trainer,
            "said": said}


def test_alarm_callback_fires_inside_a_plain_trl_run(trl_run):
    cb, trainer, said = trl_run["callback"], trl_run["trainer"], trl_run["said"]
    names = {(a.step, a.name) for a in cb.alarms}
    # every completion is truncated and every group's rewards are equal from step 1: truncation has patience 2,
    # zero_variance_groups 3
    assert {(2, "truncation"), (3, "zero_variance_groups"), (4, "truncation")} <= names
    rows = {r["step"]: r for r in trainer.state.log_history if "completions/clipped_ratio" in r}
    assert "postrl/alarm/truncation" not in rows[1] and rows[2]["postrl/alarm/truncation"] == 1.0
    assert rows[4]["postrl/alarm/zero_variance_groups"] == 1.0  # TRL's logs (trainer_state.json) carry the flags
    alarm_lines = [s for s in said if s.startswith("postrl alarm")]
    assert len(alarm_lines) == 2  # each alarm printed at the first step of its streak only
    assert any("max_completion_length=3" in s and "mask_truncated_completions=True" in s for s in alarm_lines)
    assert sum("monitors skipped" in s for s in said) == 1


def test_doctor_diagnoses_a_trl_output_folder(trl_run):
    d = _doctor_json(trl_run["out"])
    assert d["engine"] == "trl" and d["status"] == "finished" and d["steps_done"] == d["steps_planned"] == 4
    by = {a["name"]: a for a in d["alarms"]}
    assert set(by) == {"truncation", "zero_variance_groups"} and d["primary"] == "truncation"  # the root cause first
    assert by["truncation"]["message"].startswith("100% of completions truncated at max_completion_length=3")
    assert "max_completion_length (now 3)" in by["truncation"]["fix"]
    assert "mask_truncated_completions=True" in by["truncation"]["fix"]
    assert "num_generations (now 4)" in by["zero_variance_groups"]["fix"]
    assert "every completion got reward 1" in by["zero_variance_groups"]["message"]
    for a in d["alarms"]:
        assert not POSTRL_KEY.search(a["fix"]), a["fix"]
    skipped = [n for n in d["notes"] if n.startswith("monitors skipped")]
    assert len(skipped) == 1 and "kl_blowup (kl)" in skipped[0]  # beta=0: TRL logs no kl
    text = _doctor_text(trl_run["out"])
    assert "TRL (trainer_state.json of checkpoint-4; settings from checkpoint-4/training_args.bin)" in text


def test_doctor_reads_the_trl_run_through_wandb_offline(trl_run):
    if trl_run["wandb"] is None:
        pytest.skip("wandb is not installed: the W&B reader needs it")
    d = _doctor_json(trl_run["wandb"])  # the wandb folder: its latest run, read offline by the wandb package
    assert d["engine"] == "trl" and d["steps_done"] == 4 and d["status"] == "finished"
    assert {a["name"] for a in d["alarms"]} == {"truncation", "zero_variance_groups"}
    assert "max_completion_length (now 3)" in d["alarms"][0]["fix"]  # the settings come from the W&B config


# ------------------------------------------------------------------------------------------------ verl


def _verl_batch(n: int = 8, t: int = 6):
    """A verl batch after advantages: every response fills the response width (t tokens) and scores 1."""
    import numpy as np
    import torch
    from verl import DataProto

    mask = torch.ones(n, t)
    scores = torch.zeros(n, t)
    scores[:, -1] = 1.0
    return DataProto.from_dict(
        tensors={"token_level_scores": scores, "token_level_rewards": scores, "advantages": scores * 0,
                 "returns": scores * 0, "response_mask": mask, "prompts": torch.ones(n, 3, dtype=torch.long),
                 "responses": torch.ones(n, t, dtype=torch.long),
                 "attention_mask": torch.cat([torch.ones(n, 3), mask], -1).long()},
        non_tensors={"uid": np.array([str(i // 2) for i in range(n)], dtype=object)})


def _verl_metrics():
    """verl's own data metrics of that batch (its compute_data_metrics, without the postrl plug-in's wrapper) plus
    the actor's metrics as its dp_actor names them."""
    from verl.trainer.ppo import metric_utils

    compute = getattr(metric_utils.compute_data_metrics, "original", metric_utils.compute_data_metrics)
    m = compute(batch=_verl_batch(), use_critic=False)
    m.update({"actor/entropy": 2.0, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/grad_norm": 0.5,
              "actor/lr": 1e-6})
    return m


def test_doctor_diagnoses_verl_file_logger_metrics(tmp_path, monkeypatch):
    pytest.importorskip("verl")
    from verl.utils.tracking import Tracking

    path = tmp_path / "verl" / "run.jsonl"
    path.parent.mkdir()
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracker = Tracking("p", "e", default_backend="file")  # verl's own logger, as its trainer makes it
    for step in range(1, 6):
        m = _verl_metrics()
        assert m["response_length/clip_ratio"] == 1.0 and m["critic/score/min"] == m["critic/score/max"] == 1.0
        tracker.log(data=m, step=step)
    tracker.finish()
    for target in (path, path.parent):  # the file, or the folder holding it
        d = _doctor_json(target)
        assert d["engine"] == "verl" and d["steps_done"] == 5 and d["status"] in ("running", "ended")
        by = {a["name"]: a for a in d["alarms"]}
        assert set(by) == {"truncation", "zero_variance_groups"} and d["primary"] == "truncation"
        assert "truncated at data.max_response_length" in by["truncation"]["message"]
        assert "raise data.max_response_length" in by["truncation"]["fix"]
        assert "overlong_buffer_cfg" in by["truncation"]["fix"]
        assert "algorithm.filter_groups.enable=true" in by["zero_variance_groups"]["fix"]
        assert "actor_rollout_ref.rollout.n" in by["zero_variance_groups"]["fix"]
    assert "verl (file logger JSON lines)" in _doctor_text(path)


def test_verl_step_entry_point_and_tracking_hook(tmp_path, monkeypatch):
    pytest.importorskip("verl")
    import importlib
    import sys

    from verl.utils import tracking

    monkeypatch.setattr(tracking.Tracking, "__init__", tracking.Tracking.__init__)
    monkeypatch.setattr(tracking.Tracking, "log", tracking.Tracking.log)
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "postrl.integrations.alarms")
    monkeypatch.delitem(sys.modules, "postrl.integrations.alarms", raising=False)
    alarms = importlib.import_module("postrl.integrations.alarms")  # as verl imports an external module
    assert tracking.Tracking.log.postrl_alarms
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "m.jsonl"))
    tr = tracking.Tracking("p", "e", default_backend="file", config={"data": {"max_response_length": 6}})
    for step in range(1, 4):
        tr.log(data=_verl_metrics(), step=step)
    tr.finish()
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert "postrl/alarm/truncation" not in lines[0]["data"]  # patience 2
    assert lines[1]["data"]["postrl/alarm/truncation"] == 1.0 and lines[2]["data"]["postrl/alarm/zero_variance_groups"]
    msgs = [a.message for a in tr.postrl_alarms.alarms]
    assert any("truncated at data.max_response_length=6" in m for m in msgs)  # the config given to Tracking
    # the plain function a trainer loop calls with each step's metrics dict
    v = alarms.VerlAlarms({"data.max_response_length": 6})
    flags = [v(_verl_metrics(), s) for s in (1, 2, 3)]
    assert flags[0] == {} and flags[1] == {"postrl/alarm/truncation": 1.0}
    assert flags[2] == {"postrl/alarm/truncation": 1.0, "postrl/alarm/zero_variance_groups": 1.0}
    assert alarms.verl_step(_verl_metrics(), 1) == {}


# ------------------------------------------------------------------------------------------------ report


def test_report_of_trl_and_verl_runs(trl_run, tmp_path):
    from postrl.report.html import build_report

    verl_file = tmp_path / "verl.jsonl"
    verl_file.write_text("\n".join(json.dumps({"step": s, "data": {
        "critic/score/mean": 0.5, "critic/score/min": 0.0, "critic/score/max": 1.0, "response_length/mean": 10.0,
        "response_length/clip_ratio": 0.0, "actor/entropy": 1.0, "actor/pg_clipfrac": 0.4, "actor/grad_norm": 0.5}})
        for s in range(1, 5)) + "\n")
    out = build_report([trl_run["out"], verl_file], tmp_path / "r.html")
    html = out.read_text()
    assert "out (TRL)" in html and "verl.jsonl (verl)" in html
    assert "max_completion_length (now 3)" in html  # TRL's alarm with TRL's option
    assert "actor_rollout_ref.actor.ppo_epochs" in html  # verl's clip fraction 0.4 > 0.2: verl's fix
    assert "data-plot='length'" in html and "data-plot='clip'" in html
