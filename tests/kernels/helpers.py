"""Shared by the kernel tests: when the Triton kernels can run, byte comparison of packed forms,
dyadic data, the statistics of stochastic rounding, and the C kernels' documented noise stream."""
from __future__ import annotations

import os

import pytest
import torch

import freqact.kernels as K  # tests/conftest.py set TRITON_INTERPRET where there is no GPU

CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if CUDA else "cpu"
if not K._triton_importable():
    _TRITON_SKIP = "triton is not importable"
elif not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    _TRITON_SKIP = "no CUDA and TRITON_INTERPRET was set to something else"
else:
    _TRITON_SKIP = None
# Marks of a test that runs the Triton kernels (natively on CUDA, else interpreted).
TRITON = [pytest.mark.triton, pytest.mark.skipif(_TRITON_SKIP is not None,
                                                 reason=_TRITON_SKIP or "")]


FIELDS = ("lfc", "lo", "step", "codes")


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """t's raw bytes as an integer tensor (bf16 viewed as uint8), on the CPU, for torch.equal."""
    return (t.view(torch.uint8) if t.dtype == torch.bfloat16 else t).cpu()


def assert_same_bytes(got, want, fields=FIELDS) -> None:
    """Assert two DivisionPacked hold the same tensors, byte for byte, in the given fields."""
    for name in fields:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(bytes_of(a), bytes_of(b)), name
    assert got.nbytes == want.nbytes


def at_thread_counts(fn, counts=(1, 3), seed: int = 5) -> list:
    """fn() under each torch thread count in `counts`, torch's generator seeded the same before
    each call (the thread count restored after): the C kernels' bytes must not depend on it."""
    threads, results = torch.get_num_threads(), []
    try:
        for n in counts:
            torch.set_num_threads(n)
            torch.manual_seed(seed)
            results.append(fn())
    finally:
        torch.set_num_threads(threads)
    return results


def dyadic(shape, dtype, gen, device="cpu") -> torch.Tensor:
    """Gaussian values on a 2**-8 grid: every block sum is exact in float32 whatever the
    summation order, so byte equality with the reference is a strict requirement."""
    return torch.randn(shape, generator=gen).mul_(256).round_().div_(256).to(device, dtype)


def _roundings(x: torch.Tensor, packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element (N * C, P): the fraction f of a step above the lower level, and whether the
    element was rounded up (probability f under stochastic rounding), in float64 on the CPU."""
    x = x.cpu().double()
    means = K.division_decode(K.LfcPacked(packed.lfc.cpu(), x.shape, x.dtype,
                                          packed.block)).double()
    lo = packed.lo.cpu().double()[..., None, None]
    step = packed.step.cpu().double()[..., None, None]
    t = (x - means - lo) / step
    f = t - t.floor()
    up = (K.division_decode(packed).cpu().double() - x) / step > 0
    return f.flatten(1), up.flatten(1).double()


def assert_stochastic_rounding(x: torch.Tensor, packed) -> None:
    """Assert (4 sigma bounds) that packed = division_encode(x) rounded every residual up with
    probability equal to its fraction of a step: the error's mean and variance are those of
    stochastic rounding, and neighbouring elements (on Triton, Philox gives four per call) round
    independently.

    Args:
        x: float32 maps (N, C, H, W).
        packed: a full DivisionPacked of x.
    """
    f, up = _roundings(x, packed)
    var = f * (1 - f)
    err = up - f  # the rounding error in steps
    assert err.sum().abs() <= 4 * var.sum().sqrt()
    var_of_sq = f * (1 - f) ** 4 + (1 - f) * f**4 - var**2
    assert (err.pow(2).sum() - var.sum()).abs() <= 4 * var_of_sq.sum().sqrt()
    for lag in (1, 2, 3):  # disjoint pairs (i, i + lag)
        i = torch.arange(f.shape[1] - lag)
        i = i[(i // lag) % 2 == 0]
        p = f[:, i] * f[:, i + lag]
        assert (up[:, i] * up[:, i + lag] - p).sum().abs() <= 4 * (p * (1 - p)).sum().sqrt()


def stream_keys(seed: int, maps: int) -> list[tuple[int, int]]:
    """The documented noise keys (add, mul) of maps 0 .. maps - 1, in Python integers: the low 32
    bits of SplitMix64's draw at state seed + (m + 1) * gamma, and its high 32 bits with the
    lowest set."""
    mask64 = 2**64 - 1
    keys = []
    for m in range(maps):
        z = (seed + (m + 1) * 0x9E3779B97F4A7C15) & mask64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask64
        z ^= z >> 31
        keys.append((z & 0xFFFFFFFF, (z >> 32) | 1))
    return keys


def stream_uniforms(seed: int, maps: int, n: int) -> torch.Tensor:
    """The documented noise of the C kernels, written independently in Python integers, (maps, n):
    element t of map m takes the top 24 bits of lowbias32((t * mul + add) mod 2**32), times
    2**-24, (add, mul) the map's `stream_keys`."""
    mask32 = 2**32 - 1
    out = []
    for add, mul in stream_keys(seed, maps):
        for t in range(n):
            x = (t * mul + add) & mask32
            x ^= x >> 16
            x = (x * 0x21F0AAAD) & mask32
            x ^= x >> 15
            x = (x * 0x735A2D97) & mask32
            x ^= x >> 15
            out.append((x >> 8) * 2.0**-24)
    return torch.tensor(out, dtype=torch.float32).reshape(maps, n)
