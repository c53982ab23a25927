"""A small Swin Transformer (Liu et al. 2021) for 32x32 images: windowed, shifted self-attention.

Patch embedding by a strided convolution (patch 2 -> a 16x16 token grid), then stages of Swin
blocks on channels-last token grids (N, H, W, C), joined by patch merging (2x2 neighbours
concatenated, LayerNorm, Linear 4C -> 2C, halving the grid). Each block attends within
non-overlapping `window` x `window` windows, with a learned relative position bias; every second
block shifts the windows by window // 2 (a cyclic `torch.roll` plus an attention mask), as in the
paper. A stage whose grid is no larger than the window uses one window and no shift (the paper's
rule). Defaults: dims 48-96-192, depths 2-2-2, heads 3-6-12, window 4 (grids 16, 8, 4).

Attention is `F.scaled_dot_product_attention` with the bias (and shift mask) as a float
`attn_mask`. Initialisation as the ViT: Linear and the patch projection `trunc_normal_(std=0.02)`,
zero bias, relative bias table `trunc_normal_(std=0.02)`, LayerNorm 1/0.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freqact import _validate
from freqact.models import check_dropout, check_stages, init_transformer, register


def _windows(x: torch.Tensor, window: int) -> torch.Tensor:
    """(N, H, W, C) -> (N * H/w * W/w, w * w, C): tokens grouped by window, row-major inside."""
    n, h, w, c = x.shape
    x = x.view(n, h // window, window, w // window, window, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window * window, c)


def _unwindows(x: torch.Tensor, window: int, n: int, h: int, w: int) -> torch.Tensor:
    """Inverse of `_windows`: (N * h/w * w/w, w * w, C) -> (N, H, W, C)."""
    x = x.view(n, h // window, w // window, window, window, -1)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(n, h, w, -1)


def _relative_index(window: int) -> torch.Tensor:
    """(w*w, w*w) int64: index into the (2w-1)^2 bias table for each (query, key) pair."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window),
                                        indexing="ij")).flatten(1)  # (2, w*w)
    rel = (coords[:, :, None] - coords[:, None, :]) + (window - 1)  # (2, w*w, w*w), >= 0
    return rel[0] * (2 * window - 1) + rel[1]


def _shift_mask(size: int, window: int, shift: int) -> torch.Tensor:
    """(windows, w*w, w*w) float: -inf between tokens that the cyclic shift made neighbours."""
    region = torch.zeros(1, size, size, 1)
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for label, (rows, cols) in enumerate((r, c) for r in bounds for c in bounds):
        region[:, rows, cols, :] = label
    ids = _windows(region, window).squeeze(-1)  # (windows, w*w)
    same = ids[:, :, None] == ids[:, None, :]
    return torch.zeros(same.shape).masked_fill(~same, float("-inf"))


