"""On-policy distillation (regularizer ``distill``, field ``teacher_logp`` from ``model.teacher.path``) and KEPO
(the quality gate ``distill_gate``; the expansion ``teacher_hint``): hand-computed values, the anchors (verl's own
``distillation_loss``; TRL's generalized JSD through its expectation over the vocabulary), the config's and the
teacher's checks, and the real trainer with a nano student and teacher."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from postrl import registry
from postrl.batch import RolloutBatch
from postrl.cli import main
from postrl.config import load_config
from postrl.errors import ConfigError, DataError
from postrl.generation import Generation
from postrl.losses.distill import distill, distill_gate
from postrl.losses.policy import ppo_clip
from postrl.models import load_model_and_tokenizer
from postrl.models.tiny import build_local, build_model, build_tokenizer
from postrl.selection.expansions import ExpandContext
from postrl.selection.guidance import TeacherHint
from postrl.train.trainer import Trainer

ONES = torch.ones(2)


def _call(logp, teacher, old=None, gate=ONES, **kw):
    return distill(logp, logp.detach() if old is None else old, teacher, gate, **kw)


# ------------------------------------------------------------------------------------------------ the term
def test_policy_gradient_k1_by_hand():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0], [-0.5, -4.0]])
    out = _call(logp, teacher)
    # d = logp - teacher = [[0.5, -1], [0, 1]]; A = -d; ratio 1: L = -A * 1 = d
    assert out.tolist() == [[0.5, -1.0], [0.0, 1.0]]
    out.sum().backward()
    # dL/dlogp = -A rho = d (the teacher's log-prob enters the gradient through the advantage only)
    assert logp.grad.tolist() == [[0.5, -1.0], [0.0, 1.0]]


def test_policy_gradient_clips_like_ppo_with_verls_dual_clip():
    # token 1: d = -1 (A = +1), rho = e^{ln 1.5} = 1.5 > 1.2: L = -A clip(rho) = -1.2, no gradient
    # token 2: d = +0.5 (A = -0.5), rho = 5: max(-A rho, -A clip) = max(2.5, 0.6) = 2.5, dual clip 3: min(2.5, 1.5)
    logp = torch.tensor([[math.log(1.5) - 2.0, math.log(5.0) - 1.0]], requires_grad=True)
    old = torch.tensor([[-2.0, -1.0]])
    teacher = logp.detach() + torch.tensor([[1.0, -0.5]])
    out = distill(logp, old, teacher, torch.ones(1))
    assert out[0, 0].item() == pytest.approx(-1.2) and out[0, 1].item() == pytest.approx(1.5)
    out.sum().backward()
    assert logp.grad.abs().max() == 0  # both clipped
    # no dual clip: the unclipped branch, 2.5
    assert distill(logp, old, teacher, torch.ones(1), dual_clip=None)[0, 1].item() == pytest.approx(2.5)


def test_direct_mode_estimators_clamp_and_gate():
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -2.0], [-6.0, -1.0]])
    out = _call(logp, teacher, mode="direct", estimator="k3")
    # k3 = e^{t - l} - (t - l) - 1: e^-0.5 + 0.5 - 1 = 0.10653; 0; e^-5 + 5 - 1 = 4.00674; 0
    assert out[0].tolist() == pytest.approx([math.exp(-0.5) - 0.5, 0.0], abs=1e-6)
    assert out[1, 0].item() == pytest.approx(math.exp(-5) + 4, rel=1e-6)
    # k2 = d^2 / 2 clamped at 1: d = 0.5 -> 0.125; d = 5 -> 12.5 -> 1 (no gradient there)
    out = _call(logp, teacher, mode="direct", estimator="k2", max_clamp=1.0)
    assert out[0, 0].item() == pytest.approx(0.125) and out[1, 0].item() == 1.0
    out.sum().backward()
    assert logp.grad[0, 0].item() == pytest.approx(0.5) and logp.grad[1, 0].item() == 0.0
    # the gate: the second trajectory failed the quality bar and adds nothing
    out = _call(logp, teacher, mode="direct", estimator="k3", gate=torch.tensor([1.0, 0.0]))
    assert out[1].tolist() == [0.0, 0.0] and out[0, 0].item() > 0
    # the clamp bounds the advantage of the policy-gradient form too: d = 5 -> 2, so A = -2, L = 2
    assert _call(logp.detach(), teacher, max_clamp=2.0)[1, 0].item() == pytest.approx(2.0)


def test_quality_gate_field_by_hand():
    batch = RolloutBatch(prompt_ids=torch.zeros(3, 1, dtype=torch.long), prompt_mask=torch.ones(3, 1, dtype=torch.long),
                         completion_ids=torch.zeros(3, 2, dtype=torch.long), completion_mask=torch.ones(3, 2),
                         group_ids=torch.tensor([0, 0, 0]), sampler_logprobs=torch.zeros(3, 2),
                         truncated=torch.zeros(3, dtype=torch.bool), prompts=["q"] * 3, completions=["a"] * 3,
                         reward_names=["correct", "format"], rewards=torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
                         reward=torch.tensor([1.0, 0.5, float("nan")]))
    assert distill_gate(None, batch).tolist() == [1.0, 1.0, 1.0]  # no threshold: no gate
    assert distill_gate(None, batch, gate_threshold=1.0).tolist() == [1.0, 0.0, 0.0]  # NaN fails
    assert distill_gate(None, batch, gate_reward="correct", gate_threshold=1.0).tolist() == [1.0, 0.0, 1.0]
    batch.raw_rewards, batch.extra["raw_reward_names"] = torch.tensor([[0.0], [1.0], [1.0]]), ["correct"]
    # the raw column (before shaping) is the one compared
    assert distill_gate(None, batch, gate_reward="correct", gate_threshold=0.5).tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(DataError, match="gate_reward: no reward source named 'exact'"):
        distill_gate(None, batch, gate_reward="exact", gate_threshold=0.5)


def test_the_advantage_form_has_the_same_first_pass_gradient():
    """Thinking Machines / slime: A_t <- A_t - c k1_t inside the policy loss; postrl: the policy loss + c x the
    policy-gradient distill term. At ratio 1 (the first pass) their gradients are equal."""
    torch.manual_seed(0)
    logp = (-torch.rand(3, 4) * 3).requires_grad_()
    teacher, adv, c = -torch.rand(3, 4) * 3, torch.randn(3, 1), 0.3
    a, _ = ppo_clip(logp, logp.detach(), adv - c * (logp.detach() - teacher))
    (ga,) = torch.autograd.grad(a.sum(), logp)
    b = ppo_clip(logp, logp.detach(), adv)[0] + c * _call(logp, teacher, gate=torch.ones(3))
    (gb,) = torch.autograd.grad(b.sum(), logp)
    assert torch.allclose(ga, gb, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the anchors
def _verl_data(lp, tl, old, mask):
    """verl's unpadded layout: each row's stream of P + T positions, the response's log-probs shifted one left."""
    from tensordict import TensorDict

    B, T = lp.shape
    P = 3

    def unpad(x):
        pad = torch.zeros(P - 1, *x.shape[2:])
        return torch.cat([torch.cat([pad, x[b], torch.zeros(1, *x.shape[2:])]) for b in range(B)])

    data = TensorDict({"prompts": torch.ones(B, P, dtype=torch.long), "responses": torch.ones(B, T, dtype=torch.long),
                       "attention_mask": torch.ones(B, P + T, dtype=torch.long), "response_mask": mask,
                       "old_log_probs": old, "teacher_logprobs": unpad(tl.unsqueeze(-1)), "dp_size": 1,
                       "batch_num_tokens": mask.sum(), "global_batch_size": B}, batch_size=[])
    return data, unpad


