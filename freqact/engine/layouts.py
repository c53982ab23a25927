"""Layouts of token tensors for the codec: which elements share a block mean and a min/step.

A token tensor is read as a view (M, T, F): M sequences (samples, or samples x heads) of T tokens
with F features; a channels-last token grid as (N, H, W, C). A layout is named
`<blocks>/<stats>` (measured in docs/ARCHITECTURE.md, "Layouts for token tensors"):

- blocks (whose elements share one bf16 block mean, B = 8):
  `feat` 8 features of one token (8 elements); `tile` 8 tokens x 8 features (64); `tok64` 64
  consecutive tokens of one feature (64); `grid64` B x B patches of the token grid per feature
  (64: the CNN map rule on the channel-first view (N, C, H, W)). A grid is (H, W) for a
  (N, H, W, C) view, (g, g) for T = g * g tokens; with T = 1 + g * g the first (class) token is
  kept apart as a map of its own (`division` on (M, 1, F)); other T fall back to `tile`.
- stats (whose residuals share one min/step): `tok` one per token row (M, T, F), `chan` one per
  feature column (M, F, T).

`feat/tok` is the codec's own map rule on the (M, T, F) view. Every layout is specified as two
kernels of the DIVISION format: `lfc_encode` on the block view and `quantize_encode` on the
residual in the stats view, so every byte is the reference's on those views (`grid64/chan` equals
`division_encode` on (N, C, H, W); `tok64/chan` equals it on (M, F, T) with B = 64; tested).
That torch path runs off the CPU backend; on it the fused C kernels (`kernels.cpu.token_encode` /
`token_decode`) give the same bytes in one pass per sequence, reading x through its strides.
Only the full `division` codec has them; other codecs get the `feat/tok` view.

`token_view` computes the view of a saved tensor from its logical shape.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from freqact import kernels
from freqact.codecs.base import Codec
from freqact.codecs.division import Division
from freqact.kernels import cpu
from freqact.kernels.format import (
    FLT_MAX,
    DivisionPacked,
    LfcPacked,
    QuantPacked,
    geometry,
    saturating_cast,
)

__all__ = ["BLOCKS", "GROUP_TOKENS", "STATS", "LayoutPacked", "TokenLayout", "packed_nbytes",
           "token_view"]

BLOCKS = ("feat", "tile", "tok64", "grid64")
GROUP_TOKENS = 64
"""Token sequences shorter than this (Swin's windows) are read several at a time (`token_view`),
by the eager routes and the compiled graph rule alike."""
STATS = ("tok", "chan")


def token_view(shape: tuple[int, ...], heads: bool, grid: bool = False, group: int = 1
               ) -> tuple[int, ...] | None:
    """The token view of a tensor of logical `shape`, or None for rank < 3.

    Args:
        shape: the logical shape: (N, T, F), (N, H, W, C) grids, (N, heads, T, d) attention.
        heads: True for attention tensors: every dim before the last two is a sequence
            (M = N * heads); False for token grids: the middle dims are the tokens (T = H * W).
        grid: keep a rank-4 token grid of at least `group` tokens as (N, H, W, C) (the
            `grid64` blocks read its 2D layout).
        group: token grids and sequences shorter than this (Swin's 4 x 4 windows (N * nW, 16,
            C)) are read k = ceil(group / T) consecutive sequences at a time, (M / k, k * T, F),
            when k divides M: per-column statistics then cover k * T >= group tokens.

    Returns:
        (M, T, F), or (N, H, W, C) for a rank-4 grid when `grid`.
    """
    if len(shape) < 3:
        return None
    if heads:
        return math.prod(shape[:-2]), shape[-2], shape[-1]
    m, t, f = shape[0], math.prod(shape[1:-1]), shape[-1]
    if grid and len(shape) == 4 and t >= group:
        return tuple(shape)
    k = -(-group // t)
    return (m // k, k * t, f) if k > 1 and m % k == 0 else (m, t, f)


def _grid_of(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(head tokens, H, W) of a view for the `grid64` blocks, None when it has no grid."""
    if len(shape) == 4:
        return 0, shape[1], shape[2]
    t = shape[1]
    for head in (0, 1):
        g = math.isqrt(t - head)
        if g > 1 and g * g == t - head:
            return head, g, g
    return None


