"""Attention internals under DIVISION: SDPA's q/k/v packed, its output and logsumexp recomputed.

SDPA (the CPU flash kernel, `torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`) saves
q, k, v, its output and the logsumexp of the scores; its backward recomputes
P = exp(q k^T * scale - logsumexp). Decoded q, k with the *exact* logsumexp give unnormalised
rows of P, and an error on q.k enters exponentially (gradient errors 1e8-1e24 on a trained GPT).
So one SDPA call is packed as a unit (`SdpaCall`): q, k, v go through `division` in the
`feat/chan` layout of (N * heads, T, d) (`SdpaInput`), and the output and the logsumexp hold
nothing (`Recomputed`): at unpack they are recomputed by the same kernel from the decoded q, k, v
(one attention forward per call in backward), so P is the softmax of the decoded scores and
the gradient is that of attention at the decoded point. On the CPU flash backend (no dropout,
q/k/v of one shape but the last dim) the recomputation is the saved kernel's own forward. On
the MATH backend (a float mask of rank < 4 or requiring grad, dropout) autograd saves the
decomposition's tensors instead, not q, k, v: q, k, v are packed at the call's first save and
every save is recomputed by rerunning the decomposition (`sdpa_math.MathSaves`; q, k, v must
require grad). Both need q with at least `MIN_ELEMENTS` elements, CPU tensors, no grouped heads
(`enable_gqa`); otherwise the call's saves are routed as before (`routes._sdpa`).

Softmax outputs with exact zeros (causal, masked) stay exact (`routes._probabilities`): with
the zeros restored exactly (a 1-bit mask) the trained GPT still measured 5.2-5.7.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch.nn.attention import SDPBackend

from freqact.codecs.base import Codec
from freqact.engine.layouts import LayoutPacked, TokenLayout, packed_nbytes, token_view
from freqact.engine.sdpa_math import MathSaves

__all__ = ["Recomputed", "RecomputedPacked", "SdpaCall", "SdpaInput", "same_view", "setting"]

ROLES = ("q", "k", "v")


def same_view(a: torch.Tensor, b) -> bool:
    """Whether b is a tensor viewing exactly a's elements (same data pointer, shape, strides)."""
    return (isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def setting(args: tuple, kwargs: dict, name: str, index: int, default):
    """An SDPA argument given by keyword or at its position in
    (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


class SdpaCall:
    """The saves of one `F.scaled_dot_product_attention` call, packed as a unit.

    Holds weak references to the call's q, k, v (to recognise them), the packed forms of q, k, v
    (on the flash path the same objects their SavedVariables hold: no extra bytes; on the math
    path held for its `MathSaves`) and the call's settings. `mode` is "flash", "math" or None
    (nothing recomputed).

    Args:
        args, kwargs: the call's arguments (from the function tracker).
        division: the block's TokenLayout codec (its division settings).
        min_elements: q must have at least this many elements to be packed.
        call_id: the call's number (`tracker.FunctionTracker`): the saves with it are its own.
    """

    def __init__(self, args: tuple, kwargs: dict, division: TokenLayout, min_elements: int,
                 call_id: int) -> None:
        self.call_id = call_id
        q, k, v = (args[i] if len(args) > i else None for i in range(3))
        self.refs = tuple(weakref.ref(a) if isinstance(a, torch.Tensor) else None
                          for a in (q, k, v))
        self.mask = setting(args, kwargs, "attn_mask", 3, None)
        self.dropout = setting(args, kwargs, "dropout_p", 4, 0.0)
        self.causal = bool(setting(args, kwargs, "is_causal", 5, False))
        self.scale = setting(args, kwargs, "scale", 6, None)
        self.shapes = {r: tuple(a.shape) for r, a in zip(ROLES, (q, k, v))
                       if isinstance(a, torch.Tensor)}
        self.packed: dict[str, LayoutPacked] = {}
        # this backward's decoded q, k, v and recomputed out, lse, and the roles unpacked so far
        self._values: dict[str, torch.Tensor] = {}
        self._taken: set[str] = set()
        self.layout = TokenLayout(division.division)  # feat/chan: how q, k, v are packed
        # the routes' codecs (they refer back to this call; dropped at backward, `_release`)
        self.inputs = {r: SdpaInput(division, self, r) for r in ROLES}
        self.mode = self._mode(q, k, v, kwargs, min_elements)
        self.outputs = {r: Recomputed(self, r) for r in ("out", "lse")}
        self.math = None
        if self.mode == "math":  # the mask is not saved there: held by MathSaves, not here
            self.math, self.mask = MathSaves(self, self.mask), None

    def _packable(self, q, k, v, kwargs: dict, min_elements: int) -> bool:
        """q, k, v can all be packed: distinct CPU tensors of rank >= 3, smaller packed."""
        if not all(isinstance(a, torch.Tensor) for a in (q, k, v)) or q.dim() < 3:
            return False
        # q, k, v of mixed dtypes ran under autocast, which casts them to one inside the op,
        # where the hooks see autocast off: a rerun on them would choose and save otherwise
        if q.device.type != "cpu" or kwargs.get("enable_gqa", False) or not (
                q.dtype == k.dtype == v.dtype):
            return False
        if q.numel() < min_elements or any(same_view(a, b) for a, b in ((q, k), (q, v), (k, v))):
            return False
        # all three packed or none (the routes' own size check must not keep one of them)
        return all(packed_nbytes(self.layout, token_view(tuple(a.shape), True))
                   < a.numel() * a.element_size() for a in (q, k, v))

    def _mode(self, q, k, v, kwargs: dict, min_elements: int) -> str | None:
        """"flash" or "math" (the backend whose saves are recomputed), None: routed as before."""
        if not self._packable(q, k, v, kwargs, min_elements):
            return None
        backend = torch._fused_sdp_choice(q, k, v, self.mask, self.dropout, self.causal,
                                          scale=self.scale)
        if backend == int(SDPBackend.MATH):
            # the rerun must save what the forward saved: q, k, v require grad as they did
            return "math" if all(a.requires_grad for a in (q, k, v)) else None
        flash = (backend == int(SDPBackend.FLASH_ATTENTION) and not self.dropout and q.dim() == 4
                 and k.shape == q.shape and v.shape[:-1] == q.shape[:-1])
        return "flash" if flash else None

    def route(self, t: torch.Tensor, op: str):
        """The route of one save of this call (self.routes, built by the router), None: kept."""
        if self.mode == "math":
            return self.routes["recomputed" if self.math.metas else "attention"]
        role = self.role(t, op)
        if role in ROLES or (role in ("out", "lse") and self.complete):
            return self.routes[role]
        return None

    def role(self, t: torch.Tensor, op: str) -> str | None:
        """"q", "k", "v" (the call's arguments), "out", "lse" (what the kernel returned), or None
        (always on the math path: its saves are not told apart)."""
        if self.mode != "flash":
            return None
        for name, ref in zip(ROLES, self.refs):
            if ref is not None and same_view(t, ref()):
                return name
        q_shape = self.shapes.get("q")
        if q_shape is None or "v" not in self.shapes:
            return None
        if op.startswith("ScaledDotProduct") and tuple(t.shape) == (
                *q_shape[:-1], self.shapes["v"][-1]):
            return "out"
        if op == "" and t.dtype == torch.float32 and tuple(t.shape) == q_shape[:-1]:
            return "lse"
        return None

    def store(self, role: str, packed: LayoutPacked) -> None:
        self.packed[role] = packed

    @property
    def complete(self) -> bool:
        """q, k and v were all packed (then the output and logsumexp can be recomputed)."""
        return all(r in self.packed for r in ROLES)

    def _decode(self, role: str) -> torch.Tensor:
        """q, k or v decoded, in the token view it was packed in."""
        return self.layout.decode(self.packed[role])

    def decoded(self, role: str) -> torch.Tensor:
        """The decoded q, k or v, shaped (N, heads, T, d) (the math path's rerun inputs)."""
        return self._decode(role).view(self.shapes[role])

    def release(self) -> None:
        """Drop what only the forward's routing needs: the routes and their codecs, which refer
        back to this call. Called when backward starts, so that the call is freed with its graph
        by reference counting (the cycle otherwise kept every call's packed q, k, v until the
        cyclic garbage collector ran)."""
        self.routes = self.inputs = self.outputs = None
        if self.math is not None:
            self.math.codecs, self.math = None, None

    def unpack(self, role: str) -> torch.Tensor:
        """q, k or v decoded (token view), or out or logsumexp recomputed, once per backward
        (the flash path).

        Each of the five saves is unpacked once per backward; the values are held from the
        first unpack of the round to its last (all within the backward of the call's node), so
        the recomputation reuses the decoded q, k, v and out and logsumexp share one kernel
        call. A role unpacked again starts a new round (a second backward over a retained graph).
        """
        self.release()
        if role in self._taken:
            self._taken, self._values = set(), {}
        self._taken.add(role)
        value = self._value(role)
        if self._taken >= (set(ROLES) | {"out", "lse"} if self.complete else set(self.packed)):
            self._taken, self._values = set(), {}
        return value

    def _value(self, role: str) -> torch.Tensor:
        if role not in self._values:
            if role in ROLES:
                self._values[role] = self._decode(role)
            else:
                q, k, v = (self._value(r).view(self.shapes[r]) for r in ROLES)
                mask = self.mask
                if mask is not None and mask.dtype == torch.bool:
                    # as SDPA hands a boolean mask to the kernel: 0 where True, -inf elsewhere
                    mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, -math.inf)
                with torch.no_grad():
                    self._values["out"], self._values["lse"] = (
                        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                            q, k, v, 0.0, self.causal, attn_mask=mask, scale=self.scale))
        return self._values[role]

    def pack_inputs(self) -> int:
        """Pack q, k, v themselves (the math path saves none of them); returns their bytes."""
        for role, ref in zip(ROLES, self.refs):
            x = ref()
            self.packed[role] = self.layout.encode(x, view=token_view(tuple(x.shape), True))
        return sum(p.nbytes for p in self.packed.values())

class SdpaInput(TokenLayout):
    """q, k or v of one SDPA call in the `feat/chan` form; registers its packed form with the
    call, and decodes through the call (`SdpaCall.unpack`), so that one backward decodes each
    once for its own unpack and the recomputation together."""

    standalone = False  # the call recomputes its other saves from this decode

    def __init__(self, division: TokenLayout, call: SdpaCall, role: str) -> None:
        super().__init__(division.division)
        self.call, self.role = call, role

    def encode(self, x: torch.Tensor, noise: torch.Tensor | None = None,
               seed: int | None = None, view: tuple[int, ...] | None = None) -> LayoutPacked:
        packed = super().encode(x, noise, seed, view)
        self.call.store(self.role, packed)
        return packed

    def decode(self, packed: LayoutPacked) -> torch.Tensor:
        return self.call.unpack(self.role)


class RecomputedPacked:
    """Nothing held: the call recomputes the tensor at unpack (0 bytes)."""

    __slots__ = ("call", "role")
    nbytes = 0

    def __init__(self, call: SdpaCall, role: str) -> None:
        self.call, self.role = call, role


class Recomputed(Codec):
    """SDPA's output or logsumexp, recomputed from the call's decoded q, k, v."""

    name = "recomputed"
    whole_model = False
    standalone = False

    def __init__(self, call: SdpaCall, role: str) -> None:
        self.call, self.role = call, role

    def encode(self, x: torch.Tensor) -> RecomputedPacked:
        return RecomputedPacked(self.call, self.role)

    def decode(self, packed: RecomputedPacked) -> torch.Tensor:
        return packed.call.unpack(packed.role)
