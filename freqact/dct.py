"""Orthonormal DCT-II over the last 1-3 dims, frequency masks, low/high-frequency splits and spectra.

Conventions follow `scipy.fft.dctn(type=2, norm="ortho")`: for a length-N axis the basis matrix is
``D[k, i] = c_k cos(pi (2i + 1) k / (2N))`` with ``c_0 = sqrt(1/N)`` and ``c_k = sqrt(2/N)``, so
``D @ D.T == I`` and the inverse is the transpose.

Every transform here is a separable linear map: one small (N x N) matrix applied along each
transformed axis. The matrices are built once per (size, dtype, device) in float64 and cached. A
matmul is chosen for simplicity, exactness and autograd, not as the fastest DCT; the C fast path
below is about 2-3x as fast as scipy's FFT DCT at 32 x 32 and 56 x 56 on an idle machine,
depending on the run and on whether the two take turns or run alone (2 threads, `python -m
benchmarks.dct_bench`; README gives the runs), and FFT DCTs in torch are ~10x slower.
float16/bfloat16 inputs are computed in float32 (their own precision would lose ~3 digits per
axis) and cast back.

Fast path: float32 (and half) CPU work over the last 1 or 2 dims that needs no gradient (no input
requires grad, or grad mode is off: inside the codecs, analyses under no_grad) runs in the fused C
kernels of `freqact.kernels.cpu_dct` (per map, in cache, even/odd symmetry of the basis); the
matmul path (`freqact._separable`) is the reference they are tested against and serves autograd, float64, 3D and
CUDA. FREQACT_KERNELS=torch switches the fast path off.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from freqact import _validate
from freqact._separable import (
    _as_2d,
    _basis,
    _block_basis,
    _compute_dtype,
    _fast,
    _lowpass_projection,
    _separable,
)
from freqact.kernels import cpu_dct

__all__ = [
    "dct",
    "idct",
    "WINDOW_RULES",
    "windows",
    "lowpass_mask",
    "highpass_mask",
    "lowpass_coefficients",
    "lowpass_synthesis",
    "split",
    "lowpass",
    "highpass",
    "band_energy",
    "block_dct",
    "radial_spectrum",
]

_REDUCTIONS = ("instance", "channel", "all")

WINDOW_RULES = ("nearest", "official")
"""How a ratio r becomes the kept window W of a length-N axis (see `windows`)."""

# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def _check_input(name: str, x: object, dims: object) -> int:
    """Validate a tensor and a `dims`; return dims as int."""
    _validate.floating_tensor(name, x)
    dims = _validate.positive_int("dims", dims)
    _validate.choice("dims", dims, (1, 2, 3))
    if dims > x.dim():
        raise ValueError(
            f"dims: expected at most the rank of {name} ({x.dim()}), got {dims} "
            f"({name} has shape {tuple(x.shape)})"
        )
    if 0 in x.shape[x.dim() - dims :]:
        raise ValueError(
            f"{name}: expected the last {dims} dims to have size >= 1, got shape {tuple(x.shape)}"
        )
    return dims


def _check_nonempty(name: str, x: torch.Tensor) -> None:
    if x.numel() == 0:
        raise ValueError(f"{name}: expected a non-empty tensor for a norm, got shape {tuple(x.shape)}")


def _windows(sizes: Sequence[int], ratio: object, window: object, rule: object = "nearest") -> list[int]:
    """Kept low frequencies W per dim, from exactly one of `ratio` or `window` (see `windows`)."""
    if (ratio is None) == (window is None):
        raise ValueError(
            f"ratio/window: expected exactly one of them, got ratio={ratio!r}, window={window!r}"
        )
    _validate.choice("rule", rule, WINDOW_RULES)
    if window is not None:
        w = _validate.positive_int("window", window)
        return [min(w, n) for n in sizes]
    r = _validate.unit_ratio("ratio", ratio)
    if rule == "official":
        # The DIVISION code's rule, Python's round (ties to even) of r*N + 0.5, i.e. about
        # ceil(r*N): W = 4/2/1 at r = 0.1 for N = 32/16/8, where "nearest" gives 3/2/1.
        return [min(n, max(1, round(r * n + 0.5))) for n in sizes]
    # Round half up (not Python's half-to-even) so that a tie always keeps the larger window.
    return [min(n, max(1, math.floor(r * n + 0.5))) for n in sizes]


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _check_out(out: object, x: torch.Tensor) -> torch.Tensor:
    """`out` as a buffer the transform of x may write: x's shape, dtype and device, contiguous,
    x itself or sharing no memory with it, and no autograd (as torch's own out= arguments)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out: expected shape {tuple(x.shape)}, {x.dtype} on {x.device} (the "
                         f"input's), got {tuple(out.shape)}, {out.dtype} on {out.device}")
    if not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor")
    if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and not (
            out.data_ptr() == x.data_ptr() and x.is_contiguous()):
        raise ValueError("out: expected the input itself or a tensor sharing no memory with it")
    if torch.is_grad_enabled() and (x.requires_grad or out.requires_grad):
        raise ValueError("out: not supported where a gradient is needed (call without out=)")
    return out


