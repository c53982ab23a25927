"""Training with compressed activations: `compress(model, codec)` around the forward pass.

::

    with freqact.compress(model, "division", block=8, bits=2) as meter:
        loss = criterion(model(x), y)
    loss.backward()
    meter.ratio, meter.saved_bytes, meter.exact_bytes, meter.per_layer()

One `torch.autograd.graph.saved_tensors_hooks` pair is active inside the `with` block, and forward
pre-/post-hooks on every module keep a stack telling the pack hook which module is running. Each
tensor autograd saves is routed by that module and by what the tensor is:

- a parameter or buffer, a view of one (`weight.t()`) or an autocast copy of one: kept as is and not
  counted (it is not activation memory);
- the input of a Conv/Linear/BatchNorm/LayerNorm/GroupNorm (or of an `include`d type): the codec;
- a ReLU's output: 1-bit `relu-mask`; a ReLU6/Hardtanh input: 1-bit `hardtanh-mask`; a LeakyReLU
  input or output: 1-bit `sign-mask`; dropout's scaled noise: 1-bit `dropout-mask`;
- MaxPool's int64 indices: uint8 window offsets (`maxpool-indices`); MaxPool/AvgPool inputs, whose
  values backward never reads: `shape-only` (0 bytes);
- anything else (functional ops such as `F.relu`, attention, small statistics): kept as is.

Kept tensors are checked for in-place modification at unpack (an error, as in plain PyTorch);
compressing codecs copy, so their gradients reflect the values at save time. A tensor saved by
several ops is packed once per route. Modules are never replaced: weights, initialisation and state
are untouched, and all hooks are removed on exit; only the meter survives the `with` block.
Non-finite values stay visible, never turn into finite garbage: a NaN/Inf in a map the codec
stores makes that map decode non-finite (all NaN for division, division-no-lfc and quant, see
docs/ARCHITECTURE.md; its block for division-no-hfc; the DCT spreads it for lfc/hfc), so gradients
that read it come out NaN as in plain PyTorch; the 1-bit masks treat NaN exactly as PyTorch's own
backward does (NaN > 0 is false). A zero-size batch saves nothing and is kept as is.
Functional activations (`F.relu`) are kept exactly, not masked: a pack hook cannot tell the
activation's own save from a later op saving the same output, and guessing wrong would corrupt
gradients. The model zoo uses activation modules.

Not supported (refused or documented): nesting `compress` blocks (RuntimeError), several threads
running forwards of the same `compress` block, and `torch.compile` (saved-tensor hooks save no
memory there). `torch.utils.checkpoint(..., use_reentrant=False)` inside the block works: the
checkpointed regions save through checkpoint's own hooks (recomputation never reaches the codec)
and the meter counts only what the block saves itself, checkpoint's saved inputs included.
"""
from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from freqact import codecs as _codecs
from freqact.codecs.base import Codec, Exact
from freqact.codecs.cheap import (
    DropoutMask, HardtanhMask, MaxPoolIndices, ReluMask, ShapeOnly, SignMask,
)

__all__ = ["compress", "Meter", "DEFAULT_TYPES"]

# Module kinds: how the tensors saved inside a module of that type are routed.
_NONE, _CODEC, _RELU, _HARDTANH, _LEAKY, _DROPOUT, _MAXPOOL, _AVGPOOL = range(8)

DEFAULT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm,
)
"""Module types whose input goes through the codec when `include` is None."""

# Checked in order: ReLU6 is a Hardtanh subclass.
_KIND_BY_TYPE: tuple[tuple[tuple[type[nn.Module], ...], int], ...] = (
    (DEFAULT_TYPES, _CODEC),
    ((nn.ReLU,), _RELU),
    ((nn.Hardtanh,), _HARDTANH),
    ((nn.LeakyReLU,), _LEAKY),
    ((nn.Dropout,), _DROPOUT),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d), _MAXPOOL),
    ((nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
      nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d), _AVGPOOL),
)
_MAXPOOL_DIMS = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}

# Autograd nodes an autocast copy or a view of a parameter goes through before its AccumulateGrad.
_PARAM_PATH_NODES = frozenset({
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
    "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0",
})

# Kept tensors and parameters go through `Exact`: no copy, and an in-place edit after saving raises
# at unpack instead of silently changing the gradient (saved-tensor hooks bypass PyTorch's check).
_EXACT = Exact()
_RELU_MASK, _SIGN_MASK = ReluMask(), SignMask()
_DROPOUT_MASK, _SHAPE_ONLY = DropoutMask(), ShapeOnly()

# Nesting would let the inner block's hooks hide saves from the outer meter; refuse it per thread.
_ACTIVE = threading.local()


