"""One conformance suite for every backend (torch, cpu, triton) x form x data, against the
reference: same bytes given the same noise, same decode, finite in -> finite out.

Triton runs natively on CUDA, else in Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton_division is imported); the shapes stay tiny for it.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import freqact.kernels as K
from freqact.kernels import cpu
from freqact.kernels import format as fmt
from tests.kernels.helpers import (
    TRITON,
    TRITON_DEVICE,
    assert_same_bytes,
    dyadic,
)

BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(
        not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}")),
    pytest.param("triton", marks=TRITON),
]
# Odd sizes, a 1x1 map, H < B <= W, whole blocks, 1D (N, C, L), Linear input (N, F), 3D.
SHAPES = [(2, 3, 7, 9), (1, 1, 1, 1), (2, 2, 5, 16), (2, 3, 11), (2, 13), (1, 2, 3, 9, 10)]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def _device(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _encode(form: str, x, block, bits, noise, backend):
    if form == "division":
        return K.division_encode(x, block, bits, noise, backend=backend)
    return K.quantize_encode(x, bits, noise, backend=backend)


def _check(form: str, x: torch.Tensor, backend: str, block: int = 8, bits: int = 2) -> None:
    """Bytes of `backend` == the reference's for the same noise; decodes agree both ways."""
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(x.numel())).to(x.device)
    got = _encode(form, x, block, bits, noise, backend)
    want = _encode(form, x.cpu(), block, bits, noise.cpu(), "torch")
    fields = ("lfc", "lo", "step", "codes") if form == "division" else ("lo", "step", "codes")
    assert_same_bytes(got, want, fields)
    x_hat = K.division_decode(want, backend="torch")
    on_cpu = dataclasses.replace(got, **{f: getattr(got, f).cpu() for f in fields})
    for out in (K.division_decode(got, backend=backend),
                K.division_decode(on_cpu, backend="torch")):
        assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out.cpu(), x_hat, rtol=0, atol=0, equal_nan=True)
    if bool(x.isfinite().all()):
        assert bool(x_hat.isfinite().all()), "finite in, finite out"


@pytest.mark.parametrize("form", ["division", "quant"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_ordinary_data(backend, form, shape, bits, dtype):
    if backend == "triton" and form == "quant":
        pytest.skip("Triton has the full form only (quant runs the reference)")
    x = dyadic(shape, dtype, torch.Generator().manual_seed(bits), _device(backend))
    _check(form, x, backend, bits=bits)


@pytest.mark.parametrize("block", [1, 3, 16, 2**64 + 2])
def test_block_sizes(backend, block):
    # A block above every dim covers the whole map (2**64 + 2 must not wrap around in C).
    x = dyadic((1, 2, 3, 9, 10), torch.float32, torch.Generator().manual_seed(3), _device(backend))
    _check("division", x, backend, block=block)


def _bf16_neighbours(values) -> list[float]:
    """Each value's bf16 rounding, and the float32s just above and below it."""
    out = []
    for v in values:
        b = torch.tensor(v, dtype=torch.bfloat16).float()
        out += [b.item(), torch.nextafter(b, torch.tensor(math.inf)).item(),
                torch.nextafter(b, torch.tensor(-math.inf)).item()]
    return out


# Directed-rounding edges: +-0, float32 and bf16 subnormals, exact bf16 values and their float32
# neighbours of both signs, a huge value.
EDGES = _bf16_neighbours([0.0, -0.0, 1.0, -1.0, 3.0e-39, -3.0e-39, 1.0e-45, 9.2e-41, 1.0e30,
                          -2.5, 0.1, -7.0e-3])


@pytest.mark.parametrize("form", ["division", "quant"])
@pytest.mark.parametrize("bits", [1, 8])
def test_directed_rounding_edges(backend, form, bits):
    if backend == "triton" and form == "quant":
        pytest.skip("Triton has the full form only")
    # One 1x3 map per edge value v: its min lands on v, its max just above.
    x = torch.zeros(len(EDGES), 1, 1, 3)
    for i, v in enumerate(EDGES):
        x[i, 0, 0] = torch.tensor([v, v + abs(v) * 0.37, v - 1e-3 * abs(v)])
    _check(form, x.to(_device(backend)), backend, block=8, bits=bits)


def _signed_zero_maps(n: int, gen: torch.Generator) -> torch.Tensor:
    """(4, 3, n) maps whose min or max is zero with -0 and +0 mixed: ReLU-like maps (zeros of
    both signs), all-zero maps of random signs, non-positive maps (max zero), one all -0."""
    relu = dyadic((2, 3, n), torch.float32, gen).clamp(min=0)
    x = torch.cat([relu, -relu[:1], torch.zeros(1, 3, n)])
    signs = torch.rand(x.shape, generator=gen) < 0.5
    x[(x == 0) & signs] = -0.0
    x[3, 0] = -0.0
    return x


@pytest.mark.parametrize("form", ["division", "quant"])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 17, 33, 100])
def test_signed_zero_extremes_are_plus_zero(backend, form, n):
    # Which of -0 and +0 a min keeps depends on the scan order (torch.aminmax and torch.amin
    # already disagree); the format takes a zero min and max as +0, so every backend gives the
    # reference's bytes, and a map of zeros has lo = step = +0 whatever its signs.
    if backend == "triton" and form == "quant":
        pytest.skip("Triton has the full form only")
    x = _signed_zero_maps(n, torch.Generator().manual_seed(n))
    _check(form, x.to(_device(backend)), backend, block=8, bits=2)
    packed = _encode(form, x, 8, 2, None, "torch")
    zeros = (x == 0).flatten(2).all(-1)
    for part in (packed.lo, packed.step):
        assert not bool(part[zeros].signbit().any())


