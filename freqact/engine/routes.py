"""The route table: which codec each tensor autograd saves goes through.

A tensor saved inside a running module is described by a `Saved` (what it is: the op that made it,
its dtype and rank, whether it is the module's input) and routed by the module's `Kind`: each kind
has one chooser, `Saved -> Route | None` (None: keep it exactly). Routes are named, built once per
block (per module where the route carries the module's geometry), so dedup compares the same codec
object every time. New rules (routing by the op that saved a tensor, by dtype or rank) are new
choosers or new `Saved` fields, not new branches in the pack hook.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from freqact.codecs.base import Codec, Exact
from freqact.codecs.cheap import (
    DropoutMask,
    HardtanhMask,
    MaxPoolIndices,
    ReluMask,
    ShapeOnly,
    SignMask,
)

__all__ = ["DEFAULT_TYPES", "Kind", "Route", "Routes", "Saved", "Site", "choose", "kind_of"]

DEFAULT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm,
)
"""Module types whose input goes through the codec when `include` is None."""

# Dtypes the value codecs read; other floating types (float8) are kept exactly.
_CODEC_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


class Kind(enum.Enum):
    """How the tensors saved inside a module of that type are routed."""

    NONE = "none"  # not routed: everything kept exactly
    CODEC = "codec"  # the input goes through the block's codec
    BATCHNORM = "batchnorm"  # as CODEC, but a (N, C) input is read per channel
    RELU = "relu"
    HARDTANH = "hardtanh"
    LEAKY = "leaky"
    DROPOUT = "dropout"
    MAXPOOL = "maxpool"
    AVGPOOL = "avgpool"


_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
# Checked in order: BatchNorm before the other default types, ReLU6 is a Hardtanh subclass.
_KIND_BY_TYPE: tuple[tuple[tuple[type[nn.Module], ...], Kind], ...] = (
    (_BATCHNORMS, Kind.BATCHNORM),
    (DEFAULT_TYPES, Kind.CODEC),
    ((nn.ReLU,), Kind.RELU),
    ((nn.Hardtanh,), Kind.HARDTANH),
    ((nn.LeakyReLU,), Kind.LEAKY),
    ((nn.Dropout,), Kind.DROPOUT),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), Kind.MAXPOOL),
    ((nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
      nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d), Kind.AVGPOOL),
)
_MAXPOOL_DIMS = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}


def kind_of(module: nn.Module) -> Kind:
    """The routing kind of a module by its type (Kind.NONE for types the table does not know)."""
    return next((kind for types, kind in _KIND_BY_TYPE if isinstance(module, types)), Kind.NONE)


@dataclass(frozen=True, eq=False)
class Route:
    """A named way to hold one saved tensor.

    Attributes:
        name: the route's name ("codec", "relu-mask", ..., "keep-exact", "parameter").
        codec: the codec that packs and unpacks the tensor.
        channels: encode a rank-2 (N, C) tensor transposed, as (C, N): one map per channel over
            the batch, the layout of BatchNorm's statistics.
    """

    name: str
    codec: Codec
    channels: bool = False

    @property
    def label(self) -> str:
        """What the meter calls the route: the codec's name, or "kept" for exact keeping."""
        return "kept" if self.name in ("keep-exact", "parameter") else self.codec.name

    @property
    def copies(self) -> bool:
        """False when the packed form is the tensor itself (counted once per storage)."""
        return not isinstance(self.codec, Exact)


# Kept tensors and parameters go through `Exact`: no copy, and an in-place edit after saving raises
# at unpack instead of silently changing the gradient (saved-tensor hooks bypass PyTorch's check).
KEEP = Route("keep-exact", Exact())
PARAMETER = Route("parameter", Exact())  # not activation memory: the meter skips it
_RELU_MASK = Route("relu-mask", ReluMask())
_SIGN_MASK = Route("sign-mask", SignMask())
_DROPOUT_MASK = Route("dropout-mask", DropoutMask())
_SHAPE_ONLY = Route("shape-only", ShapeOnly())


@dataclass(frozen=True)
class Routes:
    """The routes of one block: its codec, and the masks (kept exact under a lossless codec).

    Under `exact` the 1-bit masks would be held beside the exact copy of the same storage that the
    next layer keeps, so held bytes could exceed plain PyTorch's: they are kept exactly instead
    (the same storage, counted once). Index and shape-only routes only ever hold less.
    """

    codec: Route
    channels: Route
    masks: bool
    relu: Route
    sign: Route

    @classmethod
    def for_codec(cls, codec: Codec) -> Routes:
        masks = not isinstance(codec, Exact)
        return cls(
            codec=Route("codec", codec),
            channels=Route("codec", codec, channels=True),
            masks=masks,
            relu=_RELU_MASK if masks else KEEP,
            sign=_SIGN_MASK if masks else KEEP,
        )


