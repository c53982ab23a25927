"""The paper's frequency-domain caches: `lfc` (LFC-ACT) and `hfc` (HFC-ACT).

x is read as maps (N, C, *S) by the same rule as the DIVISION codecs (`format.as_maps`): 1D maps
for (N, F) (one per sample) and rank-3 tensors, 2D for rank 4, 3D for rank 5. Each map's
orthonormal DCT X is taken over its spatial dims, and `freqact.dct.lowpass_mask(S, ratio,
rule=window_rule)` splits it into the top-left W_1 x ... x W_d corner (low band) and the rest.
`lfc` holds the corner's coefficients; decode puts them back in a zero spectrum and applies the
inverse DCT (synthesised from the corner alone), so decode(encode(x)) is the exact low-pass part of
x. `hfc` holds the high-pass part in the spatial domain, x - iDCT(corner of DCT(x)), which needs
only the two corner transforms (not a full DCT at encode and a full inverse at decode); decode
returns it as stored: the exact high-pass part up to float rounding. `hfc-quant` instead stores
that high-pass part Q-bit quantised per map with DIVISION's unbiased quantiser (the official
code's `rm_lfc` HFC-ACT path).

Only tensors with a spatial or sequence axis have frequencies: `accepts(x)` is False for rank-2
(N, F) inputs (a Linear layer on features; the official code never converts the classifier), and
`freqact.compress` keeps what a codec declines exactly. `encode` itself still takes (N, F) as one
1D map per sample, for direct use.

Storage is in x's dtype. `lfc` costs x's bytes times the kept fraction of coefficients, the
paper's accounting. `hfc` costs x's bytes (P values per map of P elements, not the P - W_1...W_d
dropped coefficients the paper counts: W_1...W_d / P more, e.g. 49/1024 = 4.8 % at 32 x 32 with
W = 7), traded for two corner transforms instead of two full ones; when the window covers every
coefficient (ratio 1) the high-pass part is zero and nothing is stored. For float16/bfloat16 the
transforms run in float32 and only what is stored is rounded, which loses no more than rounding x
itself would.

Edge rule (finite in, finite out): when a finite x's coefficients would overflow (|X| can reach
sqrt(P) max|x|), x is scaled by 2**-k first (2**k >= 2 sqrt(P), exact for normal values); `lfc`
stores k (`scale_exp`, 0 for ordinary inputs, whose bytes are unchanged) and decode multiplies
back, `hfc`/`hfc-quant` multiply back at encode; finite values saturate at the dtype's largest
finite value (`kernels.format.saturating_cast`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freqact import _validate, dct, kernels
from freqact._separable import _as_2d, _fast
from freqact.codecs.base import Codec, register, tensor_nbytes
from freqact.codecs.settings import BACKEND, BITS, RATIO, WINDOW_RULE
from freqact.kernels import cpu_dct
from freqact.kernels.format import QuantPacked, as_maps, maps_shape, saturating_cast


@dataclass(frozen=True)
class SpectralPacked:
    """What `lfc` or `hfc` holds of every map (module docstring).

    Attributes:
        pieces: one tensor in x's dtype. `lfc`: the corner coefficients (N, C, *W). `hfc`: the
            high-pass part in the spatial domain, x's shape, or an empty tensor (0,) when that
            part is zero (the window covers every coefficient).
        shape: the shape of the encoded tensor.
        windows: kept low frequencies W_d per spatial dim.
        high: False for `lfc`, True for `hfc`.
        scale_exp: k when the coefficients are those of x * 2**-k (the edge rule), else 0
            (always 0 for `hfc`, whose high-pass part is scaled back at encode).
    """

    pieces: tuple[torch.Tensor, ...]
    shape: torch.Size
    windows: tuple[int, ...]
    high: bool
    scale_exp: int = 0

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(p) for p in self.pieces)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype transforms run in: float32 for half precision, else dtype itself."""
    return torch.float32 if dtype.itemsize < 4 else dtype


