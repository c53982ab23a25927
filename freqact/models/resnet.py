"""ResNets (He et al. 2016): CIFAR ResNet-18/20 and ImageNet-style ResNet-50, one shared body.

The CIFAR variants have a 3x3 stride-1 stem and no max-pool; ResNet-50 has the 7x7 stride-2 stem and
max-pool (for 224x224 memory studies). Every stage but the first halves the resolution. The
classifier pools adaptively, so any input of at least 32x32 works.

Shortcuts are identities, or a 1x1 convolution + BatchNorm where the shape changes ("option B").
He et al.'s CIFAR ResNet-20 used zero-padded identities ("option A", 269,722 parameters); sharing
the block with ResNet-18 gives the common 272,474-parameter ResNet-20. Bottleneck strides in its 3x3
convolution (torchvision's "ResNet v1.5"), which leaves the parameter count unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from freqact import _validate
from freqact.models import init_conv_bn, register


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """Identity when the shape is kept, else a strided 1x1 projection + BatchNorm."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection; ReLU after the addition.

    Maps (N, in_channels, H, W) to (N, planes, ceil(H / stride), ceil(W / stride)).
    """

    expansion = 1

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _shortcut(in_channels, planes, stride)
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with a residual connection; ReLU after the add.

    Maps (N, in_channels, H, W) to (N, 4 * planes, ceil(H / stride), ceil(W / stride)).
    """

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(planes, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut = _shortcut(in_channels, out_channels, stride)
        self.relu3 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.relu2(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu3(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, stages of residual blocks, global average pool, linear classifier.

    Args:
        block: `BasicBlock` or `Bottleneck`.
        layers: number of blocks per stage, e.g. (2, 2, 2, 2).
        widths: `planes` of each stage (the block multiplies by its expansion); same length as
            `layers`.
        num_classes: classifier outputs.
        stem: "cifar" (3x3 stride-1 conv to widths[0]) or "imagenet" (7x7 stride-2 conv to
            widths[0], then 3x3 stride-2 max-pool).
        in_channels: channels of the input images.

    Input (N, in_channels, H, W) -> logits (N, num_classes).
    """

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, ...],
        widths: tuple[int, ...],
        num_classes: int = 10,
        *,
        stem: str = "cifar",
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        _validate.positive_int("num_classes", num_classes)
        _validate.positive_int("in_channels", in_channels)
        _validate.choice("stem", stem, ("cifar", "imagenet"))
        if len(layers) != len(widths):
            raise ValueError(
                f"layers/widths: expected the same length, got {len(layers)} and {len(widths)}"
            )
        for n in layers:
            _validate.positive_int("layers", n)
        for w in widths:
            _validate.positive_int("widths", w)

        if stem == "cifar":
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
                nn.BatchNorm2d(widths[0]),
                nn.ReLU(),
            )
            self.input_shape = (in_channels, 32, 32)
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(in_channels, widths[0], 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(widths[0]),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
            self.input_shape = (in_channels, 224, 224)

        stages = []
        channels = widths[0]
        for i, (n, planes) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(n):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(block(channels, planes, stride))
                channels = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        init_conv_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))  # (N, C, 1, 1) -> (N, C) -> (N, classes)


@register("resnet18")
def resnet18(num_classes: int = 10, *, width: int = 64, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-18: BasicBlocks (2, 2, 2, 2), widths width x (1, 2, 4, 8); 32x32 input.

    11,173,962 parameters at the defaults with 10 classes.
    """
    _validate.positive_int("width", width)
    widths = (width, 2 * width, 4 * width, 8 * width)
    return ResNet(BasicBlock, (2, 2, 2, 2), widths, num_classes, in_channels=in_channels)


@register("resnet20")
def resnet20(num_classes: int = 10, *, width: int = 16, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-20: BasicBlocks (3, 3, 3), widths width x (1, 2, 4); 32x32 input.

    272,474 parameters at the defaults with 10 classes (projection shortcuts, see the module doc).
    """
    _validate.positive_int("width", width)
    widths = (width, 2 * width, 4 * width)
    return ResNet(BasicBlock, (3, 3, 3), widths, num_classes, in_channels=in_channels)


@register("resnet50")
def resnet50(num_classes: int = 10, *, width: int = 64, in_channels: int = 3) -> ResNet:
    """ImageNet-style ResNet-50: Bottlenecks (3, 4, 6, 3), 7x7 stem + max-pool; 224x224 input.

    25,557,032 parameters at the defaults with 1000 classes (as torchvision's resnet50).
    """
    _validate.positive_int("width", width)
    widths = (width, 2 * width, 4 * width, 8 * width)
    return ResNet(
        Bottleneck, (3, 4, 6, 3), widths, num_classes, stem="imagenet", in_channels=in_channels
    )
