"""Telling parameters (and what derives from them) from activations in the pack hook.

A saved parameter, a view of one (`weight.t()`) or its autocast copy is not activation memory: it
is kept as it is and not counted. Parameters stay alive during the block, so their storage
addresses cannot be reused by other tensors.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["ParamIndex"]

# Autograd nodes an autocast copy or a view of a parameter goes through before its AccumulateGrad.
_PARAM_PATH_NODES = frozenset({
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
    "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0",
})


class ParamIndex:
    """The storages of a model's parameters and buffers, for one block."""

    def __init__(self, model: nn.Module) -> None:
        self.ptrs = {
            t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
        } - {0}

    def derived(self, t: torch.Tensor, ptr: int, params: tuple) -> bool:
        """True if t is a parameter or buffer, a view of one, or a copy of one.

        Args:
            t: the saved tensor; ptr: its storage's address.
            params: the running module's own parameters and buffers.
        """
        return ptr in self.ptrs or self._from_history(t) or cast_copy(t, params)

    def _from_history(self, t: torch.Tensor) -> bool:
        """True if t is an autocast copy or a view of a parameter, found by autograd history."""
        node = t.grad_fn
        while node is not None and type(node).__name__ in _PARAM_PATH_NODES:
            node = node.next_functions[0][0] if node.next_functions else None
        if node is None or type(node).__name__ != "AccumulateGrad":
            return False
        return node.variable.untyped_storage().data_ptr() in self.ptrs


def cast_copy(t: torch.Tensor, params: tuple) -> bool:
    """True if t is a cast copy (another dtype, no autograd history) of one of `params`.

    That is a frozen weight under autocast: the copy has no history to follow, so its values are
    compared with the module's own parameters of the same size.
    """
    if t.grad_fn is not None or not t.is_floating_point():
        return False
    flat = None
    for p in params:
        if p.numel() == t.numel() and p.dtype != t.dtype:
            if flat is None:
                # t may be a transposed view of the copy: compare the whole storage, flat.
                flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
            if flat.numel() == p.numel() and torch.equal(flat, p.detach().reshape(-1).to(t.dtype)):
                return True
    return False
