"""The pure-torch DIVISION codec: the specification, the fallback path and the test oracle.

It produces the "Division packed format" of docs/ARCHITECTURE.md byte for byte; the Triton and C
kernels must match it. Sizes come from `format.Geometry`. Summary for x viewed as maps
(N, C, *S) (`format.as_maps`), block B, Q bits:

- lfc (bf16, (N, C, *nb)): float32 block means (`format.block_means`), rounded to nearest.
- h = x.float() - upsample(lfc.float()).
- lo (bf16, (N, C)): min(h) rounded toward -inf; step (bf16, (N, C)): (max(h) - lo) / (2**Q - 1)
  rounded toward +inf (`format.bf16_directed`), so (h - lo) / step never leaves [0, 2**Q - 1].
- codes = clamp(floor((h - lo) / step + u), 0, 2**Q - 1), u ~ U[0, 1); 8 // Q codes per uint8,
  code i at bit (i % (8 // Q)) * Q of byte i // (8 // Q); each map starts on a fresh byte.
- decode: upsample(lfc.float()) + lo.float() + step.float() * q, in x's dtype.

The same quantiser serves the ablations: a geometry without block (`geom.block` None) quantises x
itself (`quant`); `lfc_encode` keeps the block means alone (`division-no-hfc`).

Backend signature (shared with `cpu` and `triton_division`): `encode(x, geom, bits, noise, seed)`
-> (lfc or None, lo, step, codes) and `decode(lfc, lo, step, codes, geom, bits, dtype)` -> maps
(N, C, *S) of dtype. Arguments are assumed valid: `freqact.kernels` checks them.
"""
from __future__ import annotations

import torch

from freqact.kernels.format import (
    FLT_MAX,
    Geometry,
    as_maps,
    bf16_directed,
    bf16_nearest,
    block_means,
    blocked,
    saturating_cast,
)

__all__ = ["decode", "encode", "lfc_encode", "pack_codes", "pack_mask", "token_flat",
           "unpack_codes", "unpack_mask"]


