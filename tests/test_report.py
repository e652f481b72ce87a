"""The HTML run report: both runs' curves overlaid, their config difference, alarms, samples (escaped), a
self-contained file; rendered by headless Chromium the way a person sees it (skipped without chromium)."""

from __future__ import annotations

import base64
import io
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from postrl.cli import main
from postrl.config import dump_yaml, load_config
from postrl.report.html import build_report, config_diff
from postrl.report.rundir import load_run

ROOT = Path(__file__).resolve().parents[1]


def make_run(path: Path, overrides: list[str], *, steps: int = 12, truncation: float = 0.02, reward_slope=0.03,
             finished: bool = True) -> Path:
    """A run directory written the way the trainer writes one (config.yaml, metrics/eval/samples jsonl)."""
    path.mkdir(parents=True)
    cfg = load_config(None, [f"output_dir={path}", *overrides])
    (path / "config.yaml").write_text(dump_yaml(cfg))
    lines = []
    for s in range(1, steps + 1):
        r = 0.2 + reward_slope * s
        lines.append({"step": s, "reward/mean": r, "reward/std": 0.3, "reward/correct/mean": r / 1.2,
                      "reward/format/mean": 0.9, "accuracy": r / 1.2, "pass@1": r / 1.2, "pass@8": 0.7,
                      "length/mean": 3.0, "length/min": 1.0, "length/max": 6.0, "truncated/frac": truncation,
                      "truncated/reward_mean": 0.0, "finished/reward_mean": r, "entropy": 1.0 - 0.02 * s,
                      "tokens/low_prob_frac": 0.2, "kl": 0.002 * s, "ppo_kl": 0.001, "clip_low": 0.01,
                      "clip_high": 0.02, "ratio/max": 1.2, "zero_variance_groups/frac": 0.3,
                      "zero_variance_groups/all_wrong": 0.2, "zero_variance_groups/all_correct": 0.1,
                      "advantages/distinct_frac": 0.3, "reward/group_std": 0.3, "grad_norm": 0.5,
                      "grad_norm_max": 0.7, "mismatch/kl": 1e-6, "throughput/generation": 3000.0,
                      "throughput/update": 8000.0, "memory/rss_peak_gb": 0.5, "alarms": []})
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    evals = [{"step": 0, "tag": "before", "accuracy": 0.2, "pass@1": 0.2, "pass@4": 0.5, "n": 16}]
    if finished:
        evals.append({"step": steps, "tag": "after", "accuracy": 0.5, "pass@1": 0.5, "pass@4": 0.7, "n": 16})
        (path / "summary.json").write_text(json.dumps({"steps": steps, "before": evals[0], "after": evals[1]}))
    (path / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    samples = [{"step": steps, "prompt": "3+4=", "completion": "7", "rewards": {"correct": 1.0, "format": 1.0},
                "reward": 1.2, "advantage": 0.8, "truncated": False, "valid": True},
               {"step": steps, "prompt": "3+4=", "completion": "<script>alert(1)</script>",
                "rewards": {"correct": 0.0, "format": 0.0}, "reward": 0.0, "advantage": -0.8, "truncated": True,
                "valid": True}]
    (path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two runs that differ in lr and completion limit, and their report."""
    root = tmp_path_factory.mktemp("two")
    a = make_run(root / "baseline", ["optim.lr=1e-4"])
    b = make_run(root / "short-limit", ["optim.lr=3e-4", "rollout.max_new_tokens=2"], truncation=0.9,
                 reward_slope=0.0)
    return a, b, build_report([a, b], root / "out" / "report.html")


def _plots(html: str) -> dict[str, tuple[list[str], bytes]]:
    out = {}
    for m in re.finditer(r"<div class='plot' data-plot='(\w+)' data-runs='([^']*)'><img alt='[^']*' "
                         r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'>", html):
        out[m.group(1)] = (m.group(2).split(","), base64.b64decode(m.group(3)))
    return out


def test_report_of_two_runs_overlays_curves_and_shows_config_difference(two_runs):
    a, b, out = two_runs
    html = out.read_text()
    plots = _plots(html)
    for name in ("reward", "accuracy", "length", "entropy", "kl", "mismatch", "clip", "signal", "throughput",
                 "stability", "memory"):
        assert name in plots, name
    for name in ("reward", "accuracy", "length", "entropy", "kl", "throughput"):
        assert plots[name][0] == ["baseline", "short-limit"], name  # both runs' curves on the same figure
    from PIL import Image

    for name, (_, png) in plots.items():
        im = Image.open(io.BytesIO(png))
        assert im.format == "PNG" and im.size[0] > 500 and im.size[1] > 250, name
    # config differences: exactly the keys that differ (output_dir aside)
    diff = re.search(r"<h2>config differences</h2>(.*?)</table>", html, re.S).group(1)
    keys = re.findall(r"<tr><td class='mono'>([^<]+)</td>", diff)
    assert keys == ["optim.lr", "rollout.max_new_tokens"]
    assert "0.0001" in diff and "0.0003" in diff
    # alarms of the truncated run, with cause and fix; none for the baseline
    assert "90% of completions truncated at rollout.max_new_tokens=2" in html
    assert "raise rollout.max_new_tokens (now 2)" in html
    assert "<b>baseline</b>: <span class='ok'>no alarm</span>" in html
    assert "alt='alarm timeline'" in html
    # samples, escaped; self-contained (no external resource)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script>" not in html
    assert not re.search(r"(src|href)=['\"]https?:", html)
    assert "0.200 &rarr; 0.500" in html  # held-out accuracy before -> after


def test_config_diff_ignores_identical_and_output_dir(tmp_path):
    a = make_run(tmp_path / "a", ["seed=1"])
    b = make_run(tmp_path / "b", ["seed=1", "rewards=[{name: correct}]"])
    d = config_diff([load_run(a), load_run(b)])
    assert set(d) == {"rewards.1.name", "rewards.1.weight"}
    assert d["rewards.1.name"] == ["format", "(unset)"]


def test_report_of_a_real_run_finished_then_crashed(tmp_path, capsys):
    """A real (tiny) run end to end: train, report from the CLI; then the same run as if it had crashed (no
    summary, a last line cut mid-write). The random nano model truncates everything."""
    from postrl.models.tiny import build_local
    from postrl.train.trainer import Trainer

    build_local(tmp_path / "nano", size="nano", seed=0)
    out = tmp_path / "run"
    cfg = load_config(None, [f"model.path={tmp_path / 'nano'}", f"output_dir={out}", "task.digits=1",
                             "rollout.max_new_tokens=3", "rollout.group_size=4", "train.prompts_per_step=4",
                             "train.steps=3", "train.eval_size=4", "train.eval_k=1", "train.save_every=0"])
    Trainer(cfg, out).train()
    (out / "summary.json").unlink()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # cut by the crash
    assert main(["report", str(out)]) == 0
    html = (out / "report.html").read_text()
    plots = _plots(html)
    assert plots["reward"][0] == ["run"] and plots["throughput"][0] == ["run"]
    assert "truncated at rollout.max_new_tokens=3" in html
    assert "not finished" in html and "3 / 3" in html
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def _chromium() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(_chromium() is None, reason="no chromium (apt-get install -y chromium)")
def test_report_renders_in_a_browser(two_runs, tmp_path):
    from PIL import Image, ImageStat

    report = two_runs[2]
    png = tmp_path / "shot.png"
    res = subprocess.run([str(ROOT / "scripts" / "screenshot_report.sh"), str(report), str(png), "1400", "5000"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    im = Image.open(png).convert("RGB")
    assert im.size == (1400, 5000)
    # the page is drawn: text at the top, many colours (plots), content far down the page (images loaded)
    top = im.crop((0, 0, 1400, 120))
    assert min(ImageStat.Stat(top.convert("L")).extrema[0]) < 80  # dark title text
    rows = [y for y in range(0, 5000, 20) if ImageStat.Stat(im.crop((0, y, 1400, y + 20)).convert("L")).stddev[0] > 5]
    assert max(rows) > 2500, max(rows)
    colours = len(im.resize((350, 1250)).getcolors(maxcolors=1 << 20))
    assert colours > 200, colours
    assert not math.isnan(ImageStat.Stat(im).mean[0])
