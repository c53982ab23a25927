"""DIVISION's average-pooling LFC against the DCT low-pass (the paper's Theorem 4.1, measured).

DIVISION estimates the LFC of a map by B×B block means, upsampled by nearest neighbour (a dim
smaller than B is one block; edge blocks average only the elements they cover). The orthonormal DCT
of one block has DC coefficient sqrt(block size) × its mean (B × mean for a full B×B block), so the
block mean is the block-DCT low-pass that keeps the DC term only. Both estimators are orthogonal
projections, so the share of energy each captures is ‖LFC‖²/‖x‖² and what it misses is the rest.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from freqact import _validate, dct
from freqact.analysis.common import capture, map_dims, select_layers
from freqact.kernels import format

BLOCKS = (2, 4, 8, 16)


def block_means(x: torch.Tensor, block: int, dims: int = 2) -> torch.Tensor:
    """Exact means of the non-overlapping blocks of the last `dims` dims (DIVISION's pooled LFC).

    Args:
        x: real floating tensor, shape (*, S_1, ..., S_dims).
        block: block size B >= 1; a dim with S_d < B is one block of size S_d.
        dims: 1, 2 or 3.

    Returns:
        Shape (*, ceil(S_1 / B_1), ..., ceil(S_dims / B_dims)) with B_d = min(B, S_d); edge blocks
        average only the elements they cover.
    """
    _validate.floating_tensor("x", x)
    _validate.positive_int("block", block)
    return format.block_means(x, block, dims)


def block_mean_lfc(x: torch.Tensor, block: int, dims: int = 2) -> torch.Tensor:
    """DIVISION's LFC: every element replaced by its block's mean (nearest upsampling of
    `block_means`). Same shape as x."""
    lfc = block_means(x, block, dims)
    for axis, size in enumerate(x.shape[x.dim() - dims :], start=x.dim() - dims):
        lfc = lfc.repeat_interleave(min(block, size), dim=axis).narrow(axis, 0, size)
    return lfc


def _dc_identity_error(x: torch.Tensor, block: int, dims: int) -> float:
    """max |block mean − block-DCT DC / sqrt(block size)| over all blocks, in float64."""
    sizes = x.shape[x.dim() - dims :]
    dc = dct.block_dct(x, block, dims)
    scale = torch.ones(())
    for axis, size in enumerate(sizes):
        b = min(block, size)
        # the DC terms sit at the first index of each block; edge blocks may be shorter
        dc = dc.narrow(dc.dim() - dims + axis, 0, size).index_select(
            dc.dim() - dims + axis, torch.arange(0, size, b, device=x.device)
        )
        lengths = torch.tensor([min(b, size - start) for start in range(0, size, b)], dtype=x.dtype)
        scale = scale.unsqueeze(-1) * lengths
    means_from_dc = dc / scale.sqrt().to(x.device)
    return float((block_means(x, block, dims) - means_from_dc).abs().max())


def compare(h: torch.Tensor, block: int) -> dict:
    """Block-mean LFC vs DCT low-pass (ratio 1/B) on one activation tensor, over the whole batch.

    Args:
        h: activations (N, F), (N, C, L), (N, C, H, W) or (N, C, D, H, W) (map dims as the codecs).
        block: DIVISION block size B.

    Returns:
        {"block", "map", "window", "rel_dist", "energy_pool", "energy_dct", "dc_identity_err"}:
        map and window as "HxW" strings (W_d = min(S_d, max(1, floor(S_d / B + 0.5))): S_d / B
        rounded half up, `dct.lowpass_mask`'s default "nearest" rule),
        rel_dist = ‖LFC_pool − LFC_dct‖_F / ‖h‖_F, energy_* = ‖LFC‖_F² / ‖h‖_F², and the largest
        |block mean − DC / sqrt(block size)| (0 up to float64 rounding).
    """
    _validate.floating_tensor("h", h)
    dims = map_dims(h)
    h64 = h.double()
    sizes = h.shape[h.dim() - dims :]
    pooled = block_mean_lfc(h64, block, dims)
    low = dct.lowpass(h64, 1.0 / block, dims)
    energy = float(h64.square().sum())
    norm = math.sqrt(energy)
    kept = [int(dct.lowpass_mask([s], 1.0 / block).sum()) for s in sizes]
    return {
        "block": block,
        "map": "x".join(map(str, sizes)),
        "window": "x".join(map(str, kept)),
        "rel_dist": float((pooled - low).norm()) / norm if norm > 0 else 0.0,
        "energy_pool": float(pooled.square().sum()) / energy if energy > 0 else 1.0,
        "energy_dct": float(low.square().sum()) / energy if energy > 0 else 1.0,
        "dc_identity_err": _dc_identity_error(h64, block, dims),
    }


def check_blocks(blocks: object) -> list[int]:
    """`blocks` as a list of block sizes B: a non-empty sequence of integers >= 1.

    Raises:
        ValueError/TypeError: naming `blocks`.
    """
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence) or not blocks:
        raise ValueError(f"blocks: expected a non-empty list of block sizes, got {blocks!r}")
    return [_validate.positive_int("blocks", b) for b in blocks]


def measure(
    model: nn.Module, x: torch.Tensor, *, blocks: Sequence[int] = BLOCKS, layers: str = "blocks"
) -> list[dict]:
    """`compare` on the input images and on the selected activation maps, for every block size.

    Args:
        model: the network (eval mode, no autograd; left untouched).
        x: input batch, shape (N, *input_shape).
        blocks: DIVISION block sizes B.
        layers: which maps, as in `common.select_layers` (default: block outputs).

    Returns:
        One row per (layer, B): {"layer", **compare(...)}; layer "input" is the batch itself.
    """
    _validate.floating_tensor("x", x)
    blocks = check_blocks(blocks)
    maps = [("input", x)] + capture(model, x, select_layers(model, layers))
    return [{"layer": name, **compare(h, b)} for name, h in maps for b in blocks]
