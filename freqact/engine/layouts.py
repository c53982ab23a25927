"""Layouts of token tensors for the codec: which elements share a block mean and a min/step.

A token tensor is read as a view (M, T, F): M sequences (samples, or samples x heads) of T tokens
with F features; a channels-last token grid as (N, H, W, C). A layout is named
`<blocks>/<stats>` (measured in docs/ARCHITECTURE.md, "Layouts for token tensors"):

- blocks (whose elements share one bf16 block mean, B = 8):
  `feat` 8 features of one token (8 elements); `tile` 8 tokens x 8 features (64); `tok64` 64
  consecutive tokens of one feature (64); `grid64` B x B patches of the token grid per feature
  (64: the CNN map rule on the channel-first view (N, C, H, W)). A grid is (H, W) for a
  (N, H, W, C) view, (g, g) for T = g * g tokens; with T = 1 + g * g the first (class) token is
  kept apart as a map of its own (`division` on (M, 1, F)); other T fall back to `tile`.
- stats (whose residuals share one min/step): `tok` one per token row (M, T, F), `chan` one per
  feature column (M, F, T).

`feat/tok` is the codec's own map rule on the (M, T, F) view. Every other layout runs two kernels
of the DIVISION format: `lfc_encode` on the block view and `quantize_encode` on the residual in
the stats view, so every byte is the reference's on those views (`grid64/chan` equals
`division_encode` on (N, C, H, W); `tok64/chan` equals it on (M, F, T) with B = 64; tested).
Only the full `division` codec has them; other codecs get the `feat/tok` view.

`token_view` computes the view of a saved tensor from its logical shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freqact import kernels
from freqact.codecs.base import Codec
from freqact.codecs.division import Division
from freqact.kernels.format import (
    DivisionPacked,
    LfcPacked,
    QuantPacked,
    geometry,
    saturating_cast,
)

__all__ = ["BLOCKS", "STATS", "LayoutPacked", "TokenLayout", "packed_nbytes",
           "token_view"]

BLOCKS = ("feat", "tile", "tok64", "grid64")
STATS = ("tok", "chan")


def token_view(shape: tuple[int, ...], heads: bool, grid: bool = False, group: int = 1
               ) -> tuple[int, ...] | None:
    """The token view of a tensor of logical `shape`, or None for rank < 3.

    Args:
        shape: the logical shape: (N, T, F), (N, H, W, C) grids, (N, heads, T, d) attention.
        heads: True for attention tensors: every dim before the last two is a sequence
            (M = N * heads); False for token grids: the middle dims are the tokens (T = H * W).
        grid: keep a rank-4 token grid of at least `group` tokens as (N, H, W, C) (the
            `grid64` blocks read its 2D layout).
        group: token grids and sequences shorter than this (Swin's 4 x 4 windows (N * nW, 16,
            C)) are read k = ceil(group / T) consecutive sequences at a time, (M / k, k * T, F),
            when k divides M: per-column statistics then cover k * T >= group tokens.

    Returns:
        (M, T, F), or (N, H, W, C) for a rank-4 grid when `grid`.
    """
    if len(shape) < 3:
        return None
    if heads:
        return math.prod(shape[:-2]), shape[-2], shape[-1]
    m, t, f = shape[0], math.prod(shape[1:-1]), shape[-1]
    if grid and len(shape) == 4 and t >= group:
        return tuple(shape)
    k = -(-group // t)
    return (m // k, k * t, f) if k > 1 and m % k == 0 else (m, t, f)


def _grid_of(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(head tokens, H, W) of a view for the `grid64` blocks, None when it has no grid."""
    if len(shape) == 4:
        return 0, shape[1], shape[2]
    t = shape[1]
    for head in (0, 1):
        g = math.isqrt(t - head)
        if g > 1 and g * g == t - head:
            return head, g, g
    return None


@dataclass(frozen=True)
class LayoutPacked:
    """A token tensor packed in a `TokenLayout`.

    Attributes:
        lfc: block means of the block view of the body (the tokens after the head).
        quant: the body's residual x - upsample(lfc) in the stats view ((M, T, F) or (M, F, T)).
        head: the class token (M, 1, F) as its own `division` map, or None.
        shape, dtype: the encoded view's shape and dtype.
    """

    lfc: LfcPacked
    quant: QuantPacked
    head: DivisionPacked | None
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.lfc.nbytes + self.quant.nbytes + (self.head.nbytes if self.head else 0)


