"""engine/attention.py: SDPA packed as a unit (q, k, v coded; out, logsumexp recomputed)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import freqact
from freqact import codecs, models
from freqact.engine import attention
from freqact.engine.layouts import TokenLayout, packed_nbytes


class Attend(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


def _qkv(seed=0, shape=(2, 3, 48, 16)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for _ in range(3)]


def _input_grads(model, q, k, v, codec=None, grad=None):
    for t in (q, k, v):
        t.grad = None
    if codec is None:
        out, meter = model(q, k, v), None
    else:
        with freqact.compress(model, codec) as meter:
            out = model(q, k, v)
    out.backward(grad)
    return [t.grad.clone() for t in (q, k, v)], meter


def _rel(a, b):
    num = sum(((x - y) ** 2).sum() for x, y in zip(a, b))
    return float((num / sum((y ** 2).sum() for y in b)).sqrt())


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"scale": 0.5}])
def test_exact_is_bit_identical_and_division_error_is_small(kwargs):
    q, k, v = _qkv()
    grad = torch.randn(2, 3, 48, 16, generator=torch.Generator().manual_seed(9))
    model = Attend(**kwargs)
    plain, _ = _input_grads(model, q, k, v, grad=grad)
    exact, meter = _input_grads(model, q, k, v, "exact", grad)
    assert all(torch.equal(a, b) for a, b in zip(plain, exact))
    assert meter.saved_bytes <= meter.exact_bytes
    division, meter = _input_grads(model, q, k, v, "division", grad)
    assert all(torch.isfinite(g).all() for g in division)
    # random q, k (scores of std 1-2): 1.2-1.6 at 2 bits (with the exact logsumexp: 1e8 and more)
    assert 0 < _rel(division, plain) < 2
    assert meter.by_route()["recomputed"]["count"] == 2
    fine, _ = _input_grads(model, q, k, v, codecs.get("division", bits=8), grad)
    assert _rel(fine, plain) < 0.05  # the error is the codec's: it shrinks with its step


def test_gradient_is_attention_at_the_decoded_point():
    # out and logsumexp recomputed from the decoded q, k, v: backward is exactly the gradient of
    # attention evaluated at (q_hat, k_hat, v_hat), the error model of every other route
    q, k, v = _qkv(1)
    grad = torch.randn(2, 3, 48, 16, generator=torch.Generator().manual_seed(2))
    decoded = {}
    real_decode = attention.SdpaInput.decode

    def spy(self, packed):
        x = real_decode(self, packed)
        decoded[self.role] = x.view(self.call.shapes[self.role]).detach().clone()
        return x
    attention.SdpaInput.decode = spy
    try:
        got, _ = _input_grads(Attend(is_causal=True), q, k, v, "division", grad)
    finally:
        attention.SdpaInput.decode = real_decode
    hats = [decoded[r].requires_grad_() for r in attention.ROLES]
    assert not torch.equal(hats[0], q)
    F.scaled_dot_product_attention(*hats, is_causal=True).backward(grad)
    for g, h in zip(got, hats):
        torch.testing.assert_close(g, h.grad, rtol=1e-5, atol=1e-6)


def test_bytes_are_the_packed_forms_and_nothing_for_out_and_logsumexp():
    q, k, v = _qkv()
    with freqact.compress(Attend(is_causal=True), "division") as meter:
        Attend(is_causal=True)(q, k, v)
    routes = meter.by_route()
    codec = TokenLayout(codecs.get("division"))
    assert routes["division feat/chan"]["saved_bytes"] == 3 * packed_nbytes(codec, (6, 48, 16))
    assert routes["recomputed"]["saved_bytes"] == 0
    # plain PyTorch would hold q, k, v, out (fp32) and the (N, heads, T) logsumexp
    assert meter.exact_bytes == 4 * q.numel() * 4 + 2 * 3 * 48 * 4


@pytest.mark.parametrize("case", ["math", "dropout", "small", "same-qk"])
def test_q_and_k_stay_exact_where_nothing_can_be_recomputed(case):
    q, k, v = _qkv(shape=(1, 2, 8, 8) if case == "small" else (2, 3, 48, 16))
    if case == "same-qk":
        k = q
    model = Attend(dropout_p=0.5) if case == "dropout" else Attend(is_causal=True)
    with (sdpa_kernel(SDPBackend.MATH) if case == "math" else torch.enable_grad()), \
            freqact.compress(model, "division") as meter:
        model(q, k, v)
    assert "recomputed" not in meter.by_route()
    kept = meter.by_route()["kept"]["exact_bytes"]
    assert kept >= (1 if case == "same-qk" else 2) * q.numel() * 4


def test_zoo_gpt_recomputes_every_layer_and_trains():
    torch.manual_seed(0)
    model = models.get("gpt", num_classes=64, dim=32, depth=2, heads=2, context=32)
    ids = torch.randint(0, 64, (4, 33))

    def grads(codec):
        model.zero_grad(set_to_none=True)
        with freqact.compress(model, codec) as meter:
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), meter
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    plain = torch.cat([p.grad.flatten() for p in model.parameters()])
    exact, _ = grads("exact")
    assert torch.equal(exact, plain)
    division, meter = grads("division")
    assert meter.by_route()["recomputed"]["count"] == 2 * 2  # out and logsumexp per layer
    assert float((division - plain).norm() / plain.norm()) < 2
