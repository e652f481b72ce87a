"""Calibration: metrics by hand, PAV, temperature scaling, conditional optimal transport, save/load, the CLI,
reward-time application, and the demonstration on miscalibrated PRM scores whose truth is known."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from postrl.calibration import (
    ConditionalOT,
    Isotonic,
    TemperatureScaling,
    brier,
    conditional_ece,
    ece,
    load_calibrator,
    make_calibrator,
    pav,
    reliability_curve,
    step_bucket,
)
from postrl.cli import main as cli_main
from postrl.errors import ConfigError, DataError


def test_metrics_by_hand():
    p = [0.05, 0.15, 0.95, 0.85]
    y = [0.0, 1.0, 1.0, 1.0]
    # bins of width 0.1: {0.05}->0, {0.15}->1, {0.85}->1, {0.95}->1
    assert ece(p, y) == pytest.approx((0.05 + 0.85 + 0.15 + 0.05) / 4)
    assert ece(p, y, n_bins=2) == pytest.approx(0.5 * abs(0.1 - 0.5) + 0.5 * abs(0.9 - 1.0))
    assert brier(p, y) == pytest.approx(np.mean((np.array(p) - np.array(y)) ** 2))
    mp, my, cnt = reliability_curve(p, y, n_bins=2)
    assert mp.tolist() == pytest.approx([0.1, 0.9]) and my.tolist() == [0.5, 1.0] and cnt.tolist() == [2, 2]
    assert ece([1.0, 0.0], [1.0, 0.0]) == 0.0  # p = 1 falls in the last bin
    # conditional ECE averages the within-condition ECEs (here each condition is off by 0.3 in opposite ways)
    p2, y2, c2 = [0.2, 0.2, 0.8, 0.8], [0.5, 0.5, 0.5, 0.5], ["a", "a", "b", "b"]
    assert ece(p2, y2, n_bins=1) == pytest.approx(0.0)
    assert conditional_ece(p2, y2, c2, n_bins=1) == pytest.approx(0.3)


def brute_isotonic(y):
    """Least-squares non-decreasing fit by enumerating block partitions (small n)."""
    n = len(y)
    best, best_fit = None, None
    for cuts in itertools.product([0, 1], repeat=n - 1):
        blocks, start = [], 0
        for i, c in enumerate(cuts, 1):
            if c:
                blocks.append((start, i))
                start = i
        blocks.append((start, n))
        fit = np.concatenate([[np.mean(y[a:b])] * (b - a) for a, b in blocks])
        if np.all(np.diff(fit) >= -1e-12):
            err = float(np.sum((fit - y) ** 2))
            if best is None or err < best - 1e-12:
                best, best_fit = err, fit
    return best_fit


def test_pav_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        y = rng.uniform(size=7)
        assert np.allclose(pav(y), brute_isotonic(y))
    assert pav(np.array([3.0, 1.0]), np.array([1.0, 3.0])).tolist() == [1.5, 1.5]  # weighted pooling
    iso = Isotonic().fit([0.1, 0.2, 0.2, 0.3, 0.4], [0.0, 1.0, 0.0, 0.0, 1.0])
    out = iso.apply([0.0, 0.1, 0.2, 0.3, 0.4, 1.0])
    assert np.all(np.diff(out) >= 0)  # monotone, clipped outside the fitted range
    assert out[0] == out[1] and out[-1] == out[-2] == 1.0


def test_temperature_recovers_a_known_temperature():
    rng = np.random.default_rng(1)
    z = rng.normal(0, 2, 20000)
    y = (rng.uniform(size=z.size) < 1 / (1 + np.exp(-z))).astype(float)
    scores = 1 / (1 + np.exp(-3.0 * z))  # over-confident by a factor 3 -> T = 3
    t = TemperatureScaling().fit(scores, y)
    assert t.temperature == pytest.approx(3.0, rel=0.05)
    tl = TemperatureScaling(input="logit").fit(3.0 * z, y)
    assert tl.temperature == pytest.approx(t.temperature, rel=0.01)  # (probabilities are clipped at 1e-6)
    assert ece(t.apply(scores), y) < 0.02 < ece(scores, y)


def make_prm_scores(n: int, rng):
    """Known truth: p ~ U(0.02, 0.98) per prefix; the PRM's score is p ** gamma_c with gamma depending on the
    step bucket c (over-confident early steps, under-confident late ones); outcome = fraction of 16 MC rollouts
    that succeed."""
    p = rng.uniform(0.02, 0.98, n)
    step = rng.integers(0, 6, n)
    c = np.array([step_bucket(s, 3) for s in step])
    gamma = np.array([0.25, 0.5, 2.0, 4.0])[np.minimum(step, 3)]
    return p ** gamma, c, rng.binomial(16, p) / 16


def test_demo_calibration_of_miscalibrated_prm_scores(capsys):
    rng = np.random.default_rng(0)
    s, c, y = make_prm_scores(2000, rng)
    es, ec, ey = make_prm_scores(4000, rng)
    res = {"before": (ece(es, ey), conditional_ece(es, ey, ec), brier(es, ey))}
    for m in ("temperature", "isotonic", "conditional_ot"):
        a = make_calibrator(m).fit(s, y, c).apply(es, ec)
        res[m] = (ece(a, ey), conditional_ece(a, ey, ec), brier(a, ey))
    with capsys.disabled():
        print("\ncalibration demo (held out; ECE / conditional ECE / Brier): " +
              "; ".join(f"{k} {a:.4f} / {b:.4f} / {d:.4f}" for k, (a, b, d) in res.items()))
    e0 = res["before"][0]
    assert res["isotonic"][0] < e0 / 5 and res["conditional_ot"][0] < e0 / 5  # a large factor
    # the miscalibration depends on the step: only the conditional model fixes it within each condition
    assert res["conditional_ot"][1] < res["isotonic"][1] / 3 and res["conditional_ot"][1] < res["temperature"][1] / 3
    assert res["conditional_ot"][2] < res["isotonic"][2] and res["conditional_ot"][2] < res["temperature"][2]


def test_conditional_ot_recovers_known_conditional_quantiles():
    """y = sigmoid(2 logit(s) + e), e ~ N(0, 1): Q(tau | s) = sigmoid(2 logit(s) + Phi^-1(tau)), which the linear
    head represents exactly; quantiles are non-decreasing in tau for every input, the mean is their integral."""
    from statistics import NormalDist

    rng = np.random.default_rng(5)
    z = rng.normal(0, 1.0, 3000)
    y = 1 / (1 + np.exp(-(2 * z + rng.normal(size=z.size))))
    cal = ConditionalOT().fit(1 / (1 + np.exp(-z)), y)
    zq = np.array([-1.0, 0.0, 1.0])
    taus = [0.1, 0.5, 0.9]
    got = cal.quantiles(1 / (1 + np.exp(-zq)), taus)
    want = 1 / (1 + np.exp(-(2 * zq[:, None] + np.array([NormalDist().inv_cdf(t) for t in taus])[None, :])))
    assert np.allclose(got, want, atol=0.04)
    lo, hi = cal.bounds(1 / (1 + np.exp(-zq)), 0.8)
    assert np.allclose(lo, got[:, 0]) and np.allclose(hi, got[:, 2])
    grid = cal.quantiles(np.linspace(0, 1, 101), np.linspace(0, 1, 41))
    assert np.all(np.diff(grid, axis=1) >= 0)  # monotone in tau by construction: no crossing quantiles
    e = np.random.default_rng(0).normal(size=20000)
    want_mean = [np.mean(1 / (1 + np.exp(-(2 * v + e)))) for v in zq]
    assert cal.apply(1 / (1 + np.exp(-zq))) == pytest.approx(want_mean, abs=0.02)
    with pytest.raises(DataError, match="graded"):
        ConditionalOT().fit([0.2, 0.7, 0.9], [0.0, 1.0, 1.0])
    with pytest.raises(ConfigError, match="level"):
        cal.bounds([0.5], 1.5)


def make_prm_with_hidden(n: int, rng, noise: float, d: int = 8, rollouts: int = 32):
    """Known truth with a hidden state: h ~ N(0, I_d); true logit = 2 (h . w)/|w| - 0.3 min(step, 3) + N(0, 0.7)
    (the last term unseen by anyone, so y | h keeps a spread); the PRM's score is sigmoid(logit without the unseen
    term + N(0, noise)) ** gamma_step (the step distortion of make_prm_scores): noise 0 = a well-ranked PRM,
    noise 2 = a noisy one. Outcome = success fraction of ``rollouts`` Monte-Carlo continuations."""
    h = rng.normal(size=(n, d))
    w = np.linspace(1.0, 0.2, d)
    step = rng.integers(0, 6, n)
    c = np.array([step_bucket(v, 3) for v in step])
    seen = 2 * h @ w / np.linalg.norm(w) - 0.3 * np.minimum(step, 3)
    p = 1 / (1 + np.exp(-(seen + rng.normal(0, 0.7, n))))
    gamma = np.array([0.25, 0.5, 2.0, 4.0])[np.minimum(step, 3)]
    s = (1 / (1 + np.exp(-(seen + rng.normal(0, noise, n))))) ** gamma
    return s, c, rng.binomial(rollouts, p) / rollouts, h


def test_conditional_ot_with_hidden_features_vs_isotonic_and_quantile_regression(capsys):
    """Held out, for a well-ranked and a noisy PRM: temperature, isotonic, quantile regression on the score alone
    (the same monotone model without condition or features) and conditional_ot on score + step (+ hidden state).
    The conditional model is calibrated (ECE, conditional ECE), also without the hidden state; its 50/80/90%
    intervals cover the outcome near nominal; with the hidden state it beats isotonic's Brier by a large factor
    and its intervals are sharper; on the score alone it is no better than isotonic."""
    rng = np.random.default_rng(0)
    lines = []
    for noise in (0.0, 2.0):
        s, c, y, h = make_prm_with_hidden(2000, rng, noise)
        es, ec, ey, eh = make_prm_with_hidden(4000, rng, noise)
        res = {"before": es}
        res["temperature"] = make_calibrator("temperature").fit(s, y).apply(es)
        res["isotonic"] = make_calibrator("isotonic").fit(s, y).apply(es)
        qr = ConditionalOT().fit(s, y)
        res["quantile_reg(score)"] = qr.apply(es)
        res["conditional_ot(score+step)"] = ConditionalOT().fit(s, y, c).apply(es, ec)
        cot = ConditionalOT().fit(s, y, c, h)
        res["conditional_ot"] = cot.apply(es, ec, eh)
        m = {k: (ece(a, ey), conditional_ece(a, ey, ec), brier(a, ey)) for k, a in res.items()}
        cov = {}
        for name, cal, args in (("quantile_reg(score)", qr, (None, None)), ("conditional_ot", cot, (ec, eh))):
            for level in (0.5, 0.8, 0.9):
                lo, hi = cal.bounds(es, level, *args)
                cov[name, level] = (float(np.mean((ey >= lo) & (ey <= hi))), float(np.mean(hi - lo)))
        lines.append(f"noise {noise}: " + "; ".join(f"{k} {a:.4f}/{b:.4f}/{d:.4f}" for k, (a, b, d) in m.items())
                     + " | coverage/width " + "; ".join(f"{k[0]}@{k[1]} {v[0]:.3f}/{v[1]:.3f}" for k, v in cov.items()))
        assert m["conditional_ot"][0] < 0.02 and m["conditional_ot"][1] < 0.02
        assert m["conditional_ot"][2] < m["isotonic"][2] / 2.5
        assert m["quantile_reg(score)"][2] > 0.97 * m["isotonic"][2]  # the score alone: no better than isotonic
        # without the hidden state, the step condition alone still calibrates (the marginal quantile map of the
        # old conditional_ot reached ECE 0.114 on a noisy PRM, isotonic 0.010)
        assert m["conditional_ot(score+step)"][0] < 0.03 and m["conditional_ot(score+step)"][1] < 0.04
        for level in (0.5, 0.8, 0.9):
            assert abs(cov["conditional_ot", level][0] - level) < 0.04, (noise, level, cov)
        assert cov["conditional_ot", 0.9][1] < 0.8 * cov["quantile_reg(score)", 0.9][1]  # sharper intervals
    with capsys.disabled():
        print("\nconditional OT vs baselines (held out; ECE / conditional ECE / Brier):\n" + "\n".join(lines))


def test_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(3)
    s, c, y = make_prm_scores(500, rng)
    for m in ("temperature", "isotonic", "conditional_ot"):
        cal = make_calibrator(m).fit(s, y, c)
        again = load_calibrator(cal.save(tmp_path / f"{m}.json"))
        assert type(again) is type(cal)
        assert np.allclose(again.apply(s[:50], c[:50]), cal.apply(s[:50], c[:50]))
    s, c, y, h = make_prm_with_hidden(500, rng, 2.0)
    for hidden in (0, 4):  # the linear head and a tanh layer
        cal = ConditionalOT(steps=50, hidden=hidden).fit(s, y, c, h)
        again = load_calibrator(cal.save(tmp_path / "cot_h.json"))
        assert again.rollouts == cal.rollouts == 32  # inferred from the outcomes' grid k / 32
        assert np.allclose(again.bounds(s[:20], 0.8, c[:20], h[:20]), cal.bounds(s[:20], 0.8, c[:20], h[:20]))
        assert np.all(np.diff(again.quantiles(s, np.linspace(0, 1, 21), c, h), axis=1) >= 0)
    with pytest.raises(ConfigError, match="fitted with 8 features"):
        again.apply(s[:5], c[:5])  # the model reward source passes no features
    with pytest.raises(DataError, match="7 columns, expected 8"):
        again.apply(s[:5], c[:5], h[:5, :7])
    (tmp_path / "bad.json").write_text(json.dumps({"method": "nope"}))
    with pytest.raises(ConfigError, match="unknown method"):
        load_calibrator(tmp_path / "bad.json")


def test_cli_calibrate(tmp_path, capsys):
    rng = np.random.default_rng(4)
    s, c, y = make_prm_scores(1500, rng)
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"score": float(a), "condition": b, "outcome": float(o)}) + "\n"
                            for a, b, o in zip(s, c, y)))
    out, png = tmp_path / "cal.json", tmp_path / "rel.png"
    assert cli_main(["calibrate", str(data), "--method", "conditional_ot", "--out", str(out), "--plot", str(png),
                     "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ece_after"] < res["ece_before"] / 3 and res["brier_after"] < res["brier_before"]
    assert res["conditional_ece_after"] < res["conditional_ece_before"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and load_calibrator(out).method == "conditional_ot"
    s, c, y, h = make_prm_with_hidden(1500, rng, 2.0)
    hdata = tmp_path / "calib_h.jsonl"
    hdata.write_text("".join(json.dumps({"score": float(a), "condition": b, "outcome": float(o), "h": v.tolist()})
                             + "\n" for a, b, o, v in zip(s, c, y, h)))
    assert cli_main(["calibrate", str(hdata), "--method", "conditional_ot", "--features-field", "h", "--level",
                     "0.8", "--out", str(tmp_path / "cot_h.json"), "--json"]) == 0
    res_h = json.loads(capsys.readouterr().out)
    assert res_h["level"] == 0.8 and abs(res_h["coverage"] - 0.8) < 0.06
    assert res_h["brier_after"] < res_h["brier_before"] / 3  # the hidden state carries the information
    assert cli_main(["calibrate", str(hdata), "--method", "isotonic", "--features-field", "h",
                     "--out", str(tmp_path / "x.json")]) == 2
    assert "--features-field needs --method conditional_ot" in capsys.readouterr().err
    assert cli_main(["calibrate", str(data), "--out", str(tmp_path / "iso.json")]) == 0
    text = capsys.readouterr().out
    assert "ece_before=" in text and "ece_after=" in text and "brier_after=" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"score": 0.5, "outcome": 1.0}) + "\n" + json.dumps({"score": 0.5}) + "\n")
    assert cli_main(["calibrate", str(bad), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "row 2" in err and "'outcome'" in err


def test_calibrator_applied_at_reward_time(tmp_path):
    """A PRM scored through the `model` reward source with a calibrator: every step score goes through the
    calibrator with its step bucket as the condition."""
    from postrl import registry
    from postrl.reward_models import RMTrainConfig, StepRecord, fit_prm

    recs = [StepRecord(f"q{i}", "a\n\nb\n\nc", [0.2, 0.5, 1.0]) for i in range(8)]
    prm = fit_prm("bag:4", recs, RMTrainConfig(epochs=1, lr=1e-2), max_length=32)
    folder = prm.save_pretrained(tmp_path / "prm")
    rng = np.random.default_rng(6)  # step 0 succeeds 15% of the time, step 1 75%, whatever the score
    y = np.r_[rng.binomial(16, 0.15, 200), rng.binomial(16, 0.75, 200)] / 16
    cal = ConditionalOT().fit(rng.uniform(size=400), y, ["0"] * 200 + ["1"] * 200)
    cal_path = cal.save(tmp_path / "cal.json")
    fn = registry.get("reward", "model")
    raw = torch.tensor(fn(["q0"], ["a\n\nb\n\nc"], path=str(folder)))[0]
    got = torch.tensor(fn(["q0"], ["a\n\nb\n\nc"], path=str(folder), calibrator=str(cal_path)))[0]
    want = [cal.apply([raw[j].item()], [step_bucket(j)])[0] for j in range(3)]
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert got[0] == pytest.approx(0.15, abs=0.05) and got[1] == pytest.approx(0.75, abs=0.05)  # by condition


def test_calibrator_with_the_prms_hidden_state_at_reward_time(tmp_path):
    """``calibrator_features: hidden``: each step score is calibrated with the PRM's hidden state at that step's
    end (what "Distributional Process Reward Models" conditions on); the old path could not apply such a
    calibrator (scores and step buckets only)."""
    from postrl import registry
    from postrl.reward_models import RMTrainConfig, StepRecord, fit_prm

    recs = [StepRecord(f"q{i}", "a\n\nb\n\nc", [0.2, 0.5, 1.0]) for i in range(8)]
    prm = fit_prm("bag:4", recs, RMTrainConfig(epochs=1, lr=1e-2), max_length=32)
    folder = prm.save_pretrained(tmp_path / "prm")
    sc, hid = prm.step_scores(["q0"], ["a\n\nb\n\nc"], return_hidden=True)
    H = hid.shape[-1]  # the bag backbone's width
    assert sc.shape == (1, 3) and hid.shape == (1, 3, H) and torch.isfinite(hid).all()
    # outcomes driven by the first feature: success fraction ~ sigmoid(3 f0)
    rng = np.random.default_rng(7)
    f = rng.normal(size=(600, H))
    y = rng.binomial(16, 1 / (1 + np.exp(-3 * f[:, 0]))) / 16
    cal = ConditionalOT().fit(rng.uniform(size=600), y, ["0"] * 300 + ["1"] * 300, features=f)
    cal_path = cal.save(tmp_path / "cal.json")
    fn = registry.get("reward", "model")
    with pytest.raises(ConfigError, match=f"fitted with {H} features per row"):  # scores and buckets only
        fn(["q0"], ["a\n\nb\n\nc"], path=str(folder), calibrator=str(cal_path))
    got = fn(["q0"], ["a\n\nb\n\nc"], path=str(folder), calibrator=str(cal_path), calibrator_features="hidden")[0]
    want = [cal.apply([sc[0, j].item()], [step_bucket(j)], features=hid[0, j][None].numpy())[0] for j in range(3)]
    assert got == pytest.approx(want, abs=1e-5)
    iso = Isotonic().fit(rng.uniform(size=50), rng.uniform(size=50))
    with pytest.raises(ConfigError, match="needs a conditional_ot calibrator"):
        fn(["q0"], ["a"], path=str(folder), calibrator=str(iso.save(tmp_path / "iso.json")),
           calibrator_features="hidden")
    wide = ConditionalOT(steps=5).fit(rng.uniform(size=100), y[:100], features=rng.normal(size=(100, 3)))
    with pytest.raises(ConfigError, match=f"fitted on 3 features per row, the PRM .* has a hidden state of {H}"):
        fn(["q0"], ["a"], path=str(folder), calibrator=str(wide.save(tmp_path / "w.json")),
           calibrator_features="hidden")


def test_ias_samples_by_hand():
    from postrl.calibration import ias_samples

    # N = ceil(log(1 - C) / log(1 - p)): C = 0.9, p = 0.5 -> log 0.1 / log 0.5 = 3.32 -> 4; p = 0.9 -> exactly 1;
    # p = 0.1 -> 21.85 -> 22, clipped to 16; p = 0 -> n_max; p >= C -> n_min
    assert ias_samples([0.5, 0.9, 0.1, 0.0, 1.0, 0.95], target=0.9, n_max=16).tolist() == [4, 1, 16, 16, 1, 1]
    assert ias_samples([0.5], target=0.99).tolist() == [7]  # log 0.01 / log 0.5 = 6.64
    assert ias_samples([0.9], target=0.99, n_min=3).tolist() == [3]  # 2, raised to n_min
    with pytest.raises(ConfigError, match="target must be in"):
        ias_samples([0.5], target=1.0)


def test_success_bound_is_the_conditional_quantile():
    from postrl.calibration import success_bound

    rng = np.random.default_rng(3)
    s, c, y = make_prm_scores(800, rng)
    cal = ConditionalOT().fit(s, y, c)
    b = success_bound(cal, s[:20], quantile=0.1, conditions=c[:20])
    assert np.allclose(b, cal.quantiles(s[:20], [0.1], c[:20])[:, 0])
    assert np.all(b <= cal.apply(s[:20], c[:20]) + 1e-9)  # a lower bound sits below the calibrated mean
    assert np.allclose(success_bound(None, [0.3, 1.7]), [0.3, 1.0])  # uncalibrated: the raw score


class _FakePRM:
    kind = "prm"

    def __init__(self, prompt_scores, sample_scores):
        self.p, self.s = prompt_scores, sample_scores

    def prompt_scores(self, prompts):
        return torch.tensor(self.p), torch.zeros(len(prompts), 4)

    def score(self, prompts, completions):
        return torch.tensor(self.s)[:, None]


class _TextBackend:
    """Completion text 'p<i>s<j>' for problem i, sample j."""

    def generate(self, prompt_ids, n, params, seed):
        from postrl.generation import Generation, left_pad

        N = len(prompt_ids) * n
        pid, pmask = left_pad([p for p in prompt_ids for _ in range(n)], 0)
        return Generation(prompt_ids=pid, prompt_mask=pmask, completion_ids=torch.ones(N, 1, dtype=torch.long),
                          completion_mask=torch.ones(N, 1), logprobs=torch.zeros(N, 1),
                          truncated=torch.zeros(N, dtype=torch.bool),
                          texts=[f"p{i}s{j}" for i in range(len(prompt_ids)) for j in range(n)])


def test_evaluate_ias_budget_and_best_of_n():
    from postrl.evaluate import evaluate_ias
    from postrl.models.tiny import build_tokenizer

    rows = [{"prompt": "1+1="}, {"prompt": "2+2="}]
    # problem 0: p = 0.9 -> N = ceil(log 0.05 / log 0.1) = 2; problem 1: p = 0.1 -> 28.4 -> n_max 4
    # PRM sample scores (4 per problem): the best of the first 2 of problem 0 is s1; of all 4: s3
    prm = _FakePRM([0.9, 0.1], [0.2, 0.8, 0.1, 0.9, 0.5, 0.4, 0.3, 0.6])
    correct = {"p0s1", "p1s3"}  # the IAS pick of problem 0 is right, fixed Best-of-4 picks p0s3 (wrong)
    res = evaluate_ias(_TextBackend(), build_tokenizer(), rows, prm, target=0.95, n_max=4, condition=None,
                       max_new_tokens=1, score=lambda texts, rs: [float(t in correct) for t in texts])
    assert res["ias/mean_n"] == 3.0 and res["ias/compute_saved"] == pytest.approx(0.25)
    assert res["ias/n_hist"] == {"2": 1, "4": 1}
    assert res["ias/accuracy"] == 1.0 and res["ias/fixed_accuracy"] == 0.5
    assert res["ias/oracle"] == 1.0 and res["ias/fixed_oracle"] == 1.0


def test_cli_eval_ias(tmp_path, capsys):
    from postrl.models.tiny import build_local
    from postrl.reward_models import RMTrainConfig, StepRecord, fit_prm

    policy = tmp_path / "policy"
    build_local(policy, size="nano", seed=0)
    recs = [StepRecord(f"{i}+1=", "a\n\nb", [0.5, float(i % 2)]) for i in range(8)]
    prm = fit_prm("bag:4", recs, RMTrainConfig(epochs=1, lr=1e-2), max_length=32).save_pretrained(tmp_path / "prm")
    assert cli_main(["eval", str(policy), "task.name=arithmetic", "task.digits=1", "--n", "3", "--k", "1",
                     "--max-new-tokens", "3", "--ias", str(prm), "--ias-max", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1.0 <= res["ias/mean_n"] <= 3.0 and sum(res["ias/n_hist"].values()) == 3
    assert 0.0 <= res["ias/accuracy"] <= res["ias/oracle"] <= res["ias/fixed_oracle"] <= 1.0
    assert cli_main(["eval", str(policy), "--n", "2", "--ias", str(tmp_path / "policy")]) == 2
    assert "no reward_model.json" in capsys.readouterr().err  # a policy is not a PRM: one line, status 2
