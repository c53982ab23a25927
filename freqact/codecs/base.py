"""The codec interface, the registry and the `exact` codec.

Every codec has one interface::

    packed = codec.encode(x)      # x: any tensor the engine routes to this codec
    x_hat = codec.decode(packed)  # same shape, dtype and device as x
    packed.nbytes                 # exact bytes the packed form holds

Codecs are small objects whose settings are constructor arguments; `get(name, **params)` builds one
by name and `names()` lists them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


_REGISTRY: dict[str, Callable[..., "Codec"]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a codec class available as `get(name, ...)`."""

    def add(cls: type) -> type:
        if name in _REGISTRY:
            raise ValueError(f"codec name {name!r} is registered twice")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return add


def names() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_REGISTRY)


def get(name: str, **params) -> "Codec":
    """Build the codec registered as `name` with its keyword settings.

    Raises:
        ValueError: if `name` is unknown (the message lists the known names).
        TypeError: if a setting is not accepted by that codec.
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"codec: expected one of {', '.join(names())}, got {name!r}")
    try:
        return _REGISTRY[name](**params)
    except TypeError as err:
        raise TypeError(f"codec {name!r}: {err}") from None


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements of `t` (not of its whole storage)."""
    return t.numel() * t.element_size()


class Codec:
    """Base class. Subclasses implement `encode` and `decode`; settings live on the instance."""

    name: str = "codec"
    # False: correct only for the tensors the engine itself routes to it (masks, indices, shapes)
    whole_model: bool = True

    def encode(self, x: torch.Tensor):  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, packed) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether this codec stores x; `freqact.compress` keeps a declined tensor exactly."""
        return True

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({settings})"


@dataclass(frozen=True)
class ExactPacked:
    """The tensor itself, with its version counter at encode time (to detect in-place edits)."""

    tensor: torch.Tensor
    version: int

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.tensor)


@register("exact")
class Exact(Codec):
    """Keep x as it is: the control, gradients bit-identical to plain PyTorch.

    No copy is made, so like PyTorch itself this codec refuses to decode a tensor that was modified
    in place after encoding (the gradient would silently be wrong).
    """

    def encode(self, x: torch.Tensor) -> ExactPacked:
        return ExactPacked(x, x._version)

    def decode(self, packed: ExactPacked) -> torch.Tensor:
        if packed.tensor._version != packed.version:
            raise RuntimeError(
                "a tensor cached for backward was modified by an in-place operation after it was "
                f"saved (version {packed.version} -> {packed.tensor._version}); clone it before "
                "modifying it"
            )
        return packed.tensor