class Meter:
    """Bytes autograd holds for backward, measured at pack time, per layer and per route.

    `saved_bytes` counts every saved tensor once per storage (compressed forms, masks, indices, kept
    statistics); `exact_bytes` counts what plain PyTorch would hold for the same forward (each live
    storage of a saved tensor once). Parameters and tensors derived from them are in neither. After
    the forward pass the numbers describe what autograd holds; several forwards in one block add up.
    A storage saved by several layers counts once, for the first layer that saved it (so a conv
    reading a ReLU's output shows exact_bytes 0: the ReLU row holds them).
    """

    def __init__(self) -> None:
        self._layers: dict[str, list] = {}  # name -> [type name, saved, exact, count]
        self._routes: dict[str, list] = {}  # route -> [saved, exact, count]

    def _add(self, layer: str, module_type: str, route: str, saved: int, exact: int) -> None:
        row = self._layers.get(layer)
        if row is None:
            row = self._layers[layer] = [module_type, 0, 0, 0]
        row[1] += saved
        row[2] += exact
        row[3] += 1
        cell = self._routes.get(route)
        if cell is None:
            cell = self._routes[route] = [0, 0, 0]
        cell[0] += saved
        cell[1] += exact
        cell[2] += 1

    @property
    def saved_bytes(self) -> int:
        """Bytes held for backward with compression."""
        return sum(row[1] for row in self._layers.values())

    @property
    def exact_bytes(self) -> int:
        """Bytes plain PyTorch holds for backward for the same forward."""
        return sum(row[2] for row in self._layers.values())

    @property
    def ratio(self) -> float:
        """exact_bytes / saved_bytes (inf when nothing is held, 1.0 when nothing was saved)."""
        return _ratio(self.exact_bytes, self.saved_bytes)

    def per_layer(self) -> list[dict]:
        """One dict per module that saved tensors, in forward order.

        Keys: `layer` (qualified name, "" for the model itself), `type` (module class name),
        `saved_bytes`, `exact_bytes`, `ratio`, `count` (saved tensors, shared ones included).
        """
        return [
            {"layer": name, "type": kind, "saved_bytes": saved, "exact_bytes": exact,
             "ratio": _ratio(exact, saved), "count": count}
            for name, (kind, saved, exact, count) in self._layers.items()
        ]

    def by_route(self) -> dict[str, dict]:
        """Totals per route: the codec name, a cheap codec name, or "kept"."""
        return {
            route: {"saved_bytes": saved, "exact_bytes": exact, "ratio": _ratio(exact, saved),
                    "count": count}
            for route, (saved, exact, count) in self._routes.items()
        }

    def __repr__(self) -> str:
        return (f"Meter(saved_bytes={self.saved_bytes}, exact_bytes={self.exact_bytes}, "
                f"ratio={self.ratio:.2f})")


def _ratio(exact: int, saved: int) -> float:
    if saved == 0:
        return math.inf if exact else 1.0
    return exact / saved


class _Packed:
    """What a SavedVariable holds: the codec and its packed form (never the input itself)."""

    __slots__ = ("codec", "data", "__weakref__")

    def __init__(self, codec: Codec, data) -> None:
        self.codec = codec
        self.data = data


def _unpack(packed: _Packed) -> torch.Tensor:
    # Decoding never frees the packed form, so retain_graph=True can unpack twice.
    return packed.codec.decode(packed.data)


class _ModuleInfo:
    __slots__ = ("name", "type_name", "kind", "module", "params")

    def __init__(self, name: str, module: nn.Module, kind: int) -> None:
        self.name = name
        self.type_name = type(module).__name__
        self.kind = kind
        self.module = module
        # Own parameters/buffers, for telling a frozen weight's autocast copy from an input copy.
        self.params = tuple(module.parameters(recurse=False)) + tuple(module.buffers(recurse=False))


