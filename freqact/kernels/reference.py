"""The pure-torch DIVISION codec: the specification, the fallback path and the test oracle.

It produces the "Division packed format" of docs/ARCHITECTURE.md byte for byte; the Triton and C
kernels must match it. Summary for x viewed as maps (N, C, *S) (`as_maps`), block B, Q bits:

- lfc (bf16, (N, C, *nb)): float32 block means, B per dim (a dim shorter than B is one block),
  edge blocks average only what they cover; the float32 sum is divided by the element count.
- h = x.float() - upsample(lfc.float()).
- lo (bf16, (N, C)): min(h) rounded toward -inf; step (bf16, (N, C)): (max(h) - lo) / (2**Q - 1)
  rounded toward +inf, so (h - lo) / step never leaves [0, 2**Q - 1].
- codes = clamp(floor((h - lo) / step + u), 0, 2**Q - 1), u ~ U[0, 1); 8 // Q codes per uint8,
  code i at bit (i % (8 // Q)) * Q of byte i // (8 // Q); each map starts on a fresh byte.
- decode: upsample(lfc.float()) + lo.float() + step.float() * q, in x's dtype.

The same quantiser serves the ablations: with `lfc=None` the codes quantise x itself (`quant`) or
the residual alone (`division-no-lfc`); with `codes=None` only the block means remain
(`division-no-hfc`). Triton covers the full form, the C kernels every form with codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freqact import _validate

__all__ = [
    "BITS",
    "DivisionPacked",
    "as_maps",
    "check_bits",
    "check_division_args",
    "division_decode",
    "division_encode",
    "lfc_encode",
    "pack_codes",
    "pack_mask",
    "packed_shapes",
    "quantize_encode",
    "unpack_codes",
    "unpack_mask",
]

BITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class DivisionPacked:
    """A DIVISION-family packed activation; the four tensors are all it stores.

    Attributes:
        lfc: bfloat16 block means, shape (N, C, *nb), or None when no low-frequency part is kept.
        lo: bfloat16 per-map minimum of the quantised tensor, shape (N, C), or None (no codes).
        step: bfloat16 per-map quantisation step, shape (N, C), or None (no codes).
        codes: uint8 packed codes, shape (N, C, ceil(P * bits / 8)), or None (LFC only).
        shape: the shape of the encoded tensor.
        dtype: the dtype of the encoded tensor (decode returns it).
        block: block size B of the LFC (None when lfc is None).
        bits: bits per code Q (None when codes is None).
    """

    lfc: torch.Tensor | None
    lo: torch.Tensor | None
    step: torch.Tensor | None
    codes: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    block: int | None
    bits: int | None

    @property
    def nbytes(self) -> int:
        """Element bytes of the stored tensors (the same rule as `codecs.tensor_nbytes`, which is
        not imported because the kernels sit below the codecs)."""
        kept = (self.lfc, self.lo, self.step, self.codes)
        return sum(t.numel() * t.element_size() for t in kept if t is not None)


def as_maps(x: torch.Tensor) -> torch.Tensor:
    """View a tensor as activation maps (N, C, *S) following the map-layout rule.

    (N, F) Linear inputs become one 1D map per sample, (N, 1, F); rank 3 is read as (N, C, L), so
    (N, T, F) token tensors give one 1D map per token over its features; ranks 4 and 5 are 2D and
    3D maps as they are.

    Args:
        x: tensor of rank 2 to 5.

    Returns:
        A view of x (no copy), shape (N, C, *S) with 1 <= len(S) <= 3.

    Raises:
        ValueError: if x has rank 1 or above 5.
    """
    if x.dim() == 2:
        return x.unsqueeze(1)
    if 3 <= x.dim() <= 5:
        return x
    raise ValueError(
        f"x: expected a tensor of rank 2 (N, F), 3 (N, C, L), 4 (N, C, H, W) or 5 (N, C, D, H, W), "
        f"got rank {x.dim()} with shape {tuple(x.shape)}"
    )


def check_division_args(x: object, block: object, bits: object, noise: object = None) -> None:
    """Validate the arguments of `division_encode` (the Triton dispatch calls it too).

    Raises:
        TypeError: if x is not a real floating tensor, block/bits are not integers, or noise is
            not a float32 tensor.
        ValueError: if x has rank 1, above 5 or no elements, block < 1, bits not in {1, 2, 4, 8},
            or noise differs from x in shape or device.
    """
    _check_x(x)
    _validate.positive_int("block", block)
    check_bits(bits)
    if noise is not None:
        _check_noise(noise, x)


def _check_x(x: object) -> None:
    _validate.floating_tensor("x", x)
    as_maps(x)
    if x.numel() == 0:
        raise ValueError(f"x: expected a non-empty tensor, got shape {tuple(x.shape)}")


def check_bits(bits: object) -> int:
    """Return bits if it is 1, 2, 4 or 8 (an int, not a bool), else raise TypeError/ValueError."""
    # positive_int first: `True in BITS` and `2.0 in BITS` are both true.
    return _validate.choice("bits", _validate.positive_int("bits", bits), BITS)


def _check_noise(noise: object, x: torch.Tensor) -> None:
    if not isinstance(noise, torch.Tensor) or noise.dtype != torch.float32:
        got = noise.dtype if isinstance(noise, torch.Tensor) else type(noise).__name__
        raise TypeError(f"noise: expected a float32 tensor of uniforms in [0, 1), got {got}")
    if noise.shape != x.shape or noise.device != x.device:
        raise ValueError(
            f"noise: expected shape {tuple(x.shape)} on {x.device} (like x), "
            f"got shape {tuple(noise.shape)} on {noise.device}"
        )


# --- block geometry ------------------------------------------------------------------------------


def _geometry(spatial: tuple[int, ...], block: int | None) -> tuple[tuple[int, int], ...]:
    """(block size, block count) per spatial dim; block None means one block per map."""
    sizes = [s if block is None else min(block, s) for s in spatial]
    return tuple((b, math.ceil(s / b)) for b, s in zip(sizes, spatial))


def packed_shapes(shape: torch.Size, block: int | None,
                  bits: int) -> tuple[list[int] | None, list[int], list[int]]:
    """Shapes of (lfc, lo and step, codes) of the packed form of a tensor of `shape`.

    Args:
        shape: the encoded tensor's shape (rank 2 to 5, read as maps by `as_maps`).
        block: block size B, or None for forms without block means (lfc shape None).
        bits: Q in {1, 2, 4, 8}.

    Returns:
        ([N, C, *nb] or None, [N, C], [N, C, ceil(P * Q / 8)]).
    """
    maps = list(as_maps(torch.empty(shape, device="meta")).shape)
    spatial = tuple(maps[2:])
    lfc = None if block is None else maps[:2] + [nb for _, nb in _geometry(spatial, block)]
    return lfc, maps[:2], maps[:2] + [-(-math.prod(spatial) * bits // 8)]


def _blocked(t: torch.Tensor, geom) -> torch.Tensor:
    """(N, C, *S) -> (N, C, nb1, B1, nb2, B2, ...), zero-padding partial edge blocks (a copy only
    then; a contiguous t with whole blocks is merely viewed)."""
    spatial = t.shape[2:]
    pad = [0] * (2 * len(spatial))
    for d, (s, (b, nb)) in enumerate(zip(spatial, geom)):
        pad[2 * (len(spatial) - 1 - d) + 1] = nb * b - s  # F.pad lists the last dim first
    if any(pad):
        t = F.pad(t, pad)
    return t.reshape(*t.shape[:2], *(n for b, nb in geom for n in (nb, b)))


def _unblocked(tb: torch.Tensor, geom, spatial) -> torch.Tensor:
    """Inverse of `_blocked`: (N, C, nb1, B1, ...) -> (N, C, *S), dropping the padding."""
    t = tb.reshape(*tb.shape[:2], *(b * nb for b, nb in geom))
    for d, s in enumerate(spatial):
        t = t.narrow(2 + d, 0, s)
    return t


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """(N, C, *nb) -> (N, C, nb1, 1, nb2, 1, ...): broadcasts over the elements of each block."""
    return t.reshape(*t.shape[:2], *(n for nb in t.shape[2:] for n in (nb, 1)))


def _block_means(xb: torch.Tensor, geom, spatial) -> torch.Tensor:
    """Exact float32 means of the blocks of xb (zero-padded, so divide by what each covers)."""
    sums = xb.sum(dim=tuple(range(3, xb.dim(), 2)))
    counts = torch.ones((), dtype=torch.float32, device=xb.device)
    for s, (b, nb) in zip(spatial, geom):
        covered = (s - b * torch.arange(nb, device=xb.device)).clamp(max=b).to(torch.float32)
        counts = counts.unsqueeze(-1) * covered
    return sums / counts


# --- directed rounding to bfloat16 ---------------------------------------------------------------


def _bf16_down(v: torch.Tensor) -> torch.Tensor:
    """float32 -> the largest bfloat16 <= v (NaN stays NaN)."""
    r = v.to(torch.bfloat16)
    return torch.where(r.float() > v, torch.nextafter(r, torch.full_like(r, -math.inf)), r)


def _bf16_up(v: torch.Tensor) -> torch.Tensor:
    """float32 -> the smallest bfloat16 >= v (NaN stays NaN)."""
    r = v.to(torch.bfloat16)
    return torch.where(r.float() < v, torch.nextafter(r, torch.full_like(r, math.inf)), r)


# --- the per-map quantiser shared by division, division-no-lfc and quant -------------------------


def _quantize(h: torch.Tensor, bits: int, noise: torch.Tensor | None, *, overwrite: bool):
    """Stochastically round each map of h to `bits`-bit codes and pack them.

    Args:
        h: float32 (N, C, P), any strides. Used as scratch space when `overwrite`.
        bits: Q in {1, 2, 4, 8}.
        noise: float32 (N, C, P) uniforms in [0, 1), or None to draw them.
        overwrite: whether h may be clobbered (saves one full-size float32 buffer).

    Returns:
        (lo, step, codes): bf16 (N, C), bf16 (N, C), uint8 (N, C, ceil(P * Q / 8)).
    """
    qmax = 2**bits - 1
    h_min, h_max = torch.aminmax(h, dim=-1)  # a NaN anywhere in a map makes both NaN
    lo = _bf16_down(h_min)
    step = _bf16_up((h_max - lo.float()) / qmax)
    # step == 0 means h == lo everywhere in the map: dividing by 1 instead gives floor(0 + u) = 0.
    divisor = torch.where(step == 0, 1.0, step.float()).unsqueeze(-1)
    shifted = torch.sub(h, lo.float().unsqueeze(-1), out=h if overwrite else None)
    # t = u + (h - lo) / step in one pass (addcdiv divides, then adds: the same two roundings).
    if noise is None:
        # Drawn in logical order (not rand_like, which follows h's strides): the same seed gives
        # the same codes whatever x's memory layout.
        t = torch.rand(shifted.shape, device=shifted.device).addcdiv_(shifted, divisor)
    else:
        t = torch.addcdiv(noise, shifted, divisor)
    # Values are >= 0 after the clamp, so the cast's truncation is the floor.
    q = t.clamp_(0, qmax).to(torch.uint8)
    return lo, step, pack_codes(q, bits)


# Packing works on machine words, not on bytes: PyTorch's uint8 shifts are slow on the CPU. The
# 8 // Q codes of one output byte are consecutive bytes, i.e. one little-endian integer of that many
# bytes; code k sits at bit 8k of that word and belongs at bit Qk, a right shift by k * (8 - Q).
_WORD = {1: torch.int64, 2: torch.int32, 4: torch.int16}


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack Q-bit codes along the last dim, 8 // Q per byte, little-endian within each byte.

    Args:
        q: uint8 codes < 2**bits, shape (..., P).
        bits: Q in {1, 2, 4, 8}.

    Returns:
        uint8 (..., ceil(P * Q / 8)); code i sits at bit (i % (8 // Q)) * Q of byte i // (8 // Q).
    """
    per_byte = 8 // bits
    if per_byte == 1:
        return q
    tail = -q.shape[-1] % per_byte
    q = F.pad(q, (0, tail)) if tail else q.contiguous()
    word = q.view(_WORD[bits])  # one word per output byte; codes < 2**Q keep it non-negative
    packed = word.clone()
    for k in range(1, per_byte):
        packed |= word >> (k * (8 - bits))
    return (packed & 0xFF).to(torch.uint8)


