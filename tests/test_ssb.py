"""Semantic Soft Bootstrapping on the preference driver: the `ssb` stage (by hand, and equal to TRL's GKD loss with
beta 0 times T^2), the reference reading each pair's `ref_prompt`, training that moves the student toward the
hinted teacher, `postrl pairs --ssb` (the teacher data from the policy's own rollouts) and its one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from postrl import registry, stages
from postrl.batch import RolloutBatch
from postrl.cli import main
from postrl.errors import ConfigError
from postrl.models.tiny import build_local
from postrl.train.preference import SSB_TEMPLATE, ssb_candidates


@registry.register("reward", "ssb_digit_test", source="test: 1 when the completion holds a digit")
def ssb_digit(prompts, completions, **_):
    return [1.0 if any(ch.isdigit() for ch in c) else 0.0 for c in completions]


def fields(student, teacher, mask, **kw):
    B = student.shape[0]
    base = {"chosen_logits": student, "ref_chosen_logits": teacher, "chosen_mask": mask,
            "chosen_logps": torch.zeros(B), "rejected_logps": torch.zeros(B), "ref_chosen_logps": torch.zeros(B),
            "ref_rejected_logps": torch.zeros(B), "chosen_lengths": mask.sum(-1)}
    return {**base, **kw}


def test_ssb_by_hand():
    """Vocabulary of 2, one reply token (the second is masked out whatever its logits). Teacher uniform, student
    logits (ln 3, 0). T = 1: p_S = (3/4, 1/4), KL = 0.5 ln(0.5 / 0.75) + 0.5 ln(0.5 / 0.25) = 0.143841.
    T = 2: p_S = (sqrt3, 1) / (sqrt3 + 1) = (0.633975, 0.366025), KL = 0.5 (-0.237401) + 0.5 (0.311905) = 0.0372523,
    times T^2 = 0.149009.
    ce_weight 0.5 with log pi(y) = -3 over 2 tokens adds 0.5 * 1.5 = 0.75."""
    s = torch.tensor([[[math.log(3.0), 0.0], [50.0, -50.0]]])
    t = torch.tensor([[[0.0, 0.0], [-50.0, 50.0]]])
    mask = torch.tensor([[1.0, 0.0]])
    st = stages.build("preference", "ssb", {"temperature": 1.0})
    assert float(st(fields(s, t, mask))[0][0]) == pytest.approx(0.143841, abs=1e-6)
    st2 = stages.build("preference", "ssb", {})  # T = 2 (the authors' default)
    assert float(st2(fields(s, t, mask))[0][0]) == pytest.approx(4 * 0.0372523, abs=1e-6)
    st3 = stages.build("preference", "ssb", {"ce_weight": 0.5})
    loss, info = st3(fields(s, t, mask, chosen_logps=torch.tensor([-3.0]), chosen_lengths=torch.tensor([2.0]),
                            ref_chosen_logps=torch.tensor([-4.0])))
    assert float(loss[0]) == pytest.approx(4 * 0.0372523 + 0.75, abs=1e-6)
    assert float(info["chosen_rewards"][0]) == 1.0  # log pi(y | x) - log pi_ref(y | x_T) = -3 + 4


def test_ssb_equals_trl_gkd_with_beta_0():
    """One pair's KD term = T^2 * TRL GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=0,
    temperature=T) ('batchmean' over the labelled tokens), values and gradients; two pairs of one length: the mean
    of the per-pair losses equals TRL's batch value too."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer").GKDTrainer.generalized_jsd_loss
    g = torch.Generator().manual_seed(0)
    for T in (1.0, 2.0, 0.7):
        s = torch.randn(2, 5, 11, generator=g, requires_grad=True)
        t = torch.randn(2, 5, 11, generator=g)
        mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float32)
        labels = torch.where(mask > 0, torch.ones(2, 5, dtype=torch.long), torch.full((2, 5), -100))
        st = stages.build("preference", "ssb", {"temperature": T})
        ours = st(fields(s, t, mask))[0].mean()
        theirs = T * T * gkd(s, t, labels=labels, beta=0.0, temperature=T)
        assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6)
        ga, = torch.autograd.grad(ours, s)
        gb, = torch.autograd.grad(theirs, s)
        assert torch.allclose(ga, gb, atol=1e-7)
        one = st(fields(s[:1], t[:1], mask[:1]))[0][0].detach()
        assert float(one) == pytest.approx(float(T * T * gkd(s[:1].detach(), t[:1], labels=labels[:1], beta=0.0,
                                                              temperature=T)), rel=1e-6)


