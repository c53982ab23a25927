"""The `compress` context manager: hooks on entry, the pack hook, and clean removal on exit."""
from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from freqact import _validate
from freqact import codecs as _codecs
from freqact.codecs import base as _codec_base
from freqact.codecs.base import Codec
from freqact.codecs.division import Division
from freqact.engine import compiled, graph_meter
from freqact.engine.layouts import TokenLayout
from freqact.engine.meter import Meter
from freqact.engine.params import ParamIndex, is_fsdp_unit
from freqact.engine.recompute import Recompute, Recomputer
from freqact.engine.routes import (
    KEEP,
    PARAMETER,
    Kind,
    Route,
    Routes,
    Saved,
    Site,
    kind_of,
    route_for,
)
from freqact.engine.tracker import FunctionTracker

__all__ = ["compress"]

# Nesting would let the inner block's hooks hide saves from the outer meter; saved-tensor hooks are
# per thread, so nesting is refused per thread. Forward hooks are per module and fire in every
# thread, so a module is in at most one open block, whichever thread opened it.
_ACTIVE = threading.local()
_HOOKED: dict[int, str] = {}  # id(module) -> thread name of the block hooking it
_HOOKED_LOCK = threading.Lock()
RECOMPUTED = Route("recomputed-activation", Recompute())  # an output rebuilt from its packed input


class _Packed:
    """What a SavedVariable holds: its route and packed form (never the input itself).

    One packed form can back several SavedVariables (two ops saving the same tensor: RMSNorm's
    pow and mul, the q/k/v projections' shared input; `_Compress._pack` dedups them): `uses`
    counts them (and the recipes that rebuild a function's output from it, `recompute`), and
    a backward decodes it once for all of them (`decoded`).
    """

    __slots__ = ("__weakref__", "_decoded", "_pending", "data", "memory_format", "route", "shape",
                 "uses")

    def __init__(self, route: Route, data, memory_format=None, shape=None) -> None:
        self.route = route
        self.data = data
        self.memory_format = memory_format
        self.shape = shape  # the saved shape when the codec read a token view of it
        self.uses = 1
        self._decoded: torch.Tensor | None = None
        self._pending = 0

    def decoded(self) -> torch.Tensor:
        """The codec's decode of `data`, computed once per round of `uses` unpacks.

        The first unpack decodes and, when other SavedVariables share this form, holds the result
        for them until the last of them has unpacked it (within one backward: the ops that saved
        the same tensor are differentiated close together); a second backward over a retained
        graph decodes again. Decoding never frees the packed form. Kept tensors (`Exact`) are
        never held: their unpack checks the version at every call.
        """
        x = self._decoded
        if x is not None:
            self._pending -= 1
            if self._pending == 0:
                self._decoded = None
            return x
        x = self.route.codec.decode(self.data)
        if self.uses > 1 and self.route.copies:
            self._decoded, self._pending = x, self.uses - 1
        return x


class _Coded(NamedTuple):
    """A coded form of a storage (`_Compress._coded`): where it came from and what it was charged.

    Attributes:
        storage, packed: weak references to the storage and the `_Packed` coding it.
        size, stride, offset, dtype, version: the saved tensor's view of the storage, and its
            version at the save.
        site: the layer charged; label: the route charged; held, plain: the bytes charged.
    """

    storage: weakref.ref
    packed: weakref.ref
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    version: int
    site: Site
    label: str
    held: int
    plain: int


def _memory_format(t: torch.Tensor):
    """The channels-last format t is in (codecs decode contiguous), else None."""
    if t.is_contiguous() or t.layout != torch.strided:
        return None
    for fmt, dim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if t.dim() == dim and t.is_contiguous(memory_format=fmt):
            return fmt
    return None