@pytest.mark.parametrize("verl_mode,postrl_kw", [
    (dict(loss_mode="k1", use_policy_gradient=True), dict(estimator="k1")),
    (dict(loss_mode="k1", use_policy_gradient=True, loss_max_clamp=0.4, clip_ratio_low=0.1, clip_ratio_high=0.3),
     dict(estimator="k1", max_clamp=0.4, eps_low=0.1, eps_high=0.3)),
    (dict(loss_mode="k3", use_policy_gradient=False, loss_max_clamp=1.5), dict(estimator="low_var_kl", mode="direct",
                                                                                max_clamp=1.5)),
    (dict(loss_mode="mse", use_policy_gradient=False), dict(estimator="k2", mode="direct")),
])
def test_equal_to_verls_distillation_loss(verl_mode, postrl_kw):
    pytest.importorskip("verl")
    from verl.trainer.distillation.losses import distillation_loss
    from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig

    torch.manual_seed(1)
    B, T = 3, 5
    lp = (-torch.rand(B, T) * 3 - 0.05).requires_grad_()
    tl = -torch.rand(B, T) * 4
    old = lp.detach() + 0.3 * torch.randn(B, T)  # ratios off 1, so the clip binds on some tokens
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]).float()
    data, unpad = _verl_data(lp, tl, old, mask)
    actor = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                            loss_agg_mode="token-mean", rollout_n=1)
    dcfg = DistillationConfig(enabled=False, distillation_loss=DistillationLossConfig(**{"loss_max_clamp": None,
                                                                                        **verl_mode}))
    ref, _ = distillation_loss(actor, dcfg, {"log_probs": unpad(lp)}, data)
    (g_ref,) = torch.autograd.grad(ref, lp)
    # postrl: the regulariser's matrix, aggregated by token_mean (w = mask / sum(mask)) as the objective does
    w = mask / mask.sum()
    ours = (w * distill(lp, old, tl, torch.ones(B), **postrl_kw)).sum()
    (g_ours,) = torch.autograd.grad(ours, lp)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(g_ours, g_ref, atol=1e-6)


