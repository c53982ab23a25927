"""Exact-but-cheap codecs for tensors whose backward needs far less than their values.

- `relu-mask`: ReLU saves its output and backward only asks "> 0?" -> 1 bit per element.
- `sign-mask`: LeakyReLU backward only asks "> 0?" of its input (or output) -> 1 bit; decodes to
  +1 / -1 so the same comparison gives the same answer.
- `hardtanh-mask`: Hardtanh/ReLU6 backward only asks "min < x < max?" -> 1 bit; decodes to the
  middle of the range (inside) or `min_val` (outside).
- `dropout-mask`: dropout's saved noise holds only 0 and one scale value -> 1 bit plus the scale.
- `maxpool-indices`: MaxPool's int64 flat indices -> the uint8 offset inside each pooling window.
- `shape-only`: for tensors whose values backward never reads (pooling inputs); holds nothing and
  decodes to zeros expanded with zero strides.

Each decode gives a tensor for which PyTorch's backward formula yields bit-identical gradients.
Packed forms never alias the input, so in-place edits after encoding cannot change them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freqact import _validate, kernels
from freqact.codecs.base import Codec, register, tensor_nbytes


@dataclass(frozen=True)
class BitsPacked:
    """One bit per element plus the two values the bits decode to."""

    bits: torch.Tensor  # uint8 (ceil(numel / 8),)
    shape: torch.Size
    dtype: torch.dtype
    off: float  # value decoded for a 0 bit
    on: float  # value decoded for a 1 bit

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.bits)


def _decode_bits(packed: BitsPacked) -> torch.Tensor:
    return kernels.unpack_mask(packed.bits, packed.shape, packed.dtype, packed.off, packed.on)


@register("relu-mask")
class ReluMask(Codec):
    """1 bit per element: `x > 0`; decodes to 1/0 (ReLU's backward only tests `result > 0`)."""

    whole_model = False  # exact only for the tensors the engine routes here

    def encode(self, x: torch.Tensor) -> BitsPacked:
        _validate.floating_tensor("x", x)
        return BitsPacked(kernels.pack_mask(x, 0.0), x.shape, x.dtype, 0.0, 1.0)

    def decode(self, packed: BitsPacked) -> torch.Tensor:
        return _decode_bits(packed)


@register("sign-mask")
class SignMask(Codec):
    """1 bit per element: `x > 0`; decodes to +1/-1 (LeakyReLU's backward only tests `x > 0`)."""

    whole_model = False  # exact only for the tensors the engine routes here

    def encode(self, x: torch.Tensor) -> BitsPacked:
        _validate.floating_tensor("x", x)
        return BitsPacked(kernels.pack_mask(x, 0.0), x.shape, x.dtype, -1.0, 1.0)

    def decode(self, packed: BitsPacked) -> torch.Tensor:
        return _decode_bits(packed)


@register("hardtanh-mask")
class HardtanhMask(Codec):
    """1 bit per element: `min_val < x < max_val` (Hardtanh/ReLU6 backward tests exactly this).

    Decodes to the middle of the range where the bit is set and to `min_val` elsewhere; both give
    the same test result as the original values.

    Args:
        min_val: lower end of the linear range (ReLU6: 0).
        max_val: upper end of the linear range (ReLU6: 6), > min_val.
    """

    whole_model = False  # exact only for the tensors the engine routes here

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0) -> None:
        if not float(min_val) < float(max_val):
            raise ValueError(f"max_val: expected a number > min_val={min_val}, got {max_val}")
        self.min_val = float(min_val)
        self.max_val = float(max_val)

    def encode(self, x: torch.Tensor) -> BitsPacked:
        _validate.floating_tensor("x", x)
        mid = torch.tensor((self.min_val + self.max_val) / 2, dtype=x.dtype).item()
        if not self.min_val < mid < self.max_val:
            raise ValueError(
                f"x: dtype {x.dtype} cannot represent a value strictly inside "
                f"({self.min_val}, {self.max_val})"
            )
        return BitsPacked(kernels.pack_mask(x, self.min_val, self.max_val), x.shape, x.dtype,
                          self.min_val, mid)

    def decode(self, packed: BitsPacked) -> torch.Tensor:
        return _decode_bits(packed)