def _plan(blocks: str, shape: tuple[int, ...]) -> tuple[str, int, tuple[int, int] | None]:
    """(blocks used, head tokens, grid (H, W) or None) for `blocks` on a view of `shape`:
    `grid64` without a grid falls back to `tile`."""
    if blocks != "grid64":
        return blocks, 0, None
    found = _grid_of(shape)
    if found is None:
        return "tile", 0, None
    return "grid64", found[0], found[1:]


@dataclass(frozen=True)
class LayoutPacked:
    """A token tensor packed in a `TokenLayout`.

    Attributes:
        lfc: block means of the block view of the body (the tokens after the head).
        quant: the body's residual x - upsample(lfc) in the stats view ((M, T, F) or (M, F, T)).
        head: the class token (M, 1, F) as its own `division` map, or None.
        shape, dtype: the encoded view's shape and dtype.
    """

    lfc: LfcPacked
    quant: QuantPacked
    head: DivisionPacked | None
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.lfc.nbytes + self.quant.nbytes + (self.head.nbytes if self.head else 0)


class TokenLayout(Codec):
    """`division` in a `<blocks>/<stats>` layout on (M, T, F) or (N, H, W, C) views.

    Decode: upsample(lfc) + the decoded residual, both in float32, cast once to x's dtype.
    Unbiased like `division`; a NaN/Inf decodes its block and its stats row/column to NaN.

    Args:
        division: the codec whose block, bits and backend the layout uses.
        blocks: one of BLOCKS; stats: one of STATS.
    """

    whole_model = False

    def __init__(self, division: Division, blocks: str = "feat", stats: str = "chan") -> None:
        if blocks not in BLOCKS:
            raise ValueError(f"blocks: expected one of {BLOCKS}, got {blocks!r}")
        if stats not in STATS:
            raise ValueError(f"stats: expected one of {STATS}, got {stats!r}")
        self.division, self.blocks, self.stats = division, blocks, stats
        self.name = division.name
        self.layout = f"{blocks}/{stats}"

    def _plan(self, shape: tuple[int, ...]) -> tuple[str, int, tuple[int, int] | None]:
        """(blocks used, head tokens, grid (H, W) or None) for a view of `shape`."""
        return _plan(self.blocks, shape)

    def _block_view(self, x: torch.Tensor, blocks: str, grid) -> tuple[torch.Tensor, int]:
        """x (M, T, F) as the maps its blocks run on, and the block size there."""
        b = self.division.block
        if blocks == "tile":
            return x.unsqueeze(1), b
        if blocks == "tok64":
            return x.transpose(1, 2), b * b
        if blocks == "grid64":
            return x.unflatten(1, grid).permute(0, 3, 1, 2), b
        return x, b

    def _from_block_view(self, w: torch.Tensor, blocks: str) -> torch.Tensor:
        """Inverse of `_block_view`: back to (M, T, F)."""
        if blocks == "tile":
            return w.squeeze(1)
        if blocks == "tok64":
            return w.transpose(1, 2)
        if blocks == "grid64":
            return w.permute(0, 2, 3, 1).flatten(1, 2)
        return w

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the fused C kernels encode/decode tensors like x (the CPU backend chosen)."""
        return x.numel() > 0 and kernels.backend_for(x, self.division._kernels) == "cpu"

    def _geometry(self, shape: tuple[int, ...]) -> _Plan:
        """The fused kernels' plan (geometry, head tokens, block view) for a view of `shape`."""
        return _fused_geometry(self.blocks, self.stats, self.division.block, tuple(shape))

    @staticmethod
    def _panel(x: torch.Tensor, head: int, geom: cpu.TokenGeometry) -> torch.Tensor:
        """The body of x as the float32 panel the fused kernels read: (M, H, W, F), or (N, heads,
        1, T, d) for attention's (N, heads, T, d) read as M = N * heads sequences (the kernel
        reads those through two strides, so a view of the qkv projection is not copied). Any
        strides: a view of a float32 x, except a (N, H, W, C) grid read as a sequence that
        cannot be."""
        body = x[:, head:] if head else x
        if body.dtype != torch.float32:
            body = body.float()
        if body.shape == geom.panel:
            return body
        m, h = geom.panel[:2]
        if (body.dim() == 4 and body.shape[0] * body.shape[1] == m and h == 1
                and body.shape[2:] == geom.panel[2:]):
            return body.unsqueeze(2)
        return body.reshape(geom.panel)

    def encode(self, x: torch.Tensor, noise: torch.Tensor | None = None,
               seed: int | None = None, view: tuple[int, ...] | None = None) -> LayoutPacked:
        """Args: x (M, T, F) or (N, H, W, C) floating; noise: optional uniforms shaped like the
        body's stats view ((M, T', F) for `tok`, (M, F, T') for `chan`, T' the body's tokens);
        seed: None draws the noise from torch's default generators; an integer in [0, 2**63)
        draws it from private generators seeded with it, torch's own left untouched (the
        compiled graphs' per-step seed, `graph_ops.layout_encode`). On the fused CPU path that
        gives the bytes `torch.manual_seed(seed)` before a seedless call gives;
        view: None, or the shape to encode x as, the bytes of `encode(x.reshape(view))`
        (attention's (N, heads, T, d) as (N * heads, T, d): the fused kernels read it in
        place, where the reshape would copy a view of a qkv projection)."""
        shape = x.shape if view is None else torch.Size(view)
        if shape.numel() != x.numel() or (view is not None and (
                len(shape) not in (3, 4) or min(shape) < 1)):
            raise ValueError(f"view: expected a (M, T, F) or (N, H, W, C) shape of x's "
                             f"{x.numel()} elements, sizes >= 1, got {tuple(shape)}")
        cpu_gen, device_gen = _generators(seed, x.device)
        if not self._fused(x):
            return self._encode_torch(x.reshape(shape), noise, device_gen)
        d = self.division
        plan = self._geometry(shape)
        geom, head = plan.geom, plan.head
        _check_noise(noise, geom.quant_shape)
        if head and x.shape != shape:
            x = x.reshape(shape)
        head_packed = (kernels.division_encode(x[:, :head], d.block, d.bits,
                                               seed=kernels._seed(None, cpu_gen),
                                               backend=d._kernels) if head else None)
        lfc, lo, step, codes = cpu.token_encode(self._panel(x, head, geom), geom, d.bits, noise,
                                                kernels._seed(noise, cpu_gen))
        quant = QuantPacked(lo, step, codes, plan.quant_shape, torch.float32, d.bits)
        return LayoutPacked(LfcPacked(lfc, plan.view, torch.float32, plan.block), quant,
                            head_packed, shape, x.dtype)

    def _encode_torch(self, x: torch.Tensor, noise: torch.Tensor | None,
                      generator: torch.Generator | None) -> LayoutPacked:
        """The two kernels of the format on their views (the specification of the fused path);
        with a generator, the uniforms are drawn from it."""
        blocks, head, grid = self._plan(tuple(x.shape))
        d = self.division
        body = x.flatten(1, 2) if x.dim() == 4 else x
        head_packed = (kernels.division_encode(body[:, :head], d.block, d.bits,
                                               _uniforms(body[:, :head].shape, generator, x),
                                               backend=d._kernels) if head else None)
        body = body[:, head:].float()
        w, block = self._block_view(body, blocks, grid)
        lfc = kernels.lfc_encode(w, block)
        h = body - self._from_block_view(kernels.division_decode(lfc), blocks)
        # The format's edge rule: a finite x's residual saturates (unconditionally: asking whether
        # any value overflowed would sync a CUDA device on every save).
        h = torch.where(body.isfinite(), h.clamp(-FLT_MAX, FLT_MAX), h)
        h = (h.transpose(1, 2) if self.stats == "chan" else h).contiguous()
        if noise is None:
            noise = _uniforms(h.shape, generator, x)
        quant = kernels.quantize_encode(h, d.bits, noise, backend=d._kernels)
        return LayoutPacked(LfcPacked(lfc.lfc, lfc.shape, torch.float32, lfc.block), quant,
                            head_packed, x.shape, x.dtype)

    def decode(self, packed: LayoutPacked) -> torch.Tensor:
        """Returns: a tensor of the encoded view's shape and dtype, contiguous."""
        if not self._fused(packed.quant.codes):
            return self._decode_torch(packed)
        plan = self._geometry(packed.shape)
        geom, head = plan.geom, plan.head
        lfc, quant = packed.lfc, packed.quant  # their tensors: checked by cpu.token_decode
        m, f = packed.shape[0], packed.shape[-1]
        if (not isinstance(lfc, LfcPacked) or not isinstance(quant, QuantPacked)
                or lfc.shape != plan.view or lfc.block != plan.block
                or quant.shape != geom.quant_shape
                or (head > 0) != (packed.head is not None)
                or not isinstance(packed.dtype, torch.dtype) or not packed.dtype.is_floating_point
                or (head and (not isinstance(packed.head, DivisionPacked)
                              or tuple(packed.head.shape) != (m, head, f)))):
            raise ValueError(f"packed: parts of shapes {tuple(lfc.shape)}, {tuple(quant.shape)} "
                             f"do not make a {self.layout} form of shape {tuple(packed.shape)}")
        out = torch.empty(m, head + geom.panel[1] * geom.panel[2], f)
        if head:
            out[:, :head] = kernels.division_decode(packed.head, backend=self.division._kernels)
        cpu.token_decode(lfc.lfc, quant.lo, quant.step, quant.codes, geom, quant.bits,
                         out[:, head:] if head else out)
        out = saturating_cast(out, packed.dtype)
        return out if out.shape == packed.shape else out.reshape(packed.shape)

    def _decode_torch(self, packed: LayoutPacked) -> torch.Tensor:
        blocks, _, _ = self._plan(tuple(packed.shape))
        base = self._from_block_view(kernels.division_decode(packed.lfc), blocks)
        h = kernels.division_decode(packed.quant, backend=self.division._kernels)
        body = base + (h.transpose(1, 2) if self.stats == "chan" else h)
        out = saturating_cast(body, packed.dtype)
        if packed.head is not None:
            out = torch.cat([kernels.division_decode(packed.head, backend=self.division._kernels),
                             out], dim=1)
        return out.reshape(packed.shape).contiguous()

    def nbytes_for(self, shape: tuple[int, ...]) -> int:
        """Bytes of the packed form of a view of `shape`, before encoding."""
        d = self.division
        return _layout_nbytes(self.blocks, self.stats, d.block, d.bits, tuple(shape))


