"""Saved-tensor hooks that torch.compile inlines: the codec inside compiled graphs.

AOTAutograd (torch >= 2.8) inlines saved-tensor hooks that are `torch.fx.GraphModule`s: each
tensor the compiled forward saves for backward goes through the pack graph in the forward's
epilogue and the unpack graph in the backward's prologue, so the compiled graph itself holds the
packed form between forward and backward (`maybe_inline_graph_saved_tensors_hooks` in
torch/_functorch/_aot_autograd/graph_compile.py). Plain Python hooks instead only see what the
compiled function as a whole saves, and keep it as is.

Inside a graph nothing says which module is running, so the graph-level rule
(`graph_rules.route`) reads the saved tensor and the graphs around it: with AOTAutograd's
"donated" filtering only intermediates (never parameters or graph inputs) reach the hooks; of
those with at least `threshold` elements, token tensors go through the eager routes' token
layouts (the `graph_ops` custom ops), maps through division as saved, boolean masks (Inductor
saves ReLU's) are held as 1 bit per element, the rest are kept. The packed form
travels as a tuple of tensors (AOTAutograd flattens pack outputs into forward outputs / backward
inputs). The same hooks run as plain Python hooks where the model runs eagerly (graph breaks,
`torch._dynamo.disable`): there they keep what is saved (charged to the meter), because without
the graph nothing tells which op saved a tensor: coding SDPA's q and k or a ReLU's output blind
gave gradient errors of 250x.

The hook objects are cached per codec setting: dynamo guards on their identity, so a fresh pair
per `compress` block would recompile the model at every step.
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

from freqact.codecs.base import Codec, Exact, ExactPacked
from freqact.engine import graph_meter, graph_ops, graph_rules
from freqact.engine.moments import token_moments, with_moments

__all__ = ["GRAPH_CODECS", "THRESHOLD", "GraphCodec", "graph_hooks", "installed", "is_compiled",
           "spec_for", "static_inputs"]

GRAPH_CODECS = ("exact", "division")
"""The codecs that can run inside a compiled graph (their encode/decode are custom ops)."""

THRESHOLD = 4096
"""Saved tensors with fewer elements are kept as they are inside graphs (their bytes are few)."""

_EXACT = Exact()
_TRANSPOSED = "t"  # the first item of a transposed packed form: ("t", the packed transpose)


def is_compiled(model: nn.Module) -> bool:
    """Whether model runs through torch.compile: `torch.compile(model)` or `model.compile()`."""
    if "torch._dynamo" not in sys.modules:  # nothing was compiled (and eager users skip its import)
        return False
    return (isinstance(model, sys.modules["torch._dynamo"].eval_frame.OptimizedModule)
            or getattr(model, "_compiled_call_impl", None) is not None)


def spec_for(model: nn.Module, codec: Codec, include, exclude) -> GraphCodec | None:
    """The graph-level codec `compress` uses for model, or None when model is not compiled (the
    eager engine's module routes then apply).

    Raises:
        ValueError: compiled modules inside an uncompiled model (the eager hooks would run outside
            their graphs and save nothing), a model compiled in place (`model.compile()`: its
            graphs do not inline the hooks) or with `dynamic=True` (symbolic sizes),
            include/exclude with a compiled model (a graph does not tell modules apart), or a
            codec that cannot run inside a graph.
    """
    if not is_compiled(model):
        inner = next((name for name, m in model.named_modules() if name and is_compiled(m)),
                     None)
        if inner is not None:
            raise ValueError(f"model: submodule {inner!r} is compiled inside an uncompiled "
                             f"model; compress the whole compiled model (torch.compile(model)) "
                             f"or none of it compiled")
        return None
    inner = getattr(model, "_orig_mod", model)
    in_place = next((name or "(model)" for name, m in inner.named_modules()
                     if getattr(m, "_compiled_call_impl", None) is not None), None)
    if in_place is not None:
        raise ValueError(f"model: {in_place!r} is compiled in place (module.compile()), which "
                         f"compress does not support (dynamo traces the saved-tensor hooks there "
                         f"as Python code, outside the graphs); compress torch.compile(model) "
                         f"of a model without in-place compiled modules instead")
    if getattr(getattr(model, "dynamo_ctx", None), "_dynamic", None) is True:
        # refused here in one line, not at the first forward inside BackendCompilerFailed
        raise ValueError("model: compiled with dynamic=True, which compress does not support "
                         "(the saved tensors' sizes are symbolic); compile with static shapes "
                         "(torch.compile(model), the default: a new input size recompiles)")
    if include is not None or exclude is not None:
        raise ValueError("include/exclude: not supported for a compiled model (inside a graph "
                         "the saved tensors do not say which module saved them); compress the "
                         "uncompiled model to select modules")
    return GraphCodec.of(codec)


def static_inputs(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """The block's forward pre-hook on the compiled model: forget the dynamic dims AOTAutograd
    stamped on its input tensors (`_dynamo_propagated_dynamic_indices`, a hint that dynamo reads
    as "weakly dynamic" whatever `automatic_dynamic_shapes` says, and does not guard on). A
    batch that went through a plain compiled step of a dynamic graph (automatic dynamic shapes
    after a second input size: AOTAutograd marks the saved inputs too) carried it into the
    block, whose graph then had symbolic sizes and was refused as `dynamic=True`."""
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and hasattr(t, "_dynamo_propagated_dynamic_indices"):
            del t._dynamo_propagated_dynamic_indices


@dataclass(frozen=True)
class GraphCodec:
    """A codec's settings as plain constants, the arguments baked into the hook graphs.

    Attributes:
        name: "exact" or "division".
        block, bits, backend: division's settings (unused by exact).
        threshold: smallest element count compressed inside graphs.
    """

    name: str
    block: int = 8
    bits: int = 2
    backend: str = "auto"
    threshold: int = THRESHOLD

    @classmethod
    def of(cls, codec: Codec, threshold: int = THRESHOLD) -> GraphCodec:
        """The graph form of codec.

        Raises:
            ValueError: if codec cannot run inside a compiled graph.
        """
        if codec.name not in GRAPH_CODECS:
            raise ValueError(f"codec: {codec.name!r} cannot run inside a torch.compile graph "
                             f"(supported there: {', '.join(GRAPH_CODECS)}); compress the "
                             f"uncompiled model instead")
        if codec.name == "exact":
            return cls("exact", threshold=threshold)
        return cls("division", codec.block, codec.bits, codec._kernels or "auto", threshold)


def _is_fake(t: torch.Tensor) -> bool:
    """Whether t is being traced (AOTAutograd calls the hooks on fake tensors)."""
    return torch._subclasses.fake_tensor.is_fake(t)


def _graph_pack(t: torch.Tensor, name: str, block: int, bits: int, backend: str,
                threshold: int):
    """The pack hook (the graph's only node): the packed form of saved tensor t.

    Returns:
        Traced: t itself when kept (AOTAutograd then leaves the saved tensor alone),
        (lfc, lo, step, codes, shape, dtype) for division, (lfc, lo, step, codes, view, dtype,
        layout, shape) for a token layout (either plus a 1-bit `> 0` mask for a ReLU output; a
        norm's layout then its tokens' mean and std, `engine.moments`), ("t", that form of
        t.t()) for a (F, N * T) transposed token tensor, (bits, shape) for a boolean mask.
        Eager: `Exact`'s packed form.
    """
    spec = GraphCodec(name, block, bits, backend, threshold)
    if not _is_fake(t):
        # A graph break: this op runs eagerly, and autograd calls the hook on the real tensor.
        # Detached: t.grad_fn may be the node saving t, a cycle no collector frees.
        graph_meter.charge_eager(t)
        return _EXACT.encode(t.detach())
    if not all(isinstance(size, int) for size in t.shape):
        raise RuntimeError(
            "compress: a compiled graph with dynamic shapes (torch.compile(model, dynamic=True) "
            "or torch._dynamo.mark_dynamic) cannot be compressed: its saved tensors' sizes are "
            "symbolic; compile with static shapes (the default: a new input size recompiles)")
    context = _hook_context()
    packed, route = _traced_pack(spec, t, context)
    graph_meter.plan(context, t, packed, route)
    return packed


def _traced_pack(spec: GraphCodec, t: torch.Tensor, context: dict | None):
    """(packed form, route name) of a traced saved tensor (see `_graph_pack`)."""
    chosen = graph_rules.route(spec, t, context)
    if chosen.transposed:  # (F, N * T): the (N * T, F) tensor it transposes, marked
        packed, name = _coded(spec, t.t(), chosen)
        return (_TRANSPOSED, packed), name
    if chosen.name == "mask":
        return (pack_bits(t), tuple(t.shape)), "mask"
    if chosen.name == "kept":
        return t, "kept"
    if chosen.name == "kept copy":  # a view's own elements, so that its base can be freed
        return t.clone(memory_format=torch.contiguous_format), "kept"
    return _coded(spec, t, chosen)


def _coded(spec: GraphCodec, t: torch.Tensor, chosen: graph_rules.GraphRoute):
    """(packed form, route name) of t under a coded route (division or a token layout)."""
    # A tensor seed, drawn in the graph: each step encodes with fresh noise.
    seed = torch.randint(2**62, (), dtype=torch.int64)
    # ReLU's backward reads the sign of what it saved: kept exact as 1 bit (the eager routes'
    # relu-mask), the values for the next op's backward coded.
    positive = (pack_bits(t > 0),) if chosen.positive else ()
    if chosen.layout:  # a token view in an eager route's layout
        parts = torch.ops.freqact.layout_encode(t, list(chosen.view), chosen.layout, spec.block,
                                                spec.bits, seed, spec.backend)
        stats = token_moments(t.reshape(chosen.view)) if chosen.moments else ()
        return (*parts, list(chosen.view), t.dtype, chosen.layout, tuple(t.shape), *positive,
                *stats), chosen.name
    parts = torch.ops.freqact.division_encode(t, spec.block, spec.bits, None, seed,
                                              spec.backend)
    return (*parts, tuple(t.shape), t.dtype, *positive), chosen.name


def _hook_context() -> dict | None:
    """The graph context AOTAutograd gives the hooks for the saved node being traced (a
    torch-internal API: `_node`, `_fw_graph`, `_bw_graph`); None when the hooks are traced
    outside AOTAutograd's inlining (make_fx on the hook graphs themselves).

    Raises:
        RuntimeError: when this torch has no such API. The graph rule cannot tell SDPA's q, k
            and logsumexp or a ReLU's output apart without it, and coding those blind is
            unsafe (exponential gradient errors), so compiled compression refuses instead.
    """
    from torch._functorch._aot_autograd import graph_compile

    get = getattr(graph_compile, "_get_saved_tensor_hook_context", None)
    if get is None:
        raise RuntimeError(
            f"compress: torch {torch.__version__} does not give saved-tensor hooks their graph "
            "context (torch._functorch._aot_autograd.graph_compile._get_saved_tensor_hook_context"
            "), which compressing a compiled model needs; compress the model uncompiled")
    return get()


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor as 1 bit per element in plain aten ops (Inductor fuses them with the op
    that makes the mask): the layout of `freqact.kernels.pack_mask`, element i (logical order) at
    bit i % 8 of byte i // 8.

    Args:
        mask: bool tensor, any shape.

    Returns:
        uint8 (ceil(mask.numel() / 8),).
    """
    flat = mask.reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    flat = flat.view(-1, 8)
    # An OR of the 8 shifted columns, not a sum over a dim of 8: Inductor vectorises the
    # pointwise chain (8 ms for a 16 MB ReLU map on the CPU) but not that reduction (260 ms).
    out = flat[:, 0]
    for i in range(1, 8):
        out = out | (flat[:, i] << i)
    return out


def unpack_bits(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `pack_bits`: the bool (shape) tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    n = math.prod(shape)
    return bits.reshape(-1)[:n].view(shape).to(torch.bool)


def _graph_unpack(packed, name: str, block: int, bits: int, backend: str, threshold: int):
    """The unpack hook: the tensor rebuilt from what `_graph_pack` returned."""
    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(packed, ExactPacked):  # saved where the model runs eagerly
        return _EXACT.decode(packed)
    if isinstance(packed[0], str):  # ("t", form): a (F, N * T) transpose, decoded as (N * T, F)
        return _graph_unpack(packed[1], name, block, bits, backend, threshold).t()
    if len(packed) == 2:  # a boolean mask
        return unpack_bits(*packed)
    if len(packed) >= 8:  # a token view in a layout (with a ReLU output's mask, a norm's moments)
        *parts, view, dtype, layout, shape = packed[:8]
        positive = packed[8] if len(packed) in (9, 11) else None
        x = torch.ops.freqact.layout_decode(*parts, view, dtype, layout, block, bits, backend)
        x = (with_moments(x, *packed[-2:]) if len(packed) >= 10 else x).view(shape)
        if positive is None:
            return x
        # as `division_decode`'s positive: exactly zero where it was, positive elsewhere
        return torch.where(unpack_bits(positive, shape), x.clamp_min(torch.finfo(dtype).tiny), 0)
    lfc, lo, step, codes, shape, dtype, *positive = packed
    # a ReLU output (with its mask): exactly zero where it was, strictly positive elsewhere,
    # applied in the decode's own pass (as aten ops after it, Inductor's scalar loop over the
    # bits cost as much as the decode)
    return torch.ops.freqact.division_decode(lfc, lo, step, codes, list(shape), dtype, block,
                                             bits, backend, positive[0] if positive else None)


def _hook_module(fn, spec: GraphCodec, arg: str) -> torch.fx.GraphModule:
    """A one-node GraphModule calling fn(arg, *spec): the form AOTAutograd inlines."""
    graph = torch.fx.Graph()
    x = graph.placeholder(arg)
    graph.output(graph.call_function(fn, (x, spec.name, spec.block, spec.bits, spec.backend,
                                          spec.threshold)))
    return torch.fx.GraphModule(nn.Module(), graph)


@functools.cache
def graph_hooks(spec: GraphCodec) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The (pack, unpack) GraphModules of spec, one pair per setting (dynamo guards on them)."""
    return _hook_module(_graph_pack, spec, "t"), _hook_module(_graph_unpack, spec, "packed")



@contextlib.contextmanager
def division_compile_settings():
    """How graphs compile inside a division block, hooks and attention pass aside: Inductor's
    layout optimization off and the backward compiled at once (`installed`; compile_bench's
    "compiled layout-off" mode compiles normal training with these alone)."""
    from torch._inductor import config as inductor

    with inductor.patch(layout_optimization=False), torch._functorch.config.patch(
            force_non_lazy_backward_lowering=True):
        yield


def _passes(setting) -> tuple:
    """An Inductor custom-pass setting (None, one pass or a list) as a tuple of passes."""
    if setting is None:
        return ()
    return tuple(setting) if isinstance(setting, (list, tuple)) else (setting,)


@contextlib.contextmanager
def installed(spec: GraphCodec):
    """Install spec's graph-level hooks for the block.

    With AOTAutograd's "donated" filtering (only graph intermediates get hooks: parameters and
    inputs stay as they are). Under division also, for the graphs compiled inside the block:
    Inductor's layout optimization off (it saves a channels-last copy of every conv weight and of
    the batch for backward, 43 MB on ResNet-18, that no hook sees), SDPA recomputed in backward
    (`graph_ops.recompute_in_backward`, unless a joint_custom_pre_pass is set already: then q and
    k stay exact) and the backward compiled at once (inside the block, so with the same
    settings); `exact` leaves the graphs as compiled
    normal training has them. No AOTAutograd cache: the pack hook must trace for the meter's
    plans (`graph_meter`). Static shapes (no automatic dynamic shapes: a new input size
    recompiles), since the routes and the plans need the saved tensors' sizes.
    """
    pack, unpack = graph_hooks(spec)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._functorch.config.patch(
            saved_tensors_hooks_filtering_mode="donated", enable_autograd_cache=False))
        # a new input size recompiles a static graph: the routes and the meter's plans need
        # the saved tensors' sizes (`_graph_pack` refuses symbolic ones)
        stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False))
        if spec.name == "division":
            from torch._inductor import config as inductor

            stack.enter_context(division_compile_settings())
            if inductor.joint_custom_pre_pass is None:  # a user's own pass is left in place
                stack.enter_context(inductor.patch(
                    joint_custom_pre_pass=graph_ops.recompute_in_backward()))
            stack.enter_context(inductor.patch(post_grad_custom_post_pass=[
                *_passes(inductor.post_grad_custom_post_pass), graph_ops.sink_decodes()]))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        yield
