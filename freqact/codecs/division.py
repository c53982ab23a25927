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

from freqact import kernels
from freqact.codecs.base import Codec, register
from freqact.codecs.settings import BACKEND, BITS, BLOCK
from freqact.kernels.format import DivisionPacked, LfcPacked, QuantPacked


@register("division")
class Division(Codec):
    """DIVISION: bf16 B x B block means (LFC) + Q-bit stochastically rounded residual (HFC).

    Decode is unbiased: E[decode(encode(x))] = x up to float32 rounding. Maps whose residual is
    constant and bf16-representable (all-zero maps, constant maps of a bf16 value) decode exactly
    and deterministically; other constant maps decode within one step of x (their residual is
    just the bf16 rounding error of the block means), never NaN. A NaN/Inf anywhere in a map makes
    that whole map decode to NaN.

    Settings: `block` B (a dim shorter than B is one block), `bits` Q, `backend` (the kernels).
    """

    settings = (BLOCK, BITS, BACKEND)
    title = "DIVISION (block-mean LFC in bf16 + Q-bit HFC)"

    def encode(self, x: torch.Tensor) -> DivisionPacked:
        return kernels.division_encode(x, self.block, self.bits, backend=self._kernels)

    def decode(self, packed: DivisionPacked) -> torch.Tensor:
        return kernels.division_decode(packed, backend=self._kernels)


@register("division-no-hfc")
class DivisionNoHFC(Codec):
    """Ablation: keep only DIVISION's LFC (bf16 block means); decode is their nearest upsample.

    Settings: `block` B (the torch reference computes the means: no kernels).
    """

    settings = (BLOCK,)
    title = "DIVISION without its HFC (bf16 block means only)"

    def encode(self, x: torch.Tensor) -> LfcPacked:
        return kernels.lfc_encode(x, self.block)

    def decode(self, packed: LfcPacked) -> torch.Tensor:
        return kernels.division_decode(packed)


@register("division-no-lfc")
class DivisionNoLFC(Division):
    """Ablation: keep only DIVISION's quantised HFC (x minus its bf16 block means); the block
    means are computed to form the residual, then dropped.

    Settings: as `division` (`block` defines the residual).
    """

    title = "DIVISION without its LFC (Q-bit residual only)"

    def encode(self, x: torch.Tensor) -> QuantPacked:
        p = kernels.division_encode(x, self.block, self.bits, backend=self._kernels)
        return QuantPacked(p.lo, p.step, p.codes, p.shape, p.dtype, p.bits)


@register("quant")
class Quant(Codec):
    """Ablation: Q-bit per-map stochastic quantisation of x itself (bf16 min and step per map),
    with DIVISION's quantiser; unbiased like it.

    Settings: `bits` Q, `backend` (the kernels).
    """

    settings = (BITS, BACKEND)
    title = "Q-bit per-map stochastic quantisation of x (no block means)"

    def encode(self, x: torch.Tensor) -> QuantPacked:
        return kernels.quantize_encode(x, self.bits, backend=self._kernels)

    def decode(self, packed: QuantPacked) -> torch.Tensor:
        return kernels.division_decode(packed, backend=self._kernels)