class _Plan(NamedTuple):
    """What the fused kernels need for a view of one shape (`_fused_geometry`, cached).

    Attributes:
        geom: the body's geometry; head: the tokens kept apart as a `division` map (0 or 1);
        view: the block view's shape (the lfc's); block: its block size;
        quant_shape: the stats view's shape (the quant part's).
    """

    geom: cpu.TokenGeometry
    head: int
    view: torch.Size
    block: int
    quant_shape: torch.Size


@functools.lru_cache(maxsize=1024)  # a few shapes per model, asked at every pack and unpack
def _fused_geometry(blocks: str, stats: str, b: int, shape: tuple[int, ...]) -> _Plan:
    """`TokenLayout._geometry` for a layout `blocks/stats` with block size b."""
    blocks, head, grid = _plan(blocks, shape)
    m, f = shape[0], shape[-1]
    t = math.prod(shape[1:-1]) - head
    if blocks == "grid64":
        (h, w), view = grid, (m, f, *grid)
    else:
        (h, w), view = (1, t), {"feat": (m, t, f), "tile": (m, 1, t, f),
                                "tok64": (m, f, t)}[blocks]
    block = b * b if blocks == "tok64" else b
    lfc = geometry(view, block)
    sizes, counts = lfc.sizes, lfc.counts
    # (bh, bw, bf) tokens x features per mean, and where block (i, j, k) of a sequence is
    # stored in the block view's lfc
    if blocks == "feat":
        extents, strides = (1, 1, sizes[0]), (0, counts[0], 1)
    elif blocks == "tile":
        extents, strides = (1, *sizes), (0, counts[1], 1)
    elif blocks == "tok64":
        extents, strides = (1, sizes[0], 1), (0, 1, counts[0])
    else:
        extents, strides = (*sizes, 1), (counts[1], 1, lfc.nblocks)
    geom = cpu.TokenGeometry((m, h, w, f), extents, tuple(lfc.lfc_shape), strides,
                             stats == "chan")
    return _Plan(geom, head, torch.Size(view), block, torch.Size(geom.quant_shape))


