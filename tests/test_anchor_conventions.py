"""Issue 17 section 3: every anchor convention selectable (or gone), checked against the anchor's formula written
out here (verl 0.9.1 core_algos / TRL 1.16 GRPOTrainer) and against hand-computed values."""

import math

import pytest
import torch

from postrl import registry, stages
from postrl.errors import ConfigError
from postrl.batch import RolloutBatch
from postrl.config import load_config
from postrl.losses import dr_grpo, seq_mean_token_mean, seq_mean_token_sum, token_mean
from postrl.losses.objective import Objective

# ---------------------------------------------------------------------------------------------- empty rows


def _mask_with_empty_row():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2: reward failed
    L = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [7.0, 7.0, 7.0, 7.0]])
    return mask, L


def verl_agg_loss(L, mask, mode, global_batch_size, loss_scale_factor=None):
    """verl 0.9.1 ``agg_loss`` (dp_size 1) with the trainer's ``global_batch_size``."""
    if mode == "seq-mean-token-mean":
        seq = (L * mask).sum(-1) / (mask.sum(-1) + 1e-8)
        return (seq * (mask.sum(-1) > 0)).sum() / global_batch_size
    seq = (L * mask).sum(-1)
    loss = (seq * (mask.sum(-1) > 0)).sum() / global_batch_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor or mask.shape[-1])
    return loss


