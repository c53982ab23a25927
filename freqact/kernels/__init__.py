"""Fast paths for the division codec and code packing, chosen at run time.

`division_encode`, `quantize_encode`, `division_decode`, `pack_codes`/`unpack_codes` and the
1-bit masks `pack_mask`/`unpack_mask` dispatch (the encoders after validating their arguments) to
one of three backends that produce the same packed format (a form encoded by one decodes with any
other; callers never branch on the backend):

- "triton": the fused Triton kernels (`triton_division`, registered as `torch.ops.freqact.*` in
  `ops`), for CUDA tensors when triton imports;
- "cpu": the fused C kernels (`cpu`, built with the system compiler on first use), for CPU tensors;
- "torch": the pure-torch reference (`reference`), the specification, on any device.

The choice: the keyword `backend=` if given, else the environment variable `FREQACT_KERNELS`
(read at every call), one of "auto" (the default: triton on CUDA, cpu on the CPU, torch where
those cannot be had, with a one-time warning when the C kernels fail to build), "torch", "triton"
or "cpu". "triton" on a CPU tensor runs the kernels in Triton's interpreter and is only allowed
with TRITON_INTERPRET=1 (set before triton is first imported). Triton covers the full division
form; the quant and no-lfc forms use the C kernels on the CPU and the reference elsewhere.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from freqact import _validate
from freqact.kernels import cpu, ops, reference
from freqact.kernels.reference import DivisionPacked

__all__ = ["BACKENDS", "DivisionPacked", "backend_for", "division_decode", "division_encode",
           "pack_codes", "pack_mask", "quantize_encode", "unpack_codes", "unpack_mask"]

BACKENDS = ("auto", "torch", "triton", "cpu")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _cpu_kernels_available() -> bool:
    if cpu.available():
        return True
    warnings.warn(f"freqact: using the slower torch reference on the CPU; "
                  f"{cpu.unavailable_reason()}", RuntimeWarning, stacklevel=3)
    return False


def backend_for(t: torch.Tensor, backend: str | None = None) -> str:
    """The backend ("torch", "triton" or "cpu") that the codec functions use for tensors like `t`.

    Args:
        t: a tensor on the device the work would run on.
        backend: "auto", "torch", "triton" or "cpu"; None reads FREQACT_KERNELS (default "auto").

    Raises:
        ValueError: if the choice is unknown, "triton" is asked for a CPU tensor without
            TRITON_INTERPRET=1, or "cpu" for a tensor that is not on the CPU.
        RuntimeError: if "triton" is asked for and triton cannot be imported, or "cpu" and the C
            kernels cannot be built.
    """
    if backend is None:
        choice = _validate.choice("FREQACT_KERNELS", os.environ.get("FREQACT_KERNELS", "auto"),
                                  BACKENDS)
    else:
        choice = _validate.choice("backend", backend, BACKENDS)
    if choice == "auto":
        if t.is_cuda:
            return "triton" if _triton_importable() else "torch"
        return "cpu" if t.device.type == "cpu" and _cpu_kernels_available() else "torch"
    if choice == "cpu":
        if t.device.type != "cpu":
            raise ValueError(f"backend 'cpu': expected a CPU tensor, got a tensor on {t.device}")
        if not cpu.available():
            raise RuntimeError(f"backend 'cpu' was requested but {cpu.unavailable_reason()}")
    if choice == "triton":
        if not _triton_importable():
            raise RuntimeError("backend 'triton' was requested but triton cannot be imported")
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend 'triton': expected a CUDA tensor (or TRITON_INTERPRET=1 to interpret the "
                f"kernels on the CPU), got a tensor on {t.device}"
            )
    return choice


def _seed(noise: torch.Tensor | None) -> int:
    """The noise-stream seed of a fused kernel: drawn from torch's default CPU generator, so
    every call differs and torch.manual_seed makes runs reproducible (unused when noise given)."""
    return 0 if noise is not None else int(torch.randint(2**62, (), dtype=torch.int64))


@torch.no_grad()  # a codec, not a differentiable op: nothing may link the packed form to x
def division_encode(x: torch.Tensor, block: int = 8, bits: int = 2,
                    noise: torch.Tensor | None = None, *,
                    backend: str | None = None) -> DivisionPacked:
    """Encode activation maps in the DIVISION packed format (docs/ARCHITECTURE.md).

    Args:
        x: floating tensor of rank 2 to 5, read as maps (N, C, *S) (see `reference.as_maps`);
            any strides.
        block: block size B >= 1 of the block means.
        bits: bits per residual code, one of 1, 2, 4, 8.
        noise: optional float32 uniforms in [0, 1) shaped like x, used instead of random draws
            (every backend then gives the same bytes).
        backend: "auto", "torch", "triton" or "cpu"; None reads FREQACT_KERNELS.

    Returns:
        DivisionPacked: lfc bf16 (N, C, *nb), lo and step bf16 (N, C), codes uint8
        (N, C, ceil(P * bits / 8)). The fused kernels draw their noise from a counter-based
        generator (Philox on Triton, SplitMix64 in C) seeded from torch's default generator.

    Raises:
        TypeError, ValueError: on bad arguments (see `reference.check_division_args`) or backend.
    """
    reference.check_division_args(x, block, bits, noise)
    chosen = backend_for(x, backend)
    if chosen == "torch":
        return reference.division_encode(x, block, bits, noise)
    if chosen == "cpu":
        lfc, lo, step, codes = cpu.division_encode(x, block, bits, noise, _seed(noise))
    else:
        lfc, lo, step, codes = ops.division_encode(x, block, bits, noise, _seed(noise))
    return DivisionPacked(lfc, lo, step, codes, x.shape, x.dtype, block, bits)


@torch.no_grad()
def quantize_encode(x: torch.Tensor, bits: int = 2, noise: torch.Tensor | None = None, *,
                    backend: str | None = None) -> DivisionPacked:
    """Per-map Q-bit stochastic quantisation of x itself (`reference.quantize_encode`).

    Args:
        x, bits, noise, backend: as in `division_encode` (no block; "triton" runs the reference).

    Returns:
        DivisionPacked with lo/step bf16 (N, C) and codes uint8 (N, C, ceil(P * bits / 8)).
    """
    reference.check_division_args(x, 1, bits, noise)
    if backend_for(x, backend) == "cpu":
        _, lo, step, codes = cpu.division_encode(x, None, bits, noise, _seed(noise))
        return DivisionPacked(None, lo, step, codes, x.shape, x.dtype, None, bits)
    return reference.quantize_encode(x, bits, noise)


@torch.no_grad()
def division_decode(packed: DivisionPacked, *, backend: str | None = None) -> torch.Tensor:
    """Rebuild the activation maps from any DIVISION-family packed form (from any backend).

    Args:
        packed: a DivisionPacked. Forms without codes (LFC only) use the reference, and so do
            forms without lfc on CUDA.
        backend: "auto", "torch", "triton" or "cpu"; None reads FREQACT_KERNELS.

    Returns:
        Contiguous tensor of packed.shape and packed.dtype on the packed tensors' device.

    Raises:
        TypeError: if packed is not a DivisionPacked.
        ValueError, RuntimeError: on a bad backend choice (see `backend_for`).
    """
    if not isinstance(packed, DivisionPacked):
        raise TypeError(f"packed: expected a DivisionPacked, got {type(packed).__name__}")
    chosen = "torch" if packed.codes is None else backend_for(packed.codes, backend)
    if chosen == "cpu":
        return cpu.division_decode(packed.lfc, packed.lo, packed.step, packed.codes, packed.shape,
                                   packed.dtype, packed.block, packed.bits)
    if chosen == "torch" or packed.lfc is None:
        return reference.division_decode(packed)
    return ops.division_decode(packed.lfc, packed.lo, packed.step, packed.codes,
                               list(packed.shape), packed.dtype, packed.block, packed.bits)


def pack_codes(q: torch.Tensor, bits: int, *, backend: str | None = None) -> torch.Tensor:
    """Pack Q-bit codes along the last dim, 8 // Q per byte (see `reference.pack_codes`).

    Args:
        q: uint8 codes < 2**bits, shape (..., P), on any device.
        bits: Q in {1, 2, 4, 8}.
        backend: as in `division_encode`; the C kernels on the CPU, the reference elsewhere.

    Returns:
        uint8 (..., ceil(P * Q / 8)); code i at bit (i % (8 // Q)) * Q of byte i // (8 // Q).
    """
    if backend_for(q, backend) == "cpu":
        return cpu.pack_codes(q, bits)
    return reference.pack_codes(q, bits)


def unpack_codes(codes: torch.Tensor, count: int, bits: int, *,
                 backend: str | None = None) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 (..., nbytes) -> uint8 codes (..., count)."""
    if backend_for(codes, backend) == "cpu":
        return cpu.unpack_codes(codes, count, bits)
    return reference.unpack_codes(codes, count, bits)


def pack_mask(x: torch.Tensor, lower: float, upper: float | None = None, *,
              backend: str | None = None) -> torch.Tensor:
    """One bit per element: `lower < x` (and `x < upper` when given), 8 per byte, element i at
    bit i % 8 of byte i // 8 (see `reference.pack_mask`).

    Args:
        x: floating tensor, any shape and layout (read in logical order).
        lower, upper: ends of the open interval.
        backend: as in `division_encode`; the C kernel for float32 CPU tensors, else the reference.

    Returns:
        uint8 (ceil(x.numel() / 8),) on x's device.
    """
    if x.dtype == torch.float32 and backend_for(x, backend) == "cpu":
        return cpu.pack_mask(x, lower, upper)
    return reference.pack_mask(x, lower, upper)


def unpack_mask(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype, off: float,
                on: float, *, backend: str | None = None) -> torch.Tensor:
    """Inverse of `pack_mask` up to the values: a tensor of `shape` and `dtype` holding `on`
    where the bit is set and `off` elsewhere (both rounded to dtype)."""
    if dtype == torch.float32 and backend_for(packed, backend) == "cpu":
        return cpu.unpack_mask(packed, shape, off, on)
    return reference.unpack_mask(packed, shape, dtype, off, on)