def _unblocked(tb: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """Inverse of `format.blocked`: (N, C, nb1, B1, ...) -> (N, C, *S), dropping the padding."""
    t = tb.reshape(*tb.shape[:2], *(b * nb for b, nb in zip(geom.sizes, geom.counts)))
    for d, s in enumerate(geom.spatial):
        t = t.narrow(2 + d, 0, s)
    return t


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """(N, C, *nb) -> (N, C, nb1, 1, nb2, 1, ...): broadcasts over the elements of each block."""
    return t.reshape(*t.shape[:2], *(n for nb in t.shape[2:] for n in (nb, 1)))


def _per_map(t: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """(N, C) -> (N, C, 1, 1, ...) broadcasting over a blocked map."""
    return t.reshape(*t.shape[:2], *(1 for _ in range(2 * len(geom.spatial))))


# --- the per-map quantiser shared by division, division-no-lfc and quant -------------------------


def _lo_and_step(h: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 lo = min(h) rounded down and step = (max(h) - lo) / (2**Q - 1) rounded up, per map;
    a span that overflows float32 in a finite map is taken as max / qmax - lo / qmax instead.
    A zero min or max is +0 (`+ 0.0`: -0 + 0 = +0): which of -0 and +0 a min keeps depends on
    its scan order, which differs between torch's own reductions, C and Triton."""
    qmax = 2**bits - 1
    h_min, h_max = torch.aminmax(h, dim=-1)  # a NaN anywhere in a map makes both NaN
    h_min, h_max = h_min + 0.0, h_max + 0.0
    lo = bf16_directed(h_min, up=False)
    span = h_max - lo.float()
    over = span.isinf() & h_max.isfinite() & lo.isfinite()
    scaled = torch.where(over, h_max / qmax - lo.float() / qmax, span / qmax)
    return lo, bf16_directed(scaled, up=True)


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
    lo, step = _lo_and_step(h, bits)
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
    if q.numel() == 0:  # no words to view (torch refuses views of some empty shapes)
        return q.new_empty((*q.shape[:-1], -(-q.shape[-1] * bits // 8)))
    tail = -q.shape[-1] % per_byte
    q = torch.nn.functional.pad(q, (0, tail)) if tail else q.contiguous()
    word = q.view(_WORD[bits])  # one word per output byte; codes < 2**Q keep it non-negative
    packed = word.clone()
    for k in range(1, per_byte):
        packed |= word >> (k * (8 - bits))
    return (packed & 0xFF).to(torch.uint8)


def unpack_codes(codes: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: (..., ceil(count * Q / 8)) -> uint8 (..., count)."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes
    if codes.numel() == 0:
        return codes.new_empty((*codes.shape[:-1], count))
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
    bits = unpack_codes(packed, shape.numel(), 1).view(torch.bool).view(shape)
    if off == 0.0 and on == 1.0:
        return bits.to(dtype)
    return torch.where(bits, torch.tensor(on, dtype=dtype, device=bits.device),
                       torch.tensor(off, dtype=dtype, device=bits.device))


# --- encode / decode -----------------------------------------------------------------------------


def _means(xm: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """bf16 block means (N, C, *nb) of float32 maps xm."""
    return bf16_nearest(block_means(xm, geom.block, len(geom.spatial)))


@torch.no_grad()
def encode(x: torch.Tensor, geom: Geometry, bits: int, noise: torch.Tensor | None,
           seed: int = 0):
    """Encode x: the full form (geom.block set) or the quant form (geom.block None).

    Args:
        x: floating tensor of rank 2 to 5 (maps `geom`), any layout.
        geom: `format.geometry(x.shape, block)`.
        bits: Q in {1, 2, 4, 8}.
        noise: float32 uniforms in [0, 1) shaped like x (logical order), or None for torch.rand.
        seed: unused (torch's generator draws the noise); kept for the shared signature.

    Returns:
        (lfc, lo, step, codes): bf16 (N, C, *nb) or None, bf16 (N, C), bf16 (N, C), uint8
        (N, C, ceil(P * Q / 8)).
    """
    xm = as_maps(x).float()  # no copy for float32 x: the quant form must not write into it
    n, c = geom.n, geom.c
    if noise is not None:
        noise = as_maps(noise).reshape(n, c, geom.numel)
    if geom.block is None:
        return (None, *_quantize(xm.reshape(n, c, geom.numel), bits, noise, overwrite=False))
    xb = blocked(xm, geom.sizes, geom.counts)
    lfc = _means(xm, geom)
    # The residual is taken against the stored (bf16) means so that decode rebuilds x consistently.
    hb = xb - _per_block(lfc.float())
    if not bool(hb.isfinite().all()):  # edge rule: a finite x's residual saturates
        hb = torch.where(hb.isinf() & xb.isfinite(), hb.sign() * FLT_MAX, hb)
    h = _unblocked(hb, geom).reshape(n, c, geom.numel)
    return (lfc, *_quantize(h, bits, noise, overwrite=True))


@torch.no_grad()
def lfc_encode(x: torch.Tensor, geom: Geometry) -> torch.Tensor:
    """DIVISION's low-frequency part alone: bf16 block means (N, C, *nb) of x."""
    return _means(as_maps(x).float(), geom)


def _base(lfc: torch.Tensor | None, lo: torch.Tensor | None, geom: Geometry,
          scale: float = 1.0) -> torch.Tensor:
    """scale * lfc + scale * lo, broadcastable over a blocked map (N, C, nb1, 1, nb2, 1, ...)."""
    if lfc is None:
        return _per_map(lo.float() * scale, geom)
    base = _per_block(lfc.float() * scale)
    return base if lo is None else base + _per_map(lo.float() * scale, geom)


@torch.no_grad()
def decode(lfc: torch.Tensor | None, lo: torch.Tensor | None, step: torch.Tensor | None,
           codes: torch.Tensor | None, geom: Geometry, bits: int | None,
           dtype: torch.dtype) -> torch.Tensor:
    """upsample(lfc.float()) + lo.float() + step.float() * q in float32, leaving out the parts
    that are None (lfc: the quant form; lo, step, codes: the LFC-only form), cast to dtype.

    Edge rule: where that sum overflows but q * (step / 4) + (lfc / 4 + lo / 4) is finite, the
    latter times 4, saturated at ±FLT_MAX (the scaling is exact at these magnitudes); then finite
    values saturate at dtype's largest finite value (`format.saturating_cast`).

    Returns:
        Maps (N, C, *S) of dtype, on the parts' device.
    """
    shape = [geom.n, geom.c, *geom.spatial]
    base = _base(lfc, lo, geom)
    full = [geom.n, geom.c, *(n for b, nb in zip(geom.sizes, geom.counts) for n in (nb, b))]
    if codes is None:
        out = base.expand(full)
    else:
        q = blocked(unpack_codes(codes, geom.numel, bits).reshape(shape), geom.sizes,
                    geom.counts).to(torch.float32)
        out = q.mul(_per_map(step.float(), geom)).add_(base)
        if not bool(out.isfinite().all()):
            quarter = q.mul(_per_map(step.float() * 0.25, geom)).add_(_base(lfc, lo, geom, 0.25))
            redo = ~out.isfinite() & quarter.isfinite()
            out = torch.where(redo, (quarter * 4).clamp(-FLT_MAX, FLT_MAX), out)
    return saturating_cast(_unblocked(out, geom), dtype).contiguous()


def token_flat(x: torch.Tensor, step: torch.Tensor) -> bool:
    """Whether some token's values span less than its step (`moments.NormLayout`'s test for a
    flat token): max - min < step over the last dim, in x's dtype against step as float32; a
    token with a NaN never is (its spread is NaN).

    Args:
        x: (M, T, F) floating, F >= 1; step: (M, T) (a quant part's bf16 step per token).
    """
    spread = x.amax(-1) - x.amin(-1)
    return bool((spread < step.float().reshape(spread.shape)).any())
