"""The agents' stateful stages under DDP: after a 2-process multi-turn run (torchrun, gloo), ArCHer's critic and
replay buffer and TopoCurate's score table are the same on both ranks and learned from both ranks' episodes."""

from __future__ import annotations

import json

from test_ddp_state import SCRIPT, run_two_processes
from test_train import model_dir, small  # noqa: F401  (the session's nano model)


def test_archer_and_topocurate_hold_the_same_state_on_both_ranks(model_dir, tmp_path):  # noqa: F811
    args = small(model_dir, tmp_path / "run", "train.steps=2", "train.save_every=0", "accel.threads=1",
                 "train.eval_size=2", "train.eval_k=1", "task.name=calculator", "task.digits=2",
                 "environment={name: calculator, max_turns: 2, max_total_tokens: 24}", "rewards=[{name: environment}]",
                 "rollout.max_new_tokens=8", "advantage={name: archer, critic_steps: 2, batch_size: 16}",
                 "filters=[{name: topocurate, pool_factor: 2}]")
    run_two_processes(SCRIPT, tmp_path, args)
    s0, s1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert s0["world"] == s1["world"] == 2
    assert json.dumps(s0["stages"], sort_keys=True) == json.dumps(s1["stages"], sort_keys=True)
    archer = s0["stages"]["advantage"]["0:archer"]
    # the buffer holds both ranks' turns: 8 prompts x 4 episodes x >= 1 turn per step, 2 steps
    assert archer["buffer"]["r"]["shape"][0] >= 2 * 8 * 4 and archer["updates"] == 4
    assert len(s0["stages"]["filters"]["0:topocurate"]["score"]) == 2 * 8  # every trained prompt of both ranks