def _encode(route: Route, t: torch.Tensor, view=None) -> _Packed:
    if not route.copies:
        # Held as is, but detached: a saved output's own grad_fn is the node that saves it, so
        # holding t itself would close a cycle through C++ that no collector frees (a forward
        # without backward kept its whole graph). Autograd rebuilds the unpacked tensor's history
        # from its own records; detach() keeps the storage and the version counter.
        return _Packed(route, route.codec.encode(t.detach()))
    if view is not None:
        codec = route.codec  # a token layout reads attention's (N, heads, T, d) views in place
        data = (codec.encode(t, view=view) if isinstance(codec, TokenLayout)
                else codec.encode(t.reshape(view)))
        return _Packed(route, data, shape=t.shape)
    data = route.codec.encode(t.t() if route.channels else t)
    return _Packed(route, data, _memory_format(t))


def _unpack(packed: _Packed) -> torch.Tensor:
    """The saved tensor from its packed form, computed as outside autocast whatever autocast
    state backward runs in (inside an autocast block a decode's or rerun's matmuls would run in
    its lower precision: SDPA's MATH-backend saves came back in bfloat16)."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return _unpack(packed)
    x = packed.decoded()
    if packed.shape is not None:
        return x.view(packed.shape)
    if packed.route.channels:
        x = x.t()
    if packed.memory_format is not None:
        # backward picks its kernels and output layout from the saved tensor's memory format
        x = x.contiguous(memory_format=packed.memory_format)
    return x


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
    items = list(items)
    if not items and arg_name == "include":
        raise ValueError("include: an empty list would compress nothing; pass None for the "
                         "default types")
    types, names = [], []
    for item in items:
        if isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        elif isinstance(item, str):
            if item not in model_names:
                hint = (f" (a module type is passed as the class: torch.nn.{item})"
                        if isinstance(getattr(nn, item, None), type) else "")
                raise ValueError(f"{arg_name}: no module named {item!r} in the model{hint}")
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


def _whole_model(cls_or_codec) -> bool:
    return getattr(cls_or_codec, "whole_model", True)


def _build_codec(codec, params: dict) -> Codec:
    """The block's codec from a name or an instance; only whole-model codecs are accepted."""
    if isinstance(codec, Codec):
        if params:
            raise TypeError(f"params: settings {sorted(params)} are only accepted with a codec "
                            f"name, got a {type(codec).__name__} instance")
        name = codec.name
    elif isinstance(codec, str):
        name = codec
    else:
        raise TypeError(f"codec: expected a codec name or a Codec, got {type(codec).__name__}")
    registry = _codec_base._REGISTRY
    accepted = tuple(n for n in _codecs.names() if _whole_model(registry[n]))
    if isinstance(codec, str) and name not in registry:  # the engine's own codecs not offered
        _validate.choice("codec", name, accepted)
    if not _whole_model(registry[name] if isinstance(codec, str) else codec):
        # masks, indices and shape-only are exact only for the tensors the engine routes to them
        raise ValueError(f"codec: expected a whole-model codec ({', '.join(accepted)}), got "
                         f"{name!r} (the engine applies it itself where it is exact)")
    return _codecs.get(codec, **params) if isinstance(codec, str) else codec


def _kind(name: str, module: nn.Module, include, inc: tuple, exc: tuple) -> tuple[Kind, bool]:
    """The module's routing kind after include/exclude (exclude wins), and whether the ops run
    directly in it are routed by op (everywhere without include; in included names only)."""
    kind = kind_of(module)
    if include is not None:
        if not _matches(name, module, *inc):
            kind = Kind.NONE
        elif kind is Kind.NONE and inc[0] and isinstance(module, inc[0]):
            kind = Kind.CODEC
    if _matches(name, module, *exc):
        return Kind.NONE, False
    return kind, include is None or _matches(name, module, *inc)


