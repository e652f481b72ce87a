"""The CPU speed layer (postrl.accel) computes what the plain Hugging Face path computes: log-probs, entropies,
logits and gradients of the fused path against the model's one forward per row; and ``accel.mode=off`` really
runs the plain path."""

import pytest
import torch

from postrl.accel import Accel
from postrl.accel.cpu import ThreadPolicy
from postrl.accel.fused import FUSED_MAX_POSITIONS
from postrl.logprobs import completion_logprobs
from postrl.models.tiny import build_model, build_tokenizer
from test_rollout import _reinit, _tiny_qwen2


def logprobs(model, pid, pm, cid, temperature=1.0, *, fused=False, **kw):
    """The speed layer's log-probs (the fused function with ``fused``)."""
    return Accel("auto", ThreadPolicy(torch.get_num_threads()), fused=fused).logprobs(model, pid, pm, cid, temperature,
                                                                                      **kw)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _llama(tok):
    return _reinit(build_model(tok, size="nano", seed=0))


def _gpt2(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return _reinit(GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))


def _batch(U=3, G=4, P=10, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    pid = torch.randint(5, 60, (U, P), generator=g)
    pm = torch.ones_like(pid)
    pm[0, :3] = 0  # left padding of different widths
    pm[-1, :1] = 0
    pid[pm == 0] = 0
    cid = torch.randint(5, 60, (U * G, T), generator=g)
    return pid.repeat_interleave(G, 0), pm.repeat_interleave(G, 0), cid, torch.arange(U).repeat_interleave(G)


def _run(model, pid, pm, cid):
    """The plain path: the model's one forward per row."""
    model.train()
    model.zero_grad(set_to_none=True)
    logp, ent, logits = completion_logprobs(model, pid, pm, cid, 0.7, with_entropy=True, return_logits=True)
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    (weights * logp).sum().backward()
    return logp.detach(), ent, logits.detach(), [p.grad.clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------------ fused training forward
def _fused_ran(t: torch.Tensor) -> bool:
    """Whether the fused function's node is in ``t``'s autograd graph."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "_FusedBackward":
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def _llama_gqa_bias(tok):
    """Llama with grouped-query attention (4 query heads, 2 KV heads), attention biases (q, k, v and o) and an
    untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False,
                      max_position_embeddings=128)
    torch.manual_seed(0)
    return _reinit(LlamaForCausalLM(cfg), std=0.2)


@pytest.mark.parametrize("onednn", [False, True], ids=["torch", "onednn"])
@pytest.mark.parametrize("make", [_llama, _tiny_qwen2, _llama_gqa_bias], ids=["llama-tied", "qwen2-gqa-bias",
                                                                                "llama-gqa-bias-untied"])
def test_fused_forward_and_backward_equal_the_model(tok, make, onednn):
    """The hand-written forward and backward (postrl.accel.fused) against autograd through the Hugging Face
    model's one forward per row: log-probs, entropies, logits and every parameter's gradient, with left-padded
    prompts."""
    from postrl.accel import fused, matmul

    model = make(tok)
    if onednn:
        if not matmul.onednn_available():
            pytest.skip("this torch build has no oneDNN")
        matmul.use_onednn(model)
    pid, pm, cid, _ = _batch()
    assert fused.supports(model.train())
    ref = _run(model, pid, pm, cid)
    model.zero_grad(set_to_none=True)
    logp, ent, logits = logprobs(model, pid, pm, cid, 0.7, with_entropy=True, return_logits=True, fused=True)
    assert _fused_ran(logp)
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    (weights * logp).sum().backward()
    for a, b in zip(ref[:3], (logp.detach(), ent, logits.detach())):  # (logits of tens: float rounding ~1e-5)
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-5)
    for (name, p), g in zip(model.named_parameters(), ref[3]):
        torch.testing.assert_close(p.grad, g, atol=2e-5 * float(g.abs().max()) + 1e-8, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_fused_path_is_taken_only_where_it_computes_the_same(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    from postrl.accel import fused

    gpt2, llama = _gpt2(tok), _llama(tok)
    assert not fused.supports(gpt2) and fused.supports(llama)
    # unsupported: gpt2 silently takes the model's forward; the outputs are the same as without fused
    pid, pm, cid, _ = _batch(U=1)
    torch.testing.assert_close(logprobs(gpt2, pid, pm, cid, fused=True)[0],
                               completion_logprobs(gpt2, pid, pm, cid)[0])
    llama.activation_checkpointing_enable()
    assert not fused.supports(llama)  # it would keep the activations checkpointing is there to drop
    llama.activation_checkpointing_disable()
    assert fused.supports(llama)
    assert not fused.supports(_llama(tok).to(torch.bfloat16))
    drop = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, attention_dropout=0.1))
    assert not fused.supports(drop.train()) and fused.supports(drop.eval())
    assert _fused_ran(logprobs(llama.train(), *_batch()[:3], fused=True)[0])
    # long sequences take the model's own forward (its attention kernel keeps no score matrix)
    pid, pm, cid, _ = _batch(U=1, P=10, T=FUSED_MAX_POSITIONS - 10)
    assert _fused_ran(logprobs(llama, pid, pm, cid, fused=True)[0])
    pid, pm, cid, _ = _batch(U=1, P=10, T=FUSED_MAX_POSITIONS - 9)
    assert not _fused_ran(logprobs(llama, pid, pm, cid, fused=True)[0])
    # wider models take the model's own forward (bound by their products, the fusion does not pay there)
    from postrl.accel.fused import FUSED_MAX_HIDDEN

    wide = _reinit(LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=2 * FUSED_MAX_HIDDEN,
                                                intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)))
    pid, pm, cid, _ = _batch(U=1)
    assert fused.supports(wide) and not _fused_ran(logprobs(wide.train(), pid, pm, cid, fused=True)[0])
    # no double backward: a clear error, not a wrong second derivative
    pid, pm, cid, _ = _batch(U=1)
    logp, _ = logprobs(llama, pid, pm, cid, fused=True)
    assert _fused_ran(logp)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(logp.sum(), [llama.model.norm.weight], create_graph=True)


