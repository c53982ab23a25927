"""Routes chosen by the op that saved a tensor, token layouts, and what stays exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import freqact
from freqact import codecs, kernels
from freqact.engine.layouts import TokenLayout, packed_nbytes
from freqact.kernels import reference
from freqact.kernels.format import geometry


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _routes(model, x, codec="division"):
    with freqact.compress(model, codec) as meter:
        model(x)
    return meter.by_route()


@pytest.mark.parametrize("module", [nn.GELU(), Fn(F.gelu), nn.SiLU(), Fn(F.silu), nn.Hardswish(),
                                    Fn(F.mish), Fn(F.elu), Fn(torch.sigmoid), Fn(torch.tanh)])
def test_activation_inputs_of_token_tensors_go_tile_chan_as_module_and_function(module):
    x = torch.randn(4, 64, 32, requires_grad=True)
    assert set(_routes(module, x)) == {"division tile/chan"}


def test_linear_on_a_transposed_token_view_is_compressed():
    model = nn.Linear(16, 8)
    x = torch.randn(32, 16, 256).transpose(1, 2)  # the ViT patch-embedding idiom
    with freqact.compress(model, "division") as meter:
        model(x)
    assert set(meter.by_route()) == {"division tile/chan"} and meter.ratio > 10


class _MatmulLinear(nn.Linear):
    """A Linear computing x @ W.T itself, as HF's FalconLinear does."""

    def forward(self, x):
        return x @ self.weight.T + self.bias


def test_a_linear_computing_its_own_matmul_is_routed_as_a_linear():
    # matmul's operands were kept (the rule for eager attention's q, k, v): 1.7x, not 21x
    x = torch.randn(4, 64, 64, requires_grad=True)
    routes = {}
    for cls in (nn.Linear, _MatmulLinear):
        torch.manual_seed(0)
        model = nn.Sequential(cls(64, 256), nn.GELU(), cls(256, 64))
        routes[cls] = _routes(model, x)
    assert routes[_MatmulLinear] == routes[nn.Linear]
    assert "division tile/chan" in routes[nn.Linear] and "kept" not in routes[nn.Linear]
    # q @ k^T inside an attention module (not a Linear) still keeps its operands
    assert set(_routes(Fn(lambda t: t @ t.transpose(1, 2)), x)) == {"kept"}


def test_functional_rmsnorm_and_layernorm_inputs_go_tile_tok():
    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    x = torch.randn(4, 64, 32, requires_grad=True)
    routes = _routes(Fn(rms), x)
    assert routes["division tile/tok"]["count"] == 2  # pow and mul save x: packed once
    assert routes["division tile/tok"]["saved_bytes"] < x.numel()  # one copy of x
    assert routes["kept"]["exact_bytes"] == 4 * 4 * 64  # rsqrt's (N, T, 1) statistic stays
    assert set(_routes(Fn(lambda x: F.layer_norm(x, (32,))), x)) == {"division tile/tok", "kept"}


def test_sdpa_packs_q_k_v_and_recomputes_out_and_logsumexp_with_or_without_mask():
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": torch.randn(64, 64)}):
        with freqact.compress(nn.Identity(), "division") as meter:
            F.scaled_dot_product_attention(q, k, v, **kwargs)
        routes = meter.by_route()
        assert routes["division feat/chan"]["count"] == 3, kwargs  # q, k, v
        assert routes["recomputed"]["count"] == 2 and routes["recomputed"]["saved_bytes"] == 0
        assert set(routes) <= {"division feat/chan", "recomputed", "kept"}


def test_softmax_probabilities_compressed_unless_masked():
    s = torch.randn(8, 64, 64, requires_grad=True)
    assert set(_routes(Fn(lambda s: s.softmax(-1)), s)) == {"division feat/chan"}
    masked = s.masked_fill(torch.ones(64, 64).triu(1).bool(), float("-inf"))
    assert set(_routes(Fn(lambda s: s.softmax(-1)), masked)) == {"kept"}


