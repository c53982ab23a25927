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
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from freqact.codecs.base import CODEC_DTYPES, Codec, Exact
from freqact.codecs.cheap import (
    DropoutMask,
    HardtanhMask,
    MaxPoolIndices,
    ReluMask,
    ShapeOnly,
    SignMask,
)
from freqact.codecs.division import Division
from freqact.engine.attention import ROLES, SdpaCall, same_view, setting
from freqact.engine.layouts import GROUP_TOKENS, TokenLayout, packed_nbytes, token_view
from freqact.engine.moments import NormLayout

__all__ = ["DEFAULT_TYPES", "Kind", "Route", "Routes", "Saved", "Site", "choose", "kind_of",
           "route_for", "view_shape"]

DEFAULT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm,
)
"""Module types whose input goes through the codec when `include` is None."""

MIN_ELEMENTS = 4096
"""Saved tensors routed by the op that saved them need at least this many elements (smaller ones,
statistics such as a norm's rsqrt among them, are kept: they hold few bytes)."""

MIN_BATCH_VALUES = 8
"""A BatchNorm input with fewer values per channel than this (N * spatial, N * T rows of a
(N * T, C) token batch: LeViT's 1-token stages) is kept. Backward keeps only the part of the
output gradient orthogonal to 1 and x_hat, P - 2 of the channel's P values (none at P = 2: the
exact input gradient is 0), while coding noise on x_hat passes unprojected, times 1/std over P
values. Measured on HF LeViT under `division` (20 seeds): relative gradient error up to 55 at
P = 2, 4.5 at 3, 2.7 at 4, 1.9 at 5, at most 1.84 from 6 (above 2 at P = 4 on 3 of 20 seeds).
Such a tensor holds fewer than 8 C values, and a map of P < 8 values packs at most 3.5x."""


