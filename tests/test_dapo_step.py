"""Direct Advantage Policy Optimization (step level, offline) on the preference driver: the `dapo_step` stage by
hand, step-level pairs (a prefix, EOS only after a final step), training that moves each step's log-ratio toward
its advantage / beta, and `postrl pairs --dapo` (states from the reference's trajectories, two next steps each,
advantages under a PRM critic)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from postrl import registry, stages
from postrl.cli import main
from postrl.errors import DataError
from postrl.reward_models import RMTrainConfig, StepRecord, fit_prm, load_reward_model
from postrl.reward_models.data import check_preferences


@registry.register("reward", "dapo_sum_test", source="test: 1 when the last step is the prompt's sum")
def sum_ok(prompts, completions, **_):
    out = []
    for p, c in zip(prompts, completions):
        a, b = p.rstrip("=").split("+")
        out.append(1.0 if c.split(";")[-1].strip() == str(int(a) + int(b)) else 0.0)
    return out


def test_dapo_step_by_hand():
    """rho_c = -1 - (-2) = 1, A_c / beta = 0.5 / 0.5 = 1 -> 0; rho_r = -3 - (-1) = -2, A_r / beta = -1 -> 1;
    L = (0 + 1) / 2 = 0.5; dL/d logp_c = rho_c - A_c / beta = 0, dL/d logp_r = -1; rewards beta rho = 0.5, -1."""
    st = stages.build("preference", "dapo_step", {"beta": 0.5})
    c, r = torch.tensor([-1.0], requires_grad=True), torch.tensor([-3.0], requires_grad=True)
    loss, info = st({"chosen_logps": c, "rejected_logps": r, "ref_chosen_logps": torch.tensor([-2.0]),
                     "ref_rejected_logps": torch.tensor([-1.0]), "chosen_advantage": torch.tensor([0.5]),
                     "rejected_advantage": torch.tensor([-0.5])})
    assert float(loss[0].detach()) == pytest.approx(0.5)
    loss.sum().backward()
    assert float(c.grad[0]) == pytest.approx(0.0) and float(r.grad[0]) == pytest.approx(-1.0)
    assert info["chosen_rewards"].tolist() == [0.5] and info["rejected_rewards"].tolist() == [-1.0]


def test_step_level_pairs_encode_the_prefix_and_eos_only_after_a_final_step():
    from postrl.models.tiny import build_tokenizer
    from postrl.train.preference import encode_pairs

    tok = build_tokenizer()
    pairs = check_preferences([
        {"prompt": "3+4=", "prefix": "3+4;", "chosen": "7", "rejected": "8;", "chosen_final": True,
         "chosen_advantage": 0.4, "rejected_advantage": -0.4},
        {"prompt": "3+4=", "chosen": "7", "rejected": "8"}])  # a plain pair: EOS after both
    enc, dropped = encode_pairs(tok, pairs, chat_template="none")
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    q = tok("3+4=", add_special_tokens=True)["input_ids"]
    assert dropped == 0 and enc.prompt[0] == q + ids("3+4;") and enc.prompt[1] == q
    eos = tok.eos_token_id
    assert enc.chosen[0] == ids("7") + [eos] and enc.rejected[0] == ids("8;")  # rejected_final defaults false
    assert enc.chosen[1] == ids("7") + [eos] and enc.rejected[1] == ids("8") + [eos]
    assert (pairs[0].chosen_advantage, pairs[0].rejected_advantage) == (0.4, -0.4)
    with pytest.raises(DataError, match=r"^preferences: row 1: field 'chosen_final' must be true or false"):
        check_preferences([{"prompt": "p", "prefix": "", "chosen": "a", "rejected": "b", "chosen_final": "yes"}])


@pytest.fixture(scope="module")
def step_policy(tmp_path_factory) -> Path:
    """A nano model taught (SFT, 60 steps) to answer 'a+b=' in two steps separated by ';': 'a+b;' then the sum (';':
    the tiny character tokenizer has no token for a blank line)."""
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.train.sft import run_sft

    class Sums:
        def train_rows(self, step, n, seed):
            rng = random.Random(seed * 1000 + step)
            return [{"prompt": f"{a}+{b}=", "solution": f"{a}+{b};{a + b}"}
                    for a, b in ((rng.randint(1, 9), rng.randint(1, 9)) for _ in range(n))]

    tok = build_tokenizer()
    model = build_model(tok, size="nano", seed=0)
    run_sft(model, tok, Sums(), steps=60, batch_size=16, lr=1e-2, seed=0, chat_template="none")
    out = tmp_path_factory.mktemp("dapo") / "policy"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def step_rows(path: Path) -> Path:
    """States 'a+b;' with a good final step (the sum, A = +0.6) and a bad one ('x', A = -0.6)."""
    rows = []
    for a in range(1, 9):
        for b in range(1, 4):
            rows.append({"prompt": f"{a}+{b}=", "prefix": f"{a}+{b};", "chosen": str(a + b),
                         "rejected": "x", "chosen_final": True, "rejected_final": True,
                         "chosen_advantage": 0.6, "rejected_advantage": -0.6})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_training_moves_each_step_toward_its_advantage(step_policy, tmp_path):
    """dapo_step on step-level pairs: the loss falls and each step's implicit reward beta * rho moves toward its
    advantage (up for A > 0, down for A < 0)."""
    data = step_rows(tmp_path / "steps.jsonl")
    assert main(["dpo", str(data), "--model", str(step_policy), "--out", str(tmp_path / "run"), "--loss",
                 "dapo_step", "--beta", "1", "--lr", "5e-4", "--batch-size", "24", "--epochs", "10",
                 "--schedule", "constant", "--chat-template", "none", "--eval-fraction", "0", "--accel", "off"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # step 1: policy = reference, rho = 0: L = (0.6^2 + 0.6^2) / 2 = 0.36
    assert lines[0]["loss"] == pytest.approx(0.36, abs=1e-6)
    assert lines[-1]["loss"] < 0.5 * lines[0]["loss"]
    assert lines[-1]["rewards/chosen"] > 0.1 and lines[-1]["rewards/rejected"] < -0.1


def test_missing_advantages_are_one_line(step_policy, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    assert main(["dpo", str(data), "--model", str(step_policy), "--out", str(tmp_path / "o"), "--loss", "dapo_step",
                 "--eval-fraction", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "row 1: loss 'dapo_step' reads each completion's advantage" in err


def test_pairs_dapo_advantages_under_the_prm(step_policy, tmp_path, capsys):
    """postrl pairs --dapo: states are the trajectories' step prefixes (the empty one first), two sampled next
    steps per state, A = V(s + a) - V(s) with V the PRM (its prompt score for the empty prefix) or the verifier's
    outcome after a final step; recomputed here from the PRM and the verifier; the file trains with dapo_step."""
    recs = [StepRecord(f"{a}+{b}=", f"{a}+{b};{a + b + e}", [0.6, 1.0 if e == 0 else 0.0])
            for a in range(1, 9) for b in range(1, 9) for e in (0, 1)]
    prm_dir = tmp_path / "prm"
    fit_prm("bag:4", recs, RMTrainConfig(lr=3e-2, epochs=2), max_length=32, delimiter=";").save_pretrained(prm_dir)
    out = tmp_path / "steps.jsonl"
    rc = main(["pairs", "--model", str(step_policy), "--out", str(out), "--dapo", str(prm_dir), "--verifier",
               "dapo_sum_test", "--prompts", "8", "--max-states", "2", "task.name=arithmetic", "task.digits=1",
               "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.temperature=1.0",
               "train.prompts_per_step=8", "rewards=[{name: dapo_sum_test}]", "model.chat_template=none"])
    said = capsys.readouterr()
    assert rc == 0, said.err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows and "states=" in said.out
    prm = load_reward_model(prm_dir)
    assert "" in {r["prefix"] for r in rows} and any(r["prefix"] for r in rows)  # first steps and later ones
    assert any(r["chosen_final"] or r["rejected_final"] for r in rows)
    assert any(not (r["chosen_final"] and r["rejected_final"]) for r in rows)
    for r in rows:
        if r["prefix"]:
            sc = prm.step_scores([r["prompt"]], [r["prefix"]])[0]
            v_s = [v for v in sc.tolist() if v == v][-1]
        else:
            v_s = float(prm.prompt_scores([r["prompt"]])[0][0])
        assert r["value"] == pytest.approx(v_s, abs=1e-6)
        for side in ("chosen", "rejected"):
            text = r["prefix"] + r[side]
            if r[f"{side}_final"]:
                v = sum_ok([r["prompt"]], [text])[0]
            else:
                assert r[side].endswith(";")
                v = [x for x in prm.step_scores([r["prompt"]], [text])[0].tolist() if x == x][-1]
            assert r[f"{side}_advantage"] == pytest.approx(v - v_s, abs=1e-6), (r, side)
        assert r["chosen_advantage"] >= r["rejected_advantage"]
    assert main(["dpo", str(out), "--model", str(step_policy), "--out", str(tmp_path / "run"), "--loss", "dapo_step",
                 "--chat-template", "none", "--eval-fraction", "0", "--lr", "1e-3"]) == 0
    assert main(["pairs", "--model", str(step_policy), "--out", str(out), "--dapo", str(tmp_path / "nope"),
                 "task.name=arithmetic", "rollout.group_size=2"]) == 2
    assert "nope" in capsys.readouterr().err