def test_ssb_candidates_by_hand():
    """Per group: the first correct rollout, and the first rollout of the most common wrong answer (ties: the
    answer seen first); a group without a correct or without a wrong rollout gives nothing."""
    comps = ["7", "5", "The answer is 5", "9", "9", "2", "x", "y", "4", "4"]
    gids = torch.tensor([0] * 5 + [1] * 3 + [2] * 2)
    label = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    N = len(comps)
    b = RolloutBatch(prompt_ids=torch.zeros(N, 1, dtype=torch.long), prompt_mask=torch.ones(N, 1),
                     completion_ids=torch.zeros(N, 1, dtype=torch.long), completion_mask=torch.ones(N, 1),
                     group_ids=gids, sampler_logprobs=torch.zeros(N, 1), truncated=torch.zeros(N, dtype=torch.bool),
                     prompts=["p"] * 5 + ["q"] * 3 + ["r"] * 2, completions=comps, raw_rewards=label[:, None],
                     reward_names=["v"], extra={"raw_reward_names": ("v",)})
    # group 0: the wrong answers are grouped by their extracted answer (as majority_vote compares them)
    got = ssb_candidates(b, "v")
    assert [(c["prompt"], c["correct"]) for c in got] == [("p", "7")]  # q: no correct; r: no wrong
    assert got[0]["incorrect"] in ("5", "9")
    counts = {}
    from postrl.train.preference import _answer_of

    for c in comps[1:5]:
        counts[_answer_of(c)] = counts.get(_answer_of(c), 0) + 1
    top = max(counts.values())
    assert got[0]["incorrect"] == next(c for c in comps[1:5] if counts[_answer_of(c)] == top)
    with pytest.raises(ConfigError, match=r"^--verifier w: not a reward of the config"):
        ssb_candidates(b, "w")


