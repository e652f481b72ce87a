"""ICR and SRPO as their papers say (issue 27): hand-computed targets, gates, weights and contrasts, and the step's
plumbing (a regulariser's field produced through the model context, read by the objective)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from postrl.batch import RolloutBatch
from postrl.config import load_config
from postrl.context import ModelContext
from postrl.diagnostics.metrics import batch_metrics
from postrl.errors import ConfigError, DataError
from postrl.logprobs import completion_logprobs
from postrl.losses.icr import icr_targets, length_accuracy_corr
from postrl.losses.objective import Objective
from postrl.losses.srpo import corrupt, span_tokens, srpo, srpo_contrast
from postrl.stages import build
from postrl.step import Step

T = torch.tensor
nan = float("nan")


def close(a, b, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (torch.isnan(a) == torch.isnan(b)).all(), (a, b)
    assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=tol), (a, b)


# ------------------------------------------------------------------------------------------------ ICR
# four groups of four: g0 overthinks (short ones right), g1 underthinks, g2 all correct, g3 all wrong
LENS = T([10., 20, 30, 40, 10, 20, 30, 40, 5, 5, 9, 12, 3, 4, 5, 6])
CORRECT = T([1., 1, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0])
GIDS = torch.arange(4).repeat_interleave(4)
# g0: dL = (-15, -5, 5, 15), dc = (.5, .5, -.5, -.5): cov -20, sum dL^2 500, sum dc^2 1 -> -20/sqrt(500)
# g1: dc = (-.5, .5, -.5, .5): cov 10 -> 10/sqrt(500); g2, g3: correctness constant -> undefined
RHO0, RHO1 = -20 / math.sqrt(500), 10 / math.sqrt(500)
RHO_B = (RHO0 + RHO1) / 2  # -0.2236: the batch overthinks


def targets(**kw):
    rewards = torch.stack([CORRECT, torch.zeros(16)], 1)
    return icr_targets(rewards, ["correct", "format"], LENS, GIDS, torch.ones(16, dtype=torch.bool), **kw)


def test_icr_length_accuracy_correlation_by_hand():
    rho_b, rho, defined = length_accuracy_corr(LENS, CORRECT, GIDS, torch.ones(16, dtype=torch.bool))
    assert rho_b == pytest.approx(RHO_B)
    close(rho, [RHO0] * 4 + [RHO1] * 4 + [nan] * 8)
    assert defined.tolist() == [True] * 8 + [False] * 8


def test_icr_targets_are_the_shortest_correct_completions_in_the_overthinking_regime():
    z, rho_b = targets()
    assert rho_b == pytest.approx(RHO_B)
    # batch gate on (rho_B < 0): g0 row 0 (10 < mean 25); g1 row 5 (20, its shortest correct, < 25); g2 both
    # 5-token rows (ties; 5 < mean 7.75); g3 has no correct completion
    close(z, [1, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    # per-group gate: g1 underthinks (rho 0.447 > 0) -> off; g2's rho is undefined -> the batch's gate (on)
    close(targets(gate="group")[0], [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    # top 2: g0 rows 0, 1 (20 < 25); g1 row 7 (40) is its 2nd shortest correct but not shorter than the mean;
    # g2 row 10 (9) has two shorter correct rows (rank 2) -> not among the top 2
    close(targets(top=2)[0], [1, 1, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    close(targets(top=2, shorter_than_mean=False)[0], [1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    # a stricter threshold than the batch's correlation switches it off everywhere
    assert targets(max_corr=-0.5)[0].sum() == 0
    # underthinking batch: flip g0 to underthinking too -> rho_B > 0 -> no target at all
    rewards = torch.stack([torch.cat([1 - CORRECT[:4], CORRECT[4:]]), torch.zeros(16)], 1)
    z, rho_b = icr_targets(rewards, ["correct", "format"], LENS, GIDS)
    assert rho_b > 0 and z.sum() == 0


def test_icr_targets_the_short_correct_answer_not_the_many_step_one():
    """The issue's case against the old step_length_regularizer, which paid +0.0145 to a correct 150-token completion
    in 10 steps, -0.103 to 100 tokens in 2 steps and -0.081 to a 40-token one-step answer: ICR pulls toward the
    40-token one, whatever the steps, since the group overthinks (its wrong completion is the longest)."""
    lens, correct = T([150.0, 100, 40, 200]), T([1.0, 1, 1, 0])
    # dL = (27.5, -22.5, -82.5, 77.5), dc = (.25, .25, .25, -.75): cov = -77.5 < 0
    z, rho = icr_targets(correct[:, None], ["correct"], lens, torch.zeros(4, dtype=torch.long))
    assert rho == pytest.approx(-77.5 / math.sqrt(14075 * 0.75))  # sum dL^2 = 14075, sum dc^2 = 0.75
    close(z, [0, 0, 1, 0])


def test_icr_ignores_invalid_and_unknown_rows():
    rewards = torch.stack([CORRECT, torch.zeros(16)], 1)
    valid = torch.ones(16, dtype=torch.bool)
    valid[0] = False  # g0 is now (20, 30, 40) with correctness (1, 0, 0)
    rewards[9, 0] = nan  # g2: one of its two 5-token rows has no known correctness
    z, rho_b = icr_targets(rewards, ["correct", "format"], LENS, GIDS, valid)
    # g0: dL = (-10, 0, 10), dc = (2/3, -1/3, -1/3): cov -10, sum dL^2 200, sum dc^2 2/3
    assert rho_b == pytest.approx((-10 / math.sqrt(200 * 2 / 3) + RHO1) / 2)
    close(z, [0, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ConfigError, match="source 'ok' is not a reward column; rewards: correct, format"):
        icr_targets(rewards, ["correct", "format"], LENS, GIDS, source="ok")


def test_icr_regulariser_is_the_targets_negative_log_likelihood():
    logp = torch.log(T([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]])).requires_grad_(True)
    reg = build("regularizer", "icr")
    r = reg({"logp": logp, "icr_target": T([1.0, 0.0])})
    close(r.detach(), [[math.log(2), math.log(4), -math.log(0.9)], [0.0, 0.0, 0.0]])
    (g,) = torch.autograd.grad(r.sum(), logp)
    close(g, [[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])  # descending the loss raises the targets' log-probs
    assert reg.reads == ("logp", "icr_target")


def icr_batch() -> RolloutBatch:
    N, width = 16, 40
    mask = (torch.arange(width)[None] < LENS[:, None]).float()
    rewards = torch.stack([CORRECT, torch.zeros(16)], 1)
    return RolloutBatch(prompt_ids=torch.ones(N, 2, dtype=torch.long), prompt_mask=torch.ones(N, 2, dtype=torch.long),
                        completion_ids=torch.ones(N, width, dtype=torch.long), completion_mask=mask, group_ids=GIDS,
                        sampler_logprobs=torch.zeros(N, width), truncated=torch.zeros(N, dtype=torch.bool),
                        prompts=["q"] * N, completions=["x"] * N, reward_names=["correct", "format"],
                        rewards=rewards, reward_weights=T([1.0, 0.0]), reward=CORRECT.clone(),
                        valid=torch.ones(N, dtype=torch.bool))


def test_icr_through_the_step_field_objective_and_metric():
    """The step produces the regulariser's field (no model needed), the objective reads it from batch.extra, and
    the batch metric ``length/accuracy_corr`` is the gate's statistic."""
    cfg = load_config(None, ["regularizers=[{name: icr, coef: 0.5, gate: group}]", "rollout.max_new_tokens=40"])
    step = Step(cfg)
    batch = icr_batch()
    step.advantages(None, batch)
    close(batch.extra["icr_target"], [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0])
    idx = torch.arange(16)
    fields = step.objective.batch_fields(batch, idx)
    logp = torch.full((16, 40), math.log(0.5), requires_grad=True)
    fields.update(logp=logp, old_logp=logp.detach())
    w = step.objective.weights(fields["mask"])  # token_mean: 1 / 272 tokens (sum of LENS)
    _, stats, _ = step.objective(fields, w)
    # targets hold 10 + 5 + 5 = 20 tokens, each -log 0.5
    assert stats["reg/icr"] == pytest.approx(20 * math.log(2) / float(LENS.sum()))
    m = batch_metrics(batch, {})
    assert m["length/accuracy_corr"] == pytest.approx(RHO_B)
    with pytest.raises(ConfigError, match=r"regularizers\.0\.top: expected a value >= 1, got 0"):
        load_config(None, ["regularizers=[{name: icr, top: 0}]"])
    with pytest.raises(ConfigError, match=r"regularizers\.0\.gate: expected 'batch' or 'group'"):
        load_config(None, ["regularizers=[{name: icr, gate: prompt}]"])


