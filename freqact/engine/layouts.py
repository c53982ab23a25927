"""Layouts of token tensors for the codec: which elements share a block mean and a min/step.

A token tensor is read as a view (M, T, F): M sequences (samples, or samples x heads) of T tokens
with F features. Two layouts (measured in docs/ARCHITECTURE.md, "Layouts for token tensors"):

- `feat/tok`: the codec on the (M, T, F) view as is: DIVISION's 1D maps are the token rows, so
  blocks of 8 features and one min/step per token (norm inputs: their backward divides by each
  token's own deviation).
- `feat/chan`: blocks of 8 features per token (the LFC of `feat/tok`), but the residual is
  quantised per feature column: one min/step per (sequence, feature) over its T tokens. No view
  of the (N, C, *S) map rule gives both (a map holds its blocks *and* its statistics), so
  `TokenChannels` runs two kernels of the same format: `lfc_encode` on (M, T, F) and
  `quantize_encode` on the residual transposed to (M, F, T). Every byte comes from the format's
  own kernels, so the bytes are those of the reference on those two views. Only the full
  `division` codec has this form; other codecs get the `feat/tok` view.

`token_view` computes the (M, T, F) shape of a saved tensor from its logical shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freqact import kernels
from freqact.codecs.base import Codec
from freqact.codecs.division import Division
from freqact.kernels.format import LfcPacked, QuantPacked, geometry, saturating_cast

__all__ = ["ChannelsPacked", "TokenChannels", "packed_nbytes", "token_view"]


def token_view(shape: tuple[int, ...], heads: bool) -> tuple[int, int, int] | None:
    """The (M, T, F) view of a tensor of logical `shape`, or None for rank < 3.

    Args:
        shape: the logical shape: (N, T, F), (N, H, W, C) grids, (N, heads, T, d) attention.
        heads: True for attention tensors: every dim before the last two is a sequence
            (M = N * heads); False for token grids: the middle dims are the tokens (T = H * W).
    """
    if len(shape) < 3:
        return None
    if heads:
        return math.prod(shape[:-2]), shape[-2], shape[-1]
    return shape[0], math.prod(shape[1:-1]), shape[-1]


@dataclass(frozen=True)
class ChannelsPacked:
    """The `feat/chan` form: block means of the (M, T, F) view and the per-column residual.

    Attributes:
        lfc: block means of the (M, T, F) view, one 1D map per token.
        quant: the residual x - upsample(lfc) transposed to (M, F, T), one map per feature column.
    """

    lfc: LfcPacked
    quant: QuantPacked

    @property
    def nbytes(self) -> int:
        return self.lfc.nbytes + self.quant.nbytes


class TokenChannels(Codec):
    """`division` in the `feat/chan` layout on (M, T, F) tensors (same block, bits and backend).

    Decode: upsample(lfc) + the decoded residual transposed back, in float32, cast to x's dtype.
    Unbiased like `division`; a NaN/Inf decodes its block and its feature column to NaN.
    """

    whole_model = False

    def __init__(self, division: Division) -> None:
        self.division = division
        self.name = division.name

    def encode(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> ChannelsPacked:
        """Args: x (M, T, F) floating; noise: optional uniforms shaped (M, F, T)."""
        lfc = kernels.lfc_encode(x.float(), self.division.block)
        h = x.float() - kernels.division_decode(lfc)
        quant = kernels.quantize_encode(h.transpose(1, 2).contiguous(), self.division.bits, noise,
                                        backend=self.division._kernels)
        lfc = LfcPacked(lfc.lfc, x.shape, x.dtype, lfc.block)
        return ChannelsPacked(lfc, quant)

    def decode(self, packed: ChannelsPacked) -> torch.Tensor:
        """Returns: (M, T, F) tensor of the encoded dtype, contiguous."""
        base = kernels.division_decode(LfcPacked(packed.lfc.lfc, packed.lfc.shape, torch.float32,
                                                 packed.lfc.block))
        h = kernels.division_decode(packed.quant, backend=self.division._kernels)
        return saturating_cast(base + h.transpose(1, 2), packed.lfc.dtype).contiguous()


def packed_nbytes(codec: Codec, shape: tuple[int, ...]) -> int | None:
    """Bytes the packed form of a tensor of `shape` takes under codec, before encoding.

    Known for `division` (as saved and `feat/chan`); None for other codecs.
    """
    if isinstance(codec, TokenChannels):
        m, t, f = shape
        d = codec.division
        return 2 * m * t * -(-f // d.block) + m * f * (-(-t * d.bits // 8) + 4)
    if type(codec) is Division:
        geom = geometry(shape, codec.block)
        return geom.maps * (geom.code_bytes(codec.bits) + 2 * geom.nblocks + 4)
    return None
