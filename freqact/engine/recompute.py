"""Saved activation outputs rebuilt from the packed input: f(x_hat) in backward, no second copy.

A GELU (SiLU, Hardswish, Mish) saves its input for its own backward, and the next layer saves its
output for the next weight gradient: under `division` both were encoded, the output being a
cheap function of an input already packed. When the output of one of `RECOMPUTABLE`'s functions
is saved by a later op, and the function's first argument was packed by a copying route in the
same block, the output's SavedVariable holds a `Recipe` instead: the input's packed form (shared
with the function's own SavedVariable, so decoded once for both), the function and its other
arguments (Python values and parameters only). Backward computes f(x_hat) with grad off: the
next layer's gradient sees the activation of the decoded input instead of a decoded output.
That holds no bytes for the output and skips its encode and decode. Measured in
docs/ARCHITECTURE.md ("Activation outputs recomputed"): the same gradient cosine at 1.2-1.4x
less memory; LayerNorm's output recomputed the same way lost accuracy (its x_hat error is scaled
by the per-token rstd), so norms are not in the set.

Only the full `division` codec recomputes (the spectral codecs' LFC-/HFC-ACT study keeps its
meaning: every saved tensor passes the codec). A recipe is used only for the output tensor as
the function returned it (same storage, offset and element count, contiguous, not modified in
place since), so an in-place edit after the call (whose gradient f(x_hat) would not describe)
keeps the normal route.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from freqact.codecs.base import Codec

__all__ = ["RECOMPUTABLE", "Recipe", "Recompute", "Recomputer"]

RECOMPUTABLE = frozenset({"gelu", "silu", "hardswish", "mish"})
"""Torch functions whose output is rebuilt from their packed first argument."""


class Recipe:
    """One output to rebuild: func(x_hat, *args, **kwargs), cast to the output's dtype.

    x_hat is the input's shared decode (`block._Packed.decoded`), held from the first of its
    unpacks to the last: a backward that unpacks the recipe but never the activation's own saved
    input (`torch.autograd.grad` of a later weight only, on a retained graph) keeps that decode
    for as long as the graph lives, as any packed form shared by two saves does.

    Attributes:
        input: the `block._Packed` of the function's first argument.
        nbytes: bytes the recipe holds of its own (0: the input is charged where it was packed).
    """

    __slots__ = ("args", "dtype", "func", "input", "kwargs", "unpack")
    nbytes = 0

    def __init__(self, func: Callable, packed, args: tuple, kwargs: dict, dtype: torch.dtype,
                 unpack: Callable) -> None:
        self.func, self.input, self.args, self.kwargs = func, packed, args, kwargs
        self.dtype, self.unpack = dtype, unpack

    def rebuild(self) -> torch.Tensor:
        """The output as the function computes it from the decoded input (shape as returned)."""
        x = self.unpack(self.input)
        with torch.no_grad():
            return self.func(x, *self.args, **self.kwargs).to(self.dtype)


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


class Recomputer:
    """The recipes of one `compress` block.

    The pack hook reports each tensor it packs by a copying route (`saw_input`); the function
    tracker reports each function's return (`returned`); a later save of such an output asks
    `recipe_for`. Nothing here keeps an activation alive: outputs are known by weak references
    to their storage, inputs by their packed forms.

    Args:
        unpack: the block's unpack of a packed form (a `_Packed` -> the saved tensor).
    """

    def __init__(self, unpack: Callable) -> None:
        self._unpack = unpack
        self._inputs: dict[int, object] = {}  # call id -> packed first argument
        # storage ptr -> (storage weakref, offset, numel, version, packed input weakref, func,
        # its other args, kwargs, output dtype)
        self._outputs: dict[int, tuple] = {}

    def clear(self) -> None:
        """Forget every record (the block is closing)."""
        self._inputs.clear()
        self._outputs.clear()

    def saw_input(self, func: tuple | None, t: torch.Tensor, packed) -> None:
        """Remember `packed` when t is the first argument of the running RECOMPUTABLE call.

        Args:
            func: the tracker's (name, args, kwargs, call id), or None outside any function.
        """
        if func is None or func[0] not in RECOMPUTABLE or not func[1]:
            return
        x = func[1][0]
        if (isinstance(x, torch.Tensor) and x.data_ptr() == t.data_ptr() and x.shape == t.shape
                and x.stride() == t.stride()):
            self._inputs[func[3]] = packed

    def returned(self, func: Callable, args: tuple, kwargs: dict, call_id: int, out) -> None:
        """Record `out` as rebuildable when its call's first argument was packed."""
        packed = self._inputs.pop(call_id, None)
        if (packed is None or not isinstance(out, torch.Tensor) or not out.is_contiguous()
                or not all(map(_held_as_is, (*args[1:], *kwargs.values())))):
            return
        storage = out.untyped_storage()
        ptr, outputs = storage.data_ptr(), self._outputs

        def forget(ref: weakref.ref) -> None:  # the output is freed: its entry goes with it
            if outputs.get(ptr, (None,))[0] is ref:
                del outputs[ptr]
        # weak references only: a forward without backward frees its packed forms with its graph
        outputs[ptr] = (weakref.ref(storage, forget), out.storage_offset(), out.numel(),
                        out._version, weakref.ref(packed), func, args[1:], kwargs, out.dtype)

    def recipe_for(self, t: torch.Tensor, storage, ptr: int) -> Recipe | None:
        """The recipe of t when t is a recorded output, unchanged and viewed whole; else None."""
        entry = self._outputs.get(ptr)
        if (entry is None or entry[0]() is not storage or t.storage_offset() != entry[1]
                or t.numel() != entry[2] or t._version != entry[3] or not t.is_contiguous()
                or t.dtype != entry[8]):
            return None
        packed = entry[4]()
        if packed is None:
            return None
        return Recipe(entry[5], packed, entry[6], entry[7], entry[8], self._unpack)
