"""The token layouts (`layouts.TokenLayout`) as torch.library custom ops, for compiled graphs.

`torch.ops.freqact.layout_encode` / `layout_decode` run `TokenLayout.encode` / `decode` on a saved
tensor read as its token view (M, T, F) in the `feat` or `tile` blocks with `tok` or `chan` statistics (the layouts the
eager routes give Linear and activation inputs, norm inputs and SDPA's v/out), so a compiled
graph holds exactly the bytes eager training holds for the same tensor. They take and return
plain tensors: (lfc, lo, step, codes), the parts of `LayoutPacked` without a head.

Noise: as `ops.division_encode`, the encode takes an int64 seed tensor drawn in the graph (a
Python int would be a graph constant: every step would reuse one noise stream) and passes it to
`TokenLayout.encode(x, seed=...)`, which draws from private generators seeded with it, so the
eager `TokenLayout.encode(x, seed=seed)` gives the same bytes, and torch's own generators are
neither read nor reseeded (reseeding them per call cost ~0.4 ms: `torch.manual_seed` queues a
seeding of each lazily initialised device backend with a stack trace).
"""
from __future__ import annotations

import functools

import torch

from freqact.kernels.format import LfcPacked, QuantPacked, geometry

__all__ = ["LAYOUTS", "layout_codec", "layout_decode", "layout_encode", "recompute_in_backward",
           "sdpa_flash_cpu", "sink_decodes"]

LAYOUTS = ("feat/chan", "feat/tok", "tile/chan", "tile/tok")
"""The layouts the ops serve (no head token, no grids: what a graph's token views need)."""