def _scaled(transform, maps: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(transform(maps), 0), or (transform(maps * 2**-k), k) when that overflows for finite maps.

    The edge rule (module docstring): |X| <= sqrt(P) max|x| for maps of P elements, so
    2**k >= 2 sqrt(P) keeps every coefficient finite.

    Args:
        transform: a linear map of maps (N, C, *S) (the DCT, or its low corner).
        maps: (N, C, *S).
    """
    coeffs = transform(maps)
    if bool(coeffs.isfinite().all()) or not bool(maps.isfinite().all()):
        return coeffs, 0
    scale_exp = math.ceil(math.log2(math.prod(maps.shape[2:])) / 2) + 1
    return transform(maps * 2.0**-scale_exp), scale_exp


def _unscaled(x: torch.Tensor, scale_exp: int) -> torch.Tensor:
    """x * 2**scale_exp, finite values saturating at x's dtype's largest finite value."""
    if not scale_exp:
        return x
    top = torch.finfo(x.dtype).max
    return torch.where(x.isfinite(), (x * 2.0**scale_exp).clamp(-top, top), x)


def _lowpass_corner(maps: torch.Tensor, windows: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """(the corner `windows` of each map's DCT, scale_exp) under the edge rule (`_scaled`): the
    corner alone, without the full spectrum. float32 CPU maps take the C kernel, which checks the
    coefficients' finiteness in cache (no second pass); non-finite ones go through `_scaled`.

    Args:
        maps: (N, C, *S), 1 <= len(S) = len(windows) <= 3.
    """
    dims = len(windows)
    if maps.dtype == torch.float32 and _fast(maps, dims):
        low, finite = cpu_dct.dct_corner_checked(_as_2d(maps, dims), *((1,) * (2 - dims) + windows))
        if finite:
            return low.view(*maps.shape[: maps.dim() - dims], *windows), 0
    return _scaled(lambda m: dct.lowpass_coefficients(m, windows), maps)


def _highpass(x: torch.Tensor, windows: tuple[int, ...]) -> torch.Tensor:
    """x - iDCT(the corner `windows` of DCT(x)) per map: the high-pass part, x's shape and dtype.

    Formed from the corner transforms alone, under the edge rule (`_scaled`), in float32 for half
    precision; finite values saturate in x's dtype. 1D/2D float32 CPU maps take the fused C kernel
    (`cpu_dct.highpass`: one pass per map), which hands back to this path when a corner
    coefficient is not finite.
    """
    maps = as_maps(x)
    maps = maps.to(_wide(maps.dtype))
    dims = len(windows)
    if _fast(maps, dims):
        high = cpu_dct.highpass(_as_2d(maps, dims), *((1,) * (2 - dims) + windows))
        if high is not None:
            return saturating_cast(high, x.dtype).reshape(x.shape)
    low, scale_exp = _scaled(lambda m: dct.lowpass_coefficients(m, windows), maps)
    scaled = maps * 2.0**-scale_exp if scale_exp else maps
    synthesis = dct.lowpass_synthesis(low, maps.shape[2:])
    high = torch.sub(scaled, synthesis, out=synthesis)  # in place: no third map-sized buffer
    return saturating_cast(_unscaled(high, scale_exp), x.dtype).reshape(x.shape)


class _Spectral(Codec):
    """Shared settings, encode and decode of `lfc` and `hfc`; subclasses set `_high`."""

    _high: bool
    settings = (RATIO, WINDOW_RULE)

    def accepts(self, x: torch.Tensor) -> bool:
        """True for tensors with a spatial or sequence axis (rank >= 3); (N, F) is declined."""
        return x.dim() >= 3

    def windows(self, shape) -> tuple[int, ...]:
        """W_d per spatial dim of the maps of a tensor of `shape` (as encode uses them)."""
        return dct.windows(maps_shape(shape)[2:], self.ratio, rule=self.window_rule)

    def encode(self, x: torch.Tensor) -> SpectralPacked:
        _validate.floating_tensor("x", x)
        with torch.no_grad():
            windows = self.windows(x.shape)
            if self._high:
                # No high band (ratio 1): an empty tensor holds only the dtype and device.
                high = x.new_zeros(0) if windows == tuple(maps_shape(x.shape)[2:]) else _highpass(x, windows)
                return SpectralPacked((high,), x.shape, windows, True)
            low, scale_exp = _lowpass_corner(as_maps(x), windows)
            return SpectralPacked((low,), x.shape, windows, False, scale_exp)

    def decode(self, packed: SpectralPacked) -> torch.Tensor:
        """The low-pass (`lfc`) or high-pass (`hfc`) part of x; shape and dtype of x."""
        if packed.high:
            high = packed.pieces[0]
            return high if high.shape == packed.shape else high.new_zeros(packed.shape)
        low = packed.pieces[0]
        with torch.no_grad():
            # dct.lowpass_synthesis without its checks (encode made them), float32 for half types
            x_hat = dct._synthesis(low.to(_wide(low.dtype)), tuple(maps_shape(packed.shape)[2:]))
            return saturating_cast(_unscaled(x_hat, packed.scale_exp), low.dtype).reshape(packed.shape)


@register("lfc")
class LowFrequency(_Spectral):
    """LFC-ACT: cache the DCT coefficients inside the low-pass mask; decode is the low-pass part
    of x. Declines (N, F) tensors (see the module docstring).

    Settings: `ratio` W/N, required; `window_rule`, how ratio becomes W (`freqact.dct.windows`):
    "nearest" (W = r*N rounded half up, at least 1) or "official" (the DIVISION code's
    round(r*N + 0.5)).
    """

    _high = False
    title = "LFC-ACT (only the DCT low band cached)"


@register("hfc")
class HighFrequency(_Spectral):
    """HFC-ACT: cache what the low-pass mask drops; decode is the high-pass part of x (all zeros
    at ratio=1, where nothing is stored). Declines (N, F) tensors (see the module docstring).

    Settings: `ratio`, the low-pass mask's W/N, required; `window_rule`, as for `lfc`.
    """

    _high = True
    title = "HFC-ACT (only the DCT high band cached)"


@register("hfc-quant")
class QuantizedHighFrequency(_Spectral):
    """HFC-ACT as the official code's `rm_lfc` path ran it: the high-pass part x - iDCT(DCT(x) * M)
    stored in the spatial domain as Q-bit codes per map (DIVISION's quantiser: bf16 min and step
    per map, stochastic rounding, unbiased; a `QuantPacked`). Per map of P elements that is
    ceil(Q * P / 8) + 4 bytes. Declines (N, F) tensors like `hfc`. Finite in, finite out: the
    high-pass part is formed under the same edge rule as `lfc` and saturates in x's dtype.

    Settings: `ratio` and `window_rule` as for `hfc`; `bits` Q (the official run used 2);
    `backend` (the quantiser's kernels).
    """

    _high = True
    settings = (RATIO, WINDOW_RULE, BITS, BACKEND)
    title = "HFC-ACT quantised (the DCT high band as Q-bit codes in the spatial domain)"

    def encode(self, x: torch.Tensor) -> QuantPacked:
        _validate.floating_tensor("x", x)
        with torch.no_grad():
            high = _highpass(x, self.windows(x.shape))
            return kernels.quantize_encode(high, self.bits, backend=self._kernels)

    def decode(self, packed: QuantPacked) -> torch.Tensor:
        return kernels.division_decode(packed, backend=self._kernels)


def layer_windows(model: torch.nn.Module, input_shape, codec: _Spectral, *, types=None) -> list[dict]:
    """The windows W a spectral codec keeps for each layer input of `model`, in call order.

    One no-grad eval-mode forward of a zero batch of 1 records the input shape of every module
    of `types` (default `freqact.engine.DEFAULT_TYPES`, the modules whose input the engine sends to
    the codec); nothing in the model changes. For the run's config or metrics: with
    rule="official" ResNet-20 at ratio 0.2 gives W = 7, 4, 2 on its 32, 16, 8 maps.

    Args:
        model: the network.
        input_shape: one sample's shape, e.g. (3, 32, 32).
        codec: an `lfc`, `hfc` or `hfc-quant` codec (its ratio and window_rule are used).
        types: module types to report (a tuple of classes).

    Returns:
        [{"layer", "type", "shape": list, "windows": list | None}], windows None where the codec
        declines the input (kept exactly, e.g. the classifier's (N, F)).

    Raises:
        TypeError: if codec is not a spectral codec.
    """
    if not isinstance(codec, _Spectral):
        raise TypeError(f"codec: expected an lfc, hfc or hfc-quant codec, got {type(codec).__name__}")
    if types is None:
        from freqact.engine import DEFAULT_TYPES  # the engine imports the codecs

        types = DEFAULT_TYPES
    rows: list[dict] = []

    def hook_for(name):
        def hook(module, args):
            x = args[0]
            windows = list(codec.windows(x.shape)) if codec.accepts(x) else None
            rows.append({"layer": name, "type": type(module).__name__, "shape": list(x.shape),
                         "windows": windows})

        return hook

    handles = [m.register_forward_pre_hook(hook_for(name))
               for name, m in model.named_modules() if isinstance(m, types)]
    was_training = model.training
    param = next(model.parameters(), None)
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), device=None if param is None else param.device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return rows