def _vocab_expectation(student, teacher, **kw):
    """E_{y_t ~ pi(.|t)}[distill] at each position, summed over positions: one row per vocabulary token, weighted by
    its (detached) probability. Returns (value, gradient wrt the student's logits)."""
    s = student.clone().requires_grad_()
    lp, lt = s.log_softmax(-1), teacher.log_softmax(-1)  # [T, V]
    rows = distill(lp.T, lp.T.detach(), lt.T, torch.ones(lp.shape[1]), **kw)  # row v, column t: token v at t
    val = (lp.T.detach().exp() * rows).sum()
    (g,) = torch.autograd.grad(val, s)
    return val, g


def test_expectation_over_the_vocabulary_equals_trls_generalized_jsd():
    """TRL's GKD loss with beta=1 is the reverse KL over the whole vocabulary; its expectation under the policy's
    own sampling is what the sampled-token term estimates: E[k1] is its value, and E[grad] of the policy-gradient
    k1 form (ratio 1) and of the direct k2 form is its gradient; the direct k3 form has the gradient of beta=0
    (forward KL). Exact, by summing over the vocabulary."""
    pytest.importorskip("trl")
    from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(2)
    student, teacher = torch.randn(4, 9), torch.randn(4, 9) * 2

    def trl(beta):
        s = student.clone().requires_grad_()
        loss = GKDTrainer.generalized_jsd_loss(s[None], teacher[None], beta=beta, reduction="sum")
        (g,) = torch.autograd.grad(loss, s)
        return loss, g

    reverse, g_reverse = trl(1.0)
    _, g_forward = trl(0.0)
    val, g = _vocab_expectation(student, teacher, estimator="k1")
    assert val.item() == pytest.approx(reverse.item(), rel=1e-5)
    assert torch.allclose(g, g_reverse, atol=1e-5)
    _, g = _vocab_expectation(student, teacher, estimator="k2", mode="direct")
    assert torch.allclose(g, g_reverse, atol=1e-5)
    _, g = _vocab_expectation(student, teacher, estimator="k3", mode="direct")
    assert torch.allclose(g, g_forward, atol=1e-5) and not torch.allclose(g, g_reverse, atol=1e-3)


# ------------------------------------------------------------------------------------------------ config
RUN = ["task.name=arithmetic", "task.digits=1", "rewards=[{name: correct}]"]