# ------------------------------------------------------------------------------------------------ SRPO
def test_srpo_weights_by_hand():
    s = T([[1.0, 3.0, nan, 2.0, 0.0], [nan, nan, nan, nan, nan], [0.5, -0.5, nan, nan, 7.0]])
    mask = T([[1.0, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    w = build("regularizer", "srpo")({"srpo_contrast": s, "mask": mask})["pg_mask"]
    t = math.tanh
    # row 0: role tokens 1, 3, 2 (the 0.0 is off the mask): b = 2; w = 1 + 0.5 tanh(s - 2)
    # row 2: role tokens 0.5, -0.5, 7.0: b = 7/3
    b2 = 7.0 / 3
    close(w, [[1 + 0.5 * t(-1), 1 + 0.5 * t(1), 1, 1, 1], [1, 1, 1, 1, 1],
              [1 + 0.5 * t(0.5 - b2), 1 + 0.5 * t(-0.5 - b2), 1, 1, 1 + 0.5 * t(7 - b2)]])
    w2 = srpo(s, mask, strength=0.9, scale=0.5)["pg_mask"]
    close(w2[0, :2], [1 + 0.9 * t(-2), 1 + 0.9 * t(2)])
    assert (w2 >= 1 - 0.9 - 1e-7).all() and (w2 <= 1.9 + 1e-7).all() and (w2 > 0).all()


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "gmpo", "cispo", "gpg", "sapo", "dispo"])
def test_srpo_weight_on_the_loss_is_the_token_level_advantage(loss):
    """A loss (ppo_clip with dual clip) with SRPO's pg_mask w == the same loss with advantages A_{i,t} = w_{i,t} A_i:
    same value, same gradient; and the direction of every token's update is the one of plain GRPO."""
    g = torch.Generator().manual_seed(0)
    n, t = 4, 6
    old = -torch.rand(n, t, generator=g) * 2 - 0.1
    logp0 = old + 0.3 * torch.randn(n, t, generator=g)
    adv = T([1.0, -0.5, 2.0, -1.5])
    mask = torch.ones(n, t)
    mask[1, 4:] = 0
    s = torch.randn(n, t, generator=g)
    s[:, 0] = nan  # a tag token: no role

    def objective(regs):
        extra = ["loss.dual_clip=3.0"] if loss == "ppo_clip" else []
        cfg = load_config(None, [f"regularizers={regs}", f"loss.name={loss}", "rollout.max_new_tokens=6", *extra])
        return Objective.from_config(cfg)

    with_srpo, plain = objective("[{name: srpo, strength: 0.8}]"), objective("[]")
    w = srpo(s, mask, strength=0.8)["pg_mask"]
    results = []
    for obj, a in ((with_srpo, adv), (plain, w * adv[:, None])):
        logp = logp0.clone().requires_grad_(True)
        fields = {"logp": logp, "old_logp": old, "advantages": a, "mask": mask, "srpo_contrast": s,
                  "lengths": mask.sum(-1)}
        loss, _, _ = obj(fields, obj.weights(mask))
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss.detach(), grad))
    close(results[0][0], results[1][0], 1e-6)
    close(results[0][1], results[1][1], 1e-7)
    logp = logp0.clone().requires_grad_(True)
    fields = {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask, "lengths": mask.sum(-1)}
    (grad_plain,) = torch.autograd.grad(plain(fields, plain.weights(mask))[0], logp)
    assert ((results[0][1] * grad_plain) >= 0).all()  # positive weights: no token's direction flips


