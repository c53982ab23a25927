"""Both fused backends against the torch reference: the Triton kernels and the C kernels.

Byte equality on dyadic data (every block sum exact in any order), per form and edge value, is
test_conformance.py's; here: general float32 data (equal up to rare bf16 ties of the block
means), non-contiguous inputs, and the fused kernels' own noise.
Their own noise must round stochastically, reproducibly under torch.manual_seed.

Without a GPU the Triton kernels run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set
by tests/conftest.py before triton_division is imported); with CUDA they run natively on the
device. The interpreter is slow, so the shapes stay tiny (a few programs each).
"""
from __future__ import annotations

import pytest
import torch

import freqact.kernels as K
from freqact.kernels import cpu
from tests.kernels.helpers import (
    FIELDS,
    TRITON,
    TRITON_DEVICE,
    assert_same_bytes,
    assert_stochastic_rounding,
    dyadic,
)

BACKENDS = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}")),
    pytest.param("triton", marks=TRITON),
]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def _device(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


def test_gaussian_means_match_up_to_summation_order_ties(backend):
    # Raw float32 data: block sums may round differently (another summation order), which can
    # flip a bf16 rounding of the mean when it sits on a rounding boundary (rare). Tolerated: at
    # most 1 % of blocks off by one bf16 ulp; maps whose lfc, lo and step all agree must have
    # identical codes.
    device = _device(backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 20, 23, generator=gen).to(device)
    noise = torch.rand(x.shape, generator=gen).to(device)
    got = K.division_encode(x, 4, 2, noise, backend=backend)
    want = K.division_encode(x.cpu(), 4, 2, noise.cpu(), backend="torch")
    ulps = (got.lfc.view(torch.int16).int() - want.lfc.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).float().mean() <= 0.01
    same = ((ulps.flatten(2).amax(-1) == 0) & (got.lo.view(torch.int16) == want.lo.view(torch.int16))
            & (got.step.view(torch.int16) == want.step.view(torch.int16)))
    assert same.float().mean() >= 0.75
    assert torch.equal(got.codes[same], want.codes[same])


@pytest.mark.parametrize("layout", ["channels_last", "strided", "3d_blocks"])
def test_non_contiguous_inputs(backend, layout):
    device = _device(backend)
    gen = torch.Generator().manual_seed(2)
    if layout == "channels_last":
        x = dyadic((2, 3, 9, 10), torch.float32, gen, device).to(
            memory_format=torch.channels_last)
    elif layout == "strided":
        x = dyadic((2, 3, 9, 20), torch.float16, gen, device)[..., ::2].transpose(2, 3)
    else:
        x = dyadic((1, 2, 5, 6, 7), torch.bfloat16, gen, device)[:, :, 1:]
    noise = torch.rand(x.shape[::-1], generator=gen).to(device).permute(
        *range(x.dim() - 1, -1, -1))
    got = K.division_encode(x, 2, 4, noise, backend=backend)
    assert_same_bytes(got, K.division_encode(x.cpu(), 2, 4, noise.cpu(), backend="torch"))


@pytest.mark.parametrize("backend", [*BACKENDS, "torch"])  # the reference's torch.rand too
def test_stochastic_rounding_unbiased_and_independent(backend):
    # 30 maps of 12x16 (several to a Triton program); one 40x48 map (loops in a program).
    gen = torch.Generator().manual_seed(3)
    for shape in [(6, 5, 12, 16), (1, 1, 40, 48)]:
        x = torch.randn(shape, generator=gen).to(_device(backend))
        torch.manual_seed(0)
        assert_stochastic_rounding(x, K.division_encode(x, 8, 2, backend=backend))


def test_identical_maps_get_independent_noise(backend):
    x = torch.randn(1, 1, 7, 9, generator=torch.Generator().manual_seed(7)).to(_device(backend))
    codes = K.division_encode(x.expand(16, 3, 7, 9), 8, 2, backend=backend).codes.flatten(0, 1)
    assert len({bytes(row.tolist()) for row in codes}) > 40


def test_seed_reproducible_and_calls_differ(backend):
    x = torch.randn(1, 2, 12, 12, generator=torch.Generator().manual_seed(4)).to(_device(backend))
    torch.manual_seed(5)
    first = K.division_encode(x, backend=backend)
    second = K.division_encode(x, backend=backend)
    torch.manual_seed(5)
    again = K.division_encode(x, backend=backend)
    assert_same_bytes(first, again)
    assert not torch.equal(first.codes, second.codes)


def test_no_autograd_link_to_the_input(backend):
    x = torch.randn(2, 3, 5, 5, device=_device(backend), requires_grad=True)
    packed = K.division_encode(x, backend=backend)
    assert not any(getattr(packed, n).requires_grad for n in FIELDS)
    assert not K.division_decode(packed, backend=backend).requires_grad


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
def test_constant_zero_and_nonfinite_maps(backend):
    x = torch.randn(3, 2, 6, 5, generator=torch.Generator().manual_seed(6)).to(_device(backend))
    x[0, 0] = 1.5  # constant: step 0, codes 0, decoded exactly
    x[0, 1] = 0.0
    x[1, 0, 2, 3] = float("nan")
    x[1, 1, 0, 0] = float("inf")
    packed = K.division_encode(x, 4, 2, backend=backend)
    assert packed.step[0].eq(0).all() and packed.codes[0].eq(0).all()
    assert packed.lo[1].float().isnan().all() and packed.step[1].float().isnan().all()
    for out in (K.division_decode(packed, backend=backend), K.division_decode(packed, backend="torch")):
        assert torch.equal(out[0], x[0])
        assert out[1].isnan().all()
        assert out[2].isfinite().all()
