"""MobileNet-V2 (Sandler et al. 2018), CIFAR variant.

The ImageNet network with two strides set to 1 so a 32x32 input ends at 4x4 instead of 1x1: the stem
convolution and the first 24-channel stage. Strides do not change the parameter count, so at the
defaults with 10 classes it has torchvision's mobilenet_v2(num_classes=10) count, 2,236,682.
Activations are ReLU6 (`nn.ReLU6` modules); the projection after the depthwise layer is linear.
"""
from __future__ import annotations

import numbers

import torch
from torch import nn

from freqact import _validate
from freqact.errors import UsageError, UsageTypeError
from freqact.models import check_dropout, init_conv_bn, register

# (expansion t, output channels c, repeats n, stride of the first repeat s); the paper's Table 2
# with the second row's stride 2 -> 1 for 32x32 inputs.
_CIFAR_SETTINGS = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _round_channels(channels: float, divisor: int = 8) -> int:
    """Nearest multiple of `divisor`, never more than 10% below `channels` (the reference rule)."""
    rounded = max(divisor, int(channels + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * channels:
        rounded += divisor
    return rounded


def _conv_bn_relu6(in_channels: int, out_channels: int, kernel: int, stride: int = 1,
                   groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=kernel // 2,
                  groups=groups, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(),
    )


class InvertedResidual(nn.Module):
    """1x1 expansion (skipped when t == 1), 3x3 depthwise, linear 1x1 projection.

    The residual connection is used when the shape is kept (stride 1, same channels).
    Maps (N, in_channels, H, W) to (N, out_channels, ceil(H / stride), ceil(W / stride)).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        layers = [] if expansion == 1 else [_conv_bn_relu6(in_channels, hidden, 1)]
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.layers = nn.Sequential(*layers)
        self.use_residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return x + out if self.use_residual else out


class MobileNetV2(nn.Module):
    """MobileNet-V2 for 32x32 images.

    Args:
        num_classes: classifier outputs.
        width_mult: channel multiplier; channels are rounded to multiples of 8.
        dropout: dropout probability before the classifier (0.2 in the reference network).
        in_channels: channels of the input images.

    Input (N, in_channels, H, W) -> logits (N, num_classes).
    """

    def __init__(self, num_classes: int = 10, *, width_mult: float = 1.0, dropout: float = 0.2,
                 in_channels: int = 3) -> None:
        super().__init__()
        _validate.positive_int("num_classes", num_classes)
        _validate.positive_int("in_channels", in_channels)
        if isinstance(width_mult, bool) or not isinstance(width_mult, numbers.Real):
            raise UsageTypeError(f"width_mult: expected a number > 0, got {width_mult!r}")
        if not width_mult > 0:
            raise UsageError(f"width_mult: expected a number > 0, got {width_mult}")
        self.input_shape = (in_channels, 32, 32)

        channels = _round_channels(32 * width_mult)
        last_channels = _round_channels(1280 * max(1.0, width_mult))
        layers = [_conv_bn_relu6(in_channels, channels, 3)]
        for t, c, n, s in _CIFAR_SETTINGS:
            out_channels = _round_channels(c * width_mult)
            for i in range(n):
                layers.append(InvertedResidual(channels, out_channels, s if i == 0 else 1, t))
                channels = out_channels
        layers.append(_conv_bn_relu6(channels, last_channels, 1))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(check_dropout(dropout))
        self.fc = nn.Linear(last_channels, num_classes)
        init_conv_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.pool(self.features(x)), 1)  # (N, last_channels)
        return self.fc(self.dropout(x))


@register("mobilenet_v2")
def mobilenet_v2(num_classes: int = 10, *, width_mult: float = 1.0, dropout: float = 0.2,
                 in_channels: int = 3) -> MobileNetV2:
    """CIFAR MobileNet-V2; 2,236,682 parameters at the defaults with 10 classes."""
    return MobileNetV2(num_classes, width_mult=width_mult, dropout=dropout,
                       in_channels=in_channels)