def few_batch_values(t: torch.Tensor) -> bool:
    """Whether BatchNorm input t (N, C, ...) has fewer than `MIN_BATCH_VALUES` values per channel
    (kept, eager and compiled: `graph_rules`)."""
    return t.numel() < MIN_BATCH_VALUES * t.shape[1]


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
        layout: "" (the tensor as saved, read by the map rule) or a `layouts` name ("feat/tok",
            "feat/chan", "tile/tok", "grid64/chan": the codec reads the tensor's token view).
        heads: the token view of an attention tensor (N, heads, T, d) -> (N * heads, T, d);
            else a token grid (N, *grid, F) -> (N, prod(grid), F).
    """

    name: str
    codec: Codec
    channels: bool = False
    layout: str = ""
    heads: bool = False

    @functools.cached_property  # asked at every pack
    def label(self) -> str:
        """What the meter calls the route: the codec's name and its layout, or "kept"."""
        if self.name in ("keep-exact", "parameter"):
            return "kept"
        return f"{self.codec.name} {self.layout}" if self.layout and self.copies else self.codec.name

    @functools.cached_property
    def copies(self) -> bool:
        """False when the packed form is the tensor itself (counted once per storage)."""
        return not isinstance(self.codec, Exact)

    @functools.cached_property
    def values(self) -> bool:
        """True when the packed form is a (lossy) copy of the values, or rebuilds them; False for
        the tensor itself and for masks, indices and shape-only (which keep only what one op's
        backward reads)."""
        return self.copies and not isinstance(self.codec, _STRUCTURE_CODECS)


_STRUCTURE_CODECS = (ReluMask, SignMask, DropoutMask, HardtanhMask, MaxPoolIndices, ShapeOnly)

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
    tokens: Route  # TOKEN_LAYOUT on a token grid (norm inputs, products)
    features: Route  # FEATURE_LAYOUT on token sequences (Linear and activation inputs)
    grids: Route  # GRID_LAYOUT: `features` on a (N, H, W, C) grid of at least 64 tokens
    attention: Route  # feat/chan on (N * heads, T, d) (SDPA v/out, probabilities)

    @classmethod
    def for_codec(cls, codec: Codec) -> Routes:
        masks = not isinstance(codec, Exact)
        # The token layouts need the full division form; other codecs read the feat/tok view
        chan, layout = (TokenLayout(codec), "feat/chan") if type(codec) is Division else (
            codec, "feat/tok")
        tokens, features, grids = (_layout_route(name, codec, *blocks, layout_cls=cls_)
                                   for name, blocks, cls_ in (
            ("tokens", TOKEN_LAYOUT, NormLayout), ("features", FEATURE_LAYOUT, TokenLayout),
            ("features", GRID_LAYOUT, TokenLayout)))
        whole = Route("codec", codec)
        return cls(
            codec=whole,
            # a lossless codec holds the tensor itself: nothing is transposed
            channels=Route("codec", codec, channels=True) if whole.copies else whole,
            masks=masks,
            relu=_RELU_MASK if masks else KEEP,
            sign=_SIGN_MASK if masks else KEEP,
            tokens=tokens,
            features=features,
            grids=grids,
            attention=Route("attention", chan, layout=layout, heads=True),
        )


# Measured in docs/ARCHITECTURE.md ("Layouts for token tensors"): 64-element blocks, > 8x.
TOKEN_LAYOUT = ("tile", "tok")  # norm inputs: min/step per token (backward divides by its spread;
# `NormLayout`: their exact per-token moments held too)
FEATURE_LAYOUT = ("tile", "chan")  # Linear/activation inputs: 8 tokens x 8 features, per channel
GRID_LAYOUT = ("grid64", "chan")  # the same on (N, H, W, C) grids: 8 x 8 patches, per channel


def _layout_route(name: str, codec: Codec, blocks: str, stats: str,
                  layout_cls: type[TokenLayout]) -> Route:
    """A token route in a `layouts` layout (`division`; `NormLayout` also holds each token's
    moments), else the codec's feat/tok view."""
    if type(codec) is not Division:
        return Route(name, codec, layout="feat/tok")
    return Route(name, layout_cls(codec, blocks, stats), layout=f"{blocks}/{stats}")


@dataclass
class Site:
    """A hooked module as the router sees it: its kind and its own prebuilt routes.

    Attributes:
        name: qualified name ("" for the model itself); type_name: its class name.
        kind: its routing kind (Kind.NONE when include/exclude leave it out).
        functional: the ops run directly in it (F.gelu, softmax, SDPA, ...) are routed by op
            (False when include/exclude leave it out).
        hardtanh: the hardtanh-mask route with the module's range (Kind.HARDTANH only).
        maxpool: maxpool-indices routes by input size, built on first use.
        sdpa: weak reference to the SDPA call whose saves are being packed (`attention`).
    """

    name: str
    module: nn.Module
    kind: Kind
    routes: Routes
    functional: bool = True
    type_name: str = field(init=False)
    hardtanh: Route | None = field(init=False, default=None)
    maxpool: dict = field(init=False, default_factory=dict)
    sdpa: weakref.ref | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.type_name = type(self.module).__name__
        if self.kind is Kind.HARDTANH:
            self.hardtanh = KEEP if not self.routes.masks else Route(
                "hardtanh-mask", HardtanhMask(self.module.min_val, self.module.max_val))


@dataclass(slots=True)  # built at every pack: a frozen one took 1.8-1.9 us, this 0.43-0.45 us
class Saved:
    """What the pack hook knows about one saved tensor inside a running module.

    Attributes:
        tensor: the saved tensor.
        op: class name of the autograd node that made it ("" for a tensor without history).
        input: the module's first tensor argument (None when it got none).
        is_input: tensor shares the input's storage (the input itself or a view of it).
        func: name of the outermost torch function running ("linear", "gelu", "softmax",
            "scaled_dot_product_attention", ...; "" outside any); args, kwargs: its arguments;
            call_id: the number of that call (`tracker.FunctionTracker`).
    """

    tensor: torch.Tensor
    op: str
    input: torch.Tensor | None
    is_input: bool
    func: str = ""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    call_id: int = -1

    @property
    def same_size(self) -> bool:
        return self.tensor.numel() == self.input.numel()


def _codec(site: Site, saved: Saved) -> Route | None:
    t = saved.tensor
    # The input itself, a view of it, a reshaped copy (a Linear on a transposed token view saves
    # its (N * T, F) copy) or its autocast copy: these modules save nothing else of that size
    # (parameters and their copies never get here).
    if t.dim() >= 2 and (saved.is_input or saved.same_size):
        return site.routes.codec
    return None


def _batchnorm(site: Site, saved: Saved) -> Route | None:
    route = _codec(site, saved)
    if route is not None and few_batch_values(saved.tensor):
        return KEEP  # statistics over too few values per channel (`MIN_BATCH_VALUES`)
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


# --- routes by the torch function that saved the tensor ---------------------------------------

# Autograd nodes a tensor goes through between a matmul and its reshaped output.
_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0",
                         "AddBackward0"})
