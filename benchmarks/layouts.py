"""Layout study for token tensors (issue 14.2): which DIVISION layout loses least gradient.

Trains a small `vit` on the real CIFAR-10 and a small `gpt` on the standard-library text corpus
(`freqact.text`) for a few hundred steps, then, on one real batch, replaces the tensors autograd
saves on ONE route by their DIVISION round trip (B = 8, Q = 2, stochastic rounding, the
pure-torch reference `freqact.kernels.reference`) and compares all parameter gradients with the
exact backward: relative Frobenius error ||g - g_exact|| / ||g_exact|| and cosine, mean over
noise seeds. Routes (what saved the tensor):

- `linear_in`: inputs of `nn.Linear` on token tensors (N, T, F).
- `act_in`: inputs of GELU/SiLU.
- `norm_in`: inputs of LayerNorm (module) and every token-sized tensor RMSNorm's functional code
  saves (its input and the normalised input); the (N, T, 1) statistics stay exact.
- `sdpa_qkvo`: q, k, v and the output that `F.scaled_dot_product_attention` saves (CPU flash
  kernel), viewed as tokens (N, T, heads * head_dim); logsumexp stays exact. `sdpa_qk` and
  `sdpa_vo` are its two halves (q and k, whose error the backward's recomputed
  exp(q k^T - logsumexp) amplifies; v and out).
- `attn_probs`: softmax probabilities (N, heads, T, T), saved when attention runs as matmul +
  softmax (measured with SDPA's MATH backend, which is what explicit-softmax code saves), viewed
  as (N * heads, queries, keys): "tokens" are the queries, "features" the keys.

Layouts of a token view (M, T, F) name the block axis, then whose min/step the codes share:
`feat/tok` (blocks of 8 features, min/step per token: today's map rule for rank 3), `feat/chan`,
`tok/tok`, `tok/chan` (blocks of 8 consecutive tokens, class token included), and for the ViT
`row/*` (8 consecutive patches in raster order, i.e. grid rows, the class token a block of its
own) and `grid/*` (2x4 tiles of the patch grid, the class token alone), and `as-saved` (the codec on the
tensor exactly as autograd saved it, by today's map rule for its rank: for 4D attention tensors
8x8 blocks over (tokens, head_dim) or (queries, keys), min/step per head). All layouts but
`as-saved` hold 8 elements per block, so their bytes differ only by the min/step count (4 bytes
per token row or per channel column); the table prints bytes/element for each.

The tensors are selected by `saved_tensors_hooks` with module forward pre-hooks (which module is
running) and a `TorchFunctionMode` (which torch function is running). This is a measurement
script, not the engine. Run from the repository root::

    python -m benchmarks.layouts            # ~10 min on 2 busy cores -> results/layouts-cpu.json
    python -m benchmarks.layouts --quick    # seconds: tiny models, a smoke test
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import Counter
from contextlib import ExitStack, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from benchmarks.common import RESULTS_DIR, gradient_error, print_table, write_results
from freqact import codecs, data, kernels, models, text
from freqact.engine.layouts import TokenLayout

BLOCK, BITS = 8, 2
ROUTES = ("linear_in", "act_in", "norm_in", "sdpa_qkvo", "sdpa_qk", "sdpa_vo", "sdpa_v",
          "sdpa_o", "sdpa_qk_re", "sdpa_qkv_re", "attn_probs", "attn_probs_zero", "math_qkv")
# Routes measured as the union of finer ones (a saved tensor belongs to exactly one fine route).
ROUTE_PARTS = {"sdpa_qkvo": ("sdpa_qk", "sdpa_v", "sdpa_o"), "sdpa_vo": ("sdpa_v", "sdpa_o"),
               "sdpa_qk_re": ("sdpa_qk",), "sdpa_qkv_re": ("sdpa_qk", "sdpa_v"),
               "attn_probs_zero": ("attn_probs",)}
# Routes whose SDPA output and logsumexp are recomputed from the decoded q, k, v (held: 0 bytes).
RECOMPUTED = frozenset({"sdpa_qk_re", "sdpa_qkv_re"})
# Routes whose decoded probabilities are set back to exactly 0 where they were 0 (a 1-bit mask).
ZERO_KEPT = frozenset({"attn_probs_zero"})
# layout name -> (block axis: "F" features, "T" tokens, "G" 2x4 tiles of the patch grid, stats)
LAYOUTS = {
    "feat/tok": ("F", "token"), "feat/chan": ("F", "channel"),
    "tok/tok": ("T", "token"), "tok/chan": ("T", "channel"),
    "row/tok": ("R", "token"), "row/chan": ("R", "channel"),
    "grid/tok": ("G", "token"), "grid/chan": ("G", "channel"),
}
# Layouts with 64-element blocks, run by the engine's own codec (`engine.layouts.TokenLayout`):
# `tile` 8 tokens x 8 features, `tok64` 64 tokens of one feature, `grid64` 8 x 8 patches of the
# patch grid per feature (class token its own map).
BLOCK64 = tuple(f"{b}/{s}" for b in ("tile", "tok64", "grid64") for s in ("tok", "chan"))
GRID_ONLY = ("R", "G", "grid64")  # need a patch grid: the ViT only
TILE = (2, 4)
REPO_ROOT = Path(__file__).resolve().parents[1]

FULL = {"vit": {"dim": 96, "depth": 4, "heads": 3}, "gpt": {"dim": 96, "depth": 4, "heads": 3},
        "steps": 250, "batch": 48, "eval_batch": 32, "seeds": (0, 1, 2), "corpus_bytes": 2**21,
        "context": 64, "train_images": None}
QUICK = {"vit": {"dim": 32, "depth": 1, "heads": 2, "patch_size": 8},
         "gpt": {"dim": 32, "depth": 1, "heads": 2}, "steps": 3, "batch": 8,
         "eval_batch": 4, "seeds": (0,), "corpus_bytes": 100_000, "context": 24,
         "train_images": 512}


# --- round trips under a layout --------------------------------------------------------------

def token_order(tokens: int, tile: tuple[int, int]) -> torch.Tensor:
    """Token permutation putting each `tile` of the patch grid in consecutive places.

    For ViT tokens (class token first, then a g x g grid row-major) the tiles come in row-major
    tile order and the class token last (a block of its own). tile (1, g) is the raster order.

    Raises:
        ValueError: if `tokens` is not 1 + g * g with g divisible by the tile sides.
    """
    g = math.isqrt(tokens - 1)
    if g * g != tokens - 1 or g % tile[0] or g % tile[1]:
        raise ValueError(f"tokens: expected 1 + g*g with g a multiple of {tile}, got {tokens}")
    pos = torch.arange(g * g).view(g // tile[0], tile[0], g // tile[1], tile[1])
    return torch.cat([1 + pos.permute(0, 2, 1, 3).flatten(), torch.tensor([0])])


def roundtrip(v: torch.Tensor, layout: str, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """DIVISION round trip of token view v (M, T, F) under `layout`; returns (v_hat, bytes).

    LFC: bf16 means of 8 elements along the block axis (`kernels.lfc_encode`, the torch reference); HFC: the
    residual quantised by `kernels.quantize_encode` (backend torch) with one min/step per token row (T
    maps of F) or per channel column (F maps of T), stochastic rounding drawn from `gen`.
    """
    axis, stats = LAYOUTS[layout]
    perm = None
    if axis in ("G", "R"):
        tile = TILE if axis == "G" else (1, math.isqrt(v.shape[1] - 1))
        perm = token_order(v.shape[1], tile)
        v = v[:, perm]
    w = (v.transpose(1, 2) if axis != "F" else v).contiguous().float()  # blocks on the last dim
    lfc = kernels.lfc_encode(w, BLOCK)
    base = kernels.division_decode(lfc, backend="torch")
    flip = (axis != "F") != (stats == "channel")  # quantiser maps run along the last dim too
    h = w - base
    h = h.transpose(1, 2).contiguous() if flip else h
    quant = kernels.quantize_encode(h, BITS, torch.rand(h.shape, generator=gen), backend="torch")
    h_hat = kernels.division_decode(quant, backend="torch")
    w_hat = base + (h_hat.transpose(1, 2) if flip else h_hat)
    v_hat = w_hat.transpose(1, 2) if axis != "F" else w_hat
    if perm is not None:
        v_hat = v_hat[:, torch.argsort(perm)]
    return v_hat.contiguous().to(v.dtype), 2 * lfc.lfc.numel() + quant.nbytes


def engine_roundtrip(v: torch.Tensor, layout: str, gen: torch.Generator
                     ) -> tuple[torch.Tensor, int]:
    """The engine's `TokenLayout` round trip of v (M, T, F) (kernels.reference, noise from gen)."""
    blocks, stats = layout.split("/")
    codec = TokenLayout(codecs.get("division", block=BLOCK, bits=BITS, backend="torch"),
                        blocks, stats)
    torch.manual_seed(int(torch.randint(2**62, (), generator=gen)))  # the reference's noise
    packed = codec.encode(v)
    return codec.decode(packed), packed.nbytes


