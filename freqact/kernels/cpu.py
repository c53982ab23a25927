"""Fused C kernels for the division codec on the CPU, built on first use.

`cpu_division.c` (beside this file) encodes and decodes the DIVISION packed format in one pass
over each map's data, and packs/unpacks Q-bit codes; the torch reference stays the
specification (see the C file's header for what may differ: the order of block sums). The
functions here share the reference's signatures (`reference.encode`, `reference.decode`, ...)
and hand the C code the sizes of `format.Geometry`, each range-checked for a C int64 first
(ctypes would silently truncate a Python int that does not fit).

Build: the first call compiles the C file with the system compiler (`$CC`, else `cc`; with
OpenMP, or single-threaded where the compiler has none; each attempt limited to
`COMPILE_TIMEOUT_S` seconds) into a shared library cached under `$FREQACT_CACHE` (default
`~/.cache/freqact`), named by a hash of the source, compiler, flags and CPU (model name and
instruction-set flags), written to a temporary name then renamed, so concurrent processes (DDP
ranks, pytest workers) never load a half-written file. Beside it, `<name>.sha256` records the
library's content hash (written atomically after the library).

Loading never runs code that freqact did not build for this user: the cache folder must be owned
by the user and not writable by group or others, and no folder above it may let another user swap
it (owned by another user than this one or root, or writable by group or others without the sticky
bit) (otherwise a RuntimeWarning, and the library is built in a fresh private temporary folder
instead); whichever folder is used, it is used by its absolute path with every link resolved;
the library file must be a regular file owned
by the user, not group/other-writable, and match its recorded hash; a file that fails any check
(a zero-byte or garbage entry, a missing hash) is rebuilt. A library without the kernel symbols
makes `available()` False like a failed build. It is loaded with ctypes and given tensors by data
pointer; OpenMP threads follow `torch.get_num_threads()`. When no compiler works,
`available()` is False, `unavailable_reason()` says why, and the dispatch in `freqact.kernels`
falls back to the reference.

`load_library(source, cflags, signatures)` is that one build-cache-verify-load path for any C
file of freqact: the fused DCT kernels (`freqact.kernels.cpu_dct`) are loaded through it too.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import numbers
import os
import platform
import shlex
import stat
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from freqact.kernels.format import (
    Geometry,
    _check_part,
    _geometry,
    as_maps,
    check_bits,
    check_code_bytes,
    check_count,
    check_mask_bytes,
    check_tensor,
    saturating_cast,
)

__all__ = ["COMPILE_TIMEOUT_S", "TokenGeometry", "available", "decode", "encode", "library_path",
           "load_library", "loaded", "pack_codes", "pack_mask", "token_decode", "token_encode",
           "token_flat",
           "unavailable_reason", "unpack_codes", "unpack_mask", "vector_halves"]

SOURCE = Path(__file__).with_name("cpu_division.c")
# No -ffast-math and no FMA contraction: each float operation must round as torch's does.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c11", "-fPIC", "-shared")
# Seconds one compiler run may take (a hung compiler is killed and the build fails).
COMPILE_TIMEOUT_S = 120.0

_i64, _int, _u64, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p
_SIGNATURES = {
    "freqact_division_encode": ([_ptr, _int] + [_ptr] * 2 + [_u64] + [_ptr] * 4 + [_int], _int),
    "freqact_division_decode": ([_ptr, _int] + [_ptr] * 5 + [ctypes.c_float, _ptr, _int], _int),
    "freqact_pack_codes": ([_i64, _i64, _int, _ptr, _ptr, _int], None),
    "freqact_unpack_codes": ([_i64, _i64, _int, _ptr, _ptr, _int], None),
    "freqact_pack_mask": ([_i64, _ptr, ctypes.c_float, _int, ctypes.c_float, _ptr, _int], None),
    "freqact_unpack_mask": ([_i64, _ptr, ctypes.c_float, ctypes.c_float, _ptr, _int], None),
    "freqact_token_encode": ([_ptr, _int] + [_ptr] * 2 + [_u64] + [_ptr] * 4 + [_int], _int),
    "freqact_token_decode": ([_ptr, _int] + [_ptr] * 5 + [_int], _int),
    "freqact_token_flat": ([_ptr, _ptr, _ptr, _int], _int),
    "freqact_vector_halves": ([], _int),
}
_INT64_MAX = 2**63 - 1


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def _cpu_model() -> str:
    """The CPU's model name and instruction-set flags (a library built with -march=native for
    one CPU may not run on another that reports the same generic model name)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return "\n".join(next((line for line in lines if line.startswith(w)), "") for w in wanted)


