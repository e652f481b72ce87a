"""A Llama-family model's training forward and backward written out by hand, for tiny models on a CPU.

The Hugging Face forward of a Llama layer runs about 40 operators (RMSNorm alone six, RoPE a dozen) and autograd
as many nodes in the backward; for a tiny model each costs more in dispatch, allocation and memory traffic than
it computes. :func:`fused_logits` computes the same function, ``model(input_ids, attention_mask,
position_ids).logits`` at the last ``keep`` positions, as one autograd node whose backward is the chain rule
written out, with fewer operators:

* q, k and v in one product (``[Wq; Wk; Wv]``), gate and up in one (``[Wg; Wu]``), residual additions in place;
* RMSNorm ``w * x / sqrt(mean(x^2) + eps)`` as a row scale and a weight, its backward
  ``dx = r (dxn - xn mean(dxn xn))`` with ``xn = x r``, ``dw = sum_rows(dh xn)``;
* RoPE as one complex multiply on pairs of query/key dimensions (``x_i + i x_{i+D/2}`` times ``cos + i sin``:
  HF's ``q cos + rotate_half(q) sin``), the query rows of ``Wq``/``Wk`` permuted to make the pairs adjacent (the
  attention's dot products do not change under the same permutation of q and k), its backward the conjugate
  multiply; the attention's ``D**-0.5`` folded into the query rotation;
* attention as two batched products and a softmax, grouped-query heads as groups of rows of one product, its
  backward ``ds = p (dp - sum(dp p))``;
* SwiGLU ``silu(g) u``, ``silu'(g) = s (1 + g (1 - s))`` with ``s = sigmoid(g)`` (torch's ``silu_backward``).

Measured on an AMD EPYC Zen 5 VM (2 cores, oneDNN products), the 1M benchmark model, 8 rows of 12 + 32 tokens:
forward + backward 14.4 instead of 16.3 ms alone; inside a GRPO update 0.4-0.9 ms of 19 (2-4%). A 20M model,
bound by its products, gains nothing measurable. The gradients are those of the model's own forward up to float
rounding (``tests/test_models.py`` compares
every parameter's gradient with autograd through the Hugging Face model). It is used (``train.fused``) for models
:class:`postrl.rollout.decoder.StaticDecoder` supports, in float32 on a CPU, without attention dropout, gradient
checkpointing or a wrapper (DDP's gradient hooks expect its own forward). Its backward is not differentiable
again: the sharpness diagnostic, which differentiates a gradient, uses the model's forward.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from postrl.models.matmul import OneDNNLinear, _mm, onednn_grad_input, onednn_grad_weight


_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Spec, or None when not supported


def spec_for(model) -> _Spec | None:
    """The :class:`_Spec` of ``model`` when :func:`fused_logits` reproduces its forward now, else None. The
    structural checks run once per model (about 0.2 ms); dropout, checkpointing, dtype and device every call."""
    if not isinstance(model, torch.nn.Module):
        return None
    if model not in _SPECS:
        from postrl.rollout.decoder import StaticDecoder

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
    """Whether :func:`fused_logits` reproduces ``model``'s forward (see the module docstring)."""
    return spec_for(model) is not None