class WindowAttention(nn.Module):
    """Multi-head self-attention inside windows with a learned relative position bias.

    Maps windows (B, w*w, dim) to (B, w*w, dim); `mask` (windows, w*w, w*w) or None is added to
    the logits (B is a multiple of the window count).
    """

    def __init__(self, dim: int, heads: int, window: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, heads))
        self.register_buffer("bias_index", _relative_index(window), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.bias_table[self.bias_index].permute(2, 0, 1)  # (heads, t, t)
        if mask is not None:  # (windows, t, t) -> (B, heads, t, t), windows fastest within B
            bias = (bias + mask[:, None]).repeat(b // mask.shape[0], 1, 1, 1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class SwinBlock(nn.Module):
    """Pre-norm Swin block on a token grid: x + WindowAttention(LN(x)), x + MLP(LN(x)).

    The MLP is Linear(dim, 4 dim) -> GELU -> Linear(4 dim, dim). Maps (N, size, size, dim) to
    the same shape; `shift` > 0 rolls the grid by -shift before windowing (and back after).
    """

    # How analyses read the output (freqact.analysis.common.to_channels_first): a channels-last grid.
    map_layout = "channels_last"

    def __init__(self, dim: int, heads: int, size: int, window: int, shift: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.window = window
        self.shift = shift
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        mask = _shift_mask(size, window, shift) if shift else None
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, h, w, _ = x.shape
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, (-self.shift, -self.shift), dims=(1, 2))
        y = _unwindows(self.attn(_windows(y, self.window), self.mask), self.window, n, h, w)
        if self.shift:
            y = torch.roll(y, (self.shift, self.shift), dims=(1, 2))
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """2x2 neighbouring tokens concatenated, LayerNorm, Linear 4 dim -> 2 dim.

    Maps (N, H, W, dim) to (N, H/2, W/2, 2 dim).
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]],
                      dim=-1)
        return self.reduction(self.norm(x))


def _check_stages(dim: int, depths: object, heads: object) -> None:
    """Raise unless depths/heads are equal-length tuples of positive ints fitting `dim`."""
    check_stages(depths=depths, heads=heads)
    for i, h in enumerate(heads):
        if (dim << i) % h:
            raise ValueError(f"dim: expected dim * 2**{i} to be a multiple of heads[{i}]={h}, "
                             f"got {dim}")


class Swin(nn.Module):
    """Swin Transformer classifying by the mean token.

    Args:
        num_classes: classifier outputs.
        image_size: side of the square input images.
        patch_size: side of the square patches; image_size / patch_size must be divisible by
            window * 2 ** (stages - 1) or the stage grid must fall to the window size.
        dim: token width of the first stage (doubled by each merging); a multiple of heads[0].
        depths: Swin blocks per stage.
        heads: attention heads per stage (dim * 2**i must be a multiple of heads[i]).
        window: attention window side.
        dropout: dropout probability in attention.
        in_channels: channels of the input images.

    Input (N, in_channels, image_size, image_size) -> logits (N, num_classes).
    """

    def __init__(self, num_classes: int = 10, *, image_size: int = 32, patch_size: int = 2,
                 dim: int = 48, depths: tuple[int, ...] = (2, 2, 2),
                 heads: tuple[int, ...] = (3, 6, 12), window: int = 4, dropout: float = 0.0,
                 in_channels: int = 3) -> None:
        super().__init__()
        for name, value in (("num_classes", num_classes), ("image_size", image_size),
                            ("patch_size", patch_size), ("dim", dim), ("window", window),
                            ("in_channels", in_channels)):
            _validate.positive_int(name, value)
        _check_stages(dim, depths, heads)
        dropout = check_dropout(dropout)
        size = image_size // patch_size
        if image_size % patch_size or size % (2 ** (len(depths) - 1)):
            raise ValueError(f"image_size: expected a multiple of patch_size * 2**(stages-1)="
                             f"{patch_size * 2 ** (len(depths) - 1)}, got {image_size}")
        self.input_shape = (in_channels, image_size, image_size)

        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.embed_norm = nn.LayerNorm(dim)
        layers: list[nn.Module] = []
        for i, (depth, h) in enumerate(zip(depths, heads)):
            if i:
                layers.append(PatchMerging(dim))
                dim, size = 2 * dim, size // 2
            win = min(window, size)
            if size % win:
                raise ValueError(f"window: expected a divisor of the stage-{i} grid {size}, "
                                 f"got {window}")
            for j in range(depth):
                shift = win // 2 if j % 2 and size > window else 0
                layers.append(SwinBlock(dim, h, size, win, shift, dropout))
        self.stages = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        init_transformer(self)
        for m in self.modules():
            if isinstance(m, WindowAttention):
                nn.init.trunc_normal_(m.bias_table, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).permute(0, 2, 3, 1)  # (N, D, h, w) -> channels-last (N, h, w, D)
        x = self.norm(self.stages(self.embed_norm(x)))
        return self.head(x.mean(dim=(1, 2)))  # (N, D) -> (N, num_classes)


@register("swin")
def swin(num_classes: int = 10, *, image_size: int = 32, patch_size: int = 2, dim: int = 48,
         depths: tuple[int, ...] = (2, 2, 2), heads: tuple[int, ...] = (3, 6, 12),
         window: int = 4, dropout: float = 0.0, in_channels: int = 3) -> Swin:
    """Small Swin for 32x32 images: patch 2, dims 48-96-192, depths 2-2-2, window 4."""
    return Swin(num_classes, image_size=image_size, patch_size=patch_size, dim=dim,
                depths=depths, heads=heads, window=window, dropout=dropout,
                in_channels=in_channels)