def test_empty_row_counts_in_every_sequence_average_as_in_verl_and_trl():
    mask, L = _mask_with_empty_row()
    N = 3
    # hand values: the failed row adds 0 and counts
    assert float((seq_mean_token_mean(mask) * L).sum()) == pytest.approx((2.0 + 4.0) / 3)
    assert float((seq_mean_token_sum(mask) * L).sum()) == pytest.approx((6.0 + 4.0) / 3)
    assert float((dr_grpo(mask, max_len=8) * L).sum()) == pytest.approx(10.0 / (3 * 8))
    assert float((token_mean(mask) * L).sum()) == pytest.approx(10.0 / 4)
    # verl trainer: global_batch_size = all rows
    assert float((seq_mean_token_mean(mask) * L).sum()) == pytest.approx(
        float(verl_agg_loss(L, mask, "seq-mean-token-mean", N)))
    assert float((seq_mean_token_sum(mask) * L).sum()) == pytest.approx(
        float(verl_agg_loss(L, mask, "seq-mean-token-sum", N)))
    assert float((dr_grpo(mask, max_len=8) * L).sum()) == pytest.approx(
        float(verl_agg_loss(L, mask, "seq-mean-token-sum-norm", N, 8)))
    # TRL grpo / sapo and dr_grpo
    trl_grpo = ((L * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    trl_dr = (L * mask).sum() / (L.size(0) * 8)
    assert float((registry.get("aggregation", "sequence")(mask) * L).sum()) == pytest.approx(float(trl_grpo))
    assert float((dr_grpo(mask, max_len=8) * L).sum()) == pytest.approx(float(trl_dr))


def test_nonempty_rows_reproduce_verl_agg_loss_without_global_batch_size():
    mask, L = _mask_with_empty_row()
    rows = mask.sum(-1) > 0
    for name, mode in (("seq_mean_token_mean", "seq-mean-token-mean"), ("seq_mean_token_sum", "seq-mean-token-sum"),
                       ("dr_grpo", "seq-mean-token-sum-norm")):
        w = registry.get("aggregation", name)(mask, max_len=4, rows=rows)
        assert float((w * L).sum()) == pytest.approx(float(verl_agg_loss(L, mask, mode, 2, 4)))


def _batch(reward, valid, mask):
    n, t = mask.shape
    return RolloutBatch(prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                        completion_ids=torch.ones(n, t, dtype=torch.long), completion_mask=mask,
                        group_ids=torch.zeros(n, dtype=torch.long), sampler_logprobs=torch.zeros(n, t),
                        truncated=torch.zeros(n, dtype=torch.bool), prompts=[""] * n, completions=[""] * n,
                        reward=reward, valid=valid)


def test_objective_counts_failed_rows_but_not_padding():
    """A failed reward (NaN, valid False) counts as a 0 row under loss.agg_rows=all, so it does not rescale the
    other rows' weights; a masked padding copy (valid False, finite reward) never counts; nonempty counts rows
    with a loss token."""
    mask = torch.ones(4, 2)
    batch = _batch(torch.tensor([1.0, 0.0, float("nan"), 1.0]), torch.tensor([True, True, False, False]), mask)
    obj = Objective.from_config(load_config(None, ["loss.agg=seq_mean_token_mean"]))
    assert obj.rows(batch).tolist() == [True, True, True, False]
    loss_mask = mask * batch.valid.unsqueeze(-1).float()
    w = obj.weights(loss_mask, obj.rows(batch))
    assert torch.allclose(w.sum(-1), torch.tensor([1 / 3, 1 / 3, 0.0, 0.0]))  # each trained row weighs 1/3
    obj2 = Objective.from_config(load_config(None, ["loss.agg=seq_mean_token_mean", "loss.agg_rows=nonempty"]))
    assert obj2.rows(batch).tolist() == [True, True, False, False]
    assert torch.allclose(obj2.weights(loss_mask, obj2.rows(batch)).sum(-1), torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert torch.allclose(obj2.weights(loss_mask).sum(-1), torch.tensor([0.5, 0.5, 0.0, 0.0]))


# ---------------------------------------------------------------------------------------------- groups of one
from postrl.advantages import grpo  # noqa: E402
from postrl.advantages.outcome import dr_grpo as adv_dr_grpo, gpg, opo, reinforce_pp_baseline, rloo  # noqa: E402
from postrl.advantages.shaped import gdpo  # noqa: E402


def verl_grpo(scores, index, eps=1e-6, norm=True):
    """verl ``compute_grpo_outcome_advantage``: loop over groups; a group of one has mean 0, std 1."""
    out = scores.clone()
    for g in set(index):
        rows = [i for i, x in enumerate(index) if x == g]
        s = scores[rows]
        mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if len(rows) == 1 else (s.mean(), s.std())
        out[rows] = (s - mean) / (std + eps) if norm else s - mean
    return out


def verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / mask.sum()
    var = ((values - mean) ** 2 * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


R = torch.tensor([1.0, 0.0, 1.0, 0.7, 0.2, 0.5], dtype=torch.float64)
IDX = [0, 0, 0, 1, 2, 2]  # group 1 has one completion
G = torch.tensor(IDX)


def test_singleton_default_zero_and_raw_matches_verl():
    assert grpo(R, G)[3].item() == 0.0 and rloo(R, G)[3].item() == 0.0  # postrl default kept
    assert torch.allclose(grpo(R, G, singleton="raw").double(), verl_grpo(R, IDX), atol=1e-6)
    assert grpo(R, G, singleton="raw")[3].item() == pytest.approx(0.7 / (1 + 1e-6))
    assert torch.allclose(adv_dr_grpo(R, G, singleton="raw").double(), verl_grpo(R, IDX, norm=False), atol=1e-6)
    # verl rloo: a group of one keeps its score; opo: baseline 0; gpg: alpha * (r - 0) / f_norm
    assert rloo(R, G, singleton="raw")[3].item() == pytest.approx(0.7)
    assert opo(R, G, torch.tensor([3.0, 2, 1, 4, 2, 2]), singleton="raw")[3].item() == pytest.approx(0.7)
    alpha = 6 / 5  # 5 non-zero scores of 6
    assert gpg(R, G, singleton="raw")[3].item() == pytest.approx(alpha * 0.7)
    with pytest.raises(ConfigError, match="^advantage.singleton: expected 'zero' or 'raw', got 'verl'$"):
        stages.build("advantage", "grpo", {"singleton": "verl"})


def test_reinforce_pp_baseline_raw_singleton_whitens_the_raw_reward_as_verl():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    ours = reinforce_pp_baseline(R, G, mask, singleton="raw")
    centred = R.clone()
    for g in set(IDX):
        rows = [i for i, x in enumerate(IDX) if x == g]
        centred[rows] = R[rows] - (R[rows].mean() if len(rows) > 1 else 0.0)
    ref = verl_masked_whiten(centred.unsqueeze(-1) * mask.double(), mask.double())
    assert torch.allclose(ours.double().unsqueeze(-1) * mask, ref * mask, atol=1e-6)
    assert reinforce_pp_baseline(R, G, mask)[3].item() == 0.0  # default: left out


def test_gdpo_verl_variant_token_weighted_whitening():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, 0.0], [0.0, 0.0], [1.0, 0.5]])
    w = torch.tensor([1.0, 0.5])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    s = sum(w[k] * verl_grpo(rewards[:, k].double(), IDX) for k in range(2))
    ref = verl_masked_whiten(s.unsqueeze(-1) * mask.double(), mask.double())
    ours = gdpo(rewards, w, G, None, mask, eps=1e-6, token_weighted=True, singleton="raw")
    assert torch.allclose(ours.double().unsqueeze(-1) * mask, ref * mask, atol=1e-5)
    # the TRL default (row-weighted, eps outside) differs on the same input
    trl = gdpo(rewards, w, G, None, mask, eps=1e-6, singleton="raw")
    assert not torch.allclose(trl.double().unsqueeze(-1) * mask, ref * mask, atol=1e-3)


# ---------------------------------------------------------------------------------------------- KL, kl_cov
from postrl.losses import kl_cov, kl_k3, kl_low_var_kl, kl_low_var_kl_st  # noqa: E402


def verl_low_var_kl(logprob, ref_logprob):
    kl = (ref_logprob - logprob).clamp(-20, 20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def test_low_var_kl_is_verls_clamped_k3_and_k3_is_trls_unclamped():
    logp = torch.tensor([-0.5, -14.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -0.5, -30.0])  # d = ref - logp: -0.5, 13.5 (k3 > 10), -29
    ours = kl_low_var_kl(logp, ref)
    assert torch.allclose(ours, verl_low_var_kl(logp, ref))
    assert ours[1].item() == 10.0 and kl_k3(logp, ref)[1].item() == pytest.approx(math.exp(13.5) - 13.5 - 1, rel=1e-5)
    (g,) = torch.autograd.grad(ours.sum(), logp)
    assert g[1].item() == 0.0 and g[0].item() != 0.0  # no gradient where the clamp binds
    # straight-through: value of the clamped k3, gradient of k2
    st = kl_low_var_kl_st(logp, ref)
    (g2,) = torch.autograd.grad(st.sum(), logp)
    assert torch.allclose(st, ours) and torch.allclose(g2, logp.detach() - ref)
    cfg = load_config(None, ["kl.coef=0.1", "kl.estimator=low_var_kl"])
    assert Objective.from_config(cfg).kl is kl_low_var_kl


def test_kl_cov_default_coefficient_is_verls_shipped_value():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]])
    loss, info = kl_cov(logp, old, torch.tensor([1.0]), torch.ones(1, 2), kl_cov_ratio=0.5)
    sel = info["kl_cov"]
    assert sel.sum() == 1
    pg = -1.0 * torch.exp(logp.detach() - old)
    assert torch.allclose(loss.detach(), torch.where(sel, pg + 0.1 * (logp.detach() - old).abs(), pg))


