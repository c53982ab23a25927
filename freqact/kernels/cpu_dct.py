"""Fused C kernels of the 2D (and 1D) orthonormal DCT on the CPU: `cpu_dct.c`, built on first use.

Built, cached and loaded by `freqact.kernels.cpu.load_library` (same compiler, cache, CPU key
and trust checks as the division kernels), with FMA contraction allowed: these kernels are
checked against the float64 DCT to float32 accuracy, not bit-matched. `freqact.dct` calls them
for float32 work that needs no gradient (inside the codecs, analyses under no_grad); the matmul
path stays the reference and serves autograd, float64, 3D transforms and CUDA.

Every function here takes a float32 CPU tensor of maps (..., h, w) and checks every value it
passes to C (sizes, windows, thread count, dtype, contiguity): a failed check is a ValueError /
TypeError naming the argument, never memory corruption.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from freqact.kernels import cpu

__all__ = ["MAX_SIZE", "available", "band_energy", "dct2", "dct_corner", "dct_corner_checked",
           "highpass",
           "idct_corner", "unavailable_reason"]

SOURCE = Path(__file__).with_name("cpu_dct.c")
CFLAGS = tuple("-ffp-contract=fast" if f == "-ffp-contract=off" else f for f in cpu.CFLAGS)

MAX_SIZE = 1024
"""Largest transformed dim the C path takes (its basis tables are O(n²) per call)."""

_MAX_ELEMENTS = 2**62  # int64 index arithmetic in C stays far from overflow
_MAX_THREADS = 4096

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "freqact_dct": ([_i64] * 3 + [_ptr] * 2 + [_int] * 2, _int),
    "freqact_dct_corner": ([_i64] * 5 + [_ptr] * 2 + [_int], _int),
    "freqact_idct_corner": ([_i64] * 5 + [_ptr] * 2 + [_int], _int),
    "freqact_highpass": ([_i64] * 5 + [_ptr] * 2 + [_int], _int),
    "freqact_band_energy": ([_i64] * 5 + [_ptr] * 3 + [_int], _int),
}


@functools.cache
def _library() -> ctypes.CDLL | str:
    return cpu.load_library(SOURCE, CFLAGS, _SIGNATURES)


def available() -> bool:
    """Whether the kernels can be used: built, and not switched off by FREQACT_KERNELS=torch."""
    return os.environ.get("FREQACT_KERNELS", "auto") != "torch" and not isinstance(_library(), str)


def unavailable_reason() -> str | None:
    """None when the library loads, else why not."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def _lib() -> ctypes.CDLL:
    return cpu.loaded(_library())


def _threads() -> int:
    threads = torch.get_num_threads()
    if not 1 <= threads <= _MAX_THREADS:
        raise ValueError(f"threads: expected 1 to {_MAX_THREADS} torch threads, got {threads}")
    return threads