@dataclass
class Site:
    """A hooked module as the router sees it: its kind and its own prebuilt routes.

    Attributes:
        name: qualified name ("" for the model itself); type_name: its class name.
        kind: its routing kind (Kind.NONE when include/exclude leave it out).
        hardtanh: the hardtanh-mask route with the module's range (Kind.HARDTANH only).
        maxpool: maxpool-indices routes by input size, built on first use.
    """

    name: str
    module: nn.Module
    kind: Kind
    routes: Routes
    type_name: str = field(init=False)
    hardtanh: Route | None = field(init=False, default=None)
    maxpool: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.type_name = type(self.module).__name__
        if self.kind is Kind.HARDTANH:
            self.hardtanh = KEEP if not self.routes.masks else Route(
                "hardtanh-mask", HardtanhMask(self.module.min_val, self.module.max_val))


@dataclass(frozen=True)
class Saved:
    """What the pack hook knows about one saved tensor inside a running module.

    Attributes:
        tensor: the saved tensor.
        op: class name of the autograd node that made it ("" for a tensor without history).
        input: the module's first tensor argument (None when it got none).
        is_input: tensor shares the input's storage (the input itself or a view of it).
    """

    tensor: torch.Tensor
    op: str
    input: torch.Tensor | None
    is_input: bool

    @property
    def same_size(self) -> bool:
        return self.tensor.numel() == self.input.numel()


def _codec(site: Site, saved: Saved) -> Route | None:
    t = saved.tensor
    # The input itself or a view of it, or its autocast copy (a cast: another dtype).
    # (Parameters and their copies never get here.)
    if t.dim() >= 2 and (saved.is_input or (t.dtype != saved.input.dtype and saved.same_size)):
        # A codec may decline a tensor (lfc/hfc: no spatial or sequence axis): it is then kept.
        return site.routes.codec if site.routes.codec.codec.accepts(t) else None
    return None


def _batchnorm(site: Site, saved: Saved) -> Route | None:
    route = _codec(site, saved)
    # (N, C): the statistics run per channel over the batch; per-sample maps would mix channels of
    # different scales and lose the small differences between samples that backward divides by.
    if route is not None and saved.tensor.dim() == 2:
        return site.routes.channels
    return route


def _pool_input(site: Site, saved: Saved) -> Route | None:
    return _SHAPE_ONLY if saved.is_input else None


def _relu(site: Site, saved: Saved) -> Route | None:
    # nn.ReLU runs only relu, which saves its own output.
    return site.routes.relu if saved.op == "ReluBackward0" else None


def _hardtanh(site: Site, saved: Saved) -> Route | None:
    # Hardtanh saves its input (a clone of it when in place); nothing else is saved in it.
    return site.hardtanh if saved.same_size else None


def _leaky(site: Site, saved: Saved) -> Route | None:
    # LeakyReLU saves its input or, in place, its output.
    return site.routes.sign if saved.same_size else None


def _dropout(site: Site, saved: Saved) -> Route | None:
    # Dropout saves its scaled noise: no history, not the input.
    if saved.same_size and saved.op == "" and not saved.is_input:
        return _DROPOUT_MASK
    return None


def _maxpool_indices(site: Site, saved: Saved) -> Route:
    dims = next(d for cls, d in _MAXPOOL_DIMS.items() if isinstance(site.module, cls))
    size = tuple(saved.input.shape[-dims:])
    route = site.maxpool.get(size)
    if route is None:
        m = site.module
        try:
            route = Route("maxpool-indices", MaxPoolIndices(
                m.kernel_size, m.stride, m.padding, m.dilation, input_size=size))
        except ValueError:  # a window over 256 elements: offsets would not fit a byte
            route = KEEP
        site.maxpool[size] = route
    return route


_FLOAT_CHOOSERS: dict[Kind, Callable[[Site, Saved], Route | None]] = {
    Kind.CODEC: _codec,
    Kind.BATCHNORM: _batchnorm,
    Kind.RELU: _relu,
    Kind.HARDTANH: _hardtanh,
    Kind.LEAKY: _leaky,
    Kind.DROPOUT: _dropout,
    Kind.MAXPOOL: _pool_input,
    Kind.AVGPOOL: _pool_input,
}


def choose(site: Site, saved: Saved) -> Route:
    """The route of one saved tensor that is not a parameter.

    Args:
        site: the innermost running module.
        saved: the tensor and what is known about it.

    Returns:
        The route; KEEP when no rule applies.
    """
    t = saved.tensor
    # An empty tensor (a zero-size batch) holds no bytes to save; codecs refuse it.
    if site.kind is Kind.NONE or saved.input is None or t.numel() == 0:
        return KEEP
    if site.kind is Kind.MAXPOOL and t.dtype == torch.int64:
        return _maxpool_indices(site, saved)
    if t.dtype not in _CODEC_DTYPES or t.layout != torch.strided:
        return KEEP
    return _FLOAT_CHOOSERS[site.kind](site, saved) or KEEP
