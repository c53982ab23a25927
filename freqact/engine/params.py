"""Telling parameters (and what derives from them) from activations in the pack hook.

A saved parameter, a view of one (`weight.t()`) or its autocast copy is not activation memory: it
is kept as it is and not counted. Plain parameters stay alive during the block, so their storage
addresses cannot be reused by other tensors: they are collected once, on entry.

FSDP2 (`torch.distributed.fsdp.fully_shard`) registers sharded DTensor parameters; for each forward
it all-gathers them into plain tensors and swaps those in as the module attributes (its pre-forward
hook, which runs before the engine's), and with `reshard_after_forward` it frees their storage
after the unit's forward and gathers it again for backward, at new addresses. So the storages of
FSDP2-managed parameters are read where they are *now*: the parameters registered on the modules
at pack time, cached until the next FSDP2 unit starts or ends its forward (`moved`, called by the
block's module hooks, which run after FSDP2's own).

Other DTensor parameters (tensor parallel, or FSDP2 over tensor-parallel DTensors) are refused on
entry: their unsharded forms and activations are DTensors the codecs were never checked on.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["ParamIndex", "is_fsdp_unit"]

# Autograd nodes an autocast copy or a view of a parameter goes through before its AccumulateGrad.
_PARAM_PATH_NODES = frozenset({
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
    "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0",
})

try:  # torch.distributed is optional in some builds
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - builds without torch.distributed
    FSDPModule = DTensor = ()


def is_fsdp_unit(module: nn.Module) -> bool:
    """True if `fully_shard` was applied to module (its forward hooks swap parameters)."""
    return isinstance(module, FSDPModule)


def _fsdp_managed(units: list[nn.Module]) -> set[int]:
    """ids of the sharded parameters FSDP2 manages in `units` (the modules `fully_shard` was
    applied to), whose originals were plain tensors.

    FSDP2 has no public accessor for them: `FSDPParam` (its per-parameter state) is read through
    each unit's state. A parameter FSDP2 sharded from a DTensor (FSDP over tensor parallel) is left
    out, so it is refused like any other DTensor.
    """
    ids = set()
    for module in units:
        try:
            groups = module._get_fsdp_state()._fsdp_param_groups
            ids.update(id(p.sharded_param) for g in groups for p in g.fsdp_params
                       if not p.is_dtensor)
        except AttributeError as err:  # FSDP2's internals moved in another torch version
            raise RuntimeError(f"compress: cannot read FSDP2's parameter state in torch "
                               f"{torch.__version__} ({err}); tested with torch 2.13") from err
    return ids


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class ParamIndex:
    """The storages of a model's parameters and buffers, for one block.

    Raises:
        ValueError: a parameter or buffer is a DTensor that FSDP2 does not shard from a plain
            tensor (tensor parallel placements, a hand-made DTensor).
    """

    def __init__(self, model: nn.Module) -> None:
        self.ptrs: set[int] = set()
        self._slots: list[tuple[nn.Module, str]] = []  # where FSDP2 swaps its parameters in
        units, dtensors = [], []
        for mod_name, module in model.named_modules():
            if is_fsdp_unit(module):
                units.append(module)
            # The registries themselves (None marks an unset slot): named_parameters(recurse=False)
            # built a generator chain per module, a third of a block's entry on the zoo's GPT.
            for name, t in (*module._parameters.items(), *module._buffers.items()):
                if isinstance(t, DTensor):
                    dtensors.append((mod_name, module, name, t))
                elif t is not None:
                    self.ptrs.add(_ptr(t))
        managed = _fsdp_managed(units) if dtensors else set()
        for mod_name, module, name, t in dtensors:
            if id(t) not in managed:
                raise ValueError(
                    f"model: {'.'.join(filter(None, (mod_name, name)))} is a DTensor with "
                    f"placements {tuple(t.placements)} that FSDP2 (fully_shard) does not "
                    f"shard; compress supports plain, DDP and FSDP2 models, not tensor or "
                    f"pipeline parallel ones")
            self._slots.append((module, name))
        self.ptrs.discard(0)
        self._live: set[int] | None = None

    def moved(self) -> None:
        """FSDP2 may have swapped parameters in or out: read their storages again when needed."""
        self._live = None

    def _current(self) -> set[int]:
        """Storages of the FSDP2 parameters registered now (unsharded ones; sharded are DTensors)."""
        if self._live is None:
            self._live = {_ptr(t) for t in (module._parameters.get(name)
                                           for module, name in self._slots)
                          if t is not None and not isinstance(t, DTensor)} - {0}
        return self._live

    def _known(self, ptr: int) -> bool:
        return ptr in self.ptrs or (bool(self._slots) and ptr in self._current())

    def derived(self, t: torch.Tensor, ptr: int, module: nn.Module) -> bool:
        """True if t is a parameter or buffer, a view of one, or a copy of one.

        Args:
            t: the saved tensor; ptr: its storage's address.
            module: the running module (its own parameters tell a frozen weight's autocast copy).
        """
        return self._known(ptr) or self._from_history(t) or cast_copy(t, module)

    def _from_history(self, t: torch.Tensor) -> bool:
        """True if t is an autocast copy or a view of a parameter, found by autograd history."""
        node = t.grad_fn
        while node is not None and type(node).__name__ in _PARAM_PATH_NODES:
            node = node.next_functions[0][0] if node.next_functions else None
        if node is None or type(node).__name__ != "AccumulateGrad":
            return False
        return not isinstance(node.variable, DTensor) and self._known(_ptr(node.variable))


def cast_copy(t: torch.Tensor, module: nn.Module) -> bool:
    """True if t is a cast copy (another dtype, no autograd history) of one of module's own
    parameters or buffers, as registered now (FSDP2's unsharded ones during its forward).

    That is a frozen weight under autocast: the copy has no history to follow, so its values are
    compared with the module's own parameters of the same size.
    """
    if t.grad_fn is not None or not t.is_floating_point():
        return False
    flat = None
    for p in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        if p.numel() == t.numel() and p.dtype != t.dtype and not isinstance(p, DTensor):
            if flat is None:
                # t may be a transposed view of the copy: compare the whole storage, flat.
                flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
            if flat.numel() == p.numel() and torch.equal(flat, p.detach().reshape(-1).to(t.dtype)):
                return True
    return False
