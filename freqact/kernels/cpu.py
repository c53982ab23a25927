"""Fused C kernels for the division codec on the CPU, built on first use.

`cpu_division.c` (beside this file) encodes and decodes the DIVISION packed format in one pass
over each map's data, and packs/unpacks Q-bit codes; the torch reference stays the
specification (see the C file's header for what may differ: the order of block sums).

Build: the first call compiles the C file with the system compiler (`$CC`, else `cc`; with
OpenMP, or single-threaded where the compiler has none) into a shared library cached under
`$FREQACT_CACHE` (default `~/.cache/freqact`), named by a hash of the source, compiler, flags and
CPU (model name and instruction-set flags), and written to a temporary name then renamed, so
concurrent processes (DDP ranks, pytest workers) never load a half-written file. It is loaded
with ctypes and given tensors by data pointer; OpenMP threads follow `torch.get_num_threads()`.
When no compiler works, `available()` is False, `unavailable_reason()` says why, and the
dispatch in `freqact.kernels` falls back to the reference.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch

from freqact.kernels.reference import as_maps, packed_shapes

__all__ = ["available", "division_decode", "division_encode", "library_path", "load_library",
           "pack_codes", "pack_mask", "unavailable_reason", "unpack_codes", "unpack_mask"]

SOURCE = Path(__file__).with_name("cpu_division.c")
# No -ffast-math and no FMA contraction: each float operation must round as torch's does.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c11", "-fPIC", "-shared")

_i64, _int, _u64, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p
_SIGNATURES = {
    "freqact_division_encode": ([_i64] * 5 + [_int] + [_ptr] * 2 + [_u64] + [_ptr] * 4 + [_int],
                                _int),
    "freqact_division_decode": ([_i64] * 5 + [_int] + [_ptr] * 5 + [_int], _int),
    "freqact_pack_codes": ([_i64, _i64, _int, _ptr, _ptr, _int], None),
    "freqact_unpack_codes": ([_i64, _i64, _int, _ptr, _ptr, _int], None),
    "freqact_pack_mask": ([_i64, _ptr, ctypes.c_float, _int, ctypes.c_float, _ptr, _int], None),
    "freqact_unpack_mask": ([_i64, _ptr, ctypes.c_float, ctypes.c_float, _ptr, _int], None),
}


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


def library_path(source: Path = SOURCE, cflags: tuple[str, ...] = CFLAGS) -> Path:
    """Where the compiled library for this source, compiler, flags and CPU lives (or will)."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(_compiler()).encode(), " ".join(cflags).encode(),
                 platform.machine().encode(), _cpu_model().encode()):  # -march=native
        key.update(part + b"\0")
    cache = Path(os.environ.get("FREQACT_CACHE") or Path.home() / ".cache" / "freqact")
    return cache / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _build(target: Path, source: Path = SOURCE, cflags: tuple[str, ...] = CFLAGS) -> None:
    """Compile source to target; without -fopenmp if the compiler refuses it (single-threaded)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        errors = []
        for flags in (cflags, tuple(f for f in cflags if f != "-fopenmp")):
            cmd = [*_compiler(), *flags, str(source), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(tmp, target)
                return
            errors.append(f"{shlex.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        raise OSError(errors[0])
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(source: Path, cflags: tuple[str, ...] = CFLAGS) -> ctypes.CDLL | str:
    """The C file `source` built (once per content, cached as above) and loaded, or a string
    saying why not. Callers keep the result (e.g. in a functools.cache) and set the argument and
    result types of the functions they use.
    """
    try:
        path = library_path(source, cflags)
        if not path.exists():
            _build(path, source, cflags)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as err:
        return f"the C kernels of {source.name} could not be built or loaded: {err}"


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded library, or a string saying why it cannot be had."""
    lib = load_library(SOURCE)
    if isinstance(lib, str):
        return lib
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def available() -> bool:
    """Whether the compiled kernels can be used (builds them on the first call)."""
    return not isinstance(_library(), str)


def unavailable_reason() -> str | None:
    """None when `available()`, else why not (the compiler's error, for instance)."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def _lib() -> ctypes.CDLL:
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return lib


def _dhw(spatial: tuple[int, ...]) -> tuple[int, int, int]:
    """A map's spatial dims as (D, H, W): 1D maps are 1 x 1 x L, 2D maps 1 x H x W."""
    return (1,) * (3 - len(spatial)) + tuple(spatial)


