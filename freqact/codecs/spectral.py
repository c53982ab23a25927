"""The paper's frequency-domain caches: `lfc` (LFC-ACT) and `hfc` (HFC-ACT).

x is read as maps (N, C, *S) by the same rule as the DIVISION codecs (`format.as_maps`): 1D maps
for (N, F) (one per sample) and rank-3 tensors, 2D for rank 4, 3D for rank 5. Each map's
orthonormal DCT X is taken over its spatial dims, and the cache holds only the coefficients that
`freqact.dct.lowpass_mask(S, ratio)` keeps (`lfc`: the top-left W_1 x ... x W_d corner) or drops
(`hfc`: the complement, stored as d disjoint boxes). Decode puts them back in a zero spectrum and
applies the inverse DCT, so decode(encode(x)) is the exact low-pass / high-pass part of x.

Coefficients are stored in x's dtype: the cache costs x's bytes times the kept fraction, which is
the paper's accounting. For float16/bfloat16 the transform runs in float32 and only the stored
coefficients are rounded, which loses no more than rounding x itself would.

Edge rule (finite in, finite out): when a finite x's coefficients would overflow (|X| can reach
sqrt(P) max|x|), x is scaled by 2**-k first (2**k >= 2 sqrt(P), exact for normal values) and k is
stored (`scale_exp`, 0 for ordinary inputs, whose bytes are unchanged); decode multiplies back
and saturates finite values at the dtype's largest finite value (`kernels.format.saturating_cast`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freqact import _validate, dct
from freqact.codecs.base import Codec, register, tensor_nbytes
from freqact.codecs.settings import RATIO
from freqact.kernels.format import as_maps, saturating_cast


@dataclass(frozen=True)
class SpectralPacked:
    """Kept DCT coefficients of every map.

    Attributes:
        pieces: coefficient boxes in x's dtype, each (N, C, *box); see `_boxes`.
        shape: the shape of the encoded tensor.
        windows: kept low frequencies W_d per spatial dim.
        high: False for `lfc` (one corner box), True for `hfc` (its complement).
        scale_exp: k when the coefficients are those of x * 2**-k (the edge rule), else 0.
    """

    pieces: tuple[torch.Tensor, ...]
    shape: torch.Size
    windows: tuple[int, ...]
    high: bool
    scale_exp: int = 0

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(p) for p in self.pieces)


def _boxes(windows: tuple[int, ...], high: bool) -> list[tuple[slice, ...]]:
    """Index boxes over the spatial dims that tile the kept coefficients without overlap.

    Low-pass: the corner [:W_1, ..., :W_d]. High-pass: box k is [:W_1, ..., :W_{k-1}, W_k:, :, ...],
    i.e. the coefficients whose first index at or above its window is in dim k; in 2D these are
    X[W_1:, :] and X[:W_1, W_2:]. A box is empty when W_k covers its whole dim.
    """
    if not high:
        return [tuple(slice(0, w) for w in windows)]
    d = len(windows)
    return [
        tuple(slice(0, w) for w in windows[:k])
        + (slice(windows[k], None),)
        + (slice(None),) * (d - k - 1)
        for k in range(d)
    ]


class _Spectral(Codec):
    """Shared encode/decode of `lfc` and `hfc`; subclasses set `_high`."""

    _high: bool
    settings = (RATIO,)

    def encode(self, x: torch.Tensor) -> SpectralPacked:
        _validate.floating_tensor("x", x)
        with torch.no_grad():
            maps = as_maps(x)
            spatial = tuple(maps.shape[2:])
            mask = dct.lowpass_mask(spatial, self.ratio)
            # W_d = the mask's extent along dim d (it is a corner box).
            windows = tuple(
                int(mask[(0,) * d + (slice(None),) + (0,) * (len(spatial) - d - 1)].sum())
                for d in range(len(spatial))
            )
            coeffs = dct.dct(maps, dims=len(spatial))  # (N, C, *S), x's dtype
            scale_exp = 0
            if not bool(coeffs.isfinite().all()) and bool(maps.isfinite().all()):
                scale_exp = math.ceil(math.log2(math.prod(spatial)) / 2) + 1
                coeffs = dct.dct(maps * 2.0**-scale_exp, dims=len(spatial))
            # contiguous() copies each box out, so the full spectrum is not kept alive.
            pieces = tuple(coeffs[(...,) + box].contiguous() for box in _boxes(windows, self._high))
        return SpectralPacked(pieces, x.shape, windows, self._high, scale_exp)

    def decode(self, packed: SpectralPacked) -> torch.Tensor:
        """Inverse DCT of the kept coefficients (zeros elsewhere); shape and dtype of x."""
        first = packed.pieces[0]
        maps_shape = as_maps(torch.empty(packed.shape, device="meta")).shape
        with torch.no_grad():
            coeffs = torch.zeros(maps_shape, dtype=first.dtype, device=first.device)
            for box, piece in zip(_boxes(packed.windows, packed.high), packed.pieces):
                coeffs[(...,) + box] = piece
            # Half-precision coefficients are transformed in float32 either way (`dct.idct`).
            wide = torch.float32 if first.element_size() < 4 else first.dtype
            x_hat = dct.idct(coeffs.to(wide), dims=len(packed.windows))
            if packed.scale_exp:  # multiplying back may overflow: saturate finite values
                top = torch.finfo(wide).max
                x_hat = torch.where(x_hat.isfinite(),
                                    (x_hat * 2.0**packed.scale_exp).clamp(-top, top), x_hat)
            return saturating_cast(x_hat, first.dtype).reshape(packed.shape)


@register("lfc")
class LowFrequency(_Spectral):
    """LFC-ACT: cache the DCT coefficients inside the low-pass mask (W_d = ratio * S_d, rounded
    half up, at least 1); decode is the low-pass part of x.

    Settings: `ratio` W/N, required.
    """

    _high = False
    title = "LFC-ACT (only the DCT low band cached)"


@register("hfc")
class HighFrequency(_Spectral):
    """HFC-ACT: cache the DCT coefficients outside the low-pass mask; decode is the high-pass part
    of x (all zeros at ratio=1, where nothing is stored).

    Settings: `ratio`, the low-pass mask's W/N, required.
    """

    _high = True
    title = "HFC-ACT (only the DCT high band cached)"
