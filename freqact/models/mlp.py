"""A multi-layer perceptron on flattened images: Linear + ReLU (+ Dropout) layers, a classifier."""
from __future__ import annotations

import math

import torch
from torch import nn

from freqact import _validate
from freqact.errors import UsageError, UsageTypeError
from freqact.models import check_dropout, register


class MLP(nn.Module):
    """Flatten, then `Linear -> ReLU [-> Dropout]` per hidden layer, then a linear classifier.

    Args:
        num_classes: classifier outputs.
        hidden: widths of the hidden layers (may be empty: a linear classifier).
        dropout: dropout probability after each hidden ReLU; 0 adds no Dropout modules.
        input_shape: shape of one sample, e.g. (3, 32, 32) or (64,); it is flattened.

    Input (N, *input_shape) -> logits (N, num_classes).
    """

    def __init__(self, num_classes: int = 10, *, hidden: tuple[int, ...] = (512, 512),
                 dropout: float = 0.0, input_shape: tuple[int, ...] = (3, 32, 32)) -> None:
        super().__init__()
        _validate.positive_int("num_classes", num_classes)
        if not isinstance(hidden, (tuple, list)):
            raise UsageTypeError(f"hidden: expected a tuple of widths (integers >= 1), got {hidden!r}")
        for w in hidden:
            _validate.positive_int("hidden", w)
        if not isinstance(input_shape, (tuple, list)):
            raise UsageTypeError(f"input_shape: expected a tuple of ints, got {input_shape!r}")
        if not 1 <= len(input_shape) <= 3:
            raise UsageError(
                f"input_shape: expected (F,), (C, L) or (C, H, W), got {tuple(input_shape)}"
            )
        for d in input_shape:
            _validate.positive_int("input_shape", d)
        dropout = check_dropout(dropout)
        self.input_shape = tuple(int(d) for d in input_shape)

        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(self.input_shape)
        for w in hidden:
            layers += [nn.Linear(width, w), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = w
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@register("mlp")
def mlp(num_classes: int = 10, *, hidden: tuple[int, ...] = (512, 512), dropout: float = 0.0,
        input_shape: tuple[int, ...] = (3, 32, 32)) -> MLP:
    """MLP on flattened 3x32x32 images by default: two hidden layers of 512, PyTorch's init."""
    return MLP(num_classes, hidden=hidden, dropout=dropout, input_shape=input_shape)