def _transform(x: torch.Tensor, dims: int, inverse: bool, out: torch.Tensor | None) -> torch.Tensor:
    """dct (or idct) of x over its last `dims` dims, written to `out` when given."""
    if out is not None:
        out = _check_out(out, x)
    if _fast(x, dims):
        direct = out is not None and out.dtype == torch.float32  # written by the kernel itself
        y = cpu_dct.dct2(_as_2d(x, dims), inverse=inverse,
                         out=_as_2d(out, dims) if direct else None).view(x.shape)
    else:
        y = _separable(x, dims, lambda _, n, dtype, device: (
            _basis(n, dtype, device).mT if inverse else _basis(n, dtype, device)))  # D^-1 = D^T
    if out is None:
        return y.to(x.dtype)
    return out if y.data_ptr() == out.data_ptr() else out.copy_(y)


def dct(x: torch.Tensor, dims: int = 2, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Orthonormal DCT-II over the last `dims` dims (scipy.fft.dctn(type=2, norm="ortho")).

    Args:
        x: real floating tensor, shape (*, N_1, ..., N_dims); any sizes >= 1, any leading dims.
            float16/bfloat16 are computed in float32. CPU or CUDA. Differentiable.
        dims: how many trailing dims to transform: 1, 2 or 3.
        out: optional buffer of x's shape, dtype and device (contiguous; x itself for an
            in-place transform) the coefficients are written to, e.g. to reuse one buffer over a
            loop: a fresh output's pages cost the CPU path about as much as the transform.
            Not differentiable.

    Returns:
        The coefficients, same shape, dtype and device as x (`out` when given); X[..., 0, 0] is
        the DC term.

    Raises:
        TypeError: if x is not a real floating tensor, or dims not an integer.
        ValueError: if dims is not 1, 2 or 3, exceeds x's rank, or a transformed dim is empty;
            naming `out` for a buffer that does not fit.

    Example:
        >>> X = dct(torch.ones(1, 3, 4, 4))
        >>> torch.allclose(X[..., 0, 0], torch.full((1, 3), 4.0))
        True
    """
    return _transform(x, _check_input("x", x, dims), False, out)


def idct(X: torch.Tensor, dims: int = 2, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `dct` (orthonormal DCT-III, scipy.fft.idctn(type=2, norm="ortho")).

    Args:
        X: real floating coefficients, shape (*, N_1, ..., N_dims); see `dct` for dtypes/devices.
        dims: how many trailing dims to transform: 1, 2 or 3.
        out: optional buffer for the signal, as `dct`'s.

    Returns:
        The signal, same shape, dtype and device as X (`out` when given); idct(dct(x)) == x to
        float precision.

    Raises:
        TypeError/ValueError: as `dct`, naming `X` (or `out`).
    """
    return _transform(X, _check_input("X", X, dims), True, out)