def _generators(seed: int | None, device: torch.device
                ) -> tuple[torch.Generator | None, torch.Generator | None]:
    """(CPU generator, generator of device) seeded with seed (one generator on the CPU; the
    fused kernels' seeds are drawn on the CPU, as `kernels._seed` draws them), or (None, None)
    for torch's default generators. A fresh generator per call: no state outlives the call, and
    seeding one costs microseconds (`torch.manual_seed` also queues a seeding of every lazily
    initialised device backend, with a stack trace each: ~0.4 ms per call)."""
    if seed is None:
        return None, None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed: expected None or an integer in [0, 2**63), got {seed!r}")
    cpu_gen = torch.Generator().manual_seed(seed)
    if device.type == "cpu":
        return cpu_gen, cpu_gen
    return cpu_gen, torch.Generator(device).manual_seed(seed)


def _uniforms(shape: torch.Size, generator: torch.Generator | None, like: torch.Tensor
              ) -> torch.Tensor | None:
    """float32 uniforms of shape drawn from generator on like's device, in logical order (as the
    reference draws them), or None without a generator (the kernels then draw their own)."""
    if generator is None:
        return None
    return torch.rand(shape, generator=generator, device=like.device)


def _check_noise(noise: object, shape: tuple[int, ...]) -> None:
    """Refuse noise that is not None or float32 uniforms of the stats view's `shape` on the CPU
    (the fused kernels read that many floats from its data)."""
    if noise is None:
        return
    if (not isinstance(noise, torch.Tensor) or noise.dtype != torch.float32
            or noise.layout != torch.strided or tuple(noise.shape) != shape
            or noise.device.type != "cpu"):
        got = (f"{noise.dtype} {tuple(noise.shape)} on {noise.device}"
               if isinstance(noise, torch.Tensor) else type(noise).__name__)
        raise ValueError(f"noise: expected float32 {shape} on the CPU, got {got}")


