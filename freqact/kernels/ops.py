"""The Triton DIVISION kernels registered as torch.library custom ops.

`torch.ops.freqact.division_encode` and `torch.ops.freqact.division_decode` take and return plain
tensors (the `DivisionPacked` dataclass is built around them in `freqact.kernels`), and have fake
(shape-only) implementations, so they trace under torch.compile / make_fx and pass through
autocast untouched. The random seed is an argument: the op itself is a pure function.

Importing this module does not import triton; the kernels are imported when an op first runs.
"""
from typing import Optional

import torch

from freqact.kernels import reference

__all__ = ["division_encode", "division_decode"]


@torch.library.custom_op("freqact::division_encode", mutates_args=())
def division_encode(
    x: torch.Tensor, block: int, bits: int, noise: Optional[torch.Tensor], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode x with the fused kernel; see `triton_division.encode` for shapes.

    Returns:
        (lfc, lo, step, codes): bf16 (N, C, *nb), bf16 (N, C), bf16 (N, C), uint8 (N, C, nbytes).
    """
    from freqact.kernels import triton_division

    return triton_division.encode(x, block, bits, noise, seed)


@division_encode.register_fake
def _division_encode_fake(x, block, bits, noise, seed):
    lfc, stat, codes = reference.packed_shapes(x.shape, block, bits)
    return (
        x.new_empty(lfc, dtype=torch.bfloat16),
        x.new_empty(stat, dtype=torch.bfloat16),
        x.new_empty(stat, dtype=torch.bfloat16),
        x.new_empty(codes, dtype=torch.uint8),
    )


@torch.library.custom_op("freqact::division_decode", mutates_args=())
def division_decode(
    lfc: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    codes: torch.Tensor,
    shape: list[int],
    dtype: torch.dtype,
    block: int,
    bits: int,
) -> torch.Tensor:
    """Decode a packed form with the fused kernel; returns a contiguous (shape) tensor of dtype."""
    from freqact.kernels import triton_division

    return triton_division.decode(lfc, lo, step, codes, torch.Size(shape), dtype, block, bits)


@division_decode.register_fake
def _division_decode_fake(lfc, lo, step, codes, shape, dtype, block, bits):
    return lfc.new_empty(shape, dtype=dtype)