def _check_shape(shape: object) -> list[int]:
    if isinstance(shape, (tuple, list, torch.Size)) and 1 <= len(shape) <= 3:
        return [_validate.positive_int("shape", n) for n in shape]
    raise ValueError(f"shape: expected a sequence of 1 to 3 sizes, got {shape!r}")


def windows(
    shape: Sequence[int], ratio: float | None = None, *, window: int | None = None, rule: str = "nearest"
) -> tuple[int, ...]:
    """The kept window W_d of each frequency dim: the mask keeps indices < W_d in every dim.

    Rules for a ratio r and a dim of size N (both clipped to 1 <= W <= N, so a mask is never empty
    and r = 1 keeps everything):

    - ``"nearest"`` (default): ``W = floor(r * N + 0.5)``, r*N rounded half up.
    - ``"official"``: ``W = round(r * N + 0.5)`` with Python's round (ties to even), the rule of the
      DIVISION authors' code; about ceil(r * N). ResNet-20's N = 32/16/8 give W = 4/2/1 at r = 0.1
      and 7/4/2 at 0.2 ("nearest": 3/2/1 and 6/3/2).

    With ``window=W`` the same W is used in every dim, clipped to the dim's size (rule unused).

    Args:
        shape: the frequency shape (N_1, ..., N_d), d in {1, 2, 3}, sizes >= 1.
        ratio: kept fraction W/N per dim, in (0, 1]. Give exactly one of ratio and window.
        window: integer W >= 1.
        rule: "nearest" or "official" (`WINDOW_RULES`).

    Returns:
        (W_1, ..., W_d).

    Raises:
        TypeError/ValueError: naming `shape`, `ratio`, `window` or `rule`.
    """
    return tuple(_windows(_check_shape(shape), ratio, window, rule))


