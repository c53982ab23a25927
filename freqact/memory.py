"""Activation memory from the storage formula: what compression saves per sample.

`theoretical_ratio(model, input_shape, codec)` is the batch-size-independent compression ratio of
the activations a model caches for backward (the idea of the DIVISION paper's Appendix P). Instead
of a hand-written per-layer formula it runs `freqact.compress` on two small all-zero batches of a
copy of the model and takes the per-sample difference. Every packed size is data-independent (it is
each codec's storage formula, e.g. DIVISION's Q*P/8 + 2*prod(nb) + 4 bytes per map, 1 bit per
element for ReLU masks, 1 byte per MaxPool index), so the difference is exactly

    R = (bytes plain PyTorch caches per extra sample) / (bytes cached per extra sample with codec)

and per-batch constants (BatchNorm statistics) drop out, as they do for large batches.
"""
from __future__ import annotations

import copy
import numbers

import torch
from torch import nn

from freqact.codecs.base import Codec
from freqact.engine import compress
from freqact.engine.routes import MIN_BATCH_VALUES

__all__ = ["theoretical_ratio", "per_sample_bytes"]

# Two batches of at least `routes.MIN_BATCH_VALUES` samples: below that a BatchNorm input of
# (N, C) is kept (statistics over too few values), which at batches 2 and 3 charged a
# Linear-BatchNorm1d MLP's BatchNorm input plain (ratio 1.88; the meter at batch 256: 6.8; now
# 7.0, tests/test_memory.py).
# Multiples of 8: such an input is coded one map per channel over the batch, whose block means
# (B = 8) and code bytes then grow by whole blocks and bytes, as over a large batch.
_BATCHES = (MIN_BATCH_VALUES, 2 * MIN_BATCH_VALUES)


def _check_input_shape(input_shape: object) -> tuple[int, ...]:
    if isinstance(input_shape, (str, bytes)) or not hasattr(input_shape, "__iter__"):
        raise TypeError(f"input_shape: expected a tuple of positive ints (no batch dim), "
                        f"got {input_shape!r}")
    shape = tuple(input_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1
                        for s in shape):
        raise ValueError(f"input_shape: expected a non-empty tuple of positive ints (no batch "
                         f"dim), got {input_shape!r}")
    return tuple(int(s) for s in shape)


def per_sample_bytes(model: nn.Module, input_shape, codec: str | Codec = "division", *,
                     include=None, exclude=None, **params) -> tuple[float, float]:
    """Bytes cached for backward per sample, plain and with `codec`.

    Args:
        model: the model (a deep copy is run in training mode; the model itself, its BatchNorm
            statistics and the global RNG state are left untouched).
        input_shape: one sample's shape without the batch dim, e.g. (3, 32, 32).
        codec, include, exclude, **params: as for `freqact.compress`.

    Returns:
        (exact_bytes, saved_bytes) per sample.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    shape = _check_input_shape(input_shape)
    replica = copy.deepcopy(model).train()
    first = next(replica.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    totals = []
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        for batch in _BATCHES:
            x = torch.zeros((batch, *shape), device=device)
            with compress(replica, codec, include=include, exclude=exclude, **params) as meter:
                out = replica(x)
            del out  # frees the graph and the packed forms
            totals.append((meter.exact_bytes, meter.saved_bytes))
    extra = _BATCHES[1] - _BATCHES[0]
    (exact_a, saved_a), (exact_b, saved_b) = totals
    return (exact_b - exact_a) / extra, (saved_b - saved_a) / extra


def theoretical_ratio(model: nn.Module, input_shape, codec: str | Codec = "division", *,
                      include=None, exclude=None, **params) -> float:
    """Per-sample compression ratio of the activations cached for backward (see module doc).

    Args:
        model: any nn.Module taking a batch of shape (N, *input_shape).
        input_shape: one sample's shape without the batch dim, e.g. (3, 224, 224).
        codec: a codec name or instance, as for `freqact.compress` (default "division").
        include, exclude, **params: as for `freqact.compress` (e.g. block=8, bits=2).

    Returns:
        exact / compressed bytes per sample (inf if nothing per-sample is cached with the codec).

    Raises:
        TypeError/ValueError: bad model, input_shape or codec arguments.
    """
    exact, saved = per_sample_bytes(model, input_shape, codec, include=include, exclude=exclude,
                                    **params)
    if saved <= 0:
        return float("inf") if exact > 0 else 1.0
    return exact / saved
