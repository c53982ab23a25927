"""What only the C kernels (freqact/kernels/cpu_division.c) do: thread-count independence, their
own noise stream, and the build cache. Their bytes against the reference (every form, edge values,
packing) are in test_conformance.py; memory safety and trust of the cache in test_safety.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import freqact.kernels as K
from freqact.kernels import cpu
from freqact.kernels import format as fmt
from tests.kernels.helpers import (
    assert_same_bytes,
    at_thread_counts,
    dyadic,
    stream_keys,
    stream_uniforms,
)

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason=f"C kernels unavailable: {cpu.unavailable_reason()}")

# The build flags at -O0 (the C semantics of -O3: a 1 s build instead of 20 s) for the tests that
# build the library again.
_AT_O0 = tuple("-O0" if f == "-O3" else f for f in cpu.CFLAGS)

def test_the_thread_count_does_not_change_the_bytes():
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(4))

    def codec_calls():
        packed = K.division_encode(x, backend="cpu")
        return packed, K.division_decode(packed, backend="cpu"), K.pack_mask(x, 0.0, backend="cpu")
    one, three = at_thread_counts(codec_calls)
    assert_same_bytes(one[0], three[0])
    assert torch.equal(one[1], three[1]) and torch.equal(one[2], three[2])


def test_library_is_cached_by_content_and_built_atomically(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "CFLAGS", _AT_O0)  # only the cache matters here: a quick build
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
    monkeypatch.setattr(cpu, "CFLAGS", _AT_O0)  # the same C semantics, a quick build
    cpu._library.cache_clear()
    try:
        assert cpu.available(), cpu.unavailable_reason()
        x = dyadic((2, 3, 9, 10), torch.float32, torch.Generator().manual_seed(9))
        noise = torch.rand(x.shape)
        assert_same_bytes(K.division_encode(x, 4, 2, noise, backend="cpu"),
                          K.division_encode(x, 4, 2, noise, backend="torch"))
    finally:
        cpu._library.cache_clear()


@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (3, 1, 5)], ids=str)  # odd maps: tails
def test_own_noise_is_the_documented_stream(shape):
    seed = 0x0123456789ABCDEF
    x = dyadic(shape, torch.float32, torch.Generator().manual_seed(10))
    noise = stream_uniforms(seed, shape[0] * shape[1], x[0, 0].numel()).reshape(shape)
    lfc, lo, step, codes = cpu.encode(x, fmt.geometry(x.shape, 4), 2, None, seed)
    want = K.division_encode(x, 4, 2, noise, backend="torch")
    got = fmt.DivisionPacked(lfc, lo, step, codes, x.shape, x.dtype, 4, 2)
    assert_same_bytes(got, want)


def shared_inputs_per_map_pair(keys: list[tuple[int, int]], n: int) -> torch.Tensor:
    """How many hash inputs (t * mul + add mod 2**32, t < n) each pair of maps with a common input
    has in common (the hash is a bijection: equal inputs are equal uniforms)."""
    add, mul = (torch.tensor(k, dtype=torch.int64)[:, None] for k in zip(*keys))
    inputs = (torch.arange(n)[None] * mul + add) & 0xFFFFFFFF
    owner = torch.arange(len(keys))[:, None].expand(-1, n)
    order = inputs.flatten().argsort()
    x, m = inputs.flatten()[order], owner.flatten()[order]
    same = (x[1:] == x[:-1]) & (m[1:] != m[:-1])
    pairs = torch.minimum(m[1:], m[:-1])[same] * len(keys) + torch.maximum(m[1:], m[:-1])[same]
    return pairs.unique(return_counts=True)[1]


def test_maps_draw_from_unrelated_runs_of_the_stream():
    # 65,536 maps of 256 elements: 16.8 M inputs in 2**32 meet by chance in ~33 k pairs of maps,
    # one input each (two in a pair: ~0.2 expected). Maps that read windows of one sequence (the
    # same step for every map) shared runs: ~240 pairs of ~150 inputs here.
    counts = shared_inputs_per_map_pair(stream_keys(0x0DDBA11CAFEF00D5, 2**16), 256)
    assert 10_000 < len(counts) < 100_000 and counts.max() <= 3, (len(counts), counts.max())


def own_noise_against_torch(x, block, bits, seed):
    """The C encode drawing its own noise from seed, checked against the torch reference given
    that noise (the documented stream); returns (got, want)."""
    noise = stream_uniforms(seed, x.shape[0] * x.shape[1], x[0, 0].numel()).reshape(x.shape)
    lfc, lo, step, codes = cpu.encode(x, fmt.geometry(x.shape, block), bits, None, seed)
    if block is None:
        got = fmt.QuantPacked(lo, step, codes, x.shape, x.dtype, bits)
        want = K.quantize_encode(x, bits, noise, backend="torch")
    else:
        got = fmt.DivisionPacked(lfc, lo, step, codes, x.shape, x.dtype, block, bits)
        want = K.division_encode(x, block, bits, noise, backend="torch")
        # a NaN mean's payload is torch's own (a one-element NaN block): compared as values
        torch.testing.assert_close(got.lfc, want.lfc, rtol=0, atol=0, equal_nan=True)
    assert_same_bytes(got, want, ("lo", "step", "codes"))
    return got, want


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("block", [None, 64, 4], ids=["quant", "one-block", "blocks"])
def test_small_maps_sixteen_at_a_time_give_the_per_map_bytes(bits, block):
    # Maps of at most 256 elements go 16 at a time in lanes (encode_small_maps): 38 maps are two
    # groups and 6 maps of the per-map path; odd lengths leave a tail after the last lane group;
    # block 4 gives maps of several blocks (edge blocks included).
    seed = 0x5EED5EED5EED5EED
    gen = torch.Generator().manual_seed(bits)
    for shape in [(2, 19, 1), (2, 19, 7), (2, 19, 15), (2, 19, 16), (2, 19, 4, 4),
                  (1, 38, 8, 8), (1, 38, 3, 5), (1, 38, 16, 16), (1, 38, 2, 7, 9)]:
        x = dyadic(shape, torch.float32, gen)
        flat = x.view(x.shape[0] * x.shape[1], -1)
        flat[3, 0], flat[20, -1], flat[21, 0] = float("nan"), float("inf"), -float("inf")
        flat[22] = 0.5  # a constant map: step 0
        flat[23] = flat[23].clamp(min=0)  # ReLU-like, zeros of both signs: its min is +0
        flat[23][(flat[23] == 0) & (torch.arange(flat.shape[1]) % 2 == 0)] = -0.0
        own_noise_against_torch(x, block, bits, seed)


# Map lengths around the kernels' vector widths: 8 lanes for the min/max, a lane group (8 or 16)
# for the quantise, pack, unpack and dequantise steps and for the uniforms of one noise step; odd
# lengths leave tails drawn from the same step.
LENGTHS = [1, 7, 8, 9, 15, 16, 17, 31, 33]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("block", [None, 4], ids=["quant", "division"])
def test_map_lengths_around_the_vector_widths_own_noise_and_edges(bits, block):
    seed = 0xFEDCBA9876543210
    gen = torch.Generator().manual_seed(bits)
    for n in LENGTHS:
        x = dyadic((2, 3, n), torch.float32, gen)
        x[1, 0, n // 2], x[1, 1, 0], x[1, 2, n - 1] = float("nan"), float("inf"), -float("inf")
        got, want = own_noise_against_torch(x, block, bits, seed)
        torch.testing.assert_close(K.division_decode(got, backend="cpu"),
                                   K.division_decode(want, backend="torch"), rtol=0, atol=0,
                                   equal_nan=True)


def test_maps_longer_than_the_noise_stream_are_refused_before_c():
    # A map's elements are numbered in 32 bits in the C noise stream: 2**32 elements pass the
    # check, one more is refused by name (geometries only: nothing of that size is allocated).
    refused = r"^x( \(.*\))?: expected quant maps of at most 2\*\*32 elements"
    for n, ok in ((2**32, True), (2**32 + 1, False)):
        geom = fmt.geometry((1, 2, n), None)
        token = cpu.TokenGeometry((1, 1, n, 8), (1, 1, 8), (1, n), (0, 1, 0), True)
        for make, arg in ((cpu._geometry_args.__wrapped__, geom),
                          (cpu._token_args.__wrapped__, token)):
            if ok:
                make(arg, 2)
            else:
                with pytest.raises(ValueError, match=refused):
                    make(arg, 2)


def test_the_backend_functions_check_what_they_pass_to_c():
    # Reached through the dispatchers only after their checks, but exported: each read or wrote
    # past a buffer when called directly (ASan) before 2026-12-03
    u8 = torch.uint8
    with pytest.raises(ValueError, match="^bits"):
        cpu.pack_codes(torch.zeros(1, 100, dtype=u8), 3)
    with pytest.raises(ValueError, match="^codes: expected a last dim of ceil\\(count \\* bits / 8\\) = 25"):
        cpu.unpack_codes(torch.zeros(1, 1, dtype=u8), 100, 2)
    with pytest.raises(ValueError, match="^packed: expected a 1-D tensor of ceil\\(prod\\(shape\\) / 8\\) = 13"):
        cpu.unpack_mask(torch.zeros(1, dtype=u8), torch.Size([100]), torch.float32, 0.0, 1.0)
    geom = fmt.geometry((2, 3, 8, 8), 4)
    with pytest.raises(ValueError, match="^x: expected maps \\(2, 3, 8, 8\\)"):
        cpu.encode(torch.randn(2, 3, 8, 4), geom, 2, None, 0)
    lfc, lo, step, codes = cpu.encode(torch.randn(2, 3, 8, 8), geom, 2, None, 0)
    with pytest.raises(ValueError, match="^packed.codes"):
        cpu.decode(lfc, lo, step, codes[..., :1], geom, 2, torch.float32)
    with pytest.raises(ValueError, match="^packed.lfc"):
        cpu.decode(lfc[:1], lo, step, codes, geom, 2, torch.float32)
    assert cpu.decode(lfc, lo, step, codes, geom, 2, torch.float32).shape == (2, 3, 8, 8)


@pytest.mark.parametrize("bits", [0, 3, 5, 16, True, 2.0])
def test_encode_and_decode_check_bits_before_c(bits):
    # The C code packs 1, 2, 4 or 8 bits (any other value as 8): with the codes sized for bits,
    # bits 0 wrote and read through NULL, 3 and 5 wrote (encode) or read (decode) past the codes
    # (ASan: heap-buffer-overflow in pack8 / unpack8), 16 and True gave codes of other bits
    x = torch.randn(2, 3, 8, 8)
    for block in (4, None):
        geom = fmt.geometry(x.shape, block)
        with pytest.raises((TypeError, ValueError), match="^bits"):
            cpu.encode(x, geom, bits, None, 0)
        lfc, lo, step, _ = cpu.encode(x, geom, 2, None, 0)
        codes = torch.zeros(geom.codes_shape(int(bits)), dtype=torch.uint8)
        with pytest.raises((TypeError, ValueError), match="^bits"):
            cpu.decode(lfc, lo, step, codes, geom, bits, torch.float32)


def test_encode_and_decode_check_seed_dtype_layout_and_empty_maps():
    # Refused by name, where they were a ctypes.ArgumentError (seed 1.5), taken as 1 (True), a
    # TypeError of torch.finfo after the C code ran (dtype int32), an error of `contiguous` (a
    # sparse x), or quantised maps of no elements (the reference's aminmax refuses them)
    x = torch.randn(2, 3, 8, 8)
    geom = fmt.geometry(x.shape, 4)
    for seed in (1.5, True, None, "1"):
        with pytest.raises(TypeError, match="^seed: expected an integer"):
            cpu.encode(x, geom, 2, None, seed)
    for a, b in zip(cpu.encode(x, geom, 2, None, -1), cpu.encode(x, geom, 2, None, 2**64 - 1)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # taken modulo 2**64
    for name, args in (("x", (x.to_sparse(), None)), ("noise", (x, torch.rand(x.shape).to_sparse()))):
        with pytest.raises(TypeError, match=f"^{name}: expected a dense"):
            cpu.encode(*args[:1], geom, 2, args[1], 0)
    lfc, lo, step, codes = cpu.encode(x, geom, 2, None, 0)
    for dtype in (torch.int32, torch.bool, "float32"):
        with pytest.raises(TypeError, match="^dtype: expected a floating"):
            cpu.decode(lfc, lo, step, codes, geom, 2, dtype)
    for shape in ((2, 3, 0, 8), (2, 3, 8, 0)):
        with pytest.raises(ValueError, match="^x: expected maps of at least one element"):
            cpu.encode(torch.zeros(shape), fmt.geometry(shape, 4), 2, None, 0)


def test_geometries_not_of_their_own_sizes_and_block_are_refused_before_c():
    # The C code trusts geom's block extents and counts: a zero extent divided by zero (SIGFPE
    # in make_geometry), counts or extents that do not tile the map gave other bytes
    x = torch.randn(2, 3, 8, 8)
    G = fmt.Geometry
    for geom in [G(2, 3, (8, 8), (0, 4), (2, 2), 4), G(2, 3, (8, 8), (4, 4), (1, 1), 4),
                 G(2, 3, (8, 8), (4, 4), (3, 3), 4), G(2, 3, (8, 8), (16, 16), (2, 2), 4),
                 G(2, 3, (8, 8), (2, 2), (4, 4), 4), G(2, 3, (8, 8), (4, 4), (2, 2), None)]:
        with pytest.raises(ValueError, match="^geom: expected format.geometry"):
            cpu.encode(x, geom, 2, None, 0)
        parts = [torch.zeros(shape, dtype=dtype) for shape, dtype in (
            (geom.lfc_shape, torch.bfloat16), (geom.stat_shape, torch.bfloat16),
            (geom.stat_shape, torch.bfloat16), (geom.codes_shape(2), torch.uint8))]
        with pytest.raises(ValueError, match="^geom: expected format.geometry"):
            cpu.decode(*parts, geom, 2, torch.float32)


def test_the_packing_functions_check_device_dtype_and_numbers():
    # A meta tensor's NULL data pointer was dereferenced (SEGV in pack_fixed, unpack_fixed,
    # unpack8); pack_mask read a float16 or int8 x as float32, past its end (ASan:
    # heap-buffer-overflow in mask_g), a float64 x as other values; unpack_mask gave float32 for
    # any dtype; a str bound was a ctypes.ArgumentError
    u8, f32 = torch.uint8, torch.float32
    q = torch.randint(0, 4, (3, 37), dtype=u8)
    packed, x = K.pack_codes(q, 2, backend="torch"), torch.randn(1001)
    mask = K.pack_mask(x, 0.0, backend="torch")
    meta = torch.device("meta")
    for name, call in (("q", lambda: cpu.pack_codes(q.to(meta), 2)),
                       ("codes", lambda: cpu.unpack_codes(packed.to(meta), 37, 2)),
                       ("x", lambda: cpu.pack_mask(x.to(meta), 0.0)),
                       ("packed", lambda: cpu.unpack_mask(mask.to(meta), x.shape, f32, 0.0, 1.0))):
        with pytest.raises(ValueError, match=f"^{name}: expected a CPU tensor"):
            call()
    for dtype in (torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.bool):
        with pytest.raises(TypeError, match="^x: expected a torch.float32 tensor"):
            cpu.pack_mask(x.to(dtype), 0.0)
    for dtype in (torch.bfloat16, torch.float64):
        with pytest.raises(ValueError, match="^dtype: expected torch.float32"):
            cpu.unpack_mask(mask, x.shape, dtype, 0.0, 1.0)
    for name, call in (("lower", lambda: cpu.pack_mask(x, "0")),
                       ("upper", lambda: cpu.pack_mask(x, 0.0, torch.tensor(1.0))),
                       ("on", lambda: cpu.unpack_mask(mask, x.shape, f32, 0.0, "1"))):
        with pytest.raises(TypeError, match=f"^{name}: expected a real number"):
            call()
    with pytest.raises(ValueError, match="^shape"):
        cpu.unpack_mask(mask[:1], (-1, -8), f32, 0.0, 1.0)
    assert torch.equal(cpu.pack_mask(x, 0, 1), K.pack_mask(x, 0.0, 1.0, backend="torch"))


def test_views_with_the_negative_bit_are_read_as_their_values():
    # Each was read as its stored negation (a contiguous one keeps the bit through .contiguous())
    x = dyadic((2, 3, 8, 8), torch.float32, torch.Generator().manual_seed(3))
    noise = torch.rand(x.shape)
    geom = fmt.geometry(x.shape, 4)
    want = cpu.encode(-x, geom, 2, noise, 0)
    lfc, lo, step, codes = cpu.encode(torch._neg_view(x), geom, 2, noise, 0)
    for a, b in zip((lfc, lo, step, codes), want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    out = cpu.decode(lfc, lo, step, codes, geom, 2, torch.float32)
    assert torch.equal(cpu.decode(lfc, torch._neg_view(-lo), step, codes, geom, 2, torch.float32),
                       out)
    assert torch.equal(cpu.pack_mask(torch._neg_view(x), 0.0), cpu.pack_mask(-x, 0.0))


def test_cached_geometry_and_c_arrays_equal_fresh_ones():
    """`format.geometry` is cached for plain int sizes and blocks, `cpu._geometry_args` per
    geometry: the cached values equal freshly computed ones, other values are not cached."""
    for shape, block in [((2, 3, 8, 8), 4), (torch.Size([5, 7, 9]), 8), ((4, 10), None),
                         ((1, 2, 3, 5, 7), 2)]:
        geom = fmt.geometry(shape, block)
        assert geom == fmt._geometry(shape, block) and geom is fmt.geometry(tuple(shape), block)
        args = cpu._geometry_args(geom, 2)
        assert args is cpu._geometry_args(geom, 2)
        assert list(args) == list(cpu._geometry_args.__wrapped__(geom, 2))
    # a bool block is computed, not cached: not the cached block 1's geometry (True == 1 as a
    # key), and no lookup at all (hits and misses count lookups even when the cache is full)
    assert fmt.geometry((2, 3, 8, 8), 1).block == 1
    info = fmt._cached_geometry.cache_info()
    assert fmt.geometry((2, 3, 8, 8), True).block is True
    after = fmt._cached_geometry.cache_info()
    assert (after.hits, after.misses) == (info.hits, info.misses)
    with pytest.raises((TypeError, ValueError)):
        fmt.geometry((2, 3, 8.0, 8), 4)  # refused as before



_OTHER_PATH_DRIVER = textwrap.dedent("""
    import sys
    import pytest
    from freqact.kernels import cpu
    # the same C semantics at any optimisation level: -O0 builds in 1 s (-O3: 20 s)
    cpu.CFLAGS = tuple("-O0" if f == "-O3" else f for f in cpu.CFLAGS)
    assert cpu.vector_halves() == bool(int(sys.argv[1])), "the other vector path was not built"
    args = ["-q", "-p", "no:cacheprovider", "-x"]
    sys.exit(pytest.main([*args, "-k", "not triton", "tests/kernels/test_conformance.py",
                          "tests/kernels/test_token_kernels.py"])
             or pytest.main([*args, "-k", "documented_stream or small_maps or vector_widths",
                             "tests/kernels/test_cpu_division.py"]))
""")


def test_the_other_vector_path_passes_the_conformance_tests(tmp_path):
    # cpu_division.c works in lane groups of 16 (AVX-512) or of 8 (HALVES16: without AVX-512
    # GCC leaves 16-lane comparisons scalar); a machine builds one of them. The other is built
    # here (-DFREQACT_HALVES16) and must give the reference's bytes in the byte-level tests and
    # draw the documented noise stream.
    other = int(not cpu.vector_halves())
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, CC=f"{os.environ.get('CC', 'cc')} -DFREQACT_HALVES16={other}",
               FREQACT_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", _OTHER_PATH_DRIVER, str(other)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