def _check_maps(name: str, x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x as a contiguous float32 CPU tensor and its (maps, h, w); 1D data (..., L) is h = 1."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"{name}: expected a float32 CPU tensor, got {x.dtype} on {x.device}")
    if x.dim() < 2:
        raise ValueError(f"{name}: expected shape (..., h, w), got {tuple(x.shape)}")
    h, w = x.shape[-2:]
    if not (1 <= h <= MAX_SIZE and 1 <= w <= MAX_SIZE):
        raise ValueError(f"{name}: expected map sizes in [1, {MAX_SIZE}], got {h} x {w}")
    if x.numel() >= _MAX_ELEMENTS:
        raise ValueError(f"{name}: too many elements for the C kernels ({x.numel()})")
    return x.contiguous(), x.numel() // (h * w), h, w


def _check_window(name: str, window: int, size: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= size:
        raise ValueError(f"{name}: expected an integer in [1, {size}], got {window!r}")
    return window


def _status(name: str, status: int) -> None:
    if status != 0:
        raise MemoryError(f"{name}: out of memory for the per-thread scratch buffers")


def dct2(x: torch.Tensor, inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """DCT-II (or its inverse) over the last 2 dims of a float32 CPU tensor (..., h, w).

    `out`: a contiguous float32 CPU tensor of x's shape to write to (x itself is allowed: each
    map is read into scratch before its output is written); a fresh one when None.
    """
    x, maps, h, w = _check_maps("x", x)
    if out is None:
        out = torch.empty_like(x)
    elif not (isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device.type == "cpu"
              and out.shape == x.shape and out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous float32 CPU tensor of shape {tuple(x.shape)}")
    _status("dct2", _lib().freqact_dct(maps, h, w, x.data_ptr(), out.data_ptr(), int(bool(inverse)),
                                       _threads()))
    return out


def dct_corner(x: torch.Tensor, wh: int, ww: int) -> torch.Tensor:
    """The top-left (wh, ww) DCT coefficients of each map of x (..., h, w): (..., wh, ww)."""
    return dct_corner_checked(x, wh, ww)[0]


def dct_corner_checked(x: torch.Tensor, wh: int, ww: int) -> tuple[torch.Tensor, bool]:
    """`dct_corner`'s coefficients and whether all of them are finite (checked in the kernel)."""
    x, maps, h, w = _check_maps("x", x)
    wh, ww = _check_window("wh", wh, h), _check_window("ww", ww, w)
    out = x.new_empty((*x.shape[:-2], wh, ww))
    status = _lib().freqact_dct_corner(maps, h, w, wh, ww, x.data_ptr(), out.data_ptr(), _threads())
    if status != 1:
        _status("dct_corner", status)
    return out, status == 0


def idct_corner(coeffs: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse DCT of corner coefficients (..., wh, ww) zero-padded to (h, w): (..., h, w)."""
    coeffs, maps, wh, ww = _check_maps("coeffs", coeffs)
    for name, size, window in (("h", h, wh), ("w", w, ww)):
        if isinstance(size, bool) or not isinstance(size, int) or not window <= size <= MAX_SIZE:
            raise ValueError(f"{name}: expected an integer in [{window}, {MAX_SIZE}], got {size!r}")
    out = coeffs.new_empty((*coeffs.shape[:-2], h, w))
    _status("idct_corner", _lib().freqact_idct_corner(maps, h, w, wh, ww, coeffs.data_ptr(),
                                                      out.data_ptr(), _threads()))
    return out


def highpass(x: torch.Tensor, wh: int, ww: int) -> torch.Tensor | None:
    """x minus the inverse DCT of its own top-left (wh, ww) corner, per map of x (..., h, w).

    One pass per map (`freqact_highpass`): the same values as `idct_corner(dct_corner(x, wh, ww),
    h, w)` subtracted from x. Returns None when a corner coefficient is not finite (an input near
    float32's range, or not finite), so that the caller can apply its own rule.
    """
    x, maps, h, w = _check_maps("x", x)
    wh, ww = _check_window("wh", wh, h), _check_window("ww", ww, w)
    out = torch.empty_like(x)
    status = _lib().freqact_highpass(maps, h, w, wh, ww, x.data_ptr(), out.data_ptr(), _threads())
    if status == 1:
        return None
    _status("highpass", status)
    return out


def band_energy(x: torch.Tensor, wh: int, ww: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per map of x (..., h, w): the float64 sums of squared DCT coefficients inside and outside
    the top-left (wh, ww) corner, each shaped x.shape[:-2]."""
    x, maps, h, w = _check_maps("x", x)
    wh, ww = _check_window("wh", wh, h), _check_window("ww", ww, w)
    low = torch.empty(x.shape[:-2], dtype=torch.float64)
    high = torch.empty(x.shape[:-2], dtype=torch.float64)
    _status("band_energy", _lib().freqact_band_energy(maps, h, w, wh, ww, x.data_ptr(),
                                                      low.data_ptr(), high.data_ptr(), _threads()))
    return low, high
