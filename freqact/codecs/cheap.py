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
from freqact.codecs.settings import BACKEND, Setting
from freqact.errors import UsageError, UsageTypeError


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


class _Mask(Codec):
    """The shared decode of the 1-bit codecs; `backend` chooses the mask kernels."""

    whole_model = False  # exact only for the tensors the engine routes here

    settings = (BACKEND,)

    def decode(self, packed: BitsPacked) -> torch.Tensor:
        return kernels.unpack_mask(packed.bits, packed.shape, packed.dtype, packed.off, packed.on,
                                   backend=self._kernels)


@register("relu-mask")
class ReluMask(_Mask):
    """1 bit per element: `x > 0`; decodes to 1/0 (ReLU's backward only tests `result > 0`)."""

    def encode(self, x: torch.Tensor) -> BitsPacked:
        _validate.floating_tensor("x", x)
        return BitsPacked(kernels.pack_mask(x, 0.0, backend=self._kernels), x.shape, x.dtype,
                          0.0, 1.0)


@register("sign-mask")
class SignMask(_Mask):
    """1 bit per element: `x > 0`; decodes to +1/-1 (LeakyReLU's backward only tests `x > 0`)."""

    def encode(self, x: torch.Tensor) -> BitsPacked:
        _validate.floating_tensor("x", x)
        return BitsPacked(kernels.pack_mask(x, 0.0, backend=self._kernels), x.shape, x.dtype,
                          -1.0, 1.0)


@register("hardtanh-mask")
class HardtanhMask(_Mask):
    """1 bit per element: `min_val < x < max_val` (Hardtanh/ReLU6 backward tests exactly this).

    Decodes to the middle of the range where the bit is set and to `min_val` elsewhere; both give
    the same test result as the original values.

    Settings: `min_val`, `max_val` (> min_val), `backend`.
    """

    settings = (
        Setting("min_val", float, -1.0, "lower end of the linear range (ReLU6: 0)"),
        Setting("max_val", float, 1.0, "upper end of the linear range (ReLU6: 6), > min_val"),
        BACKEND,
    )

    def _check_settings(self) -> None:
        if not self.min_val < self.max_val:
            raise UsageError(f"max_val: expected a number > min_val={self.min_val}, "
                             f"got {self.max_val}")

    def encode(self, x: torch.Tensor) -> BitsPacked:
        _validate.floating_tensor("x", x)
        mid = torch.tensor((self.min_val + self.max_val) / 2, dtype=x.dtype).item()
        if not self.min_val < mid < self.max_val:
            raise ValueError(
                f"x: dtype {x.dtype} cannot represent a value strictly inside "
                f"({self.min_val}, {self.max_val})"
            )
        return BitsPacked(kernels.pack_mask(x, self.min_val, self.max_val, backend=self._kernels),
                          x.shape, x.dtype, self.min_val, mid)


@register("dropout-mask")
class DropoutMask(_Mask):
    """1 bit per element for a tensor holding only 0 and one other value (dropout's scaled noise).

    The nonzero value is read from the tensor itself, so the decode is bit-identical. A tensor with
    more than one nonzero value is refused (ValueError): it is not a dropout mask.
    """

    def encode(self, x: torch.Tensor) -> BitsPacked:
        _validate.floating_tensor("x", x)
        keep = x != 0
        scale = x.max().item() if x.numel() else 0.0
        if not torch.equal(keep, x == scale):
            raise ValueError("x: expected a dropout mask holding only 0 and one scale value")
        return BitsPacked(kernels.pack_codes(keep.reshape(-1).view(torch.uint8), 1,
                                             backend=self._kernels),
                          x.shape, x.dtype, 0.0, scale)


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

    Settings: the pooling geometry `kernel_size`, `stride`, `padding`, `dilation` (an int or one
    int per dim) and `input_size`, the spatial size of the pooled input, e.g. (H, W); all but
    padding and dilation required.

    Raises:
        UsageError: if the window has more than 256 elements (offsets would not fit a byte).
    """

    whole_model = False  # exact only for the tensors the engine routes here

    settings = (
        Setting("kernel_size", tuple, 1, "pooling window", low=1, high=256, required=True),
        Setting("stride", tuple, 1, "pooling stride", low=1, required=True),
        Setting("padding", tuple, 0, "pooling padding", low=0),
        Setting("dilation", tuple, 1, "pooling dilation", low=1),
        Setting("input_size", tuple, 1, "spatial size of the pooled input, e.g. (H, W)", low=1,
                required=True),
    )

    def _check_settings(self) -> None:
        if not isinstance(self.input_size, tuple):
            raise UsageTypeError(f"input_size: expected one int per dim, got {self.input_size!r}")
        dims = len(self.input_size)
        for name in ("kernel_size", "stride", "padding", "dilation"):
            value = getattr(self, name)
            values = (value,) * dims if isinstance(value, int) else value
            if len(values) != dims:
                raise UsageTypeError(f"{name}: expected an int or {dims} ints, got {value!r}")
            setattr(self, name, values)
        if math.prod(self.kernel_size) > 256:
            raise UsageError(
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