def unpack_codes(codes: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: (N, C, nbytes) -> uint8 (N, C, count)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    byte = codes.to(_WORD[bits])
    word = byte.clone()
    for k in range(1, per_byte):
        word |= byte << (k * (8 - bits))
    # Keep the low Q bits of every byte of the word: those are the codes, one per byte.
    mask = int.from_bytes(bytes([2**bits - 1]) * per_byte, "little", signed=True)
    q = (word & mask).view(torch.uint8)
    return q[..., :count]


def pack_mask(x: torch.Tensor, lower: float, upper: float | None = None) -> torch.Tensor:
    """One bit per element of x: `lower < x` (and `x < upper` when given), packed 8 per byte.

    Args:
        x: floating tensor, any shape (read in logical order).
        lower, upper: the open interval's ends (compared in x's dtype, as `x > lower` does).

    Returns:
        uint8 (ceil(x.numel() / 8),); element i at bit i % 8 of byte i // 8.
    """
    inside = x > lower if upper is None else (x > lower) & (x < upper)
    return pack_codes(inside.reshape(-1).view(torch.uint8), 1)


def unpack_mask(packed: torch.Tensor, shape: torch.Size, dtype: torch.dtype, off: float,
                on: float) -> torch.Tensor:
    """Inverse of `pack_mask` up to the values: `on` where the bit is set, else `off`.

    Returns:
        Tensor of `shape` and `dtype` on packed's device.
    """
    bits = unpack_codes(packed, math.prod(shape), 1).view(torch.bool).view(shape)
    if off == 0.0 and on == 1.0:
        return bits.to(dtype)
    return torch.where(bits, torch.tensor(on, dtype=dtype, device=bits.device),
                       torch.tensor(off, dtype=dtype, device=bits.device))


# --- public encode / decode ----------------------------------------------------------------------


def _float_maps(x: torch.Tensor) -> torch.Tensor:
    """x as float32 maps (N, C, *S): no copy for float32 x (later reshapes copy other layouts)."""
    return as_maps(x).float()


@torch.no_grad()
def division_encode(
    x: torch.Tensor, block: int = 8, bits: int = 2, noise: torch.Tensor | None = None
) -> DivisionPacked:
    """Encode activations in the DIVISION packed format (see the module docstring).

    Args:
        x: floating tensor of rank 2 to 5, read as maps (N, C, *S) by `as_maps`; any layout.
        block: block size B >= 1 of the low-frequency part (per spatial dim).
        bits: bits per residual code Q, one of 1, 2, 4, 8.
        noise: optional float32 uniforms in [0, 1) with x's shape, in x's logical element order,
            used instead of fresh `torch.rand` draws (for byte-exact comparisons).

    Returns:
        DivisionPacked with lfc bf16 (N, C, *nb), lo/step bf16 (N, C), codes uint8
        (N, C, ceil(P * Q / 8)); nbytes per map = ceil(Q * P / 8) + 2 * prod(nb) + 4.

    Raises:
        TypeError, ValueError: see `check_division_args`.
    """
    check_division_args(x, block, bits, noise)
    xm = _float_maps(x)
    n, c, *spatial = xm.shape
    geom = _geometry(tuple(spatial), block)
    xb = _blocked(xm, geom)
    lfc = _block_means(xb, geom, spatial).to(torch.bfloat16)
    # The residual is taken against the stored (bf16) means so that decode rebuilds x consistently.
    h = _unblocked(xb - _per_block(lfc.float()), geom, spatial).reshape(n, c, -1)
    if noise is not None:
        noise = as_maps(noise).reshape(n, c, -1)
    lo, step, codes = _quantize(h, bits, noise, overwrite=True)
    return DivisionPacked(lfc, lo, step, codes, x.shape, x.dtype, block, bits)


@torch.no_grad()
def lfc_encode(x: torch.Tensor, block: int = 8) -> DivisionPacked:
    """Keep only DIVISION's low-frequency part (bf16 block means): the `division-no-hfc` ablation.

    Args:
        x: floating tensor of rank 2 to 5, read as maps (N, C, *S).
        block: block size B >= 1.

    Returns:
        DivisionPacked with lfc bf16 (N, C, *nb) and no codes; nbytes per map = 2 * prod(nb).
        A NaN/Inf stays confined to its own block (there is no per-map statistic to spread it).
    """
    _check_x(x)
    _validate.positive_int("block", block)
    xm = _float_maps(x)
    spatial = tuple(xm.shape[2:])
    geom = _geometry(spatial, block)
    lfc = _block_means(_blocked(xm, geom), geom, spatial).to(torch.bfloat16)
    return DivisionPacked(lfc, None, None, None, x.shape, x.dtype, block, None)


@torch.no_grad()
def quantize_encode(
    x: torch.Tensor, bits: int = 2, noise: torch.Tensor | None = None
) -> DivisionPacked:
    """Per-map Q-bit stochastic quantisation of x itself (the `quant` ablation).

    Args:
        x: floating tensor of rank 2 to 5, read as maps (N, C, *S).
        bits: Q in {1, 2, 4, 8}.
        noise: optional float32 uniforms with x's shape, as in `division_encode`.

    Returns:
        DivisionPacked with lo/step bf16 (N, C) and codes uint8 (N, C, ceil(P * Q / 8)), no lfc;
        nbytes per map = ceil(Q * P / 8) + 4.
    """
    _check_x(x)
    check_bits(bits)
    if noise is not None:
        _check_noise(noise, x)
    xm = _float_maps(x)
    n, c = xm.shape[:2]
    if noise is not None:
        noise = as_maps(noise).reshape(n, c, -1)
    # xm may be x itself, so the quantiser must not write into it.
    lo, step, codes = _quantize(xm.reshape(n, c, -1), bits, noise, overwrite=False)
    return DivisionPacked(None, lo, step, codes, x.shape, x.dtype, None, bits)


@torch.no_grad()
def division_decode(packed: DivisionPacked) -> torch.Tensor:
    """Rebuild a tensor from any DivisionPacked (full, no-lfc, no-hfc or quant form).

    Computes upsample(lfc.float()) + lo.float() + step.float() * q in float32, leaving out the
    parts the packed form does not hold, then casts to the encoded dtype.

    Args:
        packed: from `division_encode`, `lfc_encode`, `quantize_encode` (or the Triton kernel).

    Returns:
        Tensor of packed.shape and packed.dtype (contiguous), on the packed tensors' device.
    """
    if not isinstance(packed, DivisionPacked):
        raise TypeError(f"packed: expected a DivisionPacked, got {type(packed).__name__}")
    shape = as_maps(torch.empty(packed.shape, device="meta")).shape
    spatial = tuple(shape[2:])
    if packed.lfc is None:
        geom = _geometry(spatial, None)
        base = packed.lo.float().reshape(*shape[:2], *(1 for _ in spatial))
    else:
        geom = _geometry(spatial, packed.block)
        base = packed.lfc.float()
        if packed.lo is not None:
            base = base + packed.lo.float().reshape(*shape[:2], *(1 for _ in spatial))
    base = _per_block(base)  # (N, C, nb1, 1, nb2, 1, ...)
    if packed.codes is None:
        out = base.expand(*shape[:2], *(n for b, nb in geom for n in (nb, b)))
    else:
        q = unpack_codes(packed.codes, math.prod(spatial), packed.bits).reshape(shape)
        out = _blocked(q, geom).to(torch.float32)
        step = packed.step.float().reshape(*shape[:2], *(1 for _ in range(2 * len(spatial))))
        out.mul_(step).add_(base)
    return _unblocked(out, geom, spatial).reshape(packed.shape).to(packed.dtype).contiguous()