def _cache_dir() -> Path:
    return Path(os.environ.get("FREQACT_CACHE") or Path.home() / ".cache" / "freqact")


def library_path(cache: Path | None = None, source: Path = SOURCE,
                 cflags: tuple[str, ...] | None = None) -> Path:
    """Where the library compiled from `source` with `cflags` (default: the division kernels'
    CFLAGS) by this compiler for this CPU lives (or will), in `cache` (default: $FREQACT_CACHE
    or ~/.cache/freqact)."""
    cflags = CFLAGS if cflags is None else cflags
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(_compiler()).encode(), " ".join(cflags).encode(),
                 platform.machine().encode(), _cpu_model().encode()):  # -march=native
        key.update(part + b"\0")
    return (cache or _cache_dir()) / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _hash_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unsafe(path: Path, want_dir: bool) -> str | None:
    """Why `path` may not be trusted (None when it may): not ours, writable by others, a link."""
    st = os.lstat(path)
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not kind_ok:
        return f"{path} is not a {'folder' if want_dir else 'regular file'}"
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _unsafe_above(path: Path) -> str | None:
    """Why a folder above `path` may let another user swap it (None when none may): one owned by
    another user than this one or root, or writable by group or others without the sticky bit
    (as ssh's StrictModes judges a home directory; /tmp is sticky)."""
    for parent in path.resolve().parents:
        st = os.stat(parent)
        if st.st_uid not in (0, os.getuid()):
            return f"{parent}, above the cache, is owned by uid {st.st_uid}"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return (f"{parent}, above the cache, is writable by group or others without the "
                    f"sticky bit (mode {stat.S_IMODE(st.st_mode):o})")
    return None


