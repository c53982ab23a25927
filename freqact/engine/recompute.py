"""Saved outputs rebuilt from a packed argument: f(x_hat) in backward, no second copy.

A GELU (SiLU, Hardswish, Mish) saves its input for its own backward, and the next layer saves its
output for the next weight gradient: under `division` both were encoded, the output being a
cheap function of an input already packed. Llama's RMSNorm has a product of the same kind:
`x_n = x * rsqrt(mean(x^2) + eps)` saves x (packed, shared with `x.pow(2)`) and the (N, T, 1)
statistic (kept exact), and `weight * x_n` saves x_n again, both (N, T, F).

The rule: when one of `RECOMPUTABLE`'s functions or a `PRODUCTS` call saved its tensor arguments
so that exactly one was packed by a copying route (a codec, or itself a recipe) and every other
is held as is by the same call (a parameter, a small statistic kept exact: no bytes beyond what
is kept anyway) or is a parameter, a later save of its output holds a `Recipe` instead of a
copy: the argument's packed form (shared with the call's own SavedVariable, so decoded once for
both), the forms held as is, and the function's Python arguments. Backward computes f(x_hat, b)
with grad off, so the next op's gradient sees the function of the decoded argument instead of a
decoded output. That holds no bytes for the output and skips its encode and decode. Products
it rebuilds: RMSNorm's x_n from x and the statistic, a squeeze-excitation's x * scale (N, C, H, W)
from x and the kept (N, C, 1, 1) scale (MobileNetV3).

Except where the save reads per-channel statistics (`*/chan`: a Linear's input) and the
argument was not packed per channel: a Linear's input rebuilt from a per-token (`tile/tok`)
encode loses accuracy. RMSNorm's y = weight * x_n, which the next Linear(s) save, rebuilt
through x_n's recipe from x's `tile/tok` encode cost gradient cosine 0.9962 -> 0.9949 on the zoo
`gpt`, while x_n alone costs nothing (docs/ARCHITECTURE.md, "Activation outputs recomputed");
y keeps its own `tile/chan` encode. LayerNorm (`layer_norm`, one function whose output is the
next Linear's input) is not in the set for the same reason: rebuilt from its per-token-quantised
input it lost accuracy.

Only the full `division` codec recomputes (the spectral codecs' LFC-/HFC-ACT study keeps its
meaning: every saved tensor passes the codec). A recipe is used only for the output tensor as
the function returned it (same storage, offset and element count, contiguous, not modified in
place since) and while the arguments held as is and the parameters among the arguments are
unchanged (version checked), so an in-place edit after the call keeps the normal route; an edit
of either after the output's save raises at unpack, as the call's own backward does. The packed
argument must hold values (a codec's copy or a recipe): a mask or indices rebuild nothing.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from freqact.codecs.base import Codec, Exact

__all__ = ["PRODUCTS", "RECOMPUTABLE", "Recipe", "Recompute", "Recomputer"]

RECOMPUTABLE = frozenset({"gelu", "silu", "hardswish", "mish"})
"""Torch functions whose output is rebuilt from their packed first argument."""
PRODUCTS = frozenset({"mul", "__mul__", "__rmul__"})
"""Torch functions whose output is rebuilt from one packed factor and one held as is."""


class Recipe:
    """One output to rebuild: func(*args) with each packed argument unpacked, cast to the output's
    dtype (the shape is the call's: (N, T, F) for RMSNorm's x_n, an activation's input's).

    Each input is unpacked by the block (`block._Packed.decoded`): a shared decode is held from the
    first of its unpacks to the last, so a backward that unpacks the recipe but never the call's
    own saves (`torch.autograd.grad` of a later weight only, on a retained graph) keeps that decode
    for as long as the graph lives, as any packed form shared by two saves does. An input held as
    is (a kept statistic) checks its version at unpack, as the call's own backward would.

    Attributes:
        inputs: (position in args, `block._Packed`) of each tensor argument the call saved.
        params: `ExactPacked` of each parameter among the other arguments (version at the call).
        nbytes: bytes the recipe holds of its own (0: its inputs are charged where they were packed).
    """

    __slots__ = ("args", "dtype", "func", "inputs", "kwargs", "params", "unpack")
    nbytes = 0

    def __init__(self, func: Callable, inputs: tuple, args: tuple, kwargs: dict, dtype: torch.dtype,
                 unpack: Callable, params: tuple = ()) -> None:
        self.func, self.inputs, self.args, self.kwargs = func, inputs, args, kwargs
        self.dtype, self.unpack, self.params = dtype, unpack, params

    def rebuild(self) -> torch.Tensor:
        """The output as the function computes it from the unpacked arguments (shape as returned).

        Raises:
            RuntimeError: a parameter among the arguments was modified in place since the call
                (the output would no longer be the one the forward used): `Exact.decode`'s.
        """
        for param in self.params:
            _EXACT.decode(param)
        args = list(self.args)
        for i, packed in self.inputs:
            args[i] = self.unpack(packed)
        with torch.no_grad():
            return self.func(*args, **self.kwargs).to(self.dtype)


class Recompute(Codec):
    """The route's codec: decode rebuilds a `Recipe`. It has no encode: the pack hook builds the
    recipe itself (`Recomputer.recipe_for`)."""

    whole_model = False
    name = "recomputed activation"

    def decode(self, packed: Recipe) -> torch.Tensor:
        return packed.rebuild()


def _held_as_is(value: object) -> bool:
    """Whether a recipe may hold value: a Python value, None or a parameter (never activations)."""
    return not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter)


_EXACT = Exact()  # parameters a recipe holds, with their version at the call


def _edited(packed) -> bool:
    """Whether a form held as is (`Exact`'s) was modified in place since it was saved."""
    return not packed.route.copies and packed.data.edited


class Recomputer:
    """The recipes of one `compress` block.

    The pack hook reports each tensor it saves, whatever its route (`saw_input`); the function
    tracker reports each function's return (`returned`); a later save of such an output asks
    `recipe_for`. Nothing here keeps an activation alive: outputs are known by weak references
    to their storage, arguments by their packed forms.

    Args:
        unpack: the block's unpack of a packed form (a `_Packed` -> the saved tensor).
    """

    def __init__(self, unpack: Callable) -> None:
        self._unpack = unpack
        self._saves: dict[int, dict] = {}  # call id -> {argument position: its packed form}
        # storage ptr -> (storage weakref, offset, numel, version, ((position, packed weakref),
        # ...), func, its args (None where packed), kwargs, output dtype, parameters' ExactPacked)
        self._outputs: dict[int, tuple] = {}

    def clear(self) -> None:
        """Forget every record (the block is closing)."""
        self._saves.clear()
        self._outputs.clear()

    def saw_input(self, func: tuple | None, t: torch.Tensor, packed) -> None:
        """Remember `packed` when t is an argument of the running call that may be rebuilt from
        (an activation's first, a product's factors), whatever its route and dedup hits included.

        Args:
            func: the tracker's (name, args, kwargs, call id), or None outside any function.
        """
        if func is None:
            return
        name, args = func[0], func[1]
        n = 1 if name in RECOMPUTABLE else 2 if name in PRODUCTS else 0
        for i, x in enumerate(args[:n]):
            if x is t:  # autograd hands the pack hook the argument itself
                self._saves.setdefault(func[3], {})[i] = packed
                return

    def returned(self, func: Callable, args: tuple, kwargs: dict, call_id: int, out) -> None:
        """Record `out` as rebuildable when its call saved exactly one argument by a copying route
        and every other tensor argument is held as is by the call or is a parameter."""
        saves = self._saves.pop(call_id, None)
        if saves is None or not isinstance(out, torch.Tensor) or not out.is_contiguous():
            return
        copied = [p.route for p in saves.values() if p.route.copies]
        # one argument copied with its values (a mask or indices do not rebuild them)
        if (len(copied) != 1 or not copied[0].values
                or not all(_held_as_is(a) for i, a in enumerate(args) if i not in saves)
                or not all(map(_held_as_is, kwargs.values()))):
            return
        storage = out.untyped_storage()
        ptr, outputs = storage.data_ptr(), self._outputs

        def forget(ref: weakref.ref) -> None:  # the output is freed: its entry goes with it
            if outputs.get(ptr, (None,))[0] is ref:
                del outputs[ptr]
        # weak references only: a forward without backward frees its packed forms with its graph
        inputs = tuple((i, weakref.ref(p)) for i, p in saves.items())
        held = tuple(None if i in saves else a for i, a in enumerate(args))
        params = tuple(_EXACT.encode(t) for t in (*held, *kwargs.values())
                       if isinstance(t, torch.Tensor))
        outputs[ptr] = (weakref.ref(storage, forget), out.storage_offset(), out.numel(),
                        out._version, inputs, func, held, kwargs, out.dtype, params)

    def recipe_for(self, t: torch.Tensor, storage, ptr: int, route) -> Recipe | None:
        """The recipe of t when t is a recorded output, unchanged and viewed whole, its arguments
        held as is are unchanged too, and `route` (t's own) does not read per-channel statistics
        unless its packed argument's does; else None."""
        entry = self._outputs.get(ptr)
        if (entry is None or entry[0]() is not storage or t.storage_offset() != entry[1]
                or t.numel() != entry[2] or t._version != entry[3] or not t.is_contiguous()
                or t.dtype != entry[8]):
            return None
        inputs = tuple((i, ref()) for i, ref in entry[4])
        if any(p is None or _edited(p) for _, p in inputs) or any(
                param.edited for param in entry[9]) or (
                route.layout.endswith("/chan") and not any(p.route.layout.endswith("/chan")
                                                           for _, p in inputs)):
            return None
        return Recipe(entry[5], inputs, entry[6], entry[7], entry[8], self._unpack, entry[9])
