"""DenseNet-121 (Huang et al. 2017), CIFAR variant (DenseNet-BC as the paper runs it on CIFAR).

A 3x3 stride-1 stem convolution to 2 x growth channels with no BatchNorm (the dense layers are
pre-activation) and no max-pool; four dense blocks of (6, 12, 24, 16) bottleneck layers;
transitions BN-ReLU-1x1 conv (channels x reduction) then 2x2 average pool; final BN-ReLU, global
average pool and a linear classifier. At the defaults with 10 classes: 6,956,298 parameters
(torchvision's ImageNet densenet121 with 10 classes has 6,964,106: its 7x7 stem is 7,680 weights
more, its stem BatchNorm 128).
"""
from __future__ import annotations

import torch
from torch import nn

from freqact import _validate
from freqact.models import init_conv_bn, register


def _bn_relu_conv(in_channels: int, out_channels: int, kernel: int) -> list[nn.Module]:
    return [
        nn.BatchNorm2d(in_channels),
        nn.ReLU(),
        nn.Conv2d(in_channels, out_channels, kernel, padding=kernel // 2, bias=False),
    ]


class DenseLayer(nn.Module):
    """Bottleneck dense layer BN-ReLU-1x1 conv (bn_size x growth)-BN-ReLU-3x3 conv (growth).

    Maps (N, in_channels, H, W) to its new features (N, growth, H, W).
    """

    def __init__(self, in_channels: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *_bn_relu_conv(in_channels, bn_size * growth, 1),
            *_bn_relu_conv(bn_size * growth, growth, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class DenseBlock(nn.Module):
    """A whole dense block: each layer reads the concatenation of the block input and all earlier
    layers' features, and the block returns that concatenation (so its output is the block output).

    Maps (N, in_channels, H, W) to (N, in_channels + num_layers * growth, H, W).
    """

    def __init__(self, num_layers: int, in_channels: int, growth: int, bn_size: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            DenseLayer(in_channels + i * growth, growth, bn_size) for i in range(num_layers)
        )
        self.out_channels = in_channels + num_layers * growth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.cat([x, layer(x)], dim=1)
        return x


class DenseNet(nn.Module):
    """DenseNet-BC for 32x32 images.

    Args:
        block_config: dense layers per block, e.g. (6, 12, 24, 16).
        num_classes: classifier outputs.
        growth: channels each dense layer adds (k).
        reduction: channel compression of the transitions, in (0, 1].
        bn_size: bottleneck width of a dense layer, in multiples of `growth`.
        in_channels: channels of the input images.

    Input (N, in_channels, H, W) -> logits (N, num_classes).
    """

    def __init__(self, block_config: tuple[int, ...], num_classes: int = 10, *, growth: int = 32,
                 reduction: float = 0.5, bn_size: int = 4, in_channels: int = 3) -> None:
        super().__init__()
        _validate.positive_int("num_classes", num_classes)
        _validate.positive_int("growth", growth)
        _validate.unit_ratio("reduction", reduction)
        _validate.positive_int("bn_size", bn_size)
        _validate.positive_int("in_channels", in_channels)
        for n in block_config:
            _validate.positive_int("block_config", n)
        self.input_shape = (in_channels, 32, 32)

        channels = 2 * growth
        layers: list[nn.Module] = [nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)]
        for i, n in enumerate(block_config):
            block = DenseBlock(n, channels, growth, bn_size)
            layers.append(block)
            channels = block.out_channels
            if i < len(block_config) - 1:
                out_channels = max(1, int(channels * reduction))
                layers += [*_bn_relu_conv(channels, out_channels, 1), nn.AvgPool2d(2)]
                channels = out_channels
        layers += [nn.BatchNorm2d(channels), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        init_conv_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))  # (N, C) -> (N, classes)


@register("densenet121")
def densenet121(num_classes: int = 10, *, growth: int = 32, reduction: float = 0.5,
                in_channels: int = 3) -> DenseNet:
    """CIFAR DenseNet-121: blocks (6, 12, 24, 16), growth 32; 6,956,298 parameters at 10 classes."""
    return DenseNet((6, 12, 24, 16), num_classes, growth=growth, reduction=reduction,
                    in_channels=in_channels)