# ---------------------------------------------------------------------------------------------- top-p / top-k
from postrl.diagnostics.metrics import kept_mass_metrics  # noqa: E402
from postrl.diagnostics.monitors import Watchdog  # noqa: E402
from postrl.logprobs import completion_logprobs, filter_logits  # noqa: E402
from postrl.rollout import hf  # noqa: E402
from postrl.generation import SamplingParams  # noqa: E402


def test_sampler_filtered_logprob_and_kept_mass_hand_values():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    u = torch.tensor([0.1, 0.9])  # row 0 -> token 0; row 1 -> the last kept token (1)
    full = hf._sample(logits, SamplingParams(top_p=0.6), u)
    filt = hf._sample(logits, SamplingParams(top_p=0.6, logprobs="filtered"), u)
    assert full[0].tolist() == filt[0].tolist() == [0, 1]  # token 2 (mass before it 0.8 >= 0.6) is removed
    assert torch.allclose(full[2], torch.log(torch.tensor([0.8, 0.8])))  # kept mass 0.5 + 0.3
    assert torch.allclose(full[1], torch.log(torch.tensor([0.5, 0.3])))  # unfiltered (old behaviour)
    assert torch.allclose(filt[1], torch.log(torch.tensor([0.5 / 0.8, 0.3 / 0.8])))  # renormalised
    # top-k=1: the kept distribution is one token, log q = 0
    k1 = hf._sample(logits, SamplingParams(top_k=1, logprobs="filtered"), u)
    assert k1[0].tolist() == [0, 0] and torch.allclose(k1[1], torch.zeros(2), atol=1e-6)
    # no filter: kept log-mass 0, same log-probs either way
    plain = hf._sample(logits, SamplingParams(logprobs="filtered"), u)
    assert torch.equal(plain[2], torch.zeros(2)) and torch.allclose(plain[1], torch.log(torch.tensor([0.5, 0.2])))
    with pytest.raises(ValueError, match="rollout.logprobs"):
        SamplingParams(logprobs="processed")


