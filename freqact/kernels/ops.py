"""The DIVISION codec and the 1-bit masks as torch.library custom ops, and the Triton backend.

`torch.ops.freqact.division_encode` / `division_decode` / `pack_mask` / `unpack_mask` run the
dispatching functions of `freqact.kernels` (the same validation and backend choice: C on the
CPU, Triton on CUDA, the reference where those cannot be had, or the `backend` argument), so a
graph calls exactly the code eager training calls. Their fake (shape-only) implementations derive
the shapes from `format.geometry`, so they trace under torch.compile / make_fx and pass through
autocast untouched. They take and return plain tensors (the packed types are built around them).

Noise: `division_encode` takes its seed as an int64 scalar tensor, so a compiled graph can draw a
fresh seed per step (a Python int would be baked into the graph as a constant, and every step
would reuse one noise stream). The C and Triton kernels give the same bytes for the same seed in
eager code and in a graph; the reference ignores the seed and draws torch.rand.

`encode` and `decode` at the bottom are the Triton backend (`reference`'s signature), called by
`freqact.kernels` for CUDA tensors. Importing this module does not import triton.
"""

import math

import torch

from freqact.kernels.format import Geometry, _check_part, check_packed, geometry

__all__ = ["decode", "division_decode", "division_encode", "encode", "pack_mask",
           "unpack_mask"]


def _kernels():
    # freqact.kernels imports this module: reach it at call time.
    from freqact import kernels

    return kernels


def _fresh(t: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where it shares storage with an input (a custom op's outputs must not
    alias its inputs; the empty-map paths may return views)."""
    for i in inputs:
        if i is not None and t.untyped_storage().data_ptr() == i.untyped_storage().data_ptr():
            return t.clone()
    return t


@torch.library.custom_op("freqact::division_encode", mutates_args=())
def division_encode(x: torch.Tensor, block: int, bits: int, noise: torch.Tensor | None,
                    seed: torch.Tensor, backend: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`freqact.kernels.division_encode` as an op.

    Args:
        x: floating tensor of rank 2 to 5, read as maps (N, C, *S).
        block, bits: B and Q.
        noise: None, or float32 uniforms shaped like x.
        seed: int64 scalar tensor, the fused kernels' noise-stream seed (any device; read once).
        backend: "auto", "torch", "triton" or "cpu".

    Returns:
        (lfc, lo, step, codes): bf16 (N, C, *nb), bf16 (N, C), bf16 (N, C), uint8 (N, C, nbytes).
    """
    p = _kernels().division_encode(x, block, bits, noise, seed=int(seed) % 2**64,
                                   backend=backend)
    return tuple(_fresh(t, x, noise) for t in (p.lfc, p.lo, p.step, p.codes))


@division_encode.register_fake
def _division_encode_fake(x, block, bits, noise, seed, backend="auto"):
    geom = geometry(x.shape, block)
    return (
        x.new_empty(geom.lfc_shape, dtype=torch.bfloat16),
        x.new_empty(geom.stat_shape, dtype=torch.bfloat16),
        x.new_empty(geom.stat_shape, dtype=torch.bfloat16),
        x.new_empty(geom.codes_shape(bits), dtype=torch.uint8),
    )


@torch.library.custom_op("freqact::division_decode", mutates_args=())
def division_decode(lfc: torch.Tensor, lo: torch.Tensor, step: torch.Tensor,
                    codes: torch.Tensor, shape: list[int], dtype: torch.dtype, block: int,
                    bits: int, backend: str = "auto",
                    positive: torch.Tensor | None = None) -> torch.Tensor:
    """`freqact.kernels.division_decode` of the full form as an op: a contiguous (shape) tensor
    of dtype.

    Args:
        positive: None, or a ReLU output's 1-bit `> 0` mask (uint8, `pack_mask`'s layout): the
            result is then `torch.where(mask, decoded.clamp_min(finfo(dtype).tiny), 0)`, exactly
            zero where the output was and positive elsewhere; the C kernels apply it in the
            decode's own pass (float32, bfloat16, float16), other backends and dtypes after it.
    """
    kernels = _kernels()
    packed = kernels.DivisionPacked(lfc, lo, step, codes, torch.Size(shape), dtype, block, bits)
    inputs = (lfc, lo, step, codes, positive)
    if positive is not None:  # its bytes, before any backend reads them
        _check_part("positive", positive, torch.uint8, [-(-math.prod(shape) // 8)], codes.device)
    if (positive is not None and dtype in kernels.cpu.POSITIVE_DTYPES and lfc.numel()
            and kernels.backend_for(codes, backend) == "cpu"):
        out = kernels.cpu.decode(lfc, lo, step, codes, check_packed(packed), bits, dtype,
                                 positive)
        return _fresh(out.reshape(shape), *inputs)
    out = kernels.division_decode(packed, backend=backend)
    if positive is not None:
        mask = kernels.unpack_mask(positive, out.shape, torch.float32, 0.0, 1.0,
                                   backend=backend) != 0
        out = torch.where(mask, out.clamp_min(torch.finfo(dtype).tiny), 0.0)
    return _fresh(out, *inputs)


@division_decode.register_fake
def _division_decode_fake(lfc, lo, step, codes, shape, dtype, block, bits, backend="auto",
                          positive=None):
    return lfc.new_empty(shape, dtype=dtype)


@torch.library.custom_op("freqact::pack_mask", mutates_args=())
def pack_mask(x: torch.Tensor, lower: float, upper: float | None = None,
              backend: str = "auto") -> torch.Tensor:
    """`freqact.kernels.pack_mask` as an op: uint8 (ceil(x.numel() / 8),)."""
    return _kernels().pack_mask(x, lower, upper, backend=backend)


@pack_mask.register_fake
def _pack_mask_fake(x, lower, upper=None, backend="auto"):
    return x.new_empty((-(-x.numel() // 8),), dtype=torch.uint8)


@torch.library.custom_op("freqact::unpack_mask", mutates_args=())
def unpack_mask(packed: torch.Tensor, shape: list[int], dtype: torch.dtype, off: float,
                on: float, backend: str = "auto") -> torch.Tensor:
    """`freqact.kernels.unpack_mask` as an op: a (shape) tensor of dtype, `on` where set."""
    out = _kernels().unpack_mask(packed, torch.Size(shape), dtype, off, on, backend=backend)
    return _fresh(out, packed)


@unpack_mask.register_fake
def _unpack_mask_fake(packed, shape, dtype, off, on, backend="auto"):
    return packed.new_empty(shape, dtype=dtype)


# --- the Triton backend ------------------------------------------------------------------------


def _op_block(geom: Geometry) -> int:
    """A block giving the same geometry that fits a C int64 (B above every dim covers the map)."""
    return min(geom.block, max(geom.spatial))


def encode(x: torch.Tensor, geom: Geometry, bits: int, noise: torch.Tensor | None, seed: int):
    """The Triton backend's encode (`reference.encode`'s signature; the full form only)."""
    from freqact.kernels import triton_division

    return triton_division.encode(x, geometry(x.shape, _op_block(geom)), bits, noise, seed)


def decode(lfc: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor,
           geom: Geometry, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The Triton backend's decode (`reference.decode`'s signature; the full form only)."""
    from freqact.kernels import triton_division

    maps = [geom.n, geom.c, *geom.spatial]
    return triton_division.decode(lfc, lo, step, codes, geometry(maps, _op_block(geom)), bits,
                                  dtype)
