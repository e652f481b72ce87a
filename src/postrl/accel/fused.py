"""A Llama-family model's training forward and backward written out by hand, for tiny models on a CPU.

The Hugging Face forward of a Llama layer runs about 40 operators (RMSNorm alone six, RoPE a dozen) and autograd
as many nodes in the backward; for a tiny model each costs more in dispatch, allocation and memory traffic than
it computes. :func:`fused_completion_logits` computes the same function, the logits of ``model([prompt;
completion])`` that predict the completion tokens, as one autograd node whose backward is the chain rule written
out, with fewer operators:

* q, k and v in one product (``[Wq; Wk; Wv]``), gate and up in one (``[Wg; Wu]``), residual additions in place;
* RMSNorm ``w * x / sqrt(mean(x^2) + eps)`` as a row scale and a weight, its backward
  ``dx = r (dxn - xn mean(dxn xn))`` with ``xn = x r``, ``dw = sum_rows(dh xn)``;
* RoPE as one complex multiply on pairs of query/key dimensions (``x_i + i x_{i+D/2}`` times ``cos + i sin``:
  HF's ``q cos + rotate_half(q) sin``), the query rows of ``Wq``/``Wk`` permuted to make the pairs adjacent (the
  attention's dot products do not change under the same permutation of q and k), its backward the conjugate
  multiply; the attention's ``D**-0.5`` folded into the query rotation;
* attention as two batched products and a softmax, grouped-query heads as groups of rows of one product, its
  backward ``ds = p (dp - sum(dp p))``;
* SwiGLU ``silu(g) u``, ``silu'(g) = s (1 + g (1 - s))`` with ``s = sigmoid(g)`` (torch's ``silu_backward``);
* only the rows that predict a completion token through the final norm and the LM head.

Measured on an AMD EPYC Zen 5 VM (2 cores, oneDNN products), the 1M benchmark model, 8 rows of 12 + 32 tokens:
forward + backward 14.4 instead of 16.3 ms alone; inside a GRPO update 0.4-0.9 ms of 19 (2-4%). A 20M model,
bound by its products, gains nothing measurable from the fusion and keeps more memory: the update uses it for
models up to ``FUSED_MAX_HIDDEN`` (:func:`applies`). (Sharing each distinct prompt among its
completions inside it was deleted: ``postrl bench --quick`` side by side measured no gain at 1M or 20M.) The gradients are those of the model's own forward up to float
rounding (``tests/test_models.py`` compares
every parameter's gradient with autograd through the Hugging Face model). It is used (``accel.fused``) for models
:class:`postrl.accel.decoder.StaticDecoder` supports, in float32 on a CPU, without attention dropout, gradient
checkpointing or a wrapper (DDP's gradient hooks expect its own forward). Its backward is not differentiable
again: the sharpness diagnostic, which differentiates a gradient, uses the model's forward.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from postrl.accel.matmul import OneDNNLinear, _mm, onednn_grad_input, onednn_grad_weight
from postrl.accel.decoder import StaticDecoder, _LINEAR


_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Spec, or None when not supported


def spec_for(model) -> _Spec | None:
    """The :class:`_Spec` of ``model`` when :func:`fused_completion_logits` reproduces its forward now, else None. The
    structural checks run once per model (about 0.2 ms); dropout, checkpointing, dtype and device every call."""
    if not isinstance(model, torch.nn.Module):
        return None
    if model not in _SPECS:
        _SPECS[model] = _Spec(model) if StaticDecoder.supports(model) else None
    spec = _SPECS[model]
    if spec is None:
        return None
    if model.training and float(getattr(model.config, "attention_dropout", 0.0) or 0.0) != 0.0:
        return None
    # activation checkpointing (saving memory) is a flag on the decoder layers; the fused function keeps every
    # activation, so a model with it takes its own forward
    if any(getattr(m, "gradient_checkpointing", False) for m in (model.model, *spec.layers)):
        return None
    p = spec.first_param
    if p.dtype != torch.float32 or p.device.type != "cpu" or not spec.same_params(model):
        return None
    return spec


def supports(model) -> bool:
    """Whether :func:`fused_completion_logits` reproduces ``model``'s forward (see the module docstring)."""
    return spec_for(model) is not None