# ------------------------------------------------------------------------------------------ accel.mode
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from postrl.models.tiny import build_local

    path = tmp_path_factory.mktemp("nano")
    build_local(path, size="nano", seed=0)
    return path


def _cfg(model_dir, out, *extra):
    from postrl.config import load_config

    return load_config(None, [f"model.path={model_dir}", f"output_dir={out}", "task.name=arithmetic", "task.digits=1",
                              "rollout.max_new_tokens=6", "rollout.group_size=4", "train.prompts_per_step=4",
                              "train.steps=2", "train.save_every=0", "train.eval_size=4", "train.eval_k=1",
                              "accel.threads=1", *extra])


def _forbid_speed_layer(monkeypatch):
    """Every piece of the speed layer raises when it runs."""
    from postrl.accel import cpu, decoder, fused, matmul

    def boom(*a, **k):
        raise RuntimeError("speed layer ran")

    monkeypatch.setattr(fused, "fused_completion_logits", boom)
    monkeypatch.setattr(decoder.StaticDecoder, "__init__", boom)
    monkeypatch.setattr(matmul, "use_onednn", boom)
    monkeypatch.setattr(cpu, "keep_freed_memory", boom)
    monkeypatch.setattr("postrl.accel.keep_freed_memory", boom)
    monkeypatch.setattr(cpu.ThreadPolicy, "measure", boom)


def test_mode_off_runs_the_plain_hugging_face_path(model_dir, tmp_path, monkeypatch):
    """accel.mode=off: training, generation and log-probs never touch the speed layer (each piece raises here), and
    the same run with mode auto does (so the patches bite)."""
    from postrl.train.trainer import Trainer

    _forbid_speed_layer(monkeypatch)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    cfg = _cfg(model_dir, tmp_path / "off", "accel.mode=off", "accel.threads=null")
    t = Trainer(cfg, cfg.output_dir)
    assert t.accel.mode == "off" and t.backend.decoder is None and t.accel.threads.fixed == torch.get_num_threads()
    assert "TOKENIZERS_PARALLELISM" not in __import__("os").environ  # no process-wide setting either
    assert t.train()["steps"] == 2
    with pytest.raises(RuntimeError, match="speed layer ran"):
        cfg = _cfg(model_dir, tmp_path / "auto")
        Trainer(cfg, cfg.output_dir).train()


def test_mode_auto_trains_the_same_first_step_as_mode_off(model_dir, tmp_path):
    """The same rollouts (static decoder vs the model's forward), rewards and loss from both modes, up to float
    rounding (oneDNN's products on AMD CPUs with AVX-512 sum in another order)."""
    import json

    from postrl.train.trainer import Trainer

    rows = {}
    for mode in ("auto", "off"):
        cfg = _cfg(model_dir, tmp_path / mode, f"accel.mode={mode}", "train.steps=1")
        Trainer(cfg, cfg.output_dir).train()
        rows[mode] = json.loads((tmp_path / mode / "metrics.jsonl").read_text().splitlines()[0])
    for key in ("reward/mean", "pg_loss", "entropy", "grad_norm", "length/mean"):
        assert rows["auto"][key] == pytest.approx(rows["off"][key], rel=1e-4, abs=1e-6), key