def test_config_refuses_what_cannot_work(tmp_path):
    with pytest.raises(ConfigError, match=r"regularizers.0: distill reads the teacher's log-probs \(teacher_logp\): set "
                                          r"model.teacher.path"):
        load_config(None, [*RUN, "regularizers=[{name: distill}]"])
    t = f"model.teacher.path={tmp_path}"
    with pytest.raises(ConfigError, match="regularizers.0.estimator: k1 with mode direct"):
        load_config(None, [*RUN, t, "regularizers=[{name: distill, mode: direct}]"])
    with pytest.raises(ConfigError, match="regularizers.0.estimator: unknown KL estimator 'k9'"):
        load_config(None, [*RUN, t, "regularizers=[{name: distill, estimator: k9}]"])
    with pytest.raises(ConfigError, match="regularizers.0.gate_reward: no reward source named 'exact'"):
        load_config(None, [*RUN, t, "regularizers=[{name: distill, gate_reward: exact, gate_threshold: 1}]"])
    with pytest.raises(ConfigError, match="regularizers.0.eps_low: expected a value >= 0 and < 1"):
        load_config(None, [*RUN, t, "regularizers=[{name: distill, eps_low: 1.5}]"])
    with pytest.raises(ConfigError, match="filters.0: teacher_hint needs a teacher"):
        load_config(None, [*RUN, "filters=[{name: teacher_hint}]"])
    cfg = load_config(None, [*RUN, t, "regularizers=[{name: distill, gate_reward: correct, gate_threshold: 1.0}]"])
    assert cfg.model.teacher.path == str(tmp_path)