@register("dropout-mask")
class DropoutMask(Codec):
    """1 bit per element for a tensor holding only 0 and one other value (dropout's scaled noise).

    The nonzero value is read from the tensor itself, so the decode is bit-identical. A tensor with
    more than one nonzero value is refused (ValueError): it is not a dropout mask.
    """

    whole_model = False  # exact only for the tensors the engine routes here

    def encode(self, x: torch.Tensor) -> BitsPacked:
        _validate.floating_tensor("x", x)
        keep = x != 0
        scale = x.max().item() if x.numel() else 0.0
        if not torch.equal(keep, x == scale):
            raise ValueError("x: expected a dropout mask holding only 0 and one scale value")
        return BitsPacked(kernels.pack_codes(keep.reshape(-1).view(torch.uint8), 1), x.shape,
                          x.dtype, 0.0, scale)

    def decode(self, packed: BitsPacked) -> torch.Tensor:
        return _decode_bits(packed)


def _ntuple(name: str, value, dims: int) -> tuple[int, ...]:
    values = (value,) * dims if isinstance(value, int) else tuple(value)
    if len(values) != dims or any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise TypeError(f"{name}: expected an int or {dims} ints, got {value!r}")
    return values


@dataclass(frozen=True)
class IndicesPacked:
    """Offsets inside each pooling window, uint8, shaped like the indices."""

    offsets: torch.Tensor

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.offsets)


@register("maxpool-indices")
class MaxPoolIndices(Codec):
    """MaxPool's int64 flat indices stored as uint8 offsets inside each pooling window.

    The geometry (window, stride, padding, dilation, input size) turns an offset back into the flat
    index exactly. Indices have shape (..., *out) over the last `len(input_size)` dims and index the
    flattened input plane of shape `input_size`.

    Args:
        kernel_size, stride, padding, dilation: the pooling geometry, an int or one int per dim.
        input_size: spatial size of the pooled input, e.g. (H, W).

    Raises:
        ValueError: if the window has more than 256 elements (offsets would not fit a byte).
    """

    whole_model = False  # exact only for the tensors the engine routes here

    def __init__(self, kernel_size, stride, padding=0, dilation=1, *, input_size) -> None:
        dims = len(input_size)
        self.input_size = _ntuple("input_size", tuple(input_size), dims)
        self.kernel_size = _ntuple("kernel_size", kernel_size, dims)
        self.stride = _ntuple("stride", stride, dims)
        self.padding = _ntuple("padding", padding, dims)
        self.dilation = _ntuple("dilation", dilation, dims)
        if math.prod(self.kernel_size) > 256:
            raise ValueError(
                f"kernel_size: expected a window of at most 256 elements, got {self.kernel_size}"
            )

    def _starts(self, out_size, device) -> list[torch.Tensor]:
        """Per dim, the first input coordinate of each window, shaped to broadcast over out dims."""
        dims = len(out_size)
        starts = []
        for d in range(dims):
            start = torch.arange(out_size[d], device=device) * self.stride[d] - self.padding[d]
            starts.append(start.view([-1] + [1] * (dims - 1 - d)))
        return starts

    def encode(self, x: torch.Tensor) -> IndicesPacked:
        if not isinstance(x, torch.Tensor) or x.dtype != torch.int64:
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"x: expected an int64 tensor of indices, got {got}")
        dims = len(self.input_size)
        flat = x
        offset = torch.zeros_like(x)
        # Peel coordinates from the last dim: flat = ((c0 * S1) + c1) * S2 + c2 ...
        coords = []
        for size in reversed(self.input_size):
            coords.append(flat % size)
            flat = flat // size
        coords.reverse()
        for d, start in enumerate(self._starts(x.shape[-dims:], x.device)):
            offset = offset * self.kernel_size[d] + (coords[d] - start) // self.dilation[d]
        return IndicesPacked(offset.to(torch.uint8))

    def decode(self, packed: IndicesPacked) -> torch.Tensor:
        dims = len(self.input_size)
        rest = packed.offsets.long()
        within = []
        for k in reversed(self.kernel_size):
            within.append(rest % k)
            rest = rest // k
        within.reverse()
        flat = torch.zeros_like(rest)
        for d, start in enumerate(self._starts(packed.offsets.shape[-dims:], rest.device)):
            flat = flat * self.input_size[d] + start + within[d] * self.dilation[d]
        return flat


@dataclass(frozen=True)
class ShapePacked:
    """Only the shape, dtype and device: nothing is held."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return 0


@register("shape-only")
class ShapeOnly(Codec):
    """For tensors whose values backward never reads (MaxPool/AvgPool inputs): keeps only the shape.

    Decodes to a zero scalar expanded to the shape (zero strides, no memory). Only correct where
    the backward formula reads the shape alone; the engine routes just those tensors here.
    """

    whole_model = False  # exact only for the tensors the engine routes here

    def encode(self, x: torch.Tensor) -> ShapePacked:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        return ShapePacked(x.shape, x.dtype, x.device)

    def decode(self, packed: ShapePacked) -> torch.Tensor:
        return torch.zeros((), dtype=packed.dtype, device=packed.device).expand(packed.shape)