def lowpass_mask(
    shape: Sequence[int],
    ratio: float | None = None,
    *,
    window: int | None = None,
    rule: str = "nearest",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The paper's mask M: True on the top-left W_1 x ... x W_d corner of the DCT coefficients.

    W_d from `windows(shape, ratio, window=window, rule=rule)`; the default rule rounds
    ``ratio * N_d`` half up, at least 1.

    Args:
        shape: the frequency shape (N_1, ..., N_d), d in {1, 2, 3}, sizes >= 1.
        ratio: kept fraction W/N per dim, in (0, 1]. Give exactly one of ratio and window.
        window: integer W >= 1.
        rule: "nearest" or "official" (see `windows`).
        device: where to build the mask (default CPU).

    Returns:
        Bool tensor of shape `shape`, True where the index is < W_d in every dim.

    Raises:
        TypeError/ValueError: naming `shape`, `ratio`, `window` or `rule`.
    """
    sizes = _check_shape(shape)
    mask = torch.zeros(sizes, dtype=torch.bool, device=device)
    mask[tuple(slice(0, w) for w in _windows(sizes, ratio, window, rule))] = True
    return mask


def highpass_mask(
    shape: Sequence[int],
    ratio: float | None = None,
    *,
    window: int | None = None,
    rule: str = "nearest",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """1 - M: the complement of `lowpass_mask` (same arguments and rounding rule)."""
    return ~lowpass_mask(shape, ratio, window=window, rule=rule, device=device)


def _check_windows(x: torch.Tensor, windows: object) -> tuple[int, ...]:
    """`windows` as a tuple of 1-3 ints, one per trailing dim of x, each in [1, that dim]."""
    if not isinstance(windows, (tuple, list)) or not 1 <= len(windows) <= min(3, x.dim()):
        raise ValueError(f"windows: expected 1 to 3 window sizes, got {windows!r}")
    sizes = x.shape[x.dim() - len(windows) :]
    kept = tuple(_validate.positive_int("windows", w) for w in windows)
    if any(w > n for w, n in zip(kept, sizes)):
        raise ValueError(f"windows: expected sizes <= the dims {tuple(sizes)}, got {kept}")
    return kept


def lowpass_coefficients(x: torch.Tensor, windows: Sequence[int]) -> torch.Tensor:
    """The kept corner DCT(x)[..., :W_1, ..., :W_d] (d = len(windows)), without the full spectrum.

    Args:
        x: real floating tensor, shape (*, N_1, ..., N_d).
        windows: (W_1, ..., W_d), 1 <= W_i <= N_i (e.g. from `windows`).

    Returns:
        (*, W_1, ..., W_d) in x's dtype and device; differentiable.

    Raises:
        TypeError/ValueError: naming `x` or `windows`.
    """
    _validate.floating_tensor("x", x)
    kept = _check_windows(x, windows)
    dims = _check_input("x", x, len(kept))
    if _fast(x, dims):
        low = cpu_dct.dct_corner(_as_2d(x, dims), *((1,) * (2 - dims) + kept))
        return low.view(*x.shape[: x.dim() - dims], *kept).to(x.dtype)
    return dct(x, dims)[(...,) + tuple(slice(0, w) for w in kept)]


def lowpass_synthesis(coeffs: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The inverse DCT of corner coefficients placed in a zero spectrum of `sizes`.

    Args:
        coeffs: real floating tensor, shape (*, W_1, ..., W_d), d = len(sizes) in {1, 2, 3}.
        sizes: (N_1, ..., N_d) with N_i >= W_i.

    Returns:
        (*, N_1, ..., N_d) in coeffs' dtype and device: lowpass(x) when coeffs come from
        `lowpass_coefficients(x, ...)`. Differentiable.

    Raises:
        TypeError/ValueError: naming `coeffs` or `sizes`.
    """
    _validate.floating_tensor("coeffs", coeffs)
    sizes = tuple(_check_shape(list(sizes) if isinstance(sizes, torch.Size) else sizes))
    dims = _check_input("coeffs", coeffs, len(sizes))
    kept = tuple(coeffs.shape[coeffs.dim() - dims :])
    if any(w > n for w, n in zip(kept, sizes)):
        raise ValueError(f"sizes: expected sizes >= the coefficients' {kept}, got {sizes}")
    return _synthesis(coeffs, sizes)


def _synthesis(coeffs: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """lowpass_synthesis without its argument checks (for callers that made them): the C kernel
    when the coefficients and the output sizes allow it, else the padded inverse DCT."""
    dims = len(sizes)
    if _fast(coeffs, dims) and max(sizes) <= cpu_dct.MAX_SIZE:
        lead = coeffs.shape[: coeffs.dim() - dims]
        out = cpu_dct.idct_corner(_as_2d(coeffs, dims), *((1,) * (2 - dims) + sizes))
        return out.view(*lead, *sizes).to(coeffs.dtype)
    kept = coeffs.shape[coeffs.dim() - dims :]
    pad = [p for w, n in zip(reversed(kept), reversed(sizes)) for p in (0, n - w)]
    return idct(torch.nn.functional.pad(coeffs, pad), dims)


def _lowpass_compute(x: torch.Tensor, ratio, dims, window, rule) -> torch.Tensor:
    """Low-pass part in x's compute dtype: one separable projection per axis (= iDCT(DCT(x) * M));
    x itself where the mask keeps every coefficient (the round trip would leave rounding noise
    in the empty high band)."""
    sizes = tuple(x.shape[x.dim() - dims :])
    kept = _windows(sizes, ratio, window, rule)
    if tuple(kept) == sizes:
        return x.to(_compute_dtype(x), copy=True)
    if _fast(x, dims):
        corner = cpu_dct.dct_corner(_as_2d(x, dims), *((1,) * (2 - dims) + tuple(kept)))
        return cpu_dct.idct_corner(corner, *((1,) * (2 - dims) + x.shape[x.dim() - dims :])).view(x.shape)
    return _separable(
        x, dims, lambda axis, n, dtype, device: _lowpass_projection(n, kept[axis], dtype, device)
    )


def split(
    x: torch.Tensor,
    ratio: float | None = None,
    dims: int = 2,
    *,
    window: int | None = None,
    rule: str = "nearest",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split x into low- and high-frequency components with the DCT mask M.

    lfc = iDCT(DCT(x) * M) and hfc = iDCT(DCT(x) * (1 - M)); computed as a projection per axis and
    hfc = x - lfc, so lfc + hfc == x up to one rounding.

    Args:
        x: real floating tensor, shape (*, N_1, ..., N_dims), e.g. activations (N, C, H, W).
        ratio: kept fraction W/N per dim, in (0, 1] (rounding rule in `lowpass_mask`).
        dims: how many trailing dims carry frequencies: 1, 2 or 3.
        window: integer W instead of ratio.
        rule: how ratio becomes W, "nearest" or "official" (see `windows`).

    Returns:
        (lfc, hfc), each shaped, typed and placed like x.

    Raises:
        TypeError/ValueError: naming `x`, `ratio`, `window` or `dims`.

    Example:
        >>> x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        >>> low, high = split(x, 0.5)
        >>> torch.allclose(low + high, x)
        True
        >>> bool(split(torch.ones(1, 1, 8, 8), 0.5)[1].abs().max() < 1e-6)  # a constant is all LFC
        True
    """
    dims = _check_input("x", x, dims)
    low = _lowpass_compute(x, ratio, dims, window, rule)
    return low.to(x.dtype), (x.to(low.dtype) - low).to(x.dtype)


def lowpass(x: torch.Tensor, ratio: float | None = None, dims: int = 2, *, window: int | None = None,
            rule: str = "nearest"):
    """The low-frequency component iDCT(DCT(x) * M); arguments as `split`. Shape of x."""
    dims = _check_input("x", x, dims)
    return _lowpass_compute(x, ratio, dims, window, rule).to(x.dtype)


def highpass(x: torch.Tensor, ratio: float | None = None, dims: int = 2, *, window: int | None = None,
             rule: str = "nearest"):
    """The high-frequency component iDCT(DCT(x) * (1 - M)); arguments as `split`. Shape of x."""
    return split(x, ratio, dims, window=window, rule=rule)[1]


def band_energy(
    x: torch.Tensor,
    ratio: float | None = None,
    dims: int = 2,
    reduce: str = "instance",
    *,
    window: int | None = None,
    rule: str = "nearest",
) -> tuple[torch.Tensor, torch.Tensor]:
    """λ^L = ‖DCT(x) * M‖_F and λ^H = ‖DCT(x) * (1 - M)‖_F (the paper's band norms).

    By Parseval, λ_L² + λ_H² == ‖x‖² over the same elements.

    Args:
        x: real floating tensor, non-empty, shape (N, C, ..., N_1, ..., N_dims).
        ratio: kept fraction W/N per dim, in (0, 1] (rounding rule in `lowpass_mask`).
        dims: how many trailing dims carry frequencies: 1, 2 or 3.
        reduce: "instance": norms per sample, shape (N,) (needs rank >= dims + 1);
            "channel": per (sample, channel), shape (N, C) (needs rank >= dims + 2);
            "all": one norm over the whole tensor, shape ().
        window: integer W instead of ratio.
        rule: how ratio becomes W, "nearest" or "official" (see `windows`).

    Returns:
        (lam_L, lam_H), float32 for half inputs, else x's dtype; differentiable.

    Raises:
        TypeError/ValueError: naming `x`, `ratio`, `window`, `dims` or `reduce`.

    Example:
        >>> x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        >>> lam_l, lam_h = band_energy(x, 0.5)  # one pair per instance, shape (2,)
        >>> torch.allclose(lam_l**2 + lam_h**2, x.flatten(1).square().sum(1))  # Parseval
        True
    """
    dims = _check_input("x", x, dims)
    _validate.choice("reduce", reduce, _REDUCTIONS)
    _check_nonempty("x", x)
    kept = {"instance": 1, "channel": 2, "all": 0}[reduce]
    if x.dim() < dims + kept:
        raise ValueError(
            f"x: reduce={reduce!r} with dims={dims} needs rank >= {dims + kept}, "
            f"got shape {tuple(x.shape)}"
        )
    if _fast(x, dims):
        kept_w = _windows(x.shape[x.dim() - dims :], ratio, window, rule)
        low, high = cpu_dct.band_energy(_as_2d(x, dims), *((1,) * (2 - dims) + tuple(kept_w)))
        summed = tuple(range(kept, x.dim() - dims))
        if summed:  # sum(()) would reduce every dim
            low, high = low.sum(summed), high.sum(summed)
        return low.sqrt().to(torch.float32), high.sqrt().to(torch.float32)
    energy = dct(x.to(_compute_dtype(x)), dims).square()
    mask = lowpass_mask(x.shape[x.dim() - dims :], ratio, window=window, rule=rule, device=x.device)
    summed = tuple(range(kept, x.dim()))
    lam_low = energy.masked_fill(~mask, 0).sum(summed).sqrt()
    lam_high = energy.masked_fill(mask, 0).sum(summed).sqrt()
    return lam_low, lam_high


def block_dct(x: torch.Tensor, block: int, dims: int = 2) -> torch.Tensor:
    """JPEG-style DCT of non-overlapping blocks of the last `dims` dims, laid out in place.

    The coefficient (u, v) of the block starting at (i*B, j*B) lands at (i*B + u, j*B + v).
    Edge blocks: when N is not a multiple of B, the last block of that dim has size N mod B and is
    transformed with its own orthonormal DCT of that size (a dim smaller than B is one block).
    Chosen over zero padding because it keeps the output shape, keeps the whole map transform
    orthonormal (Parseval holds, no padding energy leaks into high frequencies), and matches the
    DIVISION codec's partial edge blocks: every block's DC term is sqrt(its element count) x its
    exact mean.

    Args:
        x: real floating tensor, shape (*, N_1, ..., N_dims); differentiable.
        block: block size B >= 1 (B = 1 is the identity).
        dims: how many trailing dims are blocked: 1, 2 or 3.

    Returns:
        Coefficients, same shape, dtype and device as x.

    Raises:
        TypeError/ValueError: naming `x`, `block` or `dims`.
    """
    dims = _check_input("x", x, dims)
    block = _validate.positive_int("block", block)
    return _separable(
        x, dims, lambda _, n, dtype, device: _block_basis(n, block, dtype, device)
    ).to(x.dtype)


def radial_spectrum(x: torch.Tensor) -> torch.Tensor:
    """Mean DCT energy per integer frequency radius over the last 2 dims.

    Coefficient (i, j) of the 2D DCT of each map has radius r = sqrt(i² + j²) and goes to bin
    floor(r); bin k is the mean of X[..., i, j]² over every leading index and every (i, j) with
    k <= r < k + 1. Every bin up to floor(sqrt((H-1)² + (W-1)²)) holds at least one coefficient.

    Args:
        x: real floating tensor, non-empty, shape (*, H, W) (e.g. (N, C, H, W)).

    Returns:
        (bins,) with bins = floor(sqrt((H-1)² + (W-1)²)) + 1; float32 for half inputs, else x's dtype.

    Raises:
        TypeError/ValueError: naming `x`.
    """
    _check_input("x", x, 2)
    _check_nonempty("x", x)
    h, w = x.shape[-2:]
    energy = dct(x.to(_compute_dtype(x)), 2).square().reshape(-1, h, w).mean(0)
    i = torch.arange(h).unsqueeze(1)
    j = torch.arange(w).unsqueeze(0)
    # sqrt of an integer in float64 is correctly rounded, so floor() gives the exact integer bin.
    bins = (i * i + j * j).double().sqrt().floor().long().flatten()
    counts = torch.bincount(bins)
    assert bool((counts > 0).all()), "every radius bin holds a coefficient"
    total = energy.new_zeros(counts.numel())
    summed = total.index_add(0, bins.to(x.device), energy.flatten())
    return summed / counts.to(device=x.device, dtype=energy.dtype)
