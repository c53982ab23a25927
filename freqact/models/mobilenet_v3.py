"""MobileNet-V3-Small (Howard et al. 2019), CIFAR variant.

The paper's Table 2 network with the stem and the first block at stride 1, so a 32x32 input ends
at 2x2 instead of 1x1. Blocks are inverted residuals: 1x1 expansion (skipped when the expansion
equals the input width), kxk depthwise convolution, squeeze-excitation (global average pool,
1x1 conv to a quarter of the width rounded to 8, ReLU, 1x1 conv back, Hardsigmoid, multiply),
linear 1x1 projection; ReLU or Hardswish per the table, all `nn` modules. Then 1x1 conv to 576
channels, pooling, Linear 1024 with Hardswish, dropout, classifier. Initialisation as the other
CNNs (`init_conv_bn`); Linear layers keep PyTorch's default.
"""
from __future__ import annotations

import torch
from torch import nn

from freqact import _validate
from freqact.models import check_dropout, init_conv_bn, register
from freqact.models.mobilenet import _round_channels

# (kernel, expanded width, output width, squeeze-excitation, Hardswish (else ReLU), stride);
# Table 2 of the paper with the first stride 2 -> 1 for 32x32 inputs.
_SMALL_CIFAR = (
    (3, 16, 16, True, False, 1),
    (3, 72, 24, False, False, 2),
    (3, 88, 24, False, False, 1),
    (5, 96, 40, True, True, 2),
    (5, 240, 40, True, True, 1),
    (5, 240, 40, True, True, 1),
    (5, 120, 48, True, True, 1),
    (5, 144, 48, True, True, 1),
    (5, 288, 96, True, True, 2),
    (5, 576, 96, True, True, 1),
    (5, 576, 96, True, True, 1),
)


def _conv_bn_act(in_channels: int, out_channels: int, kernel: int, stride: int = 1,
                 groups: int = 1, hardswish: bool = True) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=kernel // 2,
                  groups=groups, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.Hardswish() if hardswish else nn.ReLU(),
    )


class SqueezeExcitation(nn.Module):
    """x * Hardsigmoid(fc2(ReLU(fc1(avgpool(x))))): channel gates from global context.

    Maps (N, C, H, W) to (N, C, H, W).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        squeezed = _round_channels(channels / 4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.relu = nn.ReLU()
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))


class SEInvertedResidual(nn.Module):
    """Expansion, depthwise kxk, optional squeeze-excitation, linear projection, residual.

    The residual connection is used when the shape is kept (stride 1, same channels).
    Maps (N, in_channels, H, W) to (N, out_channels, ceil(H / stride), ceil(W / stride)).
    """

    def __init__(self, in_channels: int, kernel: int, expanded: int, out_channels: int,
                 se: bool, hardswish: bool, stride: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        if expanded != in_channels:
            layers.append(_conv_bn_act(in_channels, expanded, 1, hardswish=hardswish))
        layers.append(_conv_bn_act(expanded, expanded, kernel, stride, expanded, hardswish))
        if se:
            layers.append(SqueezeExcitation(expanded))
        layers += [nn.Conv2d(expanded, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels)]
        self.layers = nn.Sequential(*layers)
        self.use_residual = stride == 1 and in_channels == out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return x + out if self.use_residual else out


class MobileNetV3(nn.Module):
    """MobileNet-V3-Small for 32x32 images.

    Args:
        num_classes: classifier outputs.
        dropout: dropout probability before the classifier (0.2 in the reference network).
        in_channels: channels of the input images.

    Input (N, in_channels, H, W) -> logits (N, num_classes).
    """

    def __init__(self, num_classes: int = 10, *, dropout: float = 0.2,
                 in_channels: int = 3) -> None:
        super().__init__()
        _validate.positive_int("num_classes", num_classes)
        _validate.positive_int("in_channels", in_channels)
        self.input_shape = (in_channels, 32, 32)

        layers: list[nn.Module] = [_conv_bn_act(in_channels, 16, 3)]
        channels = 16
        for kernel, expanded, out_channels, se, hardswish, stride in _SMALL_CIFAR:
            layers.append(SEInvertedResidual(channels, kernel, expanded, out_channels, se,
                                             hardswish, stride))
            channels = out_channels
        layers.append(_conv_bn_act(channels, 576, 1))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(),
                                        nn.Dropout(check_dropout(dropout)),
                                        nn.Linear(1024, num_classes))
        init_conv_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


@register("mobilenet_v3")
def mobilenet_v3(num_classes: int = 10, *, dropout: float = 0.2,
                 in_channels: int = 3) -> MobileNetV3:
    """CIFAR MobileNet-V3-Small: squeeze-excitation inverted residuals, Hardswish."""
    return MobileNetV3(num_classes, dropout=dropout, in_channels=in_channels)
