"""Argument checks shared by the public functions.

Every check raises `freqact.errors.UsageError` (a ValueError) or `UsageTypeError` (also a
TypeError) naming the argument, what was expected and what came. Messages are built only on
failure.
"""
from __future__ import annotations

import numbers

import torch

from freqact.errors import UsageError, UsageTypeError


def floating_tensor(name: str, x: object) -> torch.Tensor:
    """Return `x` if it is a real floating-point tensor, else raise TypeError."""
    if not isinstance(x, torch.Tensor):
        raise UsageTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise UsageTypeError(
            f"{name}: expected a real floating-point tensor (float16/bfloat16/float32/float64), "
            f"got dtype {x.dtype}"
        )
    return x


def choice(name: str, value: object, allowed: tuple) -> object:
    """Return `value` if it is one of `allowed`, else raise ValueError listing them."""
    if value not in allowed:
        raise UsageError(f"{name}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def positive_int(name: str, value: object) -> int:
    """Return `value` as int if it is an integer >= 1 (bools refused), else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UsageTypeError(f"{name}: expected an integer >= 1, got {value!r}")
    if value < 1:
        raise UsageError(f"{name}: expected an integer >= 1, got {value}")
    return int(value)


def unit_ratio(name: str, value: object) -> float:
    """Return `value` as float if it lies in (0, 1], else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UsageTypeError(f"{name}: expected a number in (0, 1], got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise UsageError(f"{name}: expected a number in (0, 1], got {value}")
    return float(value)