_MATMUL_NODES = frozenset({"AddmmBackward0", "MmBackward0", "BmmBackward0", "LinearBackward0"})
# Between a softmax and the operand matmul saves: its broadcast, a dropout.
_MATMUL_PATH = frozenset({"ExpandBackward0", "NativeDropoutBackward0"})


def _tensor_arg(saved: Saved, index: int) -> torch.Tensor | None:
    args = saved.args
    return args[index] if len(args) > index and isinstance(args[index], torch.Tensor) else None


def _from_matmul(t: torch.Tensor) -> bool:
    """True if t (or, for an activation's saved output, its input) is a Linear's output."""
    node = t.grad_fn
    if node is not None and type(node).__name__ in ("SigmoidBackward0", "TanhBackward0"):
        node = node.next_functions[0][0] if node.next_functions else None
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0] if node.next_functions else None
    return node is not None and type(node).__name__ in _MATMUL_NODES


def _token_route(route: Route, site: Site, saved: Saved, x: torch.Tensor | None,
                 tokens: bool) -> Route | None:
    """`route` for a token tensor with the elements of x; the codec as saved for (N, F) and
    (N, C, H, W) maps; None (the module's rule) when t is not x's size.

    Args:
        tokens: t is a token tensor at rank 4 too ((N, H, W, C) grids); else only at rank 3.
    """
    t = saved.tensor
    if x is None or t.numel() != x.numel() or t.dim() < 2:
        return None
    if x.dim() == 3 or (x.dim() >= 3 and tokens):
        return route
    return site.routes.codec


def _linear(site: Site, saved: Saved) -> Route | None:
    # F.linear(x, w, b) and GPT-2's Conv1D torch.addmm(b, x.view(-1, F), w): the input's elements.
    x = _tensor_arg(saved, 1 if saved.func == "addmm" else 0)
    if saved.func == "addmm" and x is not None and saved.input is not None and (
            x.numel() == saved.input.numel()):
        x = saved.input  # the token shape before the module's view
    return _token_route(site.routes.features, site, saved, x, tokens=True)


def _activation(site: Site, saved: Saved) -> Route | None:
    # Its input (GELU, SiLU, ...) or its output (sigmoid, tanh): tokens after a Linear.
    x = _tensor_arg(saved, 0)
    return _token_route(site.routes.features, site, saved, x, tokens=_from_matmul(saved.tensor))


def _norm(site: Site, saved: Saved) -> Route | None:
    # layer_norm's input, RMSNorm's x.pow(2) input: per-token statistics (feat/tok).
    return _token_route(site.routes.tokens, site, saved, _tensor_arg(saved, 0), tokens=True)


def _product(site: Site, saved: Saved) -> Route | None:
    # a * b saves both factors; a full-size factor (not a broadcast statistic) goes feat/tok
    # (RMSNorm's normalised x, SwiGLU's factors, a layer scale's input).
    full = max((a.numel() for a in saved.args if isinstance(a, torch.Tensor)), default=0)
    t = saved.tensor
    if t.numel() != full:
        return KEEP
    if t.dim() == 3 or (t.dim() == 4 and _from_matmul(t)):  # (N, H, W, C): ConvNeXt's scale
        return site.routes.tokens
    return site.routes.codec if t.dim() >= 2 else KEEP


_SOFTMAX_NODES = frozenset({"SoftmaxBackward0", "SafeSoftmaxBackward0"})


def _probabilities(site: Site, saved: Saved, softmax: bool = False) -> Route | None:
    """Args: softmax: t is known to be a softmax's output (e.g. through a dropout)."""
    t = saved.tensor
    if not softmax and saved.op not in _SOFTMAX_NODES:
        return KEEP
    # A causal or masked softmax has exact zeros: decoded noise there carries gradient (errors
    # 9-98), and restoring the zeros exactly still left 5.2-5.7 on the trained GPT: kept.
    if t.dim() < 3 or bool((t == 0).any()):
        return KEEP
    return site.routes.attention


