"""SDPA on the math backend: every save of its decomposition recomputed from the decoded q, k, v.

Where `F.scaled_dot_product_attention` runs the MATH backend (a float `attn_mask` of rank < 4 or
requiring grad: Swin's relative position bias; dropout in training: HF GPT-2, BERT), autograd
saves the tensors of its decomposition, not q, k, v: the scaled q and k^T of q k^T, the softmax
output, dropout's noise, the (dropped) probabilities and v of P v. `MathSaves` holds none of them:
the call's own q, k, v are packed (`division` `feat/chan`, as on the flash path) at its first
save, and at the first unpack in backward the decomposition is rerun, by the same function forced
to the MATH backend, on the decoded q, k, v (requiring grad as the originals did, so autograd
saves the same tensors), the same mask and the same dropout noise; what that rerun saves is what
each SavedVariable unpacks (matched in order by shape and dtype). So backward is exactly the
gradient of attention at (q_hat, k_hat, v_hat): softmax of the decoded scores, exact zeros under
a mask, the mask's (a learned bias's) gradient from the same recomputed probabilities.

What stays exact: the mask (`HeldMask`: held as is, or once per period when it repeats along the
batch, Swin's windows x images), and the RNG state: dropout's noise depends only on the
generator's state and the shape, so the state after the save before the noise (the softmax's;
the codec's own draws come before it) is kept and the rerun starts from it (`fork_rng`: the
caller's stream is untouched). The noise's nonzero count is kept too: a rerun that drew another
mask raises instead of returning a wrong gradient.

Without dropout and `is_causal`, with contiguous q, k, v of one rank-4 shape but the last dim
and a float mask (or none), the rerun computes the saves directly, without autograd and without
the final P v that no save needs (`direct_saves`: about 60 % of the traced rerun's time on the
zoo's Swin). That writes out the decomposition of this PyTorch's MATH backend, so it is used
only once it has been checked: the first rerun of each kind of call (shapes, dtypes, scale,
mask shape, the forward's saves) runs both and compares every save bit for bit; a difference
(another PyTorch decomposing otherwise) keeps that kind on the traced rerun for the process
(`_DIRECT`). The check sees what one call's values show: the rule for rows of scores that are
all -inf (zeros, as `_safe_softmax`) is pinned against this PyTorch by the tests. A kind is a
shape: each new sequence length pays one traced rerun and one direct one, once.

Under CPU autocast SDPA casts q, k, v to the lower precision inside the op, where the pack hook
sees autocast as off: the rerun computes in the math backend's float32 on the decoded q, k, v,
without that rounding (a bfloat16 step, far below the codec's), and the forward graph's casts
round the gradients on the way back (tested). A backward run inside an autocast block reruns
the same: the unpack hook turns autocast off (`block._unpack`, tested).
"""
from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from freqact.codecs.base import Codec

__all__ = ["HeldMask", "MathPacked", "MathSave", "MathSaves", "direct_saves"]