def tiny():
    from postrl.models.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    return tok, build_model(tok, size="nano", seed=0).eval()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def srpo_batch(tok, prompts, completions):
    from postrl.generation import left_pad

    p_ids, p_mask = left_pad([ids(tok, p) for p in prompts], tok.pad_token_id)
    comps = [ids(tok, c) + [tok.eos_token_id] for c in completions]
    width = max(len(c) for c in comps)
    c_ids = torch.full((len(comps), width), tok.pad_token_id, dtype=torch.long)
    c_mask = torch.zeros(len(comps), width)
    for i, c in enumerate(comps):
        c_ids[i, :len(c)], c_mask[i, :len(c)] = torch.tensor(c), 1.0
    n = len(comps)
    return RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask,
                        group_ids=torch.zeros(n, dtype=torch.long), sampler_logprobs=torch.zeros(n, width),
                        truncated=torch.zeros(n, dtype=torch.bool), prompts=prompts, completions=completions)


def test_srpo_spans_and_corruption():
    tok, _ = tiny()
    comp = ids(tok, "<p>ab</p><r>c")  # unclosed reasoning runs to the end
    assert span_tokens(comp, tok, "p") == ([3, 4], True)
    assert span_tokens(comp, tok, "r") == ([12], True)
    assert span_tokens(comp, tok, "q") == ([], False)
    x = list(range(10))
    assert corrupt(x, [2, 3, 4], "mask", 99, 0) == [0, 1, 99, 99, 99, 5, 6, 7, 8, 9]
    sh = corrupt(x, [2, 3, 4, 5, 6], "shuffle", 99, 7)
    assert sh[:2] == [0, 1] and sh[7:] == [7, 8, 9] and sorted(sh[2:7]) == [2, 3, 4, 5, 6] and sh != x
    assert corrupt(x, [2, 3, 4, 5, 6], "shuffle", 99, 7) == sh  # seeded


