"""postrl merge: the per-tensor rules against hand-computed 4-element cases, the folder merge of tiny models
(weighted average, loading with from_pretrained, tied embeddings, generation), the update-selective top fraction,
and the one-line errors (architecture mismatch as a subprocess, exit status 2)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from postrl.cli import main
from postrl.models import merge as M
from postrl.models.tiny import build_local

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def t(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama folders: a, b, base (nano, different seeds), base16 / rl16 (nano in bfloat16), big (another size)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("a", 1), ("b", 2), ("base", 3)):
        build_local(root / name, size="nano", seed=seed)
        out[name] = root / name
    for name, seed in (("base16", 3), ("rl16", 4)):
        model, _ = build_local(root / name, size="nano", seed=seed)
        model.to(torch.bfloat16).save_pretrained(root / name)
        out[name] = root / name
    build_local(root / "big", size="tiny", seed=1)
    out["big"] = root / "big"
    return out


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def merge(*args) -> int:
    return main(["merge", *map(str, args)])


# ------------------------------------------------------------------------------------ per tensor, by hand


def test_linear_by_hand():
    # 0.25 * [1, 2, 3, 4] + 0.75 * [5, 6, 7, 8] = [4, 5, 6, 7]
    assert torch.equal(M.linear([t(1, 2, 3, 4), t(5, 6, 7, 8)], [0.25, 0.75]), t(4, 5, 6, 7))


def test_task_arithmetic_by_hand():
    base, th1, th2 = t(1, 2, 3, 4), t(2, 2, 2, 2), t(0, 4, 3, 8)
    # tau1 = [1, 0, -1, -2], tau2 = [-1, 2, 0, 4]; sum = [0, 2, -1, 2]; base + 0.5 * sum = [1, 3, 2.5, 5]
    assert torch.allclose(M.task_arithmetic(base, [th1, th2], [1, 1], lam=0.5), t(1, 3, 2.5, 5))
    # weights [1, 0.5]: tau1 + 0.5 tau2 = [0.5, 1, -1, 0]; + base = [1.5, 3, 2, 4]
    assert torch.allclose(M.task_arithmetic(base, [th1, th2], [1, 0.5]), t(1.5, 3, 2, 4))


TAU1, TAU2 = t(1, -2, 3, -0.5), t(-3, 1, 2, 0.1)


def test_ties_by_hand():
    base = t(1, 1, 1, 1)
    th1, th2 = base + TAU1, base + TAU2
    # trim to density 0.5 (2 of 4 by |tau|): tau1 -> [0, -2, 3, 0], tau2 -> [-3, 0, 2, 0]
    # elect: sums [-3, -2, 5, 0] -> signs [-, -, +, +];  agreeing: pos0 tau2, pos1 tau1, pos2 both, pos3 none
    # disjoint mean: [-3/1, -2/1, (3 + 2)/2, 0] = [-3, -2, 2.5, 0]; + base = [-2, -1, 3.5, 1]
    assert torch.allclose(M.ties(base, [th1, th2], [1, 1], density=0.5), t(-2, -1, 3.5, 1))
    # weights [1, 0.5] multiply after the election: [-1.5, -2, (3 + 1)/2, 0]; base + 2 * that = [-2, -3, 5, 1]
    assert torch.allclose(M.ties(base, [th1, th2], [1, 0.5], density=0.5, lam=2.0), t(-2, -3, 5, 1))
    # density 1 (no trim): sums [-2, -1, 5, -0.4] -> [-, -, +, -]: [-3, -2, 2.5, -0.5]
    assert torch.allclose(M.ties(t(0, 0, 0, 0), [TAU1, TAU2], [1, 1], density=1.0), t(-3, -2, 2.5, -0.5))


def test_dare_by_hand():
    zero = t(0, 0, 0, 0)
    # one model, density 0.5: every entry is dropped (0) or rescaled (tau / 0.5)
    r = M.dare(zero, [t(1, 2, 3, 4)], [1], density=0.5, seed=7)
    kept = r != 0
    assert torch.equal(r, kept * t(2, 4, 6, 8))
    assert torch.equal(M.dare(zero, [t(1, 2, 3, 4)], [1], density=0.5, seed=7), r)  # the seed fixes the mask
    masks = {tuple((M.dare(zero, [t(1, 2, 3, 4)], [1], density=0.5, seed=s) != 0).tolist()) for s in range(8)}
    assert len(masks) > 1
    # two models with tau1 = 1 and tau2 = 10 everywhere, lam 1: each entry is 0, 2, 20 or 22 (which survived)
    r2 = M.dare(zero, [t(1, 1, 1, 1), t(10, 10, 10, 10)], [1, 1], density=0.5, seed=3)
    assert set(r2.tolist()) <= {0.0, 2.0, 20.0, 22.0}
    # base + lam * ...: base 1, lam 0.5 -> 1 + 0.5 * r2
    assert torch.equal(M.dare(t(1, 1, 1, 1), [t(2, 2, 2, 2), t(11, 11, 11, 11)], [1, 1], density=0.5, seed=3,
                              lam=0.5), 1 + 0.5 * r2)
    # about density of a large tensor survives; the global generator is left as it was
    torch.manual_seed(0)
    expected_next = torch.rand(3)
    torch.manual_seed(0)
    big = M.dare(torch.zeros(20000), [torch.ones(20000)], [1], density=0.3, seed=1)
    assert torch.equal(torch.rand(3), expected_next)
    assert abs((big != 0).float().mean().item() - 0.3) < 0.02 and torch.equal(big.unique(), t(0, 1 / 0.3))
    # dare_ties with density 1 keeps every entry: the TIES election of the hand case above
    assert torch.allclose(M.dare(t(0, 0, 0, 0), [TAU1, TAU2], [1, 1], density=1.0, sign_election=True),
                          t(-3, -2, 2.5, -0.5))


def test_update_selective_by_hand():
    base, rl = t(0, 0, 0, 0), t(0.1, -0.5, 0.2, 0.05)
    # |delta| order: 0.5 > 0.2 > 0.1 > 0.05; top 0.5 keeps 2 entries, top 0.25 keeps 1
    assert torch.equal(M.update_selective(base, rl, top=0.5), t(0, -0.5, 0.2, 0))
    assert torch.equal(M.update_selective(base, rl, top=0.25), t(0, -0.5, 0, 0))
    assert torch.equal(M.update_selective(base, rl, top=1.0), rl)
    assert torch.allclose(M.update_selective(base, rl, top=0.5, lam=0.5), t(0, -0.25, 0.1, 0))
    b2 = t(1, 2, 3, 4)
    assert torch.equal(M.update_selective(b2, b2 + t(0.1, -0.5, 0.2, 0.05), top=0.5),
                       t(1, 2, 3, 4) + t(0, -0.5, 0.2, 0))


# ------------------------------------------------------------------------------------ folders


def _loads_tied_and_generates(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert torch.equal(model.model.embed_tokens.weight.detach(), weights_of(folder)["model.embed_tokens.weight"])
    ids = tok("12+3=", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 4)


def test_linear_folder_is_the_weighted_average(models, tmp_path, capsys):
    out = tmp_path / "ab"
    assert merge(models["a"], models["b"], "--weights", 3, 1, "--out", out) == 0  # normalised: 0.75, 0.25
    wa, wb, wm = weights_of(models["a"]), weights_of(models["b"]), weights_of(out)
    assert wm.keys() == wa.keys()
    for name in wa:
        assert torch.allclose(wm[name], 0.75 * wa[name] + 0.25 * wb[name], atol=1e-7), name
    assert json.loads((out / M.RECORD_FILE).read_text())["weights"] == [0.75, 0.25]
    assert (out / "config.json").read_bytes() == (models["a"] / "config.json").read_bytes()
    _loads_tied_and_generates(out)
    # --no-normalize: the weights as given (0.5 + 0.5 is again an average; 1 + 1 would double the weights)
    assert merge(models["a"], models["b"], "--weights", 0.5, 0.5, "--no-normalize", "--out", tmp_path / "h") == 0
    wh = weights_of(tmp_path / "h")
    assert all(torch.allclose(wh[n], 0.5 * wa[n] + 0.5 * wb[n], atol=1e-7) for n in wa)
    assert "merged 2 model(s) by linear" in capsys.readouterr().out


def test_sharded_first_model_keeps_its_layout(models, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    shutil.copytree(models["a"], sharded)
    (sharded / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(models["a"]).save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / M.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    out = tmp_path / "out"
    assert merge(sharded, models["b"], "--out", out) == 0  # the second model in one file: read by tensor name
    assert json.loads((out / M.INDEX_FILE).read_text()) == index
    wa, wb = weights_of(models["a"]), weights_of(models["b"])
    merged = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name in wa:
        assert torch.allclose(merged[name], 0.5 * wa[name] + 0.5 * wb[name], atol=1e-7), name


@pytest.mark.parametrize("method,extra", [("task_arithmetic", ["--lambda", "0.5"]),
                                          ("ties", ["--density", "0.3"]),
                                          ("dare", ["--density", "0.3", "--seed", "5"]),
                                          ("dare_ties", ["--density", "0.3", "--seed", "5"])])
def test_task_vector_folders_match_the_tensor_rules_and_load(models, tmp_path, method, extra):
    out = tmp_path / method
    assert merge(models["a"], models["b"], "--method", method, "--base", models["base"], *extra, "--out", out) == 0
    wa, wb, w0, wm = (weights_of(f) for f in (models["a"], models["b"], models["base"], out))
    for name in w0:
        if method == "task_arithmetic":
            want = M.task_arithmetic(w0[name], [wa[name], wb[name]], [1, 1], lam=0.5)
        elif method == "ties":
            want = M.ties(w0[name], [wa[name], wb[name]], [1, 1], density=0.3)
        else:
            want = M.dare(w0[name], [wa[name], wb[name]], [1, 1], density=0.3, seed=M._tensor_seed(5, name),
                          sign_election=method == "dare_ties")
        assert torch.equal(wm[name], want), name
    _loads_tied_and_generates(out)


def test_dare_folder_is_reproducible(models, tmp_path):
    args = [models["a"], models["b"], "--method", "dare", "--base", models["base"], "--density", "0.5"]
    for name, seed in (("s1", 1), ("s1_again", 1), ("s2", 2)):
        assert merge(*args, "--seed", seed, "--out", tmp_path / name) == 0
    s1, again, s2 = (weights_of(tmp_path / n) for n in ("s1", "s1_again", "s2"))
    assert all(torch.equal(s1[n], again[n]) for n in s1)
    assert not torch.equal(s1["model.layers.0.mlp.up_proj.weight"], s2["model.layers.0.mlp.up_proj.weight"])


def test_update_selective_keeps_exactly_the_top_fraction(models, tmp_path):
    out = tmp_path / "us"
    assert merge(models["rl16"], "--method", "update_selective", "--base", models["base16"], "--top", 0.3,
                 "--out", out) == 0
    rl, base, merged = weights_of(models["rl16"]), weights_of(models["base16"]), weights_of(out)
    checked = 0
    for name, m in merged.items():
        r, b = rl[name], base[name]
        assert m.dtype == torch.bfloat16  # the first model's dtype
        changed = r != b  # RL moved these entries (the norm weights start at 1 in both: none moved)
        k = min(int(0.3 * m.numel()), int(changed.sum()))
        from_rl = changed & (m == r)
        assert int(from_rl.sum()) == k, name  # exactly the top fraction takes the RL value ...
        assert torch.equal(m[~from_rl], b[~from_rl]), name  # ... every other entry the base value
        delta = (r.float() - b.float()).abs()
        if 0 < k < int(changed.sum()):  # ... and they are the largest updates
            assert delta[from_rl].min() >= delta[changed & ~from_rl].max(), name
            checked += 1
    assert checked >= 10


def test_architecture_mismatch_is_one_line_exit_2(models, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = str(SRC)
    out = tmp_path / "x"
    r = subprocess.run([sys.executable, "-m", "postrl", "merge", str(models["a"]), str(models["big"]), "--out",
                        str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("postrl: error: "), r.stderr
    assert str(models["a"]) in lines[0] and str(models["big"]) in lines[0]
    assert "'model.embed_tokens.weight' has shape [88, 64] vs [88, 128]" in lines[0]
    assert not out.exists() and os.listdir(tmp_path) == []  # nothing written, no temporary folder left


def test_other_architecture_differences(models, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(models["a"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    assert "config model_type 'llama' vs 'qwen2'" in M.architecture_mismatch(M.read_model_files(models["a"]),
                                                                           M.read_model_files(other))
    from safetensors.torch import save_file

    w = weights_of(models["a"])
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, str(other / "model.safetensors"), metadata={"format": "pt"})
    (other / "config.json").write_text(json.dumps(config))
    msg = M.architecture_mismatch(M.read_model_files(models["a"]), M.read_model_files(other))
    assert msg == (f"models '{models['a']}' and '{other}' have different architectures: parameter 'lm_head.weight' "
                   f"is missing in '{models['a']}'")


@pytest.mark.parametrize("args,expected", [
    (["A", "B", "--weights", "1"], "--weights: 1 given for 2 models"),
    (["A", "B", "--weights", "1", "-1"], "--weights must be finite and >= 0"),
    (["A", "B", "--weights", "0", "0"], "--weights are all 0"),
    (["A", "B", "--method", "ties", "--base", "A", "--density", "0"], "--density must be in (0, 1], got 0.0"),
    (["A", "B", "--method", "dare", "--base", "A", "--density", "1.5"], "--density must be in (0, 1], got 1.5"),
    (["A", "B", "--method", "ties", "--density", "0.5"], "give --base"),
    (["A", "B", "--method", "ties", "--base", "A"], "needs --density"),
    (["A", "B", "--density", "0.5"], "--density applies to ties, dare, dare_ties"),
    (["A", "B", "--base", "A"], "--base: --method linear uses no base model"),
    (["A", "B", "--lambda", "2"], "--lambda scales the merged task vector"),
    (["A", "B", "--seed", "1"], "--seed applies to the random drop"),
    (["A", "--method", "update_selective", "--base", "B"], "--method update_selective needs --top"),
    (["A", "--method", "update_selective", "--base", "B", "--top", "1.2"], "--top must be in (0, 1]"),
    (["A", "B", "--method", "update_selective", "--base", "B", "--top", "0.5"], "merges one RL model"),
    (["A", "NOPE"], "NOPE': no such model folder"),
])
def test_user_mistakes_are_one_line_exit_2(models, tmp_path, capsys, args, expected):
    args = [str(models["a"]) if x == "A" else str(models["b"]) if x == "B" else str(tmp_path / x) if x == "NOPE"
            else x for x in args]
    assert main(["merge", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("postrl: error: ") and expected in err, err
    assert not (tmp_path / "out").exists()


def test_out_is_replaced_only_with_overwrite(models, tmp_path, capsys):
    out = tmp_path / "m"
    assert merge(models["a"], "--out", out) == 0  # one model, weight 1: a copy
    assert merge(models["b"], "--out", out) == 2
    assert "exists" in capsys.readouterr().err
    assert merge(models["b"], "--out", out, "--overwrite") == 0
    assert all(torch.equal(x, y) for x, y in zip(weights_of(out).values(), weights_of(models["b"]).values()))
    (tmp_path / "notes").mkdir()
    assert merge(models["b"], "--out", tmp_path / "notes", "--overwrite") == 2
    assert "not a model folder" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["m", "notes"]  # no temporary folder left behind


def test_cli_lists_the_methods_of_the_module():
    from postrl.cli import merge as cli_merge

    assert cli_merge.METHODS == M.METHODS


def _commands(text: str) -> list[str]:
    """The `postrl ...` lines of the ```bash blocks in ``text`` (comments after two spaces dropped)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        lines += [re.split(r"\s{2,}#", ln)[0].strip() for ln in block.splitlines() if ln.startswith("postrl ")]
    return lines


def _run_docs(text: str, folders: dict[str, Path], cwd: Path, monkeypatch) -> list[str]:
    for rel, src in folders.items():
        shutil.copytree(src, cwd / rel)
    monkeypatch.chdir(cwd)
    ran = []
    for line in _commands(text):
        argv = shlex.split(line)[1:]
        if argv[0] == "train":  # the training line: its recipe and overrides must be a valid config (no training)
            recipe = [str(SRC / f"postrl/recipes/{argv[i + 1]}.yaml") for i, a in enumerate(argv) if a == "--recipe"]
            argv = ["config", "show", *recipe, *[a for a in argv[1:] if "=" in a]]
        assert main(argv) == 0, line
        ran.append(argv[0])
    return ran


def test_readme_merge_commands_run(models, tmp_path, monkeypatch):
    section = (ROOT / "README.md").read_text().split("### Merge models", 1)[1].split("\n#", 1)[0]
    ran = _run_docs(section, {"models/sft-a": models["a"], "models/sft-b": models["b"], "models/base": models["base"],
                              "runs/rl/final": models["a"]}, tmp_path, monkeypatch)
    assert ran.count("merge") >= 3
    assert (tmp_path / "models/soup/model.safetensors").is_file()


def test_docs_recipes_run(models, tmp_path, monkeypatch):
    text = (ROOT / "docs/merge.md").read_text()
    ran = _run_docs(text, {"models/reasoning": models["a"], "models/instruct": models["b"],
                           "models/pretrained": models["base"], "runs/dler/final": models["b"]}, tmp_path,
                    monkeypatch)
    assert ran.count("merge") >= 3 and "config" in ran
    assert (tmp_path / "models/bai-init/model.safetensors").is_file()
