"""The single-GPU essentials of postrl's own trainer, on CPU: LoRA through peft (adapters train, the base stays,
the reference model is the adapter disabled, adapter checkpoints resume bit-exactly, final model merged and as an
adapter), QLoRA's refusal off CUDA, gradient checkpointing (same log-probs and gradients), rollout.max_prompt_length
(truncate / drop, in training and evaluation) and rollout.backend's vllm removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from postrl.config import AccelConfig

from postrl import accel
from postrl.config import load_config
from postrl.errors import ConfigError
from postrl.evaluate import evaluate
from postrl.models import enable_gradient_checkpointing, load_model_and_tokenizer
from postrl.logprobs import completion_logprobs
from postrl.generation import encode_prompt
from postrl.train.trainer import Trainer
from test_train import crash_in_step, metrics, model_dir, resume, run_inprocess, small  # noqa: F401 - fixture

peft = pytest.importorskip("peft")

LORA = ["model.lora.r=4", "model.lora.alpha=8", "optim.lr=1e-2", "rewards=[{name: sevens}]"]


def test_lora_trains_the_adapters_only_and_saves_a_merged_model_and_an_adapter(model_dir, tmp_path):
    """model.lora.r=4: the policy is a PeftModel, the optimizer holds the adapters alone, the base weights do not
    move while the adapters do; RUN/final is the merged model (AutoModelForCausalLM.from_pretrained) with the
    adapter in final/adapter (PeftModel.from_pretrained), both giving the trained policy's logits."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    cfg = load_config(None, small(model_dir, out, *LORA, "train.steps=3"))
    tr = Trainer(cfg, out)
    assert isinstance(tr.policy, peft.PeftModel) and tr.ref_model is None
    trainable = {id(p) for p in tr.policy.parameters() if p.requires_grad}
    in_optim = [p for g in tr.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in in_optim} == trainable and 0 < len(trainable) < len(list(tr.policy.parameters()))
    before = {n: p.detach().clone() for n, p in tr.policy.named_parameters()}
    tr.train()
    after = dict(tr.policy.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all("lora_" in n for n in moved)
    assert any("lora_B" in n for n in moved)  # B starts at 0: the policy started as the base model
    final = out / "final"
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    tr.policy.eval()
    with torch.no_grad():
        want = tr.policy(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(final).eval()
        assert not any("lora" in n for n in merged.state_dict())
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=0, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        adapted = peft.PeftModel.from_pretrained(base, final / "adapter").eval()
        torch.testing.assert_close(adapted(input_ids=ids).logits, want, rtol=0, atol=1e-6)
        # and the merged weights differ from the base's: the training is in them
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(model_dir)(input_ids=ids).logits, want)


def test_lora_save_adapter_writes_a_peft_folder(model_dir, tmp_path):
    out = tmp_path / "run"
    run_inprocess(small(model_dir, out, *LORA, "train.steps=1", "model.lora.save=adapter"))
    names = {p.name for p in (out / "final").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    assert json.loads((out / "final" / "adapter_config.json").read_text())["r"] == 4


def test_reference_by_disabled_adapter_equals_a_frozen_copy_of_the_base(model_dir, tmp_path):
    """kl.coef > 0 with LoRA: no second copy of the model; the reference log-probs (the policy with its adapter
    disabled) equal a frozen copy of the base model's, after the adapters have moved the policy away from it."""
    out = tmp_path / "run"
    cfg = load_config(None, small(model_dir, out, *LORA, "kl.coef=0.1", "train.steps=4"))
    tr = Trainer(cfg, out)
    assert tr.needs_ref and tr.ref_model is None
    for s in range(3):
        m = tr.train_step(s)
    assert m["kl"] > 0  # the policy moved from the reference
    batch, _ = tr.batches.next_batch(3)
    ref = tr.frozen_logprobs(batch, "ref_logp")
    frozen, _ = load_model_and_tokenizer(model_dir)
    frozen.eval()
    with torch.no_grad():
        want = completion_logprobs(frozen, batch.prompt_ids, batch.prompt_mask, batch.completion_ids)[0]
        policy = completion_logprobs(tr.policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids)[0]
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(ref[mask], want[mask], rtol=0, atol=1e-5)
    assert (policy - want)[mask].abs().max() > 1e-3  # the adapter is on outside the reference computation


def test_lora_resume_after_a_crash_equals_the_uninterrupted_run(model_dir, tmp_path, monkeypatch):
    """Checkpoints hold the adapter (adapter_model.safetensors, no full weights); a run killed in step 5 and
    resumed from step 3 logs exactly the uninterrupted run's metrics and ends with the same adapter."""
    args = [*LORA, "kl.coef=0.05", "train.steps=6", "train.save_every=3"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_inprocess(small(model_dir, ref, *args))
    ck = run / "checkpoints" / "step-00000003"
    crash_in_step(monkeypatch, small(model_dir, run, *args), step=4)
    names = {p.name for p in ck.iterdir()}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names
    resume(run)
    assert metrics(run) == metrics(ref)
    from safetensors.torch import load_file

    a = load_file(run / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(ref / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_checkpoint_does_not_resume_a_lora_run(model_dir, tmp_path):
    """A run started without LoRA resumed with model.lora.r: one line naming the checkpoint."""
    from postrl.errors import PostrlError

    out = tmp_path / "run"
    run_inprocess(small(model_dir, out, "train.steps=2", "train.save_every=1"))
    cfg = load_config(None, small(model_dir, out, *LORA, "train.steps=3"))
    with pytest.raises(PostrlError, match="checkpoint"):
        Trainer(cfg, out, resume=True)


def test_qlora_is_refused_off_cuda_in_one_line(model_dir, tmp_path):
    cfg = load_config(None, small(model_dir, tmp_path / "q", *LORA, "model.lora.quantize=4bit",
                                  "model.lora.save=adapter"))
    with pytest.raises(ConfigError, match=r"model.lora.quantize=4bit \(QLoRA\) needs a CUDA GPU"):
        Trainer(cfg, tmp_path / "q")
    with pytest.raises(ConfigError, match="model.lora.save=both: a 4-bit base cannot be saved merged"):
        load_config(None, ["model.lora.r=4", "model.lora.quantize=4bit"])


def test_vllm_backend_is_not_accepted_and_points_to_trl_and_verl():
    with pytest.raises(ConfigError, match="rollout.backend: 'vllm' is not part of postrl's own trainer.*TRL adapter"
                                          ".*verl plug-in"):
        load_config(None, ["rollout.backend=vllm"])


# ---------------------------------------------------------------------------------------------- checkpointing
def _logp_and_grads(model, ids, mask, comp):
    model.zero_grad(set_to_none=True)
    acc = accel.prepare(model, AccelConfig(), "cpu")
    logp, _ = acc.logprobs(model, ids, mask, comp)
    (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("with_lora", [False, True])
def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(model_dir, with_lora):
    """train.gradient_checkpointing: the model recomputes activations in the backward; the update's log-probs and
    every gradient equal those without it (float rounding), and the fused CPU path stands down under it. With LoRA
    (a frozen base: no input of a checkpointed layer requires grad) the adapters still get their gradients."""
    from postrl.accel import fused
    from postrl.models import lora

    model, _ = load_model_and_tokenizer(model_dir)
    if with_lora:
        model = lora.apply(model, load_config(None, ["model.lora.r=4"]).model.lora, seed=0)
        with torch.no_grad():  # B = 0 at init: give the adapters a value so that A's gradient is not 0 either
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    model.train()
    g = torch.Generator().manual_seed(0)
    ids, comp = torch.randint(3, 30, (4, 6), generator=g), torch.randint(3, 30, (4, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    lp0, g0 = _logp_and_grads(model, ids, mask, comp)
    with torch.no_grad():
        plain = completion_logprobs(model, ids, mask, comp)[0]
    torch.testing.assert_close(lp0, plain, rtol=0, atol=1e-5)
    enable_gradient_checkpointing(model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert not fused.supports(model)
    lp1, g1 = _logp_and_grads(model, ids, mask, comp)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    assert g0.keys() == g1.keys() and all("lora_" in n for n in g0) == with_lora
    for n in g0:
        assert g0[n].abs().sum() > 0, n
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)


def test_gradient_checkpointing_trains_like_the_run_without_it(model_dir, tmp_path):
    runs = {}
    for gc in (False, True):
        out = tmp_path / str(gc)
        cfg = load_config(None, small(model_dir, out, "train.steps=2", "accel.mode=off",
                                      f"train.gradient_checkpointing={str(gc).lower()}"))
        tr = Trainer(cfg, out)
        assert any(getattr(m, "gradient_checkpointing", False) for m in tr.policy.modules()) == gc
        runs[gc] = [tr.train_step(s) for s in range(2)]
    for a, b in zip(runs[False], runs[True]):
        assert a["reward/mean"] == b["reward/mean"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


# ---------------------------------------------------------------------------------------------- prompt length
def _prompt_file(tmp_path: Path) -> Path:
    f = tmp_path / "prompts.jsonl"
    texts = ["1+1=", "2+2=", "3+3=", "4+4="] + ["12+34+56+78+90=", "98+76+54+32+10="] * 2
    f.write_text("".join(json.dumps({"prompt": t, "answer": "2"}) + "\n" for t in texts))
    return f


def _task(tmp_path):
    return "task={name: file, path: " + str(_prompt_file(tmp_path)) + ", eval_fraction: 0, verifier: arithmetic}"


def test_max_prompt_length_truncates_from_the_left_and_counts(model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, small(model_dir, out, _task(tmp_path), "rollout.max_prompt_length=6",
                                  "train.prompts_per_step=8"))
    tr = Trainer(cfg, out)
    batch, _ = tr.batches.next_batch(0)
    lengths = [len(encode_prompt(tr.tokenizer, p, cfg.model.chat_template)) for p in batch.prompts]
    real = batch.prompt_mask.sum(-1).tolist()
    assert real == [min(n, 6) for n in lengths] and max(lengths) > 6
    for i, p in enumerate(batch.prompts):  # the last 6 tokens of a long prompt
        ids = encode_prompt(tr.tokenizer, p, cfg.model.chat_template)
        assert batch.prompt_ids[i, batch.prompt_mask[i].bool()].tolist() == ids[-6:]
    n_long = sum(n > 6 for n in lengths[::cfg.rollout.group_size])
    assert tr.batches.metrics["prompts/truncated"] == n_long > 0
    assert bool(batch.valid.all())


def test_max_prompt_length_drop_masks_the_groups_out_of_the_update(model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, small(model_dir, out, _task(tmp_path), "rollout.max_prompt_length=6",
                                  "rollout.prompt_overflow=drop", "train.prompts_per_step=8"))
    tr = Trainer(cfg, out)
    batch, _ = tr.batches.next_batch(0)
    long = torch.tensor([len(encode_prompt(tr.tokenizer, p, cfg.model.chat_template)) > 6 for p in batch.prompts])
    assert long.any() and (~long).any()
    assert torch.equal(batch.valid, ~long)
    assert tr.batches.metrics["prompts/dropped"] == int(long.sum()) // cfg.rollout.group_size
    tr.step.advantages(tr.ctx, batch)
    assert bool((batch.advantages[long] == 0).all())


def test_evaluate_applies_the_same_prompt_rule(model_dir, tmp_path):
    model, tok = load_model_and_tokenizer(model_dir)
    gen = accel.prepare(model, AccelConfig(), "cpu").generator(model, tok)
    rows = [json.loads(x) for x in _prompt_file(tmp_path).read_text().splitlines()]
    n_long = sum(len(encode_prompt(tok, r["prompt"])) > 6 for r in rows)
    kw = dict(max_new_tokens=3, k=1, max_prompt_length=6)
    res = evaluate(gen, tok, None, rows, prompt_overflow="drop", **kw)
    assert res["n"] == len(rows) - n_long and res["prompts_dropped"] == n_long > 0
    res = evaluate(gen, tok, None, rows, prompt_overflow="truncate", **kw)
    assert res["n"] == len(rows) and res["prompts_truncated"] == n_long


def test_readme_one_gpu_command_trains(model_dir, tmp_path):
    """The README's one-GPU command (its overrides as written), on CPU with the tiny model in place of run.yaml's
    model: bf16 autocast + LoRA + gradient checkpointing + the prompt limit train and write final/ and
    final/adapter/."""
    import shlex
    import subprocess
    import sys

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("postrl train run.yaml model.dtype=bfloat16"))
    overrides = shlex.split(line)[3:]
    assert "model.lora.r=16" in overrides and "train.gradient_checkpointing=true" in overrides
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "postrl", "train", *small(model_dir, out, "train.steps=2",
                                                                      "rewards=[{name: correct}]"), *overrides],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "warning" not in r.stdout.lower() + r.stderr.lower(), r.stdout[-2000:] + r.stderr[-2000:]
    cfg = json.loads(json.dumps(__import__("yaml").safe_load((out / "config.yaml").read_text())))
    assert cfg["model"]["lora"]["r"] == 16 and cfg["model"]["dtype"] == "bfloat16"
    assert (out / "final" / "model.safetensors").is_file()
    assert (out / "final" / "adapter" / "adapter_model.safetensors").is_file()
    assert len(json.loads((out / "summary.json").read_text())) > 0