# ------------------------------------------------------------------------------------------------ the trainer
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A nano student and its teacher: the student's own weights with the output head x3 (a sharper version of
    it, so the reverse KL is learnable in a few steps); and a model with another vocabulary."""
    base = tmp_path_factory.mktemp("distill")
    build_local(base / "student", size="nano", seed=0)
    model, tok = load_model_and_tokenizer(base / "student")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    model.save_pretrained(base / "teacher")
    tok.save_pretrained(base / "teacher")
    other_tok = build_tokenizer("abcdef0123456789")
    build_model(other_tok, size="nano").save_pretrained(base / "other")
    other_tok.save_pretrained(base / "other")
    return {"student": base / "student", "teacher": base / "teacher", "other": base / "other"}


@registry.register("reward", "distill_test_zero", source="test: no task signal")
def distill_test_zero(prompts, completions, **_):
    return [0.0] * len(completions)


def make(models, out: Path, *extra: str) -> Trainer:
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(None, [f"model.path={models['student']}", f"model.teacher.path={models['teacher']}",
                             f"output_dir={out}", "task.name=arithmetic", "task.digits=1", "rollout.max_new_tokens=8",
                             "rollout.group_size=4", "train.prompts_per_step=4", "train.micro_batch_size=16",
                             "optim.lr=3e-3", "train.save_every=0", *extra])
    return Trainer(cfg, out)


def full_reverse_kl(tr: Trainer, batch: RolloutBatch) -> float:
    """KL(pi_theta || pi_teacher) summed over the vocabulary, token mean over the batch's completions."""
    from postrl.logprobs import completion_logprobs

    with torch.no_grad():
        ls = completion_logprobs(tr.policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, 1.0,
                                 return_logits=True)[2].log_softmax(-1)
        lt = completion_logprobs(tr.teacher, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, 1.0,
                                 return_logits=True)[2].log_softmax(-1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    m = batch.completion_mask
    return float((kl * m).sum() / m.sum())


def test_distillation_pulls_the_student_to_the_teacher(models, tmp_path):
    """No task signal (every reward 0, so every GRPO advantage is 0): only the distill term trains. The reverse KL
    to the teacher, measured exactly over the vocabulary on a fixed batch, falls."""
    tr = make(models, tmp_path / "run", "rewards=[{name: distill_test_zero}]", "regularizers=[{name: distill}]")
    assert set(tr.frozen) == {"teacher_logp"} and tr.ref_model is None  # the teacher, no reference
    probe, _ = tr.batches.next_batch(0, 25)
    before = full_reverse_kl(tr, probe)
    metrics = [tr.train_step(s) for s in range(25)]
    after = full_reverse_kl(tr, probe)
    assert all(math.isfinite(m["reg/distill"]) for m in metrics)
    assert before > 0.2 and after < 0.75 * before, (before, after)


def test_the_quality_gate_keeps_failed_trajectories_out(models, tmp_path):
    """gate_threshold above every reward: no row passes, the term is 0 and (no task signal) nothing moves."""
    tr = make(models, tmp_path / "gated", "rewards=[{name: distill_test_zero}]",
              "regularizers=[{name: distill, gate_threshold: 0.5}]")
    w0 = [p.detach().clone() for p in tr.policy.parameters()]
    m = tr.train_step(0)
    assert m["reg/distill"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(w0, tr.policy.parameters()))


def test_a_teacher_no_stage_uses_is_not_loaded(models, tmp_path):
    with pytest.warns(UserWarning, match="no configured stage uses a teacher .* so it is not loaded"):
        tr = make(models, tmp_path / "unused", "rewards=[{name: distill_test_zero}]")
    assert tr.teacher is None and tr.frozen == {} and tr.ctx.teacher_generate is None


def test_a_teacher_with_another_vocabulary_is_one_line(models, tmp_path, capsys):
    argv = ["train", f"model.path={models['student']}", f"model.teacher.path={models['other']}",
            "task.name=arithmetic", "rollout.max_new_tokens=4", "train.steps=1", "regularizers=[{name: distill}]",
            f"output_dir={tmp_path / 'o'}", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"postrl: error: model.teacher.path {models['other']}: another vocabulary"), err
    assert "policy's tokenizer" in err


# ------------------------------------------------------------------------------------------------ teacher_hint
def _failed_batch() -> RolloutBatch:
    """Two groups of two: group 7 all wrong, group 9 one right."""
    return RolloutBatch(prompt_ids=torch.tensor([[1, 2], [1, 2], [0, 3], [0, 3]]),
                        prompt_mask=torch.tensor([[1, 1], [1, 1], [0, 1], [0, 1]]),
                        completion_ids=torch.tensor([[5, 6], [6, 5], [5, 5], [6, 6]]), completion_mask=torch.ones(4, 2),
                        group_ids=torch.tensor([7, 7, 9, 9]), sampler_logprobs=torch.zeros(4, 2),
                        truncated=torch.zeros(4, dtype=torch.bool), prompts=["p", "p", "q", "q"],
                        completions=["x"] * 4, columns={"answer": ["A", "A", "B", "B"]}, reward_names=["correct"],
                        rewards=torch.tensor([[0.0], [0.0], [1.0], [0.0]]), reward=torch.tensor([0.0, 0.0, 1.0, 0.0]),
                        valid=torch.ones(4, dtype=torch.bool))


def test_teacher_hint_resamples_only_all_failed_groups_and_keeps_the_positive():
    calls = {}

    def teacher_generate(ids, n, seeds, max_new_tokens):
        calls["teacher"] = (ids, n, max_new_tokens)
        return Generation(prompt_ids=torch.zeros(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.long),
                          completion_ids=torch.tensor([[4]]), completion_mask=torch.ones(1, 1),
                          logprobs=torch.zeros(1, 1), truncated=torch.zeros(1, dtype=torch.bool), texts=[" think "])

    def generate(ids, n, seeds):
        calls["policy"] = (ids, n)
        k = len(ids) * n
        return Generation(prompt_ids=torch.zeros(k, 1, dtype=torch.long), prompt_mask=torch.ones(k, 1, dtype=torch.long),
                          completion_ids=torch.tensor([[8], [9], [8]]), completion_mask=torch.ones(k, 1),
                          logprobs=torch.full((k, 1), -0.5), truncated=torch.zeros(k, dtype=torch.bool),
                          texts=["right", "wrong", "right"])

    def score(b):  # the run's rewards: 'right' is correct
        b.reward_names = ["correct"]
        b.rewards = torch.tensor([[1.0 if c == "right" else 0.0] for c in b.completions])
        b.reward = b.rewards[:, 0]

    enc = {"H": [20], "G": [21]}
    ctx = ExpandContext(generate=generate, decode=lambda ids: "", group_size=3, seed=0, pad_id=0,
                        encode=lambda text: enc["H"] if text.startswith("\n\nGive") or "ANS" in text else enc["G"],
                        score=score, teacher_generate=teacher_generate)
    hint = TeacherHint()
    assert hint.failed_groups(_failed_batch()) == [0]  # group 7 only (group 9 has a correct completion)
    out = hint.expand(_failed_batch(), ctx)
    # the teacher saw prompt + the hint request (no padding), the policy prompt + the hint's guidance, G times
    assert calls["teacher"] == ([[1, 2, 20]], 1, 64) and calls["policy"] == ([[1, 2, 21]], 3)
    # rejection sampling: the two 'right' completions, in the failed group 7, trained without the hint
    assert out.completions == ["right", "right"] and out.group_ids.tolist() == [7, 7]
    assert out.prompt_ids.tolist() == [[1, 2], [1, 2]] and out.extra["guided"].all() and out.extra["branch"].all()
    assert out.extra["hint"] == ["think", "think"] and out.sampler_logprobs.tolist() == [[-0.5], [-0.5]]
    assert len(TeacherHint(keep="all").expand(_failed_batch(), ctx)) == 3
    # the reference answer shown to the teacher when the template asks for it
    TeacherHint(answer_column="answer", hint_template="ANS {answer}").expand(_failed_batch(), ctx)
    with pytest.raises(DataError, match="answer_column: the prompt rows have no column 'solution'"):
        TeacherHint(answer_column="solution", hint_template="{answer}").expand(_failed_batch(), ctx)


def test_teacher_hint_in_the_trainer_joins_the_failed_groups(models, tmp_path):
    """With the real trainer: the teacher writes hints for the all-failed groups (a random nano model fails every
    arithmetic prompt) and the hinted completions join those groups (keep: all: a random model is rarely right)."""
    tr = make(models, tmp_path / "hint", "rewards=[{name: correct}]", "train.prompts_per_step=2",
              "filters=[{name: teacher_hint, keep: all, retries: 2, hint_tokens: 4}]")
    batch, _ = tr.batches.next_batch(0, 1)
    own = ~batch.extra["branch"].bool()
    assert int(own.sum()) == 8 and len(batch) == 8 + 2 * 2  # two failed groups, two hinted retries each
    assert set(batch.group_ids[~own].tolist()) == set(batch.group_ids[own].tolist())  # joined, no new group
    assert batch.extra["guided"][~own].all() and not batch.extra["guided"][own].any()
    assert all(isinstance(h, str) for h in [batch.extra["hint"][i] for i in torch.nonzero(~own).flatten().tolist()])
    m = tr.train_step(0)
    assert math.isfinite(m["pg_loss"])


CALLS = {"n": 0, "pass_after": 1}


@registry.register("reward", "distill_test_later", source="test: fails the first scoring of a step, passes later ones")
def distill_test_later(prompts, completions, **_):
    """0 on the first call (the step's rollouts), 1 on later calls (the hinted retries, scored by the expansion)."""
    CALLS["n"] += 1
    return [float(CALLS["n"] > CALLS["pass_after"])] * len(completions)


@pytest.mark.parametrize("pass_after,hinted", [(1, 4), (10, 0)])
def test_teacher_hint_rejection_sampling_scores_with_the_runs_rewards(models, tmp_path, pass_after, hinted):
    """keep: positive scores the hinted retries with the run's rewards inside the expansion: all accepted when they
    pass, none when they fail (then the groups stay as they were)."""
    tr = make(models, tmp_path / f"pos{pass_after}", "rewards=[{name: distill_test_later}]", "train.prompts_per_step=2",
              "filters=[{name: teacher_hint, reward: distill_test_later, retries: 2, hint_tokens: 4}]")
    CALLS.update(n=0, pass_after=pass_after)
    batch, _ = tr.batches.next_batch(0, 1)
    assert len(batch) == 8 + hinted
    if hinted:
        assert batch.reward[8:].tolist() == [1.0] * hinted and batch.extra["guided"][8:].all()


def test_readme_commands_run(models, tmp_path, monkeypatch):
    """The README's commands (on-policy distillation, KEPO, RL-PLUS) as written, with the nano models in place of
    the folders and a one-step, small run appended."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("### On-policy distillation and demonstrations", 1)[1].split("\n#", 1)[0]
    lines = [ln.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)
             for ln in block.replace("\\\n", " ").splitlines() if ln.strip().startswith("postrl ")]
    assert len(lines) == 3
    monkeypatch.chdir(tmp_path)
    Path("train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b),
                                                       "demonstration": str(a + b)}) + "\n"
                                           for a in range(4) for b in range(3)))
    fast = ["train.steps=1", "train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
            "train.eval_size=2", "train.eval_k=1", "--quiet"]
    names = {"models/student": str(models["student"]), "models/teacher": str(models["teacher"])}
    for i, line in enumerate(lines):
        argv = []
        for a in shlex.split(line)[1:]:
            key, _, value = a.partition("=")
            argv.append(f"{key}={names[value]}" if value in names else a)
        if not any(a.startswith("model.path=") for a in argv):
            argv.append(f"model.path={models['student']}")
        assert main([*argv, *fast, f"output_dir=run{i}"]) == 0, line
        assert (tmp_path / f"run{i}" / "final").is_dir()