# The fused function writes the attention out as products and a softmax over every (query, key) pair, read again in
# the backward; the model's own forward runs torch's fused attention kernel, which does not keep them. Measured on a
# 2-core Zen 5, 32 rows, 12-token prompts: the fused update 1.14x as fast at 140 positions (1M model), 0.91x at 268
# (1M) and 0.76x at 268 (20M). Above this many positions the model's own forward runs.
FUSED_MAX_POSITIONS = 192
# Models up to this hidden size only: the fusion saves operators, which is what a tiny model's step is made of. At
# hidden size 512 the step is bound by its products: ``postrl bench --quick`` side by side (three runs, 8 rows of
# 12 + 32 tokens) measured the 20M model's step 0.86x, 0.95x and 1.16x as fast with it (median 0.95x), its peak
# RSS 70 MiB higher (the attention scores kept for the backward); the 1M model's (hidden 128) 1.16x, 0.94x, 1.09x,
# update 1.23x.
FUSED_MAX_HIDDEN = 256


def applies(model, P: int, T: int) -> bool:
    """Whether the update runs :func:`fused_completion_logits` for ``P`` prompt and ``T`` completion positions: a
    model it supports with a hidden size up to ``FUSED_MAX_HIDDEN``, at most ``FUSED_MAX_POSITIONS`` positions."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None) or 0
    return 0 < P and 0 < T and P + T <= FUSED_MAX_POSITIONS and hidden <= FUSED_MAX_HIDDEN and supports(model)


def _products(onednn: bool):
    """(x W^T, g W, g^T x) for x [M, in], W [out, in], g [M, out]: oneDNN's (as the oneDNN linear layers compute
    them, postrl.accel.matmul) or torch's (MKL's)."""
    if onednn:
        return _mm, onednn_grad_input, onednn_grad_weight
    return (lambda x, w: x @ w.t()), (lambda g, w: g @ w), (lambda g, x: g.t() @ x)


def _rms(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * r, r) with r = 1 / sqrt(mean(x^2) + eps) over the last axis of a 2-D x."""
    r = torch.linalg.vecdot(x, x).mul_(1.0 / x.shape[-1]).add_(eps).rsqrt_().unsqueeze_(-1)
    return x * r, r