def test_srpo_contrast_is_the_policy_log_prob_difference():
    """On a nano Llama: perception tokens' contrast = log-prob under the original minus the evidence-masked prompt;
    reasoning tokens' = under the response minus the perception-masked response; NaN elsewhere (tags, EOS, a
    response without the format); recomputed here with the model directly."""
    tok, model = tiny()
    prompts = ["<evidence>12+3</evidence> sum?", "<evidence>7</evidence> x?", "no evidence"]
    completions = ["<perception>12 3</perception><reasoning>15</reasoning>", "<reasoning>7</reasoning>", "9"]
    batch = srpo_batch(tok, prompts, completions)
    ctx = ModelContext(model, tok, temperature=1.0, pad_id=tok.pad_token_id)
    s = srpo_contrast(ctx, batch)
    unk = tok.unk_token_id

    def lp(prompt_text, completion_ids):
        p = torch.tensor([ids(tok, prompt_text)])
        c = torch.tensor([completion_ids])
        with torch.no_grad():
            return completion_logprobs(model, p, torch.ones_like(p), c)[0][0]

    comp0 = ids(tok, completions[0]) + [tok.eos_token_id]
    per = list(range(len("<perception>"), len("<perception>12 3")))
    rea_start = len("<perception>12 3</perception><reasoning>")
    rea = list(range(rea_start, rea_start + 2))
    base = lp(prompts[0], comp0)
    p_ids = ids(tok, prompts[0])
    ev = list(range(len("<evidence>"), len("<evidence>12+3")))
    for j in ev:
        p_ids[j] = unk
    with torch.no_grad():
        corrupted_p = completion_logprobs(model, torch.tensor([p_ids]), torch.ones(1, len(p_ids), dtype=torch.long),
                                          torch.tensor([comp0]))[0][0]
    c_ids = list(comp0)
    for j in per:
        c_ids[j] = unk
    with torch.no_grad():
        corrupted_c = completion_logprobs(model, torch.tensor([ids(tok, prompts[0])]),
                                          torch.ones(1, len(ids(tok, prompts[0])), dtype=torch.long),
                                          torch.tensor([c_ids]))[0][0]
    want = torch.full((len(comp0),), nan)
    want[per] = (base - corrupted_p)[per]
    want[rea] = (base - corrupted_c)[rea]
    close(s[0, :len(comp0)], want, 1e-5)
    assert torch.isfinite(s[0, per]).all() and (s[0, per] != 0).any()  # the evidence matters to a random model too
    # row 1: reasoning without a perception section -> no role token; row 2: no section at all (and no evidence:
    # not an error, its prompt is never corrupted)
    assert torch.isnan(s[1]).all() and torch.isnan(s[2]).all()
    bad = srpo_batch(tok, ["no evidence here"], ["<perception>a</perception><reasoning>b</reasoning>"])
    with pytest.raises(DataError, match=r"row 0: the prompt has no <evidence>\.\.\.</evidence> section"):
        srpo_contrast(ctx, bad)


