"""freqact.dct against scipy.fft (the oracle), plus its algebraic properties and input checks."""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch

from freqact import _separable
from freqact import dct as F

SIZES = [1, 2, 7, 8, 14, 32, 56]
# (shape, dims): square sizes from SIZES plus non-square, odd and size-1 shapes, 1D/2D/3D.
SHAPES = (
    [((3, n), 1) for n in SIZES]
    + [((2, 2, n, n), 2) for n in SIZES]
    + [((1, n, n, n), 3) for n in SIZES]
    + [((2, 3, 7, 14), 2), ((5, 1), 1), ((2, 1, 56), 2), ((3, 32, 1), 2), ((2, 7, 1, 8), 3),
       ((2, 3, 14, 8), 3), ((4, 5, 2), 3)]
)
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def rel_error(a: torch.Tensor, b: np.ndarray) -> float:
    """max|a - b| / max|b| (b is the float64 oracle)."""
    return float(np.abs(a.detach().cpu().double().numpy() - b).max() / np.abs(b).max())


def axes(dims: int) -> tuple[int, ...]:
    """scipy's axes for the last `dims` dims."""
    return tuple(range(-dims, 0))


def randn(*shape, dtype=torch.float64, seed=0) -> torch.Tensor:
    """Reproducible standard normal samples on the CPU."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,dims", SHAPES)
def test_dct_idct_match_scipy(shape, dims, dtype):
    x = randn(*shape, dtype=dtype)
    x64 = x.double().numpy()
    X = F.dct(x, dims)
    assert X.shape == x.shape and X.dtype == dtype
    assert rel_error(X, scipy.fft.dctn(x64, type=2, norm="ortho", axes=axes(dims))) <= TOL[dtype]
    y = F.idct(x, dims)
    assert rel_error(y, scipy.fft.idctn(x64, type=2, norm="ortho", axes=axes(dims))) <= TOL[dtype]


@pytest.mark.parametrize("n", SIZES + [3, 224])
def test_basis_is_orthonormal(n):
    d = F._basis(n, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-13, rtol=0)


@pytest.mark.parametrize("shape,dims", SHAPES)
def test_round_trip_and_parseval(shape, dims):
    x = randn(*shape)
    X = F.dct(x, dims)
    torch.testing.assert_close(F.idct(X, dims), x, atol=1e-12, rtol=0)
    torch.testing.assert_close(F.dct(F.idct(x, dims), dims), x, atol=1e-12, rtol=0)
    torch.testing.assert_close(X.square().sum(), x.square().sum(), atol=0, rtol=1e-12)


def test_non_contiguous_input():
    x = randn(4, 6, 10).transpose(0, 2)  # (10, 6, 4), strided
    ref = scipy.fft.dctn(x.numpy(), type=2, norm="ortho", axes=(-2, -1))
    assert rel_error(F.dct(x), ref) <= 1e-12


def test_cpu_chunks_give_the_same_result(monkeypatch):
    # Chunks of 5 maps (the last one partial) exercise the chunk loop and its buffer reuse.
    x = randn(13, 4, 6, 5)
    monkeypatch.setattr(_separable, "_CPU_CHUNK_BYTES", 5 * 4 * 6 * 5 * 8)
    for dims in (1, 2, 3):
        ref = scipy.fft.dctn(x.numpy(), type=2, norm="ortho", axes=axes(dims))
        assert rel_error(F.dct(x, dims), ref) <= 1e-12


def test_empty_batch():
    x = torch.zeros(0, 3, 5, 5)
    assert F.dct(x).shape == x.shape and F.idct(x).shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes_computed_in_float32(dtype):
    x = randn(2, 3, 14, 14, dtype=torch.float32).to(dtype)
    X = F.dct(x)
    assert X.dtype == dtype
    # Exactly the float32 result rounded once to the half type.
    assert torch.equal(X, F.dct(x.float()).to(dtype))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(F.idct(X).float(), x.float(), atol=8 * eps * x.abs().max().item(), rtol=0)


# ---------------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("dims,shape", [(1, (2, 5)), (2, (2, 3, 4)), (3, (1, 2, 3, 4))])
@pytest.mark.parametrize("fn", [F.dct, F.idct])
def test_gradcheck(fn, dims, shape):
    x = randn(*shape).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: fn(t, dims), (x,))
    assert torch.autograd.gradgradcheck(lambda t: fn(t, dims), (x,))


def test_gradcheck_split_band_energy_block_dct():
    x = randn(2, 2, 5, 6).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: F.split(t, 0.5), (x,))
    assert torch.autograd.gradcheck(lambda t: F.band_energy(t, 0.4, reduce="channel"), (x,))
    assert torch.autograd.gradcheck(lambda t: F.block_dct(t, 4), (x,))


def test_backward_is_the_inverse_transform():
    # DCT is orthonormal: the gradient of <dct(x), g> with respect to x is idct(g).
    x = randn(2, 3, 7, 8).requires_grad_()
    g = randn(2, 3, 7, 8, seed=1)
    (F.dct(x) * g).sum().backward()
    torch.testing.assert_close(x.grad, F.idct(g), atol=1e-13, rtol=0)


def test_basis_never_requires_grad_and_is_cached():
    cpu = torch.device("cpu")
    F._basis.cache_clear()
    with torch.inference_mode():
        F.dct(torch.randn(2, 11, 13))  # first use inside inference mode must not poison the cache
    d = F._basis(11, torch.float32, cpu)
    assert d is F._basis(11, torch.float32, cpu)
    assert not d.requires_grad and not d.is_inference()
    assert F._basis(11, torch.float64, cpu) is not d
    x = torch.randn(2, 11, 13, requires_grad=True)
    F.dct(x).sum().backward()  # usable by autograd after an inference-mode first use
    assert not F._basis(11, torch.float32, cpu).requires_grad


def test_saved_tensor_hooks_never_see_the_basis():
    # The compression engine packs every saved tensor; the constant basis must not be one of them.
    seen = []
    x = randn(2, 3, 8, 8).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        y = F.dct(x)
    assert seen == []
    y.sum().backward()


# ---------------------------------------------------------------------------------- masks, split


@pytest.mark.parametrize(
    "n,ratio,w",
    [(32, 1.0, 32), (32, 0.5, 16), (7, 0.5, 4), (5, 0.5, 3), (9, 0.5, 5), (56, 1e-9, 1), (1, 0.01, 1),
     (8, 0.0625, 1), (8, 0.2, 2), (8, 0.99, 8)],
)
def test_mask_rounding_rule(n, ratio, w):
    for dims in (1, 2, 3):
        m = F.lowpass_mask((n,) * dims, ratio)
        assert m.dtype == torch.bool and m.shape == (n,) * dims
        assert int(m.sum()) == w**dims
        assert bool(m[(slice(0, w),) * dims].all())
        assert torch.equal(F.highpass_mask((n,) * dims, ratio), ~m)


def test_mask_window_and_non_square():
    m = F.lowpass_mask((4, 10), window=6)
    assert m[:, :6].all() and not m[:, 6:].any()  # the 4-long dim is kept whole
    m = F.lowpass_mask((8, 20), 0.25)
    assert m[:2, :5].all() and int(m.sum()) == 10


@pytest.mark.parametrize("shape,dims", [((2, 3, 14, 9), 2), ((3, 20), 1), ((1, 2, 6, 7, 8), 3)])
@pytest.mark.parametrize("ratio", [0.01, 0.3, 0.5, 1.0])
def test_split_matches_scipy_masking(shape, dims, ratio):
    x = randn(*shape)
    mask = F.lowpass_mask(shape[-dims:], ratio).numpy()
    coeff = scipy.fft.dctn(x.numpy(), type=2, norm="ortho", axes=axes(dims))
    low = scipy.fft.idctn(coeff * mask, type=2, norm="ortho", axes=axes(dims))
    high = scipy.fft.idctn(coeff * ~mask, type=2, norm="ortho", axes=axes(dims))
    lfc, hfc = F.split(x, ratio, dims)
    assert float(np.abs(lfc.numpy() - low).max()) <= 1e-12 * float(np.abs(x.numpy()).max())
    assert float(np.abs(hfc.numpy() - high).max()) <= 1e-12 * float(np.abs(x.numpy()).max())
    torch.testing.assert_close(lfc + hfc, x, atol=1e-14, rtol=0)
    torch.testing.assert_close(F.lowpass(x, ratio, dims), lfc, atol=0, rtol=0)
    torch.testing.assert_close(F.highpass(x, ratio, dims), hfc, atol=0, rtol=0)


def test_split_edges_of_ratio_range():
    x = randn(2, 3, 8, 8)
    lfc, hfc = F.split(x, 1.0)
    torch.testing.assert_close(lfc, x, atol=1e-14, rtol=0)
    assert hfc.abs().max() <= 1e-14
    # The smallest window keeps only the DC term: the per-map mean.
    lfc, _ = F.split(x, 1e-6)
    torch.testing.assert_close(lfc, x.mean((-2, -1), keepdim=True).expand_as(x), atol=1e-14, rtol=0)
    torch.testing.assert_close(F.lowpass(x, window=1), lfc, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_split_low_precision_sums_back(dtype):
    x = randn(2, 3, 14, 14, dtype=torch.float32).to(dtype)
    lfc, hfc = F.split(x, 0.5)
    assert lfc.dtype == hfc.dtype == dtype
    # Each part is rounded once to the half type: at most half a unit in the last place of each.
    bound = torch.finfo(dtype).eps * (lfc.abs().max() + hfc.abs().max()).item()
    torch.testing.assert_close(lfc.double() + hfc.double(), x.double(), atol=bound, rtol=0)


# ---------------------------------------------------------------------------------- band energy


@pytest.mark.parametrize("dims,shape", [(1, (3, 4, 20)), (2, (3, 4, 7, 9)), (3, (3, 4, 5, 6, 7))])
def test_band_energy_parseval_and_oracle(dims, shape):
    x = randn(*shape)
    ratio = 0.4
    coeff = scipy.fft.dctn(x.numpy(), type=2, norm="ortho", axes=axes(dims))
    mask = F.lowpass_mask(shape[-dims:], ratio).numpy()
    for reduce, keep in [("instance", 1), ("channel", 2), ("all", 0)]:
        lam_l, lam_h = F.band_energy(x, ratio, dims, reduce)
        summed = tuple(range(keep, x.dim()))
        assert lam_l.shape == shape[:keep]
        np.testing.assert_allclose(lam_l.numpy(), np.sqrt((coeff**2 * mask).sum(summed)), rtol=1e-12)
        np.testing.assert_allclose(lam_h.numpy(), np.sqrt((coeff**2 * ~mask).sum(summed)), rtol=1e-12)
        torch.testing.assert_close(lam_l**2 + lam_h**2, x.square().sum(summed), atol=0, rtol=1e-12)


def test_band_energy_half_input_returns_float32():
    lam_l, lam_h = F.band_energy(randn(2, 3, 8, 8).to(torch.bfloat16), 0.5)
    assert lam_l.dtype == lam_h.dtype == torch.float32 and lam_l.shape == (2,)


# ---------------------------------------------------------------------------------- block DCT, radial


@pytest.mark.parametrize("h,w,block", [(16, 16, 8), (14, 10, 4), (7, 7, 8), (9, 5, 3), (5, 6, 1)])
def test_block_dct_each_block_matches_scipy(h, w, block):
    x = randn(2, 3, h, w)
    out = F.block_dct(x, block)
    assert out.shape == x.shape
    for i in range(0, h, block):
        for j in range(0, w, block):
            tile = x[..., i : i + block, j : j + block].numpy()  # edge tiles are smaller
            ref = scipy.fft.dctn(tile, type=2, norm="ortho", axes=(-2, -1))
            np.testing.assert_allclose(out[..., i : i + block, j : j + block].numpy(), ref, atol=1e-12)
    torch.testing.assert_close(out.square().sum(), x.square().sum(), atol=0, rtol=1e-12)


def test_block_dct_dc_is_scaled_block_mean_and_3d():
    x = randn(1, 10, 10)
    out = F.block_dct(x, 4)
    # Edge block (rows 8:10, cols 0:4) has 2 x 4 elements: DC = sqrt(8) * mean.
    torch.testing.assert_close(out[0, 8, 0], math.sqrt(8) * x[0, 8:10, 0:4].mean(), atol=1e-13, rtol=0)
    x3 = randn(2, 6, 5, 7)
    ref = scipy.fft.dctn(x3[:, 3:6, 3:5, 3:6].numpy(), type=2, norm="ortho", axes=(-3, -2, -1))
    np.testing.assert_allclose(F.block_dct(x3, 3, dims=3)[:, 3:6, 3:5, 3:6].numpy(), ref, atol=1e-12)


@pytest.mark.parametrize("h,w", [(8, 8), (5, 9), (1, 1), (1, 6)])
def test_radial_spectrum_against_loop_oracle(h, w):
    x = randn(3, 2, h, w)
    energy = scipy.fft.dctn(x.numpy(), type=2, norm="ortho", axes=(-2, -1)) ** 2
    sums, counts = {}, {}
    for i in range(h):
        for j in range(w):
            k = int(math.floor(math.hypot(i, j)))
            sums[k] = sums.get(k, 0.0) + energy[..., i, j].sum()
            counts[k] = counts.get(k, 0) + energy[..., i, j].size
    expected = np.array([sums[k] / counts[k] for k in range(max(sums) + 1)])
    spectrum = F.radial_spectrum(x)
    assert spectrum.shape == (int(math.floor(math.hypot(h - 1, w - 1))) + 1,)
    np.testing.assert_allclose(spectrum.numpy(), expected, rtol=1e-12)


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 4, dtype=torch.bool),
                                 torch.ones(2, 4, dtype=torch.complex64), np.ones((2, 4)), [1.0]])
@pytest.mark.parametrize(
    "call",
    [lambda t: F.dct(t, 1), lambda t: F.idct(t, 1), lambda t: F.split(t, 0.5, 1),
     lambda t: F.lowpass(t, 0.5, 1), lambda t: F.highpass(t, 0.5, 1), lambda t: F.band_energy(t, 0.5, 1),
     lambda t: F.block_dct(t, 2, 1), lambda t: F.radial_spectrum(t)],
)
def test_non_float_inputs_raise_type_error(call, bad):
    with pytest.raises(TypeError, match=r"^(x|X):"):
        call(bad)


@pytest.mark.parametrize("dims", [0, 4, -1, 2.0, True, "2"])
def test_bad_dims(dims):
    with pytest.raises((TypeError, ValueError), match="^dims:"):
        F.dct(torch.ones(2, 3, 4, 4, 4), dims)


def test_dims_larger_than_rank():
    with pytest.raises(ValueError, match="^dims:.*rank"):
        F.dct(torch.ones(4, 4), 3)
    with pytest.raises(ValueError, match="^dims:"):
        F.radial_spectrum(torch.ones(4))


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.0001, 2, float("nan")])
def test_bad_ratio(ratio):
    x = torch.ones(2, 4, 4)
    for call in (F.split, F.lowpass, F.highpass, F.band_energy):
        with pytest.raises(ValueError, match="^ratio:"):
            call(x, ratio)
    with pytest.raises(ValueError, match="^ratio:"):
        F.lowpass_mask((4, 4), ratio)


def test_bad_ratio_type_window_and_shape():
    with pytest.raises(TypeError, match="^ratio:"):
        F.lowpass_mask((4, 4), "half")
    with pytest.raises(ValueError, match="^ratio/window:"):
        F.lowpass_mask((4, 4))
    with pytest.raises(ValueError, match="^ratio/window:"):
        F.split(torch.ones(4, 4), 0.5, window=2)
    with pytest.raises(ValueError, match="^window:"):
        F.lowpass_mask((4, 4), window=0)
    with pytest.raises(TypeError, match="^window:"):
        F.lowpass_mask((4, 4), window=1.5)
    for shape in [(), (1, 2, 3, 4), 4]:
        with pytest.raises(ValueError, match="^shape:"):
            F.lowpass_mask(shape, 0.5)
    with pytest.raises(ValueError, match="^shape:"):
        F.lowpass_mask((4, 0), 0.5)


def test_bad_reduce_block_and_rank_for_reduce():
    x = torch.ones(2, 3, 4, 4)
    with pytest.raises(ValueError, match="^reduce:"):
        F.band_energy(x, 0.5, reduce="batch")
    with pytest.raises(ValueError, match="^x:.*rank"):
        F.band_energy(torch.ones(3, 4, 4), 0.5, reduce="channel")
    with pytest.raises(ValueError, match="^x:.*rank"):
        F.band_energy(torch.ones(4, 4), 0.5, reduce="instance")
    assert F.band_energy(torch.ones(4, 4), 0.5, reduce="all")[0].shape == ()
    with pytest.raises(ValueError, match="^block:"):
        F.block_dct(x, 0)
    with pytest.raises(TypeError, match="^block:"):
        F.block_dct(x, 2.5)


def test_empty_tensors():
    with pytest.raises(ValueError, match="^x:.*non-empty"):
        F.band_energy(torch.ones(0, 3, 4, 4), 0.5)
    with pytest.raises(ValueError, match="^x:.*non-empty"):
        F.radial_spectrum(torch.ones(0, 4, 4))
    with pytest.raises(ValueError, match="^x:.*size >= 1"):
        F.dct(torch.ones(2, 0, 4))


# ---------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device available")
    x = randn(4, 3, 14, 9)
    for dims in (1, 2, 3):
        ref = scipy.fft.dctn(x.numpy(), type=2, norm="ortho", axes=axes(dims))
        X = F.dct(x.cuda(), dims)
        assert X.is_cuda and rel_error(X, ref) <= 1e-12
        torch.testing.assert_close(F.idct(X, dims).cpu(), x, atol=1e-12, rtol=0)
    xf = x.float().cuda()
    assert rel_error(F.dct(xf), scipy.fft.dctn(x.numpy(), type=2, norm="ortho", axes=(-2, -1))) <= 1e-5
    assert F.dct(xf.half()).dtype == torch.float16
    lfc, hfc = F.split(xf, 0.5)
    torch.testing.assert_close(lfc + hfc, xf, atol=1e-5, rtol=0)
    assert F.band_energy(xf, 0.5)[0].is_cuda and F.radial_spectrum(xf).is_cuda
    assert F._basis(9, torch.float32, xf.device) is F._basis(9, torch.float32, xf.device)


# --------------------------------------------------------------------------- window rules


@pytest.mark.parametrize("ratio,expected", [(0.1, (4, 2, 1)), (0.2, (7, 4, 2))])
def test_official_window_rule_gives_the_issue_windows(ratio, expected):
    # ResNet-20's maps are 32, 16 and 8 wide; the DIVISION code keeps round(r * N + 0.5).
    assert tuple(F.windows((n,), ratio, rule="official")[0] for n in (32, 16, 8)) == expected


@pytest.mark.parametrize("ratio,expected", [(0.1, (3, 2, 1)), (0.2, (6, 3, 2))])
def test_nearest_window_rule_is_todays_rule(ratio, expected):
    assert tuple(F.windows((n,), ratio)[0] for n in (32, 16, 8)) == expected


def test_official_rule_ties_round_to_even_and_stays_in_range():
    # r * N + 0.5 = 2.5 exactly (r = 0.25, N = 8): Python's round gives 2; 3.5 gives 4.
    assert F.windows((8,), 0.25, rule="official") == (2,)
    assert F.windows((12,), 0.25, rule="official") == (4,)
    assert F.windows((7,), 1.0, rule="official") == (7,)  # round(7.5) = 8, clipped to N
    assert F.windows((32,), 0.001, rule="official") == (1,)  # round(0.532) = 1; never empty
    mask = F.lowpass_mask((32, 16), 0.1, rule="official")
    assert mask.sum() == 4 * 2 and mask[:4, :2].all()
    with pytest.raises(ValueError, match="rule"):
        F.windows((8,), 0.5, rule="floor")


# ----------------------------------------------------------------- fused C path (cpu_dct)

from freqact.kernels import cpu_dct

needs_c = pytest.mark.skipif(not cpu_dct.available(), reason=f"C DCT kernels: {cpu_dct.unavailable_reason()}")
EDGE = (1, 7, 8, 33)


def reference(monkeypatch, fn, *args, **kwargs):
    """fn(*args) on the matmul reference path (FREQACT_KERNELS=torch switches the C path off)."""
    monkeypatch.setenv("FREQACT_KERNELS", "torch")
    try:
        return fn(*args, **kwargs)
    finally:
        monkeypatch.delenv("FREQACT_KERNELS")


@needs_c
@pytest.mark.parametrize("h", EDGE)
@pytest.mark.parametrize("w", EDGE)
def test_fast_dct_matches_scipy_and_the_matmul_reference(monkeypatch, h, w):
    x = randn(3, 2, h, w, dtype=torch.float32, seed=h * 100 + w)
    assert F._fast(x, 2)
    x64 = x.double().numpy()
    for fn, oracle in ((F.dct, scipy.fft.dctn), (F.idct, scipy.fft.idctn)):
        got = fn(x, 2)
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert rel_error(got, oracle(x64, type=2, norm="ortho", axes=(-2, -1))) <= 2e-6
        torch.testing.assert_close(got, reference(monkeypatch, fn, x, 2), atol=2e-6, rtol=0)
    ref1 = scipy.fft.dctn(x64, type=2, norm="ortho", axes=(-1,))
    assert rel_error(F.dct(x, 1), ref1) <= 2e-6


@needs_c
@pytest.mark.parametrize("h", [2, 5, 32])
@pytest.mark.parametrize("w", [2, 16, 31, 32, 33, 48, 56, 64, 65, 130])
def test_fast_dct_row_lengths_on_both_sides_of_the_plain_product(monkeypatch, h, w):
    # Rows shorter than 32 take the plain n x n product in C, longer ones the even/odd split with
    # its vector (de)interleave (tails at 33, 48, 56, 65, 130); h = 5 leaves rows outside the
    # groups of 4, h = 2 the smallest column split.
    x = randn(2, 3, h, w, dtype=torch.float32, seed=h * 1000 + w)
    x64 = x.double().numpy()
    for dims, axes in ((2, (-2, -1)), (1, (-1,))):
        for fn, oracle in ((F.dct, scipy.fft.dctn), (F.idct, scipy.fft.idctn)):
            got = fn(x, dims)
            assert rel_error(got, oracle(x64, type=2, norm="ortho", axes=axes)) <= 2e-6
            torch.testing.assert_close(got, reference(monkeypatch, fn, x, dims), atol=3e-6, rtol=0)
    torch.testing.assert_close(F.idct(F.dct(x)), x, atol=3e-6, rtol=0)


@needs_c
def test_outputs_of_8_mib_stream_past_the_cache_with_the_same_bytes():
    # From 8 MiB on, the transform and the high-pass part are written with non-temporal stores
    # where the output is aligned for them, plainly where it is not: the same bytes either way,
    # and the same as the maps transformed in a small batch (ordinary stores).
    x = randn(2048, 32, 32, dtype=torch.float32, seed=11)  # 8 MiB
    got = F.dct(x)
    assert rel_error(got, scipy.fft.dctn(x.double().numpy(), type=2, norm="ortho", axes=(-2, -1))) <= 2e-6
    assert torch.equal(got[:8], F.dct(x[:8]))
    unaligned = torch.empty(x.numel() + 1)[1:].view(x.shape)  # 4 bytes off the allocation
    assert torch.equal(F.dct(x, out=unaligned), got)
    assert torch.equal(F.idct(got), F.idct(got, out=unaligned))
    high = cpu_dct.highpass(x, 7, 7)
    assert torch.equal(high, x - cpu_dct.idct_corner(cpu_dct.dct_corner(x, 7, 7), 32, 32))
    assert torch.equal(high[:8], cpu_dct.highpass(x[:8], 7, 7))
    # Streamed stores are invisible to AddressSanitizer: guard floats around an output that
    # starts and ends off the vector alignment must come back untouched.
    guarded = torch.full((x.numel() + 32,), 7.0)
    assert torch.equal(F.idct(got, out=guarded[13:-19].view(x.shape)), F.idct(got))
    assert bool((guarded[:13] == 7.0).all()) and bool((guarded[-19:] == 7.0).all())


@needs_c
def test_outputs_of_8_mib_are_complete_at_any_thread_count():
    # From 8 MiB on, the team populates the output in 2 MiB chunks and takes the maps dynamically
    # with no barrier (nowait) between: every thread count must still write every map, with the
    # same bytes, fresh or into a reused buffer, for the full transform and the high-pass job.
    # (Populating only touches pages; what this checks is the loops' coverage.)
    x = randn(2048 + 37, 32, 32, dtype=torch.float32, seed=12)  # 8 MiB and a part of a huge page
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want, high = F.dct(x), cpu_dct.highpass(x, 5, 5)
        for n in (2, 3):
            torch.set_num_threads(n)
            assert torch.equal(F.dct(x), want) and torch.equal(cpu_dct.highpass(x, 5, 5), high)
            reused = torch.full_like(x, float("nan"))
            assert torch.equal(F.dct(x, out=reused), want)
    finally:
        torch.set_num_threads(threads)
    reference = scipy.fft.dctn(x.double().numpy(), type=2, norm="ortho", axes=(-2, -1))
    assert rel_error(want, reference) <= 2e-6


@needs_c
@pytest.mark.parametrize("h,w", [(8, 8), (4, 4), (8, 2), (24, 2), (16, 8), (12, 4), (64, 8),  # narrow
                                 (2, 2), (6, 2), (7, 8), (3, 4), (66, 8)])  # rows left over: products
def test_corner_kernels_on_maps_a_vector_holds_whole_rows_of(h, w):
    # Rows of 2, 4 or 8 floats take the narrow path when whole rows fill the vectors (h a
    # multiple of 16 / w, up to 64 rows); the other cases keep the general products. Windows
    # from one coefficient to the whole map (wh = 2, 3, 5 and 6 leave row blocks of every size
    # below 4), against float64 scipy; the high-pass kernel is the corner then the synthesis
    # kernel, byte for byte.
    x = randn(3, 5, h, w, dtype=torch.float32, seed=h * 10 + w)
    spectrum = scipy.fft.dctn(x.double().numpy(), type=2, norm="ortho", axes=(-2, -1))
    windows = {(1, 1), (1, w), (h, 1), (min(h, 2), w), (min(h, 3), min(w, 2)), (min(h, 5), w),
               (min(h, 6), 1), (h, w)}
    for wh, ww in sorted(windows):
        corner = cpu_dct.dct_corner(x, wh, ww)
        assert rel_error(corner, spectrum[..., :wh, :ww]) <= 2e-6
        kept = np.zeros_like(spectrum)
        kept[..., :wh, :ww] = spectrum[..., :wh, :ww]
        low = scipy.fft.idctn(kept, type=2, norm="ortho", axes=(-2, -1))
        synthesis = cpu_dct.idct_corner(corner, h, w)
        assert np.abs(synthesis.double().numpy() - low).max() <= 2e-6 * np.abs(x.numpy()).max()
        assert torch.equal(cpu_dct.highpass(x, wh, ww), x - synthesis)


@needs_c
@pytest.mark.parametrize("h,w", [(1, 1), (7, 33), (8, 8), (33, 7), (32, 32)])
def test_fast_lowpass_pieces_and_band_energy_match_the_reference(monkeypatch, h, w):
    x = randn(2, 3, h, w, dtype=torch.float32, seed=h + w)
    kept = F.windows((h, w), 0.3, rule="official")
    corner = F.lowpass_coefficients(x, kept)
    full = scipy.fft.dctn(x.double().numpy(), type=2, norm="ortho", axes=(-2, -1))
    assert rel_error(corner, full[..., : kept[0], : kept[1]]) <= 2e-6
    torch.testing.assert_close(F.lowpass_synthesis(corner, (h, w)),
                               reference(monkeypatch, F.lowpass_synthesis, corner, (h, w)), atol=2e-6, rtol=0)
    for ratio_fn in (F.lowpass, F.highpass):
        torch.testing.assert_close(ratio_fn(x, 0.3, rule="official"),
                                   reference(monkeypatch, ratio_fn, x, 0.3, rule="official"), atol=3e-6, rtol=0)
    for reduce in ("instance", "channel", "all"):
        got = F.band_energy(x, 0.3, reduce=reduce)
        want = reference(monkeypatch, F.band_energy, x.double(), 0.3, reduce=reduce)
        for g, r in zip(got, want):
            assert g.dtype == torch.float32 and g.shape == r.shape
            torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_path_half_inputs_are_computed_in_float32(dtype, monkeypatch):
    x = randn(2, 4, 9, 16, dtype=torch.float32).to(dtype)
    got = F.dct(x)
    assert got.dtype == dtype
    want = reference(monkeypatch, F.dct, x)
    assert torch.equal(got, want) or (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()
    corner = F.lowpass_coefficients(x, (3, 4))
    assert corner.dtype == dtype and corner.shape == (2, 4, 3, 4)


def test_fast_path_is_not_used_where_a_gradient_is_needed():
    x = randn(2, 3, 8, 8, dtype=torch.float32).requires_grad_(True)
    assert not F._fast(x, 2)
    assert not F._fast(x.detach().double(), 2)  # float64: the reference keeps its precision
    assert not F._fast(x.detach(), 3)
    with torch.no_grad():
        assert F._fast(x, 2) == cpu_dct.available()


@needs_c
def test_fast_kernels_range_check_what_goes_into_c():
    x = torch.randn(2, 8, 8)
    with pytest.raises(TypeError, match="float32 CPU"):
        cpu_dct.dct2(x.double())
    with pytest.raises(ValueError, match="map sizes"):
        cpu_dct.dct2(torch.zeros(1, 1, cpu_dct.MAX_SIZE + 1))
    with pytest.raises(ValueError, match="wh"):
        cpu_dct.dct_corner(x, 0, 2)
    with pytest.raises(ValueError, match="ww"):
        cpu_dct.band_energy(x, 2, 9)
    with pytest.raises(ValueError, match="h"):
        cpu_dct.idct_corner(torch.zeros(2, 4, 4), 3, 8)
    with pytest.raises(ValueError, match="shape"):
        cpu_dct.dct2(torch.zeros(5))
    with pytest.raises(ValueError, match="windows"):
        F.lowpass_coefficients(x, (9, 2))
    with pytest.raises(ValueError, match="sizes"):
        F.lowpass_synthesis(x, (4, 8))
    # non-contiguous input is read in logical order
    t = torch.randn(8, 8, 3).permute(2, 0, 1)
    torch.testing.assert_close(cpu_dct.dct2(t), cpu_dct.dct2(t.contiguous()), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_out_buffer_gets_the_same_values_and_may_be_the_input(dtype, dims):
    x = randn(2, 3, 6, 33, dtype=torch.float32, seed=dims).to(dtype)
    for fn in (F.dct, F.idct):
        want = fn(x, dims)
        out = torch.full_like(x, float("nan"))
        assert fn(x, dims, out=out) is out and torch.equal(out, want)
        inplace = x.clone()
        assert fn(inplace, dims, out=inplace) is inplace and torch.equal(inplace, want)


def test_out_buffer_that_does_not_fit_is_refused_naming_out():
    x = randn(2, 3, 8, 8, dtype=torch.float32)
    bad = {"shape": torch.empty(2, 3, 8, 7), "dtype": torch.empty(2, 3, 8, 8, dtype=torch.float64),
           "layout": torch.empty(2, 3, 8, 8).transpose(-1, -2)}
    for out in bad.values():
        with pytest.raises(ValueError, match="^out: expected"):
            F.dct(x, out=out)
    flat = torch.zeros(2 * 3 * 8 * 8 + 1)
    with pytest.raises(ValueError, match="^out: expected the input itself"):
        F.dct(flat[:-1].view(2, 3, 8, 8), out=flat[1:].view(2, 3, 8, 8))  # overlapping, shifted
    with pytest.raises(TypeError, match="^out: expected a torch.Tensor"):
        F.idct(x, out=x.numpy())
    with pytest.raises(ValueError, match="^out: not supported where a gradient"):
        F.dct(x.clone().requires_grad_(), out=torch.empty_like(x))


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_split_with_a_mask_keeping_everything_is_exact(dims):
    # the DCT round trip left float32 noise (7e-7) in the empty high band
    x = torch.randn(2, 3, 5, 6, 7)
    low, high = F.split(x, 1.0, dims=dims)
    assert torch.equal(low, x) and not high.any() and low.data_ptr() != x.data_ptr()
