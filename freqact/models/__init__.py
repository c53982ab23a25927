"""The model zoo: models built by name, one file per family.

::

    model = freqact.models.get("resnet18", num_classes=10)
    x = torch.randn(8, *model.input_shape)

`names()` lists the registered names. Every model has an attribute `input_shape`, (C, H, W) of its
default input ((F,) for flat inputs; (T,) for the language model `gpt`, whose input is int64
token ids (N, T) and whose `num_classes` is the vocabulary size, logits (N, T, V)). The residual,
dense and transformer blocks are modules of the classes in `BLOCK_TYPES`, so an analysis finds the
"block outputs" (the paper's Fig. 4) with `isinstance(m, BLOCK_TYPES)`; a block whose output is not
channels-first (N, C, *spatial) says so in a class attribute `map_layout`: "channels_last" (Swin's
(N, H, W, C) grids) or "tokens" ((N, T, F) sequences: ViT, GPT), read by
`analysis.common.to_channels_first` (tokens refused by `analysis.common.select_layers`).

Models know nothing about compression. Activations are `nn` modules (`nn.ReLU`, `nn.ReLU6`, `nn.GELU`,
`nn.SiLU`, `nn.Hardswish`, `nn.Hardsigmoid`; never `F.relu`) and none is in place, so the engine's
hooks see every activation and no cached tensor is modified after it was saved.

Initialisation ("standard", as in torchvision): convolutions `kaiming_normal_(mode="fan_out",
nonlinearity="relu")` without bias, BatchNorm weight 1 and bias 0, Linear layers PyTorch's default
(Kaiming-uniform, a=sqrt(5)). The ViT follows the ViT/DeiT recipe instead: Linear (and the patch
projection, itself a linear map) `trunc_normal_(std=0.02)` with zero bias, LayerNorm 1/0
(`init_transformer`, shared with Swin and ConvNeXt); `gpt` follows GPT-2 (see its module).
The transformer families keep the code idioms of their reference implementations (ViT's
`flatten(2).transpose(1, 2)` tokens, Swin's channels-last grids, Llama's functional RMSNorm), since
those are what a compressor meets in practice.
"""
from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable

from torch import nn

from freqact import _validate
from freqact.errors import UsageError, UsageTypeError

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register(name: str) -> Callable[[Callable], Callable]:
    """Decorator: make a builder `fn(num_classes, **kwargs) -> nn.Module` available by name."""

    def add(fn: Callable) -> Callable:
        if name in _REGISTRY:
            raise ValueError(f"model name {name!r} is registered twice")
        _REGISTRY[name] = fn
        return fn

    return add


def names() -> list[str]:
    """The registered model names, sorted."""
    return sorted(_REGISTRY)


def get(name: str, num_classes: int = 10, **kwargs) -> nn.Module:
    """Build the model registered as `name`, freshly initialised.

    Args:
        name: one of `names()`.
        num_classes: size of the classifier output, shape (N, num_classes).
        **kwargs: the family's explicit settings (e.g. `width`, `dropout`); see each builder.

    Returns:
        The model, in training mode, with an attribute `input_shape`.

    Raises:
        UsageError (a ValueError): if `name` is unknown (the message lists the known names) or a
            setting is out of range.
        UsageTypeError (a TypeError): if a setting is not one of that model's (the message lists
            its settings) or has the wrong type. A TypeError from inside a builder is a bug and
            propagates as it is.

    Example:
        >>> import torch
        >>> model = get("mlp")
        >>> model(torch.zeros(2, *model.input_shape)).shape
        torch.Size([2, 10])
    """
    _validate.choice("name", name, tuple(names()))
    _validate.positive_int("num_classes", num_classes)
    builder = _REGISTRY[name]
    # The builder's signature is the model's declaration of its settings: check the keywords
    # against it first, so that the call below raises only what the builder itself raises.
    accepted = inspect.signature(builder).parameters
    open_ended = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    unknown = [key for key in kwargs if not open_ended and key not in accepted]
    if unknown:
        known = ", ".join(p for p in accepted if p != "num_classes") or "none"
        raise UsageTypeError(f"model {name!r}: unknown setting {unknown[0]!r}; its settings: "
                             f"{known}")
    return builder(num_classes=num_classes, **kwargs)


def init_conv_bn(model: nn.Module) -> None:
    """Standard CNN initialisation in place: Kaiming (fan_out) convs, BatchNorm 1/0.

    Linear layers keep PyTorch's default initialisation.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def init_transformer(model: nn.Module) -> None:
    """ViT/DeiT initialisation in place: Linear and Conv2d weights `trunc_normal_(std=0.02)`,
    their biases 0, LayerNorm weight 1 and bias 0."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def check_stages(**stages: object) -> None:
    """Raise unless every keyword is a tuple of positive ints, all of one length >= 1.

    Per-stage settings such as `depths=(2, 2), heads=(3, 6)`; errors name the argument
    (`depths`, or `heads[1]` for one entry).
    """
    names = ", ".join(stages)
    lengths = {len(v) if isinstance(v, tuple) else -1 for v in stages.values()}
    if len(lengths) != 1 or lengths.pop() < 1:
        got = ", ".join(repr(v) for v in stages.values())
        raise UsageTypeError(f"{names}: expected tuples of equal length >= 1, got {got}")
    for name, values in stages.items():
        for i, value in enumerate(values):
            _validate.positive_int(f"{name}[{i}]", value)


def check_dropout(value: object) -> float:
    """Return `value` as float if it is a probability in [0, 1), else raise (argument `dropout`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UsageTypeError(f"dropout: expected a number in [0, 1), got {value!r}")
    if not 0.0 <= float(value) < 1.0:
        raise UsageError(f"dropout: expected a number in [0, 1), got {value}")
    return float(value)


# The families import `register` and the initialisers from this module, so they are imported last.
from freqact.models.convnext import ConvNeXt, ConvNeXtBlock  # noqa: E402
from freqact.models.densenet import DenseBlock, DenseNet  # noqa: E402
from freqact.models.gpt import GPT, DecoderBlock, RMSNorm  # noqa: E402
from freqact.models.mlp import MLP  # noqa: E402
from freqact.models.mobilenet import InvertedResidual, MobileNetV2  # noqa: E402
from freqact.models.mobilenet_v3 import MobileNetV3, SEInvertedResidual  # noqa: E402
from freqact.models.resnet import BasicBlock, Bottleneck, ResNet  # noqa: E402
from freqact.models.swin import Swin, SwinBlock  # noqa: E402
from freqact.models.vit import TransformerBlock, ViT  # noqa: E402

# MobileNets' inverted residuals are left out (as before): most of them change the shape and
# carry no residual, so they are not "block outputs" in the paper's sense.
BLOCK_TYPES: tuple[type[nn.Module], ...] = (
    BasicBlock, Bottleneck, ConvNeXtBlock, DecoderBlock, DenseBlock, SwinBlock, TransformerBlock,
)

__all__ = [
    "BLOCK_TYPES",
    "GPT",
    "MLP",
    "BasicBlock",
    "Bottleneck",
    "ConvNeXt",
    "ConvNeXtBlock",
    "DecoderBlock",
    "DenseBlock",
    "DenseNet",
    "InvertedResidual",
    "MobileNetV2",
    "MobileNetV3",
    "RMSNorm",
    "ResNet",
    "SEInvertedResidual",
    "Swin",
    "SwinBlock",
    "TransformerBlock",
    "ViT",
    "get",
    "names",
    "register",
]