def as_saved_roundtrip(t: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """The full DIVISION codec on t as saved (today's map rule for its rank)."""
    packed = kernels.division_encode(t.contiguous(), BLOCK, BITS,
                                     torch.rand(t.shape, generator=gen), backend="torch")
    return kernels.division_decode(packed, backend="torch").view(t.shape), packed.nbytes


# --- which route saved a tensor --------------------------------------------------------------

class _FunctionNames(TorchFunctionMode):
    """Keeps the name of the torch function running right now on `self.names` (a stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.args: list[tuple] = []
        self.kwargs: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", ""))
        self.args.append(args)
        self.kwargs.append(kwargs or {})
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.names.pop()
            self.args.pop()
            self.kwargs.pop()


def _same_view(a: torch.Tensor, b: object) -> bool:
    return (torch.is_tensor(b) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride())


def _token_view(t: torch.Tensor, inp: torch.Tensor | None):
    """(view (M, T, F), back) for a tensor with the running module's token input's elements."""
    if inp is None or inp.dim() != 3 or t.numel() != inp.numel():
        return None
    return t.reshape(inp.shape), lambda v: v.reshape(t.shape)


def classify(t: torch.Tensor, func: str, args: tuple, module: nn.Module | None,
             inp: torch.Tensor | None, math_attention: bool):
    """(route, view (M, T, F), back-function) for a saved tensor, or None (kept exact).

    Under the MATH attention backend, SDPA's (N, heads, T, T) tensors are the probabilities
    and its 3D ones the scaled q, k^T and v its matmuls save (`math_qkv`, k^T read transposed);
    otherwise every 4D tensor SDPA saves is q, k, v or out: `sdpa_qk` if it is the call's q or k argument, `sdpa_v` if
    it is its v, else `sdpa_o` (the output).
    """
    if func == "scaled_dot_product_attention" and t.dim() == 3 and math_attention:
        if t.shape[-1] == t.shape[-2]:  # matmul's view of the probabilities (packed as 4D)
            return None
        # eager attention's matmul operands: scaled q (N * heads, T, d), scaled k^T
        # (N * heads, d, T), v; k^T is read as tokens (N * heads, T, d) like the others
        tokens, dim = args[0].shape[-2:]
        if tokens != dim and t.shape[-2:] == (dim, tokens):
            return "math_qkv", t.transpose(1, 2), lambda v: v.transpose(1, 2).reshape(t.shape)
        return "math_qkv", t, lambda v: v.reshape(t.shape)
    if func == "scaled_dot_product_attention" and t.dim() == 4:
        n, h, q, last = t.shape
        if math_attention:
            if last != q:
                return None
            return "attn_probs", t.reshape(n * h, q, last), lambda v: v.reshape(t.shape)
        view = t.permute(0, 2, 1, 3).reshape(n, q, h * last)  # q/k/v/out -> tokens (N, T, F)
        route = ("sdpa_qk" if any(_same_view(t, a) for a in args[:2]) else
                 "sdpa_v" if len(args) > 2 and _same_view(t, args[2]) else "sdpa_o")
        return route, view, lambda v: v.reshape(n, q, h, last).permute(0, 2, 1, 3)
    route = None
    if func == "linear" and isinstance(module, nn.Linear):
        route = "linear_in"
    elif func in ("gelu", "silu"):
        route = "act_in"
    elif func == "layer_norm" or isinstance(module, models.RMSNorm):
        route = "norm_in"
    found = _token_view(t, inp) if route else None
    return (route, *found) if found else None


class SavedTensorReplacer:
    """Saved-tensor hooks replacing one route's tensors by their round trip under one layout.

    Args:
        model: the model (its parameters and buffers are never replaced).
        route: one of ROUTES, or None to replace nothing (then gradients are bit-exact).
        layout: a LAYOUTS name or "as-saved".
        seed: seed of the stochastic-rounding noise.

    Attributes:
        counts: per fine route (not those of ROUTE_PARTS), Counter of "tensors", "elements"
            seen and, for the replaced route, "bytes" of the packed forms; see `route_count`.
    """

    def __init__(self, model: nn.Module, route: str | None, layout: str, seed: int,
                 math_attention: bool = False) -> None:
        self.route, self.layout, self.math_attention = route, layout, math_attention
        self.gen = torch.Generator().manual_seed(seed)
        self.fixed = {t.untyped_storage().data_ptr()
                      for t in (*model.parameters(), *model.buffers())}
        self.modules: list[tuple[nn.Module, torch.Tensor | None]] = []
        self.functions = _FunctionNames()
        # key -> (the saved tensor, what autograd keeps instead); holding the saved tensor keeps
        # its address from being reused by a later tensor with the same key.
        self.memo: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.aliases: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.counts: dict[str, Counter] = {r: Counter() for r in ROUTES}
        self._model = model

    def _pre(self, module, args):
        self.modules.append((module, args[0] if args and torch.is_tensor(args[0]) else None))

    def _post(self, module, args, out):
        self.modules.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.untyped_storage().data_ptr() in self.fixed:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t._version)
        if key in self.memo:  # one tensor saved by two ops is packed once, as the engine does
            return self.memo[key][1]
        alias = self.aliases.get(key[:2] + (t.numel(),)) if t.is_contiguous() else None
        if alias is not None and alias[0]._version == t._version:
            # another contiguous view of a replaced tensor (matmul's (N * heads, T, T) view of
            # the probabilities): its decoded values, as the engine's one packed form decodes
            return alias[1].reshape(t.shape)
        module, inp = self.modules[-1] if self.modules else (None, None)
        func, args, kwargs = ((self.functions.names[-1], self.functions.args[-1],
                               self.functions.kwargs[-1]) if self.functions.names else ("", (), {}))
        found = classify(t, func, args, module, inp, self.math_attention)
        out = t
        if self.route in RECOMPUTED and func == "scaled_dot_product_attention" and (
                t.dim() == 3 or (found is not None and found[0] == "sdpa_o")):
            # SDPA saves k, q, v, then logsumexp and out: both from the replaced q, k, v
            out = self._recomputed(args, kwargs)[0 if t.dim() == 4 else 1]
        elif found is not None:
            out = self._replace(t, *found)
        self.memo[key] = (t, out)
        if out is not t and t.is_contiguous():
            self.aliases[key[:2] + (t.numel(),)] = (t, out)
        return out

    def _replace(self, t: torch.Tensor, route: str, view: torch.Tensor, back) -> torch.Tensor:
        """t's round trip if `route` is measured (counting it), else t."""
        self.counts[route].update(tensors=1, elements=t.numel())
        if route != self.route and route not in ROUTE_PARTS.get(self.route, ()):
            return t
        if self.layout == "as-saved":
            out, nbytes = as_saved_roundtrip(t, self.gen)
        elif self.layout in BLOCK64:
            v_hat, nbytes = engine_roundtrip(view, self.layout, self.gen)
            out = back(v_hat)
        else:
            v_hat, nbytes = roundtrip(view, self.layout, self.gen)
            out = back(v_hat)
        if self.route in ZERO_KEPT:  # a 1-bit mask of the zeros (causal, masked)
            out = out.masked_fill(t == 0, 0.0)
            nbytes += -(-t.numel() // 8)
        self.counts[route].update(bytes=nbytes)
        return out

    def _replaced(self, t: torch.Tensor) -> torch.Tensor:
        """What autograd keeps for an already packed tensor t (t itself if not packed)."""
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t._version)
        return self.memo.get(key, (t, t))[1]

    def _recomputed(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, logsumexp) of the CPU flash kernel on the replaced q, k, v of one SDPA call."""
        q, k, v = (self._replaced(a) for a in args[:3])
        setting = dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:6]), **kwargs)
        with torch.no_grad():
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, setting.get("dropout_p", 0.0), setting.get("is_causal", False),
                attn_mask=setting.get("attn_mask"), scale=setting.get("scale"))

    def __enter__(self) -> SavedTensorReplacer:  # noqa: PYI034 (Python 3.10 has no Self)
        self._stack = ExitStack()
        for m in self._model.modules():
            self._stack.enter_context(m.register_forward_pre_hook(self._pre))
            self._stack.enter_context(m.register_forward_hook(self._post))
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, lambda x: x))
        self._stack.enter_context(self.functions)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


# --- gradients --------------------------------------------------------------------------------

def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class logits (N, C) or next-token logits (N, T, V)."""
    out = model(x)
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def gradients(model, x, y, *, route=None, layout="feat/tok", seed=0, math_attention=False):
    """All parameter gradients as one float64 vector, and the replacer's counts."""
    model.zero_grad(set_to_none=True)
    replacer = SavedTensorReplacer(model, route, layout, seed, math_attention)
    with sdpa_kernel(SDPBackend.MATH) if math_attention else nullcontext(), replacer:
        loss = loss_of(model, x, y)
    loss.backward()
    grads = torch.cat([p.grad.flatten().double() for p in model.parameters()
                       if p.grad is not None])
    return grads, replacer.counts


def route_count(counts: dict[str, Counter], route: str, key: str) -> int:
    """counts[route][key], summed over the parts of a union route."""
    return sum(counts[r][key] for r in ROUTE_PARTS.get(route, (route,)))


def measure_routes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, layouts: list[str],
                   seeds: tuple[int, ...], routes: tuple[str, ...] = ROUTES) -> dict:
    """Per route and layout: bytes/element, relative error and cosine (mean, per seed)."""
    model.eval()  # no dropout here; eval only makes the runs repeatable
    results = {}
    for route in routes:
        math_attention = route.startswith(("attn_probs", "math_"))
        exact, counts = gradients(model, x, y, math_attention=math_attention)
        again, _ = gradients(model, x, y, math_attention=math_attention)
        if not torch.equal(exact, again):
            raise RuntimeError(f"{route}: the hooks alone changed the gradients")
        if not route_count(counts, route, "tensors"):
            continue
        rows = {}
        for layout in layouts:
            errors, cosines, nbytes = [], [], 0
            for seed in seeds:
                g, c = gradients(model, x, y, route=route, layout=layout, seed=seed,
                                 math_attention=math_attention)
                rel, cos = gradient_error(g, exact)
                errors.append(rel)
                cosines.append(cos)
                nbytes = route_count(c, route, "bytes")
            rows[layout] = {"bytes_per_element": nbytes / route_count(counts, route, "elements"),
                            "rel_error": statistics.fmean(errors), "cosine": statistics.fmean(cosines),
                            "rel_error_per_seed": errors, "cosine_per_seed": cosines}
        results[route] = {"tensors": route_count(counts, route, "tensors"),
                          "elements": route_count(counts, route, "elements"), "layouts": rows}
    return results


