"""Which torch function is running: the op the pack hook attributes a saved tensor to.

A `TorchFunctionMode` active inside the block keeps the outermost running torch function (its name
and arguments) on a stack. Autograd saves a function's tensors while it runs, so at pack time the
top of the stack is the op that saved them: `F.gelu` inside HF's `GELUActivation`,
`scaled_dot_product_attention`, `softmax`, the `pow`/`mul` of a functional RMSNorm. Inside a
function the mode is off (PyTorch pops it while its handler runs), so a Python function built of
torch calls (`F.multi_head_attention_forward`) is seen as itself, never as its parts.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

from torch.overrides import TorchFunctionMode

__all__ = ["FunctionTracker"]


class FunctionTracker(TorchFunctionMode):
    """Records the running torch function; `current` is (name, args, kwargs, call) or None,
    call the number of the call (two calls with the same arguments are told apart).

    Args:
        on_return: called as on_return(func, args, kwargs, call, output) after each call
            (`recompute.Recomputer.returned`; output None when the call raised), or None.
    """

    def __init__(self, on_return: Callable | None = None) -> None:
        super().__init__()
        self._stack: list[tuple] = []
        self._calls = itertools.count()
        self._on_return = on_return

    @property
    def current(self) -> tuple | None:
        return self._stack[-1] if self._stack else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = next(self._calls)
        self._stack.append((getattr(func, "__name__", ""), args, kwargs, call))
        try:
            out = func(*args, **kwargs)
        except BaseException:
            if self._on_return is not None:  # what was recorded for the call is dropped
                self._on_return(func, args, kwargs, call, None)
            raise
        finally:
            self._stack.pop()
        if self._on_return is not None:
            self._on_return(func, args, kwargs, call, out)
        return out
