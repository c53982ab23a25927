"""The spectral codecs' settings: window rule, declining (N, F) inputs, Q-bit quantised HFC
(`hfc-quant`), and
the per-layer windows report."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch
from torch import nn

import freqact
from freqact import codecs, dct
from freqact.codecs import spectral
from freqact.kernels import cpu_dct
from freqact.kernels.format import QuantPacked, as_maps, saturating_cast


def _masked_oracle(x: torch.Tensor, windows, high: bool) -> np.ndarray:
    """Low- or high-pass part of x's 2D maps by scipy in float64."""
    X = scipy.fft.dctn(x.double().numpy(), type=2, norm="ortho", axes=(-2, -1))
    keep = np.zeros(X.shape[-2:], dtype=bool)
    keep[: windows[0], : windows[1]] = True
    X = X * (~keep if high else keep)
    return scipy.fft.idctn(X, type=2, norm="ortho", axes=(-2, -1))


@pytest.mark.parametrize("name", ["lfc", "hfc"])
@pytest.mark.parametrize("rule,windows", [("official", (7, 4)), ("nearest", (6, 3))])
def test_window_rule_sets_the_kept_coefficients(name, rule, windows):
    x = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(1))
    codec = codecs.get(name, ratio=0.2, window_rule=rule)
    packed = codec.encode(x)
    assert packed.windows == windows
    # lfc holds the corner coefficients, hfc the high-pass part in the spatial domain (all of x).
    assert packed.nbytes == 4 * 6 * (windows[0] * windows[1] if name == "lfc" else 32 * 16)
    y = codec.decode(packed)
    np.testing.assert_allclose(y.double().numpy(), _masked_oracle(x, windows, name == "hfc"), atol=2e-6)


def test_bad_window_rule_and_bits():
    with pytest.raises(ValueError, match="window_rule"):
        codecs.get("lfc", ratio=0.2, window_rule="ceil")
    with pytest.raises(ValueError, match="bits"):
        codecs.get("hfc-quant", ratio=0.2, bits=3)
    for name in ("lfc", "hfc"):  # exact coefficients; only hfc-quant quantises
        with pytest.raises(TypeError, match="bits"):
            codecs.get(name, ratio=0.2, bits=2)


@pytest.mark.parametrize("name", ["lfc", "hfc", "hfc-quant"])
def test_spectral_codecs_decline_feature_vectors_and_the_engine_keeps_them(name):
    codec = codecs.get(name, ratio=0.25)
    assert not codec.accepts(torch.zeros(4, 16)) and codec.accepts(torch.zeros(4, 2, 16))
    assert codecs.get("division").accepts(torch.zeros(4, 16))
    torch.manual_seed(2)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
    x, y = torch.randn(4, 2, 8, 8), torch.randint(0, 5, (4,))
    exact = torch.autograd.grad(nn.functional.cross_entropy(net(x), y), [net[0].weight, net[2].weight])
    with freqact.compress(net, name, ratio=0.25) as meter:
        loss = nn.functional.cross_entropy(net(x), y)
    approx = torch.autograd.grad(loss, [net[0].weight, net[2].weight])
    # The Linear's input (N, F) was kept: its weight gradient is exact; the conv's is not.
    torch.testing.assert_close(approx[1], exact[1], rtol=0, atol=0)
    assert not torch.allclose(approx[0], exact[0], atol=1e-3)
    linear = next(r for r in meter.per_layer() if r["layer"] == "2")
    assert linear["saved_bytes"] == linear["exact_bytes"] == 4 * 3 * 8 * 8 * 4  # its float32 input
    assert meter.by_route()[name]["count"] == 1  # only the conv input went through the codec


def test_quantised_hfc_is_unbiased_and_sized_as_documented():
    torch.manual_seed(3)
    draws, bits = 1000, 2
    x = torch.randn(1, 3, 8, 12)
    codec = codecs.get("hfc-quant", ratio=0.25, bits=bits)
    packed = codec.encode(x.expand(draws, -1, -1, -1).contiguous())
    assert isinstance(packed, QuantPacked)  # no block means: the quant form of the format
    assert packed.nbytes == draws * 3 * (math.ceil(bits * 8 * 12 / 8) + 4)
    out = codec.decode(packed)
    assert out.shape == (draws, 3, 8, 12) and out.dtype == x.dtype
    target = torch.from_numpy(_masked_oracle(x, dct.windows((8, 12), 0.25), True))[0]
    step = packed.step[0].double()[:, None, None]
    sigma = step / 2 / math.sqrt(draws)
    assert ((out.double().mean(0) - target).abs() <= 4 * sigma + 1e-5).all()
    assert (out.double().std(0) > 0.2 * step).float().mean() > 0.5  # stochastic, not nearest


