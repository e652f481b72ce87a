"""postrl compare: the statistics by hand, a 2 variants x 2 seeds comparison on the nano model, resuming a killed
comparison without re-running finished cells, and one-line errors for a malformed spec."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from postrl import compare
from postrl.cli import main
from postrl.errors import ConfigError

SRC = str(Path(compare.__file__).resolve().parents[1])


# ------------------------------------------------------------------------------------------------ statistics


def test_t_distribution_matches_tables():
    # two-sided 95% critical values from any t table
    for df, crit in [(1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (9, 2.2622), (30, 2.0423)]:
        assert compare.t_quantile(0.975, df) == pytest.approx(crit, abs=1e-4)
    # df = 1 is Cauchy: F(1) = 3/4; df = 2: F(t) = 1/2 + t / (2 sqrt(t^2 + 2))
    assert compare.t_cdf(1.0, 1) == pytest.approx(0.75)
    assert compare.t_cdf(-1.5, 2) == pytest.approx(0.5 - 1.5 / (2 * math.sqrt(1.5 ** 2 + 2)))


def test_interval_and_paired_t_by_hand():
    iv = compare.interval([1.0, 2.0, 3.0])  # mean 2, sd 1, half = t_{.975,2} / sqrt(3) = 4.3027 / 1.7321
    assert iv["mean"] == 2.0 and iv["sd"] == pytest.approx(1.0)
    assert iv["half"] == pytest.approx(4.302653 / math.sqrt(3), abs=1e-5)
    assert (iv["low"], iv["high"]) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-5)
    one = compare.interval([0.7])
    assert one["mean"] == 0.7 and math.isnan(one["half"])
    # d = (2, 3, 2): mean 7/3, sd 1/sqrt(3), se 1/3, t = 7, df 2, p = 1 - 7/sqrt(51) (closed form for df 2)
    p = compare.paired_t({0: 3.0, 1: 5.0, 2: 4.0, 7: 9.0}, {0: 1.0, 1: 2.0, 2: 2.0})  # seed 7 has no pair
    assert p["n"] == 3 and p["df"] == 2
    assert p["diff"] == pytest.approx(7 / 3) and p["t"] == pytest.approx(7.0)
    assert p["p"] == pytest.approx(1 - 7 / math.sqrt(51), abs=1e-9)
    assert compare.paired_t({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})["p"] == 1.0
    assert compare.auc([0, 1, 3], [0.0, 1.0, 1.0]) == pytest.approx((0.5 + 2.0) / 3)


# ------------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def nano(tmp_path_factory):
    from postrl.models.tiny import build_local

    path = tmp_path_factory.mktemp("nano") / "model"
    build_local(path, size="nano")
    return path


def _spec(tmp_path: Path, nano: Path, **extra) -> Path:
    spec = {
        "name": "t", "out": str(tmp_path / "cmp"), "seeds": 2,
        "base": {"name": "grpo", "overrides": {
            "model.path": str(nano), "train.steps": 2, "train.prompts_per_step": 2, "rollout.group_size": 4,
            "rollout.max_new_tokens": 5, "train.eval_size": 4, "train.eval_k": 2, "train.eval_every": 1,
            "train.save_every": 1, "accel.threads": 1, "optim.lr": 0.05,
            "rewards": [{"name": "novelty", "unit": "char", "n": 1}, {"name": "correct", "weight": 0.0}]}},
        "variants": {"big_lr": {"overrides": ["optim.lr=0.2", "advantage.name=dr_grpo"]}},
        "metrics": ["advantages/abs_mean"],
    }
    spec.update(extra)
    f = tmp_path / "spec.yaml"
    f.write_text(json.dumps(spec))  # JSON is YAML
    return f


def test_two_variants_two_seeds(tmp_path, nano):
    spec = compare.load_spec(_spec(tmp_path, nano))
    res = compare.run_comparison(spec, progress=False)
    out = spec.out
    assert res["cells"] == {"total": 4, "done": 4}
    for v in ("grpo", "big_lr"):
        for s in (0, 1):
            d = out / "cells" / v / f"seed-{s}"
            assert (d / "summary.json").is_file()
            cfg = (d / "config.yaml").read_text()
            assert f"seed: {s}" in cfg and ("dr_grpo" in cfg) == (v == "big_lr")
    # every interval is the t interval of the per-seed values, which are read from the cells' own files
    for v in ("grpo", "big_lr"):
        ent = res["variants"][v]["entropy"]
        a, b = (json.loads((out / "cells" / v / f"seed-{s}" / "metrics.jsonl").read_text().splitlines()[-1])
                ["entropy"] for s in (0, 1))
        assert [ent["per_seed"][0], ent["per_seed"][1]] == [a, b]
        # n = 2: mean (a+b)/2, sd |a-b|/sqrt(2), half = 12.7062 * sd / sqrt(2) = 12.7062 |a-b| / 2
        assert ent["final"]["mean"] == pytest.approx((a + b) / 2)
        assert ent["final"]["half"] == pytest.approx(12.70620 * abs(a - b) / 2, rel=1e-5)
        acc = [json.loads((out / "cells" / v / f"seed-{s}" / "eval.jsonl").read_text().splitlines()[-1])["accuracy"]
               for s in (0, 1)]
        assert res["variants"][v]["eval/accuracy"]["final"]["mean"] == pytest.approx(sum(acc) / 2)
        assert "advantages/abs_mean" in res["variants"][v] and "wall_s" in res["variants"][v]
    base_e, var_e = (res["variants"][v]["entropy"]["per_seed"] for v in ("grpo", "big_lr"))
    pt = res["paired"]["big_lr"]["entropy"]
    d = [var_e[s] - base_e[s] for s in (0, 1)]
    assert pt["n"] == 2 and pt["diff"] == pytest.approx(sum(d) / 2)
    sd = abs(d[0] - d[1]) / math.sqrt(2)
    assert pt["t"] == pytest.approx((sum(d) / 2) / (sd / math.sqrt(2)), rel=1e-6)
    # the comparison directory
    saved = json.loads((out / "results.json").read_text())
    assert saved["variants"]["grpo"]["entropy"]["final"]["mean"] == pytest.approx(res["variants"]["grpo"]["entropy"]
                                                                                   ["final"]["mean"])
    html = (out / "report.html").read_text()
    assert "data-plot='entropy'" in html and "data-plot='eval/accuracy'" in html and "dr_grpo" in html
    table = (out / "table.txt").read_text()
    assert "big_lr" in table and "grpo" in table and "(base)" in table


def test_dry_run_lists_cells_and_trains_nothing(tmp_path, nano, capsys):
    f = _spec(tmp_path, nano)
    assert main(["compare", str(f), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("new") == 4 and "big_lr/seed-1" in out and "grpo/seed-0" in out
    assert not (tmp_path / "cmp" / "cells").exists()


KILLER = """
import os, signal, sys
from postrl import compare
from postrl.train import trainer
save = trainer.Trainer.save
def killing_save(self, step):
    save(self, step)
    if self.run_dir.parent.name == "big_lr" and self.run_dir.name == "seed-0" and step == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # killed after the second cell's first checkpoint
