"""The main job's warm-started model ships with the package, and `make builtin` rebuilds it."""

import json

import torch
from safetensors.torch import load_file

from postrl.config import Config
from postrl.models import load_model_and_tokenizer
from postrl.models.builtin import SHIPPED, builtin_name, ensure_builtin


def test_the_default_config_uses_the_shipped_model(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTRL_CACHE", str(tmp_path))
    cfg = Config()
    shipped = SHIPPED / builtin_name(cfg)
    assert (shipped / "config.json").is_file(), "the default config changed: rebuild the shipped model (make builtin)"
    assert [p.name for p in SHIPPED.glob("builtin-*")] == [shipped.name]  # no stale copies in the package
    logs = []
    assert ensure_builtin(cfg, log=logs.append) == shipped and logs == []  # nothing built
    assert not any(tmp_path.iterdir())  # nor cached
    model, tok = load_model_and_tokenizer(shipped)
    assert model.config.model_type == "llama" and len(tok) == model.config.vocab_size
    # Another config has no shipped model: it is built and cached as before.
    other = Config(sft={"steps": 2})
    assert not (SHIPPED / builtin_name(other)).exists()
    built = ensure_builtin(other, log=logs.append)
    assert built.parent == tmp_path and (built / "model.safetensors").is_file() and logs


def _greedy(path, prompts):
    from postrl.models import encode_prompt
    from postrl.rollout.base import SamplingParams
    from postrl.rollout.hf import HFGenerator

    model, tok = load_model_and_tokenizer(path)
    ids = [encode_prompt(tok, p, "auto") for p in prompts]
    return HFGenerator(model, tok).generate(ids, 1, SamplingParams(max_new_tokens=16, temperature=0.0), seed=0).texts


def test_the_shipped_model_is_what_make_builtin_builds(tmp_path, monkeypatch):
    """Rebuild from scratch (800 SFT steps, about 2 minutes on 2 cores) and compare with the shipped files."""
    monkeypatch.setenv("POSTRL_CACHE", str(tmp_path))
    cfg = Config()
    built = ensure_builtin(cfg, log=lambda m: None, use_shipped=False)
    shipped = SHIPPED / built.name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert json.loads((built / name).read_text()) == json.loads((shipped / name).read_text()), name
    a, b = load_file(shipped / "model.safetensors"), load_file(built / "model.safetensors")
    assert a.keys() == b.keys()
    if all(torch.equal(a[k], b[k]) for k in a):
        return  # bit for bit, as on the development machine
    # A CPU whose matrix kernels round differently trains the same model along a slightly different path: then
    # the same losses and the same answers, not the same bits.
    la = json.loads((shipped / "postrl_sft.json").read_text())["final_loss"]
    lb = json.loads((built / "postrl_sft.json").read_text())["final_loss"]
    assert abs(la - lb) < 0.02 * la, (la, lb)
    from postrl.data import load_source

    prompts = [r["prompt"] for r in load_source(cfg.task.model_dump()).eval_rows(100, cfg.seed)]
    same = sum(x == y for x, y in zip(_greedy(shipped, prompts), _greedy(built, prompts)))
    assert same >= 90, f"{same}/100 greedy answers agree"