def test_trainer_logprobs_filter_the_same_way_and_keep_the_sampled_token():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.25, 0.15]]]))  # [1, 2, 3]
    comp = torch.tensor([[1, 2]])  # the second token lies outside the trainer's top-p set: kept anyway
    lp, _ = completion_logprobs(None, None, None, comp, 1.0, logits=logits, top_p=0.6)
    assert torch.allclose(lp, torch.log(torch.tensor([[0.3 / 0.8, 0.15 / 0.75]])), atol=1e-6)
    lp_full, _ = completion_logprobs(None, None, None, comp, 1.0, logits=logits)
    assert torch.allclose(lp_full, torch.log(torch.tensor([[0.3, 0.15]])), atol=1e-6)
    assert torch.isinf(filter_logits(logits[0], top_p=0.6)[1, 2])  # without keep it would be removed
    # the gradient flows through the kept logits only
    z = logits.clone().requires_grad_(True)
    lp, _ = completion_logprobs(None, None, None, comp, 1.0, logits=z, top_p=0.6)
    (g,) = torch.autograd.grad(lp[0, 0], z)
    assert torch.allclose(g[0, 0], torch.tensor([-0.5 / 0.8, 1 - 0.3 / 0.8, 0.0]), atol=1e-6)
    assert SamplingParams(top_p=0.6, logprobs="filtered").logprob_filter() == {"top_p": 0.6, "top_k": 0}
    assert SamplingParams(top_p=0.6).logprob_filter() == {}
    assert SamplingParams(top_p=0.6, temperature=0.0, logprobs="filtered").logprob_filter() == {}


def test_generator_filtered_logprobs_equal_the_trainer_recompute():
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.rollout.hf import HFGenerator

    tok = build_tokenizer()
    model = build_model(tok, size="nano", seed=0).eval()
    prompts = [tok.encode("12+3="), tok.encode("7*8=")]
    kw = dict(max_new_tokens=6, temperature=0.9, top_p=0.7, top_k=20)
    full = HFGenerator(model, tok).generate(prompts, 2, SamplingParams(**kw), seed=3)
    filt = HFGenerator(model, tok).generate(prompts, 2, SamplingParams(**kw, logprobs="filtered"), seed=3)
    m = filt.completion_mask
    assert torch.equal(full.completion_ids, filt.completion_ids)  # the same draws
    assert torch.allclose(full.kept_logmass, filt.kept_logmass)
    assert (full.kept_logmass[m > 0] < 0).any() and (full.kept_logmass <= 1e-6).all()
    assert torch.allclose(filt.logprobs, (full.logprobs - full.kept_logmass) * m, atol=1e-5)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, filt.prompt_ids, filt.prompt_mask, filt.completion_ids, 0.9,
                                    **SamplingParams(**kw, logprobs="filtered").logprob_filter())
        lp_full, _ = completion_logprobs(model, full.prompt_ids, full.prompt_mask, full.completion_ids, 0.9)
    assert torch.allclose(lp * m, filt.logprobs, atol=1e-4)
    assert torch.allclose(lp_full * m, full.logprobs, atol=1e-4)
    assert HFGenerator(model, tok).generate(prompts, 1, SamplingParams(max_new_tokens=3), seed=0).kept_logmass is None