def _write_atomically(target: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(target: Path, source: Path = SOURCE, cflags: tuple[str, ...] | None = None) -> None:
    """Compile source to target with cflags (default CFLAGS); without -fopenmp if the compiler
    refuses it (single-threaded). Records the library's content hash beside it. Raises OSError
    with every compiler error."""
    cflags = CFLAGS if cflags is None else cflags
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        errors = []
        for flags in (cflags, tuple(f for f in cflags if f != "-fopenmp")):
            cmd = [*_compiler(), *flags, str(source), "-o", tmp]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                      timeout=COMPILE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                errors.append(f"{shlex.join(cmd)} timed out after {COMPILE_TIMEOUT_S:g} s")
                break  # a hung compiler would hang again
            if done.returncode == 0:
                os.chmod(tmp, 0o700)
                digest = _digest(Path(tmp))
                os.replace(tmp, target)
                _write_atomically(_hash_path(target), digest.encode())
                return
            errors.append(f"{shlex.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        raise OSError("; ".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _verified(path: Path) -> bool:
    """Whether `path` is a library that this user built: safe file, hash as recorded."""
    try:
        if _unsafe(path, want_dir=False) or _unsafe(_hash_path(path), want_dir=False):
            return False
        return path.stat().st_size > 0 and _hash_path(path).read_text().strip() == _digest(path)
    except OSError:
        return False


def _trusted_cache() -> Path:
    """The cache folder if it is safe (created private when missing), else a fresh private
    temporary folder (with a RuntimeWarning saying why); absolute, with no symbolic link.

    Everything after the checks goes through the resolved path: a relative one without a folder
    ($FREQACT_CACHE=".") would hand dlopen a bare file name, which it looks up in
    LD_LIBRARY_PATH and the system folders instead, and a link on the way (in a folder of
    another user's, say) could be pointed elsewhere once the checks are done."""
    cache = _cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        real = cache.resolve(strict=True)
        reason = _unsafe(cache, want_dir=True) or _unsafe(real, want_dir=True) or _unsafe_above(real)
    except OSError as err:
        reason = str(err)
    if reason is None:
        return real
    private = Path(tempfile.mkdtemp(prefix="freqact-kernels-")).resolve()
    warnings.warn(f"freqact: not using the kernel cache: {reason}; building the C kernels in "
                  f"{private} instead", RuntimeWarning, stacklevel=5)
    return private


def _load(path: Path, source: Path, cflags: tuple[str, ...] | None) -> ctypes.CDLL:
    """Build path unless it holds a verified library, then load it (rebuilding once if a
    verified file still does not load)."""
    if not _verified(path):
        _build(path, source, cflags)
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        _build(path, source, cflags)
        return ctypes.CDLL(str(path))


def load_library(source: Path, cflags: tuple[str, ...] | None = None,
                 signatures: dict | None = None) -> ctypes.CDLL | str:
    """The C file `source` built with `cflags` (default CFLAGS) and loaded through the cache and
    its trust checks (module docstring), or a string saying why not.

    Every C kernel library of freqact is loaded here (`cpu_division.c` below, `cpu_dct.c` by
    `freqact.kernels.cpu_dct`); callers keep the result (in a functools.cache) and read it with
    `loaded`.

    Args:
        source: the C file.
        cflags: the compiler flags (default CFLAGS).
        signatures: {symbol: (argtypes, restype)}; each symbol must exist (else the string says
            which is missing) and gets these types.
    """
    try:
        path = library_path(_trusted_cache(), source, cflags)
        lib = _load(path, source, cflags)
    except (OSError, subprocess.SubprocessError) as err:
        return f"the C kernels of {source.name} could not be built or loaded: {err}"
    for name, (args, result) in (signatures or {}).items():
        fn = getattr(lib, name, None)
        if fn is None:
            return f"the C kernels of {source.name} could not be loaded: {path} has no symbol {name}"
        fn.argtypes, fn.restype = args, result
    return lib


def loaded(lib: ctypes.CDLL | str) -> ctypes.CDLL:
    """lib, a `load_library` result, if it loaded; else RuntimeError with the reason."""
    if not isinstance(lib, str):
        return lib
    raise RuntimeError(lib)  # not a TypeError: the kernels are missing, nothing was mistyped


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or a string saying why it cannot be had."""
    return load_library(SOURCE, CFLAGS, _SIGNATURES)


def available() -> bool:
    """Whether the compiled kernels can be used (builds them on the first call)."""
    return not isinstance(_library(), str)


def unavailable_reason() -> str | None:
    """None when `available()`, else why not (the compiler's error, for instance)."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def vector_halves() -> bool:
    """Whether the built kernels do their 16-lane steps on two 8-lane halves (built for a CPU
    without AVX-512; cpu_division.c's HALVES16), else in 16-lane registers."""
    return bool(_lib().freqact_vector_halves())


def _lib() -> ctypes.CDLL:
    return loaded(_library())


def _c_int64(name: str, value: int) -> int:
    """value if it fits a C int64 >= 0 (ctypes would silently keep only its low 64 bits)."""
    if not 0 <= value <= _INT64_MAX:
        raise ValueError(f"{name}: expected an integer in [0, 2**63 - 1], got {value}")
    return value


def _check_stream_length(name: str, n: int) -> None:
    """Refuse quant maps of n > 2^32 elements: the kernels' noise stream numbers a map's elements
    in 32 bits (cpu_division.c: element t of a map hashes (t * mul + add) mod 2^32)."""
    if n > 2**32:
        raise ValueError(f"{name}: expected quant maps of at most 2**32 elements (the C kernels' "
                         f"noise stream numbers them in 32 bits), got maps of {n}")


def _on_cpu(name: str, t: torch.Tensor) -> torch.Tensor:
    """t if it is on the CPU (the C code dereferences its data pointer: a meta tensor's is NULL,
    a CUDA tensor's is device memory)."""
    if not t.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got a tensor on {t.device}")
    return t


def _real(name: str, value: object) -> float:
    """value as a float if it is a real number (not a bool; ctypes refuses others with an
    ArgumentError that names no argument)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {value!r}")
    return float(value)


def _for_c(t: torch.Tensor) -> torch.Tensor:
    """t, contiguous, as the C code may read it through its data pointer: its negative bit
    resolved (a view with the bit, such as `z.conj().imag`, stores its values' negation, and
    `contiguous` keeps the bit of a contiguous one)."""
    return (t.resolve_neg() if t.is_neg() else t).contiguous()


def _extent(t: torch.Tensor) -> int:
    """Elements from t's first to its last, gaps included (0 for none): where its strides reach."""
    if not t.numel():
        return 0
    return t.numel() if t.is_contiguous() else 1 + sum(
        (size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _strided_for_c(name: str, t: torch.Tensor) -> torch.Tensor:
    """t as the C code reads or writes it in place through its strides: its negative bit
    resolved, and every element it names within its storage (a view whose storage was resized
    after it was made was read or written past the storage's end; torch's own kernels do not
    check this, so it is checked where freqact hands C the strides)."""
    if t.is_neg():
        t = t.resolve_neg()
    reach = (t.storage_offset() + _extent(t)) * t.element_size() if t.numel() else 0
    if reach > t.untyped_storage().nbytes():
        raise ValueError(f"{name}: its sizes and strides reach {reach} bytes into a storage of "
                         f"{t.untyped_storage().nbytes()}")
    return t


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, end) from t's first element to its last (empty for no elements)."""
    first = t.data_ptr()
    return first, first + _extent(t) * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _check_seed(seed: object) -> None:
    """Refuse a seed that is not an integer (a bool, a float: ctypes would raise an
    ArgumentError or take True as 1); any integer is taken modulo 2**64."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an integer, got {type(seed).__name__}")


def _threads() -> int:
    return min(torch.get_num_threads(), 2**31 - 1)


def _consistent(geom: object) -> bool:
    """Whether geom is a Geometry of int sizes, 1 to 3 spatial dims, whose block extents and
    counts are those its sizes and block give."""
    if not isinstance(geom, Geometry) or not isinstance(geom.spatial, tuple):
        return False
    shape = (geom.n, geom.c, *geom.spatial)
    if not 1 <= len(geom.spatial) <= 3 or not all(type(v) is int for v in shape):
        return False
    try:
        return geom == _geometry(shape, geom.block)
    except (TypeError, ValueError, ZeroDivisionError):
        return False


@functools.lru_cache(maxsize=1024, typed=True)  # one array per map shape (the C code reads it)
def _geometry_args(geom: Geometry, bits: int):
    """The C geometry array (see the enum in cpu_division.c), every value range-checked; shared
    between calls (the kernels take it as const; 10 us a call built, 0.3 us cached).

    geom must be the geometry of its own sizes and block (`format.geometry`): the C code trusts
    its block extents and counts (a zero extent divided by zero, counts that do not cover the map
    left elements out of every block or made blocks past it)."""
    if not _consistent(geom):
        raise ValueError(f"geom: expected format.geometry((n, c, *spatial), block) of its own "
                         f"sizes and block, got {geom}")
    values = (geom.maps, *geom.dhw, *geom.block_dhw, *geom.counts_dhw, geom.code_bytes(bits))
    # The largest index the C code forms: maps * numel (and its code bytes) must fit too.
    _c_int64("x.numel()", geom.maps * max(geom.numel, geom.code_bytes(bits)))
    _check_stream_length("x", geom.numel)
    return (ctypes.c_int64 * len(values))(*(_c_int64("geometry", v) for v in values))


def encode(x: torch.Tensor, geom: Geometry, bits: int, noise: torch.Tensor | None, seed: int):
    """As `reference.encode` (full form when geom.block is set, else the quant form), for a CPU
    tensor; seed: a 64-bit integer for the noise stream when noise is None.

    Returns:
        (lfc, lo, step, codes): bf16 (N, C, *nb) or None, bf16 (N, C), bf16 (N, C),
        uint8 (N, C, ceil(P * bits / 8)).
    """
    lib = _lib()
    args = _geometry_args(geom, check_bits(bits))  # bits picks the C code's packing: checked
    _check_seed(seed)
    maps = (geom.n, geom.c, *geom.spatial)
    for name, t in (("x", x), ("noise", noise)):
        if t is not None and (tuple(as_maps(check_tensor(name, t)).shape) != maps
                              or t.device.type != "cpu"):
            raise ValueError(f"{name}: expected maps {maps} on the CPU, got {tuple(t.shape)} "
                             f"on {t.device}")
    if geom.maps and not geom.numel:  # as the dispatcher: no min and max of an empty map
        raise ValueError(f"x: expected maps of at least one element, got maps {maps}")
    xm = _for_c(as_maps(x).float())
    lfc = None if geom.block is None else torch.empty(geom.lfc_shape, dtype=torch.bfloat16)
    lo = torch.empty(geom.stat_shape, dtype=torch.bfloat16)
    step = torch.empty(geom.stat_shape, dtype=torch.bfloat16)
    codes = torch.empty(geom.codes_shape(bits), dtype=torch.uint8)
    if noise is not None:
        noise = _for_c(as_maps(noise).float())
    status = lib.freqact_division_encode(
        args, bits, xm.data_ptr(), None if noise is None else noise.data_ptr(), seed % 2**64,
        None if lfc is None else lfc.data_ptr(), lo.data_ptr(), step.data_ptr(), codes.data_ptr(),
        _threads())
    if status != 0:
        raise MemoryError("division_encode: out of memory for the per-thread scratch buffers")
    return lfc, lo, step, codes


POSITIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes `decode` applies a ReLU mask for: their smallest normal is a float32 that each
rounds to itself, so clamping in float32 before the cast equals clamping after it."""


def decode(lfc: torch.Tensor | None, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor,
           geom: Geometry, bits: int, dtype: torch.dtype,
           positive: torch.Tensor | None = None) -> torch.Tensor:
    """As `reference.decode` for forms with codes (lfc None: the quant form).

    Args:
        positive: None, or a ReLU output's mask applied in the same pass: uint8
            (ceil(numel / 8),), element i at bit i % 8 of byte i // 8 (`pack_mask`'s layout);
            the result is then `torch.where(mask, decoded.clamp_min(finfo(dtype).tiny), 0)`
            (dtype one of POSITIVE_DTYPES).

    Returns:
        Contiguous maps (N, C, *S) of dtype on the CPU.

    Raises:
        TypeError, ValueError: positive of another dtype, size or device, or with a dtype it
            cannot serve.
    """
    lib = _lib()
    args = _geometry_args(geom, check_bits(bits))  # bits picks the C code's unpacking: checked
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    cpu = torch.device("cpu")  # the C code reads as many bytes as geom says: checked first
    if lfc is not None or geom.block is not None:
        _check_part("lfc", lfc, torch.bfloat16, list(geom.lfc_shape), cpu)
    for name, t in (("lo", lo), ("step", step)):
        _check_part(name, t, torch.bfloat16, list(geom.stat_shape), cpu)
    _check_part("codes", codes, torch.uint8, list(geom.codes_shape(bits)), cpu)
    out = torch.empty([geom.n, geom.c, *geom.spatial], dtype=torch.float32)
    tensors = [_for_c(t) for t in (lo, step, codes)]
    lfc = None if lfc is None else _for_c(lfc)
    tiny = 0.0
    if positive is not None:
        _check_part("positive", positive, torch.uint8, [-(-out.numel() // 8)],
                    torch.device("cpu"))
        if dtype not in POSITIVE_DTYPES:
            raise ValueError(f"positive: a mask needs a dtype in {POSITIVE_DTYPES}, got {dtype}")
        positive, tiny = _for_c(positive), torch.finfo(dtype).tiny
    status = lib.freqact_division_decode(
        args, bits, None if lfc is None else lfc.data_ptr(), *(t.data_ptr() for t in tensors),
        None if positive is None else positive.data_ptr(), tiny, out.data_ptr(), _threads())
    if status != 0:
        raise MemoryError("division_decode: out of memory for the per-thread scratch buffers")
    return saturating_cast(out, dtype)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """As `reference.pack_codes`: uint8 codes (..., P) -> uint8 (..., ceil(P * bits / 8))."""
    lib = _lib()
    bits = check_bits(bits)
    if _on_cpu("q", check_tensor("q", q, torch.uint8)).dim() == 0:
        raise ValueError("q: expected a tensor with at least one dim, got a scalar")
    q = _for_c(q)
    count = q.shape[-1]
    out = torch.empty((*q.shape[:-1], -(-count * bits // 8)), dtype=torch.uint8)
    rows = q.numel() // max(count, 1)
    lib.freqact_pack_codes(_c_int64("rows", rows), _c_int64("count", count), bits, q.data_ptr(),
                           out.data_ptr(), _threads())
    return out


def unpack_codes(codes: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """As `reference.unpack_codes`: uint8 (..., ceil(count * bits / 8)) -> uint8 (..., count)."""
    lib = _lib()
    bits, count = check_bits(bits), check_count("count", count)
    check_code_bytes(_on_cpu("codes", check_tensor("codes", codes, torch.uint8)), count, bits)
    codes = _for_c(codes)
    out = torch.empty((*codes.shape[:-1], count), dtype=torch.uint8)
    rows = codes.numel() // max(codes.shape[-1], 1)
    lib.freqact_unpack_codes(_c_int64("rows", rows), _c_int64("count", count), bits,
                             codes.data_ptr(), out.data_ptr(), _threads())
    return out


def pack_mask(x: torch.Tensor, lower: float, upper: float | None = None) -> torch.Tensor:
    """As `reference.pack_mask` for a float32 CPU tensor: uint8 (ceil(numel / 8),)."""
    lib = _lib()
    # the C code reads 4 bytes per element: a float16 or int8 x was read past its end (ASan)
    x = _for_c(_on_cpu("x", check_tensor("x", x, torch.float32)))
    lower = _real("lower", lower)
    upper = None if upper is None else _real("upper", upper)
    out = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
    lib.freqact_pack_mask(_c_int64("x.numel()", x.numel()), x.data_ptr(), lower,
                          upper is not None, 0.0 if upper is None else upper, out.data_ptr(),
                          _threads())
    return out


def unpack_mask(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype, off: float,
                on: float) -> torch.Tensor:
    """As `reference.unpack_mask` for dtype float32 (the only one the dispatch sends here): a
    float32 CPU tensor of `shape`."""
    lib = _lib()
    if dtype != torch.float32:  # the C code writes float32 values
        raise ValueError(f"dtype: expected torch.float32 (the C kernel's), got {dtype!r}")
    shape = torch.Size([check_count("shape", s) for s in shape])
    check_mask_bytes(_on_cpu("packed", check_tensor("packed", packed, torch.uint8)), shape)
    off, on = _real("off", off), _real("on", on)
    packed = _for_c(packed)
    out = torch.empty(shape, dtype=torch.float32)
    lib.freqact_unpack_mask(_c_int64("numel", out.numel()), packed.data_ptr(), off, on,
                            out.data_ptr(), _threads())
    return out


# --- token layouts (freqact.engine.layouts) ----------------------------------------------------


@dataclass(frozen=True)
class TokenGeometry:
    """A token layout's sizes for the fused kernels (`freqact_token_encode` in cpu_division.c).

    Attributes:
        panel: (M, H, W, F): M sequences of H x W tokens (H = 1 for sequences) of F features.
        extents: (bh, bw, bf), the tokens x features one block mean covers (edge blocks less).
        lfc_shape: the block view's lfc shape (M, ...), nblocks = prod(lfc_shape[1:]) per sequence.
        lfc_strides: (lh, lw, lf): where block (i, j, k) of a sequence sits in its lfc.
        chan: min/step per feature column (quant maps (M, F, H * W)), else per token row
            (quant maps (M, H * W, F)).
    """

    panel: tuple[int, int, int, int]
    extents: tuple[int, int, int]
    lfc_shape: tuple[int, ...]
    lfc_strides: tuple[int, int, int]
    chan: bool

    def __post_init__(self) -> None:
        """Refuse fields of another structure: the C code reads exactly T_LEN values (a fourth
        extent or a missing stride shifted every value after it, read past the array or divided
        by zero), and a float that equals an int would find that int's cached C array."""
        for name, length in (("panel", 4), ("extents", 3), ("lfc_shape", 0), ("lfc_strides", 3)):
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != (length or max(len(value), 1))
                    or not all(type(v) is int for v in value)):
                raise TypeError(f"geom.{name}: expected a tuple of {length or 'one or more'} "
                                f"ints, got {value!r}")
        if not isinstance(self.chan, bool):
            raise TypeError(f"geom.chan: expected a bool, got {self.chan!r}")

    @property
    def counts(self) -> tuple[int, int, int]:
        return tuple(-(-s // b) for s, b in zip(self.panel[1:], self.extents))

    @property
    def quant_shape(self) -> tuple[int, int, int]:
        m, h, w, f = self.panel
        return (m, f, h * w) if self.chan else (m, h * w, f)

    def codes_shape(self, bits: int) -> tuple[int, int, int]:
        maps, count = self.quant_shape[:2], self.quant_shape[2]
        return (*maps, -(-count * bits // 8))


def _blocks_fill_the_lfc(geom: TokenGeometry) -> bool:
    """Whether block (i, j, k) -> i * lh + j * lw + k * lf maps the counts' blocks one to one
    onto a sequence's lfc of prod(lfc_shape[1:]) entries (the C code steps a sequence's lfc by
    the number of blocks, and writes each block's mean once): strides in mixed radix."""
    per_sequence = math.prod(geom.lfc_shape[1:])
    if per_sequence != math.prod(geom.counts) or min(geom.lfc_strides) < 0:
        return False
    span = 1
    for stride, count in sorted((s, c) for s, c in zip(geom.lfc_strides, geom.counts) if c > 1):
        if stride < span:
            return False
        span = stride * count
    return span <= per_sequence


@functools.lru_cache(maxsize=1024, typed=True)  # a few shapes per model; values checked once
def _token_args(geom: TokenGeometry, bits: int, x_strides=(0, 1, 0, 0, 0, 0),
                out_stride: int = 0):
    """The C array of cpu_division.c's T_* enum, every value range-checked.

    Args:
        x_strides: how the encode reads x: (stride of a group of sequences, sequences per group,
            stride of a sequence in its group, then of a token row, a token, a feature). Only
            the group size is checked here: `token_encode` takes the strides from x itself,
            whose shape it has checked against geom, so every element read is x's own.
        out_stride: the decode's output stride per sequence.

    Besides int64 range: bits in {1, 2, 4, 8} (the codes' row bytes follow from it), sizes and
    extents positive, chan a bool (the C code branches on it being 1; the parts are sized by
    it), and the blocks mapped one to one onto a sequence's lfc (`_blocks_fill_the_lfc`: the C
    code indexes it with lfc_strides and steps it by the number of blocks), so an inconsistent
    TokenGeometry is refused, never written past nor left unwritten; the
    sequences per group (the C code divides by it) positive and dividing M.
    """
    bits = check_bits(bits)
    m, h, w, f = geom.panel
    if (not isinstance(geom.chan, bool) or min(h, w, f, *geom.extents) < 1 or m < 0
            or geom.lfc_shape[0] != m or not _blocks_fill_the_lfc(geom)):
        raise ValueError(f"geom: inconsistent token geometry {geom}")
    if len(x_strides) != 6 or x_strides[1] < 1 or m % x_strides[1]:
        raise ValueError(f"x: expected sequences in groups of a size dividing {m}, got strides "
                         f"{x_strides}")
    codes = _token_parts(geom, bits)[3][1]
    _c_int64("x.numel()", math.prod(geom.panel))
    _c_int64("codes", math.prod(codes))
    _check_stream_length("x (tokens per sequence for chan stats, features for tok)",
                   geom.quant_shape[2])
    values = (*geom.panel, *geom.extents, *geom.counts, *geom.lfc_strides, int(geom.chan),
              codes[2], *x_strides, out_stride)
    return (ctypes.c_int64 * len(values))(*(_c_int64("token geometry", v) for v in values))


@functools.lru_cache(maxsize=1024, typed=True)  # typed: bits True or 2.0 is not bits 1 or 2
def _token_parts(geom: TokenGeometry, bits: int) -> tuple[tuple[torch.dtype, tuple], ...]:
    """(dtype, shape) of the packed parts lfc, lo, step, codes for geom and bits (checked)."""
    maps = tuple(geom.quant_shape[:2])
    return ((torch.bfloat16, tuple(geom.lfc_shape)), (torch.bfloat16, maps),
            (torch.bfloat16, maps), (torch.uint8, tuple(geom.codes_shape(check_bits(bits)))))


def token_encode(x: torch.Tensor, geom: TokenGeometry, bits: int, noise: torch.Tensor | None,
                 seed: int):
    """Encode a token tensor in one pass per sequence (block means, residual, quant maps).

    Args:
        x: float32 CPU tensor of shape geom.panel (M, H, W, F), or (A, B, H, W, F) with A * B
            = M (sequence m is x[m // B, m % B]: attention's (N, heads, T, d) views of a qkv
            projection, whose N * heads sequences no single stride reaches); any strides (read
            in place).
        geom: the layout's sizes.
        bits: Q in {1, 2, 4, 8}.
        noise: float32 uniforms of geom.quant_shape, or None to draw from `seed` (the stream of
            cpu_division.c's header, map index and element of the quant view as in `encode`).
        seed: a 64-bit integer.

    Returns:
        (lfc, lo, step, codes): bf16 geom.lfc_shape, bf16 quant_shape[:2] (twice), uint8
        (*quant_shape[:2], ceil(quant_shape[2] * bits / 8)).
    """
    lib = _lib()
    _check_seed(seed)
    grouped = x.dim() == 5 and x.shape[0] * x.shape[1] == geom.panel[0] and (
        x.shape[2:] == geom.panel[1:])
    if x.dtype != torch.float32 or not (grouped or x.shape == geom.panel) or (
            x.device.type != "cpu" or x.layout != torch.strided):
        raise ValueError(f"x: expected float32 of shape {geom.panel} (or (A, B, *{geom.panel[1:]}"
                         f") with A * B = {geom.panel[0]}) on the CPU, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if noise is not None and (noise.shape != geom.quant_shape or noise.device.type != "cpu"
                              or noise.layout != torch.strided):
        raise ValueError(f"noise: expected shape {geom.quant_shape}, strided, on the CPU, got "
                         f"{tuple(noise.shape)} {noise.layout} on {noise.device}")
    x = _strided_for_c("x", x)  # read in place, through its strides
    strides = x.stride()
    args = _token_args(geom, bits, (strides[0], x.shape[1], *strides[1:]) if grouped
                       else (strides[0], 1, 0, *strides[1:]))
    # sizes as separate arguments: torch parses them faster than a tuple (2 vs 3.6 us a call)
    lfc, lo, step, codes = (torch.empty(*shape, dtype=dtype)
                            for dtype, shape in _token_parts(geom, bits))
    if noise is not None:
        noise = _for_c(noise.float())
    status = lib.freqact_token_encode(
        args, bits, x.data_ptr(), None if noise is None else noise.data_ptr(), seed % 2**64,
        lfc.data_ptr(), lo.data_ptr(), step.data_ptr(), codes.data_ptr(), _threads())
    if status != 0:
        raise MemoryError("token_encode: out of memory for the per-thread scratch buffers")
    return lfc, lo, step, codes


def token_decode(lfc: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor,
                 geom: TokenGeometry, bits: int, out: torch.Tensor) -> None:
    """Inverse of `token_encode` into `out`: upsample(lfc) + (q * step + lo) in float32.

    Args:
        lfc, lo, step, codes: as `token_encode` returns them (dtypes and shapes checked here:
            the C code reads that many bytes).
        out: float32 (M, >= H * W, F) with contiguous (H * W, F) panels (strides (any, F, 1));
            panel m is written at out[m, :H * W].

    Raises:
        ValueError: naming the part whose dtype, shape or device disagrees with geom.
    """
    lib = _lib()
    bits = check_bits(bits)
    parts = (lfc, lo, step, codes)
    expected = _token_parts(geom, bits)
    if not all(isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape
               and t.device.type == "cpu" for t, (dtype, shape) in zip(parts, expected)):
        for name, t, (dtype, shape) in zip(("lfc", "lo", "step", "codes"), parts, expected):
            _check_part(name, t, dtype, list(shape), torch.device("cpu"))
    m, h, w, f = geom.panel
    if (out.dtype != torch.float32 or out.dim() != 3 or out.shape[0] != m or out.shape[1] < h * w
            or out.shape[2] != f or out.stride()[1:] != (f, 1) or out.device.type != "cpu"
            or (m > 1 and out.stride(0) < h * w * f)  # overlapping panels would race
            or out.is_neg()):  # the C code writes the values, not their negation
        raise ValueError(f"out: expected float32 (M, >= {h * w}, {f}) disjoint CPU panels, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    args = _token_args(geom, bits, out_stride=out.stride(0))
    _strided_for_c("out", out)
    parts = [_for_c(t) for t in parts]
    written = _span(out)
    for name, t in zip(("lfc", "lo", "step", "codes"), parts):
        # a part read while out is written gives other values. Byte ranges, not storages, are
        # compared: distinct storages may alias one buffer (torch.from_numpy of two views of an
        # array, frombuffer, DLPack); the parts are contiguous here.
        if _overlap((t.data_ptr(), t.data_ptr() + t.nbytes), written):
            raise ValueError(f"out: expected memory apart from the parts', got memory that "
                             f"overlaps packed.{name}'s")
    status = lib.freqact_token_decode(args, bits, *(t.data_ptr() for t in parts), out.data_ptr(),
                                      _threads())
    if status != 0:
        raise MemoryError("token_decode: out of memory for the per-thread scratch buffers")


def token_flat(x: torch.Tensor, step: torch.Tensor) -> bool:
    """`reference.token_flat` in one pass of C: whether some token's values span less than its
    step (max - min < step in float32; never a token with a NaN).

    Args:
        x: float32 CPU (M, T, F), F >= 1, any strides (read in place).
        step: bfloat16 CPU (M, T).

    Raises:
        ValueError: naming x or step when its dtype, shape or device is not that.
    """
    if (x.dtype != torch.float32 or x.dim() != 3 or x.shape[2] < 1 or x.device.type != "cpu"
            or x.layout != torch.strided):
        raise ValueError(f"x: expected a float32 (M, T, F >= 1) strided CPU tensor, got "
                         f"{x.dtype} {tuple(x.shape)} on {x.device}")
    _check_part("step", step, torch.bfloat16, list(x.shape[:2]), torch.device("cpu"))
    if x.numel() == 0:
        return False
    x, step = _strided_for_c("x", x), _for_c(step)
    return bool(_lib().freqact_token_flat(_flat_args(tuple(x.shape), x.stride()), x.data_ptr(),
                                          step.data_ptr(), _threads()))


@functools.lru_cache(maxsize=1024)  # a few shapes per model, asked at every norm input's pack
def _flat_args(shape: tuple[int, ...], strides: tuple[int, ...]):
    """The C array (M, T, F, sm, st, sf) of `token_flat`: x's own shape and strides (so every
    element read is x's), each value and each extent size * stride range-checked."""
    _c_int64("x.numel()", math.prod(shape))
    for size, stride in zip(shape, strides):
        _c_int64("x's extent", size * stride)
    values = (*shape, *strides)
    return (ctypes.c_int64 * 6)(*(_c_int64("x's shape and strides", v) for v in values))