# ------------------------------------------------------------------------------------------------ the driver
@pytest.fixture(scope="module")
def nano(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ssb") / "nano"
    build_local(path, size="nano", seed=0)
    return path


def ssb_rows(folder: Path, hinted: bool = True) -> Path:
    """Sums with the answer in the teacher's prompt: the teacher (the reference reading ref_prompt) is far surer
    of the reply than the student reading the bare question."""
    rows = []
    for a in range(10, 30):
        for b in range(1, 4):
            r = {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a)}
            if hinted:
                r["ref_prompt"] = f"{a}+{b}={a + b}. {a}+{b}={a + b}. {a}+{b}="
            rows.append(r)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("ssb.jsonl" if hinted else "plain.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(settings, path, out):
    from postrl.reward_models import read_preferences
    from postrl.train.preference import PreferenceTrainer

    pairs = read_preferences(path)
    PreferenceTrainer(settings, pairs, pairs[:8], out, log=lambda s: None).train()
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _kl_by_hand(model_dir: Path, rows: list[dict], T: float = 2.0) -> float:
    """mean over rows of T^2 * token-mean KL(p(. | ref_prompt, y_<t) || p(. | prompt, y_<t)) over y + EOS, from the
    model's own forward on each unpadded sequence (the reference = the initial model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total = 0.0
    for r in rows:
        y = tok(r["chosen"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

        def dist(prompt: str) -> torch.Tensor:
            q = tok(prompt, add_special_tokens=True)["input_ids"]
            with torch.no_grad():
                logits = m(input_ids=torch.tensor([q + y])).logits[0]
            return F.log_softmax(logits[len(q) - 1:len(q) - 1 + len(y)] / T, -1)

        lt, ls = dist(r.get("ref_prompt", r["prompt"])), dist(r["prompt"])
        total += T * T * float((lt.exp() * (lt - ls)).sum(-1).mean())
    return total / len(rows)


def test_the_teacher_reads_ref_prompt(nano, tmp_path):
    """Step 1 (policy = reference): with the hinted ref_prompt the logged loss is the mean KL between the model
    reading the hint and the model reading the bare question, computed here from plain forwards; without
    ref_prompt it is exactly 0. With LoRA the teacher is the policy with its adapter disabled (the paper's frozen
    base): the same step-1 loss."""
    from postrl.train.preference import PreferenceSettings

    base = dict(model=str(nano), loss="ssb", lr=1e-3, batch_size=60, chat_template="none", accel="off")
    plain = _run(PreferenceSettings(**base, data="plain"), ssb_rows(tmp_path, hinted=False), tmp_path / "plain")
    assert plain[0]["loss"] == pytest.approx(0.0, abs=1e-7)
    hinted = ssb_rows(tmp_path)
    want = _kl_by_hand(nano, [json.loads(x) for x in hinted.read_text().splitlines()])
    assert want > 1e-4
    for name, extra in (("full", {}), ("lora", {"lora_r": 4})):
        lines = _run(PreferenceSettings(**{**base, **extra}, data="ssb"), hinted, tmp_path / name)
        assert lines[0]["loss"] == pytest.approx(want, rel=1e-4), name


def test_student_learns_the_teachers_distribution(nano, tmp_path):
    """A teacher that differs (--ref: another model reading the hinted prompt): the KD loss falls below half its
    first value within 9 steps, with every weight training and with LoRA."""
    from postrl.train.preference import PreferenceSettings

    teacher = tmp_path / "teacher"
    build_local(teacher, size="nano", seed=1)
    base = dict(model=str(nano), loss="ssb", loss_params={"temperature": 1.0}, lr=3e-3, batch_size=20, epochs=3,
                chat_template="none", accel="off", ref=str(teacher))
    for name, extra in (("full", {}), ("lora", {"lora_r": 4, "lr": 1e-2})):
        lines = _run(PreferenceSettings(**{**base, **extra}, data="ssb"), ssb_rows(tmp_path), tmp_path / name)
        first, last = lines[0]["loss"], lines[-1]["loss"]
        assert first > 0.01 and last < 0.5 * first, (name, first, last)
        assert lines[-1]["rewards/chosen"] > lines[0]["rewards/chosen"]  # log pi(y|x) approaches log pi_T(y|x_T)


def test_precompute_ref_is_refused_for_ssb(nano, tmp_path, capsys):
    data = ssb_rows(tmp_path)
    assert main(["dpo", str(data), "--model", str(nano), "--out", str(tmp_path / "o"), "--loss", "ssb",
                 "--precompute-ref"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--precompute-ref: loss 'ssb' reads the reference's token distributions" in err


def test_pairs_ssb_then_dpo(nano, tmp_path, capsys):
    """postrl pairs --ssb: the policy's rollouts, labelled by the verifier; per prompt with both a correct and an
    incorrect one, the hinted prompt and the teacher's solution, kept when verified; postrl dpo --loss ssb trains
    on the file as it is."""
    out = tmp_path / "ssb.jsonl"
    rc = main(["pairs", "--model", str(nano), "--out", str(out), "--ssb", "--verifier", "ssb_digit_test",
               "--prompts", "16", "--teacher-temperature", "1.0", "task.name=arithmetic", "task.digits=1",
               "rollout.group_size=4", "rollout.max_new_tokens=4", "train.prompts_per_step=8",
               "rewards=[{name: ssb_digit_test}]", "model.chat_template=none"])
    said = capsys.readouterr()
    assert rc == 0, said.err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows and "with_both=" in said.out and "teacher_verified=" in said.out
    for r in rows:
        assert any(ch.isdigit() for ch in r["chosen"]) and not any(ch.isdigit() for ch in r["rejected"])
        assert any(ch.isdigit() for ch in r["correct"])
        assert r["ref_prompt"] == SSB_TEMPLATE.format(prompt=r["prompt"], correct=r["correct"],
                                                      incorrect=r["rejected"])
    assert main(["dpo", str(out), "--model", str(nano), "--out", str(tmp_path / "run"), "--loss", "ssb",
                 "--chat-template", "none", "--eval-fraction", "0", "--lr", "1e-3"]) == 0
    assert main(["pairs", "--model", str(nano), "--out", str(out), "--ssb", "--verifier", "nope",
                 "task.name=arithmetic", "rollout.group_size=2", "rewards=[{name: ssb_digit_test}]"]) == 2
    assert "--verifier nope: not a reward of the config (rewards: ssb_digit_test)" in capsys.readouterr().err
