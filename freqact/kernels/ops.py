"""The Triton DIVISION kernels registered as torch.library custom ops, and the Triton backend.

`torch.ops.freqact.division_encode` and `torch.ops.freqact.division_decode` take and return plain
tensors (the packed types are built around them in `freqact.kernels`), and have fake
(shape-only) implementations from `format.geometry`, so they trace under torch.compile / make_fx
and pass through autocast untouched. The random seed is an argument: the op itself is a pure
function. `encode` and `decode` call them with the backend signature of `reference`.

Importing this module does not import triton; the kernels are imported when an op first runs.
"""

import torch

from freqact.kernels.format import Geometry, geometry

__all__ = ["decode", "division_decode", "division_encode", "encode"]


@torch.library.custom_op("freqact::division_encode", mutates_args=())
def division_encode(
    x: torch.Tensor, block: int, bits: int, noise: torch.Tensor | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode x with the fused kernel; see `triton_division.encode` for shapes.

    Returns:
        (lfc, lo, step, codes): bf16 (N, C, *nb), bf16 (N, C), bf16 (N, C), uint8 (N, C, nbytes).
    """
    from freqact.kernels import triton_division

    return triton_division.encode(x, geometry(x.shape, block), bits, noise, seed)


@division_encode.register_fake
def _division_encode_fake(x, block, bits, noise, seed):
    geom = geometry(x.shape, block)
    return (
        x.new_empty(geom.lfc_shape, dtype=torch.bfloat16),
        x.new_empty(geom.stat_shape, dtype=torch.bfloat16),
        x.new_empty(geom.stat_shape, dtype=torch.bfloat16),
        x.new_empty(geom.codes_shape(bits), dtype=torch.uint8),
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

    geom = geometry(shape, block)
    return triton_division.decode(lfc, lo, step, codes, geom, bits, dtype).reshape(shape)


@division_decode.register_fake
def _division_decode_fake(lfc, lo, step, codes, shape, dtype, block, bits):
    return lfc.new_empty(shape, dtype=dtype)


def _op_block(geom: Geometry) -> int:
    """A block giving the same geometry that fits the ops' int64 argument (B above every dim
    covers the whole map)."""
    return min(geom.block, max(geom.spatial))


def encode(x: torch.Tensor, geom: Geometry, bits: int, noise: torch.Tensor | None, seed: int):
    """The Triton backend's encode (`reference.encode`'s signature; the full form only)."""
    return division_encode(x, _op_block(geom), bits, noise, seed)


def decode(lfc: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor,
           geom: Geometry, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The Triton backend's decode (`reference.decode`'s signature; the full form only)."""
    maps = [geom.n, geom.c, *geom.spatial]
    return division_decode(lfc, lo, step, codes, maps, dtype, _op_block(geom), bits)