def division_encode(x: torch.Tensor, block: int | None, bits: int, noise: torch.Tensor | None,
                    seed: int):
    """Encode like `reference.division_encode` (block int) or `quantize_encode` (block None).

    Arguments are assumed valid (the dispatch checks them). x: CPU floating tensor of rank 2-5,
    any layout and dtype (read as float32 in logical order); noise: float32 like x or None;
    seed: a 64-bit integer for the noise stream when noise is None.

    Returns:
        (lfc, lo, step, codes): bf16 (N, C, *nb) or None, bf16 (N, C), bf16 (N, C),
        uint8 (N, C, ceil(P * bits / 8)).
    """
    lib = _lib()
    xm = as_maps(x).float().contiguous()
    n, c, *spatial = xm.shape
    lfc_shape, stat_shape, codes_shape = packed_shapes(x.shape, block, bits)
    lfc = None if block is None else torch.empty(lfc_shape, dtype=torch.bfloat16)
    lo = torch.empty(stat_shape, dtype=torch.bfloat16)
    step = torch.empty(stat_shape, dtype=torch.bfloat16)
    codes = torch.empty(codes_shape, dtype=torch.uint8)
    if noise is not None:
        noise = as_maps(noise).contiguous()
    status = lib.freqact_division_encode(
        n * c, *_dhw(tuple(spatial)), block or 0, bits, xm.data_ptr(),
        None if noise is None else noise.data_ptr(), seed % 2**64,
        None if lfc is None else lfc.data_ptr(), lo.data_ptr(), step.data_ptr(), codes.data_ptr(),
        torch.get_num_threads())
    if status != 0:
        raise MemoryError("division_encode: out of memory for the per-thread scratch buffers")
    return lfc, lo, step, codes


def division_decode(lfc: torch.Tensor | None, lo: torch.Tensor, step: torch.Tensor,
                    codes: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                    block: int | None, bits: int) -> torch.Tensor:
    """Decode like `reference.division_decode` for forms with codes (lfc None: no block means).

    Returns:
        Contiguous tensor of `shape` and `dtype` on the CPU.
    """
    lib = _lib()
    maps_shape = as_maps(torch.empty(shape, device="meta")).shape
    out = torch.empty(maps_shape, dtype=torch.float32)
    tensors = [t.contiguous() for t in (lo, step, codes)]
    lfc = None if lfc is None else lfc.contiguous()
    status = lib.freqact_division_decode(
        maps_shape[0] * maps_shape[1], *_dhw(tuple(maps_shape[2:])),
        0 if lfc is None else block, bits, None if lfc is None else lfc.data_ptr(),
        *(t.data_ptr() for t in tensors), out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError("division_decode: out of memory for the per-thread scratch buffers")
    return out.reshape(shape).to(dtype)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """As `reference.pack_codes`: uint8 codes (..., P) -> uint8 (..., ceil(P * bits / 8))."""
    lib = _lib()
    q = q.contiguous()
    count = q.shape[-1]
    out = torch.empty((*q.shape[:-1], -(-count * bits // 8)), dtype=torch.uint8)
    lib.freqact_pack_codes(q.numel() // max(count, 1), count, bits, q.data_ptr(), out.data_ptr(),
                           torch.get_num_threads())
    return out


def unpack_codes(codes: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """As `reference.unpack_codes`: uint8 (..., nbytes) -> uint8 codes (..., count)."""
    lib = _lib()
    codes = codes.contiguous()
    out = torch.empty((*codes.shape[:-1], count), dtype=torch.uint8)
    rows = codes.numel() // max(codes.shape[-1], 1)
    lib.freqact_unpack_codes(rows, count, bits, codes.data_ptr(), out.data_ptr(),
                             torch.get_num_threads())
    return out


def pack_mask(x: torch.Tensor, lower: float, upper: float | None = None) -> torch.Tensor:
    """As `reference.pack_mask` for a float32 CPU tensor: uint8 (ceil(numel / 8),)."""
    lib = _lib()
    x = x.contiguous()
    out = torch.empty(-(-x.numel() // 8), dtype=torch.uint8)
    lib.freqact_pack_mask(x.numel(), x.data_ptr(), lower, upper is not None,
                          0.0 if upper is None else upper, out.data_ptr(), torch.get_num_threads())
    return out


def unpack_mask(packed: torch.Tensor, shape: torch.Size, off: float, on: float) -> torch.Tensor:
    """As `reference.unpack_mask` with dtype float32: a float32 CPU tensor of `shape`."""
    lib = _lib()
    packed = packed.contiguous()
    out = torch.empty(shape, dtype=torch.float32)
    lib.freqact_unpack_mask(out.numel(), packed.data_ptr(), off, on, out.data_ptr(),
                            torch.get_num_threads())
    return out

