"""The HF generation backend: greedy parity with ``model.generate``, padding, log-probs, seeds, EOS, stops."""

from __future__ import annotations

import copy

import pytest
import torch

from postrl.config import AccelConfig

from postrl.accel.decoder import StaticDecoder
from postrl.models.tiny import build_model, build_tokenizer
from postrl.generation import SamplingParams
from postrl.rollout.hf import HFGenerator
from postrl.generation import left_pad

PROMPTS = ["12+3=", "a", "hello world", "x*y"]


def _reinit(model, seed: int = 1, std: float = 0.3):
    # The default init gives a model whose greedy output just repeats the last token; larger random weights make
    # varied text (and the occasional EOS), so parity tests compare something non-trivial.
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, std)
    return model.eval()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return _reinit(build_model(tok, size="nano", seed=0))


@pytest.fixture(scope="module")
def eos_model(tok, model):
    """The same model with an untied lm_head whose bias pushes EOS up, so rows end at varied lengths."""
    m = copy.deepcopy(model)
    m.config.tie_word_embeddings = False
    head = torch.nn.Linear(m.config.hidden_size, m.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(m.get_input_embeddings().weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 1.5
    m.lm_head = head
    return m.eval()


def _fast(model, tok, library: str = "auto", **kw) -> HFGenerator:
    """The generator with the speed layer's static decoder (``library``: of its steps), as postrl.accel builds it."""
    return HFGenerator(model, tok, decoder=lambda m: StaticDecoder(m, library), **kw)


def _ids(tok, texts):
    return [tok.encode(t) for t in texts]


def _recompute_logprobs(model, prompt, completion, temperature):
    """Full, uncached forward over prompt + completion; log_softmax(logits / T) gathered at the completion."""
    seq = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=seq).logits[0].float()
    pred = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)] / temperature
    return torch.log_softmax(pred, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def _row(gen, i):
    length = int(gen.completion_mask[i].sum())
    return gen.completion_ids[i, :length].tolist()


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [9], [1, 2]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9], [0, 1, 2]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_greedy_matches_hf_generate(tok, model):
    gen = HFGenerator(model, tok)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    for prompt in _ids(tok, PROMPTS):
        out = gen.generate([prompt], 1, params, seed=0)
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=20,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )[0, len(prompt) :].tolist()
        assert _row(out, 0) == ref
        assert out.truncated[0].item() == (tok.eos_token_id not in ref)
        # Greedy log-probs are of the temperature-1 distribution.
        lp = _recompute_logprobs(model, prompt, ref, 1.0)
        torch.testing.assert_close(out.logprobs[0, : len(ref)], lp, atol=1e-4, rtol=0)
    # The varied outputs make this a real check (not a model that repeats one token).
    assert len(set(_row(gen.generate(_ids(tok, PROMPTS[:1]), 1, params, 0), 0))) > 3