def _views(shape: tuple[int, ...], layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(block view, stats view) shapes of a (M, T, F) token view, as `TokenLayout` reads it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if len(shape) != 3:
        raise ValueError(f"view: expected a (M, T, F) token view, got {shape}")
    m, t, f = shape
    blocks, stats = layout.split("/")
    return ((m, 1, t, f) if blocks == "tile" else (m, t, f)), (
        (m, f, t) if stats == "chan" else (m, t, f))


@functools.cache
def layout_codec(layout: str, block: int, bits: int, backend: str = "auto"):
    """The eager `TokenLayout` the ops run (`division` B, Q on `backend`, "auto": the default)."""
    from freqact import codecs
    from freqact.engine.layouts import TokenLayout

    division = codecs.get("division", block=block, bits=bits, backend=backend)
    return TokenLayout(division, *layout.split("/"))


@torch.library.custom_op("freqact::layout_encode", mutates_args=())
def layout_encode(x: torch.Tensor, view: list[int], layout: str, block: int, bits: int,
                  seed: torch.Tensor, backend: str = "auto"
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`TokenLayout(division, *layout.split("/")).encode(x, view=view)` as an op.

    Args:
        x: the floating saved tensor, any shape of view's elements.
        view: the (M, T, F) token view to encode x as (attention's (N, heads, T, d) views of a
            qkv projection are read in place as (N * heads, T, d), not copied).
        layout: one of LAYOUTS; block, bits: division's B and Q; backend as in
            `freqact.kernels.division_encode`.
        seed: int64 scalar tensor: `TokenLayout.encode`'s seed (modulo 2**63).

    Returns:
        (lfc, lo, step, codes): bf16 block means of the block view, bf16 (M, S) min and step
        and uint8 (M, S, nbytes) codes of the stats view (S = F for `chan`, T for `tok`).
    """
    _views(tuple(view), layout)  # checks layout and the view's rank
    p = layout_codec(layout, block, bits, backend).encode(x, seed=int(seed) % 2**63,
                                                          view=tuple(view))
    return p.lfc.lfc, p.quant.lo, p.quant.step, p.quant.codes


@layout_encode.register_fake
def _layout_encode_fake(x, view, layout, block, bits, seed, backend="auto"):
    blocks, stats = _views(tuple(view), layout)
    lfc, quant = geometry(blocks, block), geometry(stats, None)
    return (x.new_empty(lfc.lfc_shape, dtype=torch.bfloat16),
            x.new_empty(quant.stat_shape, dtype=torch.bfloat16),
            x.new_empty(quant.stat_shape, dtype=torch.bfloat16),
            x.new_empty(quant.codes_shape(bits), dtype=torch.uint8))


@torch.library.custom_op("freqact::layout_decode", mutates_args=())
def layout_decode(lfc: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, codes: torch.Tensor,
                  shape: list[int], dtype: torch.dtype, layout: str, block: int, bits: int,
                  backend: str = "auto") -> torch.Tensor:
    """`TokenLayout.decode` of `layout_encode`'s parts as an op: a contiguous (shape) (M, T, F)
    tensor of dtype."""
    from freqact.engine.layouts import LayoutPacked

    blocks, stats = _views(tuple(shape), layout)
    packed = LayoutPacked(LfcPacked(lfc, torch.Size(blocks), torch.float32, block),
                          QuantPacked(lo, step, codes, torch.Size(stats), torch.float32, bits),
                          None, torch.Size(shape), dtype)
    return layout_codec(layout, block, bits, backend).decode(packed)


@layout_decode.register_fake
def _layout_decode_fake(lfc, lo, step, codes, shape, dtype, layout, block, bits,
                        backend="auto"):
    return lfc.new_empty(shape, dtype=dtype)


@torch.library.custom_op("freqact::sdpa_flash_cpu", mutates_args=())
def sdpa_flash_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   dropout_p: float = 0.0, is_causal: bool = False,
                   attn_mask: torch.Tensor | None = None, scale: float | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten._scaled_dot_product_flash_attention_for_cpu` (output, logsumexp) without its
    random-op tag, so the partitioner can recompute it in backward (`recompute_in_backward`)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out, lse


@sdpa_flash_cpu.register_fake
def _sdpa_flash_cpu_fake(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None,
                         scale=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


_SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_SDPA_ARGS = ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale")


def _recompute_attention(graph: torch.fx.Graph) -> None:
    """Each CPU flash SDPA without dropout of a joint graph becomes `sdpa_flash_cpu`, tagged to
    be recomputed in backward (see `recompute_in_backward`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    for node in graph.find_nodes(op="call_function", target=_SDPA_CPU):
        args = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
        if args.get("dropout_p"):
            continue
        node.target = torch.ops.freqact.sdpa_flash_cpu.default
        node.args = (*node.args[:3], args.get("dropout_p", 0.0), args.get("is_causal", False),
                     args.get("attn_mask"), args.get("scale"))
        node.kwargs = {}
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = 0


_ERF_GELU = (0.5, 0.7071067811865476)  # a * 0.5 * (1 + erf(a * M_SQRT1_2)): gelu's decomposition


def _call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _backward_part(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a joint graph that a tangent reaches (its backward)."""
    reached = {n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents")}
    for node in graph.nodes:
        if any(i in reached for i in node.all_input_nodes):
            reached.add(node)
    return reached


def _gelu_chain(erf: torch.fx.Node) -> list[torch.fx.Node] | None:
    """[x * M_SQRT1_2, erf, 1 + erf, x * 0.5, output, views of the output...] of the erf GELU
    `x * 0.5 * (1 + erf(x * M_SQRT1_2))` around erf (aten's decomposition), None if erf is not
    one (GELU's backward writes its erf term another way)."""
    aten = torch.ops.aten
    inner = erf.args[0]
    if not (_call(inner, aten.mul.Tensor) and inner.args[1] == _ERF_GELU[1]):
        return None
    for add in (u for u in erf.users if _call(u, aten.add.Tensor) and 1 in u.args):
        for out in (u for u in add.users if _call(u, aten.mul.Tensor)):
            half = out.args[0] if out.args[1] is add else out.args[1]
            if _call(half, aten.mul.Tensor) and half.args == (inner.args[0], _ERF_GELU[0]):
                views = [u for u in out.users if getattr(u.target, "is_view", False)]
                return [inner, erf, add, half, out, *views]
    return None


def _gelu_chains(graph: torch.fx.Graph):
    """The nodes (`_gelu_chain`) of each erf GELU in a joint graph's forward."""
    backward = _backward_part(graph)
    for erf in graph.find_nodes(op="call_function", target=torch.ops.aten.erf.default):
        chain = None if erf in backward else _gelu_chain(erf)
        if chain is not None:
            yield chain


def _recompute_gelu(graph: torch.fx.Graph) -> None:
    """Each erf GELU of a joint graph's forward (and the views of its output) tagged to be
    recomputed in backward from its input (see `recompute_in_backward`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    for chain in _gelu_chains(graph):
        for node in chain:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0


@functools.cache
def recompute_in_backward():
    """The joint-graph pass (`torch._inductor.config.joint_custom_pre_pass`) that recomputes
    SDPA and GELU outputs in backward: a `CustomGraphPass` (Inductor keys its caches on the
    pass's uuid), made on first use (its module imports Inductor).

    SDPA (`_recompute_attention`): the partitioner then saves SDPA's q, k, v instead of its
    output and logsumexp, and the backward reruns the kernel on them, as eager's
    `attention.SdpaCall` does: with q, k, v decoded, the recomputed logsumexp matches the decoded
    scores (an error on q or k no longer enters exponentially), so q, k, v can be coded. The aten
    op itself carries a random-op tag (dropout): recomputing it made the partitioner save an RNG
    state under a name the saved-tensor hook inlining could not find ("could not find saved
    tensor getitem_8 in bw_g_inputs", torch 2.13), hence the untagged `sdpa_flash_cpu`.

    GELU (`_recompute_gelu`, the erf form): the partitioner saved both its input (for GELU's
    backward) and its output (the next Linear's input, for its weight gradient): the output is
    now recomputed from the decoded input in backward (one pointwise pass, which Inductor fuses
    with GELU's backward) instead of being saved and coded. The small ViT: 6 of its 55 coded
    tensors, the largest ones ((64, 65, 768) each), no longer encoded and decoded.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class RecomputeInBackward(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            _recompute_attention(graph)
            _recompute_gelu(graph)

        def uuid(self) -> str:
            return "freqact.recompute_in_backward.1"

    return RecomputeInBackward()


def _decodes() -> frozenset:
    from freqact.kernels import ops  # noqa: F401  (registers the division ops)

    return frozenset({torch.ops.freqact.layout_decode.default,
                      torch.ops.freqact.division_decode.default,
                      torch.ops.freqact.unpack_mask.default})


def _pure(node: torch.fx.Node) -> bool:
    """Whether node is an aten/custom op call that neither mutates nor draws random numbers (so
    running it later changes nothing but when its output is allocated)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    return (node.op == "call_function" and schema is not None and not schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()))


def _decode_ops(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The codec decodes of graph and the pure ops that read only those and graph inputs (the
    rest of an unpack hook: views)."""
    decodes = _decodes()
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op == "call_function" and (node.target in decodes or (
                any(n in found for n in inputs) and _pure(node)
                and all(n in found or n.op == "placeholder" for n in inputs))):
            found.add(node)
    return found


def _sink_decodes(graph: torch.fx.Graph) -> None:
    """Each of graph's `_decode_ops` moved to just before the first op that reads it."""
    moving = _decode_ops(graph)
    # last first: a node's users have moved before it does, so it lands before the first of
    # them in their new places (and still after its inputs: it only moves later)
    for node in reversed(list(graph.nodes)):
        if node in moving:
            first = node.next
            while first not in node.users and first.op != "output":
                first = first.next
            if first is not node.next:
                first.prepend(node)


@functools.cache
def sink_decodes():
    """The post-grad pass (`torch._inductor.config.post_grad_custom_post_pass`) that moves each
    decode of a backward graph from its prologue to its first use: a `CustomGraphPass`, made on
    first use (its module imports Inductor).

    AOTAutograd inlines every unpack hook right after the backward's inputs, so all saved
    tensors were decoded before the backward's first op: the whole uncompressed set alive at
    once (the backward's peak as without compression), each decode's output in fresh memory
    that the allocator could not reuse, and cold in the caches by the time its op read it.
    Moved, each decode runs just before its op, into memory the ops before it freed. The
    forward graphs have no decodes (no change there).
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class SinkDecodes(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            _sink_decodes(graph)

        def uuid(self) -> str:
            return "freqact.sink_decodes.1"

    return SinkDecodes()