def _products(onednn: bool):
    """(x W^T, g W, g^T x) for x [M, in], W [out, in], g [M, out]: oneDNN's (as the oneDNN linear layers compute
    them, postrl.models.matmul) or torch's (MKL's)."""
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
        from postrl.rollout.decoder import _LINEAR

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


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, grad: bool, ids: torch.Tensor, bias: torch.Tensor, rot: torch.Tensor, keep: int,
                *params):
        fwd, _, _ = _products(spec.onednn)
        N, L = ids.shape
        H, K, D = spec.H, spec.K, spec.D
        G = H // K
        M = N * L
        it = iter(params)
        embed = next(it)
        x = F.embedding(ids.reshape(-1), embed)  # [M, hidden]
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
            qkv = qkv.view(N, L, H + 2 * K, D)
            qk = torch.view_as_complex(qkv[:, :, :H + K].reshape(N, L, H + K, D // 2, 2))
            qk = qk * rot  # RoPE (queries also scaled by D**-0.5): [N, L, H + K, D/2]
            qk = torch.view_as_real(qk).reshape(N, L, H + K, D)
            q = qk[:, :, :H].reshape(N, L, K, G, D).permute(0, 2, 3, 1, 4).reshape(N, K, G * L, D)
            k = qk[:, :, H:].transpose(1, 2)  # [N, K, L, D]
            v = qkv[:, :, H + K:].transpose(1, 2)
            s = torch.matmul(q, k.transpose(-1, -2)).view(N, K, G, L, L)
            s += bias
            p = torch.softmax(s, dim=-1).view(N, K, G * L, L)
            o = torch.matmul(p, v).view(N, K, G, L, D).permute(0, 3, 1, 2, 4).reshape(M, H * D)
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
                saved.append((xn1, r1, h1, q, k, v, p, o, xn2, r2, h2, g, u, a_g, a, wqkv, wgu))
            x = x2
        w_norm = next(it)
        head_w = embed if spec.tied else next(it)
        head_b = next(it) if spec.head_bias else None
        xl = x.view(N, L, -1)[:, L - keep:].reshape(N * keep, -1)
        xnf, rf = _rms(xl, spec.norm_eps)
        hf = xnf * w_norm
        logits = fwd(hf, head_w)
        if head_b is not None:
            logits += head_b
        ctx.spec, ctx.shape, ctx.keep = spec, (N, L), keep
        if grad:
            ctx.saved = saved
            ctx.final = (xnf, rf, hf)
            ctx.save_for_backward(ids, rot, *params)
        return logits.view(N, keep, -1)

    @staticmethod
    def backward(ctx, dlogits: torch.Tensor):
        if torch.is_grad_enabled():
            raise RuntimeError("the fused training forward (train.fused) has no double backward; run the model's "
                               "own forward where a gradient is differentiated")
        spec = ctx.spec
        _, dxp, dwp = _products(spec.onednn)
        N, L = ctx.shape
        keep = ctx.keep
        H, K, D = spec.H, spec.K, spec.D
        G = H // K
        M = N * L
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
        dlog = dlogits.reshape(N * keep, -1)
        d_head = dwp(dlog, hf)
        if spec.head_bias:
            grads[pos_hb] = dlog.sum(0)
        dhf = dxp(dlog, head_w)
        grads[pos_norm] = (dhf * xnf).sum(0)
        dxl = _rms_back(dhf * params[pos_norm], xnf, rf)
        dx = torch.zeros((N, L, dxl.shape[-1]), dtype=dxl.dtype, device=dxl.device)
        dx[:, L - keep:] = dxl.view(N, keep, -1)
        dx = dx.view(M, -1)
        for li in reversed(range(spec.n_layers)):
            base = 1 + per_layer * li
            j = base
            w_in, wq, wk, wv = params[j], params[j + 1], params[j + 2], params[j + 3]
            j += 4
            if spec.qkv_bias:
                j += 3
            wo = params[j]
            j += 1
            if spec.o_bias:
                j += 1
            w_post, wg, wu, wd = params[j], params[j + 1], params[j + 2], params[j + 3]
            xn1, r1, h1, q, k, v, p, o, xn2, r2, h2, g, u, a_g, a, wqkv, wgu = ctx.saved[li]
            # MLP: x2 = x1 + (silu(g) u) Wd^T, [g u] = h2 [Wg; Wu]^T, h2 = w_post * rms(x1)
            grads[j + 3] = dwp(dx, a)
            da = dxp(dx, wd)
            inter = wg.shape[0]
            dgu = torch.empty((M, 2 * inter), dtype=da.dtype, device=da.device)  # [dg du], written in place
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
            do = dxp(dx1, wo).view(N, L, K, G, D).permute(0, 2, 3, 1, 4).reshape(N, K, G * L, D)
            dp = torch.matmul(do, v.transpose(-1, -2))
            dv = torch.matmul(p.transpose(-1, -2), do)  # [N, K, L, D]: the G query groups summed
            ds = dp.sub_(torch.linalg.vecdot(dp, p).unsqueeze_(-1)).mul_(p)  # softmax backward
            dq = torch.matmul(ds, k).view(N, K, G, L, D).permute(0, 3, 1, 2, 4).reshape(N, L, H, D)
            dk = torch.matmul(ds.transpose(-1, -2), q).transpose(1, 2)  # [N, L, K, D]
            dqkv = torch.empty((N, L, H + 2 * K, D), dtype=dq.dtype, device=dq.device)  # [dq dk dv] in place
            dqkv[:, :, :H] = dq
            dqkv[:, :, H:H + K] = dk
            dqkv[:, :, H + K:] = dv.transpose(1, 2)
            dqk = torch.view_as_complex(dqkv[:, :, :H + K].view(N, L, H + K, D // 2, 2))
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
        d_embed = torch.zeros_like(embed).index_add_(0, ids.reshape(-1), dx)
        if spec.tied:
            d_embed += d_head
        else:
            grads[pos_head] = d_head
        grads[0] = d_embed
        ctx.saved = ctx.final = None
        grads = [gr if need else None for gr, need in zip(grads, ctx.needs_input_grad[6:])]
        return (None, None, None, None, None, None, *grads)


def fused_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 keep: int) -> torch.Tensor:
    """``model(input_ids, attention_mask, position_ids, logits_to_keep=keep).logits`` (float32 [N, keep, V]) for
    a model :func:`supports` accepts, through the hand-written forward and backward (module docstring)."""
    spec = spec_for(model)
    if spec is None:
        raise ValueError("fused_logits: this model is not supported (postrl.models.fused.supports)")
    N, L = input_ids.shape
    with torch.no_grad():
        cos, sin = spec.rotary(torch.empty(0, dtype=torch.float32), position_ids)  # [N, L, D]: HF's own table
        half = spec.D // 2
        rot = torch.complex(cos[..., :half], sin[..., :half]).unsqueeze(2)  # [N, L, 1, D/2]
        scale = torch.ones(spec.H + spec.K, 1, dtype=torch.float32)
        scale[:spec.H] = spec.scaling
        rot = (rot * scale).contiguous()  # [N, L, H + K, D/2]: queries pre-scaled
        real = attention_mask.bool()
        causal = torch.ones((L, L), dtype=torch.bool).tril()
        allowed = causal & real[:, None, :]
        allowed |= torch.eye(L, dtype=torch.bool)  # a padding query attends to itself: finite, never read
        bias = torch.zeros((N, 1, 1, L, L), dtype=torch.float32)
        bias.masked_fill_(~allowed[:, None, None], float("-inf"))
    params = spec.params()
    grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    return _Fused.apply(spec, grad, input_ids, bias, rot, keep, *params)