_DIRECT: dict[tuple, bool] = {}
"""Kind of call (`MathSaves._kind`) -> whether `direct_saves` gave the traced rerun's saves bit
for bit at its first rerun (checked once per kind and process)."""


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _batch_period(mask: torch.Tensor) -> int:
    """The smallest p < B with mask[i] == mask[i % p] for every i along dim 0 (0: none)."""
    b = mask.shape[0] if mask.dim() >= 3 else 1
    if b < 2 or mask.stride(0) == 0:
        return 0
    # mask[i] == mask[i - p] for every i >= p: one comparison, no boolean tensor
    return next((p for p in range(1, b // 2 + 1) if b % p == 0 and torch.equal(mask[p:], mask[:-p])),
                0)


class HeldMask:
    """A math-path call's `attn_mask` (or None), held exactly for the rerun.

    A mask that repeats along dim 0 (Swin's (images * windows, heads, T, T) bias + shift mask) is
    held once per period (a copy); any other mask as is (its storage, in-place edits refused).
    """

    def __init__(self, mask: torch.Tensor | None) -> None:
        self.mask = None if mask is None else mask.detach()
        self.requires_grad = mask is not None and mask.requires_grad
        self.period = 0 if mask is None else _batch_period(self.mask)
        self.shape = None if mask is None else mask.shape
        self.version = None if mask is None else mask._version
        if self.period and (self.mask[:self.period].numel() * self.mask.element_size()
                            >= _storage_nbytes(self.mask)):
            self.period = 0  # a broadcast mask: its storage is smaller than a dense period
        if self.period:
            self.mask = self.mask[:self.period].clone()
        self.nbytes = 0 if mask is None else _storage_nbytes(self.mask)

    def rebuild(self) -> torch.Tensor | None:
        """The mask of the call's shape and values, a leaf requiring grad as the original did."""
        if self.mask is None:
            return None
        if self.period:
            full = self.mask.expand(self.shape[0] // self.period, *self.mask.shape)
            full = full.reshape(self.shape)
        else:
            if self.mask._version != self.version:
                raise RuntimeError("compress: an attn_mask of scaled_dot_product_attention was "
                                   "modified in place after the call; clone it before editing")
            full = self.mask.detach()
        return full.requires_grad_(self.requires_grad)


class MathPacked:
    """One save of a math-path call: its index in the call, and the bytes charged to it."""

    __slots__ = ("index", "nbytes", "saves")

    def __init__(self, saves: MathSaves, index: int, nbytes: int) -> None:
        self.saves, self.index, self.nbytes = saves, index, nbytes


class MathSaves:
    """The saves of one SDPA call on the math backend, recomputed together.

    Args:
        call: the `attention.SdpaCall` (its settings, the packed q, k, v).
        mask: the call's attn_mask (None: none).
    """

    def __init__(self, call, mask: torch.Tensor | None) -> None:
        self.call = call
        self.mask = HeldMask(mask)
        self.metas: list[tuple] = []  # (shape, dtype) of each save, in order
        self.rng: torch.Tensor | None = None  # the CPU generator's state after the last save
        self.replay: torch.Tensor | None = None  # its state before the dropout draw
        self.noise: tuple[int, int] | None = None  # (save index, nonzero count) of the noise
        self.cache: list | None = None  # the rerun's saves not unpacked yet
        # route name -> codec: the first save (labelled as the flash path's q, k, v), the others
        self.codecs = {"attention": MathSave(self, f"{call.layout.name} feat/chan"),
                       "recomputed": MathSave(self, "recomputed")}

    def encode(self, x: torch.Tensor) -> MathPacked:
        index = len(self.metas)
        self.metas.append((tuple(x.shape), x.dtype))
        # the first save holds the packed q, k, v (the call's arguments are alive now) and mask
        nbytes = self.call.pack_inputs() + self.mask.nbytes if index == 0 else 0
        if self.call.dropout:
            if x.grad_fn is None and self.noise is None and index > 0:
                # dropout's noise (q, k, v require grad: every other save has a history)
                self.replay = self.rng
                self.noise = (index, int(torch.count_nonzero(x)))
                nbytes += _storage_nbytes(self.replay)
            if self.noise is None:  # the state before the noise is drawn, until it is found
                self.rng = torch.get_rng_state()
        return MathPacked(self, index, nbytes)

    def unpack(self, index: int) -> torch.Tensor:
        """Save `index` as the rerun on the decoded q, k, v saved it (one rerun per backward)."""
        if self.cache is None or self.cache[index] is None:
            self.call.release()
            self.cache = self._rerun()
        x, self.cache[index] = self.cache[index], None
        return x

    def _rerun(self) -> list[torch.Tensor]:
        """The decomposition's saves on the decoded q, k, v, matched to the forward's: computed
        directly where that was checked to give the same saves, else traced."""
        inputs = [self.call.decoded(role).detach() for role in ("q", "k", "v")]
        mask = self.mask.rebuild()
        kind = self._kind(inputs)
        if kind is None:
            return self._traced(inputs, mask)
        checked = _DIRECT.get(kind)
        if checked:
            return direct_saves(*inputs, mask, self.call.scale)
        traced = self._traced(inputs, mask)
        if checked is None:
            self._check(kind, inputs, mask, traced)
        return traced

    def _check(self, kind: tuple, inputs: list[torch.Tensor], mask: torch.Tensor | None,
               traced: list[torch.Tensor]) -> None:
        """Record in `_DIRECT` whether `direct_saves` gives the traced saves bit for bit. Saves
        that differ where the traced ones hold NaNs leave the kind unrecorded (NaN payloads may
        differ; the next call checks again)."""
        try:
            direct = direct_saves(*inputs, mask, self.call.scale)
        except (RuntimeError, ValueError, TypeError):  # another PyTorch's saves: not direct
            _DIRECT[kind] = False
            return
        same = len(direct) == len(traced) and all(map(_same_bits, direct, traced))
        if same or not any(bool(t.isnan().any()) for t in traced):
            _DIRECT[kind] = same

    def _kind(self, inputs: list[torch.Tensor]) -> tuple | None:
        """What decides the direct rerun's saves (None: the call needs the traced rerun)."""
        q, k, v = inputs
        mask = self.mask
        if (self.call.dropout or self.call.causal or q.dim() != 4 or k.shape != q.shape
                or v.shape[:-1] != q.shape[:-1] or not q.dtype == k.dtype == v.dtype
                or not all(t.is_contiguous() for t in inputs)
                or (mask.mask is not None and not mask.mask.is_floating_point())):
            return None
        return (tuple(q.shape), tuple(v.shape), q.dtype, self.call.scale, tuple(self.metas),
                None if mask.mask is None else (tuple(mask.shape), mask.mask.dtype))

    def _traced(self, inputs: list[torch.Tensor], mask: torch.Tensor | None
                ) -> list[torch.Tensor]:
        """The saves of SDPA itself on the decoded q, k, v and the call's rebuilt mask, rerun on
        the MATH backend under autograd."""
        call = self.call
        inputs = [x.requires_grad_() for x in inputs]
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            # The rerun's graph is never differentiated: its SavedVariables hold the detached
            # copy. Returning t itself, a saved output of its own node (the softmax's), would
            # make the cycle node -> SavedVariable -> t -> node, which no garbage collector
            # sees: every call's rerun graph and saves would leak (Swin: ~24 MB per step).
            saved.append(t.detach())
            return saved[-1]
        dropout = bool(call.dropout)
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH), torch.random.fork_rng(
                devices=[], enabled=dropout), torch.autograd.graph.saved_tensors_hooks(
                keep, lambda t: t):
            if dropout:
                torch.set_rng_state(self.replay)
            torch.nn.functional.scaled_dot_product_attention(
                *inputs, attn_mask=mask, dropout_p=call.dropout,
                is_causal=call.causal, scale=call.scale)
        out = self._match(saved)
        if self.noise is not None and int(torch.count_nonzero(out[self.noise[0]])) != (
                self.noise[1]):
            raise RuntimeError("compress: the recomputed dropout mask of scaled_dot_product_"
                               "attention differs from the forward's (RNG state not replayed)")
        return out

    def _match(self, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        """For each forward save, the next rerun save of its shape and dtype (in order)."""
        out, j = [], 0
        for shape, dtype in self.metas:
            while j < len(saved) and (tuple(saved[j].shape), saved[j].dtype) != (shape, dtype):
                j += 1
            if j == len(saved):
                raise RuntimeError(
                    f"compress: rerunning scaled_dot_product_attention saved other tensors than "
                    f"its forward ({[tuple(t.shape) for t in saved]} vs "
                    f"{[m[0] for m in self.metas]})")
            out.append(saved[j])
            j += 1
        return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b have one shape and dtype and the same bits (NaNs and signed zeros too)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    return torch.equal(a.view(ints), b.view(ints)) if a.is_floating_point() and ints else (
        torch.equal(a, b))


def direct_saves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 scale: float | None) -> list[torch.Tensor]:
    """The tensors the MATH backend saves for SDPA(q, k, v, mask) without dropout or is_causal,
    in its order, computed under no_grad (no autograd records, no final P v).

    The decomposition, as ATen's: with r = sqrt(|scale|) (scale default 1 / sqrt(d), in double),
    q_s = q * r (-r for a negative scale) and k_s^T = k^T * r, scores = q_s @ k_s^T through
    (N * heads, ...) views, plus the mask, P = the safe softmax over the last dim (rows all
    -inf give zeros, as `_safe_softmax`).

    Args:
        q, k: contiguous (N, heads, T, d); v: contiguous (N, heads, T, dv); mask: a float mask
            broadcastable to (N, heads, T, T), or None; scale: SDPA's scale (None: 1 / sqrt(d)).

    Returns:
        [k_s^T (N * heads, d, T), q_s (N * heads, T, d), P (N, heads, T, T),
        v (N * heads, T, dv), P (N * heads, T, T)]: the first bmm's operands (the second
        first), the softmax output, the second bmm's operands (likewise).
    """
    n, heads, t, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    root = math.sqrt(abs(scale))
    with torch.no_grad():
        q_s, k_t = q * (-root if scale < 0 else root), k.transpose(-2, -1) * root
        scores = torch.bmm(q_s.view(n * heads, t, d), k_t.reshape(n * heads, d, t))
        scores = scores.view(n, heads, t, t)
        if mask is not None:
            scores.add_(mask.detach())
        # ATen's _safe_softmax (softmax, then zeros where a row is all -inf) in fewer passes
        # (about 60 % of its time on Swin's shapes): a row's max is -inf exactly when the row
        # is all -inf (a NaN makes the max NaN, as it makes the row not all -inf). Such a row's
        # softmax is NaN, so rows are looked for only when p's sum is NaN (probabilities sum to
        # at most p.numel(): no overflow), one fast pass (19 vs 174 us on (256, 3, 16, 16)).
        p = torch.softmax(scores, -1)
        if p.sum().isnan():
            masked = scores.amax(-1, keepdim=True) == float("-inf")
            p.masked_fill_(masked, 0.0)
        return [k_t.reshape(n * heads, d, t), q_s.view(n * heads, t, d), p,
                v.reshape(n * heads, t, v.shape[-1]), p.view(n * heads, t, t)]


class MathSave(Codec):
    """A codec view of `MathSaves`: encode records a save, decode recomputes it.

    Args:
        saves: the call's MathSaves; name: the route's label (the first save, which holds the
            packed q, k, v, is labelled as the flash path's q, k, v).
    """

    whole_model = False
    standalone = False

    def __init__(self, saves: MathSaves, name: str) -> None:
        self.saves, self.name = saves, name

    def encode(self, x: torch.Tensor) -> MathPacked:
        return self.saves.encode(x)

    def decode(self, packed: MathPacked) -> torch.Tensor:
        return packed.saves.unpack(packed.index)