def test_multihead_attention_compresses_projections_and_probabilities():
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    x = torch.randn(4, 64, 32, requires_grad=True)
    routes = _routes(Fn(lambda x: mha(x, x, x)[0]), x)
    assert routes["division tile/chan"]["count"] >= 2  # the projections' inputs
    assert routes["division feat/chan"]["count"] >= 1  # the probabilities


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 8, 8, requires_grad=True),  # tiny: 256 elements
    lambda: torch.randn(2, 4096, 1, 1, requires_grad=True),  # 1x1 maps: packed 7 B > 4 B
])
def test_tiny_and_not_smaller_tensors_are_kept(make):
    assert set(_routes(nn.GELU(), make())) == {"kept"}


def test_exact_is_bit_identical_on_the_new_routes():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                       activation="gelu")
    x = torch.randn(4, 64, 32, requires_grad=True)
    model(x).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with freqact.compress(model, "exact") as meter:
        out = model(x)
    out.square().mean().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    assert meter.saved_bytes <= meter.exact_bytes


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_feat_chan_bytes_equal_the_reference_on_the_two_views(backend):
    x = torch.randn(3, 20, 24)
    codec = TokenLayout(codecs.get("division", block=8, bits=2, backend=backend))
    noise = torch.rand(3, 24, 20)
    packed = codec.encode(x, noise)
    lfc = reference.lfc_encode(x, geometry(x.shape, 8))
    assert torch.equal(packed.lfc.lfc.view(torch.int16), lfc.view(torch.int16))
    h = x - torch.repeat_interleave(lfc.float(), 8, dim=-1)[..., :24]
    ref = kernels.quantize_encode(h.transpose(1, 2).contiguous(), 2, noise, backend="torch")
    for part in ("lo", "step", "codes"):
        assert torch.equal(getattr(packed.quant, part), getattr(ref, part)), part
    assert packed.nbytes == packed_nbytes(codec, tuple(x.shape))
    y = codec.decode(packed)
    assert y.shape == x.shape and (y - x).abs().max() < (x.amax() - x.amin())


def test_channels_last_grids_and_windows_get_64_element_blocks():
    # ConvNeXt's (N, H, W, C) Linear input: 8 x 8 patches per channel (the CNN map rule);
    # Swin's 4 x 4 windows (N * nW, 16, C): tiles, four windows per per-channel statistics.
    lin = nn.Linear(32, 32)
    grid = torch.randn(2, 16, 16, 32, requires_grad=True)
    codec = TokenLayout(codecs.get("division"), "grid64", "chan")
    routes = _routes(lin, grid)
    assert routes["division grid64/chan"]["saved_bytes"] == packed_nbytes(codec, (2, 16, 16, 32))
    windows = torch.randn(64, 16, 32, requires_grad=True)
    routes = _routes(lin, windows)
    tiles = TokenLayout(codecs.get("division"), "tile", "chan")
    assert routes["division tile/chan"]["saved_bytes"] == packed_nbytes(tiles, (16, 64, 32))
    assert windows.numel() * 4 / routes["division tile/chan"]["saved_bytes"] > 10


def test_layer_scale_on_a_channels_last_grid_reads_tokens():
    lin = nn.Linear(32, 32)
    scale = nn.Parameter(torch.ones(32))
    model = Fn(lambda x: lin(x) * scale)
    routes = _routes(model, torch.randn(2, 8, 8, 32, requires_grad=True))
    assert "division tile/tok" in routes and "division" not in routes


def test_eager_attention_probabilities_are_packed_once_through_matmul():
    s = torch.randn(4, 2, 64, 64, requires_grad=True)
    v = torch.randn(4, 2, 64, 16, requires_grad=True)

    def eager(s):
        return torch.matmul(F.dropout(s.softmax(-1), p=0.0, training=True), v)
    routes = _routes(Fn(eager), s)
    codec = TokenLayout(codecs.get("division"))
    assert routes["division feat/chan"]["count"] == 2  # softmax's save and matmul's view
    assert routes["kept"]["count"] == 1  # v
    assert routes["division feat/chan"]["saved_bytes"] == packed_nbytes(codec, (8, 64, 64))
