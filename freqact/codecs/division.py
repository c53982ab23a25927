"""DIVISION (Wang et al. 2022) and its Table 1(c) ablations: `division`, `division-no-hfc`,
`division-no-lfc`, `quant`.

They store the packed types of `freqact.kernels.format` (`DivisionPacked`, `LfcPacked`,
`QuantPacked`; format in docs/ARCHITECTURE.md) and
read x as maps (N, C, *S): (N, F) Linear inputs are one 1D map per sample (C = 1), (N, C, L) and
(N, T, F) token tensors are 1D maps along the last dim (one per channel / token), (N, C, H, W) and
(N, C, D, H, W) are 2D / 3D maps. Blocks and per-map statistics follow those maps.

Per (n, c) map of P elements with Q bits and nb = ceil(S / B) blocks per dim, nbytes is
`division`: ceil(Q * P / 8) + 2 * prod(nb) + 4; `division-no-hfc`: 2 * prod(nb);
`division-no-lfc` and `quant`: ceil(Q * P / 8) + 4.
"""

from __future__ import annotations

import torch

from freqact import _validate, kernels
from freqact.codecs.base import Codec, register
from freqact.kernels.format import DivisionPacked, LfcPacked, QuantPacked, check_bits


@register("division")
class Division(Codec):
    """DIVISION: bf16 B x B block means (LFC) + Q-bit stochastically rounded residual (HFC).

    Decode is unbiased: E[decode(encode(x))] = x up to float32 rounding. Maps whose residual is
    constant and bf16-representable (all-zero maps, constant maps of a bf16 value) decode exactly
    and deterministically; other constant maps decode within one step of x (their residual is
    just the bf16 rounding error of the block means), never NaN. A NaN/Inf anywhere in a map makes
    that whole map decode to NaN.

    Args:
        block: block size B >= 1 per spatial dim (a dim shorter than B is one block).
        bits: residual bits Q, one of 1, 2, 4, 8.
    """

    def __init__(self, block: int = 8, bits: int = 2):
        self.block = _validate.positive_int("block", block)
        self.bits = check_bits(bits)

    def encode(self, x: torch.Tensor) -> DivisionPacked:
        return kernels.division_encode(x, self.block, self.bits)

    def decode(self, packed: DivisionPacked) -> torch.Tensor:
        return kernels.division_decode(packed)


@register("division-no-hfc")
class DivisionNoHFC(Codec):
    """Ablation: keep only DIVISION's LFC (bf16 block means); decode is their nearest upsample.

    Args:
        block: block size B >= 1 per spatial dim.
    """

    def __init__(self, block: int = 8):
        self.block = _validate.positive_int("block", block)

    def encode(self, x: torch.Tensor) -> LfcPacked:
        return kernels.lfc_encode(x, self.block)

    def decode(self, packed: LfcPacked) -> torch.Tensor:
        return kernels.division_decode(packed)


@register("division-no-lfc")
class DivisionNoLFC(Division):
    """Ablation: keep only DIVISION's quantised HFC (x minus its bf16 block means); the block
    means are computed to form the residual, then dropped.

    Args:
        block: block size B >= 1 defining the residual.
        bits: residual bits Q, one of 1, 2, 4, 8.
    """

    def encode(self, x: torch.Tensor) -> QuantPacked:
        p = kernels.division_encode(x, self.block, self.bits)
        return QuantPacked(p.lo, p.step, p.codes, p.shape, p.dtype, p.bits)


@register("quant")
class Quant(Codec):
    """Ablation: Q-bit per-map stochastic quantisation of x itself (bf16 min and step per map),
    with DIVISION's quantiser; unbiased like it.

    Args:
        bits: Q, one of 1, 2, 4, 8.
    """

    def __init__(self, bits: int = 2):
        self.bits = check_bits(bits)

    def encode(self, x: torch.Tensor) -> QuantPacked:
        return kernels.quantize_encode(x, self.bits)

    def decode(self, packed: QuantPacked) -> torch.Tensor:
        return kernels.division_decode(packed)