def test_kept_mass_metrics_and_monitor():
    lm = torch.log(torch.tensor([[0.8, 0.5, 1.0], [0.9, 1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    m = kept_mass_metrics(lm, mask)
    assert m["sampler/kept_mass_mean"] == pytest.approx((0.8 + 0.5 + 0.9) / 3)
    assert m["sampler/kept_mass_min"] == pytest.approx(0.5)
    assert m["sampler/kept_logmass_seq"] == pytest.approx((math.log(0.4) + math.log(0.9)) / 2)
    row = {"step": 1, **m}
    for logprobs, fires in (("full", True), ("filtered", False)):
        w = Watchdog({"rollout": {"top_p": 0.8, "top_k": 0, "logprobs": logprobs}})
        w.step(row)
        alarms = [a.name for a in w.step({**row, "step": 2})]
        assert ("filtered_sampling" in alarms) is fires
    w = Watchdog({"rollout": {"logprobs": "full"}})
    assert not [a for a in w.step({"step": 1, "sampler/kept_mass_mean": 0.99}) + w.step(
        {"step": 2, "sampler/kept_mass_mean": 0.99}) if a.name == "filtered_sampling"]


def test_training_with_filtered_logprobs_both_speed_paths(tmp_path):
    """rollout.logprobs=filtered end to end: the trainer's log-probs are of the same filtered distribution as the
    sampler's (no mismatch, although top-p drops mass), the kept mass is logged, and the speed layer (static
    decoder, fused forward) and the plain path give the same step."""
    import json

    from postrl.models.tiny import build_local
    from postrl.train.trainer import Trainer

    build_local(tmp_path / "m", size="nano", seed=0)
    rows = {}
    for mode in ("auto", "off"):
        cfg = load_config(None, [f"model.path={tmp_path / 'm'}", f"output_dir={tmp_path / mode}",
                                 "task.name=arithmetic", "task.digits=1", "rollout.max_new_tokens=6",
                                 "rollout.group_size=4", "train.prompts_per_step=4", "train.steps=1",
                                 "train.save_every=0", "train.eval_size=4", "train.eval_k=1", "accel.threads=1",
                                 "rollout.top_p=0.7", "rollout.temperature=0.9", "rollout.logprobs=filtered",
                                 f"accel.mode={mode}"])
        Trainer(cfg, cfg.output_dir).train()
        rows[mode] = json.loads((tmp_path / mode / "metrics.jsonl").read_text().splitlines()[0])
    for r in rows.values():
        assert r["sampler/kept_mass_mean"] < 0.95  # top-p dropped mass ...
        assert r["mismatch/logp_abs_mean"] < 1e-3  # ... yet sampler and trainer agree
    for key in ("reward/mean", "pg_loss", "sampler/kept_mass_mean", "length/mean", "grad_norm"):
        assert rows["auto"][key] == pytest.approx(rows["off"][key], rel=1e-4, abs=1e-6), key


def test_multi_temperature_generation_carries_the_kept_logmass():
    """The kept log-mass follows each row when completions at several temperatures are merged (rollout plans)."""
    from postrl.selection.sampling import generate_multi_temperature
    from postrl.models.tiny import build_model, build_tokenizer
    from postrl.rollout.hf import HFGenerator

    tok = build_tokenizer()
    gen = HFGenerator(build_model(tok, size="nano", seed=0), tok)
    prompts = [tok.encode("1+2="), tok.encode("3+4=")]
    params = SamplingParams(max_new_tokens=4, top_p=0.7)
    out, row_t = generate_multi_temperature(gen.generate, prompts, params, [0.7, 1.0], [5, 6], tok.pad_token_id)
    assert out.kept_logmass is not None and out.kept_logmass.shape == out.logprobs.shape
    for t in (0.7, 1.0):
        rows = (row_t == t).nonzero().flatten()
        s = [(x + int(round(t * 1000)) * 104729) % (2**62) for x in [5, 6]]
        alone = gen.generate(prompts, 1, SamplingParams(max_new_tokens=4, top_p=0.7, temperature=t), s)
        w = alone.kept_logmass.shape[1]
        assert torch.allclose(out.kept_logmass[rows, :w], alone.kept_logmass, atol=1e-6)