def _storage(t: torch.Tensor):
    """t's untyped storage, or None for tensors without one (sparse, nested, ...)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _split_selectors(arg_name: str, value, model_names: set[str]) -> tuple[tuple, tuple]:
    """Validate include/exclude: None, a module type, a module name, or an iterable of those."""
    if value is None:
        return (), ()
    items = [value] if isinstance(value, (str, type)) else value
    if not isinstance(items, Iterable):
        raise TypeError(f"{arg_name}: expected a module type, a module name or a list of them, "
                        f"got {type(value).__name__}")
    types, names = [], []
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        elif isinstance(item, str):
            if item not in model_names:
                raise ValueError(f"{arg_name}: no module named {item!r} in the model")
            names.append(item)
        else:
            raise TypeError(
                f"{arg_name}: expected nn.Module subclasses or module names, got {item!r}")
    return tuple(types), tuple(names)


def _matches(name: str, module: nn.Module, types: tuple, names: tuple) -> bool:
    if types and isinstance(module, types):
        return True
    # "" is the model itself and contains everything.
    return any(n == "" or name == n or name.startswith(n + ".") for n in names)


def compress(model: nn.Module, codec: str | Codec = "division", *, include=None, exclude=None,
             **params) -> "_Compress":
    """Compress the activations autograd caches during the forward passes run in the block.

    Args:
        model: any nn.Module; it is hooked, never modified.
        codec: a codec name (built with `freqact.codecs.get(codec, **params)`) or a Codec instance.
        include: None (the `DEFAULT_TYPES`, activations and pools everywhere), or module types
            and/or qualified module names (a name covers its submodules) to restrict compression to.
            An included type outside the default kinds has its input sent through the codec.
        exclude: module types and/or names never compressed (their saves are kept as is).
        **params: the codec's settings when `codec` is a name (e.g. block=8, bits=2).

    Returns:
        A context manager; entering it yields the `Meter`.

    Raises:
        TypeError: model is not an nn.Module, codec is neither a name nor a Codec, params given
            with a Codec instance, or include/exclude hold something else than types and names.
        ValueError: unknown codec name, or an include/exclude name not in the model.
    """
    return _Compress(model, codec, include, exclude, params)


class _Compress:
    def __init__(self, model, codec, include, exclude, params) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        if isinstance(codec, Codec):
            if params:
                raise TypeError(f"params: settings {sorted(params)} are only accepted with a codec "
                                f"name, got a {type(codec).__name__} instance")
        elif isinstance(codec, str):
            codec = _codecs.get(codec, **params)
        else:
            raise TypeError(f"codec: expected a codec name or a Codec, got {type(codec).__name__}")
        self.codec = codec
        self.model = model
        named = dict(model.named_modules())
        inc_types, inc_names = _split_selectors("include", include, set(named))
        exc_types, exc_names = _split_selectors("exclude", exclude, set(named))
        self._infos: list[_ModuleInfo] = []
        for name, module in named.items():
            kind = next((k for types, k in _KIND_BY_TYPE if isinstance(module, types)), _NONE)
            if include is not None:
                if not _matches(name, module, inc_types, inc_names):
                    kind = _NONE
                elif kind == _NONE and inc_types and isinstance(module, inc_types):
                    kind = _CODEC
            if _matches(name, module, exc_types, exc_names):
                kind = _NONE
            self._infos.append(_ModuleInfo(name, module, kind))
        self._root = self._infos[0]
        self.meter = Meter()

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Meter:
        if getattr(_ACTIVE, "on", False):
            raise RuntimeError(
                "compress: blocks cannot be nested; one block covers the whole forward (to "
                "compress several models at once, pass them in one nn.ModuleList)")
        _ACTIVE.on = True
        self._stack: list[tuple] = []
        # key -> (storage weakref, _Packed weakref): never keeps a tensor or packed form alive.
        self._dedup: dict[tuple, tuple] = {}
        self._exact_seen: dict[int, weakref.ref] = {}  # storage ptr -> storage (plain PyTorch)
        self._held_seen: dict[int, weakref.ref] = {}  # storage ptr -> storage (kept as is)
        # Parameters and buffers stay alive during the block, so their addresses cannot be reused.
        self._param_ptrs = {
            t.untyped_storage().data_ptr()
            for t in (*self.model.parameters(), *self.model.buffers())
        } - {0}
        self._handles = []
        for info in self._infos:
            self._handles.append(info.module.register_forward_pre_hook(
                functools.partial(self._push, info), with_kwargs=True))
            self._handles.append(info.module.register_forward_hook(self._pop, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self.meter

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        # Drop everything but the meter: packed forms live on in the graph only.
        self._handles, self._stack, self._dedup = [], [], {}
        self._exact_seen, self._held_seen, self._param_ptrs = {}, {}, set()
        _ACTIVE.on = False

    def _push(self, info: _ModuleInfo, module, args, kwargs) -> None:
        if info.kind == _NONE:
            self._stack.append((info, ()))
            return
        inputs = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        self._stack.append((info, inputs))

    def _pop(self, module, args, output) -> None:
        # always_call also runs this hook when an earlier pre-hook raised before our push.
        if self._stack and self._stack[-1][0].module is module:
            self._stack.pop()

    # -- the pack hook ---------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> _Packed:
        info, inputs = self._stack[-1] if self._stack else (self._root, ())
        storage = _storage(t)
        if storage is None:
            return _Packed(_EXACT, _EXACT.encode(t))
        ptr = storage.data_ptr()
        if ptr in self._param_ptrs or self._from_param(t):
            return _Packed(_EXACT, _EXACT.encode(t))
        codec = self._route(t, ptr, info, inputs)
        key = (ptr, t.storage_offset(), t.shape, t.stride(), t.dtype, t._version, id(codec))
        hit = self._dedup.get(key)
        packed = hit[1]() if hit is not None and hit[0]() is storage else None
        if packed is not None:
            saved = 0
        else:
            packed = _Packed(codec, codec.encode(t))
            self._dedup[key] = (weakref.ref(storage), weakref.ref(packed))
            if isinstance(codec, Exact):
                saved = self._first_sight(self._held_seen, ptr, storage)
            else:
                saved = packed.data.nbytes
        route = codec.name if codec is not _EXACT else "kept"
        exact = self._first_sight(self._exact_seen, ptr, storage)
        self.meter._add(info.name, info.type_name, route, saved, exact)
        return packed

    @staticmethod
    def _first_sight(seen: dict, ptr: int, storage) -> int:
        """storage's bytes the first time it is seen alive, else 0 (freed addresses are reused)."""
        ref = seen.get(ptr)
        if ref is not None and ref() is storage:
            return 0
        seen[ptr] = weakref.ref(storage)
        return storage.nbytes()

    def _from_param(self, t: torch.Tensor) -> bool:
        """True if t is an autocast copy or a view of a parameter, found by autograd history."""
        node = t.grad_fn
        while node is not None and type(node).__name__ in _PARAM_PATH_NODES:
            node = node.next_functions[0][0] if node.next_functions else None
        if node is None or type(node).__name__ != "AccumulateGrad":
            return False
        return node.variable.untyped_storage().data_ptr() in self._param_ptrs

    def _route(self, t: torch.Tensor, ptr: int, info: _ModuleInfo, inputs: tuple) -> Codec:
        kind = info.kind
        # An empty tensor (a zero-size batch) holds no bytes to save; codecs refuse it.
        if kind == _NONE or not inputs or t.numel() == 0:
            return _EXACT
        x = inputs[0]
        if kind == _MAXPOOL and t.dtype == torch.int64:
            return self._maxpool_codec(info.module, x)
        if not t.is_floating_point():
            return _EXACT
        x_storage = _storage(x)
        is_input = x_storage is not None and ptr == x_storage.data_ptr()
        if kind == _CODEC:
            # The input itself or a view of it, or its autocast copy (a cast: another dtype).
            if t.dim() >= 2 and (is_input or (t.dtype != x.dtype and t.numel() == x.numel()
                                              and not self._param_copy(t, info))):
                return self.codec
        elif kind in (_MAXPOOL, _AVGPOOL):
            if is_input:
                return _SHAPE_ONLY
        elif kind == _RELU:
            # nn.ReLU runs only relu, which saves its own output.
            if type(t.grad_fn).__name__ == "ReluBackward0":
                return _RELU_MASK
        elif t.numel() == x.numel():
            # Hardtanh/LeakyReLU save their input (a clone of it when in place) or, for an in-place
            # LeakyReLU, their output; dropout saves its noise. Nothing else is saved in them.
            if kind == _HARDTANH:
                return HardtanhMask(info.module.min_val, info.module.max_val)
            if kind == _LEAKY:
                return _SIGN_MASK
            if kind == _DROPOUT and t.grad_fn is None and not is_input:
                return _DROPOUT_MASK
        return _EXACT

    @staticmethod
    def _param_copy(t: torch.Tensor, info: _ModuleInfo) -> bool:
        """True if t (not sharing the input's storage) is a cast copy of one of the module's own
        parameters, e.g. a frozen weight under autocast (no autograd history to follow)."""
        if t.grad_fn is not None:
            return False
        flat = None
        for p in info.params:
            if p.numel() == t.numel():
                if flat is None:
                    # t may be a transposed view of the copy: compare the whole storage, flat.
                    flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
                cast = p.detach().reshape(-1).to(t.dtype)
                if flat.numel() == p.numel() and torch.equal(flat, cast):
                    return True
        return False

    @staticmethod
    def _maxpool_codec(module: nn.Module, x: torch.Tensor) -> Codec:
        dims = next(d for cls, d in _MAXPOOL_DIMS.items() if isinstance(module, cls))
        try:
            return MaxPoolIndices(module.kernel_size, module.stride, module.padding,
                                  module.dilation, input_size=tuple(x.shape[-dims:]))
        except ValueError:  # a window over 256 elements: offsets would not fit a byte
            return _EXACT