def _sdpa_call(site: Site, saved: Saved) -> SdpaCall | None:
    """The SDPA call `saved` belongs to: the site's current one, or a new one for new args."""
    division = site.routes.attention.codec
    if not isinstance(division, TokenLayout):
        return None
    call = site.sdpa() if site.sdpa is not None else None
    if call is None or call.call_id != saved.call_id:
        call = SdpaCall(saved.args, saved.kwargs, division, MIN_ELEMENTS, saved.call_id)
        call.routes = {
            **{r: Route("attention", call.inputs[r], layout="feat/chan", heads=True)
               for r in ROLES},
            **{r: Route("recomputed", call.outputs[r]) for r in ("out", "lse")},
            **{name: Route(name, codec) for name, codec in (call.math.codecs.items()
                                                           if call.math else ())}}
        site.sdpa = weakref.ref(call)
    return call


def _sdpa(site: Site, saved: Saved) -> Route | None:
    t = saved.tensor
    # Its fused backward recomputes exp(q k^T - logsumexp): with the exact logsumexp an error on
    # q or k enters exponentially. Where the saves can be recomputed (`attention.SdpaCall`: the
    # flash kernel, or the math backend's decomposition), q, k, v are packed and the rest
    # recomputed from their decoded forms, as a unit.
    call = _sdpa_call(site, saved)
    if call is not None and call.mode is not None:
        return call.route(t, saved.op) or KEEP
    if t.numel() < MIN_ELEMENTS:
        return KEEP if site.kind is Kind.NONE else None
    return _sdpa_kept_qk(site, saved)


def _sdpa_kept_qk(site: Site, saved: Saved) -> Route:
    # Where the kernel cannot be rerun, q and k stay exact; so do v and out with a mask or
    # is_causal (measured: no layout works there yet), and logsumexp and the RNG state.
    t = saved.tensor
    mask = setting(saved.args, saved.kwargs, "attn_mask", 3, None)
    causal = setting(saved.args, saved.kwargs, "is_causal", 5, False)
    if mask is not None or causal or t.dim() < 3 or any(
            same_view(t, _tensor_arg(saved, i)) for i in (0, 1)):
        return KEEP
    if same_view(t, _tensor_arg(saved, 2)) or saved.op.startswith("ScaledDotProduct"):
        return site.routes.attention
    return KEEP


def _attention_module(site: Site, saved: Saved) -> Route:
    # F.multi_head_attention_forward (nn.MultiheadAttention): its projections' inputs and the
    # probabilities (need_weights=True); q, k, v and SDPA's own saves stay exact.
    if saved.op in _SOFTMAX_NODES:
        return _probabilities(site, saved)
    x = _tensor_arg(saved, 0)
    t = saved.tensor
    if x is not None and t.dim() == 2 and t.numel() == x.numel():
        return site.routes.features if x.dim() == 3 else site.routes.codec
    return KEEP


def _matmul(site: Site, saved: Saved) -> Route:
    # Eager attention's probabilities (P @ v), also after a dropout (whose zeros keep them
    # exact when p > 0); q, k, v of eager attention stay exact.
    node = saved.tensor.grad_fn  # matmul saves (N * heads, T, T) views of 4D operands
    while node is not None and type(node).__name__ in _VIEW_NODES | _MATMUL_PATH:
        node = node.next_functions[0][0] if node.next_functions else None
    if node is not None and type(node).__name__ in _SOFTMAX_NODES:
        return _probabilities(site, saved, softmax=True)
    if isinstance(site.module, nn.Linear) and saved.is_input:
        return _linear(site, saved)  # a Linear computing x @ W.T itself (HF FalconLinear)
    return KEEP


_ACTIVATIONS = ("gelu", "silu", "hardswish", "hardsigmoid", "mish", "elu", "selu", "celu",
                "sigmoid", "tanh", "softplus")
_FUNCTION_CHOOSERS: dict[str, Callable[[Site, Saved], Route | None]] = {
    "relu": _relu, "relu_": _relu,  # F.relu, torch.relu, Tensor.relu: as nn.ReLU
    "linear": _linear, "addmm": _linear,
    **dict.fromkeys(_ACTIVATIONS, _activation),
    "layer_norm": _norm, "rms_norm": _norm, "pow": _norm,
    "mul": _product, "__mul__": _product, "__rmul__": _product,
    "softmax": _probabilities,
    "scaled_dot_product_attention": _sdpa,
    "multi_head_attention_forward": _attention_module,
    "matmul": _matmul, "bmm": _matmul,
}
"""Torch functions whose saves are routed by op (before the module's rule); None: the module's."""