def test_left_padded_batch_matches_single_prompts(tok, model):
    gen = HFGenerator(model, tok)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    prompts = _ids(tok, PROMPTS)
    batch = gen.generate(prompts, 2, params, seed=0)
    assert batch.prompt_ids.shape == (8, max(len(p) for p in prompts))
    for i, prompt in enumerate(prompts):
        alone = gen.generate([prompt], 1, params, seed=0)
        for j in range(2):
            r = i * 2 + j
            assert _row(batch, r) == _row(alone, 0)
            assert batch.texts[r] == alone.texts[0]
            assert batch.truncated[r] == alone.truncated[0]
            n = len(_row(alone, 0))
            torch.testing.assert_close(batch.logprobs[r, :n], alone.logprobs[0, :n], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "which,params",
    [
        ("model", SamplingParams(max_new_tokens=24, temperature=0.7)),
        ("model", SamplingParams(max_new_tokens=24, temperature=0.7, top_k=10, top_p=0.9)),
        ("eos_model", SamplingParams(max_new_tokens=24, temperature=0.7)),
    ],
)
def test_logprobs_match_full_forward(tok, model, eos_model, which, params):
    m = model if which == "model" else eos_model
    prompts = _ids(tok, PROMPTS)
    out = HFGenerator(m, tok).generate(prompts, 3, params, seed=7)
    lengths = out.completion_mask.sum(1).long()
    if which == "eos_model":
        assert len(set(lengths.tolist())) > 3  # rows finished at different steps
    for r in range(len(prompts) * 3):
        completion = _row(out, r)
        lp = _recompute_logprobs(m, prompts[r // 3], completion, params.temperature)
        torch.testing.assert_close(out.logprobs[r, : len(completion)], lp, atol=1e-4, rtol=0)
        assert (out.logprobs[r, len(completion) :] == 0).all()
        assert (out.completion_ids[r, len(completion) :] == tok.pad_token_id).all()


def test_seed_determinism(tok, model):
    gen = HFGenerator(model, tok)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    prompts = _ids(tok, PROMPTS[:2])
    a = gen.generate(prompts, 4, params, seed=123)
    b = gen.generate(prompts, 4, params, seed=123)
    c = gen.generate(prompts, 4, params, seed=124)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.logprobs, b.logprobs)
    assert a.texts == b.texts
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # The n samples of one prompt differ from each other.
    assert len({tuple(_row(a, r)) for r in range(4)}) == 4
    # Sampling uses only its own generator: the global RNG is neither used nor advanced.
    torch.manual_seed(0)
    before = torch.get_rng_state()
    d = gen.generate(prompts, 4, params, seed=123)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(d.completion_ids, a.completion_ids)


def test_top_k_1_and_tiny_top_p_equal_greedy(tok, model):
    gen = HFGenerator(model, tok)
    prompts = _ids(tok, PROMPTS)
    greedy = gen.generate(prompts, 1, SamplingParams(max_new_tokens=16, temperature=0.0), seed=0)
    topk = gen.generate(prompts, 2, SamplingParams(max_new_tokens=16, temperature=1.0, top_k=1), seed=5)
    topp = gen.generate(prompts, 2, SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1e-6), seed=6)
    for r in range(len(prompts) * 2):
        assert _row(topk, r) == _row(greedy, r // 2)
        assert _row(topp, r) == _row(greedy, r // 2)
        # At temperature 1 the (unfiltered) log-probs are the greedy ones, not 0 from the filtered distribution.
        n = len(_row(greedy, r // 2))
        # (float rounding differs between batch compositions: up to ~1.6e-5 on this deliberately sharp model)
        torch.testing.assert_close(topk.logprobs[r, :n], greedy.logprobs[r // 2, :n], atol=3e-5, rtol=0)
        assert (topk.logprobs[r, :n] < 0).all()


def test_eos_ends_rows(tok, eos_model):
    eos = tok.eos_token_id
    gen = HFGenerator(eos_model, tok)
    out = gen.generate(_ids(tok, PROMPTS), 4, SamplingParams(max_new_tokens=20, temperature=1.0), seed=3)
    lengths = out.completion_mask.sum(1).long()
    assert out.completion_ids.shape[1] == int(lengths.max())  # trimmed to the longest completion
    n_eos = 0
    for r in range(16):
        ids = out.completion_ids[r].tolist()
        if eos in ids:
            n_eos += 1
            e = ids.index(eos)
            assert lengths[r] == e + 1  # EOS itself is in the completion, mask 1
            assert out.completion_mask[r, : e + 1].eq(1).all() and out.completion_mask[r, e + 1 :].eq(0).all()
            assert all(t == tok.pad_token_id for t in ids[e + 1 :])
            assert out.logprobs[r, e] < 0 and out.logprobs[r, e + 1 :].eq(0).all()
            assert not out.truncated[r]
            assert out.texts[r] == tok.decode(ids[:e], skip_special_tokens=True) and "</s>" not in out.texts[r]
        else:
            assert lengths[r] == 20 and out.truncated[r]
    assert 4 <= n_eos < 16

    # A head that always prefers EOS: every completion is exactly [EOS], one column, empty text.
    forced = copy.deepcopy(eos_model)
    with torch.no_grad():
        forced.lm_head.bias[eos] = 100.0
    out = HFGenerator(forced, tok).generate(_ids(tok, PROMPTS), 2, SamplingParams(max_new_tokens=10), seed=0)
    assert out.completion_ids.tolist() == [[eos]] * 8
    assert out.completion_mask.tolist() == [[1.0]] * 8
    assert not out.truncated.any()
    assert out.texts == [""] * 8


def test_stop_strings(tok, model):
    gen = HFGenerator(model, tok)
    prompts = _ids(tok, PROMPTS)
    free = gen.generate(prompts, 1, SamplingParams(max_new_tokens=20, temperature=0.0), seed=0)
    text = free.texts[2]
    stop = text[5:7]  # a substring of prompt 2's greedy output
    out = gen.generate(prompts, 1, SamplingParams(max_new_tokens=20, temperature=0.0, stop=[stop, "@@"]), seed=0)
    cut = text.find(stop)
    assert out.texts[2] == text[:cut]
    assert not out.truncated[2]
    # The completion runs up to and including the token that completed the stop string (one char per token here).
    assert _row(out, 2) == _row(free, 2)[: cut + len(stop)]
    assert out.completion_mask[2].sum() == cut + len(stop)
    # Rows whose text never contains a stop string are unchanged.
    for r in range(4):
        if stop not in free.texts[r]:
            assert _row(out, r) == _row(free, r) and out.texts[r] == free.texts[r]
            assert out.truncated[r] == free.truncated[r]


def test_max_new_tokens_and_truncation(tok, model):
    gen = HFGenerator(model, tok)
    out = gen.generate(_ids(tok, PROMPTS), 2, SamplingParams(max_new_tokens=5, temperature=1.0), seed=0)
    assert out.completion_ids.shape == (8, 5)
    for r in range(8):
        if tok.eos_token_id not in out.completion_ids[r].tolist():
            assert out.truncated[r] and out.completion_mask[r].sum() == 5
    assert out.truncated.dtype == torch.bool and out.completion_mask.dtype == torch.float32


def test_rows_are_prompt_major_and_batch_size_invariant(tok, model):
    prompts = _ids(tok, PROMPTS[:3])
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    full = HFGenerator(model, tok).generate(prompts, 3, params, seed=11)
    chunked = HFGenerator(model, tok, batch_size=2).generate(prompts, 3, params, seed=11)
    width = full.prompt_ids.shape[1]
    for r in range(9):
        p = prompts[r // 3]
        assert full.prompt_ids[r, width - len(p) :].tolist() == p
        assert full.prompt_mask[r].sum() == len(p)
        assert full.prompt_ids[r, : width - len(p)].eq(tok.pad_token_id).all()
    assert torch.equal(full.prompt_ids, chunked.prompt_ids)
    assert torch.equal(full.completion_ids, chunked.completion_ids)
    torch.testing.assert_close(full.logprobs, chunked.logprobs, atol=1e-4, rtol=0)
    # Greedy rows of one prompt are identical; each block matches that prompt generated alone.
    greedy = HFGenerator(model, tok).generate(prompts, 3, SamplingParams(max_new_tokens=8, temperature=0), seed=0)
    for i, p in enumerate(prompts):
        alone = HFGenerator(model, tok).generate([p], 1, SamplingParams(max_new_tokens=8, temperature=0), seed=0)
        assert all(_row(greedy, 3 * i + j) == _row(alone, 0) for j in range(3))


def test_without_cache_compaction_same_result(tok, eos_model, monkeypatch):
    prompts = _ids(tok, PROMPTS)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, stop=["e"])
    from postrl.accel.decoder import _StaticStepper
    from postrl.rollout.hf import _HFStepper

    a = HFGenerator(eos_model, tok).generate(prompts, 3, params, seed=2)
    c = _fast(eos_model, tok).generate(prompts, 3, params, seed=2)
    monkeypatch.setattr(_HFStepper, "_can_compact", staticmethod(lambda cache: False))
    monkeypatch.setattr(_StaticStepper, "can_compact", False)
    b = HFGenerator(eos_model, tok).generate(prompts, 3, params, seed=2)
    d = _fast(eos_model, tok).generate(prompts, 3, params, seed=2)
    assert torch.equal(c.completion_ids, d.completion_ids)
    torch.testing.assert_close(c.logprobs, d.logprobs, atol=1e-4, rtol=0)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    assert a.texts == b.texts and torch.equal(a.truncated, b.truncated)


def test_mode_restored_and_outputs_are_ordinary_tensors(tok, model):
    gen = HFGenerator(model, tok)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    ref = gen.generate(_ids(tok, PROMPTS), 1, params, seed=0)
    model.train()
    try:
        out = gen.generate(_ids(tok, PROMPTS), 1, params, seed=0)
        assert model.training
    finally:
        model.eval()
    assert torch.equal(out.completion_ids, ref.completion_ids)
    for t in (out.prompt_ids, out.completion_ids, out.completion_mask, out.logprobs, out.truncated):
        assert not torch.is_inference(t)
    out.logprobs.mul_(1.0)  # in-place use by a trainer outside inference mode works


def test_rejects_bad_input(tok, model):
    gen = HFGenerator(model, tok)
    with pytest.raises(ValueError):
        gen.generate([[]], 1, SamplingParams(), seed=0)
    with pytest.raises(ValueError):
        gen.generate([[5]], 0, SamplingParams(), seed=0)
    with pytest.raises(ValueError):
        HFGenerator(model, tok, batch_size=0)


# ---------------------------------------------------------------------------------------------- static decoder
def _tiny_qwen2(tok, hidden: int = 64):
    """Qwen2 (q/k/v biases) with grouped-query attention: 4 query heads share 2 KV heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return _reinit(Qwen2ForCausalLM(cfg))


def test_static_decoder_supports_llama_family_only(tok, model):
    from transformers import GPT2Config, GPT2LMHeadModel

    from postrl import accel

    assert StaticDecoder.supports(model) and StaticDecoder.supports(_tiny_qwen2(tok))
    assert accel.prepare(copy.deepcopy(model), AccelConfig()).generator(model, tok).decoder is not None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert not StaticDecoder.supports(gpt2) and accel.prepare(copy.deepcopy(gpt2), AccelConfig()).generator(gpt2, tok).decoder is None
    scaled = copy.deepcopy(model)
    scaled.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert not StaticDecoder.supports(scaled)  # a RoPE variant it does not implement: the model's own forward
    # An unsupported model still generates (through its forward with a DynamicCache).
    out = accel.prepare(copy.deepcopy(gpt2), AccelConfig()).generator(gpt2.eval(), tok).generate(
        _ids(tok, PROMPTS[:2]), 2, SamplingParams(max_new_tokens=5), seed=0)
    assert out.completion_ids.shape == (4, 5)


@pytest.mark.parametrize("which,library", [("eos_model", "numpy"), ("eos_model", "torch"), ("qwen2", "numpy"),
                                           ("qwen2", "torch"), ("qwen2_onednn", "torch"),
                                           ("qwen2_onednn", "numpy")])
def test_static_cache_and_dynamic_cache_give_the_same_generation(tok, eos_model, which, library):
    """Same tokens, EOS ends, stop strings and log-probs from the static decoder (decode steps in numpy or in torch)
    and from the model's forward; sampled with top-k/top-p, rows finishing at different steps (cache compaction),
    chunked batches. qwen2_onednn: layers on oneDNN (postrl.accel.matmul) and wide enough for the decoder's steps
    (torch or numpy) to run their products on it too."""
    if which == "eos_model":
        m = eos_model
    elif which == "qwen2":
        m = _tiny_qwen2(tok)
    else:
        from postrl.accel import matmul
        from postrl.accel import decoder

        if not matmul.onednn_available():
            pytest.skip("this torch build has no oneDNN")
        m = _tiny_qwen2(tok, hidden=decoder._ONEDNN_MIN_HIDDEN + 64)
        plain = copy.deepcopy(m)
        assert matmul.use_onednn(m) > 0
        assert decoder.StaticDecoder(m, "torch").linear is decoder._onednn_linear
        assert decoder.StaticDecoder(plain, "torch").linear is not decoder._onednn_linear
        numpy_steps = decoder.StaticDecoder(m)
        assert numpy_steps.library == "numpy"  # auto on a CPU in float32
        assert numpy_steps.onednn and isinstance(numpy_steps.np_layers[0][1], torch.Tensor)  # products on oneDNN
        assert not decoder.StaticDecoder(plain).onednn
    # oneDNN sums the products in another order than MKL; with these large random weights (logits of tens) the
    # log-probs then differ by up to ~2e-4
    tol = 5e-4 if which == "qwen2_onednn" else 1e-4
    prompts = _ids(tok, PROMPTS)
    for params in (SamplingParams(max_new_tokens=20, temperature=0.8, top_k=20, top_p=0.95, stop=["e"]),
                   SamplingParams(max_new_tokens=12, temperature=0.0)):
        a = _fast(m, tok, library).generate(prompts, 3, params, seed=5)
        b = HFGenerator(m, tok).generate(prompts, 3, params, seed=5)
        c = _fast(m, tok, library, batch_size=5).generate(prompts, 3, params, seed=5)
        for o in (b, c):
            assert torch.equal(a.completion_ids, o.completion_ids)
            assert torch.equal(a.completion_mask, o.completion_mask)
            assert torch.equal(a.truncated, o.truncated) and a.texts == o.texts
            torch.testing.assert_close(a.logprobs, o.logprobs, atol=tol, rtol=0)
    if which == "eos_model":
        assert len(set(a.completion_mask.sum(1).tolist())) > 2  # rows ended at different steps
    # and the log-probs are the model's own full-forward ones
    for r in range(len(prompts) * 3):
        completion = _row(a, r)
        lp = _recompute_logprobs(m if which != "qwen2_onednn" else plain, prompts[r // 3], completion, 1.0)
        torch.testing.assert_close(a.logprobs[r, : len(completion)], lp, atol=tol, rtol=0)


def test_generation_thread_policy(tok, model):
    from postrl.accel.cpu import ThreadPolicy

    before = torch.get_num_threads()
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    ref = HFGenerator(model, tok).generate(_ids(tok, PROMPTS), 2, params, seed=1)
    out = HFGenerator(model, tok, threads=ThreadPolicy(1)).generate(_ids(tok, PROMPTS), 2, params, seed=1)
    torch.set_num_threads(before)
    assert torch.equal(ref.completion_ids, out.completion_ids)
    with pytest.raises(ValueError):
        ThreadPolicy(0)


def test_decode_library_choice_and_errors(tok, model):
    from postrl.accel import decoder

    assert decoder.numpy_blas() is not None  # numpy from PyPI ships OpenBLAS
    assert decoder.decode_library(model) == "numpy" and decoder.decode_library(model, "torch") == "torch"
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert decoder.decode_library(bf16) == "torch"  # numpy has no bfloat16: auto falls back
    with pytest.raises(ValueError, match="bfloat16, numpy decodes float32 only"):
        decoder.decode_library(bf16, "numpy")
    with pytest.raises(ValueError, match="auto, numpy, torch"):
        decoder.decode_library(model, "jax")
    # bfloat16 still generates through the static decoder's torch steps
    out = _fast(bf16, tok).generate(_ids(tok, PROMPTS[:2]), 2, SamplingParams(max_new_tokens=4), seed=0)
    assert out.completion_ids.shape == (4, 4)


def test_numpy_and_torch_decode_steps_agree_and_silu_overflow_is_silent(tok, model):
    """The same logits from both libraries' decode steps, step after step, on a model whose MLP pre-activations
    reach hundreds (exp(-g) overflows in the numpy SiLU: g / inf = -0, no warning, no NaN)."""
    import warnings

    from postrl.accel import decoder

    m = copy.deepcopy(model)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.gate_proj.weight.mul_(400.0)
    ids, mask = left_pad(_ids(tok, PROMPTS), tok.pad_token_id)
    decs = {lib: decoder.StaticDecoder(m, lib) for lib in ("numpy", "torch")}
    assert {lib: d.library for lib, d in decs.items()} == {"numpy": "numpy", "torch": "torch"}
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        logits = {lib: d.prefill(ids, mask, 8) for lib, d in decs.items()}
        pos = mask.sum(-1)
        live = torch.tensor([True, False, True, True])  # a finished row is masked out of later attention
        for t in range(6):
            torch.testing.assert_close(logits["numpy"], logits["torch"], atol=2e-4, rtol=1e-5)
            tokens = logits["torch"].argmax(-1)
            logits = {lib: d.decode(tokens, pos + t, live) for lib, d in decs.items()}
    assert torch.isfinite(logits["numpy"]).all()
    g = m.model.layers[0].mlp.gate_proj.weight @ m.model.embed_tokens.weight[ids[0, -1]]
    assert g.min() < -88  # where float32 exp(-g) overflows


def test_prefill_runs_each_distinct_prompt_once(tok, model, monkeypatch):
    from postrl.accel import decoder

    widths = []
    real = decoder.StaticDecoder.prefill
    monkeypatch.setattr(decoder.StaticDecoder, "prefill",
                        lambda self, ids, mask, n: widths.append(len(ids)) or real(self, ids, mask, n))
    prompts = _ids(tok, PROMPTS[:3])
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    shared = _fast(model, tok).generate(prompts, 4, params, seed=3)
    assert widths == [3]  # 12 rows, 3 prompts
    # the same samples as one row at a time (no prompt repeated within a batch)
    alone = _fast(model, tok, batch_size=1).generate(prompts, 4, params, seed=3)
    assert widths[1:] == [1] * 12
    assert torch.equal(shared.completion_ids, alone.completion_ids)
    torch.testing.assert_close(shared.logprobs, alone.logprobs, atol=1e-4, rtol=0)
    assert len({tuple(r) for r in shared.completion_ids.tolist()}) > 6  # the rows of a prompt differ


def test_numpy_blas_runs_with_the_generation_thread_count(tok, model, monkeypatch):
    from postrl.accel import decoder

    from postrl.accel.cpu import ThreadPolicy

    seen = []
    real = decoder.blas_threads
    monkeypatch.setattr(decoder, "blas_threads", lambda n: seen.append(n) or real(n))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _fast(model, tok, threads=ThreadPolicy(1)).generate(_ids(tok, PROMPTS[:1]), 2,
                                                           SamplingParams(max_new_tokens=3), seed=0)
        _fast(model, tok).generate(_ids(tok, PROMPTS[:1]), 2, SamplingParams(max_new_tokens=3), seed=0)
        _fast(model, tok, "torch").generate(_ids(tok, PROMPTS[:1]), 2, SamplingParams(max_new_tokens=3), seed=0)
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]  # the policy's count; else torch's; torch decode steps leave numpy's BLAS alone


def test_plain_cpu_sampling_matches_the_general_sampler():
    """The numpy fast path (no top-k / top-p, CPU) draws the same tokens with the same log-probs as the general
    torch sampler it stands in for, and never a zero-probability token."""
    from postrl.rollout import hf

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4000, 88, generator=g) * 3
    logits[:, ::3] = float("-inf")  # zero-probability tokens
    u = torch.rand(4000, generator=g)
    u[:4] = torch.tensor([0.0, 1.0 - 2**-24, 0.5, 1e-9])
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature)
        fast = hf._sample(logits, params, u)
        ref = hf._sample(logits, SamplingParams(temperature=temperature, top_p=1.0 - 1e-12), u)  # the torch path
        assert fast[0].dtype == ref[0].dtype == torch.long and fast[1].dtype == torch.float32
        assert (fast[0] != ref[0]).sum() <= 2  # boundary cases of float rounding at most
        same = fast[0] == ref[0]
        torch.testing.assert_close(fast[1][same], ref[1][same], atol=1e-5, rtol=1e-6)
        assert (fast[0] % 3 != 0).all()
        want = torch.log_softmax(logits / temperature, -1).gather(1, fast[0][:, None]).squeeze(1)
        torch.testing.assert_close(fast[1], want, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("fast", [False, True], ids=["hf", "static-decoder"])
def test_ignore_eos_runs_every_row_to_max_new_tokens(tok, eos_model, fast):
    """SamplingParams.ignore_eos: EOS does not end a row (equal work, as the benchmark needs); up to each row's first
    EOS the tokens and log-probs are those of the ordinary run (same seed, same draws)."""
    gen = _fast(eos_model, tok) if fast else HFGenerator(eos_model, tok)
    prompts = _ids(tok, PROMPTS)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    ended = gen.generate(prompts, 3, params, seed=4)
    full = gen.generate(prompts, 3, SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True), seed=4)
    assert (ended.completion_mask.sum(1) < 12).any()  # without it, some rows end early at EOS
    assert full.completion_mask.shape == (12, 12) and bool(full.completion_mask.all()) and bool(full.truncated.all())
    for r in range(12):
        n = int(ended.completion_mask[r].sum())
        assert full.completion_ids[r, :n].tolist() == ended.completion_ids[r, :n].tolist()
        torch.testing.assert_close(full.logprobs[r, :n], ended.logprobs[r, :n], atol=1e-5, rtol=0)
    assert (full.completion_ids == tok.eos_token_id).any()  # EOS was sampled and did not stop the row
