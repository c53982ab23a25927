"""The DIVISION packed format: map layout, block geometry, packed types, bf16 rounding rules.

The one home of what every backend (the torch reference, the C and the Triton kernels) must agree
on; docs/ARCHITECTURE.md ("Division packed format") describes it in prose. The backends take their
sizes from `Geometry` (computed here once per call) instead of re-deriving them.

Packed types, one per form:

- `DivisionPacked`: lfc + lo + step + codes (`division`);
- `LfcPacked`: lfc only (`division-no-hfc`);
- `QuantPacked`: lo + step + codes (`quant`, `division-no-lfc`).

Edge rule (finite in, finite out): a finite value whose bf16 or float32 result would overflow
saturates at the largest finite value of that type instead (block means, lo, step, the decoded
sum and its cast to the output dtype); infinities and NaNs in the data keep their meaning.
Ordinary inputs never reach these branches, so their bytes are those of the plain rule.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freqact import _validate

__all__ = [
    "BF16_MAX",
    "BITS",
    "FLT_MAX",
    "SUM_SCALE",
    "PACKED_TYPES",
    "DivisionPacked",
    "Geometry",
    "LfcPacked",
    "QuantPacked",
    "as_maps",
    "bf16_directed",
    "bf16_nearest",
    "block_means",
    "blocked",
    "check_bits",
    "check_packed",
    "geometry",
    "map_dims",
    "maps_shape",
    "saturating_cast",
]

BITS = (1, 2, 4, 8)
BF16_MAX = 3.3895313892515355e38  # 0x7F7F, the largest finite bfloat16
FLT_MAX = 3.4028234663852886e38
# Block sums that overflow float32 are recomputed on values scaled by 2**-64 (exact: a power of
# two), which cannot overflow for fewer than 2**64 elements.
SUM_SCALE = 2.0**-64


# --- map layout ----------------------------------------------------------------------------------

_MAP_DIMS = {2: 1, 3: 1, 4: 2, 5: 3}


def map_dims(shape: torch.Size | tuple[int, ...]) -> int:
    """How many trailing dims of a tensor of `shape` form one activation map (1, 2 or 3).

    (N, F) and (N, C, L) / (N, T, F) hold 1D maps, (N, C, H, W) 2D maps, (N, C, D, H, W) 3D maps.

    Raises:
        ValueError: for any other rank (naming `x`).
    """
    dims = _MAP_DIMS.get(len(shape))
    if dims is None:
        raise ValueError(
            f"x: expected a tensor of rank 2 (N, F), 3 (N, C, L), 4 (N, C, H, W) or 5 "
            f"(N, C, D, H, W), got rank {len(shape)} with shape {tuple(shape)}")
    return dims


def maps_shape(shape: torch.Size | tuple[int, ...]) -> torch.Size:
    """The (N, C, *S) map shape of a tensor of `shape`: (N, F) becomes (N, 1, F)."""
    map_dims(shape)
    shape = tuple(shape)
    return torch.Size(shape[:1] + (1,) + shape[1:] if len(shape) == 2 else shape)


def as_maps(x: torch.Tensor) -> torch.Tensor:
    """View x (rank 2 to 5) as activation maps (N, C, *S) without copying (`maps_shape`)."""
    map_dims(x.shape)
    return x.unsqueeze(1) if x.dim() == 2 else x


# --- geometry ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """Sizes of the packed form of a tensor, computed once and given to every backend.

    Attributes:
        n, c: the map layout's leading dims (N, C).
        spatial: the map's spatial sizes S (1 to 3 dims).
        sizes: block extent per spatial dim, min(B, S_d) (S_d when there is no block).
        counts: blocks per spatial dim, ceil(S_d / sizes_d).
        block: the block size B, or None for forms without block means (one block per map).
    """

    n: int
    c: int
    spatial: tuple[int, ...]
    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    block: int | None

    @property
    def maps(self) -> int:
        return self.n * self.c

    @property
    def numel(self) -> int:
        """Elements P of one map."""
        return math.prod(self.spatial)

    @property
    def nblocks(self) -> int:
        return math.prod(self.counts)

    def code_bytes(self, bits: int) -> int:
        """Bytes of one map's packed codes, ceil(P * Q / 8)."""
        return -(-self.numel * bits // 8)

    @property
    def lfc_shape(self) -> list[int]:
        return [self.n, self.c, *self.counts]

    @property
    def stat_shape(self) -> list[int]:
        return [self.n, self.c]

    def codes_shape(self, bits: int) -> list[int]:
        return [self.n, self.c, self.code_bytes(bits)]

    @staticmethod
    def _dhw(values: tuple[int, ...]) -> tuple[int, int, int]:
        return (1,) * (3 - len(values)) + tuple(values)

    @property
    def dhw(self) -> tuple[int, int, int]:
        """Spatial sizes as (D, H, W): 1D maps are 1 x 1 x L, 2D maps 1 x H x W."""
        return self._dhw(self.spatial)

    @property
    def block_dhw(self) -> tuple[int, int, int]:
        return self._dhw(self.sizes)

    @property
    def counts_dhw(self) -> tuple[int, int, int]:
        return self._dhw(self.counts)


def geometry(shape: torch.Size | tuple[int, ...], block: int | None) -> Geometry:
    """The geometry of a tensor of `shape` (rank 2 to 5) with block size `block` (None: one block
    per map). A block larger than a dim covers that whole dim. Cached where every size and the
    block are plain ints (each codec call asks: 7 us computed, under 1 us cached); other values
    (SymInts while tracing, anything a check below refuses) are computed each time."""
    shape = tuple(shape)
    if type(block) in (int, type(None)) and all(type(s) is int for s in shape):
        return _cached_geometry(shape, block)
    return _geometry(shape, block)


@functools.lru_cache(maxsize=1024)
def _cached_geometry(shape: tuple[int, ...], block: int | None) -> Geometry:
    return _geometry(shape, block)


def _geometry(shape: torch.Size | tuple[int, ...], block: int | None) -> Geometry:
    n, c, *spatial = maps_shape(shape)
    sizes, counts = _extents(tuple(spatial), block)
    return Geometry(n, c, tuple(spatial), sizes, counts, block)


def _extents(spatial: tuple[int, ...], block: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(block extent, block count) per spatial dim: B_d = min(B, S_d), nb_d = ceil(S_d / B_d);
    an empty dim has extent 1 and no blocks (with or without a block size)."""
    sizes = tuple(max(1, s if block is None else min(block, s)) for s in spatial)
    return sizes, tuple(-(-s // b) for s, b in zip(spatial, sizes))


# --- packed types --------------------------------------------------------------------------------


def _nbytes(*tensors: torch.Tensor) -> int:
    # The rule of `codecs.tensor_nbytes`, not imported: the kernels sit below the codecs.
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class DivisionPacked:
    """The full DIVISION form (`division`).

    Attributes:
        lfc: bfloat16 block means (N, C, *nb).
        lo: bfloat16 per-map minimum of the residual (N, C).
        step: bfloat16 per-map quantisation step (N, C).
        codes: uint8 packed codes (N, C, ceil(P * bits / 8)).
        shape, dtype: the encoded tensor's shape and dtype (decode returns them).
        block: block size B; bits: bits per code Q.
    """

    lfc: torch.Tensor
    lo: torch.Tensor
    step: torch.Tensor
    codes: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block: int
    bits: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.lfc, self.lo, self.step, self.codes)


@dataclass(frozen=True)
class LfcPacked:
    """Block means only (`division-no-hfc`): lfc bfloat16 (N, C, *nb)."""

    lfc: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.lfc)


@dataclass(frozen=True)
class QuantPacked:
    """Per-map quantised codes without block means (`quant`, `division-no-lfc`): lo, step
    bfloat16 (N, C), codes uint8 (N, C, ceil(P * bits / 8))."""

    lo: torch.Tensor
    step: torch.Tensor
    codes: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.lo, self.step, self.codes)


PACKED_TYPES = (DivisionPacked, LfcPacked, QuantPacked)


def check_bits(bits: object) -> int:
    """Return bits if it is 1, 2, 4 or 8 (an int, not a bool), else raise TypeError/ValueError."""
    # positive_int first: `True in BITS` and `2.0 in BITS` are both true.
    return _validate.choice("bits", _validate.positive_int("bits", bits), BITS)


def check_tensor(name: str, t: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t if it is a dense (strided) tensor of dtype (any floating dtype when None), else raise."""
    if dtype is None:
        _validate.floating_tensor(name, t)
    elif not isinstance(t, torch.Tensor) or t.dtype != dtype:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name}: expected a {dtype} tensor, got {got}")
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    return t


def check_count(name: str, value: object) -> int:
    """value as an int if it is an integer >= 0 (not a bool), else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
    return int(value)


def check_code_bytes(codes: torch.Tensor, count: int, bits: int) -> None:
    """Refuse codes whose last dim does not hold count bits-bit codes, ceil(count * bits / 8)."""
    need = -(-count * bits // 8)
    if codes.dim() == 0 or codes.shape[-1] != need:
        raise ValueError(f"codes: expected a last dim of ceil(count * bits / 8) = {need} bytes "
                         f"for count={count}, bits={bits}, got shape {tuple(codes.shape)}")


def check_mask_bytes(packed: torch.Tensor, shape: torch.Size) -> None:
    """Refuse a packed mask that is not 1-D with one bit per element of shape."""
    need = -(-math.prod(shape) // 8)
    if packed.dim() != 1 or packed.numel() != need:
        raise ValueError(f"packed: expected a 1-D tensor of ceil(prod(shape) / 8) = {need} bytes "
                         f"for shape {tuple(shape)}, got shape {tuple(packed.shape)}")


def _check_part(name: str, t: object, dtype: torch.dtype, shape: list[int],
                device: torch.device | None) -> torch.device:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.layout != torch.strided:
        got = f"{t.dtype} {t.layout}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"packed.{name}: expected a dense {dtype} tensor, got {got}")
    if list(t.shape) != shape or (device is not None and t.device != device):
        raise ValueError(f"packed.{name}: expected shape {tuple(shape)} on {device or t.device}, "
                         f"got shape {tuple(t.shape)} on {t.device}")
    return t.device


def check_packed(packed: object) -> Geometry:
    """Check that a packed form's tensors have the dtypes, shapes and device its shape, block and
    bits imply (so no backend reads past a buffer), and return its geometry.

    Raises:
        TypeError: if packed is not one of `PACKED_TYPES` or a part has the wrong type.
        ValueError: if a part's shape or device disagrees with the others.
    """
    if not isinstance(packed, PACKED_TYPES):
        raise TypeError(f"packed: expected a DivisionPacked, LfcPacked or QuantPacked, "
                        f"got {type(packed).__name__}")
    if not isinstance(packed.dtype, torch.dtype) or not packed.dtype.is_floating_point:
        raise TypeError(f"packed.dtype: expected a floating dtype, got {packed.dtype!r}")
    if not isinstance(packed.shape, (tuple, torch.Size)) or not all(
            isinstance(s, numbers.Integral) and s >= 0 for s in packed.shape):
        raise TypeError(f"packed.shape: expected a tuple of sizes, got {packed.shape!r}")
    block = None if isinstance(packed, QuantPacked) else _validate.positive_int(
        "packed.block", packed.block)
    geom = geometry(packed.shape, block)
    device = None
    if block is not None:
        device = _check_part("lfc", packed.lfc, torch.bfloat16, geom.lfc_shape, device)
    if not isinstance(packed, LfcPacked):
        bits = check_bits(packed.bits)
        for name in ("lo", "step"):
            device = _check_part(name, getattr(packed, name), torch.bfloat16, geom.stat_shape,
                                 device)
        _check_part("codes", packed.codes, torch.uint8, geom.codes_shape(bits), device)
    return geom


# --- block means ---------------------------------------------------------------------------------


def blocked(t: torch.Tensor, sizes: tuple[int, ...], counts: tuple[int, ...]) -> torch.Tensor:
    """(*, *S) -> (*, nb1, B1, nb2, B2, ...) over the last len(sizes) dims, zero-padding partial
    edge blocks (a copy only then; a contiguous t with whole blocks is merely viewed)."""
    d = len(sizes)
    spatial = t.shape[t.dim() - d:]
    pad = [0] * (2 * d)
    for k, (s, b, nb) in enumerate(zip(spatial, sizes, counts)):
        pad[2 * (d - 1 - k) + 1] = nb * b - s  # F.pad lists the last dim first
    if any(pad):
        t = F.pad(t, pad)
    return t.reshape(*t.shape[:t.dim() - d], *(n for b, nb in zip(sizes, counts) for n in (nb, b)))


def _block_counts(spatial, sizes, counts, dtype, device) -> torch.Tensor:
    """Elements each block covers, shape (*nb), in `dtype` (float32: the reference's product)."""
    out = torch.ones((), dtype=dtype, device=device)
    for s, b, nb in zip(spatial, sizes, counts):
        covered = (s - b * torch.arange(nb, device=device)).clamp(max=b).to(dtype)
        out = out.unsqueeze(-1) * covered
    return out


def block_means(x: torch.Tensor, block: int | None, dims: int) -> torch.Tensor:
    """Exact means of the non-overlapping blocks of the last `dims` dims, in x's dtype.

    Edge blocks average only the elements they cover; block None is one block per map. A sum
    that overflows while its block is finite is redone on values scaled by 2**-64 (exact), so a
    finite block has a finite mean.

    Args:
        x: floating tensor (*, S_1, ..., S_dims), dims in 1..3.
        block: block size B >= 1 (B_d = min(B, S_d)), or None.

    Returns:
        (*, nb_1, ..., nb_dims) with nb_d = ceil(S_d / B_d).
    """
    spatial = tuple(x.shape[x.dim() - dims:])
    sizes, counts = _extents(spatial, block)
    xb = blocked(x, sizes, counts)
    inner = tuple(range(xb.dim() - 2 * dims + 1, xb.dim(), 2))
    sums = xb.sum(dim=inner)
    covered = _block_counts(spatial, sizes, counts, x.dtype, x.device)
    if not bool(torch.isfinite(sums).all()):
        finite = torch.isfinite(xb).all(dim=inner)
        scaled = (xb * SUM_SCALE).sum(dim=inner) / covered / SUM_SCALE
        return torch.where(finite, scaled, sums / covered)
    return sums / covered


# --- rounding to bfloat16 ------------------------------------------------------------------------


def bf16_nearest(v: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, nearest even; a finite v that would round to inf gives ±BF16_MAX."""
    r = v.to(torch.bfloat16)
    over = r.isinf() & v.isfinite()
    if bool(over.any()):
        r = torch.where(over, torch.copysign(torch.tensor(BF16_MAX, dtype=torch.bfloat16), r), r)
    return r


def bf16_directed(v: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 -> bfloat16 rounded toward +inf (up) or -inf, on the bit patterns; NaN gives the
    quiet NaN 0x7FC0 and a finite v saturates at ±BF16_MAX.

    The algorithm the C and Triton kernels share: dropping the low 16 bits rounds toward zero;
    one unit more in the magnitude is needed when bits were dropped and v lies on the far side of
    zero (v > 0 rounding up, v < 0 rounding down). -0 and +0 stay as they are.
    """
    b = v.contiguous().view(torch.int32)
    kept = b >> 16  # arithmetic shift: the sign bit fills, so mask the low 16 bits below
    far = (v > 0) if up else (v < 0)
    kept = kept + ((b & 0xFFFF) != 0).logical_and_(far).to(torch.int32)
    kept = torch.where(v.isnan(), 0x7FC0, kept & 0xFFFF)
    # A finite v past the largest bf16 reached the infinity pattern: one unit back.
    kept = torch.where(((kept & 0x7FFF) == 0x7F80) & v.isfinite(), kept - 1, kept)
    return kept.to(torch.int16).view(torch.bfloat16).reshape(v.shape)


def saturating_cast(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast v to dtype, finite values saturating at dtype's largest finite value (a plain cast
    for every value that fits; infinities and NaNs are kept)."""
    if v.dtype == dtype:
        return v
    limit = torch.finfo(dtype).max
    if limit < torch.finfo(v.dtype).max and bool(
            v.abs().gt(limit).logical_and_(v.isfinite()).any()):
        v = torch.where(v.isfinite(), v.clamp(-limit, limit), v)
    return v.to(dtype)