def _by_function(site: Site, saved: Saved) -> Route | None:
    chooser = _FUNCTION_CHOOSERS.get(saved.func)
    if chooser is None or not site.functional:
        return None
    # SDPA's saves are routed as a unit: its chooser sizes them by the call's q
    if saved.tensor.numel() < MIN_ELEMENTS and chooser is not _sdpa:
        return KEEP if site.kind is Kind.NONE else None
    return chooser(site, saved)


def view_shape(route: Route, saved: Saved) -> tuple[int, ...] | None:
    """The shape the codec reads a tensor routed through `route` as (None: as saved)."""
    if not route.layout:
        return None
    t = saved.tensor
    logical = t.shape
    if t.dim() == 2:  # a Linear's (N * T, F) copy: the token shape of its input
        for x in (_tensor_arg(saved, 0), saved.input):
            if x is not None and x.dim() >= 3 and x.numel() == t.numel():
                logical = x.shape
                break
    layout = route.codec if isinstance(route.codec, TokenLayout) and not route.heads else None
    if layout is None:
        return token_view(tuple(logical), route.heads)
    return token_view(tuple(logical), False, grid=route.name == "features", group=GROUP_TOKENS)


def _declines(codec: Codec, t: torch.Tensor, shape) -> bool:
    """True when codec does not store t read as `shape` (None: as saved)."""
    if type(codec).accepts is Codec.accepts:  # accepts everything (no probe tensor to build)
        return False
    return not codec.accepts(t if shape is None else torch.empty(shape, dtype=t.dtype,
                                                                   device="meta"))


def _not_smaller(route: Route, t: torch.Tensor, shape) -> bool:
    """True when the packed form would hold at least t's own bytes (1x1 maps: 7 B vs 4)."""
    n = packed_nbytes(route.codec, tuple(shape if shape is not None else t.shape))
    return n is not None and n >= t.numel() * t.element_size()


def choose(site: Site, saved: Saved) -> Route:
    """The route of one saved tensor that is not a parameter (`route_for` without the view)."""
    return route_for(site, saved)[0]


def route_for(site: Site, saved: Saved) -> tuple[Route, tuple[int, ...] | None]:
    """The route of one saved tensor that is not a parameter, and the shape its codec reads.

    The op that saved it decides first (`_FUNCTION_CHOOSERS`), then the module's kind. A route
    whose packed form would not be smaller than the tensor is replaced by KEEP.

    Args:
        site: the innermost running module.
        saved: the tensor and what is known about it.

    Returns:
        (route, view): KEEP when no rule applies; view is the (M, T, F) token view for the
        token layouts, None for the tensor as saved.
    """
    route = _chosen(site, saved)
    if not route.copies:
        return route, None
    return _checked(site, route, saved)


def _chosen(site: Site, saved: Saved) -> Route:
    """The route a rule picks for `saved`, before the size and acceptance checks (KEEP: none)."""
    t = saved.tensor
    # An empty tensor (a zero-size batch) or a meta one (shape-only tracing) holds no bytes to
    # save; codecs refuse the one and cannot read the other.
    if t.numel() == 0 or t.layout != torch.strided or t.device.type == "meta":
        return KEEP
    if site.kind is Kind.MAXPOOL and t.dtype == torch.int64 and saved.input is not None:
        return _maxpool_indices(site, saved)
    if t.dtype not in CODEC_DTYPES:
        return KEEP
    route = _by_function(site, saved)
    if route is not None:
        return route
    if site.kind is Kind.NONE or saved.input is None:
        return KEEP
    return _FLOAT_CHOOSERS[site.kind](site, saved) or KEEP


def _checked(site: Site, route: Route, saved: Saved) -> tuple[Route, tuple[int, ...] | None]:
    """`route` with its token view, or KEEP where the codec declines the tensor or would not
    make it smaller."""
    t = saved.tensor
    shape = view_shape(route, saved)
    if shape is None and route.layout:
        route = site.routes.codec  # no token view (rank 2): the map rule
    elif route is site.routes.features and len(shape) == 4:
        route = site.routes.grids  # a channels-last grid: its 2D patches
    # A codec may decline a tensor (lfc/hfc: no spatial or sequence axis): it is then kept.
    if _declines(route.codec, t, shape) or _not_smaller(route, t, shape):
        return KEEP, None
    return route, shape
