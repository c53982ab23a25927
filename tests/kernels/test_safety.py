"""Memory safety of the C kernels and trust of their cache (issue 15.1, 15.2): arguments are
checked against the buffers before any backend runs, and only a library that freqact built for
this user is loaded."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import freqact.kernels as K
from freqact.kernels import cpu

needs_cc = pytest.mark.skipif(not cpu.available(),
                              reason=f"C kernels unavailable: {cpu.unavailable_reason()}")
BACKENDS = ["torch", pytest.param("cpu", marks=needs_cc)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_codes_of_any_shape_pack_and_unpack(backend):
    # Empty work goes to the reference, whose word views raised on some empty shapes
    u8 = torch.uint8
    assert K.pack_codes(torch.zeros(3, 0, dtype=u8), 1, backend=backend).shape == (3, 0)
    assert K.pack_codes(torch.zeros(2, 3, 0, dtype=u8), 4, backend=backend).shape == (2, 3, 0)
    assert K.unpack_codes(torch.zeros(0, 1, dtype=u8), 3, 2, backend=backend).shape == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffers_are_checked_before_any_backend_runs(backend):
    codes = torch.zeros(1, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="^codes: expected a last dim"):
        K.unpack_codes(codes, 400_000_000, 2, backend=backend)  # would read out of bounds
    with pytest.raises(ValueError, match="^count"):
        K.unpack_codes(codes, -1, 2, backend=backend)
    with pytest.raises(ValueError, match="^bits"):
        K.pack_codes(torch.zeros(2, 8, dtype=torch.uint8), 3, backend=backend)
    with pytest.raises(ValueError, match="^q: expected codes < 2"):
        K.pack_codes(torch.full((2, 8), 4, dtype=torch.uint8), 2, backend=backend)
    with pytest.raises(TypeError, match="^q"):
        K.pack_codes(torch.zeros(2, 8), 2, backend=backend)
    with pytest.raises(ValueError, match="^packed: expected a 1-D tensor"):
        K.unpack_mask(torch.zeros(1, dtype=torch.uint8), (4, 4), torch.float32, 0.0, 1.0,
                      backend=backend)
    x = torch.randn(2, 3, 8, 8)
    packed = K.division_encode(x, 4, 2, backend=backend)
    for field, bad in [("codes", packed.codes[:, :, :1]), ("lfc", packed.lfc.float()),
                       ("lo", packed.lo[:1]), ("block", 2**63), ("bits", 4),
                       ("shape", torch.Size([2, 3, 80, 8]))]:
        with pytest.raises((TypeError, ValueError), match=f"^packed.({field}|lfc|codes)"):
            K.division_decode(dataclasses.replace(packed, **{field: bad}), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_maps_of_no_elements_are_refused_by_name_without_a_block_too(backend):
    # quantize_encode's geometry divided by the empty dim's extent (ZeroDivisionError) before
    # its check could name x
    for shape in ((2, 3, 0, 8), (2, 3, 8, 0), (2, 0)):
        for encode in (lambda x: K.quantize_encode(x, backend=backend),
                       lambda x: K.division_encode(x, 4, backend=backend)):
            with pytest.raises(ValueError, match="^x: expected maps of at least one element"):
                encode(torch.zeros(shape))


@needs_cc
def test_huge_block_is_one_block_per_map_not_a_wrapped_int():
    x = torch.randn(2, 3, 5, 6)
    noise = torch.rand(x.shape)
    for block in (2**63, 2**64 + 2):
        got = K.division_encode(x, block, 2, noise, backend="cpu")
        want = K.division_encode(x, 6, 2, noise, backend="torch")
        assert torch.equal(got.codes, want.codes) and torch.equal(got.lo, want.lo)
        assert torch.equal(K.division_decode(got, backend="cpu"),
                           K.division_decode(want, backend="torch"))
    with pytest.raises(ValueError, match="in \\[0, 2\\*\\*63 - 1\\]"):
        cpu._c_int64("count", 2**64 + 2)


_ASAN_DRIVER = textwrap.dedent("""
    import torch, freqact.kernels as K
    from freqact.kernels import cpu, cpu_dct
    # built at -O0: the same loads and stores of the C code, checked, in a fraction of -O3's
    # build time under ASan (135 s for cpu_division.c on a 2-core AVX2 machine)
    cpu.CFLAGS, cpu_dct.CFLAGS = (tuple("-O0" if f == "-O3" else f for f in flags)
                                  for flags in (cpu.CFLAGS, cpu_dct.CFLAGS))
    # (2, 17, 4, 4), (1, 35, 3, 5), (1, 17, 16, 16): small maps 16 at a time in lanes, and the
    # rest one by one
    for shape in [(1, 1, 1), (2, 13), (3, 1, 7, 9), (1, 2, 3, 9, 17), (2, 3, 8, 8), (2, 17, 4, 4),
                  (1, 35, 3, 5), (1, 17, 16, 16)]:
        x = torch.randn(shape)
        for bits in (1, 2, 4, 8):
            for block in (1, 3, 8, 2**64 + 2):
                p = K.division_encode(x, block, bits, backend="cpu")
                K.division_decode(p, backend="cpu")
            K.division_decode(K.quantize_encode(x, bits, backend="cpu"), backend="cpu")
            q = torch.randint(0, 2**bits, (3, 65537 if bits == 1 else 11), dtype=torch.uint8)
            K.unpack_codes(K.pack_codes(q, bits, backend="cpu"), q.shape[-1], bits, backend="cpu")
        m = K.pack_mask(x, 0.0, backend="cpu")
        K.unpack_mask(m, x.shape, torch.float32, 0.0, 1.0, backend="cpu")
    big = torch.randn(4097 * 3 + 5)
    K.unpack_mask(K.pack_mask(big, 0.0, 1.0, backend="cpu"), big.shape, torch.float32, 0, 1,
                  backend="cpu")
    from freqact.kernels import cpu_dct as D
    for h, w in [(1, 1), (5, 31), (3, 32), (2, 33), (7, 56), (1, 65), (33, 7), (8, 8), (8, 2), (12, 4), (64, 8)]:
        x = torch.randn(3, h, w)
        for inverse in (False, True):
            D.dct2(x, inverse)
        corner = D.dct_corner(x, max(1, h // 3), max(1, w // 3))
        D.idct_corner(corner, h, w)
        D.band_energy(x, max(1, h // 3), max(1, w // 3))
        D.highpass(x, max(1, h // 3), max(1, w // 3))
    # 8 MiB and more: streamed stores, their heads and tails (ASan sees their loads, not the
    # non-temporal stores: tests/test_dct.py checks guard floats around such an output)
    big = torch.randn(2**21 + 2**12)
    for x in (big[:2**21].view(2048, 32, 32), big[7:2**21 + 7].view(2048, 32, 32), big[:2280 * 920].view(2280, 8, 115)):
        D.dct2(x, False, out=big.new_empty(x.numel() + 3)[3:].view(x.shape))
        D.highpass(x, 2, 7)
    from freqact import codecs
    from freqact.engine.layouts import BLOCKS, STATS, TokenLayout
    # (2, 9, 64), (2, 33, 16): the C kernels' lane paths (8 feature blocks in lanes, chan maps
    # 16 at a time down the columns, odd and even T)
    for shape in [(1, 1, 1), (2, 7, 5), (2, 37, 20), (2, 6, 5, 16), (1, 3, 20, 8), (2, 130, 13),
                  (2, 9, 64), (2, 33, 16), (2, 4, 4, 32)]:
        strided = torch.randn(shape).transpose(0, -1).contiguous().transpose(0, -1)
        for x in (strided, torch.randn(shape)):  # read through strides, and in place
            for blocks in BLOCKS:
                for stats in STATS:
                    for bits in (1, 2, 4, 8):
                        c = TokenLayout(codecs.get("division", bits=bits, backend="cpu"), blocks,
                                        stats)
                        c.decode(c.encode(x))
                        noise = torch.rand(c._geometry(shape)[0].quant_shape)
                        c.decode(c.encode(x, noise))
    print("asan-ok")
""")


def test_kernels_run_clean_under_address_sanitizer(tmp_path):
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("gcc is not installed")
    found = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True,
                           check=False)
    libasan = found.stdout.strip()
    if not os.path.isabs(libasan) or not os.path.exists(libasan):
        pytest.skip("the AddressSanitizer runtime (libasan.so) is absent")
    env = dict(os.environ, CC=f"{cc} -fsanitize=address -fno-omit-frame-pointer -g",
               FREQACT_CACHE=str(tmp_path / "cache"), LD_PRELOAD=libasan,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=99",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", _ASAN_DRIVER], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0 and "asan-ok" in done.stdout, done.stderr[-3000:]
    assert "AddressSanitizer" not in done.stderr


# --- trust of the cache --------------------------------------------------------------------------


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A fresh cache folder (private), with the loaded library forgotten before and after;
    built at -O0 (these tests rebuild several times: only the trust checks matter here)."""
    monkeypatch.setattr(cpu, "CFLAGS", tuple("-O0" if f == "-O3" else f for f in cpu.CFLAGS))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("FREQACT_CACHE", str(cache))
    cpu._library.cache_clear()
    yield cache
    cpu._library.cache_clear()


@needs_cc
def test_a_world_writable_cache_is_refused(fresh, tmp_path):
    fresh.chmod(0o777)
    planted = cpu.library_path(fresh)
    planted.write_bytes(b"not a library")
    with pytest.warns(RuntimeWarning, match="writable by group or others"):
        assert cpu.available(), cpu.unavailable_reason()
    assert cpu._library()._name != str(planted)
    assert planted.read_bytes() == b"not a library"  # not touched, not loaded


@needs_cc
def test_a_cache_under_a_folder_others_may_write_is_refused(tmp_path, monkeypatch):
    # Another user could rename the whole cache folder away and put their own in its place
    shared = tmp_path / "shared"
    shared.mkdir()
    cache = shared / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("FREQACT_CACHE", str(cache))
    try:
        for mode, refused in ((0o777, True), (0o1777, False), (0o755, False)):
            shared.chmod(mode)
            cpu._library.cache_clear()
            if refused:
                with pytest.warns(RuntimeWarning, match="above the cache, is writable by group"):
                    assert cpu.available(), cpu.unavailable_reason()
                assert not cpu._library()._name.startswith(str(cache))
            else:
                assert cpu.available(), cpu.unavailable_reason()
                assert cpu._library()._name.startswith(str(cache))
    finally:
        shared.chmod(0o755)
        cpu._library.cache_clear()


@needs_cc
def test_a_library_that_does_not_match_its_recorded_hash_is_rebuilt(fresh, tmp_path):
    path = cpu.library_path(fresh)
    cpu._build(path)
    other = tmp_path / "other.c"
    other.write_text("__attribute__((constructor)) static void boom(void) { *(volatile int *)0 = 1; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(other), "-o", str(path)], check=True)
    assert cpu.available(), cpu.unavailable_reason()  # rebuilt: the planted constructor never ran
    assert cpu._verified(path)


@needs_cc
@pytest.mark.parametrize("content", [b"", b"\x7fELF garbage"])
def test_a_zero_byte_or_garbage_entry_is_rebuilt(fresh, content):
    path = cpu.library_path(fresh)
    path.write_bytes(content)
    path.chmod(0o600)
    cpu._hash_path(path).write_text(cpu._digest(path))  # even with a matching hash
    assert cpu.available(), cpu.unavailable_reason()
    assert path.stat().st_size > 1000


@needs_cc
def test_a_library_without_the_kernel_symbols_falls_back(fresh, tmp_path, monkeypatch):
    path = cpu.library_path(fresh)
    empty = tmp_path / "empty.c"
    empty.write_text("int freqact_unrelated(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", str(empty), "-o", str(path)], check=True)
    path.chmod(0o700)
    cpu._hash_path(path).write_text(cpu._digest(path))
    monkeypatch.delenv("FREQACT_KERNELS", raising=False)
    K._cpu_kernels_available.cache_clear()
    try:
        assert not cpu.available() and "has no symbol" in cpu.unavailable_reason()
        with pytest.warns(RuntimeWarning, match="slower torch reference"):
            assert K.backend_for(torch.zeros(2, 3)) == "torch"
    finally:
        K._cpu_kernels_available.cache_clear()


def test_a_hung_compiler_times_out_and_both_errors_are_kept(fresh, tmp_path, monkeypatch):
    hang = tmp_path / "cc-hang"
    hang.write_text("#!/bin/sh\nexec sleep 30\n")
    hang.chmod(0o755)
    monkeypatch.setenv("CC", str(hang))
    monkeypatch.setattr(cpu, "COMPILE_TIMEOUT_S", 0.5)
    assert not cpu.available() and "timed out after 0.5 s" in cpu.unavailable_reason()
    cpu._library.cache_clear()
    fail = tmp_path / "cc-fail"
    fail.write_text('#!/bin/sh\ncase "$*" in *-fopenmp*) echo "no OpenMP" >&2;; '
                    '*) echo "no compiler either" >&2;; esac\nexit 1\n')
    fail.chmod(0o755)
    monkeypatch.setenv("CC", str(fail))
    reason = cpu.unavailable_reason()
    assert "no OpenMP" in reason and "no compiler either" in reason


@needs_cc
def test_a_library_writable_by_others_or_owned_by_another_user_is_rebuilt(fresh):
    path = cpu.library_path(fresh)
    cpu._build(path)
    path.chmod(0o666)
    assert not cpu._verified(path)
    if os.getuid() == 0:  # only root can hand a file to another user
        path.chmod(0o700)
        os.chown(path, 65534, 65534)
        assert not cpu._verified(path)
    assert cpu.available(), cpu.unavailable_reason()
    assert cpu._verified(path) and path.stat().st_uid == os.getuid()


_RELATIVE_CACHE_DRIVER = textwrap.dedent("""
    import shutil, sys
    from pathlib import Path
    from freqact.kernels import cpu
    cpu.CFLAGS = tuple("-O0" if f == "-O3" else f for f in cpu.CFLAGS)
    # another library of the very name freqact's would have, in the loader's search path
    shutil.copy(sys.argv[1], Path(sys.argv[2]) / cpu.library_path(Path("."), cpu.SOURCE, cpu.CFLAGS).name)
    assert cpu.available(), cpu.unavailable_reason()
    print(cpu._library()._name)
""")


@needs_cc
def test_a_relative_cache_loads_the_library_built_there_not_one_the_loader_finds(tmp_path):
    # FREQACT_CACHE=. named the library "cpu_division-<hash>.so", without a slash: dlopen then
    # searches LD_LIBRARY_PATH and the system folders for that name, not the cache
    marker, planted, work = tmp_path / "planted-ran", tmp_path / "libs", tmp_path / "work"
    planted.mkdir()
    work.mkdir(mode=0o700)
    source = tmp_path / "planted.c"
    source.write_text('#include <sys/stat.h>\n__attribute__((constructor)) static void planted(void) '
                      f'{{ mkdir("{marker}", 0700); }}\n')
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(tmp_path / "planted.so")],
                   check=True)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, FREQACT_CACHE=".", LD_LIBRARY_PATH=str(planted), PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", _RELATIVE_CACHE_DRIVER, str(tmp_path / "planted.so"),
                           str(planted)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert not marker.exists(), "a library freqact did not build was loaded"
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith(str(work.resolve()) + "/cpu_division-")
