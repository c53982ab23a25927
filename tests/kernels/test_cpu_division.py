"""What only the C kernels (freqact/kernels/cpu_division.c) do: the quant and no-lfc forms,
thread-count independence, directed rounding at the edges of bf16, packing, and the build cache.

Their bytes against the reference, shared with the Triton kernels, are in test_fused_kernels.py.
"""
from __future__ import annotations

import pytest
import torch

import freqact.kernels as K
from freqact.kernels import cpu
from freqact.kernels import reference as R
from tests.kernels.helpers import assert_same_bytes, dyadic

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason=f"C kernels unavailable: {cpu.unavailable_reason()}")

BITS = [1, 2, 4, 8]
SHAPES = [(2, 3, 7, 9), (1, 1, 1, 1), (2, 3, 11), (2, 13), (1, 2, 3, 9, 10)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_quant_and_no_lfc_forms(shape, bits):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen)  # no block sums: exact on any data
    noise = torch.rand(shape, generator=gen)
    got = K.quantize_encode(x, bits, noise, backend="cpu")
    want = R.quantize_encode(x, bits, noise)
    assert got.lfc is None and got.block is None
    assert_same_bytes(got, want, ("lo", "step", "codes"))
    assert torch.equal(K.division_decode(got, backend="cpu"), R.division_decode(want))
    # division-no-lfc drops the block means: the C decode then uses lo alone, like the reference.
    full = R.division_encode(dyadic(shape, torch.float32, gen), 4, bits, noise)
    no_lfc = R.DivisionPacked(None, full.lo, full.step, full.codes, full.shape, full.dtype, None,
                              bits)
    assert torch.equal(K.division_decode(no_lfc, backend="cpu"), R.division_decode(no_lfc))


def test_the_thread_count_does_not_change_the_bytes():
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            torch.manual_seed(5)
            results.append(K.division_encode(x, backend="cpu"))
            packed = results[-1]
            results.append(K.division_decode(packed, backend="cpu"))
            results.append(K.pack_mask(x, 0.0, backend="cpu"))
    finally:
        torch.set_num_threads(threads)
    assert_same_bytes(results[0], results[3])
    assert torch.equal(results[1], results[4]) and torch.equal(results[2], results[5])


def test_directed_rounding_of_lo_and_step_at_every_sign_and_zero():
    # Maps whose min/max land exactly on, just above and just below bf16 values of both signs
    # (and zero, where rounding down crosses to -0's neighbour): the reference's torch.nextafter
    # is the oracle.
    values = []
    for v in (0.0, 1.0, -1.0, 3.0e-39, -3.0e-39, 1.0e30, -2.5):
        b = torch.tensor(v, dtype=torch.bfloat16).float().item()
        values += [b, torch.nextafter(torch.tensor(b), torch.tensor(float("inf"))).item(),
                   torch.nextafter(torch.tensor(b), torch.tensor(float("-inf"))).item()]
    x = torch.zeros(len(values), 1, 1, 3)
    for i, v in enumerate(values):
        x[i, 0, 0] = torch.tensor([v, v + abs(v) * 0.37, v - 1e-3])
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(8))
    for bits in BITS:
        assert_same_bytes(K.quantize_encode(x, bits, noise, backend="cpu"),
                           R.quantize_encode(x, bits, noise), ("lo", "step", "codes"))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(3, 17), (1, 1), (2, 5, 64), (7, 9)], ids=str)
def test_packing_matches_reference(bits, shape):
    q = torch.randint(0, 2**bits, shape, dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(bits))
    packed = K.pack_codes(q, bits, backend="cpu")
    assert torch.equal(packed, R.pack_codes(q, bits))
    assert torch.equal(K.unpack_codes(packed, shape[-1], bits, backend="cpu"),
                       R.unpack_codes(packed, shape[-1], bits))


def test_library_is_cached_by_content_and_built_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv("FREQACT_CACHE", str(tmp_path))
    path = cpu.library_path()
    assert path.parent == tmp_path and path.name.startswith("cpu_division-")
    cpu._build(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    import ctypes
    assert hasattr(ctypes.CDLL(str(path)), "freqact_division_encode")
    monkeypatch.setenv("CC", "cc -DFREQACT_OTHER_FLAGS")
    assert cpu.library_path() != path  # another compiler command: another file


def test_a_compiler_without_openmp_still_builds_single_threaded(monkeypatch, tmp_path):
    fake = tmp_path / "cc-without-openmp"
    fake.write_text('#!/bin/sh\ncase "$*" in *-fopenmp*) echo "no OpenMP here" >&2; exit 1;; '
                    'esac\nexec cc "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("FREQACT_CACHE", str(tmp_path / "cache"))
    cpu._library.cache_clear()
    try:
        assert cpu.available(), cpu.unavailable_reason()
        x = dyadic((2, 3, 9, 10), torch.float32, torch.Generator().manual_seed(9))
        noise = torch.rand(x.shape)
        assert_same_bytes(K.division_encode(x, 4, 2, noise, backend="cpu"),
                          R.division_encode(x, 4, 2, noise))
    finally:
        cpu._library.cache_clear()


def _splitmix_uniforms(seed: int, count: int) -> torch.Tensor:
    """The documented noise of the C kernels, written independently in Python integers: element g
    takes bits 40-63 (even g) or 16-39 (odd g) of SplitMix64's draw at seed + (g // 2 + 1) * gamma,
    times 2**-24."""
    mask = 2**64 - 1
    out = []
    for g in range(count):
        z = (seed + (g // 2 + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append(((z >> 16) & 0xFFFFFF if g % 2 else z >> 40) * 2.0**-24)
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (3, 1, 5)], ids=str)  # odd maps: pairs straddle
def test_own_noise_is_the_documented_splitmix_stream(shape):
    seed = 0x0123456789ABCDEF
    x = dyadic(shape, torch.float32, torch.Generator().manual_seed(10))
    noise = _splitmix_uniforms(seed, x.numel()).reshape(shape)
    lfc, lo, step, codes = cpu.division_encode(x, 4, 2, None, seed)
    want = R.division_encode(x, 4, 2, noise)
    got = R.DivisionPacked(lfc, lo, step, codes, x.shape, x.dtype, 4, 2)
    assert_same_bytes(got, want)
