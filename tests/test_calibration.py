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
from postrl.errors import DataError


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
    s, c, y = make_prm_scores(4000, rng)
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
    # the miscalibration depends on the step: only the conditional map fixes it within each condition
    assert res["conditional_ot"][1] < res["isotonic"][1] / 3 and res["conditional_ot"][1] < res["temperature"][1] / 3
    assert res["conditional_ot"][2] < res["isotonic"][2] and res["conditional_ot"][2] < res["temperature"][2]


def test_conditional_ot_is_the_quantile_map():
    rng = np.random.default_rng(2)
    src = rng.uniform(size=5000)
    tgt = rng.beta(2, 5, size=5000)
    ot = ConditionalOT(n_quantiles=201).fit(src, tgt)
    u = np.array([0.1, 0.5, 0.9])
    assert np.allclose(ot.apply(u), np.quantile(tgt, u), atol=0.02)  # F_t^-1(F_s(s)) with F_s(s) = s
    # monotone per condition; unseen condition -> the pooled map
    ot2 = ConditionalOT(min_count=10).fit(np.r_[src, src], np.r_[tgt, 1 - tgt], ["a"] * 5000 + ["b"] * 5000)
    grid = np.linspace(0, 1, 11)
    assert np.all(np.diff(ot2.apply(grid, ["a"] * 11)) >= 0)
    assert np.allclose(ot2.apply(grid, ["zzz"] * 11), ot2.apply(grid))
    with pytest.raises(DataError, match="graded"):
        ConditionalOT().fit([0.2, 0.7, 0.9], [0.0, 1.0, 1.0])


def test_save_load_roundtrip(tmp_path):
    rng = np.random.default_rng(3)
    s, c, y = make_prm_scores(500, rng)
    for m in ("temperature", "isotonic", "conditional_ot"):
        cal = make_calibrator(m).fit(s, y, c)
        again = load_calibrator(cal.save(tmp_path / f"{m}.json"))
        assert type(again) is type(cal)
        assert np.allclose(again.apply(s[:50], c[:50]), cal.apply(s[:50], c[:50]))
    (tmp_path / "bad.json").write_text(json.dumps({"method": "nope"}))
    from postrl.errors import ConfigError

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
    cal = ConditionalOT(min_count=1).fit(
        np.r_[np.linspace(0, 1, 50), np.linspace(0, 1, 50)],
        np.r_[np.linspace(0.0, 0.3, 50), np.linspace(0.6, 0.9, 50)],
        ["0"] * 50 + ["1"] * 50)
    cal_path = cal.save(tmp_path / "cal.json")
    fn = registry.get("reward", "model")
    raw = torch.tensor(fn(["q0"], ["a\n\nb\n\nc"], path=str(folder)))[0]
    got = torch.tensor(fn(["q0"], ["a\n\nb\n\nc"], path=str(folder), calibrator=str(cal_path)))[0]
    want = [cal.apply([raw[j].item()], [step_bucket(j)])[0] for j in range(3)]
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert 0.0 <= got[0] <= 0.3 and 0.6 <= got[1] <= 0.9  # the condition decides the map