class TokenLayout(Codec):
    """`division` in a `<blocks>/<stats>` layout on (M, T, F) or (N, H, W, C) views.

    Decode: upsample(lfc) + the decoded residual, both in float32, cast once to x's dtype.
    Unbiased like `division`; a NaN/Inf decodes its block and its stats row/column to NaN.

    Args:
        division: the codec whose block, bits and backend the layout uses.
        blocks: one of BLOCKS; stats: one of STATS.
    """

    whole_model = False

    def __init__(self, division: Division, blocks: str = "feat", stats: str = "chan") -> None:
        if blocks not in BLOCKS:
            raise ValueError(f"blocks: expected one of {BLOCKS}, got {blocks!r}")
        if stats not in STATS:
            raise ValueError(f"stats: expected one of {STATS}, got {stats!r}")
        self.division, self.blocks, self.stats = division, blocks, stats
        self.name = division.name
        self.layout = f"{blocks}/{stats}"

    def _plan(self, shape: tuple[int, ...]) -> tuple[str, int, tuple[int, int] | None]:
        """(blocks used, head tokens, grid (H, W) or None) for a view of `shape`."""
        if self.blocks != "grid64":
            return self.blocks, 0, None
        found = _grid_of(shape)
        if found is None:
            return "tile", 0, None
        return "grid64", found[0], found[1:]

    def _block_view(self, x: torch.Tensor, blocks: str, grid) -> tuple[torch.Tensor, int]:
        """x (M, T, F) as the maps its blocks run on, and the block size there."""
        b = self.division.block
        if blocks == "tile":
            return x.unsqueeze(1), b
        if blocks == "tok64":
            return x.transpose(1, 2), b * b
        if blocks == "grid64":
            return x.unflatten(1, grid).permute(0, 3, 1, 2), b
        return x, b

    def _from_block_view(self, w: torch.Tensor, blocks: str) -> torch.Tensor:
        """Inverse of `_block_view`: back to (M, T, F)."""
        if blocks == "tile":
            return w.squeeze(1)
        if blocks == "tok64":
            return w.transpose(1, 2)
        if blocks == "grid64":
            return w.permute(0, 2, 3, 1).flatten(1, 2)
        return w

    def encode(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> LayoutPacked:
        """Args: x (M, T, F) or (N, H, W, C) floating; noise: optional uniforms shaped like the
        body's stats view ((M, T', F) for `tok`, (M, F, T') for `chan`, T' the body's tokens)."""
        blocks, head, grid = self._plan(tuple(x.shape))
        d = self.division
        body = x.flatten(1, 2) if x.dim() == 4 else x
        head_packed = (kernels.division_encode(body[:, :head], d.block, d.bits,
                                               backend=d._kernels) if head else None)
        body = body[:, head:].float()
        w, block = self._block_view(body, blocks, grid)
        lfc = kernels.lfc_encode(w, block)
        h = body - self._from_block_view(kernels.division_decode(lfc), blocks)
        h = h.transpose(1, 2) if self.stats == "chan" else h
        quant = kernels.quantize_encode(h.contiguous(), d.bits, noise, backend=d._kernels)
        return LayoutPacked(LfcPacked(lfc.lfc, lfc.shape, torch.float32, lfc.block), quant,
                            head_packed, x.shape, x.dtype)

    def decode(self, packed: LayoutPacked) -> torch.Tensor:
        """Returns: a tensor of the encoded view's shape and dtype, contiguous."""
        blocks, _, _ = self._plan(tuple(packed.shape))
        base = self._from_block_view(kernels.division_decode(packed.lfc), blocks)
        h = kernels.division_decode(packed.quant, backend=self.division._kernels)
        body = base + (h.transpose(1, 2) if self.stats == "chan" else h)
        out = saturating_cast(body, packed.dtype)
        if packed.head is not None:
            out = torch.cat([kernels.division_decode(packed.head, backend=self.division._kernels),
                             out], dim=1)
        return out.reshape(packed.shape).contiguous()

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Bytes of the packed form of a view of `shape`, before encoding."""
        blocks, head, grid = self._plan(shape)
        d = self.division
        m, f = shape[0], shape[-1]
        t = math.prod(shape[1:-1]) - head
        block_shape = {"feat": (m, t, f), "tile": (m, 1, t, f), "tok64": (m, f, t),
                       "grid64": (m, f, *(grid or ()))}[blocks]
        lfc = geometry(block_shape, d.block * d.block if blocks == "tok64" else d.block)
        quant = geometry((m, t, f) if self.stats == "tok" else (m, f, t), None)
        n = 2 * lfc.maps * lfc.nblocks + quant.maps * (quant.code_bytes(d.bits) + 4)
        return n + (_division_nbytes(d, (m, head, f)) if head else 0)


def _division_nbytes(codec: Division, shape: tuple[int, ...]) -> int:
    geom = geometry(shape, codec.block)
    return geom.maps * (geom.code_bytes(codec.bits) + 2 * geom.nblocks + 4)


def packed_nbytes(codec: Codec, shape: tuple[int, ...]) -> int | None:
    """Bytes the packed form of a tensor of `shape` takes under codec, before encoding.

    Known for `division` (as saved and in every `TokenLayout`); None for other codecs.
    """
    if isinstance(codec, TokenLayout):
        return codec.nbytes_for(shape)
    if type(codec) is Division:
        return _division_nbytes(codec, shape)
    return None
