"""A lean incremental decoder for Llama-family causal LMs with a pre-allocated (static) KV cache.

:class:`HFGenerator` drives generation one token at a time. For tiny models on a CPU, the cost of a decode step is
mostly the number of tensor operations, not their arithmetic: the Hugging Face forward runs several dozen per layer
(module calls, mask construction, a cache that grows by concatenation). :class:`StaticDecoder` computes the same
function as the model's own ``forward`` — same weights, same formulas (RMSNorm in float32, rotary embedding,
grouped-query attention scaled by ``head_dim**-0.5``, SwiGLU MLP, tied or untied LM head) — with fewer operations:

* fused projections: one matmul for q/k/v and one for gate/up (the weights are concatenated once per
  ``generate`` call, so they always are the current weights of the training module);
* in float32, each RMSNorm weight folded into the projection that follows it (``W diag(w)``), so a norm is four
  elementwise operations, and the queries' ``head_dim**-0.5`` folded into their rows;
* rotary embedding as one in-place complex multiply: the rows of the q and k projections are permuted within each
  head from HF's half-split layout ``[x_0..x_{D/2-1}, y_0..y_{D/2-1}]`` to pairs ``(x_i, y_i)``, which is the
  same rotation ``(x cos - y sin, x sin + y cos)``; since queries and keys are permuted alike, ``q . k`` is
  unchanged (the cache holds keys in the permuted layout, used by nothing else);
* a KV cache allocated once for the whole generation (``[layers, 2, rows, kv_heads, prompt + max_new, head_dim]``)
  and written in place, keys and values of a layer in one copy, so no step copies the cache;
* a decode step on 2-D activations ``[rows, hidden]``, RMSNorm as four operators, and the residual
  additions fused into the output and down projections (``addmm``, or oneDNN's linear with an ``add`` post-op);
* the rotary table computed once per call; an additive attention bias row per step;
* the LM head only on the last position.

Together these halve the operations of a decode step; the results differ from the model's forward by float
rounding only.

On a CPU in float32 the decode steps run in numpy (``library='numpy'``, the default there, see
:func:`decode_library`) on the same weights and the same cache memory (numpy views of the torch tensors): the same
formulas, each operation costing about a microsecond where a torch operator costs several (argument parsing,
dispatch, output allocation). A decode step of a tiny model is a few hundred such operations around 17 small
products: in torch the operations are most of its time, in numpy the products are about two thirds. numpy's
products run on the BLAS numpy ships (OpenBLAS in the PyPI wheels), with as many threads as torch has at the time
(``blas_threads``), except where the torch steps would use oneDNN (below): there the numpy steps call oneDNN's
product on the same memory (on the Zen 5 VM measured, whose environment pins OpenBLAS to its AVX2 kernels with
``OPENBLAS_CORETYPE=Haswell``, oneDNN's AVX-512 ones were 1.7-1.9x as fast for the 20M model). Measured on an AMD
EPYC Zen 3 (AVX2), 8 rows: 1M model 0.88 vs 1.5 ms a step on one thread, 20M model 8.5 vs 15 ms on two (torch on
MKL); on a Zen 5 (AVX-512), 1M: 0.40 vs 0.53 ms, 20M with 32 rows: the same time either way (bound by oneDNN's
products). The prompt's prefill runs in numpy too (1M model, 2 prompts of 12 tokens: 0.95 vs 1.37 ms), its last
layer's output projection and MLP on the last position only. At long completions a step reads the whole KV cache
(float32: 20 MB a step for 32 rows of the 1M model at 150 positions), and that reading bounds it (1.1 ms a step at
12 positions, 2.7 ms at 260).

It is used for models it can reproduce exactly (``StaticDecoder.supports``): ``model_type`` llama, mistral or qwen2,
default RoPE, SiLU MLP without bias, no sliding window, no logit soft-capping. Any other model goes through the
Hugging Face forward with a ``DynamicCache``. Both give the same tokens and log-probs up to float rounding
(tests/test_rollout.py checks this against the model's full forward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from postrl.accel.matmul import OneDNNLinear

_TYPES = ("llama", "mistral", "qwen2")
_LINEAR = (torch.nn.Linear, OneDNNLinear)
# Decode-step products of models above this hidden size go through oneDNN when the model's layers do
# (postrl.accel.matmul): 1.4-2.3x faster for 8-32 rows x 512 x 1536 on an AMD CPU with AVX-512; at hidden size 128 a product
# takes microseconds and the gain is lost to the call's overhead.
_ONEDNN_MIN_HIDDEN = 256


LIBRARIES = ("auto", "numpy", "torch")


@lru_cache(maxsize=1)
def blas_controller():
    """threadpoolctl's controller of the BLAS libraries loaded in this process (numpy's; torch links MKL in)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


