"""The graph-level rule: how a tensor a compiled forward saves is held, from the graphs alone.

Inside a compiled graph nothing says which module runs; what AOTAutograd gives the pack hook is
the saved (fake) tensor and its node: the forward graph around it (what made it, what reads it)
and the backward graph (which op reads it there, in which argument). `route` reads those to
give each saved tensor the eager routes' layout where it can tell (docs/ARCHITECTURE.md,
"Compiled models"):

- boolean masks: 1 bit each ("mask"); tensors under the threshold, non-floating: kept;
- SDPA's saves: where the backward reruns the CPU flash kernel (`graph_ops.
  recompute_in_backward`: the graph saves q, k, v, not out and logsumexp), q, k, v in
  `feat/chan` on (N * heads, T, d), as eager's `attention.SdpaCall`; elsewhere the backward
  op's `query`, `key`, `logsumexp` kept, `value` and `out` in `feat/chan` (eager's route where
  the kernel cannot be rerun: its backward computes exp(q k^T - logsumexp), so an error on q
  or k enters exponentially), kept under a mask, is_causal or dropout. A kept q or k that is a strided view (of the qkv
  Linear's output, whose v part is coded) is held as a contiguous copy ("kept copy"): as a
  view it would keep the whole qkv buffer alive;
- a softmax's input (attention scores that an SDPA with dropout, decomposed, saves): kept, since
  the backward recomputes exp(x - max) with the exact max;
- token tensors (N, T, F), and rank-2 (N * T, F) views of them (aten's Linear saves its input
  and the GELU input so, as `addmm`/`mm` operands): `tile/tok` for a LayerNorm's input or
  normalised output (min/step per token), else `tile/chan` (Linear and activation inputs);
  the token shape of a rank-2 tensor is read from the view it was made from or is read as;
  a (F, N * T) transpose of such a view (GPT-2's `Conv1D`, `addmm(b, x, w)` with an (in, out)
  weight, saves its input so for the weight's gradient) is held as the (N * T, F)
  tensor it transposes, in the same layout, and transposed back when decoded;
  rank-2 tensors without one (BatchNorm1d inputs, a classifier's (N, F) input) are kept;
- rank 4 and 5 maps, and a Conv1d's rank-3 input or output: `division` as saved (the map
  rule), but a BatchNorm's input (read by a var_mean over every dim but 1) with fewer than
  `routes.MIN_BATCH_VALUES` values per channel is kept, as in eager;
- a ReLU output, whichever of the coded rules above it gets, also keeps its signs as 1 bit
  ("relu-mask", "relu-mask <layout>");
- per-token statistics (N, T, 1) (LayerNorm's mean and rstd: its gradient scales with rstd) and
  whatever would not get smaller packed are kept; a kept view that holds less than half of its
  storage's bytes as its own copy ("kept copy"), so that the storage can be freed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from freqact.codecs.base import CODEC_DTYPES
from freqact.engine import graph_ops
from freqact.engine.layouts import GROUP_TOKENS, packed_nbytes, token_view
from freqact.engine.routes import few_batch_values

__all__ = ["GraphRoute", "route"]

_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                    torch.ops.aten._unsafe_view.default})
_NORM_STATS = frozenset({torch.ops.aten.var_mean.correction, torch.ops.aten.rsqrt.default,
                         torch.ops.aten.native_layer_norm.default})
_CONVOLUTION = torch.ops.aten.convolution.default
_SDPA_OPS = ("scaled_dot_product", "freqact::sdpa_flash_cpu")
_SDPA_CODED = frozenset({"value", "out"})
_RECOMPUTED_CODED = frozenset({"query", "key", "value"})
TOKENS, FEATURES, ATTENTION = "tile/tok", "tile/chan", "feat/chan"


@dataclass(frozen=True)
class GraphRoute:
    """How one saved tensor is held.

    Attributes:
        name: the meter's route: "kept", "mask", "division", "relu-mask" (the map rule and a
            1-bit `> 0` mask), "division <layout>" or "relu-mask <layout>".
        layout: a `graph_ops.LAYOUTS` name, "" for the map rule.
        view: the (M, T, F) token view the layout reads (None for the map rule).
        transposed: the saved tensor is the (F, N * T) transpose of the tensor `view` reads
            (the layout then codes `t.t()`, and the decode is transposed back).
    """

    name: str
    layout: str = ""
    view: tuple[int, ...] | None = None
    transposed: bool = False

    @property
    def positive(self) -> bool:
        """Whether a 1-bit `> 0` mask is held beside the coded values (a ReLU output)."""
        return self.name.startswith("relu-mask")

    @property
    def moments(self) -> bool:
        """Whether each token's exact mean and standard deviation are held too (norm inputs and
        outputs, as the eager `NormLayout`: `engine.moments`)."""
        return self.layout == TOKENS


KEPT, COPY, MASK = GraphRoute("kept"), GraphRoute("kept copy"), GraphRoute("mask")


def route(spec, t: torch.Tensor, context: dict | None) -> GraphRoute:
    """The route of saved tensor t (see the module docstring).

    Args:
        spec: the block's `compiled.GraphCodec`.
        t: the saved (fake) tensor.
        context: AOTAutograd's `_node` (t's node in the forward graph) and `_bw_graph`, or None.
    """
    if spec.name != "division" or t.layout != torch.strided:
        return KEPT
    if t.numel() < spec.threshold:
        return _kept(t)
    if t.dtype == torch.bool:
        return MASK
    if t.dtype not in CODEC_DTYPES:
        return _kept(t)
    node = context.get("_node") if context else None
    chosen = _chosen(t, node, context)
    if chosen.name.startswith("kept"):
        return chosen
    return chosen if _smaller(spec, t, chosen) else _kept(t)


def _kept(t: torch.Tensor) -> GraphRoute:
    """KEPT, or COPY for a view holding less than half of its storage's bytes (the head's
    (N, F) class-token slice of the final norm's output kept 65 times its bytes alive)."""
    try:
        storage = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return KEPT
    return COPY if 2 * t.numel() * t.element_size() < storage else KEPT


