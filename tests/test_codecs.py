"""Codecs: registry, the DIVISION packed format (against independent float64/numpy oracles), round
trips over odd shapes and layouts, unbiasedness by statistics, byte counts, spectral codecs against
scipy, and argument errors."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import scipy.fft
import torch

from freqact import codecs, dct, kernels
from freqact.kernels import format

# The torch reference through the validating dispatch (the specification).
_encode = functools.partial(kernels.division_encode, backend="torch")
_decode = functools.partial(kernels.division_decode, backend="torch")

DIVISION_FAMILY = ["division", "division-no-hfc", "division-no-lfc", "quant"]
QUANTISED = ["division", "division-no-lfc", "quant"]

# (shape, block): odd sizes, 1x1, H < B <= W, batch 1, odd channels, every map rank.
SHAPES = [
    ((2, 3, 7, 7), 8),
    ((1, 5, 14, 14), 8),
    ((2, 3, 28, 28), 8),
    ((3, 1, 1, 1), 8),
    ((2, 3, 3, 8), 8),
    ((2, 3, 5, 11), 4),
    ((1, 7, 9, 6), 2),
    ((4, 10), 8),
    ((2, 3, 13), 4),
    ((1, 2, 3, 5, 9), 2),
]


def _maps(x: torch.Tensor) -> np.ndarray:
    """x as float64 maps (N, C, *S) per the documented layout rule, written independently."""
    a = x.detach().double().numpy()
    return a[:, None] if a.ndim == 2 else a


def _bf16(a: np.ndarray) -> np.ndarray:
    """float64 -> nearest-even bfloat16 value, as float64."""
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16).double().numpy()


def _block_means64(m: np.ndarray, block: int) -> np.ndarray:
    """Oracle block means in float64 by explicit slicing (edge blocks average what they cover)."""
    spatial = m.shape[2:]
    sizes = [min(block, s) for s in spatial]
    counts = [math.ceil(s / b) for s, b in zip(spatial, sizes)]
    out = np.empty(m.shape[:2] + tuple(counts))
    for idx in np.ndindex(*counts):
        box = tuple(slice(i * b, min((i + 1) * b, s)) for i, b, s in zip(idx, sizes, spatial))
        out[(...,) + idx] = m[(...,) + box].mean(axis=tuple(range(2, m.ndim)))
    return out


def _upsample(lfc: np.ndarray, block: int, spatial) -> np.ndarray:
    """Each element gets its block's value (float64 oracle)."""
    idx = [np.arange(s) // min(block, s) for s in spatial]
    return lfc[(...,) + tuple(np.ix_(*idx))]


def _unpack64(codes: torch.Tensor, count: int, bits: int) -> np.ndarray:
    """Oracle unpacking, code by code: code i sits at bit (i % k) * Q of byte i // k."""
    k = 8 // bits
    c = codes.numpy().astype(np.int64)
    i = np.arange(count)
    return (c[..., i // k] >> ((i % k) * bits)) & (2**bits - 1)


def _map_steps(packed, x: torch.Tensor) -> torch.Tensor:
    """Each element's quantisation step, broadcast to x's shape."""
    maps = format.as_maps(x).shape
    return (
        packed.step.float().reshape(maps[:2] + (1,) * (len(maps) - 2)).expand(maps).reshape(x.shape)
    )


def test_registry_lists_every_codec():
    assert {"exact", "lfc", "hfc", *DIVISION_FAMILY} <= set(codecs.names())


# --- the packed format against an independent oracle ---------------------------------------------


@pytest.mark.parametrize("bits", format.BITS)
@pytest.mark.parametrize("shape, block", SHAPES)
def test_division_packed_format_matches_float64_oracle(shape, block, bits):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 1
    noise = torch.rand(shape)
    packed = _encode(x, block, bits, noise)
    m = _maps(x)
    spatial = m.shape[2:]
    # Means in float64 vs float32 only differ at a bf16 rounding tie: not hit by random data.
    lfc = _bf16(_block_means64(m, block))
    np.testing.assert_array_equal(packed.lfc.double().numpy(), lfc)
    h = (m - _upsample(lfc, block, spatial)).reshape(*m.shape[:2], -1)
    lo = packed.lo.double().numpy()
    step = packed.step.double().numpy()
    # Directed rounding: lo is the largest bf16 <= min(h), step the smallest bf16 >= the ideal.
    down = torch.from_numpy(lo).to(torch.bfloat16)
    above = torch.nextafter(down, torch.full_like(down, math.inf)).double().numpy()
    assert (lo <= h.min(-1)).all() and (above > h.min(-1)).all()
    ideal = (h.max(-1) - lo) / (2**bits - 1)
    below = torch.nextafter(packed.step, torch.zeros_like(packed.step)).double().numpy()
    assert (step >= ideal * (1 - 2**-23)).all()
    # (step == 0 exactly when the residual is constant and equals lo, as in 1x1 maps)
    assert ((below < ideal * (1 + 2**-23)) | ((step == 0) & (ideal == 0))).all()
    q = _unpack64(packed.codes, h.shape[-1], bits)
    # step == 0 (constant residual equal to lo) means codes 0: divide by 1 there.
    divisor = np.where(step == 0, 1.0, step)[..., None]
    t = (h - lo[..., None]) / divisor + _maps(noise).reshape(h.shape)
    expected = np.clip(np.floor(t), 0, 2**bits - 1)
    # float32 vs float64 arithmetic can only move a code across an integer by rounding.
    near = np.abs(t - np.round(t)) < 1e-4
    assert (q[~near] == expected[~near]).all()
    assert np.abs(q - expected).max() <= 1


def test_unused_bits_and_padding_are_zero():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 5)  # 5 codes of 2 bits: the last byte holds one code
    packed = _encode(x, 8, 2)
    assert packed.codes.shape == (2, 3, 2)
    assert (packed.codes[..., -1] >> 2 == 0).all()


@pytest.mark.parametrize("bits", format.BITS)
def test_decode_follows_the_documented_formula(bits):
    torch.manual_seed(2)
    x = torch.randn(2, 3, 10, 12)
    packed = _encode(x, 4, bits)
    q = _unpack64(packed.codes, 120, bits).reshape(x.shape)
    up = _upsample(packed.lfc.double().numpy(), 4, (10, 12))
    lo = packed.lo.double().numpy()[..., None, None]
    step = packed.step.double().numpy()[..., None, None]
    expected = up + lo + step * q
    np.testing.assert_allclose(
        _decode(packed).double().numpy(), expected, rtol=1e-6, atol=1e-6
    )


def test_given_noise_makes_encode_deterministic_and_uses_logical_order():
    torch.manual_seed(3)
    x = torch.randn(2, 6, 9, 9)
    noise = torch.rand(x.shape)
    a = _encode(x, 8, 2, noise)
    b = _encode(
        x.to(memory_format=torch.channels_last), 8, 2, noise.to(memory_format=torch.channels_last)
    )
    for name in ("lfc", "lo", "step", "codes"):
        assert torch.equal(getattr(a, name), getattr(b, name))


# --- accuracy, round trips, layouts --------------------------------------------------------------


def test_division_bits8_block1_is_close_to_exact():
    # block 1: the residual is x's bf16 rounding error, |h| <= 2**-8 |x| (bf16 unit roundoff), so
    # lo >= -(1 + 2**-7) 2**-8 max|x| and one 8-bit step (rounded up to bf16) is at most
    # (2 + 2**-7) * 2**-8 * max|x| / 255 * (1 + 2**-7) < 3.1e-5 * max|x| of the map: the tolerance.
    torch.manual_seed(4)
    x = torch.randn(3, 4, 9, 11) * 10
    y = codecs.get("division", block=1, bits=8).decode(
        codecs.get("division", block=1, bits=8).encode(x)
    )
    tolerance = 3.1e-5 * x.abs().amax(dim=(2, 3), keepdim=True)
    assert ((y - x).abs() <= tolerance).all()


@pytest.mark.parametrize("bits", format.BITS)
@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("shape, block", SHAPES)
def test_quantised_round_trip_is_within_one_step(name, shape, block, bits):
    torch.manual_seed(5)
    x = torch.randn(shape) * 2 + 0.5
    params = {"bits": bits} if name == "quant" else {"block": block, "bits": bits}
    codec = codecs.get(name, **params)
    packed = codec.encode(x)
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device and y.is_contiguous()
    if name == "division-no-lfc":  # decode is the residual alone
        x = x - codecs.get("division-no-hfc", block=block).decode(
            codecs.get("division-no-hfc", block=block).encode(x)
        )
    # Stochastic rounding moves each value by less than one step (plus float32 rounding).
    assert ((y - x).abs() <= _map_steps(packed, x) * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("shape, block", SHAPES)
def test_no_hfc_decodes_the_upsampled_block_means(shape, block):
    torch.manual_seed(6)
    x = torch.randn(shape)
    codec = codecs.get("division-no-hfc", block=block)
    y = codec.decode(codec.encode(x))
    m = _maps(x)
    expected = _upsample(_bf16(_block_means64(m, block)), block, m.shape[2:]).reshape(shape)
    np.testing.assert_array_equal(y.double().numpy(), expected)


@pytest.mark.parametrize("name", DIVISION_FAMILY + ["lfc", "hfc"])
@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced"])
def test_layout_does_not_change_the_result(name, layout):
    torch.manual_seed(7)
    base = torch.randn(2, 5, 12, 10)
    x = {
        "channels_last": base.to(memory_format=torch.channels_last),
        "transposed": base.transpose(2, 3).contiguous().transpose(2, 3),
        "sliced": torch.randn(2, 5, 12, 20)[..., ::2].copy_(base),
    }[layout]
    assert not x.is_contiguous()
    params = {"ratio": 0.5} if name in ("lfc", "hfc") else {}
    codec = codecs.get(name, **params)
    torch.manual_seed(8)
    y = codec.decode(codec.encode(x))
    torch.manual_seed(8)
    expected = codec.decode(codec.encode(base))
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", DIVISION_FAMILY + ["lfc", "hfc"])
def test_other_dtypes_round_trip(name, dtype):
    torch.manual_seed(9)
    x = torch.randn(2, 3, 9, 9).to(dtype)
    params = (
        {"ratio": 1.0}
        if name in ("lfc", "hfc")
        else {"bits": 8} if name == "quant" else {"block": 1, "bits": 8}
    )
    if name == "division-no-hfc":
        params = {"block": 1}
    codec = codecs.get(name, **params)
    y = codec.decode(codec.encode(x))
    assert y.dtype == dtype and y.shape == x.shape
    if name in ("division-no-lfc", "hfc"):
        return  # these drop the signal by design; the shape/dtype contract is what is checked here
    # block 1 / ratio 1 / 8 bits: the codec's own error (one step of a range <= 2 max|x| for quant,
    # bf16 rounding for the LFC, see test_division_bits8_block1_is_close_to_exact) plus the
    # rounding of the result (lfc: of each coefficient, at most eps * ||x||_F) into dtype.
    own = {"division": 3.1e-5, "quant": 8e-3, "division-no-hfc": 2**-8, "lfc": 1e-6}[name]
    xd = x.double()
    bound = own * xd.abs().max() + 2 * torch.finfo(dtype).eps * xd.norm()
    assert (y.double() - xd).abs().max() <= bound


def test_exact_keeps_the_tensor():
    x = torch.randn(2, 3, 4, 4)
    codec = codecs.get("exact")
    assert codec.decode(codec.encode(x)) is x


# --- unbiasedness --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, params",
    [
        ("division", {"block": 4, "bits": 2}),
        ("quant", {"bits": 1}),
        ("division-no-lfc", {"block": 4, "bits": 1}),
    ],
)
def test_stochastic_rounding_is_unbiased(name, params):
    torch.manual_seed(10)
    draws = 1000
    x = torch.randn(1, 3, 6, 7)
    codec = codecs.get(name, **params)
    # 1000 copies as a batch: every copy has the same per-map lo/step, so the mean over the batch
    # estimates E[decode] element by element.
    packed = codec.encode(x.expand(draws, -1, -1, -1).contiguous())
    y = codec.decode(packed).double()
    step = packed.step[0].double()[:, None, None]
    target = x.double()[0]
    if name == "division-no-lfc":
        no_hfc = codecs.get("division-no-hfc", block=params["block"])
        target = target - no_hfc.decode(no_hfc.encode(x)).double()[0]
    # Per element the decode takes two values one step apart, with variance <= step**2 / 4.
    sigma = step / 2 / math.sqrt(draws)
    assert ((y.mean(0) - target).abs() <= 4 * sigma + 1e-6).all()
    # Not round-to-nearest in disguise: values whose fraction is mid-way see both neighbours.
    assert (y.std(0) > 0.2 * step).float().mean() > 0.5


# --- constant and non-finite maps ----------------------------------------------------------------


@pytest.mark.parametrize("name", DIVISION_FAMILY)
def test_zero_and_bf16_constant_maps_are_exact(name):
    x = torch.zeros(2, 3, 7, 9)
    x[0, 1] = 1.5
    x[1, 2] = -0.25
    codec = codecs.get(name)
    for _ in range(3):
        assert torch.equal(
            codec.decode(codec.encode(x)), x if name != "division-no-lfc" else torch.zeros_like(x)
        )


@pytest.mark.parametrize("name", ["lfc", "hfc"])
def test_spectral_zero_maps_are_exact_and_constant_maps_deterministic(name):
    x = torch.zeros(2, 3, 7, 9)
    x[1] = 0.1
    codec = codecs.get(name, ratio=0.5)
    y = codec.decode(codec.encode(x))
    assert torch.equal(y[0], x[0]) and torch.isfinite(y).all()
    assert torch.equal(codec.decode(codec.encode(x)), y)
    # A constant map is pure DC: the low-pass part is the map, the high-pass part (almost) zero.
    expected = x[1] if name == "lfc" else torch.zeros_like(x[1])
    torch.testing.assert_close(y[1], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", QUANTISED)
def test_other_constant_maps_are_finite_and_within_a_step(name):
    x = torch.full((2, 3, 7, 9), 0.1)
    codec = codecs.get(name)
    packed = codec.encode(x)
    y = codec.decode(packed)
    assert torch.isfinite(y).all()
    target = (
        x
        if name != "division-no-lfc"
        else x - codecs.get("division-no-hfc").decode(codecs.get("division-no-hfc").encode(x))
    )
    assert ((y - target).abs() <= _map_steps(packed, x) + 1e-7).all()
    assert (packed.step.float() < 1e-3).all()


@pytest.mark.parametrize("name", QUANTISED + ["lfc"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_value_turns_its_map_to_nan(name, bad):
    x = torch.randn(2, 3, 9, 9)
    x[1, 2, 4, 5] = bad
    codec = codecs.get(name, ratio=0.5) if name == "lfc" else codecs.get(name)
    y = codec.decode(codec.encode(x))
    if name == "lfc" and not math.isnan(bad):
        assert not torch.isfinite(y[1, 2]).any()  # inf coefficients: inf or NaN, never finite
    else:
        assert torch.isnan(y[1, 2]).all()
    others = torch.ones(2, 3, dtype=torch.bool)
    others[1, 2] = False
    assert torch.isfinite(y[others]).all()


# --- storage -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", format.BITS)
@pytest.mark.parametrize("shape, block", SHAPES)
def test_nbytes_equals_the_storage_formula(shape, block, bits):
    x = torch.randn(shape)
    n, c, *spatial = (shape[0], 1, shape[1]) if len(shape) == 2 else shape
    p = math.prod(spatial)
    blocks = math.prod(math.ceil(s / min(block, s)) for s in spatial)
    codes = math.ceil(bits * p / 8)
    expected = {
        "division": codes + 2 * blocks + 4,
        "division-no-hfc": 2 * blocks,
        "division-no-lfc": codes + 4,
        "quant": codes + 4,
    }
    for name, per_map in expected.items():
        params = (
            {"bits": bits}
            if name == "quant"
            else {"block": block} if name == "division-no-hfc" else {"block": block, "bits": bits}
        )
        assert codecs.get(name, **params).encode(x).nbytes == n * c * per_map


def test_division_ratio_to_fp32_at_b8_q2():
    # The paper's headline: 14.2x smaller than fp32 at B = 8, Q = 2 on large maps.
    x = torch.randn(1, 1, 224, 224)
    assert x.numel() * 4 / codecs.get("division").encode(x).nbytes == pytest.approx(14.2, abs=0.05)


# --- spectral codecs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(2, 3, 7, 9), (4, 10), (2, 3, 13), (1, 2, 3, 5, 6), (2, 2, 1, 1)]
)
@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0])
def test_spectral_codecs_match_scipy(shape, ratio):
    torch.manual_seed(12)
    x = torch.randn(shape, dtype=torch.float64)
    m = _maps(x)
    axes = tuple(range(2, m.ndim))
    X = scipy.fft.dctn(m, type=2, norm="ortho", axes=axes)
    windows = [max(1, math.floor(ratio * s + 0.5)) for s in m.shape[2:]]
    keep = np.zeros(m.shape[2:], dtype=bool)
    keep[tuple(slice(0, w) for w in windows)] = True
    low = scipy.fft.idctn(X * keep, type=2, norm="ortho", axes=axes).reshape(shape)
    # hfc holds the high-pass part in the spatial domain: every element, or nothing at ratio 1.
    held_hfc = 0 if keep.all() else keep.size
    for name, expected, kept in [("lfc", low, keep.sum()), ("hfc", x.numpy() - low, held_hfc)]:
        packed = codecs.get(name, ratio=ratio).encode(x)
        np.testing.assert_allclose(
            codecs.get(name, ratio=ratio).decode(packed).numpy(), expected, atol=1e-10
        )
        assert packed.nbytes == m.shape[0] * m.shape[1] * kept * 8


def test_spectral_half_precision_stores_its_own_dtype():
    x = torch.randn(2, 3, 8, 8).to(torch.bfloat16)
    packed = codecs.get("lfc", ratio=0.5).encode(x)
    assert packed.nbytes == 2 * 3 * 16 * 2 and all(p.dtype == torch.bfloat16 for p in packed.pieces)
    packed = codecs.get("hfc", ratio=0.5).encode(x)
    assert packed.nbytes == 2 * 3 * 64 * 2 and all(p.dtype == torch.bfloat16 for p in packed.pieces)
    # Its high-pass part is formed in float32 and rounded once: as close as rounding x allows.
    wide = x.float()
    want = wide - dct.idct(dct.dct(wide) * dct.lowpass_mask((8, 8), 0.5), dims=2)
    torch.testing.assert_close(codecs.get("hfc", ratio=0.5).decode(packed), want.bfloat16())


def test_hfc_holds_nothing_without_a_high_band():
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    codec = codecs.get("hfc", ratio=1.0)
    packed = codec.encode(x)
    assert packed.nbytes == 0
    y = codec.decode(packed)
    assert torch.equal(y, torch.zeros_like(x)) and y.dtype == x.dtype


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DIVISION_FAMILY + ["lfc", "hfc"])
@pytest.mark.parametrize(
    "x, error",
    [
        (torch.ones(2, 3, 4, 4, dtype=torch.int32), TypeError),
        (torch.ones(2, 3, 4, 4, dtype=torch.bool), TypeError),
        (torch.ones(2, 3, 4, 4, dtype=torch.complex64), TypeError),
        (torch.ones(8), ValueError),
        (torch.ones(1, 1, 1, 1, 2, 2), ValueError),
        ([[1.0, 2.0]], TypeError),
    ],
)
def test_bad_x_is_refused_naming_it(name, x, error):
    codec = codecs.get(name, ratio=0.5) if name in ("lfc", "hfc") else codecs.get(name)
    with pytest.raises(error, match="^x:"):
        codec.encode(x)


@pytest.mark.parametrize("name", ["division", "division-no-lfc", "quant"])
@pytest.mark.parametrize(
    "bits, error",
    [(3, ValueError), (0, ValueError), (16, ValueError), (True, TypeError), (2.0, TypeError)],
)
def test_bad_bits_is_refused(name, bits, error):
    with pytest.raises(error, match="bits"):
        codecs.get(name, bits=bits)


@pytest.mark.parametrize("name", ["division", "division-no-hfc", "division-no-lfc"])
@pytest.mark.parametrize("block, error", [(0, ValueError), (-8, ValueError), (1.5, TypeError)])
def test_bad_block_is_refused(name, block, error):
    with pytest.raises(error, match="block"):
        codecs.get(name, block=block)


@pytest.mark.parametrize("name", ["lfc", "hfc"])
@pytest.mark.parametrize(
    "ratio, error", [(0.0, ValueError), (1.5, ValueError), (-0.5, ValueError), ("half", TypeError)]
)
def test_bad_ratio_is_refused(name, ratio, error):
    with pytest.raises(error, match="ratio"):
        codecs.get(name, ratio=ratio)


def test_reference_refuses_bad_noise_and_empty_maps():
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(TypeError, match="noise"):
        _encode(x, 8, 2, torch.rand(x.shape, dtype=torch.float64))
    with pytest.raises(ValueError, match="noise"):
        _encode(x, 8, 2, torch.rand(2, 3, 4, 5))
    with pytest.raises(ValueError, match="^x:"):
        _encode(torch.ones(2, 3, 0, 4), 8, 2)  # maps without elements (no maps is fine)
    with pytest.raises(TypeError, match="packed"):
        _decode(x)
