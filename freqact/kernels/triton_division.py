"""Fused Triton kernels for the DIVISION codec (encode and decode).

They produce the packed format of docs/ARCHITECTURE.md ("Division packed format") byte for byte: a
tensor encoded here decodes with `freqact.kernels.reference` and vice versa. Given the same uniforms
(`noise`) the bytes equal the reference's; with their own random numbers (Philox, counter based) the
two agree in distribution.

Every map is handled as a 3D map (D, H, W): 1D and 2D maps get leading spatial dims of size 1 (block
1 in those dims), so one kernel serves rank 2 to 5 inputs. Inputs are read through their strides
(non-contiguous and channels_last tensors need no copy). fp16 / bf16 / fp64 inputs are computed in
fp32, like the reference (`x.float()`); decode writes x's dtype.

Encode: one program per (n, c) map, or per group of MPP small maps (a leading tile axis), so
that a program always handles about _TILE elements (one 7x7 map alone would leave most lanes and
memory parallelism idle). Two loops over the map(s):
  1. Block layout, tiles of (MPP, blocks, elements of a block): block sums -> exact fp32 means
     (edge blocks divide by the count they cover) -> bf16 (nearest even) -> `lfc`; residual
     against the bf16 mean; running min / max of the residual in registers.
  2. Row-major layout, tiles of (MPP, rows, 8 elements): residual again (x re-read, its block mean
     gathered from the `lfc` just written), stochastic rounding, clamp, packing `8 // Q` codes per
     byte, one store of whole bytes.
  Why two loops: the first code cannot be written before the min of the whole map is known, and
  the block means need a blocked layout while the packing needs the row-major one. Both loops run
  in the same program right after each other, so the second read of x hits L1/L2 (a 56x56 fp32 map
  is 12.5 KiB): DRAM traffic stays one read of x plus the packed write. A separate stats kernel
  followed by a codes kernel would read x from DRAM twice for large tensors.
Decode: one pass, a program per (group of maps, tile of the map): unpack, dequantise, add the
  block mean, store in the output dtype.
Map sizes and block geometry are compile-time constants: every index division is by a constant
(a multiply-shift, where a runtime divisor costs ~20 instructions per element and would make the
kernels compute bound). A network has a handful of map shapes, each compiled once (and cached
on disk by Triton); inputs whose sizes change every call would recompile every call.

Bit-exactness with the torch reference rests on: the same fp32 operations in the same order
(true IEEE division `div_rn`; no FMA contraction, launches pass `enable_fp_fusion=False`), the
bf16 roundings done on the fp32 bit patterns (nearest-even for means and decoded bf16 outputs,
down for `lo`, up for `step`), and identical uniforms. Block sums are the one place where the
summation order differs from torch's (a tree here, torch's own order there): the fp32 mean can
differ in its last bit, which changes the bf16 mean only when it lies within that bit of a bf16
rounding boundary (rare: 16 more bits of fp32 mantissa). Sums that are exact in fp32 (e.g. values
on a coarse dyadic grid) always give identical bytes; the tests rely on that.

Random numbers: `tl.philox(seed, f // 4, map, 0, 0)` gives four 32-bit words per call, one for each
of four consecutive elements of a map (philox costs ~10 integer rounds, a call per element would
make the encode compute bound); u = (word >> 8) * 2**-24, uniform on [0, 1) with fp32's 24 bits.
The seed is a kernel argument that is not specialised on, so a fresh seed per call recompiles
nothing.

Not measured yet: no GPU was available while these kernels were written; they were verified in
Triton's interpreter only. benchmarks/gpu_bench.py checks them on the device first.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from freqact.kernels.format import FLT_MAX, SUM_SCALE, Geometry, as_maps

__all__ = ["decode", "encode"]

# Tile sizes: a program handles about _TILE elements at a time (encode loops over its maps in such
# tiles, decode gives each program one). Powers of two, as Triton's block shapes must be.
_TILE = 1024
_ROWS = _TILE // 8
_FLT_MAX: tl.constexpr = tl.constexpr(FLT_MAX)
_SUM_SCALE: tl.constexpr = tl.constexpr(SUM_SCALE)
_SUM_UNSCALE: tl.constexpr = tl.constexpr(1.0 / SUM_SCALE)


@triton.jit
def _bf16_bits_nearest(v):
    """fp32 -> bf16 bit pattern (in the low 16 bits of an int32), round to nearest even.

    NaN gives the canonical quiet NaN 0x7FC0 like torch's conversion.
    """
    b = v.to(tl.uint32, bitcast=True)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int32)
    # A finite v that reached the infinity pattern saturates (format.bf16_nearest).
    rounded = tl.where(((rounded & 0x7FFF) == 0x7F80) & (tl.abs(v) <= _FLT_MAX), rounded - 1,
                       rounded)
    return tl.where(v != v, 0x7FC0, rounded)


@triton.jit
def _bf16_bits_directed(v, UP: tl.constexpr):
    """fp32 -> bf16 bit pattern rounded toward +inf (UP) or -inf; NaN gives 0x7FC0; the
    algorithm of `format.bf16_directed` (a finite v saturates at the largest finite bf16).

    Dropping the low 16 bits rounds toward zero; one more unit in the last place of the magnitude
    is needed when bits were dropped and the value lies on the far side of zero.
    """
    b = v.to(tl.uint32, bitcast=True)
    kept = b >> 16
    lost = (b & 0xFFFF) != 0
    if UP:
        away = lost & (v > 0)
    else:
        away = lost & (v < 0)
    kept = tl.where(away, kept + 1, kept).to(tl.int32)
    kept = tl.where(((kept & 0x7FFF) == 0x7F80) & (tl.abs(v) <= _FLT_MAX), kept - 1, kept)
    return tl.where(v != v, 0x7FC0, kept)


@triton.jit
def _bf16_value(bits):
    """bf16 bit pattern (any integer type, low 16 bits) -> its exact fp32 value."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _saturated_residual(xv, mean):
    """xv - mean; a residual that overflowed for a finite xv saturates (the edge rule)."""
    r = xv - mean
    over = (tl.abs(r) > _FLT_MAX) & (tl.abs(xv) <= _FLT_MAX) & (r == r)
    return tl.where(over, tl.where(r > 0, _FLT_MAX, -_FLT_MAX), r)


