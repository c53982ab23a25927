"""The codec interface, the registry and the `exact` codec.

Every codec has one interface::

    packed = codec.encode(x)      # x: any tensor the engine routes to this codec
    x_hat = codec.decode(packed)  # same shape, dtype and device as x
    packed.nbytes                 # exact bytes the packed form holds

Codecs are small objects whose settings are declared once on the class (`Codec.settings`, see
`freqact.codecs.settings`) and checked by the shared constructor; `get(name, **params)` builds one
by name, `names()` lists them, `modes()` lists those that `freqact train` offers as modes and
`mode_settings()` the settings those take (the run config's codec fields and CLI flags).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from freqact import _validate, kernels
from freqact.codecs.settings import Setting, resolve

_REGISTRY: dict[str, type[Codec]] = {}


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


def codec_class(name: str) -> type[Codec]:
    """The class registered as `name`.

    Raises:
        UsageError: if `name` is unknown (the message lists the known names).
    """
    return _REGISTRY[_validate.choice("codec", name, tuple(names()))]


def get(name: str, **params) -> Codec:
    """Build the codec registered as `name` with its keyword settings (see `Codec.settings`).

    Raises:
        UsageError: if `name` is unknown (the message lists the known names) or a value is out
            of its declared range.
        UsageTypeError (a TypeError): for an unknown or missing setting, or a value of the
            wrong type; the message names the codec and the setting.

    Example:
        >>> import freqact.codecs
        >>> freqact.codecs.get("division", block=4, bits=2)
        Division(block=4, bits=2, backend='auto')
    """
    return codec_class(name)(**params)


def modes() -> list[str]:
    """The codecs a whole model trains with (those with a `title`), in registration order."""
    return [name for name, cls in _REGISTRY.items() if cls.title is not None]


def mode_settings() -> tuple[Setting, ...]:
    """The settings of every codec in `modes()`, each name once, in first-declared order.

    Raises:
        RuntimeError: if two codecs declare different settings under one name (a run config has
            one field per name).
    """
    seen: dict[str, Setting] = {}
    for name in modes():
        for setting in _REGISTRY[name].settings:
            if seen.setdefault(setting.name, setting) != setting:
                raise RuntimeError(f"codec {name!r} declares setting {setting.name!r} unlike "
                                   "another training mode; share one Setting")
    return tuple(seen.values())


CODEC_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dtypes the value codecs read; other floating types (float8) are kept exactly (eager routes and
the compiled graph rule alike)."""


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of the elements of `t` (not of its whole storage)."""
    return t.numel() * t.element_size()


class Codec:
    """Base class. Subclasses declare `settings` and implement `encode` and `decode`.

    The constructor takes the declared settings (positionally in declared order, or by keyword),
    checks them (`settings.resolve`) and stores each as an attribute of the same name; a subclass
    with checks across settings overrides `_check_settings`.

    Attributes:
        name: the registered name (set by `register`).
        settings: the declared settings.
        title: for codecs a whole model trains with, a description ("DIVISION (...)"); None for
            the codecs the engine picks per tensor (masks, indices).
    """

    name: str = "codec"
    # False: correct only for the tensors the engine itself routes to it (masks, indices, shapes)
    whole_model: bool = True
    # False: a packed form other saves depend on (one SDPA call's q, k, v and the saves recomputed
    # from their decodes), which the engine never swaps for the tensor itself (`block._uncode`)
    standalone: bool = True
    settings: tuple[Setting, ...] = ()
    title: str | None = None

    def __init__(self, *args, **params) -> None:
        for key, value in resolve(self.name, self.settings, args, params).items():
            setattr(self, key, value)
        self._check_settings()

    def _check_settings(self) -> None:
        """Checks that involve several settings (none by default); raise UsageError."""

    @property
    def _kernels(self) -> str | None:
        """The `backend=` of the `freqact.kernels` calls: None for "auto", which lets
        $FREQACT_KERNELS decide (default: the automatic choice)."""
        return None if self.backend == "auto" else self.backend

    def backend_used(self, device: str | torch.device) -> str | None:
        """The kernel backend ("torch", "cpu" or "triton") this codec dispatches to on `device`,
        as `freqact.kernels.backend_for` resolves its `backend` setting; None for codecs without
        one (they use no kernels). On CUDA, `quant` and the decode of `division-no-lfc` run the
        torch reference whatever this says (see `freqact.kernels`).

        Raises:
            ValueError, RuntimeError: if the chosen backend cannot run there (`backend_for`).
        """
        if not any(s.name == "backend" for s in self.settings):
            return None
        return kernels.backend_for(torch.empty(0, device=device), self._kernels)

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

    @property
    def edited(self) -> bool:
        """Whether the tensor was modified in place since it was encoded."""
        return self.tensor._version != self.version


@register("exact")
class Exact(Codec):
    """Keep x as it is: the control, gradients bit-identical to plain PyTorch.

    No copy is made, so like PyTorch itself this codec refuses to decode a tensor that was modified
    in place after encoding (the gradient would silently be wrong).
    """

    title = "exact (the engine's hooks on, cached tensors kept as they are)"

    def encode(self, x: torch.Tensor) -> ExactPacked:
        return ExactPacked(x, x._version)

    def decode(self, packed: ExactPacked) -> torch.Tensor:
        if packed.edited:
            raise RuntimeError(
                "a tensor cached for backward was modified by an in-place operation after it was "
                f"saved (version {packed.version} -> {packed.tensor._version}); clone it before "
                "modifying it"
            )
        return packed.tensor