trainer.Trainer.save = killing_save
compare.run_comparison(compare.load_spec(sys.argv[1]), progress=False)
"""


def test_killed_comparison_resumes_without_rerunning_finished_cells(tmp_path, nano):
    f = _spec(tmp_path, nano)
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", KILLER, str(f)], env=env, capture_output=True, timeout=240)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    spec = compare.load_spec(f)
    cells = {c.label: c for c in compare.plan(spec)}
    states = {k: compare.cell_state(c) for k, c in cells.items()}
    assert states == {"grpo/seed-0": "done", "big_lr/seed-0": "resume", "grpo/seed-1": "new", "big_lr/seed-1": "new"}
    done_dir = cells["grpo/seed-0"].run_dir
    before = {p.name: p.stat().st_mtime_ns for p in done_dir.iterdir() if p.is_file()}
    killed_rows = (cells["big_lr/seed-0"].run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in killed_rows] == [1]
    ran = []
    res = compare.run_comparison(spec, progress=False, on_cell_done=lambda c: ran.append(c.label))
    assert ran == ["big_lr/seed-0", "grpo/seed-1", "big_lr/seed-1"]  # the finished cell is not re-run
    assert {p.name: p.stat().st_mtime_ns for p in done_dir.iterdir() if p.is_file()
            and p.name in before} == before
    rows = (cells["big_lr/seed-0"].run_dir / "metrics.jsonl").read_text().splitlines()
    assert rows[0] == killed_rows[0] and [json.loads(r)["step"] for r in rows] == [1, 2]  # resumed at step 1
    assert res["cells"] == {"total": 4, "done": 4}
    assert set(res["variants"]["big_lr"]["entropy"]["per_seed"]) == {0, 1}


# ------------------------------------------------------------------------------------------------ bad specs


@pytest.mark.parametrize("patch, needle", [
    ({"variants": {"x": {"overides": ["optim.lr=0.1"]}}}, "variants.x: unknown key 'overides'"),
    ({"seeds": 0}, "seeds: expected at least 1 seed, got 0"),
    ({"variants": {"x": {"overrides": {"optim.learning_rate": 0.1}}}}, "variants.x: unknown key 'optim.learning_rate'"),
    ({"variants": {"x": {"recipe": "nope"}}}, "unknown recipe 'nope'"),
    ({"varients": {}}, "spec: unknown key 'varients'"),
])
def test_malformed_spec_is_one_line(tmp_path, nano, capsys, patch, needle):
    f = _spec(tmp_path, nano, **patch)
    assert main(["compare", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("postrl: error: ") and needle in err and err.count("\n") == 1, err
    with pytest.raises(ConfigError):
        compare.plan(compare.load_spec(f))
    assert not (tmp_path / "cmp" / "cells").exists()


def test_jobs_run_cells_as_processes_with_user_stages(tmp_path, nano, monkeypatch):
    # a reward beside the spec, named by import path: the `postrl train` processes must import it too
    (tmp_path / "cmp_digits.py").write_text(
        "def digits(prompts, completions, **kw):\n    return [sum(ch.isdigit() for ch in c) / 5 for c in completions]\n")
    f = _spec(tmp_path, nano, seeds=[3])
    data = json.loads(f.read_text())
    data["base"]["overrides"]["rewards"] = [{"name": "cmp_digits:digits"}]
    f.write_text(json.dumps(data))
    monkeypatch.syspath_prepend(str(tmp_path))  # what `postrl compare` does for the spec's folder
    spec = compare.load_spec(f)
    res = compare.run_comparison(spec, jobs=2, progress=False)
    assert res["cells"] == {"total": 2, "done": 2}
    for v in ("grpo", "big_lr"):
        d = spec.out / "cells" / v / "seed-3"
        assert (d / "summary.json").is_file() and (spec.out / "cells" / v / "seed-3.log").is_file()
        assert "reward/cmp_digits:digits/mean" in json.loads((d / "metrics.jsonl").read_text().splitlines()[0])
        assert res["variants"][v]["entropy"]["per_seed"][3] is not None
