"""The meter for compiled models: rows from the saved tensors of each compiled graph.

Inside a compiled graph no Python runs per saved tensor, so the rows are planned when
AOTAutograd inlines the pack hook (`plan`: per saved node, the module that made it, from the
node's `nn_module_stack`, the route, the packed form's bytes and the plain tensor's bytes, all from
the fake tensors' shapes) and charged each time the graph runs: after each forward of the compiled
model inside the block (`Charger`), its output's autograd graph is searched for compiled-graph
nodes, and each node's plan is charged once. Graph inputs are not in the plans (the hooks never
see them): parameters and the batch are not activation memory, but a graph's inputs with
autograd history (a tensor crossing a graph break) and its outputs that it saves are held as
they are, so each is charged, kept, to the model's row (`Charger._graph_inputs`, read from the
graph node's saved tensors after the forward). A tensor saved where the model runs eagerly (past
a graph break) is kept; it is charged to the model's row as it is saved (`charge_eager`). Each
storage is charged once, parameters and what derives from them not at all.
"""
from __future__ import annotations

import re
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

from freqact.engine.meter import Meter
from freqact.engine.params import ParamIndex

__all__ = ["Charger", "PlanRow", "attach", "charge_eager", "plan"]


@dataclass(frozen=True)
class PlanRow:
    """One saved node of a compiled forward graph, as the meter charges it.

    Attributes:
        layer, type: the module that made the node ("" and the model's type when unknown).
        route: "division", "division <layout>" (a token view in a `graph_ops` layout),
            "relu-mask" (a ReLU output: division and a 1-bit sign mask), "mask" (a boolean mask
            held as bits) or "kept".
        saved_bytes: bytes of the packed form; exact_bytes: bytes of the tensor itself.
    """

    layer: str
    type: str
    route: str
    saved_bytes: int
    exact_bytes: int