HUGE = 3.0e38


@pytest.mark.parametrize("form", ["division", "quant"])
@pytest.mark.parametrize("case", ["mixed", "positive", "fp16-max", "bf16-max"])
def test_finite_at_the_edges_of_the_float_range(backend, form, case):
    # Block sums, residuals, lo/step spans and decoded sums overflow here; the edge rule keeps
    # them finite, and every backend applies it alike. Values are powers-of-two multiples so the
    # block sums are exact in any order.
    if backend == "triton" and form == "quant":
        pytest.skip("Triton has the full form only")
    gen = torch.Generator().manual_seed(5)
    signs = torch.randint(0, 2, (2, 3, 4, 6), generator=gen) * 2 - 1
    if case == "mixed":
        x = signs * torch.randint(1, 3, signs.shape, generator=gen) * (0.75 * 2.0**127)
    elif case == "positive":
        x = torch.full(signs.shape, torch.finfo(torch.float32).max)
    elif case == "fp16-max":
        x = (65504.0 - 32.0 * torch.randint(0, 2, signs.shape, generator=gen)).half()
    else:
        x = torch.full(signs.shape, fmt.BF16_MAX).bfloat16() * signs
    _check(form, x.to(_device(backend)), backend, block=2, bits=2)


def test_lfc_form_keeps_finite_means_at_the_edges():
    x = torch.full((1, 2, 4, 4), torch.finfo(torch.float32).max)
    out = K.division_decode(K.lfc_encode(x, 2))
    assert torch.equal(out, torch.full_like(x, fmt.BF16_MAX))
    half = K.division_decode(K.lfc_encode(torch.full((1, 1, 4), 65504.0).half(), 4))
    assert torch.equal(half, torch.full_like(half, 65504.0))  # bf16(65504) = 65536: saturated


@pytest.mark.parametrize("form", ["division", "quant"])
def test_no_maps_round_trip(backend, form):
    x = torch.zeros(0, 3, 5, 5, device=_device(backend))
    packed = _encode(form, x, 4, 2, None, backend)
    out = K.division_decode(packed, backend=backend)
    assert out.shape == x.shape and out.dtype == x.dtype and packed.nbytes == 0


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(3, 17), (1, 1), (2, 5, 64), (7, 9), (0, 5)], ids=str)
def test_packing(bits, shape):
    q = torch.randint(0, 2**bits, shape, dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(bits))
    want = K.pack_codes(q, bits, backend="torch")
    assert want.shape[-1] == -(-shape[-1] * bits // 8)
    for backend in ("torch", "cpu") if cpu.available() else ("torch",):
        assert torch.equal(K.pack_codes(q, bits, backend=backend), want)
        assert torch.equal(K.unpack_codes(want, shape[-1], bits, backend=backend), q)


def test_directed_rounding_is_nextafter_of_the_nearest():
    # The bit algorithm of format.bf16_directed (shared by C and Triton) equals the definition
    # "the nearest bf16, moved one bf16 toward the rounding direction when it overshot", on edge
    # values and on 2**16 random float32 bit patterns (NaNs excluded).
    bits = torch.randint(-2**31, 2**31 - 1, (2**16,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int64).to(torch.int32)
    v = torch.cat([bits.view(torch.float32), torch.tensor(EDGES)])
    v = v[~v.isnan()]
    for up in (False, True):
        r = v.to(torch.bfloat16)
        toward = torch.full_like(r, math.inf if up else -math.inf)
        overshot = r.float() < v if up else r.float() > v
        want = torch.where(overshot, torch.nextafter(r, toward), r)
        # The edge rule: finite values saturate at the largest finite bf16.
        want = torch.where(want.isinf() & v.isfinite(), want.sign() * fmt.BF16_MAX, want.float())
        got = fmt.bf16_directed(v, up).float()
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
