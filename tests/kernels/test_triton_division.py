"""The Triton DIVISION kernels against the torch reference, and the backend dispatch.

Without a GPU the kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set here
before triton is first imported); with CUDA they run natively on the device. The interpreter is
slow, so the shapes stay tiny (a few programs each).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # triton.jit reads this when a kernel is decorated, i.e. when triton_division is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import freqact.kernels as K  # noqa: E402
from freqact.kernels import reference as R  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [1, 2, 4, 8]
# Odd sizes, a 1x1 map, H < B <= W, whole blocks, 1D (N, C, L), Linear input (N, F), 3D.
SHAPES = [(2, 3, 7, 9), (1, 1, 1, 1), (2, 2, 5, 16), (2, 3, 16, 16), (2, 3, 11), (2, 13),
          (1, 2, 3, 9, 10)]
FIELDS = ("lfc", "lo", "step", "codes")

needs_triton = pytest.mark.skipif(not K._triton_importable(), reason="triton is not importable")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    needs_triton = pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET was set to something else")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


def _dyadic(shape, dtype, gen) -> torch.Tensor:
    """Gaussian values on a 2**-8 grid: every block sum is exact in float32 whatever the
    summation order, so byte equality with the reference is a strict requirement."""
    x = torch.randn(shape, generator=gen).mul_(256).round_().div_(256)
    return x.to(device=DEVICE, dtype=dtype)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_same_bytes_as_reference_and_cross_decode(shape, bits, dtype):
    gen = torch.Generator().manual_seed(hash((shape, bits)) % 2**31)
    x = _dyadic(shape, dtype, gen)
    noise = torch.rand(shape, generator=gen).to(DEVICE)
    got = K.division_encode(x, 8, bits, noise, backend="triton")
    want = R.division_encode(x, 8, bits, noise)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(_bytes(a), _bytes(b)), name
    assert got.nbytes == want.nbytes
    # Each backend decodes the other's form to the reference's own result, bit for bit.
    x_hat = R.division_decode(want)
    for out in (K.division_decode(want, backend="triton"), R.division_decode(got)):
        assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
        assert torch.equal(out, x_hat)


@needs_triton
@pytest.mark.triton
def test_gaussian_means_match_up_to_summation_order_ties():
    # Raw float32 data: block sums may round differently (another summation order), which can
    # flip a bf16 rounding of the mean when it sits on a rounding boundary (rare).
    # Tolerated: at most 1 % of blocks off by one bf16 ulp; maps whose lfc, lo and step all
    # agree must have identical codes.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 20, 23, generator=gen).to(DEVICE)
    noise = torch.rand(x.shape, generator=gen).to(DEVICE)
    got = K.division_encode(x, 4, 2, noise, backend="triton")
    want = R.division_encode(x, 4, 2, noise)
    ulps = (got.lfc.view(torch.int16).int() - want.lfc.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).float().mean() <= 0.01
    same = ((ulps.flatten(2).amax(-1) == 0) & (got.lo.view(torch.int16) == want.lo.view(torch.int16))
            & (got.step.view(torch.int16) == want.step.view(torch.int16)))
    assert same.float().mean() >= 0.75
    assert torch.equal(got.codes[same], want.codes[same])


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("block", [1, 3, 16])
def test_other_block_sizes(block):
    gen = torch.Generator().manual_seed(block)
    x = _dyadic((2, 3, 7, 9), torch.float32, gen)
    noise = torch.rand(x.shape, generator=gen).to(DEVICE)
    got = K.division_encode(x, block, 2, noise, backend="triton")
    want = R.division_encode(x, block, 2, noise)
    for name in FIELDS:
        assert torch.equal(_bytes(getattr(got, name)), _bytes(getattr(want, name))), name
    assert torch.equal(K.division_decode(got, backend="triton"), R.division_decode(want))


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("layout", ["channels_last", "strided", "3d_blocks"])
def test_non_contiguous_inputs(layout):
    gen = torch.Generator().manual_seed(2)
    if layout == "channels_last":
        x = _dyadic((2, 3, 9, 10), torch.float32, gen).to(memory_format=torch.channels_last)
    elif layout == "strided":
        x = _dyadic((2, 3, 9, 20), torch.float16, gen)[..., ::2].transpose(2, 3)
    else:
        x = _dyadic((1, 2, 5, 6, 7), torch.bfloat16, gen)[:, :, 1:]
    noise = torch.rand(x.shape[::-1], generator=gen).to(DEVICE).permute(*range(x.dim() - 1, -1, -1))
    got = K.division_encode(x, 2, 4, noise, backend="triton")
    want = R.division_encode(x, 2, 4, noise)
    for name in FIELDS:
        assert torch.equal(_bytes(getattr(got, name)), _bytes(getattr(want, name))), name


def _roundings(x: torch.Tensor, packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element (N * C, P): the fraction f of a step above the lower level, and whether the
    element was rounded up (probability f under stochastic rounding), in float64."""
    means = R.division_decode(R.DivisionPacked(packed.lfc, None, None, None, x.shape, x.dtype,
                                               packed.block, None)).double()
    lo = packed.lo.double()[..., None, None]
    step = packed.step.double()[..., None, None]
    t = (x.double() - means - lo) / step
    f = t - t.floor()
    up = (K.division_decode(packed, backend="torch").double() - x.double()) / step > 0
    return f.flatten(1).cpu(), up.flatten(1).double().cpu()


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_stochastic_rounding_unbiased_and_independent(backend):
    # Exact statistics of stochastic rounding bind both backends (4 sigma bounds): mean and
    # variance of the error, and independence of neighbouring elements (which share one Philox
    # call in the kernel). 30 maps of 12x16 go several to a program; one 40x48 map takes loops.
    gen = torch.Generator().manual_seed(3)
    for shape in [(6, 5, 12, 16), (1, 1, 40, 48)]:
        x = torch.randn(shape, generator=gen).to(DEVICE)
        torch.manual_seed(0)
        f, up = _roundings(x, K.division_encode(x, 8, 2, backend=backend))
        var = f * (1 - f)
        err = up - f  # the rounding error in steps
        assert err.sum().abs() <= 4 * var.sum().sqrt()
        var_of_sq = f * (1 - f) ** 4 + (1 - f) * f**4 - var**2
        assert (err.pow(2).sum() - var.sum()).abs() <= 4 * var_of_sq.sum().sqrt()
        for lag in (1, 2, 3):  # disjoint pairs (i, i + lag), within and across Philox calls
            i = torch.arange(f.shape[1] - lag)
            i = i[(i // lag) % 2 == 0]
            p = f[:, i] * f[:, i + lag]
            assert (up[:, i] * up[:, i + lag] - p).sum().abs() <= 4 * (p * (1 - p)).sum().sqrt()


@needs_triton
@pytest.mark.triton
def test_identical_maps_get_independent_noise():
    x = torch.randn(1, 1, 7, 9, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    codes = K.division_encode(x.expand(16, 3, 7, 9), 8, 2, backend="triton").codes.flatten(0, 1)
    assert len({bytes(row.tolist()) for row in codes}) > 40


@needs_triton
@pytest.mark.triton
def test_no_autograd_link_to_the_input():
    x = torch.randn(2, 3, 5, 5, device=DEVICE, requires_grad=True)
    packed = K.division_encode(x, backend="triton")
    assert not any(getattr(packed, n).requires_grad for n in FIELDS)
    assert not K.division_decode(packed, backend="triton").requires_grad


@needs_triton
@pytest.mark.triton
def test_seed_reproducible_and_calls_differ():
    x = torch.randn(1, 2, 12, 12, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    torch.manual_seed(5)
    first = K.division_encode(x, backend="triton").codes
    second = K.division_encode(x, backend="triton").codes
    torch.manual_seed(5)
    again = K.division_encode(x, backend="triton").codes
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


@needs_triton
@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
def test_constant_zero_and_nonfinite_maps():
    x = torch.randn(3, 2, 6, 5, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    x[0, 0] = 1.5  # constant: step 0, codes 0, decoded exactly
    x[0, 1] = 0.0
    x[1, 0, 2, 3] = float("nan")
    x[1, 1, 0, 0] = float("inf")
    packed = K.division_encode(x, 4, 2, backend="triton")
    assert packed.step[0].eq(0).all() and packed.codes[0].eq(0).all()
    for backend in ("triton", "torch"):
        out = K.division_decode(packed, backend=backend)
        assert torch.equal(out[0], x[0])
        assert out[1].isnan().all()
        assert out[2].isfinite().all()


@needs_triton
@pytest.mark.triton
def test_fake_shapes_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for shape in [(2, 13), (2, 3, 11), (2, 3, 7, 9), (1, 2, 3, 9, 10)]:
        want = R.division_encode(torch.randn(shape), 4, 2)
        with FakeTensorMode():
            fake = torch.ops.freqact.division_encode(torch.empty(shape), 4, 2, None, 0)
        assert [tuple(t.shape) for t in fake] == [tuple(getattr(want, n).shape) for n in FIELDS]
    x = torch.randn(1, 2, 3, 4, device=DEVICE)
    noise = torch.rand(x.shape, device=DEVICE)
    torch.library.opcheck(torch.ops.freqact.division_encode.default, (x, 8, 2, noise, 0))
    p = R.division_encode(x, 8, 2, noise)
    torch.library.opcheck(torch.ops.freqact.division_decode.default,
                          (p.lfc, p.lo, p.step, p.codes, list(x.shape), x.dtype, 8, 2))


# --- dispatch (no kernel runs) -------------------------------------------------------------------


def test_dispatch_auto_and_forced_torch_use_the_reference(monkeypatch):
    x = torch.randn(2, 3, 5, 5)
    assert K.backend_for(x) == ("triton" if x.is_cuda and K._triton_importable() else "torch")
    monkeypatch.setenv("FREQACT_KERNELS", "torch")
    assert K.backend_for(x.to(DEVICE)) == "torch"
    noise = torch.rand(x.shape)
    got = K.division_encode(x, 4, 2, noise)
    want = R.division_encode(x, 4, 2, noise)
    assert all(torch.equal(_bytes(getattr(got, n)), _bytes(getattr(want, n))) for n in FIELDS)


def test_dispatch_keyword_overrides_environment(monkeypatch):
    monkeypatch.setenv("FREQACT_KERNELS", "triton")
    assert K.backend_for(torch.zeros(1), "torch") == "torch"


def test_dispatch_errors(monkeypatch):
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError, match="backend"):
        K.division_encode(x, backend="cuda")
    monkeypatch.setenv("FREQACT_KERNELS", "fast")
    with pytest.raises(ValueError, match="FREQACT_KERNELS"):
        K.division_encode(x)
    monkeypatch.delenv("FREQACT_KERNELS")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if K._triton_importable():
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            K.division_encode(x, backend="triton")
    monkeypatch.setattr(K, "_triton_importable", lambda: False)
    with pytest.raises(RuntimeError, match="triton"):
        K.backend_for(x, "triton")
    with pytest.raises(TypeError, match="x"):
        K.division_encode(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="packed"):
        K.division_decode(x)