def numpy_blas() -> str | None:
    """The BLAS library numpy's products run on ('openblas', 'mkl', 'blis', ...), or None when numpy has none it
    can report (then its products would be slow loops, and decode steps stay in torch)."""
    if not np.__config__.CONFIG.get("Build Dependencies", {}).get("blas", {}).get("found", True):
        return None
    libs = blas_controller().info()
    return libs[0]["internal_api"] if libs else None


@contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Run the body with numpy's BLAS limited to ``n`` threads (restored afterwards). torch's own BLAS (MKL, linked
    into torch) is not affected; its count is torch's ``set_num_threads``."""
    with blas_controller().limit(limits=max(1, int(n))):
        yield


def decode_library(model, library: str = "auto") -> str:
    """The library of :class:`StaticDecoder`'s prefill and decode steps: ``numpy`` (float32 model on a CPU, numpy
    with a BLAS; what ``auto`` picks there) or ``torch``. ``library='numpy'`` where numpy cannot run the model is a
    ValueError."""
    if library not in LIBRARIES:
        raise ValueError(f"decode library must be one of {', '.join(LIBRARIES)}, got '{library}'")
    if library == "torch":
        return "torch"
    p = next(iter(model.parameters()), None)
    why = None
    if p is None or p.device.type != "cpu":
        why = "the model is not on the CPU"
    elif p.dtype != torch.float32:
        why = f"the model is in {str(p.dtype).replace('torch.', '')}, numpy decodes float32 only"
    elif numpy_blas() is None:
        why = "numpy has no BLAS library"
    if why is None:
        return "numpy"
    if library == "numpy":
        raise ValueError(f"decode library 'numpy': {why}")
    return "torch"