def compress(model: nn.Module, codec: str | Codec = "division", *, include=None, exclude=None,
             **params) -> _Compress:
    """Compress the activations autograd caches during the forward passes run in the block.

    Args:
        model: any nn.Module; it is hooked, never modified.
        codec: a whole-model codec name (built with `freqact.codecs.get(codec, **params)`: exact,
            division, lfc, ...) or a Codec instance. The cheap codecs (relu-mask, shape-only, ...)
            are exact only where the engine applies them and are refused here.
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
        ValueError: unknown or not whole-model codec, or an include/exclude name not in the model.
        RuntimeError (on entry): a block is already open in this thread, the model is inside a
            block of another thread, or a module cannot be hooked (e.g. a TorchScript module).

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
        >>> with compress(net, "division", block=4, bits=2) as meter:
        ...     loss = net(torch.randn(2, 3, 8, 8)).sum()
        >>> loss.backward()
        >>> meter.saved_bytes < meter.exact_bytes
        True
    """
    return _Compress(model, codec, include, exclude, params)


class _Compress:
    def __init__(self, model, codec, include, exclude, params) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
        self.codec = _build_codec(codec, params)
        self.model = model
        self._graph = compiled.spec_for(model, self.codec, include, exclude)
        named = dict(model.named_modules())
        inc = _split_selectors("include", include, set(named))
        exc = _split_selectors("exclude", exclude, set(named))
        routes = Routes.for_codec(self.codec)
        self._sites = []
        for name, module in named.items():
            kind, functional = _kind(name, module, include, inc, exc)
            self._sites.append(Site(name, module, kind, routes, functional))
        self._root = self._sites[0]
        self.meter = Meter()
        self._handles: list = []
        self._claimed: list[int] = []

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Meter:
        if getattr(_ACTIVE, "on", False):
            raise RuntimeError(
                "compress: blocks cannot be nested; one block covers the whole forward (to "
                "compress several models at once, pass them in one nn.ModuleList)")
        self._claim()
        _ACTIVE.on = True
        self._thread = threading.get_ident()
        self._stack: list[tuple] = []
        # key -> (storage weakref, _Packed weakref): never keeps a tensor or packed form alive.
        self._dedup: dict[tuple, tuple] = {}
        # storage ptr -> (storage weakref, layer site it is charged to), as plain PyTorch holds it
        self._owner: dict[int, tuple] = {}
        # storage ptr -> (storage ref, ref of the latest packed form holding it as is)
        self._held: dict[int, tuple] = {}
        # storage ptr -> the coded forms of it, as `_Coded` records, until a save keeps it as is
        self._coded: dict[int, list[_Coded]] = {}
        # outputs rebuilt from their packed inputs: under the full `division` codec only
        self._recompute = Recomputer(_unpack) if type(self.codec) is Division else None
        try:
            self._params = ParamIndex(self.model)
            self._install()
        except BaseException:
            self._release()
            raise
        return self.meter

    def _claim(self) -> None:
        """Mark every module as inside this block; refuse modules another thread's block hooks."""
        me = threading.current_thread().name
        with _HOOKED_LOCK:
            for site in self._sites:
                other = _HOOKED.get(id(site.module))
                if other is not None:
                    self._unclaim_locked()
                    raise RuntimeError(
                        f"compress: module {site.name or '(model)'!r} is already inside a compress "
                        f"block of thread {other!r}; one block per model at a time (give each "
                        f"thread its own copy of the model)")
                _HOOKED[id(site.module)] = me
                self._claimed.append(id(site.module))

    def _unclaim_locked(self) -> None:
        for key in self._claimed:
            _HOOKED.pop(key, None)
        self._claimed = []

    def _install(self) -> None:
        if self._graph is not None:  # a compiled model: the codec runs inside its graphs
            # the meter first: a failure there leaves no hooks behind (`_release` removes it)
            self._handles.append(graph_meter.attach(self.model, graph_meter.Charger(
                self.meter, self.model, self._params)))
            self._handles.append(self.model.register_forward_pre_hook(
                compiled.static_inputs, with_kwargs=True))
            self._hooks = compiled.installed(self._graph)
            self._hooks.__enter__()
            return
        for site in self._sites:
            try:
                self._handles.append(site.module.register_forward_pre_hook(
                    functools.partial(self._push, site), with_kwargs=True))
                self._handles.append(site.module.register_forward_hook(self._pop,
                                                                       always_call=True))
            except RuntimeError as err:
                raise RuntimeError(f"compress: cannot hook module {site.name or '(model)'!r} "
                                   f"({site.type_name}): {err}") from err
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        self._functions = FunctionTracker(self._recompute.returned if self._recompute else None)
        self._functions.__enter__()

    def _release(self) -> None:
        """Remove every hook and drop everything but the meter (packed forms live in the graph)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._stack, self._dedup = [], [], {}
        if self._recompute is not None:  # the tracker's on_return still refers to it
            self._recompute.clear()
        self._owner, self._held, self._coded, self._recompute = {}, {}, {}, None
        with _HOOKED_LOCK:
            self._unclaim_locked()
        _ACTIVE.on = False

    def __exit__(self, *exc) -> None:
        if self._graph is None:  # compiled models track no functions
            self._functions.__exit__(*exc)
        self._hooks.__exit__(*exc)
        self._release()

    def _push(self, site: Site, module, args, kwargs) -> None:
        if threading.get_ident() != self._thread:
            return  # another thread's plain forward: its saves are not ours
        if is_fsdp_unit(module):  # FSDP2's pre-forward hook (run before this one) unsharded it
            self._params.moved()
        if site.kind is Kind.NONE:
            self._stack.append((site, None))
            return
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        self._stack.append((site, first))

    def _pop(self, module, args, output) -> None:
        # always_call also runs this hook when an earlier pre-hook raised before our push.
        if threading.get_ident() != self._thread:
            return
        if is_fsdp_unit(module):  # FSDP2's post-forward hook (run before this one) may reshard
            self._params.moved()
        if self._stack and self._stack[-1][0].module is module:
            self._stack.pop()

    # -- the pack hook ---------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> _Packed:
        func = self._functions.current
        packed = self._packed_form(t, func)
        if self._recompute is not None:  # every save, whatever its route: dedup hits, parameters
            self._recompute.saw_input(func, t, packed)
        return packed

    def _packed_form(self, t: torch.Tensor, func: tuple | None) -> _Packed:
        """t's packed form: a fresh encode, a dedup hit, a recipe, or t held as is."""
        site, x = self._stack[-1] if self._stack else (self._root, None)
        storage = None if t.is_nested else _storage(t)
        if storage is None:
            # Sparse and nested tensors: no codec reads them, so they are kept exactly (always
            # correct); they are not one dense buffer, so they are not counted in bytes.
            self.meter._record(site.name, site.type_name, KEEP.label)
            return _encode(KEEP, t)
        ptr = storage.data_ptr()
        if self._params.derived(t, ptr, site.module):
            return _encode(PARAMETER, t)
        route, view = route_for(site, self._describe(t, x, func))
        as_is = self._held.get(ptr)
        if route.copies and as_is is not None and as_is[0]() is storage and as_is[1]() is not None:
            # a save still holds the storage as is (another rule keeps it: include= leaving that
            # module out): a copy beside it would hold more than plain PyTorch, for nothing
            route, view = KEEP, None
        recipe = (self._recompute.recipe_for(t, storage, ptr, route)
                  if route.copies and self._recompute is not None else None)
        if recipe is not None:
            route, view = RECOMPUTED, None
        self.meter._record(site.name, site.type_name, route.label)
        # Contiguous tensors read through the same token view hold the same elements (a
        # softmax's (N, heads, T, T) output and matmul's (N * heads, T, T) view of it).
        layout = (view, ()) if view is not None and t.is_contiguous() else (t.shape, t.stride())
        key = (ptr, t.storage_offset(), *layout, t.dtype, t._version, id(route))
        hit = self._dedup.get(key)
        packed = hit[1]() if hit is not None and hit[0]() is storage else None
        if packed is None and not route.copies:
            self._uncode(ptr, storage, t)
        owner = self._charged_to(ptr, storage, site)
        # a coded form a later save keeping the storage turns into a view (`_uncode`)
        codable = route.copies and recipe is None and route.codec.standalone
        if packed is not None:
            if packed.shape is not None and packed.shape != t.shape:
                # the same elements through another view of the storage: decode to t's shape
                variant = _Packed(route, packed.data, shape=t.shape)
                if codable:  # it holds the same coded data: held as is with the first, nothing
                    self._add_coded(ptr, storage, variant, t, owner[1], route.label, 0, 0)
                return variant
            packed.uses += 1
            return packed
        if recipe is not None:
            packed = _Packed(route, recipe, shape=t.shape)
            for _, shared in recipe.inputs:  # decoded once for the function's backward and the recipe
                shared.uses += 1
        else:
            packed = _encode(route, t, view)
        self._dedup[key] = (weakref.ref(storage), weakref.ref(packed))
        held = self._held_bytes(route, packed, ptr, storage)
        self.meter._charge(owner[1].name, owner[1].type_name, route.label, held, owner[2])
        self._owner[ptr] = (owner[0], owner[1], 0)  # plain bytes are charged once
        if codable:
            self._add_coded(ptr, storage, packed, t, owner[1], route.label, held, owner[2])
        return packed

    def _add_coded(self, ptr: int, storage, packed: _Packed, t: torch.Tensor, site: Site,
                   label: str, held: int, plain: int) -> None:
        self._coded.setdefault(ptr, []).append(_Coded(
            weakref.ref(storage), weakref.ref(packed), t.size(), t.stride(), t.storage_offset(),
            t.dtype, t._version, site, label, held, plain))

    def _uncode(self, ptr: int, storage, t: torch.Tensor) -> None:
        """A save keeps t's storage as it is: hold its earlier coded forms as they are too.

        The storage is held whole anyway, so a coded copy beside it is bytes for nothing (a
        tanh's output coded for its own backward, then kept by a plain `matmul` reading it): each
        form that still describes the storage's values (same version, same dtype) becomes t's
        view of its shape, strides and offset, held as is, and its charge is taken back (its
        plain bytes are charged again with this save). The reverse order is `_packed_form`'s
        `_held` rule. Codecs that are not `standalone` are never swapped: an SDPA call recomputes
        its other saves from its q, k, v's decodes, and an exact k beside the logsumexp of the
        decoded one gave gradients 287 times too large."""
        for coded in self._coded.pop(ptr, ()):
            packed = coded.packed()
            if (packed is None or coded.storage() is not storage or coded.version != t._version
                    or coded.dtype != t.dtype):
                continue
            view = t.detach().as_strided(coded.size, coded.stride, coded.offset)
            packed.route, packed.data = KEEP, KEEP.codec.encode(view)
            packed.shape = packed.memory_format = None
            self.meter._charge(coded.site.name, coded.site.type_name, coded.label, -coded.held,
                               -coded.plain)
            entry = self._owner.get(ptr)
            if entry is not None and entry[0]() is storage:
                self._owner[ptr] = (entry[0], entry[1], entry[2] + coded.plain)

    @staticmethod
    def _describe(t: torch.Tensor, x: torch.Tensor | None, func: tuple | None) -> Saved:
        x_storage = _storage(x) if x is not None else None
        is_input = x_storage is not None and t.untyped_storage().data_ptr() == x_storage.data_ptr()
        op = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
        return Saved(t, op, x, is_input, *(func or ()))

    def _charged_to(self, ptr: int, storage, site: Site) -> tuple:
        """(storage ref, layer site, plain bytes still to charge) for a saved storage.

        The first layer that saves a live storage is charged with it; freed addresses are reused,
        so an entry counts only while its storage is the same object.
        """
        entry = self._owner.get(ptr)
        if entry is None or entry[0]() is not storage:
            entry = (weakref.ref(storage), site, storage.nbytes())
            self._owner[ptr] = entry
        return entry

    def _held_bytes(self, route: Route, packed: _Packed, ptr: int, storage) -> int:
        if route.copies:
            return packed.data.nbytes
        # Held as is: the storage counts once, however many routes keep it (and while a form
        # holding it lives, later saves of it are kept too: `_packed_form`).
        entry = self._held.get(ptr)
        self._held[ptr] = (weakref.ref(storage), weakref.ref(packed))
        return 0 if entry is not None and entry[0]() is storage else storage.nbytes()