def _chosen(t: torch.Tensor, node, context) -> GraphRoute:
    sdpa = _sdpa_use(node, context)
    if sdpa is not None:
        if sdpa and t.dim() == 4:
            return _layout(ATTENTION, token_view(tuple(t.shape), heads=True))
        return _kept(t)  # a q or k view of the qkv output: a copy (the v part is coded)
    if _softmax_input(node) or _batch_statistics_over_few(t, node):
        return _kept(t)
    relu = getattr(node, "target", None) is torch.ops.aten.relu.default
    if t.dim() in (4, 5) or (t.dim() == 3 and _convolution_map(node)):
        return GraphRoute("relu-mask" if relu else "division")
    if t.dim() == 2 and _transpose_of(node) is not None:
        # (F, N * T): a Linear-like input saved transposed; routed as the tensor it transposes
        chosen = _chosen(t.t(), _transpose_of(node), context)
        return replace(chosen, transposed=True) if chosen.layout else _kept(t)
    if t.dim() in (2, 3):
        if t.shape[-1] == 1:  # per-token statistics (LayerNorm's mean, rstd): kept exact
            return _kept(t)
        view = _token_shape(t, node)
        if view is None:
            return _kept(t)
        # short sequences (windows) read several at a time, as the eager routes read them
        return _layout(TOKENS if _is_norm(node) else FEATURES,
                       token_view(view, False, group=GROUP_TOKENS), relu)
    return _kept(t)


def _batch_statistics_over_few(t: torch.Tensor, node) -> bool:
    """Whether node is a BatchNorm's input (read by a var_mean over every dim but 1, as Inductor
    decomposes a training BatchNorm) with fewer than `routes.MIN_BATCH_VALUES` values per channel:
    kept, as the eager rule keeps it (backward keeps only the gradient orthogonal to 1 and x_hat,
    none at 2 values, while coding noise passes unprojected)."""
    if node is None or t.dim() < 2 or not few_batch_values(t):
        return False
    batch_dims = {0, *range(2, t.dim())}
    return any(user.target is torch.ops.aten.var_mean.correction and len(user.args) > 1
               and {d % t.dim() for d in user.args[1]} == batch_dims for user in node.users)


def _layout(layout: str, view: tuple[int, ...], positive: bool = False) -> GraphRoute:
    return GraphRoute(f"{'relu-mask' if positive else 'division'} {layout}", layout, tuple(view))


# Ops a pre-softmax score reaches softmax's statistics through (views, a scale, a mask added).
_SCORE_PATH = _VIEWS | frozenset({
    torch.ops.aten.expand.default, torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int, torch.ops.aten.clone.default, torch.ops.aten.mul.Tensor,
    torch.ops.aten.div.Tensor, torch.ops.aten.add.Tensor})
_SOFTMAX_STATS = frozenset({torch.ops.aten.amax.default, torch.ops.aten._softmax.default,
                            torch.ops.aten._safe_softmax.default,
                            torch.ops.aten._log_softmax.default, torch.ops.aten.logsumexp.default})


def _softmax_input(node, depth: int = 4) -> bool:
    """Whether node is a softmax's input in the forward (read by amax, softmax or logsumexp,
    through views, a scale or an added mask): its backward recomputes exp(x - max) / sum with the
    exact max and sum, so an error on x enters an exponent (an SDPA decomposed for dropout saves
    its scores so: a relative weight-gradient error of 2e4 coded)."""
    if node is None or depth == 0:
        return False
    return any(user.target in _SOFTMAX_STATS
               or (user.target in _SCORE_PATH and _softmax_input(user, depth - 1))
               for user in node.users)


