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

Every public function here validates its arguments against each other before any backend runs
(`format.check_packed` for packed forms): dtypes, shapes, counts and bits must agree with the
buffers, so no backend reads or writes past one; a bad argument is a one-line TypeError or
ValueError naming it. Empty inputs (no maps) give empty outputs, from the reference.
"""
from __future__ import annotations

import functools
import numbers
import os
import warnings

import torch

from freqact import _validate
from freqact.kernels import cpu, ops, reference
from freqact.kernels.format import (
    DivisionPacked,
    Geometry,
    LfcPacked,
    QuantPacked,
    check_bits,
    check_code_bytes,
    check_count,
    check_mask_bytes,
    check_packed,
    check_tensor,
    geometry,
)

__all__ = ["BACKENDS", "DivisionPacked", "LfcPacked", "QuantPacked", "backend_for",
           "division_decode", "division_encode", "lfc_encode", "pack_codes", "pack_mask",
           "quantize_encode", "unpack_codes", "unpack_mask"]

BACKENDS = ("auto", "torch", "triton", "cpu")
# The backend modules, one signature (`reference`'s docstring).
_MODULES = {"torch": reference, "cpu": cpu, "triton": ops}


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


def _module(t: torch.Tensor, backend: str | None, serves: tuple[str, ...], empty: bool = False):
    """The backend module for work on tensors like t: the chosen one if it is in `serves`, else
    the reference (which also takes empty work: a kernel launch over no maps is not needed)."""
    chosen = backend_for(t, backend)
    return _MODULES[chosen] if chosen in serves and not empty else reference


# --- argument checks -----------------------------------------------------------------------------


def _check_x(x: object, block: int | None) -> Geometry:
    geom = geometry(check_tensor("x", x).shape, block)
    if geom.maps and not geom.numel:
        raise ValueError(f"x: expected maps of at least one element, got shape {tuple(x.shape)}")
    return geom


def _check_noise(noise: object, x: torch.Tensor) -> None:
    if noise is None:
        return
    check_tensor("noise", noise, torch.float32)
    if noise.shape != x.shape or noise.device != x.device:
        raise ValueError(
            f"noise: expected shape {tuple(x.shape)} on {x.device} (like x), "
            f"got shape {tuple(noise.shape)} on {noise.device}"
        )


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {value!r}")
    return float(value)


def _seed(noise: torch.Tensor | None, generator: torch.Generator | None = None) -> int:
    """The noise-stream seed of a fused kernel: drawn from `generator` (a CPU generator; default:
    torch's default CPU generator), so every call differs and torch.manual_seed makes runs
    reproducible (unused when noise given)."""
    if noise is not None:
        return 0
    return int(torch.randint(2**62, (), dtype=torch.int64, generator=generator))


def _seed_value(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an integer in [0, 2**64), got {seed!r}")
    return int(seed)


# --- the codec functions -------------------------------------------------------------------------


@torch.no_grad()  # a codec, not a differentiable op: nothing may link the packed form to x
def division_encode(x: torch.Tensor, block: int = 8, bits: int = 2,
                    noise: torch.Tensor | None = None, *, seed: int | None = None,
                    backend: str | None = None) -> DivisionPacked:
    """Encode activation maps in the DIVISION packed format (docs/ARCHITECTURE.md).

    Args:
        x: floating tensor of rank 2 to 5, read as maps (N, C, *S) (see `format.as_maps`);
            any strides; no maps (N = 0) gives an empty form.
        block: block size B >= 1 of the block means (a B above a dim covers that dim).
        bits: bits per residual code, one of 1, 2, 4, 8.
        noise: optional float32 uniforms in [0, 1) shaped like x, used instead of random draws
            (every backend then gives the same bytes).
        seed: the fused kernels' noise-stream seed, an integer in [0, 2**64) (None: drawn from
            torch's default generator); the C and Triton kernels give the same bytes for the same
            seed, in eager code and in compiled graphs (`torch.ops.freqact.division_encode`); the
            reference draws torch.rand instead.
        backend: "auto", "torch", "triton" or "cpu"; None reads FREQACT_KERNELS.

    Returns:
        DivisionPacked: lfc bf16 (N, C, *nb), lo and step bf16 (N, C), codes uint8
        (N, C, ceil(P * bits / 8)). The fused kernels draw their noise from a counter-based
        generator (Philox on Triton, a SplitMix64-keyed lowbias32 hash in C) seeded from torch's default generator.

    Raises:
        TypeError, ValueError: on bad arguments (naming them) or backend.

    Example:
        >>> x = torch.randn(2, 3, 8, 8)
        >>> packed = division_encode(x, block=4, bits=2, backend="torch")
        >>> packed.lfc.shape  # one bf16 mean per 4 x 4 block
        torch.Size([2, 3, 2, 2])
        >>> division_decode(packed).shape
        torch.Size([2, 3, 8, 8])
    """
    geom = _check_x(x, _validate.positive_int("block", block))
    check_bits(bits)
    _check_noise(noise, x)
    module = _module(x, backend, ("torch", "cpu", "triton"), empty=not geom.maps)
    seed = _seed(noise) if seed is None else _seed_value(seed)
    lfc, lo, step, codes = module.encode(x, geom, bits, noise, seed)
    return DivisionPacked(lfc, lo, step, codes, x.shape, x.dtype, geom.block, bits)


@torch.no_grad()
def quantize_encode(x: torch.Tensor, bits: int = 2, noise: torch.Tensor | None = None, *,
                    backend: str | None = None) -> QuantPacked:
    """Per-map Q-bit stochastic quantisation of x itself (the `quant` ablation).

    Args:
        x, bits, noise, backend: as in `division_encode` (no block; "triton" runs the reference).

    Returns:
        QuantPacked with lo/step bf16 (N, C) and codes uint8 (N, C, ceil(P * bits / 8)).
    """
    geom = _check_x(x, None)
    check_bits(bits)
    _check_noise(noise, x)
    module = _module(x, backend, ("torch", "cpu"), empty=not geom.maps)
    _, lo, step, codes = module.encode(x, geom, bits, noise, _seed(noise))
    return QuantPacked(lo, step, codes, x.shape, x.dtype, bits)


@torch.no_grad()
def lfc_encode(x: torch.Tensor, block: int = 8) -> LfcPacked:
    """Keep only DIVISION's block means (the `division-no-hfc` ablation; the reference on any
    device). A NaN/Inf stays confined to its own block.

    Returns:
        LfcPacked with lfc bf16 (N, C, *nb); nbytes per map = 2 * prod(nb).
    """
    geom = _check_x(x, _validate.positive_int("block", block))
    return LfcPacked(reference.lfc_encode(x, geom), x.shape, x.dtype, geom.block)


@torch.no_grad()
def division_decode(packed: DivisionPacked | LfcPacked | QuantPacked, *,
                    backend: str | None = None) -> torch.Tensor:
    """Rebuild the activation maps from any DIVISION-family packed form (from any backend).

    Args:
        packed: a DivisionPacked, LfcPacked or QuantPacked whose tensors agree with its shape,
            block and bits (`format.check_packed`). LFC-only forms use the reference, and so do
            quant forms on CUDA.
        backend: "auto", "torch", "triton" or "cpu"; None reads FREQACT_KERNELS.

    Returns:
        Contiguous tensor of packed.shape and packed.dtype on the packed tensors' device.

    Raises:
        TypeError, ValueError: if packed is malformed (naming the part), or on a bad backend.
    """
    geom = check_packed(packed)
    if isinstance(packed, LfcPacked):
        out = reference.decode(packed.lfc, None, None, None, geom, None, packed.dtype)
        return out.reshape(packed.shape)
    lfc = packed.lfc if isinstance(packed, DivisionPacked) else None
    serves = ("torch", "cpu", "triton") if lfc is not None else ("torch", "cpu")
    module = _module(packed.codes, backend, serves, empty=not geom.maps)
    out = module.decode(lfc, packed.lo, packed.step, packed.codes, geom, packed.bits,
                        packed.dtype)
    return out.reshape(packed.shape)


def pack_codes(q: torch.Tensor, bits: int, *, backend: str | None = None) -> torch.Tensor:
    """Pack Q-bit codes along the last dim, 8 // Q per byte (see `reference.pack_codes`).

    Args:
        q: uint8 codes < 2**bits, shape (..., P) (at least one dim), on any device.
        bits: Q in {1, 2, 4, 8}.
        backend: as in `division_encode`; the C kernels on the CPU, the reference elsewhere.

    Returns:
        uint8 (..., ceil(P * Q / 8)); code i at bit (i % (8 // Q)) * Q of byte i // (8 // Q).
    """
    check_tensor("q", q, torch.uint8)
    check_bits(bits)
    if q.dim() == 0:
        raise ValueError("q: expected a tensor with at least one dim, got a scalar")
    if bits < 8 and q.numel() and int(q.max()) >= 2**bits:
        raise ValueError(f"q: expected codes < 2**bits = {2**bits}, got {int(q.max())}")
    return _module(q, backend, ("torch", "cpu"), empty=not q.numel()).pack_codes(q, bits)


def unpack_codes(codes: torch.Tensor, count: int, bits: int, *,
                 backend: str | None = None) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 (..., ceil(count * bits / 8)) -> uint8 codes (..., count).

    Raises:
        ValueError: if codes' last dim is not ceil(count * bits / 8) (it must hold count codes).
    """
    check_tensor("codes", codes, torch.uint8)
    count = check_count("count", count)
    check_bits(bits)
    check_code_bytes(codes, count, bits)
    module = _module(codes, backend, ("torch", "cpu"), empty=not codes.numel())
    return module.unpack_codes(codes, count, bits)


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
    check_tensor("x", x)
    lower = _real("lower", lower)
    upper = None if upper is None else _real("upper", upper)
    serves = ("torch", "cpu") if x.dtype == torch.float32 else ("torch",)
    return _module(x, backend, serves, empty=not x.numel()).pack_mask(x, lower, upper)


def unpack_mask(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype, off: float,
                on: float, *, backend: str | None = None) -> torch.Tensor:
    """Inverse of `pack_mask` up to the values: a tensor of `shape` and `dtype` holding `on`
    where the bit is set and `off` elsewhere (both rounded to dtype).

    Raises:
        ValueError: if packed is not 1-D with ceil(prod(shape) / 8) bytes.
    """
    check_tensor("packed", packed, torch.uint8)
    if not isinstance(shape, (tuple, list, torch.Size)):
        raise TypeError(f"shape: expected a tuple of sizes, got {type(shape).__name__}")
    shape = torch.Size([check_count("shape", s) for s in shape])
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    off, on = _real("off", off), _real("on", on)
    check_mask_bytes(packed, shape)
    serves = ("torch", "cpu") if dtype == torch.float32 else ("torch",)
    module = _module(packed, backend, serves, empty=not packed.numel())
    return module.unpack_mask(packed, shape, dtype, off, on)