def test_quantised_hfc_keeps_the_input_dtype():
    x = torch.randn(2, 3, 8, 8).to(torch.bfloat16)
    codec = codecs.get("hfc-quant", ratio=0.5, bits=4)
    assert codec.decode(codec.encode(x)).dtype == torch.bfloat16


def test_layer_windows_reports_what_resnet20_keeps():
    model = freqact.models.get("resnet20")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = spectral.layer_windows(model, (3, 32, 32), codecs.get("lfc", ratio=0.2, window_rule="official"))
    by_size = {r["shape"][-1]: r["windows"] for r in rows if r["windows"] is not None}
    assert by_size == {32: [7, 7], 16: [4, 4], 8: [2, 2]}
    declined = [r for r in rows if r["windows"] is None]
    assert [r["type"] for r in declined] == ["Linear"] and declined[0]["shape"] == [1, 64]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(TypeError, match="codec"):
        spectral.layer_windows(model, (3, 32, 32), codecs.get("division"))


@pytest.mark.skipif(not cpu_dct.available(), reason=f"C DCT kernels: {cpu_dct.unavailable_reason()}")
@pytest.mark.parametrize("shape", [(2, 3, 32, 32), (2, 3, 7, 33), (1, 2, 33, 7), (3, 4, 20), (2, 3, 8, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_highpass_is_the_two_corner_transforms_bit_for_bit(shape, dtype):
    # The fused kernel runs the same products as dct_corner then idct_corner, in cache: equal
    # bytes to x - iDCT(corner) formed from the separate kernels, and to float64 scipy's
    # high band within float32 accuracy.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    codec = codecs.get("hfc", ratio=0.3, window_rule="official")
    windows = codec.windows(shape)
    maps = as_maps(x).float()
    separate = maps - dct.lowpass_synthesis(dct.lowpass_coefficients(maps, windows), maps.shape[2:])
    got = codec.decode(codec.encode(x))
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, saturating_cast(separate, dtype).reshape(shape))
    axes = tuple(range(-len(windows), 0))
    spectrum = scipy.fft.dctn(maps.double().numpy(), type=2, norm="ortho", axes=axes)
    spectrum[(...,) + tuple(slice(0, w) for w in windows)] = 0
    want = scipy.fft.idctn(spectrum, type=2, norm="ortho", axes=axes)
    scale = np.abs(want).max()
    assert np.abs(got.float().double().numpy().reshape(want.shape) - want).max() <= (
        2e-6 * scale if dtype == torch.float32 else 1e-2 * scale)


def test_fused_highpass_hands_overflowing_corners_to_the_edge_rule():
    # Coefficients of maps near float32's top overflow: the C kernel reports it, the codec scales.
    x = torch.full((1, 2, 16, 16), 3e38)
    x[0, 1] = -3e38
    if cpu_dct.available():
        assert cpu_dct.highpass(x, 4, 4) is None
    high = codecs.get("hfc", ratio=0.25).encode(x).pieces[0]
    assert bool(high.isfinite().all()) and float(high.abs().max()) <= 1e-6 * 3e38


def test_lfc_corner_checks_finiteness_in_the_kernel_and_keeps_the_edge_rule():
    # Ordinary maps: the checked C corner, the same bytes as lowpass_coefficients, no scaling.
    # Maps near float32's top: their corner overflows, the kernel says so, the codec scales.
    codec = codecs.get("lfc", ratio=0.25)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(7))
    packed = codec.encode(x)
    assert packed.scale_exp == 0
    assert torch.equal(packed.pieces[0], dct.lowpass_coefficients(x, codec.windows(x.shape)))
    big = torch.full((1, 2, 16, 16), 3e38)
    big[0, 1] = -3e38
    if cpu_dct.available():
        assert cpu_dct.dct_corner_checked(big, 4, 4)[1] is False
        assert cpu_dct.dct_corner_checked(x, 4, 4)[1] is True
    packed = codec.encode(big)
    assert packed.scale_exp > 0 and bool(packed.pieces[0].isfinite().all())
    torch.testing.assert_close(codec.decode(packed), dct.lowpass(big.double(), 0.25).float(),
                               rtol=1e-5, atol=1e-5 * 3e38)


def test_lfc_decodes_maps_longer_than_the_c_kernels_take():
    # A corner the C kernel could take, of maps it cannot (sizes above cpu_dct.MAX_SIZE): the
    # decode runs the padded inverse DCT instead of refusing.
    x = torch.randn(2, 3, 2000, generator=torch.Generator().manual_seed(3))
    codec = codecs.get("lfc", ratio=0.25)
    torch.testing.assert_close(codec.decode(codec.encode(x)), dct.lowpass(x.double(), 0.25, 1).float(),
                               rtol=1e-4, atol=1e-5)