def test_srpo_through_the_step_and_config():
    tok, model = tiny()
    cfg = load_config(None, ["regularizers=[{name: srpo, corruption: shuffle, evidence_tag: ev, strength: 0.3}]"])
    step = Step(cfg)
    batch = srpo_batch(tok, ["<ev>123</ev> q", "<ev>45</ev> q"],
                       ["<perception>123</perception><reasoning>6</reasoning>", "<perception>4</perception>"])
    batch.reward = T([1.0, 0.0])
    batch.valid = torch.ones(2, dtype=torch.bool)
    ctx = ModelContext(model, tok, temperature=1.0, pad_id=tok.pad_token_id)
    step.advantages(ctx, batch)
    s = batch.extra["srpo_contrast"]
    assert torch.isfinite(s[0]).sum() == 3 + 1 and torch.isfinite(s[1]).sum() == 1
    fields = step.objective.batch_fields(batch, torch.arange(2))
    assert "srpo_contrast" in fields
    w = step.objective.regularizers[0](fields)["pg_mask"]
    assert ((w > 0.7) & (w < 1.3)).all()
    assert w[1].tolist() == [1.0] * w.shape[1]  # a single role token is its own baseline: weight 1
    with pytest.raises(ConfigError, match=r"regularizers\.0\.strength: expected a value >= 0 and < 1, got 1"):
        load_config(None, ["regularizers=[{name: srpo, strength: 1.0}]"])
    with pytest.raises(ConfigError, match=r"regularizers\.0\.corruption: expected 'mask' or 'shuffle'"):
        load_config(None, ["regularizers=[{name: srpo, corruption: drop}]"])


def test_methods_lists_the_producer_parameters_of_the_entry(capsys):
    from postrl.cli import main

    assert main(["methods", "icr", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [(p["name"], p.get("field")) for p in d["parameters"]] == [
        (k, "icr_target") for k in ("source", "correct_threshold", "top", "gate", "max_corr", "shorter_than_mean")]
    assert main(["methods", "srpo", "--kind", "regularizer", "--json"]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)["parameters"]]
    assert names == ["strength", "scale", "perception_tag", "reasoning_tag", "evidence_tag", "corruption", "seed"]
