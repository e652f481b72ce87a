"""postrl check-logprobs: sampler vs trainer log-prob agreement (postrl.diagnostics.agreement), on a nano model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from logprob_reference import renormalised_reference
from postrl.cli import main as cli_main
from postrl.diagnostics.agreement import LAYOUTS, ratio_stats, recompute
from postrl.models.tiny import build_local


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    path = tmp_path_factory.mktemp("check") / "nano"
    build_local(path, size="nano", seed=0)  # random weights: near-uniform next-token distributions
    return str(path)


def _check(nano, capsys, *extra):
    args = ["check-logprobs", f"model.path={nano}", "rollout.group_size=2", "rollout.max_new_tokens=5",
            "train.micro_batch_size=4", "rollout.temperature=0.9", "--prompts", "3", "--json", *extra]
    status = cli_main(args)
    return status, json.loads(capsys.readouterr().out)


def test_ratio_statistics_by_hand():
    sampler = torch.log(torch.tensor([[0.5, 0.4, 0.2, 0.1]]))
    trainer = torch.log(torch.tensor([[0.6, 0.38, 0.2, 0.05]]))  # ratios 1.2, 0.95, 1, 0.5 (masked out)
    s = ratio_stats(trainer, sampler, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    d = [math.log(1.2), math.log(0.95), 0.0]
    assert s["tokens"] == 3 and s["outside"] == pytest.approx(1 / 3)  # only 1.2 is outside [0.9, 1.1]
    assert s["mean"] == pytest.approx(sum(d) / 3) and s["max_abs"] == pytest.approx(math.log(1.2))
    assert s["std"] == pytest.approx(torch.tensor(d, dtype=torch.float64).std().item())


def test_default_check_agrees_and_shows_the_top_p_bias(nano, capsys):
    """No filter configured: the trainer agrees with the sampler at every micro-batch size and padding layout;
    the top_p=0.9 probe's uncorrected log-ratio is the kept log-mass (mean d = mean log M < 0, ratio >= top_p),
    the corrected one agrees."""
    status, res = _check(nano, capsys)
    assert status == 0 and res["ok"]
    rows = res["rows"]
    conf = res["configured"]
    assert rows[0] == conf and conf["outside"] == 0.0 and conf["max_abs"] < 1e-4 and conf["tokens"] > 0
    mb = [r for r in rows if r["check"] == "micro-batch"]
    assert len(mb) == 3 * len(LAYOUTS)  # sizes 1, 4 (= train.micro_batch_size) and all 6 rows
    assert {r["setting"] for r in mb} >= {"1 row, per micro-batch", "6 rows, extra padding"}
    assert all(r["max_abs"] < 1e-4 and r["tokens"] == conf["tokens"] for r in mb)
    unc, cor = [r for r in rows if r["check"] == "top-p/top-k"]
    assert unc["setting"].startswith("top_p=0.9, uncorrected") and cor["setting"].startswith("top_p=0.9, corrected")
    assert 0.9 <= unc["kept_mass"] < 0.99 and unc["kept_mass"] == cor["kept_mass"]
    assert unc["mean"] < -0.01 and unc["max_abs"] <= -math.log(0.9) + 1e-4  # top-p keeps at least 0.9
    assert abs(cor["mean"]) < 1e-5 and cor["max_abs"] < 1e-4 and cor["outside"] == 0.0


def test_an_uncorrected_filter_fails_the_check_and_the_correction_passes_it(nano, capsys):
    """top_p=0.6 on a random model keeps ~60% of the mass per token: with log-probs of the full distribution
    (rollout.logprobs=full) nearly every token's ratio is below 0.9 and the check exits 1; with the correction
    (filtered) it passes. The probe rows then use the configured filter."""
    status, res = _check(nano, capsys, "rollout.top_p=0.6", "--max-outside", "0.05")
    conf = res["configured"]
    assert status == 1 and not res["ok"] and conf["outside"] > 0.9
    assert conf["mean"] == pytest.approx(math.log(conf["kept_mass"]), abs=0.05)  # d = log M per token
    # the micro-batch rows compare like with like (the sampler's full log-probs): no effect of the filter
    assert all(r["max_abs"] < 1e-4 for r in res["rows"] if r["check"] == "micro-batch")
    status, res = _check(nano, capsys, "rollout.top_p=0.6", "rollout.logprobs=filtered", "--max-outside", "0.05")
    assert status == 0 and res["configured"]["outside"] == 0.0 and res["configured"]["max_abs"] < 1e-4
    unc, cor = [r for r in res["rows"] if r["check"] == "top-p/top-k"]
    assert unc["setting"].startswith("top_p=0.6") and unc["outside"] > 0.9 and cor["outside"] == 0.0


def test_recompute_equals_the_renormalised_reference_in_every_layout(nano):
    """The check's trainer side is the renormalised log-prob of the model's own logits, whatever the micro-batch
    size and padding layout."""
    from postrl.context import ModelContext
    from postrl.generation import SamplingParams
    from postrl.logprobs import completion_logits
    from postrl.models import load_model_and_tokenizer
    from postrl.rollout.hf import HFGenerator

    model, tok = load_model_and_tokenizer(nano, "float32")
    params = SamplingParams(max_new_tokens=5, temperature=0.9, top_k=7, top_p=0.8, logprobs="filtered")
    gen = HFGenerator(model, tok).generate([tok.encode("12+3="), tok.encode("7*8=1")], 2, params, seed=1)
    ctx = ModelContext(model, tok, temperature=0.9, sampling=params, pad_id=tok.pad_token_id)
    with torch.no_grad():
        logits = completion_logits(model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids) / 0.9
    ref = renormalised_reference(logits, gen.completion_ids, 0.8, 7)
    m = gen.completion_mask.bool()
    assert torch.allclose(gen.logprobs[m], ref[m], atol=1e-4)  # the sampler's own log q
    for size in (1, 3):
        for layout in LAYOUTS:
            assert torch.allclose(recompute(ctx, gen, size, layout)[m], ref[m], atol=1e-4), (size, layout)


def test_user_mistakes_are_one_line(nano, capsys):
    for extra, message in ((["--micro-batch-sizes", "0,4"], "--micro-batch-sizes"),
                           (["--max-outside", "2"], "--max-outside"), (["--top-p", "0"], "--top-p")):
        assert cli_main(["check-logprobs", f"model.path={nano}", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("postrl: error: ") and message in err and err.count("\n") == 1