# --- training on real data --------------------------------------------------------------------

def _train(model: nn.Module, batches, steps: int, lr: float) -> list[float]:
    """AdamW (weight decay 0.05), linear warm-up over 10% of the steps; returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    model.train()
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def vit_case(cfg: dict, data_dir: Path) -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict]:
    """Train the ViT on CIFAR-10; return it, a real test batch and training facts."""
    ds = data.load("cifar10", data_dir, subset=cfg["train_images"])
    gen = torch.Generator().manual_seed(0)

    def batches():  # normalised per batch: the whole float32 training set would be 600 MB
        while True:
            idx = torch.randint(0, ds.train_images.shape[0], (cfg["batch"],), generator=gen)
            flip = torch.rand(cfg["batch"], generator=gen) < 0.5
            x = data.normalize(ds.train_images[idx], ds.mean, ds.std)
            yield torch.where(flip[:, None, None, None], x.flip(-1), x), ds.train_labels[idx]

    torch.manual_seed(0)
    model = models.get("vit", num_classes=10, **cfg["vit"])
    losses = _train(model, batches(), cfg["steps"], 1e-3)
    test = data.normalize(ds.test_images, ds.mean, ds.std)
    model.eval()
    with torch.no_grad():
        acc = float((model(test).argmax(1) == ds.test_labels).float().mean())
    x, y = test[: cfg["eval_batch"]], ds.test_labels[: cfg["eval_batch"]]
    return model, x, y, {"final_train_loss": statistics.fmean(losses[-20:]),
                         "test_accuracy": acc, "test_images": int(test.shape[0])}


def gpt_case(cfg: dict) -> tuple[nn.Module, torch.Tensor, torch.Tensor, dict]:
    """Train the GPT on the standard-library corpus; return it, a real test batch and facts."""
    corpus = text.load_stdlib_corpus(cfg["corpus_bytes"])
    gen = torch.Generator().manual_seed(0)
    context = cfg["context"]

    def batches():
        while True:
            yield text.sample_windows(corpus.train, context, cfg["batch"], gen)

    torch.manual_seed(0)
    model = models.get("gpt", num_classes=text.VOCAB_SIZE, **{"context": context, **cfg["gpt"]})
    losses = _train(model, batches(), cfg["steps"], 3e-3)
    tx, ty = text.tiled_windows(corpus.test, context)
    x, y = tx[: cfg["eval_batch"]], ty[: cfg["eval_batch"]]
    model.eval()
    with torch.no_grad():
        test_loss = float(loss_of(model, tx[:256], ty[:256]))
    return model, x, y, {"final_train_loss": statistics.fmean(losses[-20:]),
                         "test_loss": test_loss, "corpus_sha256": corpus.sha256,
                         "corpus_bytes": cfg["corpus_bytes"]}


# --- the study --------------------------------------------------------------------------------

def default_data_dir() -> Path:
    """$FREQACT_DATA, else the shared data folder next to the repository (../shared/data)."""
    return Path(os.environ.get("FREQACT_DATA") or REPO_ROOT.parent / "shared" / "data")


def layouts_for(name: str, chosen: list[str] | None) -> list[str]:
    """The layouts measured on model `name` (the ViT has a patch grid, the GPT none)."""
    every = [*LAYOUTS, *BLOCK64, "as-saved"]
    grid = {k for k in every if k in BLOCK64 and k.startswith("grid64")} | {
        k for k, (axis, _) in LAYOUTS.items() if axis in GRID_ONLY}
    return [k for k in (chosen or every) if name == "vit" or k not in grid]


def run(quick: bool, data_dir: Path, chosen: list[str] | None = None,
        steps: int | None = None, names: tuple[str, ...] = ("vit", "gpt"),
        routes: tuple[str, ...] = ROUTES) -> dict:
    """Train the models, measure every route and layout (or those chosen); return the payload.

    Args:
        chosen: the layouts to measure (None: all); names: the models; routes: the routes.
        steps: training steps per model instead of the configuration's (a shorter study).
    """
    cfg = dict(QUICK if quick else FULL)
    if steps is not None:
        cfg["steps"] = steps
    payload = {"block": BLOCK, "bits": BITS, "quick": quick,
               "config": {k: v for k, v in cfg.items() if k != "seeds"},
               "seeds": list(cfg["seeds"]), "models": {}}
    for name in names:
        start = time.perf_counter()
        model, x, y, facts = vit_case(cfg, data_dir) if name == "vit" else gpt_case(cfg)
        print(f"{name}: trained in {time.perf_counter() - start:.0f} s: {facts}",
              file=sys.stderr, flush=True)
        measured = measure_routes(model, x, y, layouts_for(name, chosen), cfg["seeds"], routes)
        payload["models"][name] = {"settings": cfg[name], "training": facts,
                                   "batch_shape": list(x.shape), "routes": measured,
                                   "seconds": time.perf_counter() - start}
    return payload


def table_rows(payload: dict) -> list[list[object]]:
    """One row per model, route and layout; the best (lowest error) layout of a route starred."""
    rows = []
    for name, m in payload["models"].items():
        for route, r in m["routes"].items():
            best = min((k for k in r["layouts"] if k != "as-saved"),
                       key=lambda k: r["layouts"][k]["rel_error"])
            for layout, v in r["layouts"].items():
                rows.append([name, route, layout + (" *" if layout == best else ""),
                             f"{v['bytes_per_element']:.3f}", f"{v['rel_error']:.4f}",
                             f"{v['cosine']:.5f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layouts", description=__doc__
                                     .split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, seconds (smoke test)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="folder holding cifar-10-batches-py (default $FREQACT_DATA or "
                             "../shared/data)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON folder (default benchmarks/results; --quick writes nothing "
                             "unless given)")
    parser.add_argument("--layouts", nargs="+", default=None, metavar="LAYOUT",
                        choices=[*LAYOUTS, *BLOCK64, "as-saved"],
                        help="measure only these layouts (default: all)")
    parser.add_argument("--models", nargs="+", default=["vit", "gpt"], choices=["vit", "gpt"],
                        help="models to train and measure (default both)")
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES,
                        help="routes to measure (default all)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per model (default 250; --quick 3)")
    args = parser.parse_args(argv)
    data_dir = args.data_dir or default_data_dir()
    if not (data_dir / "cifar-10-batches-py" / "data_batch_1").is_file():
        print(f"error: --data-dir: no CIFAR-10 (cifar-10-batches-py) under {data_dir}",
              file=sys.stderr)
        return 2
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps: expected an integer >= 1, got {args.steps}")
    payload = run(args.quick, data_dir, args.layouts, args.steps, tuple(args.models),
                  tuple(args.routes))
    print_table(["model", "route", "layout", "bytes/elem", "rel. grad error", "cosine"],
                table_rows(payload))
    if args.out is not None or not args.quick:
        path = write_results("layouts-cpu" if not args.quick else "layouts-quick", payload,
                             directory=args.out or RESULTS_DIR)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