@triton.jit
def _block_mean(xv, count):
    """Means (MPP, NBT) of the blocks of xv (MPP, NBT, BE; zeros past the data): a sum that
    overflowed in a finite block is redone on values scaled by 2**-64 (format.block_means)."""
    sums = tl.sum(xv, axis=2)
    finite = tl.sum((tl.abs(xv) > _FLT_MAX) | (xv != xv), axis=2) == 0
    scaled = tl.div_rn(tl.sum(xv * _SUM_SCALE, axis=2), count) * _SUM_UNSCALE
    return tl.where((tl.abs(sums) <= _FLT_MAX) | ~finite, tl.div_rn(sums, count), scaled)


@triton.jit
def _row_major_coords(f, H, W):
    """Map-local row-major element index -> (d, h, w)."""
    w = f % W
    h = (f // W) % H
    d = f // (W * H)
    return d, h, w


@triton.jit
def _block_index(d, h, w, nbh, nbw, BD: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr):
    """Index of the block holding (d, h, w) in the row-major (nbd, nbh, nbw) grid of blocks."""
    return ((d // BD) * nbh + h // BH) * nbw + w // BW


@triton.jit(do_not_specialize=["seed"])
def _encode_kernel(
    x_ptr, noise_ptr, lfc_ptr, lo_ptr, step_ptr, codes_ptr, M, C, seed,
    sxn, sxc, sxd, sxh, sxw,
    sun, suc, sud, suh, suw,
    D: tl.constexpr, H: tl.constexpr, W: tl.constexpr,
    nbd: tl.constexpr, nbh: tl.constexpr, nbw: tl.constexpr, nbytes: tl.constexpr,
    BD: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, BE: tl.constexpr, NBT: tl.constexpr,
    MPP: tl.constexpr, Q: tl.constexpr, ROWS: tl.constexpr, HAS_NOISE: tl.constexpr,
):
    # MPP maps per program; tiles carry a leading map axis of size MPP.
    mm = tl.program_id(0) * MPP + tl.arange(0, MPP)
    has_map = mm < M
    n = (mm // C).to(tl.int64)
    c = (mm % C).to(tl.int64)
    x_map = (n * sxn + c * sxc)[:, None, None]  # (MPP, 1, 1)
    nblk: tl.constexpr = nbd * nbh * nbw
    lfc_map = (mm.to(tl.int64) * nblk)[:, None]  # (MPP, 1)

    # Pass 1, block layout (MPP, NBT blocks, BE elements): means -> lfc, residual min / max.
    e = tl.arange(0, BE)[None, None, :]
    ed = e // (BH * BW)
    eh = (e // BW) % BH
    ew = e % BW
    in_block = e < BD * BH * BW
    r_min = tl.full([MPP, NBT, BE], float("inf"), tl.float32)
    r_max = tl.full([MPP, NBT, BE], float("-inf"), tl.float32)
    bad = tl.zeros([MPP, NBT, BE], tl.int32)
    for b0 in range(0, nblk, NBT):
        blk = b0 + tl.arange(0, NBT)[None, :]  # (1, NBT)
        bd = blk // (nbh * nbw)
        bh = (blk // nbw) % nbh
        bw = blk % nbw
        d = (bd * BD)[:, :, None] + ed
        h = (bh * BH)[:, :, None] + eh
        w = (bw * BW)[:, :, None] + ew
        blk_live = has_map[:, None] & (blk < nblk)  # (MPP, NBT)
        live = blk_live[:, :, None] & in_block & (d < D) & (h < H) & (w < W)
        xv = tl.load(x_ptr + x_map + d * sxd + h * sxh + w * sxw, mask=live,
                     other=0.0).to(tl.float32)
        # Edge blocks average only the elements they cover; lanes past the last block get 1 to
        # keep the division finite.
        count = (tl.minimum(D - bd * BD, BD) * tl.minimum(H - bh * BH, BH)
                 * tl.minimum(W - bw * BW, BW))
        count = tl.maximum(count, 1)
        mean_bits = _bf16_bits_nearest(_block_mean(xv, count.to(tl.float32)))
        tl.store(lfc_ptr + lfc_map + blk, mean_bits.to(tl.int16), mask=blk_live)
        r = _saturated_residual(xv, _bf16_value(mean_bits)[:, :, None])
        r_min = tl.where(live, tl.minimum(r_min, r), r_min)
        r_max = tl.where(live, tl.maximum(r_max, r), r_max)
        # NaN in x, or Inf (whose block mean makes its residual NaN), poisons the whole map.
        bad = tl.where(live & (r != r), 1, bad)

    # A zero min or max is +0 (-0 + 0 = +0), whatever the reduction order (the format's rule).
    lo_bits = _bf16_bits_directed(tl.min(tl.min(r_min, axis=2), axis=1) + 0.0, UP=False)  # (MPP,)
    hi = tl.max(tl.max(r_max, axis=2), axis=1) + 0.0
    lo_f = _bf16_value(lo_bits)
    qmax = (2**Q - 1) * 1.0
    span = hi - lo_f
    # A span that overflows float32 in a finite map: max / qmax - lo / qmax (the edge rule).
    over = (tl.abs(span) > _FLT_MAX) & (tl.abs(hi) <= _FLT_MAX) & (tl.abs(lo_f) <= _FLT_MAX)
    step_bits = _bf16_bits_directed(
        tl.where(over, tl.div_rn(hi, qmax) - tl.div_rn(lo_f, qmax), tl.div_rn(span, qmax)),
        UP=True)
    is_bad = tl.max(tl.max(bad, axis=2), axis=1) > 0
    lo_bits = tl.where(is_bad, 0x7FC0, lo_bits)
    step_bits = tl.where(is_bad, 0x7FC0, step_bits)
    tl.store(lo_ptr + mm, lo_bits.to(tl.int16), mask=has_map)
    tl.store(step_ptr + mm, step_bits.to(tl.int16), mask=has_map)
    lo = _bf16_value(lo_bits)[:, None, None]
    step = _bf16_value(step_bits)[:, None, None]
    # step == 0 (constant residual): codes 0 and no division; NaN maps also get codes 0.
    has_step = step > 0
    divisor = tl.where(has_step, step, 1.0)
    # Pass 2 gathers means that other threads of this program stored in pass 1.
    tl.debug_barrier()

    # Pass 2, row-major layout (MPP, ROWS, 8): codes, packed K = 8 // Q per byte.
    K: tl.constexpr = 8 // Q
    P: tl.constexpr = D * H * W
    row = tl.arange(0, ROWS)[None, :, None]
    col = tl.arange(0, 8)[None, None, :]
    if HAS_NOISE:
        u_map = (n * sun + c * suc)[:, None, None]
    codes_map = (mm.to(tl.int64) * nbytes)[:, None, None]
    for f0 in range(0, P, 8 * ROWS):
        f = f0 + row * 8 + col  # (1, ROWS, 8)
        live = has_map[:, None, None] & (f < P)
        d, h, w = _row_major_coords(f, H, W)
        xv = tl.load(x_ptr + x_map + d * sxd + h * sxh + w * sxw, mask=live,
                     other=0.0).to(tl.float32)
        mean_bits = tl.load(lfc_ptr + lfc_map[:, :, None]
                            + _block_index(d, h, w, nbh, nbw, BD, BH, BW), mask=live, other=0)
        r = _saturated_residual(xv, _bf16_value(mean_bits))
        if HAS_NOISE:
            u = tl.load(noise_ptr + u_map + d * sud + h * suh + w * suw, mask=live, other=0.0)
        else:
            # One philox call per 4 consecutive elements: counters (f // 4, map).
            ctr = f0 // 4 + tl.arange(0, ROWS)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
            ctr = tl.broadcast_to(ctr, (MPP, ROWS, 2)).to(tl.uint32)
            key = tl.broadcast_to(mm[:, None, None], (MPP, ROWS, 2)).to(tl.uint32)
            w0, w1, w2, w3 = tl.philox(seed, ctr, key, 0 * ctr, 0 * ctr)
            # join stacks on a new last axis, so this nesting puts w0..w3 on elements 0..3.
            words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (MPP, ROWS, 8))
            u = (words >> 8).to(tl.float32) * (1.0 / 16777216.0)
        t = tl.div_rn(r - lo, divisor) + u
        q = tl.minimum(tl.maximum(tl.floor(t), 0.0), 2**Q - 1.0)
        q = tl.where(live & has_step, q, 0.0).to(tl.int32)
        shifted = q << ((col % K) * Q)
        packed = tl.sum(tl.reshape(shifted, (MPP, ROWS, 8 // K, K)), axis=3)
        byte = f0 // K + row * (8 // K) + tl.arange(0, 8 // K)[None, None, :]
        tl.store(codes_ptr + codes_map + byte, packed.to(tl.uint8),
                 mask=has_map[:, None, None] & (byte < nbytes))


@triton.jit
def _decode_kernel(
    lfc_ptr, lo_ptr, step_ptr, codes_ptr, out_ptr, M,
    H: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
    nbd: tl.constexpr, nbh: tl.constexpr, nbw: tl.constexpr, nbytes: tl.constexpr,
    BD: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,
    MPP: tl.constexpr, Q: tl.constexpr, ROWS: tl.constexpr, OUT_BF16: tl.constexpr,
    OUT_MAX: tl.constexpr,
):
    mm = tl.program_id(0) * MPP + tl.arange(0, MPP)
    has_map = (mm < M)[:, None, None]
    mm = mm.to(tl.int64)[:, None, None]  # (MPP, 1, 1)
    f0 = tl.program_id(1) * ROWS * 8
    K: tl.constexpr = 8 // Q
    row = tl.arange(0, ROWS)[None, :, None]
    byte = f0 // K + row * (8 // K) + tl.arange(0, 8 // K)[None, None, :]
    raw = tl.load(codes_ptr + mm * nbytes + byte, mask=has_map & (byte < nbytes), other=0)
    shift = tl.arange(0, K)[None, None, None, :] * Q
    q = (raw.to(tl.int32)[:, :, :, None] >> shift) & (2**Q - 1)
    q = tl.reshape(q, (MPP, ROWS, 8)).to(tl.float32)

    f = f0 + row * 8 + tl.arange(0, 8)[None, None, :]
    live = has_map & (f < P)
    d, h, w = _row_major_coords(f, H, W)
    mean_bits = tl.load(lfc_ptr + mm * (nbd * nbh * nbw)
                        + _block_index(d, h, w, nbh, nbw, BD, BH, BW), mask=live, other=0)
    lo = _bf16_value(tl.load(lo_ptr + mm, mask=has_map, other=0))
    step = _bf16_value(tl.load(step_ptr + mm, mask=has_map, other=0))
    # Same order as the reference: (mean + lo) + step * q. Edge rule: an overflowed sum is
    # redone at quarter scale, times 4 and saturated; then finite values saturate at OUT_MAX.
    mean = _bf16_value(mean_bits)
    v = (mean + lo) + step * q
    quarter = (mean * 0.25 + lo * 0.25) + (step * 0.25) * q
    redo = ~(tl.abs(v) <= _FLT_MAX) & (tl.abs(quarter) <= _FLT_MAX)  # NaN: inf - inf
    v = tl.where(redo, tl.minimum(tl.maximum(quarter * 4.0, -_FLT_MAX), _FLT_MAX), v)
    v = tl.where((tl.abs(v) > OUT_MAX) & (tl.abs(v) <= _FLT_MAX),
                 tl.where(v > 0, OUT_MAX, -OUT_MAX), v)
    out = out_ptr + mm * P + f
    if OUT_BF16:
        tl.store(out, _bf16_bits_nearest(v).to(tl.int16), mask=live)
    else:
        tl.store(out, v.to(out_ptr.dtype.element_ty), mask=live)


def _as_maps5(t: torch.Tensor) -> torch.Tensor:
    """View t as (N, C, D, H, W) without copying: the map layout (`format.as_maps`), then
    size-1 leading spatial dims for 1D and 2D maps."""
    t = as_maps(t)
    while t.dim() < 5:
        t = t.unsqueeze(2)
    return t


def _rows(per_map: int) -> int:
    """Rows of 8 elements per row-major tile: the whole map when it is small, else _ROWS."""
    return min(_ROWS, triton.next_power_of_2(-(-per_map // 8)))


def _maps_per_program(tile: int, maps: int) -> int:
    """Maps per program: small maps are grouped until a program's tile holds ~_TILE elements
    (one 7x7 map alone would leave most lanes and memory parallelism idle)."""
    return min(max(1, _TILE // tile), triton.next_power_of_2(maps))


def _warps(tile: int) -> int:
    return 4 if tile >= _TILE else 2


def _on_device(t: torch.Tensor):
    """Make t's GPU the current one while launching (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def encode(x: torch.Tensor, geom: Geometry, bits: int, noise: torch.Tensor | None,
           seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode x with the fused kernel (the full form: geom.block is set); `reference.encode`'s
    signature.

    Args:
        x: activations, shape (N, F), (N, C, L), (N, C, H, W) or (N, C, D, H, W), floating point,
            any strides, on CUDA (or CPU under TRITON_INTERPRET=1), at least one map.
        geom: `format.geometry(x.shape, block)`.
        bits: Q in {1, 2, 4, 8}.
        noise: None, or float32 uniforms shaped like x, used instead of the Philox stream.
        seed: Philox key (ignored when `noise` is given).

    Returns:
        (lfc, lo, step, codes): lfc bf16 (N, C, *nb); lo, step bf16 (N, C); codes uint8
        (N, C, ceil(P * Q / 8)), shapes of the map layout (C = 1 for rank 2).
    """
    lfc = torch.empty(geom.lfc_shape, dtype=torch.bfloat16, device=x.device)
    lo = torch.empty(geom.stat_shape, dtype=torch.bfloat16, device=x.device)
    step = torch.empty(geom.stat_shape, dtype=torch.bfloat16, device=x.device)
    codes = torch.empty(geom.codes_shape(bits), dtype=torch.uint8, device=x.device)
    x5 = _as_maps5(x)
    u5 = _as_maps5(noise) if noise is not None else x5
    (D, H, W), (BD, BH, BW), (nbd, nbh, nbw) = geom.dhw, geom.block_dhw, geom.counts_dhw
    maps = geom.maps
    be = triton.next_power_of_2(BD * BH * BW)
    nbt = min(max(1, _TILE // be), triton.next_power_of_2(geom.nblocks))
    rows = _rows(geom.numel)
    mpp = _maps_per_program(max(nbt * be, rows * 8), maps)
    with _on_device(x):
        _encode_kernel[(triton.cdiv(maps, mpp),)](
            x5, u5, lfc.view(torch.int16), lo.view(torch.int16), step.view(torch.int16), codes,
            maps, geom.c, seed, *x5.stride(), *u5.stride(),
            D=D, H=H, W=W, nbd=nbd, nbh=nbh, nbw=nbw, nbytes=codes.shape[-1],
            BD=BD, BH=BH, BW=BW, BE=be, NBT=nbt, MPP=mpp, Q=bits, ROWS=rows,
            HAS_NOISE=noise is not None, num_warps=_warps(mpp * max(nbt * be, rows * 8)),
            enable_fp_fusion=False,
        )
    return lfc, lo, step, codes


def decode(lfc: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor,
           geom: Geometry, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode a full packed form (from any backend) with the fused kernel; `reference.decode`'s
    signature.

    Returns:
        Contiguous maps (N, C, *S) of dtype on lfc's device.
    """
    out = torch.empty([geom.n, geom.c, *geom.spatial], dtype=dtype, device=lfc.device)
    lfc, lo, step, codes = (t.contiguous() for t in (lfc, lo, step, codes))
    (_, H, W), (BD, BH, BW), (nbd, nbh, nbw) = geom.dhw, geom.block_dhw, geom.counts_dhw
    per_map = geom.numel
    rows = _rows(per_map)
    mpp = _maps_per_program(rows * 8, geom.maps)
    out_bf16 = dtype == torch.bfloat16
    with _on_device(out):
        _decode_kernel[(triton.cdiv(geom.maps, mpp), triton.cdiv(per_map, rows * 8))](
            lfc.view(torch.int16), lo.view(torch.int16), step.view(torch.int16), codes,
            out.view(torch.int16) if out_bf16 else out, geom.maps,
            H=H, W=W, P=per_map, nbd=nbd, nbh=nbh, nbw=nbw, nbytes=codes.shape[-1],
            BD=BD, BH=BH, BW=BW, MPP=mpp, Q=bits, ROWS=rows, OUT_BF16=out_bf16,
            OUT_MAX=min(torch.finfo(dtype).max, FLT_MAX),
            num_warps=_warps(mpp * rows * 8), enable_fp_fusion=False,
        )
    return out
