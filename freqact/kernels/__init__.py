"""Fast paths for the division codec, chosen at run time.

`division_encode` / `division_decode` validate, then dispatch: the fused Triton kernels
(`freqact.kernels.triton_division`, registered as `torch.ops.freqact.*` in `freqact.kernels.ops`)
on CUDA tensors when triton imports, the pure-torch reference (`freqact.kernels.reference`, the
specification and the CPU path) otherwise. Both produce the same packed format, so a form encoded
by one decodes with the other. Callers never branch on the backend.

The choice: the keyword `backend=` if given, else the environment variable `FREQACT_KERNELS`
(read at every call), each one of "auto" (the default), "torch" or "triton". "triton" on a CPU
tensor runs the kernels in Triton's interpreter and is only allowed with TRITON_INTERPRET=1 (set
before triton is first imported). The ablation forms (no lfc or no codes) always use the reference.
"""
from __future__ import annotations

import functools
import os

import torch

from freqact import _validate
from freqact.kernels import ops, reference
from freqact.kernels.reference import DivisionPacked

__all__ = ["BACKENDS", "DivisionPacked", "backend_for", "division_decode", "division_encode"]

BACKENDS = ("auto", "torch", "triton")


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def backend_for(t: torch.Tensor, backend: str | None = None) -> str:
    """The backend ("torch" or "triton") that the codec functions use for tensors like `t`.

    Args:
        t: a tensor on the device the work would run on.
        backend: "auto", "torch" or "triton"; None reads FREQACT_KERNELS (default "auto").

    Raises:
        ValueError: if the choice is unknown, or "triton" is asked for a CPU tensor without
            TRITON_INTERPRET=1.
        RuntimeError: if "triton" is asked for and triton cannot be imported.
    """
    if backend is None:
        choice = _validate.choice("FREQACT_KERNELS", os.environ.get("FREQACT_KERNELS", "auto"),
                                  BACKENDS)
    else:
        choice = _validate.choice("backend", backend, BACKENDS)
    if choice == "auto":
        return "triton" if t.is_cuda and _triton_importable() else "torch"
    if choice == "triton":
        if not _triton_importable():
            raise RuntimeError("backend 'triton' was requested but triton cannot be imported")
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend 'triton': expected a CUDA tensor (or TRITON_INTERPRET=1 to interpret the "
                f"kernels on the CPU), got a tensor on {t.device}"
            )
    return choice


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
            (both backends then give identical bytes).
        backend: "auto", "torch" or "triton"; None reads FREQACT_KERNELS.

    Returns:
        DivisionPacked: lfc bf16 (N, C, *nb), lo and step bf16 (N, C), codes uint8
        (N, C, ceil(P * bits / 8)). The Triton path draws its Philox seed from torch's default
        generator, so every call differs and torch.manual_seed makes runs reproducible.

    Raises:
        TypeError, ValueError: on bad arguments (see `reference.check_division_args`) or backend.
    """
    reference.check_division_args(x, block, bits, noise)
    if backend_for(x, backend) == "torch":
        return reference.division_encode(x, block, bits, noise)
    seed = 0 if noise is not None else int(torch.randint(2**62, (), dtype=torch.int64))
    lfc, lo, step, codes = ops.division_encode(x, block, bits, noise, seed)
    return DivisionPacked(lfc, lo, step, codes, x.shape, x.dtype, block, bits)


@torch.no_grad()
def division_decode(packed: DivisionPacked, *, backend: str | None = None) -> torch.Tensor:
    """Rebuild the activation maps from a DIVISION packed form (from either backend).

    Args:
        packed: a DivisionPacked; the ablation forms (lfc or codes None) use the reference.
        backend: "auto", "torch" or "triton"; None reads FREQACT_KERNELS.

    Returns:
        Contiguous tensor of packed.shape and packed.dtype on the packed tensors' device.

    Raises:
        TypeError: if packed is not a DivisionPacked.
        ValueError, RuntimeError: on a bad backend choice (see `backend_for`).
    """
    if not isinstance(packed, DivisionPacked):
        raise TypeError(f"packed: expected a DivisionPacked, got {type(packed).__name__}")
    if packed.lfc is None or packed.codes is None or backend_for(packed.lfc, backend) == "torch":
        return reference.division_decode(packed)
    return ops.division_decode(packed.lfc, packed.lo, packed.step, packed.codes,
                               list(packed.shape), packed.dtype, packed.block, packed.bits)