def _division_nbytes(block: int, bits: int, shape: tuple[int, ...]) -> int:
    """Bytes of `division` (block, bits) on a tensor of `shape` as saved."""
    geom = geometry(shape, block)
    return geom.maps * (geom.code_bytes(bits) + 2 * geom.nblocks + 4)


@functools.lru_cache(maxsize=1024)  # asked at every pack (the router's size check)
def _layout_nbytes(blocks: str, stats: str, block: int, bits: int, shape: tuple[int, ...]) -> int:
    """`TokenLayout.nbytes_for` of the layout `blocks/stats` with (block, bits)."""
    plan = _fused_geometry(blocks, stats, block, shape)
    geom, head = plan.geom, plan.head
    maps = math.prod(geom.quant_shape[:2])
    n = 2 * math.prod(geom.lfc_shape) + maps * (geom.codes_shape(bits)[2] + 4)
    return n + (_division_nbytes(block, bits, (shape[0], head, shape[-1])) if head else 0)


def packed_nbytes(codec: Codec, shape: tuple[int, ...]) -> int | None:
    """Bytes the packed form of a tensor of `shape` takes under codec, before encoding.

    Known for `division` (as saved and in every `TokenLayout`); None for other codecs.
    """
    if isinstance(codec, TokenLayout):
        return codec.nbytes_for(shape)
    if type(codec) is Division:
        return _division_nbytes(codec.block, codec.bits, shape)
    return None
