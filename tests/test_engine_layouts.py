"""Token layouts with 64-element blocks (`engine.layouts.TokenLayout`): the format's own bytes on
the views they read, decode shapes and dtypes, unbiased round trips, bounded gradient errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from freqact import codecs, kernels
from freqact.engine.layouts import BLOCKS, STATS, TokenLayout, packed_nbytes, token_view
from freqact.kernels import cpu

LAYOUTS = [(b, s) for b in BLOCKS for s in STATS]


def _codec(blocks, stats, backend="torch"):
    return TokenLayout(codecs.get("division", block=8, bits=2, backend=backend), blocks, stats)


def _same(a, b):
    """Bit-identical packed parts (bf16 compared as bits)."""
    for part in ("lo", "step", "codes"):
        assert torch.equal(getattr(a, part).view(torch.uint8), getattr(b, part).view(torch.uint8))


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"))])
def test_grid64_chan_on_a_channels_last_grid_is_the_cnn_map_rule(backend):
    # (N, H, W, C): edge blocks on both axes; dyadic values, so that block sums are exact in
    # any order (the fused C kernels add them in another order than torch)
    x = torch.randn(2, 12, 10, 24).mul(256).round().div(256)
    noise = torch.rand(2, 24, 120)
    packed = _codec("grid64", "chan", backend).encode(x, noise)
    maps = x.permute(0, 3, 1, 2)
    ref = kernels.division_encode(maps.contiguous(), 8, 2, noise.view(2, 24, 12, 10),
                                  backend="torch")
    assert torch.equal(packed.lfc.lfc.view(torch.int16), ref.lfc.view(torch.int16))
    _same(packed.quant, ref)
    assert packed.nbytes == ref.nbytes and packed.head is None


def test_tok64_chan_is_division_with_64_token_blocks_on_the_transposed_view():
    x = torch.randn(3, 150, 16)
    noise = torch.rand(3, 16, 150)
    packed = _codec("tok64", "chan").encode(x, noise)
    ref = kernels.division_encode(x.transpose(1, 2).contiguous(), 64, 2, noise, backend="torch")
    assert torch.equal(packed.lfc.lfc.view(torch.int16), ref.lfc.view(torch.int16))
    _same(packed.quant, ref)
    assert packed.nbytes == ref.nbytes


@pytest.mark.parametrize("stats", STATS)
def test_tile_bytes_are_the_two_kernels_on_their_views(stats):
    x = torch.randn(2, 21, 20)
    packed = _codec("tile", stats).encode(x)
    lfc = kernels.lfc_encode(x.unsqueeze(1), 8)  # 8 tokens x 8 features per mean
    assert torch.equal(packed.lfc.lfc.view(torch.int16), lfc.lfc.view(torch.int16))
    h = x - kernels.division_decode(lfc).squeeze(1)
    view = h.transpose(1, 2).contiguous() if stats == "chan" else h
    noise = torch.rand(view.shape)
    _same(_codec("tile", stats).encode(x, noise).quant,
          kernels.quantize_encode(view, 2, noise, backend="torch"))


def test_class_token_is_a_map_of_its_own_and_the_patches_a_grid():
    x = torch.randn(2, 1 + 16 * 16, 12)
    torch.manual_seed(3)
    packed = _codec("grid64", "chan").encode(x)
    torch.manual_seed(3)
    head = kernels.division_encode(x[:, :1], 8, 2, backend="torch")
    patches = _codec("grid64", "chan").encode(x[:, 1:].reshape(2, 16, 16, 12))
    _same(packed.head, head)
    assert torch.equal(packed.lfc.lfc, patches.lfc.lfc)
    assert packed.lfc.lfc.shape == (2, 12, 2, 2)  # 8x8 patch blocks per channel
    assert packed.nbytes == head.nbytes + patches.nbytes


def _parts(packed):
    parts = [packed.lfc.lfc, packed.quant.lo, packed.quant.step, packed.quant.codes]
    if packed.head is not None:
        parts += [packed.head.lfc, packed.head.lo, packed.head.step, packed.head.codes]
    return [p.view(torch.uint8) for p in parts]


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"))])
@pytest.mark.parametrize(("blocks", "shape"), [("tile", (3, 21, 20)), ("grid64", (2, 65, 12))])
def test_a_seed_fixes_the_bytes_without_touching_torchs_generators(backend, blocks, shape):
    # the compiled graphs' layout ops pass their per-step seed here (graph_ops.layout_encode);
    # grid64 on 1 + 8 * 8 tokens has a class token: its own map, its own draws
    codec = _codec(blocks, "chan", backend)
    x = torch.randn(shape)
    state = torch.get_rng_state()
    a, b, c = codec.encode(x, seed=5), codec.encode(x, seed=5), codec.encode(x, seed=6)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(_parts(a), _parts(b)))
    assert not torch.equal(a.quant.codes, c.quant.codes)
    if backend == "cpu":  # the fused path: the bytes torch.manual_seed(5) gives a seedless call
        torch.manual_seed(5)
        assert all(torch.equal(p, q) for p, q in zip(_parts(a), _parts(codec.encode(x))))
    with pytest.raises(ValueError, match="seed"):
        codec.encode(x, seed=-1)


def test_grid64_without_a_grid_falls_back_to_tiles():
    x = torch.randn(2, 30, 16)  # 30 is neither g*g nor 1 + g*g
    noise = torch.rand(2, 16, 30)
    a = _codec("grid64", "chan").encode(x, noise)
    b = _codec("tile", "chan").encode(x, noise)
    assert torch.equal(a.lfc.lfc, b.lfc.lfc) and a.nbytes == b.nbytes
    torch.testing.assert_close(_codec("grid64", "chan").decode(a), _codec("tile", "chan").decode(b))


@pytest.mark.parametrize(("blocks", "stats"), LAYOUTS)
@pytest.mark.parametrize("shape", [(3, 65, 24), (2, 64, 40), (2, 6, 5, 16), (4, 9, 7)])
def test_nbytes_known_before_encoding_and_above_8x_for_64_element_blocks(blocks, stats, shape):
    codec = _codec(blocks, stats)
    x = torch.randn(shape)
    packed = codec.encode(x)
    assert packed.nbytes == packed_nbytes(codec, shape)
    if blocks != "feat" and shape in ((3, 65, 24), (2, 64, 40)):
        assert x.numel() * 4 / packed.nbytes > 8  # what 8-element blocks cannot reach


@pytest.mark.parametrize(("blocks", "stats"), LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_decode_keeps_shape_dtype_and_is_contiguous(blocks, stats, dtype):
    for shape in ((1, 65, 8), (1, 8, 8, 8)):
        x = torch.randn(shape).to(dtype)
        codec = _codec(blocks, stats)
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
        assert (y.float() - x.float()).abs().max() <= (x.float().amax() - x.float().amin())


@pytest.mark.parametrize(("blocks", "stats"), LAYOUTS[2:])  # feat/chan: test_engine_routes
def test_round_trips_are_unbiased(blocks, stats):
    x = torch.randn(1, 65, 16) * torch.linspace(0.2, 2, 16)
    codec = _codec(blocks, stats)
    torch.manual_seed(0)
    runs = torch.stack([codec.decode(codec.encode(x)) for _ in range(60)])
    assert (runs.mean(0) - x).abs().max() < (runs - x).abs().max() / 5


def test_nan_stays_in_its_block_and_column():
    x = torch.randn(1, 64, 16)
    x[0, 3, 5] = float("nan")
    y = _codec("tile", "chan").decode(_codec("tile", "chan").encode(x))
    assert y[0, :, 5].isnan().all()  # its feature column (shared min/step)
    assert y[0, :, 8:].isfinite().all()  # other tiles and columns are finite


def test_token_view_keeps_a_grid_only_when_asked():
    assert token_view((2, 4, 5, 8), heads=False) == (2, 20, 8)
    assert token_view((2, 4, 5, 8), heads=False, grid=True) == (2, 4, 5, 8)
    assert token_view((2, 3, 7, 8), heads=True, grid=True) == (6, 7, 8)


def test_bad_layout_names_are_refused():
    with pytest.raises(ValueError, match="blocks"):
        _codec("rows", "chan")
    with pytest.raises(ValueError, match="stats"):
        _codec("tile", "column")


class _Packing(torch.autograd.graph.saved_tensors_hooks):
    """Every saved (N, T, F) activation through `codec` (parameters kept)."""

    def __init__(self, model, codec):
        params = {p.data_ptr() for p in model.parameters()}

        def pack(t):
            if t.dim() == 3 and t.numel() >= 2048 and t.data_ptr() not in params:
                return codec.encode(t)
            return t

        def unpack(p):
            return codec.decode(p) if not isinstance(p, torch.Tensor) else p
        super().__init__(pack, unpack)


@pytest.mark.parametrize(("blocks", "stats"), LAYOUTS)
def test_gradient_error_is_bounded_on_random_data(blocks, stats):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(2, 65, 32)

    def grads(hooks):
        model.zero_grad()
        with hooks:
            out = model(x)
        F.mse_loss(out, torch.ones_like(out)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    from contextlib import nullcontext
    exact = grads(nullcontext())
    approx = grads(_Packing(model, _codec(blocks, stats)))
    assert (approx - exact).norm() / exact.norm() < 2
    assert F.cosine_similarity(approx, exact, dim=0) > 0.5
