"""What only the C kernels (freqact/kernels/cpu_division.c) do: thread-count independence, their
own noise stream, and the build cache. Their bytes against the reference (every form, edge values,
packing) are in test_conformance.py; memory safety and trust of the cache in test_safety.py.
"""
from __future__ import annotations

import pytest
import torch

import freqact.kernels as K
from freqact.kernels import cpu
from freqact.kernels import format as fmt
from tests.kernels.helpers import assert_same_bytes, at_thread_counts, dyadic

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason=f"C kernels unavailable: {cpu.unavailable_reason()}")

def test_the_thread_count_does_not_change_the_bytes():
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(4))

    def codec_calls():
        packed = K.division_encode(x, backend="cpu")
        return packed, K.division_decode(packed, backend="cpu"), K.pack_mask(x, 0.0, backend="cpu")
    one, three = at_thread_counts(codec_calls)
    assert_same_bytes(one[0], three[0])
    assert torch.equal(one[1], three[1]) and torch.equal(one[2], three[2])


def test_library_is_cached_by_content_and_built_atomically(monkeypatch, tmp_path):
    monkeypatch.setenv("FREQACT_CACHE", str(tmp_path))
    path = cpu.library_path()
    assert path.parent == tmp_path and path.name.startswith("cpu_division-")
    cpu._build(path)
    # No temporary file left; the content hash beside the library.
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]
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
                          K.division_encode(x, 4, 2, noise, backend="torch"))
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
    lfc, lo, step, codes = cpu.encode(x, fmt.geometry(x.shape, 4), 2, None, seed)
    want = K.division_encode(x, 4, 2, noise, backend="torch")
    got = fmt.DivisionPacked(lfc, lo, step, codes, x.shape, x.dtype, 4, 2)
    assert_same_bytes(got, want)
