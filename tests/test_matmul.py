"""oneDNN linear layers (postrl.accel.matmul): the same function and gradients as torch's, on any thread count."""

import pytest
import torch
import torch.nn.functional as F

from postrl.accel import matmul
from postrl.accel.matmul import OneDNNLinear, onednn_linear, use_onednn

pytestmark = pytest.mark.skipif(not matmul.onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(7, 16), (3, 5, 16), (2, 0, 16)])
def test_forward_and_gradients_equal_torch(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(24, 16, generator=g, requires_grad=True)
    b = torch.randn(24, generator=g, requires_grad=True) if bias else None
    gy = torch.randn(*shape[:-1], 24, generator=g)
    y = onednn_linear(x, w, b)
    grads = torch.autograd.grad((y * gy).sum(), [x, w] + ([b] if bias else []), allow_unused=True)
    y_ref = F.linear(x, w, b)
    ref = torch.autograd.grad((y_ref * gy).sum(), [x, w] + ([b] if bias else []), allow_unused=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(grads, ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-4)


def test_double_backward_through_a_onednn_layer():
    """The sharpness diagnostic differentiates a gradient: the backward then runs torch's differentiable products."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(4, 8, generator=g, requires_grad=True)
    v = torch.randn(4, 8, generator=g)

    def hvp(fn):
        loss = fn(x, w).tanh().pow(2).sum()
        (gw,) = torch.autograd.grad(loss, w, create_graph=True)
        (hv,) = torch.autograd.grad((gw * v).sum(), w)
        return hv

    torch.testing.assert_close(hvp(onednn_linear), hvp(F.linear), rtol=1e-5, atol=1e-5)


def test_bitwise_identical_on_one_and_two_threads():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(296, 128, generator=g, requires_grad=True)
    w = torch.randn(480, 128, generator=g, requires_grad=True)
    old = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = onednn_linear(x, w)
            outs.append((y.detach(), *torch.autograd.grad(y.square().sum(), [x, w])))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_use_onednn_switches_layers_and_keeps_the_state_dict(tmp_path):
    from transformers import AutoModelForCausalLM

    from postrl.models.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    model = build_model(tok, size="nano", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    ref = model(ids).logits
    n = use_onednn(model)
    assert n == sum(isinstance(m, torch.nn.Linear) for m in model.modules()) > 0
    assert all(type(m) is OneDNNLinear for m in model.modules() if isinstance(m, torch.nn.Linear))
    torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
    assert model.state_dict().keys() == before.keys()
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(type(m) is torch.nn.Linear for m in again.modules() if isinstance(m, torch.nn.Linear))
    assert all(torch.equal(again.state_dict()[k], v) for k, v in before.items() if k in again.state_dict())
    assert use_onednn(model, False) == n
    assert not any(type(m) is OneDNNLinear for m in model.modules())


def test_choose_respects_the_setting(monkeypatch):
    from postrl.models.tiny import build_model, build_tokenizer

    model = build_model(build_tokenizer(), size="nano", seed=0)
    assert matmul.choose("torch", model) == "torch"
    assert matmul.choose("onednn", model) == "onednn"
    for vendor, avx512, want in (("AuthenticAMD", True, "onednn"), ("AuthenticAMD", False, "torch"),
                                 ("GenuineIntel", True, "torch"), ("", False, "torch")):
        monkeypatch.setattr(matmul, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(matmul, "cpu_has_avx512", lambda a=avx512: a)
        assert matmul.choose("auto", model) == want  # a rule: every run and process chooses alike
    assert matmul.choose("onednn", model.to(torch.bfloat16)) == "torch"  # float32 layers only