def _rms_back(dxn: torch.Tensor, xn: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """d/dx of xn = x r(x), given dL/dxn: r (dxn - xn mean(dxn xn))."""
    c = torch.linalg.vecdot(dxn, xn).mul_(1.0 / xn.shape[-1]).unsqueeze_(-1)
    return (dxn - xn * c).mul_(r)


class _Spec:
    """What the fused function needs of the model besides its parameters."""

    def __init__(self, model):
        cfg = model.config
        base = model.model
        self.H = cfg.num_attention_heads
        self.K = getattr(cfg, "num_key_value_heads", None) or self.H
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.layers = list(base.layers)
        self.n_layers = len(self.layers)
        a = self.layers[0].self_attn
        self.qkv_bias = a.q_proj.bias is not None
        self.o_bias = a.o_proj.bias is not None
        head = model.get_output_embeddings()
        self.tied = head.weight is base.embed_tokens.weight
        self.head_bias = head.bias is not None
        self.eps = [(layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon)
                    for layer in self.layers]
        self.norm_eps = base.norm.variance_epsilon
        D = self.D
        pair = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=1).reshape(-1)
        self.q_perm = (torch.arange(self.H)[:, None] * D + pair).reshape(-1)
        self.k_perm = (torch.arange(self.K)[:, None] * D + pair).reshape(-1)
        self.q_inv = torch.argsort(self.q_perm)
        self.k_inv = torch.argsort(self.k_perm)
        self.scaling = D ** -0.5
        self.rotary = base.rotary_emb
        self.onednn = any(type(m) is OneDNNLinear for m in self.layers[0].modules())
        self._params = self._collect(model)
        self.first_param = self._params[0]

    def same_params(self, model) -> bool:
        """Whether the model still holds the parameters (and linear layer classes) this spec was made from."""
        if list(model.model.layers) != self.layers or any(
                type(lin) not in _LINEAR for layer in self.layers
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                            layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)):
            return False
        params = self._collect(model)
        return len(params) == len(self._params) and all(a is b for a, b in zip(params, self._params)) \
            and any(type(m) is OneDNNLinear for m in self.layers[0].modules()) == self.onednn

    def params(self) -> list[torch.Tensor]:
        """The parameters in the fused function's order: embedding, per layer (input norm, q, k, v, [q, k, v
        biases], o, [o bias], post norm, gate, up, down), final norm, [untied head weight], [head bias]."""
        return self._params

    def _collect(self, model) -> list[torch.Tensor]:
        base = model.model
        out = [base.embed_tokens.weight]
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            out += [layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]
            if self.qkv_bias:
                out += [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            out.append(a.o_proj.weight)
            if self.o_bias:
                out.append(a.o_proj.bias)
            out += [layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
        self._norm_pos = len(out)
        out.append(base.norm.weight)
        head = model.get_output_embeddings()
        if not self.tied:
            out.append(head.weight)
        if self.head_bias:
            out.append(head.bias)
        return out


def _causal_bias(real: torch.Tensor) -> torch.Tensor:
    """Additive attention bias [B, 1, 1, L, L] for rows of ``L`` positions whose keys are ``real`` [B, L]: 0 where
    a query may attend (an earlier or the same real position), -inf elsewhere; a padding query attends to itself
    (finite, never read)."""
    L = real.shape[1]
    allowed = torch.ones((L, L), dtype=torch.bool).tril() & real[:, None, :]
    allowed |= torch.eye(L, dtype=torch.bool)
    return torch.zeros((real.shape[0], 1, 1, L, L)).masked_fill_(~allowed[:, None, None], float("-inf"))


class _Layout:
    """Where the packed token rows come from, and what each attends to: rows ``[n L, (n + 1) L)`` are row n's prompt
    (``P`` positions, left-padded) and completion (``T`` positions), ``L = P + T``, with causal attention. ``keep``
    [N T]: the packed row whose hidden state predicts each completion token (the prompt's last position, then the
    completion's positions ``0..T-2``)."""

    def __init__(self, prompt_mask: torch.Tensor, T: int):
        self.N, self.P = prompt_mask.shape
        self.T = T
        N, L = self.N, self.P + T
        self.M = N * L
        self.keep = (torch.arange(N)[:, None] * L + self.P - 1 + torch.arange(T)).reshape(-1)
        self.bias = _causal_bias(torch.cat([prompt_mask.bool(), torch.ones((N, T), dtype=torch.bool)], dim=1))

    def positions(self, prompt_mask: torch.Tensor) -> torch.Tensor:
        """The position id of every packed row [M], as the one forward over [prompt; completion] numbers them."""
        attn = torch.cat([prompt_mask, torch.ones((self.N, self.T), dtype=prompt_mask.dtype)], dim=1)
        return (attn.cumsum(-1) - 1).clamp(min=0).reshape(-1)

    def attend(self, qkv: torch.Tensor, K: int, G: int) -> tuple[torch.Tensor, tuple]:
        """Attention of the packed rows: (o [M, H D], what :meth:`attend_back` needs) from qkv [M, H + 2K, D],
        queries and keys rotated."""
        H, D = K * G, qkv.shape[-1]
        o = torch.empty((self.M, H * D), dtype=qkv.dtype)
        N, L = self.N, self.P + self.T
        qkv4 = qkv.view(N, L, H + 2 * K, D)
        q = _to_heads(qkv4[:, :, :H], N, L, K, G, D)
        k, v = qkv4[:, :, H:H + K].transpose(1, 2), qkv4[:, :, H + K:].transpose(1, 2)  # [N, K, L, D]
        p, o4 = _attention(q, k, v, self.bias)
        _from_heads(o4, o, N, L, K, G, D)
        return o, (q, k, v, p)

    def attend_back(self, do: torch.Tensor, saved: tuple, K: int, G: int) -> torch.Tensor:
        """dL/d[q k v] [M, H + 2K, D] (queries and keys still rotated) given dL/do [M, H D]."""
        H = K * G
        D = do.shape[-1] // H
        N, L = self.N, self.P + self.T
        dqkv = torch.empty((self.M, H + 2 * K, D), dtype=do.dtype)  # [dq dk dv], written in place
        dq, dk, dv = _attention_back(_to_heads(do, N, L, K, G, D), *saved)
        _from_heads(dq, dqkv[:, :H], N, L, K, G, D)
        rows = dqkv.view(N, L, H + 2 * K, D)
        rows[:, :, H:H + K] = dk.transpose(1, 2)
        rows[:, :, H + K:] = dv.transpose(1, 2)
        return dqkv


def _to_heads(x: torch.Tensor, B: int, L: int, K: int, G: int, D: int) -> torch.Tensor:
    """[B, L, K G, D] query rows -> [B, K, G L, D]: the G query heads of a KV head as rows of one product."""
    return x.reshape(B, L, K, G, D).permute(0, 2, 3, 1, 4).reshape(B, K, G * L, D)


def _from_heads(o: torch.Tensor, out: torch.Tensor, B: int, L: int, K: int, G: int, D: int) -> None:
    """Inverse of :func:`_to_heads`, written into ``out`` (a [B L, K G D] block of rows)."""
    out.view(B, L, K, G, D).copy_(o.view(B, K, G, L, D).permute(0, 3, 1, 2, 4))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor):
    """softmax(q k^T + bias) v for q [B, K, G L, D], k, v [B, K, S, D], bias [B, 1, 1, L, S]: (p, o)."""
    B, K, GL, _ = q.shape
    L, S = bias.shape[-2:]
    s = torch.matmul(q, k.transpose(-1, -2)).view(B, K, GL // L, L, S)
    s += bias
    p = torch.softmax(s, dim=-1).view(B, K, GL, S)
    return p, torch.matmul(p, v)


def _attention_back(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: torch.Tensor):
    """(dq, dk, dv) of :func:`_attention` given dL/do; the G query groups of a KV head sum into dk and dv."""
    dp = torch.matmul(do, v.transpose(-1, -2))
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = dp.sub_(torch.linalg.vecdot(dp, p).unsqueeze_(-1)).mul_(p)  # softmax backward
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, grad: bool, ids: torch.Tensor, lay: _Layout, rot: torch.Tensor, *params):
        fwd, _, _ = _products(spec.onednn)
        N, T, M = lay.N, lay.T, lay.M
        H, K, D = spec.H, spec.K, spec.D
        G = H // K
        it = iter(params)
        embed = next(it)
        x = F.embedding(ids, embed)  # [M, hidden]
        saved = []
        for li in range(spec.n_layers):
            w_in, wq, wk, wv = next(it), next(it), next(it), next(it)
            bqkv = torch.cat([next(it)[spec.q_perm], next(it)[spec.k_perm], next(it)]) if spec.qkv_bias else None
            wo = next(it)
            bo = next(it) if spec.o_bias else None
            w_post, wg, wu, wd = next(it), next(it), next(it), next(it)
            eps_in, eps_post = spec.eps[li]
            wqkv = torch.cat([wq[spec.q_perm], wk[spec.k_perm], wv])
            xn1, r1 = _rms(x, eps_in)
            h1 = xn1 * w_in
            qkv = fwd(h1, wqkv)
            if bqkv is not None:
                qkv += bqkv
            qkv = qkv.view(M, H + 2 * K, D)
            # RoPE in place (queries also scaled by D**-0.5)
            torch.view_as_complex(qkv[:, :H + K].view(M, H + K, D // 2, 2)).mul_(rot)
            o, att = lay.attend(qkv, K, G)
            x1 = fwd(o, wo)
            x1 += x
            if bo is not None:
                x1 += bo
            xn2, r2 = _rms(x1, eps_post)
            h2 = xn2 * w_post
            wgu = torch.cat([wg, wu])
            gu = fwd(h2, wgu)
            g, u = gu.split(wg.shape[0], dim=-1)
            a_g = F.silu(g)
            a = a_g * u
            x2 = fwd(a, wd)
            x2 += x1
            if grad:  # (a forward without a graph keeps nothing)
                saved.append((xn1, r1, h1, att, o, xn2, r2, h2, g, u, a_g, a, wqkv, wgu))
            x = x2
        w_norm = next(it)
        head_w = embed if spec.tied else next(it)
        head_b = next(it) if spec.head_bias else None
        xl = x[lay.keep]  # [N T, hidden]: the rows that predict the completion tokens
        xnf, rf = _rms(xl, spec.norm_eps)
        hf = xnf * w_norm
        logits = fwd(hf, head_w)
        if head_b is not None:
            logits += head_b
        ctx.spec, ctx.lay = spec, lay
        if grad:
            ctx.saved = saved
            ctx.final = (xnf, rf, hf)
            ctx.save_for_backward(ids, rot, *params)
        return logits.view(N, T, -1)

    @staticmethod
    def backward(ctx, dlogits: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("the fused training forward (accel.fused) has no double backward; run the model's "
                               "own forward where a gradient is differentiated")
        spec, lay = ctx.spec, ctx.lay
        _, dxp, dwp = _products(spec.onednn)
        N, T, M = lay.N, lay.T, lay.M
        H, K, D = spec.H, spec.K, spec.D
        G = H // K
        ids, rot, *params = ctx.saved_tensors
        grads: list[torch.Tensor | None] = [None] * len(params)
        # parameter positions, in the order of _Spec.params
        per_layer = 4 + (3 if spec.qkv_bias else 0) + 1 + (1 if spec.o_bias else 0) + 4
        pos_norm = 1 + per_layer * spec.n_layers
        pos_head = pos_norm + 1 if not spec.tied else 0
        pos_hb = pos_norm + 1 + (0 if spec.tied else 1)
        embed = params[0]
        head_w = embed if spec.tied else params[pos_head]
        xnf, rf, hf = ctx.final
        dlog = dlogits.reshape(N * T, -1)
        d_head = dwp(dlog, hf)
        if spec.head_bias:
            grads[pos_hb] = dlog.sum(0)
        dhf = dxp(dlog, head_w)
        grads[pos_norm] = (dhf * xnf).sum(0)
        dxl = _rms_back(dhf * params[pos_norm], xnf, rf)
        dx = torch.zeros((M, dxl.shape[-1]), dtype=dxl.dtype).index_add_(0, lay.keep, dxl)
        for li in reversed(range(spec.n_layers)):
            base = 1 + per_layer * li
            j = base
            w_in = params[j]
            j += 4
            if spec.qkv_bias:
                j += 3
            wo = params[j]
            j += 1
            if spec.o_bias:
                j += 1
            w_post, wg, wd = params[j], params[j + 1], params[j + 3]
            xn1, r1, h1, att, o, xn2, r2, h2, g, u, a_g, a, wqkv, wgu = ctx.saved[li]
            # MLP: x2 = x1 + (silu(g) u) Wd^T, [g u] = h2 [Wg; Wu]^T, h2 = w_post * rms(x1)
            grads[j + 3] = dwp(dx, a)
            da = dxp(dx, wd)
            inter = wg.shape[0]
            dgu = torch.empty((M, 2 * inter), dtype=da.dtype)  # [dg du], written in place
            torch.mul(da, a_g, out=dgu[:, inter:])
            torch.ops.aten.silu_backward.grad_input(da.mul_(u), g, grad_input=dgu[:, :inter])  # * silu'(g)
            dwgu = dwp(dgu, h2)
            grads[j + 1], grads[j + 2] = dwgu[:inter], dwgu[inter:]
            dh2 = dxp(dgu, wgu)
            grads[j] = (dh2 * xn2).sum(0)
            dx1 = _rms_back(dh2.mul_(w_post), xn2, r2).add_(dx)
            # attention: x1 = x + o Wo^T (+ bo)
            jo = j - 1 - (1 if spec.o_bias else 0)
            grads[jo] = dwp(dx1, o)
            if spec.o_bias:
                grads[jo + 1] = dx1.sum(0)
            do = dxp(dx1, wo)
            dqkv = lay.attend_back(do, att, K, G)
            dqk = torch.view_as_complex(dqkv[:, :H + K].view(M, H + K, D // 2, 2))
            dqk.mul_(rot.conj())  # RoPE backward
            dqkv = dqkv.view(M, (H + 2 * K) * D)
            dwqkv = dwp(dqkv, h1)
            nq, nk = H * D, K * D
            grads[base + 1] = dwqkv[:nq][spec.q_inv]
            grads[base + 2] = dwqkv[nq:nq + nk][spec.k_inv]
            grads[base + 3] = dwqkv[nq + nk:]
            if spec.qkv_bias:
                db = dqkv.sum(0)
                grads[base + 4], grads[base + 5], grads[base + 6] = db[:nq][spec.q_inv], db[nq:nq + nk][spec.k_inv], \
                    db[nq + nk:]
            dh1 = dxp(dqkv, wqkv)
            grads[base] = (dh1 * xn1).sum(0)
            dx = _rms_back(dh1.mul_(w_in), xn1, r1).add_(dx1)
        d_embed = torch.zeros_like(embed).index_add_(0, ids, dx)
        if spec.tied:
            d_embed += d_head
        else:
            grads[pos_head] = d_head
        grads[0] = d_embed
        ctx.saved = ctx.final = None
        grads = [gr if need else None for gr, need in zip(grads, ctx.needs_input_grad[5:])]
        return (None, None, None, None, None, *grads)


def fused_completion_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                            completion_ids: torch.Tensor) -> torch.Tensor:
    """The float32 logits [N, T, V] that predict each completion token, ``model(cat(prompt_ids, completion_ids),
    cat(prompt_mask, 1), positions).logits[:, P-1:P+T-1]``, for a model :func:`supports` accepts, through the
    hand-written forward and backward (module docstring). ``prompt_ids``/``prompt_mask`` [N, P] are left-padded."""
    spec = spec_for(model)
    if spec is None:
        raise ValueError("fused_completion_logits: this model is not supported (postrl.accel.fused.supports)")
    if prompt_ids.shape[1] == 0 or completion_ids.shape[1] == 0:
        raise ValueError("fused_completion_logits: needs at least one prompt and one completion position")
    T = completion_ids.shape[1]
    lay = _Layout(prompt_mask, T)
    with torch.no_grad():
        positions = lay.positions(prompt_mask)
        cos, sin = spec.rotary(torch.empty(0, dtype=torch.float32), positions[None])  # [1, M, D]: HF's own table
        half = spec.D // 2
        rot = torch.complex(cos[0, :, :half], sin[0, :, :half]).unsqueeze(1)  # [M, 1, D/2]
        scale = torch.ones(spec.H + spec.K, 1, dtype=torch.float32)
        scale[:spec.H] = spec.scaling
        rot = (rot * scale).contiguous()  # [M, H + K, D/2]: queries pre-scaled
    ids = torch.cat([prompt_ids, completion_ids], dim=1).reshape(-1)
    params = spec.params()
    grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    return _Fused.apply(spec, grad, ids, lay, rot, *params)
