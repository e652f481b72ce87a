"""Reward models that keep learning: `model_online` (Cooper) -- pair selection, the one Bradley-Terry step of
end_step against a hand-written step, every process's pairs, the checkpoint state, exact resume inside
`postrl train`, and the one-line refusal of a run without a verifier."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from postrl import registry, stages
from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.reward_models import PreferencePair, RMTrainConfig, fit_reward_model, fit_prm, StepRecord
from postrl.reward_models.train import online_step
from postrl.stages import StepEnd
from test_ddp_state import run_two_processes
from test_train import crash_in_step, metrics, model_dir, resume, run_inprocess  # noqa: F401 - model_dir: fixture


@registry.register("reward", "has_digit_test", source="test: 1 when the completion holds a digit")
def has_digit(prompts, completions, **_):
    """1.0 when the completion contains a digit, else 0.0 (a verifier random policies satisfy about half the time)."""
    return [1.0 if any(ch.isdigit() for ch in c) else 0.0 for c in completions]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    """A small bag-of-tokens Bradley-Terry model (it prefers completions that start with '2')."""
    out = tmp_path_factory.mktemp("rm") / "rm"
    pairs = [PreferencePair("1+1=", "2" + "a" * (i % 5), "x" + "b" * (i % 3), row=i + 1) for i in range(20)]
    fit_reward_model("bag:4", pairs, RMTrainConfig(lr=1e-2), max_length=32).save_pretrained(out)
    return out


def build(rm_dir, **kw):
    return stages.build("reward", "model_online", {"path": str(rm_dir), "verifier": "v", **kw})


def test_pairs_are_the_ones_the_model_ranks_worst(rm_dir):
    """Per group: C = verifier >= threshold, W = below; the max_pairs pairs of C x W with the largest
    r(w) - r(c), recorded as (prompt, chosen = c, rejected = w); a NaN label labels nothing; a group without both
    sets gives none."""
    st = build(rm_dir, max_pairs=2)
    prompts = ["p"] * 4 + ["q"] * 2 + ["r"] * 2
    comps = ["2a", "2aaa", "xb", "xbb", "2", "x", "2b", "xa"]
    label = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, math.nan])
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    s = st.fn.scores(prompts, comps).tolist()
    # group 0: C = {0, 1}, W = {2, 3}; the two largest s[w] - s[c] among the four
    cand = sorted(((s[w] - s[c], c, w) for c in (0, 1) for w in (2, 3)), reverse=True)[:2]
    want = [("p", comps[c], comps[w]) for _, c, w in cand]
    assert st.fn.pairs(prompts, comps, gids, label) == want  # group 1: no incorrect; group 2: row 7 unlabelled
    st.observe({"prompts": prompts, "completions": comps, "group_ids": gids,
                "raw_rewards": torch.stack([label, torch.zeros(8)], 1), "raw_reward_names": ["v", "model_online"]})
    assert st.fn.observed == want
    # threshold 0.5 and max_pairs 1: the single worst-ranked pair
    st1 = build(rm_dir, threshold=0.5)
    assert st1.fn.pairs(prompts, comps, gids, label) == want[:1]


def test_end_step_is_one_adamw_step_of_the_bradley_terry_loss(rm_dir):
    """end_step = L = mean_i -log sigma(r(c_i) - r(w_i)) over every pair, one AdamW step (clip 1.0), written out
    by hand on a copy of the model; the metrics are the loss and accuracy before the step."""
    st = build(rm_dir, lr=0.05)
    pairs = [("p", "2a", "xb"), ("p", "2aa", "x"), ("q", "xx", "2")]
    st.fn._ensure()
    ref = copy.deepcopy(st.fn.model)
    body = [p for n, p in ref.named_parameters() if not n.startswith("beta_raw")]
    opt = torch.optim.AdamW(body, lr=0.05, weight_decay=0.0)
    ref.train()
    r = ref.score  # (no grad: only to compute the expected metrics)
    before_c = r([p for p, _, _ in pairs], [c for _, c, _ in pairs])[:, 0]
    before_w = r([p for p, _, _ in pairs], [w for _, _, w in pairs])[:, 0]
    ids, mask = ref.collate([x for x, _ in ref.encode_many([p for p, _, _ in pairs], [c for _, c, _ in pairs])]
                            + [x for x, _ in ref.encode_many([p for p, _, _ in pairs], [w for _, _, w in pairs])])
    ref.train()
    out = ref(ids, mask)[:, 0]
    loss = -F.logsigmoid(out[:3] - out[3:]).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(body, 1.0)
    opt.step()

    for p in pairs:
        st.fn.record(p)
    m = stages.end_step([st], StepEnd())
    assert m["reward/model_online/pairs"] == 3.0 and m["reward/model_online/updates"] == 1.0
    assert m["reward/model_online/loss"] == pytest.approx(float(-F.logsigmoid(before_c - before_w).mean()), abs=1e-6)
    assert m["reward/model_online/pair_accuracy"] == pytest.approx(float((before_c > before_w).float().mean()))
    for (n, a), (_, b) in zip(st.fn.model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(a, b, atol=1e-7), n
    assert st.fn.observed == []  # forgotten once applied


def test_micro_batches_do_not_change_the_step(rm_dir):
    """online_step accumulates (B / P) * mean over micro-batches: batch_size 1 and 32 give the same gradient, so
    the same weights after an SGD step (SGD: AdamW would amplify the float noise of the head's bias, whose
    Bradley-Terry gradient is exactly 0 since r(c) - r(w) cancels it)."""
    from postrl.reward_models import load_reward_model

    pairs = [("p", "2a" * k, "x" * (k + 1)) for k in range(1, 6)]
    outs = []
    for bs in (1, 32):
        m = load_reward_model(rm_dir)
        opt = torch.optim.SGD([p for n, p in m.named_parameters() if not n.startswith("beta_raw")], lr=0.5)
        online_step(m, opt, *zip(*pairs), batch_size=bs)
        outs.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)


def test_every_process_pairs_are_applied_once(rm_dir):
    """stages.end_step gathers every process's records: two ranks' pairs make one step on their union, and each
    process (same start, same gathered pairs) ends with the same weights."""
    mine, theirs = [("p", "2a", "xb")], [("q", "2", "x"), ("q", "2b", "xx")]
    a, b, both = build(rm_dir, lr=0.05), build(rm_dir, lr=0.05), build(rm_dir, lr=0.05)
    for p in mine:
        a.fn.record(p)
    for p in theirs:
        b.fn.record(p)
    for p in mine + theirs:
        both.fn.record(p)
    ma = stages.end_step([a], StepEnd(gather=lambda obj: [obj, [list(theirs)]]))
    mb = stages.end_step([b], StepEnd(gather=lambda obj: [[list(mine)], obj]))
    stages.end_step([both], StepEnd())
    assert ma["reward/model_online/pairs"] == mb["reward/model_online/pairs"] == 3.0
    probe = (["p", "q"], ["2aa", "xbx"])
    assert torch.equal(a.fn.scores(*probe), b.fn.scores(*probe))
    assert torch.equal(a.fn.scores(*probe), both.fn.scores(*probe))


def test_state_dict_round_trips_through_json(rm_dir):
    """The weights and AdamW state go through postrl.jsonstate (JSON); a stage loaded from them scores and steps
    exactly as the original."""
    st = build(rm_dir, lr=0.05)
    st.fn.record(("p", "2a", "xb"))
    stages.end_step([st], StepEnd())
    state = json.loads(json.dumps(st.state_dict()))
    other = build(rm_dir, lr=0.05)
    other.load_state_dict(state)
    probe = (["p", "q", "r"], ["2a", "x", "2bb"])
    assert torch.equal(st.fn.scores(*probe), other.fn.scores(*probe)) and other.fn.updates == 1
    for s in (st, other):
        s.fn.record(("q", "2", "xx"))
        stages.end_step([s], StepEnd())
    assert torch.equal(st.fn.scores(*probe), other.fn.scores(*probe))
    assert build(rm_dir).state_dict() == {}  # never loaded: nothing to save


def test_online_training_learns_the_verifier(rm_dir):
    """Steps of verifier-labelled pairs (correct = holds a digit) teach the model to rank correct above incorrect
    completions it has never seen: held-out pairwise accuracy rises from below 0.5 to above 0.9."""
    import random

    st = build(rm_dir, lr=0.05, max_pairs=4)
    rng = random.Random(0)

    def completion():
        n = rng.randint(1, 4)
        return "".join(rng.choice("ab2x7") for _ in range(n))

    held = [(completion(), completion()) for _ in range(200)]
    held = [(c, w) for c, w in held if has_digit([], [c])[0] == 1.0 and has_digit([], [w])[0] == 0.0]

    def accuracy() -> float:
        sc = st.fn.scores(["q"] * len(held), [c for c, _ in held])
        sw = st.fn.scores(["q"] * len(held), [w for _, w in held])
        return float((sc > sw).float().mean())

    before = accuracy()
    for _ in range(40):
        comps = [completion() for _ in range(16)]
        label = torch.tensor(has_digit([], comps))
        st.observe({"prompts": ["q"] * 16, "completions": comps, "group_ids": torch.arange(16) // 8,
                    "raw_rewards": label[:, None], "raw_reward_names": ["v"]})
        stages.end_step([st], StepEnd())
    assert len(held) > 20 and before < 0.5 and accuracy() > 0.9, (before, accuracy())


# ------------------------------------------------------------------------------------------------ in postrl train
def online_args(model_dir: Path, rm: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
            "rollout.max_new_tokens=4", "rollout.group_size=4", "train.prompts_per_step=8", "train.steps=4",
            "train.save_every=2", "train.eval_size=4", "train.eval_k=1", "optim.lr=1e-3",
            f"rewards=[{{name: has_digit_test, weight: 0}}, {{name: model_online, path: '{rm}', lr: 0.05, "
            f"max_pairs: 2, verifier: has_digit_test}}]", *extra]


def test_resumed_run_equals_the_uninterrupted_one(model_dir, rm_dir, tmp_path, monkeypatch):
    """4 steps, checkpoints at 2 and 4; a run that dies in step 3 and resumes from step 2 logs the same metrics
    (the reward model's scores, pairs and losses among them) and ends with the same reward-model weights and
    optimizer state in its checkpoint."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_inprocess(online_args(model_dir, rm_dir, ref))
    crash_in_step(monkeypatch, online_args(model_dir, rm_dir, run), step=2)
    assert [m["step"] for m in metrics(run)] == [1, 2]
    resume(run)
    got, want = metrics(run), metrics(ref)
    assert got == want
    assert [m["reward/model_online/updates"] for m in want] == [1.0, 2.0, 3.0, 4.0]
    assert all(m["reward/model_online/pairs"] > 0 for m in want)

    def rm_state(r: Path) -> dict:
        st = json.loads((r / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
        return st["stages"]["rewards"]["1:model_online"]

    assert rm_state(run) == rm_state(ref) and rm_state(ref)["updates"] == 4


def test_no_verifier_is_one_line_naming_the_entry(rm_dir, tmp_path):
    """A reward model that cannot be trained online: no verifier among the rewards, or a PRM folder."""
    base = ["task.name=arithmetic"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, f"rewards=[{{name: model_online, path: '{rm_dir}'}}]"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rewards.0: model_online cannot train its reward model online: no "
                                              "verifier to label the pairs ('correct' is not a reward source")
    with pytest.raises(ConfigError, match=r"^rewards.1: .* \('has_digit_test' is not a reward source of this run; "
                                          r"rewards: correct, model_online\)"):
        load_config(None, [*base, f"rewards=[{{name: correct}}, {{name: model_online, path: '{rm_dir}', "
                                  f"verifier: has_digit_test}}]"])
    prm = tmp_path / "prm"
    fit_prm("bag:4", [StepRecord("1+1=", "2\n\n3", [0.5, 1.0])] * 4, RMTrainConfig(lr=1e-2),
            max_length=32).save_pretrained(prm)
    with pytest.raises(ConfigError, match=r"^rewards.1.path: '.*prm' is a process reward model \(postrl prm train\)"):
        load_config(None, [*base, f"rewards=[{{name: correct}}, {{name: model_online, path: '{prm}'}}]"])


DDP_SCRIPT = """
import json, sys
from pathlib import Path
from postrl.config import load_config
from postrl.train.trainer import Trainer

out = Path(sys.argv[1])
cfg = load_config(None, sys.argv[2:])
tr = Trainer(cfg, cfg.output_dir)
tr.train()
(out / f"rank{tr.rank}.json").write_text(json.dumps({"world": tr.world, "stages": tr.step.state_dict()}))
"""


def test_two_processes_train_one_reward_model(model_dir, rm_dir, tmp_path):
    """torchrun, 2 processes (DDP over gloo): each rank labels pairs on its own rows; the step gathers them, so
    both ranks take the same steps and end with the same reward-model weights and optimizer state."""
    args = online_args(model_dir, rm_dir, tmp_path / "run", "train.steps=2", "train.save_every=0", "accel.threads=1")
    args = [a.replace("has_digit_test", "'test_online_rm:has_digit'") for a in args]
    run_two_processes(DDP_SCRIPT, tmp_path, args)
    s0, s1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert s0["world"] == s1["world"] == 2
    a, b = s0["stages"]["rewards"]["1:model_online"], s1["stages"]["rewards"]["1:model_online"]
    assert a["updates"] == 2 and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    pairs = [m["reward/model_online/pairs"] for m in metrics(tmp_path / "run")]
    assert all(p > 0 for p in pairs)