def _rope_default(config) -> bool:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        return params.get("rope_type", "default") == "default"
    scaling = getattr(config, "rope_scaling", None)
    return scaling is None or (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default")


def _linear_t(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, wt.t(), b)`` with the weight stored transposed (``wt`` [in, out], contiguous). For a decode
    step's few rows MKL multiplies by a row-major [in, out] weight faster than by the transposed view F.linear
    passes it (8 x 128 x 960 on one thread: 44 vs 57 us on an AMD Zen 3), and the weights are copied per
    ``generate`` call anyway."""
    if x.dim() == 2:
        return torch.mm(x, wt) if b is None else torch.addmm(b, x, wt)
    out = torch.matmul(x, wt)
    return out if b is None else out + b


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    # no autograd: generation runs under inference_mode
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _weight(parts: list[torch.Tensor], perms: list[torch.Tensor | None], fold: torch.Tensor | None, transpose: bool,
            q_rows: int = 0, q_scale: float = 1.0) -> torch.Tensor:
    """A decode step's weight from a layer's: the ``parts`` [out_i, in] stacked by rows, each with its rows
    permuted by ``perms`` (None: as they are), the first ``q_rows`` rows scaled by ``q_scale``, the columns by
    ``fold`` (a norm weight folded in; None: not), laid out [in, out] contiguous when ``transpose`` else [out, in].
    Passes over the weight: the stacking, the folding, the transposition; the result is a new tensor except for a
    single part with nothing to change in [out, in]."""
    if len(parts) == 1 and perms[0] is None and not q_rows and fold is None and not transpose:
        return parts[0]
    w = torch.empty((sum(p.shape[0] for p in parts), parts[0].shape[1]), dtype=parts[0].dtype, device=parts[0].device)
    row = 0
    for part, perm in zip(parts, perms):
        dst = w[row:row + part.shape[0]]
        if perm is None:
            dst.copy_(part)
        else:
            torch.index_select(part, 0, perm.to(part.device), out=dst)
        row += part.shape[0]
    if q_rows:
        w[:q_rows] *= q_scale
    if fold is not None:
        w.mul_(fold)
    # (a transposing copy_ takes torch's blocked path: 3x faster than an elementwise op writing transposed)
    return torch.empty((w.shape[1], w.shape[0]), dtype=w.dtype, device=w.device).copy_(w.t()) if transpose else w


def _np_mm(x: np.ndarray, w: np.ndarray | torch.Tensor) -> np.ndarray:
    """A numpy decode step's product ``x @ w.T`` for a weight [out, in] as the layers hold it: numpy's for a numpy
    array, oneDNN's for a torch tensor (the same memory on both sides: no copy)."""
    if isinstance(w, np.ndarray):
        return x @ w.T
    return _onednn_linear(torch.from_numpy(x), w).numpy()


def _np_softmax_(s: np.ndarray) -> np.ndarray:
    """softmax over the last axis, in place (``-inf`` entries get 0)."""
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    return s


def _np_rms(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) in float32 over the last axis of a 2-D array (the weight is folded)."""
    r = (x * x).sum(-1, keepdims=True)  # 8 x 128: 8 us, einsum 14 us (its Python dispatcher)
    r *= np.float32(1.0 / x.shape[-1])
    r += np.float32(eps)
    np.sqrt(r, out=r)
    return x / r


class StaticDecoder:
    """Prefill + one-token decode steps over a static KV cache, for a supported HF model (see module docstring)."""

    @staticmethod
    def supports(model) -> bool:
        cfg = getattr(model, "config", None)
        base = getattr(model, "model", None)
        if cfg is None or base is None or getattr(cfg, "model_type", None) not in _TYPES:
            return False
        if getattr(cfg, "hidden_act", None) != "silu" or getattr(cfg, "mlp_bias", False):
            return False
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1) or getattr(cfg, "final_logit_softcapping", None):
            return False
        if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return False
        if not _rope_default(cfg):
            return False
        rot = getattr(base, "rotary_emb", None)
        if rot is None or getattr(rot, "attention_scaling", 1.0) != 1.0 or not hasattr(rot, "inv_freq"):
            return False
        try:
            layers = list(base.layers)
            for layer in layers:
                a, m = layer.self_attn, layer.mlp
                for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
                    if type(lin) not in _LINEAR:
                        return False
                if m.gate_proj.bias is not None or m.up_proj.bias is not None or m.down_proj.bias is not None:
                    return False
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    if not hasattr(norm, "variance_epsilon") or tuple(norm.weight.shape) != (cfg.hidden_size,):
                        return False
            head = model.get_output_embeddings()
            if type(head) not in _LINEAR or type(base.embed_tokens) is not torch.nn.Embedding:
                return False
            if not hasattr(base.norm, "variance_epsilon"):
                return False
        except AttributeError:
            return False
        return bool(layers)

    def stepper(self, rows: list[list[int]], ids: torch.Tensor, mask: torch.Tensor, max_new: int) -> _StaticStepper:
        """The stepper :class:`~postrl.rollout.hf.HFGenerator` drives for the left-padded prompts ``ids``/``mask``
        (``rows``: their token lists): prefill, then one decode step per token."""
        return _StaticStepper(self, rows, ids, mask, max_new)

    def threads(self, n: int):
        """numpy decode steps: numpy's BLAS on ``n`` threads (torch's count for the phase) for the body."""
        return blas_threads(n) if self.library == "numpy" else nullcontext()

    def __init__(self, model, library: str = "auto"):
        """``library``: of the prefill and decode steps (:func:`decode_library`): ``auto``, ``numpy`` or ``torch``."""
        self.library = decode_library(model, library)
        cfg = model.config
        base = model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scaling = self.head_dim ** -0.5
        self.embed = base.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.inv_freq = base.rotary_emb.inv_freq
        # Norm weights folded into the next projection in float32 only: in lower precision the model rounds the
        # normalised activations before the weight, which a folded weight would not reproduce as closely.
        self.fold = self.dtype == torch.float32
        head = model.get_output_embeddings()
        self.head_b = head.bias
        onednn = type(head) is OneDNNLinear and cfg.hidden_size > _ONEDNN_MIN_HIDDEN and self.dtype == torch.float32
        # oneDNN's linear takes the weight as the layers hold it, [out, in]; MKL's and numpy's products get it
        # transposed. numpy decode steps run their products on oneDNN too where the torch steps would (on an AVX-512
        # AMD CPU, 20M model, 32 rows: 8 x 512 x 3072 in 224 us against OpenBLAS's 417).
        self.onednn = onednn
        # numpy's products take the weights as the layers hold them too ([out, in], ``x @ w.T``): as fast as
        # [in, out] at a decode step's rows (8 x 128 x 960: 29.6 vs 35.1 us, 8 x 480 x 128: 15.4 vs 13.6), and no
        # transposing copy per generate call. (A numpy decoder runs no torch layer: ``linear`` is the torch steps'.)
        t = not onednn and self.library == "torch"
        self.linear = _onednn_linear if onednn else _linear_t if t else None
        D = self.head_dim
        # Within a head: [x_0, y_0, x_1, y_1, ...] from HF's [x_0, x_1, ..., y_0, y_1, ...] (rotate_half pairs i, i+D/2).
        pair = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=1).reshape(-1)
        q_perm = (torch.arange(self.n_heads)[:, None] * D + pair).reshape(-1)
        k_perm = (torch.arange(self.n_kv)[:, None] * D + pair).reshape(-1)
        nq = self.n_heads * D
        self.layers = []
        with torch.no_grad():
            self.norm_w, self.norm_eps = base.norm.weight, base.norm.variance_epsilon
            self.head_w = _weight([head.weight], [None], self.norm_w if self.fold else None, t)
            if self.fold:
                self.norm_w = None
            for layer in base.layers:
                a, m = layer.self_attn, layer.mlp
                w_in, w_post = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
                fold_in, fold_post = (w_in, w_post) if self.fold else (None, None)
                # Queries pre-scaled by head_dim**-0.5 (the attention's scaling, applied to q instead of q.k).
                wqkv = _weight([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], [q_perm, k_perm, None], fold_in, t,
                               q_rows=nq, q_scale=self.scaling)
                bqkv = None
                if a.q_proj.bias is not None:
                    bqkv = torch.cat([a.q_proj.bias[q_perm] * self.scaling, a.k_proj.bias[k_perm], a.v_proj.bias])
                wgu = _weight([m.gate_proj.weight, m.up_proj.weight], [None, None], fold_post, t)
                self.layers.append((None if self.fold else w_in, layer.input_layernorm.variance_epsilon, wqkv, bqkv,
                                    _weight([a.o_proj.weight], [None], None, t), a.o_proj.bias,
                                    None if self.fold else w_post, layer.post_attention_layernorm.variance_epsilon,
                                    wgu, _weight([m.down_proj.weight], [None], None, t)))
        self.inter = m.gate_proj.weight.shape[0]
        self.cache: torch.Tensor | None = None
        if self.library == "numpy":  # numpy views of the same memory (the weights above: parameters, or copies)
            def arr(t):
                return None if t is None else t.detach().numpy()

            # a product's weight [out, in]: a numpy array (numpy's product) or, on oneDNN, the torch tensor
            mat = (lambda t: t) if onednn else arr
            self.np_layers = [(eps_in, mat(wqkv), arr(bqkv), mat(wo), arr(bo), eps_post, mat(wgu), mat(wd))
                              for (_, eps_in, wqkv, bqkv, wo, bo, _, eps_post, wgu, wd) in self.layers]
            self.np_embed, self.np_head_w, self.np_head_b = arr(self.embed), mat(self.head_w), arr(self.head_b)

    # ------------------------------------------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
        # As LlamaRMSNorm: in float32, then back to the activations' dtype, then the weight (``None``: folded into
        # the next projection, float32 only: x * rsqrt(mean(x^2) + eps) in four operators, where F.rms_norm runs
        # seventeen aten calls on a CPU: 10.4 vs 13.7 us for 8 x 128 on one core, 2-4% of a 1M model's decode step).
        if w is None:
            return x * torch.linalg.vecdot(x, x).mul_(1.0 / x.shape[-1]).add_(eps).rsqrt_().unsqueeze_(-1)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    def _rope_table(self, n: int, device) -> torch.Tensor:
        # As LlamaRotaryEmbedding.forward: freqs = position * inv_freq in float32; cos + i sin of them (HF's table
        # repeats them for the second half of a head, which the paired layout does not need).
        pos = torch.arange(n, device=device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq.to(device=device, dtype=torch.float32)[None, :]
        cos, sin = freqs.cos().to(self.dtype).float(), freqs.sin().to(self.dtype).float()  # the model's rounding
        return torch.complex(cos, sin)

    def _layer(self, x, li, rot, bias, start: int, n_new: int) -> torch.Tensor:
        """One decoder layer over ``n_new`` new positions (the prompts) written at cache columns
        [start, start + n_new); ``rot``: the rotation of each new position, complex [B, n_new, 1, head_dim / 2]."""
        w_in, eps_in, wqkv, bqkv, wo, bo, w_post, eps_post, wgu, wd = self.layers[li]
        B = x.shape[0]
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        h = self._rms(x, w_in, eps_in)
        qkv = self.linear(h, wqkv, bqkv).view(B, n_new, H + 2 * K, D)
        if qkv.dtype == torch.float32:  # RoPE on queries and keys at once, in place (paired layout)
            torch.view_as_complex(qkv.view(B, n_new, H + 2 * K, D // 2, 2))[:, :, :H + K].mul_(rot)
        else:
            qk = torch.view_as_complex(qkv[:, :, :H + K].float().reshape(B, n_new, H + K, D // 2, 2)) * rot
            qkv[:, :, :H + K] = torch.view_as_real(qk).reshape(B, n_new, H + K, D).to(qkv.dtype)
        qkv = qkv.transpose(1, 2)  # [B, H+2K, n, D]
        q = qkv[:, :H]
        self.cache[li][:, :, :, start:start + n_new] = qkv[:, H:].unflatten(1, (2, K)).transpose(0, 1)  # one copy
        keys, values = self.keys[li][:, :, :start + n_new], self.values[li][:, :, :start + n_new]
        # (pre-scaled queries: scale 1)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=1.0,
                                           enable_gqa=H != K).transpose(1, 2).reshape(B, n_new, H * D)
        x = x + self.linear(o, wo, bo)
        h = self._rms(x, w_post, eps_post)
        g, u = self.linear(h, wgu).split(self.inter, dim=-1)
        return x + self.linear(F.silu(g).mul_(u), wd)

    def _decode_layer(self, x: torch.Tensor, li: int, rot: torch.Tensor, bias: torch.Tensor, col: int) -> torch.Tensor:
        """One decoder layer for one new token per row, on 2-D activations ``x`` [B, hidden] (about half the
        operations of the general path: one copy writes the keys and values, residual additions fused into the
        products); ``rot`` complex [B, 1, head_dim / 2], ``bias`` [B, 1, 1, col + 1]."""
        w_in, eps_in, wqkv, bqkv, wo, bo, w_post, eps_post, wgu, wd = self.layers[li]
        B = x.shape[0]
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        h = self._rms(x, w_in, eps_in)
        qkv = self.linear(h, wqkv, bqkv).view(B, H + 2 * K, D)
        if qkv.dtype == torch.float32:
            torch.view_as_complex(qkv.view(B, H + 2 * K, D // 2, 2))[:, :H + K].mul_(rot)
        else:
            qk = torch.view_as_complex(qkv[:, :H + K].float().reshape(B, H + K, D // 2, 2)) * rot
            qkv[:, :H + K] = torch.view_as_real(qk).reshape(B, H + K, D).to(qkv.dtype)
        self.cache[li].select(3, col).copy_(qkv[:, H:].view(B, 2, K, D).transpose(0, 1))
        # two batched products; query heads grouped by their KV head (GQA); queries pre-scaled by head_dim**-0.5
        scores = torch.matmul(qkv[:, :H].view(B, K, H // K, D), self.keys[li][:, :, :col + 1].transpose(-1, -2))
        if scores.dtype == torch.float32:
            probs = torch.softmax(scores.add_(bias), dim=-1)
        else:
            probs = torch.softmax(scores.float() + bias.float(), dim=-1).to(qkv.dtype)
        o = torch.matmul(probs, self.values[li][:, :, :col + 1]).view(B, H * D)
        x = self._linear_add(x, o, wo, bo)
        h = self._rms(x, w_post, eps_post)
        g, u = self.linear(h, wgu).split(self.inter, dim=-1)
        return self._linear_add(x, F.silu(g).mul_(u), wd, None)

    def _linear_add(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x + a w^T (+ b) for 2-D x and a, in one product where the library fuses the addition."""
        if b is not None:
            return x + self.linear(a, w, b)
        if self.linear is _linear_t:
            return torch.addmm(x, a, w)
        return torch.ops.mkldnn._linear_pointwise.binary(a, x, w, None, "add")

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        return self.linear(self._rms(x_last, self.norm_w, self.norm_eps), self.head_w, self.head_b).float()

    # ------------------------------------------------------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new: int) -> torch.Tensor:
        """Run the left-padded prompts ``ids``/``mask`` [B, W]; allocate the cache for ``max_new`` more tokens.

        Returns the float32 logits of the next token [B, V]."""
        B, W = ids.shape
        dev = ids.device
        self.width, self.total = W, W + max_new
        self._set_cache(torch.empty((len(self.layers), 2, B, self.n_kv, self.total, self.head_dim),
                                    dtype=self.dtype, device=dev))
        self.rot = self._rope_table(self.total, dev)
        # Additive key bias for every cache column: 0 for real tokens, -inf for padding (and for finished rows).
        self.key_bias = torch.zeros((B, self.total), dtype=self.dtype, device=dev)
        self.key_bias[:, :W].masked_fill_(mask == 0, float("-inf"))
        if self.library == "numpy":  # views: the torch-side updates of the key bias show in numpy
            self.np_key_bias, self.np_rot = self.key_bias.numpy(), self.rot.numpy()
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        rot = self.rot[positions][:, :, None]  # [B, W, 1, D/2]
        causal = torch.ones((W, W), dtype=torch.bool, device=dev).tril()
        allowed = causal[None] & (mask[:, None, :] != 0)
        allowed |= torch.eye(W, dtype=torch.bool, device=dev)[None]  # padding queries see themselves (no NaN)
        bias = torch.zeros((B, 1, W, W), dtype=self.dtype, device=dev).masked_fill_(~allowed[:, None], float("-inf"))
        self.step_idx = 0
        if self.library == "numpy":
            return torch.from_numpy(self._np_prefill(ids.numpy(), positions.numpy(), bias.numpy()))
        x = F.embedding(ids, self.embed)
        for li in range(len(self.layers)):
            x = self._layer(x, li, rot, bias, 0, W)
        return self._logits(x[:, -1])

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (``positions`` [B]); rows with ``live`` False are masked out of later attention
        (their output is ignored). Returns the float32 logits of the next token [B, V]."""
        col = self.width + self.step_idx
        self.step_idx += 1
        if not bool(live.all()):
            self.key_bias[:, col].masked_fill_(~live, float("-inf"))
        if self.library == "numpy":
            return torch.from_numpy(self._np_decode(tokens.numpy(), positions.numpy(), col))
        bias = self.key_bias[:, None, None, :col + 1]
        rot = self.rot[positions][:, None]  # [B, 1, D/2]
        x = F.embedding(tokens, self.embed)  # [B, hidden]
        for li in range(len(self.layers)):
            x = self._decode_layer(x, li, rot, bias, col)
        return self._logits(x)

    def _np_prefill(self, ids: np.ndarray, positions: np.ndarray, bias: np.ndarray) -> np.ndarray:
        """:meth:`prefill`'s layers in numpy (as :meth:`_layer`; the cache and rotary table as in
        :meth:`_np_decode`): the prompts ``ids`` [B, W] at ``positions``, attention ``bias`` [B, 1, W, W]. The last
        layer's output projection and MLP run for the last position only, the one whose logits are returned."""
        B, W = ids.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        G = H // K
        rot = self.np_rot[positions.reshape(-1)][:, None, :]  # [B W, 1, D/2]
        bias = bias[:, :, None]  # [B, 1, 1, W, W]
        x = self.np_embed[ids.reshape(-1)]  # [B W, hidden]
        last = len(self.np_layers) - 1
        with np.errstate(over="ignore"):  # the SiLU's exp(-g), as in _np_decode
            for li, (eps_in, wqkv, bqkv, wo, bo, eps_post, wgu, wd) in enumerate(self.np_layers):
                qkv = _np_mm(_np_rms(x, eps_in), wqkv)
                if bqkv is not None:
                    qkv += bqkv
                qkv.view(np.complex64).reshape(B * W, H + 2 * K, D // 2)[:, :H + K] *= rot  # RoPE on q and k
                qkv = qkv.reshape(B, W, H + 2 * K, D)
                kv = qkv[:, :, H:].reshape(B, W, 2, K, D).transpose(2, 0, 3, 1, 4)  # [2, B, K, W, D]
                self.np_cache[li, :, :, :, :W] = kv
                q = qkv[:, :, :H].reshape(B, W, K, G, D).transpose(0, 2, 3, 1, 4)  # [B, K, G, W, D]
                s = np.matmul(q, kv[0][:, :, None].swapaxes(-1, -2))  # [B, K, G, W, W] (pre-scaled queries)
                s += bias
                o = np.matmul(_np_softmax_(s), kv[1][:, :, None])  # [B, K, G, W, D]
                if li == last:  # only the last position's output is needed from here on
                    o, x = o[:, :, :, -1:], x.reshape(B, W, -1)[:, -1]
                o = o.transpose(0, 3, 1, 2, 4).reshape(len(x), H * D)
                x = x + _np_mm(o, wo)
                if bo is not None:
                    x += bo
                self._np_mlp(x, eps_post, wgu, wd)
        return self._np_logits(x)

    def _np_decode(self, tokens: np.ndarray, positions: np.ndarray, col: int) -> np.ndarray:
        """:meth:`decode`'s step in numpy (float32, folded norms, paired RoPE layout: the same function as
        ``_decode_layer``), on numpy views of the torch cache, key bias and rotary table."""
        B = len(tokens)
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        rot = self.np_rot[positions][:, None, :]  # complex64 [B, 1, D/2]
        bias = self.np_key_bias[:, None, None, :col + 1]  # [B, 1, 1, col + 1]
        x = self.np_embed[tokens]  # [B, hidden], a copy
        with np.errstate(over="ignore"):  # exp(-g) of the SiLU overflows to inf for g < -88: g / inf = -0, exact
            for li, (eps_in, wqkv, bqkv, wo, bo, eps_post, wgu, wd) in enumerate(self.np_layers):
                qkv = _np_mm(_np_rms(x, eps_in), wqkv)
                if bqkv is not None:
                    qkv += bqkv
                qkv.view(np.complex64).reshape(B, H + 2 * K, D // 2)[:, :H + K] *= rot  # RoPE on q and k
                qkv = qkv.reshape(B, H + 2 * K, D)
                self.np_cache[li, :, :, :, col] = qkv[:, H:].reshape(B, 2, K, D).transpose(1, 0, 2, 3)
                keys, values = self.np_cache[li, 0, :, :, :col + 1], self.np_cache[li, 1, :, :, :col + 1]
                s = np.matmul(qkv[:, :H].reshape(B, K, H // K, D), keys.swapaxes(-1, -2))  # pre-scaled queries
                s += bias
                o = np.matmul(_np_softmax_(s), values).reshape(B, H * D)
                x += _np_mm(o, wo)
                if bo is not None:
                    x += bo
                self._np_mlp(x, eps_post, wgu, wd)
        return self._np_logits(x)

    def _np_mlp(self, x: np.ndarray, eps: float, wgu, wd) -> None:
        """x += SwiGLU MLP of the normed x, in place (x [rows, hidden])."""
        gu = _np_mm(_np_rms(x, eps), wgu)
        g, u = gu[:, :self.inter], gu[:, self.inter:]
        e = np.exp(-g)
        e += 1.0
        act = g / e  # SiLU: g * sigmoid(g)
        act *= u
        x += _np_mm(act, wd)

    def _np_logits(self, x: np.ndarray) -> np.ndarray:
        logits = _np_mm(_np_rms(x, self.norm_eps), self.np_head_w)
        if self.np_head_b is not None:
            logits += self.np_head_b
        return logits

    def select(self, idx: torch.Tensor) -> None:
        """Keep only rows ``idx`` of the running batch (copies the filled part of the cache)."""
        used = self.width + self.step_idx
        cache = torch.empty((len(self.layers), 2, len(idx), self.n_kv, self.total, self.head_dim),
                            dtype=self.dtype, device=self.cache.device)
        cache[..., :used, :] = self.cache[:, :, idx, :, :used, :]
        self._set_cache(cache)
        self.key_bias = self.key_bias[idx]
        if self.library == "numpy":
            self.np_key_bias = self.key_bias.numpy()

    def _set_cache(self, cache: torch.Tensor) -> None:
        """The KV cache [layers, 2, rows, kv_heads, columns, head_dim] (keys, values) and per-layer views of its
        keys and values ([rows, kv_heads, columns, head_dim], each (rows, kv_heads) block contiguous, so the
        attention's batched products read them in place), taken once instead of at every step."""
        self.cache = cache
        self.keys = [c[0] for c in cache]
        self.values = [c[1] for c in cache]
        if self.library == "numpy":
            self.np_cache = cache.numpy()


class _StaticStepper:
    """Incremental decoding with :class:`StaticDecoder` (static KV cache), the interface of
    :class:`postrl.rollout.hf.HFGenerator`'s steppers."""

    compact_below = 0.75  # a compaction copies the filled cache: do it once a quarter of the rows has finished
    can_compact = True

    def __init__(self, decoder: StaticDecoder, rows: list[list[int]], ids: torch.Tensor, mask: torch.Tensor,
                 max_new: int):
        self.cache = decoder
        # Prefill sharing: rows with the same prompt (the n samples of a prompt) run through the model once; the
        # keys and values are then copied to each of its rows (the same numbers up to the float rounding of a
        # smaller batch). 8 rows of 2 prompts, 1M model: 2.3 instead of 4.7 ms.
        index: dict[tuple[int, ...], int] = {}
        first: list[int] = []
        inverse: list[int] = []
        for i, r in enumerate(rows):
            key = tuple(r)
            if key not in index:
                index[key] = len(first)
                first.append(i)
            inverse.append(index[key])
        if len(first) == len(rows):
            self.first_logits = decoder.prefill(ids, mask, max_new)
            return
        first_t, inverse_t = torch.tensor(first, device=ids.device), torch.tensor(inverse, device=ids.device)
        self.first_logits = decoder.prefill(ids[first_t], mask[first_t], max_new)[inverse_t]
        decoder.select(inverse_t)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return self.cache.decode(tokens, positions, live)

    def select(self, idx: torch.Tensor) -> None:
        self.cache.select(idx)