def _smaller(spec, t: torch.Tensor, chosen: GraphRoute) -> bool:
    """Whether the packed form, a ReLU output's 1-bit mask included, holds fewer bytes than t
    (1-element maps do not: 7 B vs 4)."""
    codec = graph_ops.layout_codec(chosen.layout or FEATURES, spec.block, spec.bits,
                                   spec.backend)
    codec, shape = (codec, chosen.view) if chosen.layout else (codec.division, tuple(t.shape))
    n = packed_nbytes(codec, shape)
    mask = -(-t.numel() // 8) if chosen.positive else 0
    moments = 8 * math.prod(chosen.view[:-1]) if chosen.moments else 0
    return n is not None and n + mask + moments < t.numel() * t.element_size()


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _token_shape(t: torch.Tensor, node) -> tuple[int, ...] | None:
    """(N, T, F) of a token tensor: t's own shape at rank 3, else the rank-3 shape a rank-2
    (N * T, F) tensor was viewed from (a Linear input) or is viewed as (an `addmm` output read
    by GELU), None when the graph shows none."""
    if t.dim() == 3:
        return tuple(t.shape)
    if node is None:
        return None
    near = [node.args[0]] if node.target in _VIEWS and node.args else []
    near += [user for user in node.users if user.target in _VIEWS]
    for other in near:
        value = _val(other)
        if (value is not None and value.dim() == 3 and value.numel() == t.numel()
                and value.shape[-1] == t.shape[-1]):
            return tuple(value.shape)
    return None


_TRANSPOSES = frozenset({torch.ops.aten.permute.default, torch.ops.aten.t.default,
                         torch.ops.aten.transpose.int})


def _transpose_of(node):
    """The rank-2 node that node transposes (a `permute` by (1, 0), `t`, `transpose`), or None."""
    if node is None or node.target not in _TRANSPOSES or not node.args:
        return None
    source = node.args[0]
    value = _val(source)
    if value is None or value.dim() != 2:
        return None
    if node.target is torch.ops.aten.permute.default and list(node.args[1]) != [1, 0]:
        return None
    return source


def _convolution_map(node) -> bool:
    """Whether a rank-3 node is a Conv1d's (N, C, L) input or output (maps, not tokens)."""
    return node is not None and (node.target is _CONVOLUTION or any(
        user.target is _CONVOLUTION for user in node.users))


def _is_norm(node) -> bool:
    """Whether node is a LayerNorm's input (read by var_mean) or its normalised output
    ((x - mean) * rstd, a product with an rsqrt)."""
    if node is None:
        return False
    if any(user.target in _NORM_STATS for user in node.users):
        return True
    return node.target is torch.ops.aten.mul.Tensor and any(
        isinstance(a, torch.fx.Node) and a.target in _NORM_STATS for a in node.args)


def _sdpa_reads(node, graph) -> list[tuple[str, dict, set[str]]]:
    """(op name, arguments by name, the names node is passed as) of each SDPA op reading node
    in backward: SDPA's backward, and its forward where it is recomputed there."""
    inputs = [n for n in graph.find_nodes(op="placeholder") if n.name == node.name]
    reads = []
    for user in (u for n in inputs for u in n.users):
        schema = getattr(user.target, "_schema", None)
        if schema is not None and any(name in schema.name for name in _SDPA_OPS):
            args = {a.name: v for a, v in zip(schema.arguments, user.args)} | dict(user.kwargs)
            reads.append((schema.name, args, {name for name, v in args.items() if v in inputs}))
    return reads


def _sdpa_use(node, context) -> bool | None:
    """None when no SDPA op reads node in backward; else whether it may be coded: q, k, v where
    the backward recomputes the forward from them (`graph_ops.recompute_in_backward`), else
    `value` and `out` without a mask, is_causal or dropout."""
    graph = context.get("_bw_graph") if context else None
    reads = _sdpa_reads(node, graph) if node is not None and graph is not None else []
    if not reads:
        return None
    if any(name.endswith("sdpa_flash_cpu") for name, _, _ in reads):
        return all(roles <= _RECOMPUTED_CODED for _, _, roles in reads)
    # the mask is `attn_mask` (CPU flash backward) or `attn_bias` (CUDA efficient, cuDNN)
    return all(roles <= _SDPA_CODED and not args.get("is_causal") and not args.get("dropout_p")
               and args.get("attn_mask") is None and args.get("attn_bias") is None
               for _, args, roles in reads)
