"""A small ConvNeXt (Liu et al. 2022) for 32x32 images.

A 2x2 stride-2 "patchify" stem (32x32 -> 16x16) with LayerNorm, then stages of ConvNeXt blocks
joined by downsampling layers (LayerNorm, 2x2 stride-2 convolution). A block is the paper's:
depthwise 7x7 convolution, permute to channels-last (N, H, W, C), LayerNorm, pointwise MLP as
Linear(C, 4C) -> GELU -> Linear(4C, C), a learned per-channel layer scale (init 1e-6), permute
back, residual. LayerNorms over channels of (N, C, H, W) maps permute to channels-last and back,
as the reference's `channels_first` LayerNorm computes the same normalisation. Defaults: dims
48-96-192, depths 2-2-2; global average pooling, LayerNorm, linear head.

Initialisation as the reference: convolutions and Linear layers `trunc_normal_(std=0.02)` with
zero bias, LayerNorm 1/0.
"""
from __future__ import annotations

import torch
from torch import nn

from freqact import _validate
from freqact.models import check_stages, init_transformer, register


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of (N, C, H, W) maps; returns the same shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """x + gamma * MLP(LayerNorm(dwconv7x7(x))) on channels-last tokens.

    Maps (N, dim, H, W) to (N, dim, H, W).
    """

    def __init__(self, dim: int, layer_scale: float = 1e-6) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # (N, C, H, W) -> (N, H, W, C)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """ConvNeXt classifier.

    Args:
        num_classes: classifier outputs.
        dims: channels per stage.
        depths: blocks per stage (same length as dims).
        layer_scale: initial value of each block's per-channel scale.
        in_channels: channels of the input images.

    Input (N, in_channels, 32, 32) -> logits (N, num_classes); other sizes that are multiples
    of 2 ** len(dims) work too.
    """

    def __init__(self, num_classes: int = 10, *, dims: tuple[int, ...] = (48, 96, 192),
                 depths: tuple[int, ...] = (2, 2, 2), layer_scale: float = 1e-6,
                 in_channels: int = 3) -> None:
        super().__init__()
        _validate.positive_int("num_classes", num_classes)
        _validate.positive_int("in_channels", in_channels)
        check_stages(dims=dims, depths=depths)
        self.input_shape = (in_channels, 32, 32)

        layers: list[nn.Module] = [nn.Conv2d(in_channels, dims[0], 2, stride=2),
                                   ChannelsFirstLayerNorm(dims[0])]
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            if i:
                layers += [ChannelsFirstLayerNorm(dims[i - 1]),
                           nn.Conv2d(dims[i - 1], dim, 2, stride=2)]
            layers += [ConvNeXtBlock(dim, layer_scale) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], num_classes)
        init_transformer(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).mean(dim=(2, 3))  # global average pool -> (N, C)
        return self.head(self.norm(x))


@register("convnext")
def convnext(num_classes: int = 10, *, dims: tuple[int, ...] = (48, 96, 192),
             depths: tuple[int, ...] = (2, 2, 2), layer_scale: float = 1e-6,
             in_channels: int = 3) -> ConvNeXt:
    """Small ConvNeXt for 32x32 images: patchify stem 2, dims 48-96-192, depths 2-2-2."""
    return ConvNeXt(num_classes, dims=dims, depths=depths, layer_scale=layer_scale,
                    in_channels=in_channels)
