"""Stateful stages under DDP: after a few steps of a 2-process run (torchrun, DDP over gloo, as `accelerate launch
--cpu --num_processes 2 -m postrl train` starts it: postrl/launch.py),
every stateful stage holds the same state on both ranks, and that state learned from both processes' rows (one
gather of every stage's records at the end of each step, `postrl.stages.end_step`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from test_train import free_port, model_dir, small  # noqa: F401  (model_dir: the session's nano model)

STATEFUL = [
    "shaping=[{name: weighted_sum}, {name: running_norm}, {name: dataset_median, key: task}, "
    "{name: adaptive_length_coef, max_length: 4, lr: 0.5}, {name: laser_d, max_length: 4, update_every: 1}, "
    "{name: weighted_sum}]",
    "filters=[{name: pass_rate_curriculum, pool_factor: 2}]",
    "advantage={name: gae, value_epochs: 1}",
    "regularizers=[{name: adaptive_entropy, target: 0.5, coef: 0.0}]",
]

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from postrl.config import load_config
    from postrl.train.trainer import Trainer

    out = Path(sys.argv[1])
    cfg = load_config(None, sys.argv[2:])
    tr = Trainer(cfg, cfg.output_dir)
    tr.train()
    (out / f"rank{tr.rank}.json").write_text(json.dumps({"world": tr.world, "stages": tr.step.state_dict()}))
""")



def run_two_processes(script: str, tmp_path, args: list[str]) -> None:
    """Run ``script`` (a Python source: argv is the folder, then ``args``) under torchrun, 2 processes, DDP over
    gloo on the CPU (also where a GPU is present), rendezvous on a free port; fails the test with its stderr."""
    path = tmp_path / "run.py"
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
           str(path), str(tmp_path), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]


def test_every_stateful_stage_holds_the_same_state_on_both_ranks(model_dir, tmp_path):  # noqa: F811
    run_two_processes(SCRIPT, tmp_path, small(model_dir, tmp_path / "run", "train.steps=3", "train.save_every=0",
                                              "accel.threads=1", "train.eval_size=4", "train.eval_k=1", *STATEFUL))
    s0, s1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert s0["world"] == s1["world"] == 2
    a, b = s0["stages"], s1["stages"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    # the state learned from both processes' rows: running_norm merged every scored row of both ranks (8 prompts x
    # 4 completions per round, at least one round per step, 3 steps)
    count = a["shaping"]["1:running_norm"]["stats"]["correct"][0]
    assert count >= 3 * 8 * 4 and count % 4 == 0
    hist = a["shaping"]["2:dataset_median"]["history"]
    assert sum(len(v) for v in hist.values()) >= 3 * 8 * 4  # every rank's rewards, per column and dataset
    rates = a["filters"]["0:pass_rate_curriculum"]["rate"]
    assert len(rates) >= 8  # prompts of both ranks were recorded (each rank generates 4 of the 8 per round)
    head = a["advantage"]["0:gae"]["head"]
    weights = [v for row in head["weight"]["__tensor__"] for v in row]
    assert any(v != 0 for v in weights)  # the value head was fitted (from zeros), its gradients averaged


def test_discriminator_and_hwe_threshold_are_the_same_on_both_ranks(model_dir, tmp_path):  # noqa: F811
    """ares' smoothed HWE threshold and chi2_occupancy's discriminator (trained once per step on both ranks'
    tokens, gathered in rank order) come out identical on both ranks."""
    run_two_processes(SCRIPT, tmp_path, small(
        model_dir, tmp_path / "run", "train.steps=2", "train.save_every=0", "accel.threads=1", "train.eval_size=4",
        "train.eval_k=1", "advantage={name: ares, window: 1}",
        "regularizers=[{name: chi2_occupancy, coef: 0.1, max_tokens: 64}, {name: ares_kl, coef: 0.0}]"))
    s0, s1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    a, b = s0["stages"], s1["stages"]
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["regularizers"]["0:chi2_occupancy"]["steps"] == 2 and a["regularizers"]["0:chi2_occupancy"]["net"]
    assert a["advantage"]["0:ares"]["tau"] > 0


@pytest.mark.parametrize("n", [1])
def test_one_process_gathers_its_own_records(n):
    """The gather is the identity on one process: records are applied once, in order, then forgotten."""
    from postrl import stages

    st = stages.build("shaping", "running_norm")
    import torch

    fields = {"rewards": torch.tensor([[1.0], [3.0]]), "reward_names": ["correct"]}
    st.observe(fields)
    st.observe(fields)
    out = stages.end_step([st], stages.StepEnd())
    assert out == {} and st.fn.stats["correct"][0] == 4.0 and st.fn.observed == []
    stages.end_step([st], stages.StepEnd())
    assert st.fn.stats["correct"][0] == 4.0  # nothing recorded: nothing applied again