# backward graph -> {saved node name: PlanRow}; a compiled graph is found by its backward graph
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _module_of(node: torch.fx.Node) -> tuple[str, str]:
    """(qualified name, class name) of the innermost module that made node ("", "" if none)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    # dynamo's source path: L['self'].layer1[0].conv1, L['fn']._modules['0'] -> layer1.0.conv1
    path = re.sub(r"^L\['[^']*'\]", "", path)
    path = re.sub(r"(?:\._modules)?\['([^']*)'\]|\[(\d+)\]", lambda m: "." + (m[1] or m[2]), path)
    return path.lstrip("."), getattr(cls, "__name__", str(cls))


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor))


def plan(context: dict | None, t: torch.Tensor, packed, route: str) -> None:
    """Record, while AOTAutograd inlines the pack hook, how saved node context["_node"] is held.

    Args:
        context: AOTAutograd's description of the saved node (`_node`, `_bw_graph`), or None.
        t: the saved (fake) tensor; packed: what the pack hook returns for it; route: its name.
    """
    if not context or "_bw_graph" not in context:
        return
    node = context["_node"]
    layer, type_name = _module_of(node)
    held = _nbytes(packed)  # for "kept", packed is t itself (or its own copy)
    rows = _PLANS.setdefault(context["_bw_graph"], {})
    rows[node.name] = PlanRow(layer, type_name, route, held, _nbytes(t))


def _plan_of(node) -> dict | None:
    """The plan of the compiled graph whose autograd node this is ({} for a graph without one,
    None for other nodes)."""
    info = getattr(getattr(node, "_forward_cls", None), "_lazy_backward_info", None)
    module = getattr(info, "bw_module", None)
    return _PLANS.get(module.graph, {}) if module is not None else None


class Charger:
    """Charges the plans of the compiled graphs each forward ran to a meter.

    Attributes:
        meter: the block's meter; model_type: the model's class name (rows without a module).
    """

    def __init__(self, meter: Meter, model: nn.Module, params: ParamIndex) -> None:
        self._model = getattr(model, "_orig_mod", model)
        self.meter, self.model_type = meter, type(self._model).__name__
        # the block's index of the model's parameters and buffers (frozen ones included): not
        # activation memory where a region that runs eagerly saves them
        self._params = params
        # compiled graphs' autograd nodes already charged in this block (weakly: a forward
        # dropped inside the block frees its graph and packed forms at once, as without the meter)
        self._charged: weakref.WeakSet = weakref.WeakSet()
        self._kept: dict[int, weakref.ref] = {}  # storage ptr -> storage, eager saves charged
        self._eager_saves = 0  # saves the hooks saw on real tensors since this forward began
        self._warned = False

    def __call__(self, output) -> None:
        """Charge the compiled graphs behind output (a forward's result, any nesting); warn (once
        per block) when a forward that saved tensors ran no compiled graph at all."""
        stack = [t.grad_fn for t in pytree.tree_leaves(output)
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        visited = set()
        compiled = False
        while stack:
            node = stack.pop()
            if node is None or node in visited:
                continue
            visited.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
            rows = _plan_of(node)
            compiled = compiled or rows is not None
            if rows is None or node in self._charged:  # a compiled graph's node is a Python one
                continue
            self._charged.add(node)
            for row in rows.values():
                layer, type_name = (row.layer, row.type) if row.type else ("", self.model_type)
                self.meter._record(layer, type_name, row.route)
                self.meter._charge(layer, type_name, row.route, row.saved_bytes, row.exact_bytes)
            self._graph_inputs(node)
        if not compiled and self._eager_saves and not self._warned:
            self._warned = True
            warnings.warn(
                f"compress: a forward of the compiled {self.model_type} ran without any compiled "
                f"graph (dynamo's recompile limit reached, torch._dynamo.config.recompile_limit, "
                f"or a disabled frame), so its {self._eager_saves} saved tensors were kept as "
                f"they are; pad or bucket the input sizes", RuntimeWarning, stacklevel=2)

    def forward_started(self) -> None:
        """A forward of the model begins: count its eager saves from here (saves made between
        forwards, a loss or a metric computed under the block, are not the next forward's)."""
        self._eager_saves = 0

    def saved_eagerly(self, t: torch.Tensor) -> None:
        """A hook saved t where the model runs eagerly: counted for the warning, charged kept."""
        self._eager_saves += 1
        self.eager(t)

    def _graph_inputs(self, node) -> None:
        """Charge, kept, the activations compiled graph node saves that no plan holds: its
        inputs with autograd history (a tensor crossing a graph break, made by an earlier graph
        or by code running eagerly) and its own outputs. No hook sees them, and they are held as
        they are; parameters, their copies and the input batch (no history) are not charged."""
        try:
            saved = node.saved_tensors
        except RuntimeError:  # already freed by a backward
            return
        for t in saved:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                self.eager(t)

    def eager(self, t: torch.Tensor) -> None:
        """Charge t, saved where the model runs eagerly and kept, to the model's row (its
        storage once; the model's parameters and buffers, their views and copies, and tensors
        without storage, never: as the eager engine's `ParamIndex.derived` tells them)."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        if self._params.derived(t, storage.data_ptr(), self._model):
            return
        self.meter._record("", self.model_type, "kept")
        ref = self._kept.get(storage.data_ptr())
        if ref is not None and ref() is storage:
            return
        self._kept[storage.data_ptr()] = weakref.ref(storage)
        self.meter._charge("", self.model_type, "kept", storage.nbytes(), storage.nbytes())


_CURRENT = threading.local()  # .charger: the Charger of this thread's open block


def charge_eager(t: torch.Tensor) -> None:
    """Charge t, kept where the model runs eagerly, to the meter of this thread's block."""
    charger = getattr(_CURRENT, "charger", None)
    if charger is not None:
        charger.saved_eagerly(t)


def attach(model: nn.Module, charger: Charger):
    """Run charger on each output of compiled `model` (a `torch.compile` OptimizedModule, whose
    forward hooks run eagerly, outside the graph), and make it this thread's charger of eager
    saves (`charge_eager`), until the returned handle is removed."""
    _CURRENT.charger = charger
    start = model.register_forward_pre_hook(lambda module, args: charger.forward_started())
    return _Detach(model.register_forward_hook(lambda module, args, output: charger(output)), start)


class _Detach:
    """The handle of `attach`: removes the forward hooks and forgets this thread's charger."""

    def __init__(self, *hooks) -> None:
        self.hooks = hooks

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        _CURRENT.charger = None
