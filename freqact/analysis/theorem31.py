"""Theorem 3.1 tested for what it claims: per conv layer, the weight-gradient error of an LFC- or
HFC-cached input is bounded by GEB, and how tight that bound is; plus whole-network gradient
fidelity of LFC-ACT / HFC-ACT.

For a conv layer l with cached input x = x_L + x_H (DCT low-pass split) and output gradient ∇y,
the weight gradient G(z) = ∇W computed from a cached input z is linear in z. Caching only x_L
therefore errs by exactly G(x_L) − G(x) = −G(x_H), and caching only x_H by −G(x_L). `kernel_factor`
bounds ‖G(z)‖_F ≤ c_l · ‖∇y‖_F · ‖z‖_F, and ‖x_H‖_F = λ^H, ‖x_L‖_F = λ^L by Parseval (orthonormal
DCT), so

    err^L = ‖Ĝ^L − G‖_F ≤ GEB^L = c_l ‖∇y‖_F λ^H,    err^H = ‖Ĝ^H − G‖_F ≤ GEB^H = c_l ‖∇y‖_F λ^L,

with norms over the whole batch tensor. What can be checked: that err ≤ GEB (the bound holds),
its tightness err/GEB, and err^L against err^H measured directly. Comparing the *orderings* of
GEB^L/GEB^H and λ^L/λ^H checks nothing: GEB^H − GEB^L = c_l‖∇y‖(λ^L − λ^H) identically.
The theorem is about convolutions; the classifier Linear (outside it, and kept exact by the
spectral codecs) is not reported.

Whole-network gradient fidelity (`gradient_fidelity`) runs the network under
`freqact.engine.compress(model, "lfc" | "hfc", ratio=...)` and compares the gradient of every
parameter, concatenated, with the exact one: cosine similarity and relative error.
"""
from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from freqact import _validate, dct, engine
from freqact.analysis.common import (
    WEIGHT_LAYERS,
    eval_batch,
    load_checkpoints,
    scratch_state,
    where,
)

CONV_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

_CONV_WEIGHT_GRAD = {
    1: torch.nn.grad.conv1d_weight,
    2: torch.nn.grad.conv2d_weight,
    3: torch.nn.grad.conv3d_weight,
}

# Rounding slack of the "bound holds" test, relative to c_l·‖∇y‖·‖x‖ (the scale of G(x)): a layer
# whose mask keeps everything has λ^H = 0, and its measured err^L is pure rounding.
_BOUND_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10}


def _padding(module: nn.Module, spatial: int) -> list[tuple[int, int]]:
    """(left, right) zero/reflect/... padding of each spatial dim of a conv, as its forward uses it."""
    if module.padding == "valid":
        return [(0, 0)] * spatial
    if module.padding == "same":
        # PyTorch puts the odd element of the total padding d·(k−1) on the right
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in module.padding]


def _max_reads(size: int, kernel: int, stride: int, dilation: int, pad: tuple[int, int], mode: str) -> int:
    """Along one dim: the most (tap, output position) pairs that read any one input element.

    The padded signal is built from input indices (−1 for a zero pad), so reflect/replicate/circular
    copies of an element count as reads of that element.
    """
    index = torch.arange(size, dtype=torch.float64).view(1, 1, size)
    index = F.pad(index, pad, value=-1.0) if mode == "zeros" else F.pad(index, pad, mode=mode)
    index = index.view(-1).long()
    outputs = (index.numel() - dilation * (kernel - 1) - 1) // stride + 1
    if outputs < 1:
        return 0
    taps = stride * torch.arange(outputs)[:, None] + dilation * torch.arange(kernel)[None, :]
    read = index[taps.view(-1)]
    return int(torch.bincount(read[read >= 0], minlength=size).max())


def kernel_factor(module: nn.Module, input_shape: Sequence[int]) -> float:
    """c_l with ‖∇W(z)‖_F ≤ c_l · ‖∇y‖_F · ‖z‖_F for every cached input z of the layer.

    Derivation (conv, any stride s, padding p, dilation d, groups g, zero padding): for an output
    channel o in group γ, an in-group input channel c and a tap t = (t_1, ..., t_k),

        ∇W[o, c, t] = Σ_n Σ_u ∇y[n, o, u] · z̄[n, γ·C_in/g + c, s·u + d·t]

    over output positions u, with z̄ the padded input. Cauchy–Schwarz over (n, u) gives
    ∇W[o, c, t]² ≤ ‖∇y[:, o]‖² · Σ_{n,u} z̄[n, c', s·u + d·t]². Summing over the taps t, each input
    element z[n, c', q] appears R(q) times, R(q) = the number of (t, u) pairs that read q; R factors
    over the dims, R(q) = Π_i R_i(q_i), so Σ_t Σ_u z̄² ≤ R · ‖z[:, c']‖² with R = Π_i max R_i. Summing
    over o and c within each group and then over the groups, Σ_γ A_γ B_γ ≤ (Σ A_γ)(Σ B_γ) gives

        ‖∇W(z)‖_F ≤ sqrt(R) · ‖∇y‖_F · ‖z‖_F,     c_l = sqrt(Π_i max_q R_i(q)).

    Groups change nothing (block structure). With zero padding R_i ≤ ceil(k_i / (s_i / gcd(s_i, d_i))):
    taps i and i' can read the same element only if d·(i − i') ≡ 0 mod s, so with dilation the
    familiar ceil(k/s) is not enough (k=5, s=2, d=2: all five taps share one parity). `_max_reads`
    counts R_i exactly, edges and reflect/replicate/circular copies included; for stride 1 and a map
    wider than the kernel's reach it is k_i, i.e. c_l = sqrt(k_h·k_w), the kernel-area factor. A
    Linear layer (any leading dims, rows r) has ∇W = Σ_r ∇y_r ⊗ z_r, hence c_l = 1. The bound is
    attained, e.g. by constant ∇y and z with circular padding (every step above is an equality).

    Args:
        module: a Conv1d/2d/3d or Linear.
        input_shape: shape of its input, (N, C, *spatial) for a conv.

    Returns:
        c_l >= 0.

    Raises:
        TypeError: if `module` is not a conv/linear layer.
    """
    if isinstance(module, nn.Linear):
        return 1.0
    if not isinstance(module, WEIGHT_LAYERS):
        raise TypeError(f"module: expected a Conv1d/2d/3d or Linear, got {type(module).__name__}")
    spatial = len(module.kernel_size)
    reads = 1
    for size, k, s, d, pad in zip(
        input_shape[-spatial:], module.kernel_size, module.stride, module.dilation, _padding(module, spatial)
    ):
        reads *= _max_reads(size, k, s, d, pad, module.padding_mode)
    return math.sqrt(reads)


def weight_grad(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The weight gradient a conv/linear layer computes from a cached input and its output gradient.

    Args:
        module: a Conv1d/2d/3d or Linear (only its hyper-parameters and weight shape are read).
        x: cached input, shape (N, C_in, *spatial) or (..., F_in).
        grad_out: gradient of the loss w.r.t. the layer output, (N, C_out, *out_spatial) or (..., F_out).

    Returns:
        ∇W, shaped like `module.weight`, in the dtype of `x` (the bias gradient is not included).
    """
    if isinstance(module, nn.Linear):
        return grad_out.reshape(-1, grad_out.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    spatial = len(module.kernel_size)
    pads = _padding(module, spatial)
    grad_fn = _CONV_WEIGHT_GRAD[spatial]
    if module.padding_mode == "zeros" and all(left == right for left, right in pads):
        padding = [left for left, _ in pads]
    else:  # other padding modes, and the asymmetric zero padding of "same", are applied explicitly
        flat = [p for pair in reversed(pads) for p in pair]
        x = F.pad(x, flat, mode="constant" if module.padding_mode == "zeros" else module.padding_mode)
        padding = 0
    return grad_fn(x, module.weight.shape, grad_out, module.stride, padding, module.dilation, module.groups)


def _seeded_loss(model, x, y, loss_fn, seed) -> torch.Tensor:
    """One forward pass under a fixed seed, so every pass draws the same dropout masks."""
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return loss_fn(model(x), y)


def _compressed_grads(model, x, y, params, *, band, ratio, rule, loss_fn, seed) -> tuple[torch.Tensor, ...]:
    """Gradients of `params` with the whole network under compress(model, band) (lfc or hfc)."""
    with engine.compress(model, band, ratio=ratio, window_rule=rule):
        loss = _seeded_loss(model, x, y, loss_fn, seed)
    return torch.autograd.grad(loss, params, allow_unused=True)


def measure(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    ratio: float = 0.1,
    rule: str = "nearest",
    end_to_end: bool = True,
    train: bool = True,
    seed: int = 0,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> list[dict]:
    """Per conv layer: λ^L, λ^H, the measured weight-gradient errors, their Theorem 3.1 bounds,
    whether each bound holds and how tight it is.

    One exact forward/backward pass in the model's precision captures every conv layer's cached
    input x and output gradient ∇y; per layer, G(x), G(x_L) and G(x_H) are then computed by
    `weight_grad` from that same ∇y, so only layer l's cached input changes. They are computed in
    the batch's precision (float64 batches give errors free of float32 cancellation; float32 keeps
    ResNet-18 on 128 images to seconds); the bound checks allow a rounding slack of 1e-4 (float32)
    or 1e-10 (float64) times c_l·‖∇y‖_F·‖x‖_F. The model's mode and buffers (BatchNorm
    statistics) are restored afterwards.

    Args:
        model: the network; each conv layer must run at most once per forward pass.
        x: input batch, shape (N, *input_shape).
        y: targets for `loss_fn`, e.g. int64 labels of shape (N,).
        ratio: kept fraction W/N of each frequency axis of the cached inputs, in (0, 1].
        rule: how ratio becomes W, "nearest" or "official" (`freqact.dct.windows`).
        end_to_end: also run the whole network under `engine.compress(model, "lfc"|"hfc")` and
            report each layer's weight-gradient error there.
        train: run in training mode (BatchNorm batch statistics, dropout) as in training.
        seed: RNG seed of every pass (identical dropout masks).
        loss_fn: loss(model(x), y) -> scalar.

    Returns:
        One row per conv layer in call order: {"layer", "kind", "c", "grad_out_norm", "lam_L",
        "lam_H", "err_L", "err_H", "GEB_L", "GEB_H", "bound_L_holds", "bound_H_holds",
        "bound_holds" (both), "tightness_L" = err_L / GEB_L, "tightness_H" (None where GEB is 0,
        e.g. tightness_L when the mask keeps every coefficient: the high band is then exactly 0),
        "err_L_lt_err_H"} and, with `end_to_end`, "e2e_err_L", "e2e_err_H" (float32 weight-gradient
        errors of the layer with the whole network in LFC-ACT / HFC-ACT).

    Raises:
        ValueError: if the model has no conv layer or runs one of them twice.
    """
    _validate.floating_tensor("x", x)
    _validate.unit_ratio("ratio", ratio)
    _validate.choice("rule", rule, dct.WINDOW_RULES)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, CONV_LAYERS)]
    if not layers:
        raise ValueError(f"model: expected at least one Conv1d/2d/3d layer in {type(model).__name__}")
    calls: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook_for(name):
        def hook(module, inputs, output):
            if name in calls:
                raise ValueError(f"model: layer {name!r} runs more than once per forward pass (shared weights)")
            calls[name] = (inputs[0].detach(), output)
            # later layers get a copy, so an in-place edit downstream cannot change the tensor
            # whose gradient we ask for
            return output.clone()

        return hook

    handles = [m.register_forward_hook(hook_for(name)) for name, m in layers]
    with scratch_state(model, train):
        try:
            loss = _seeded_loss(model, x, y, loss_fn, seed)
        finally:
            for handle in handles:
                handle.remove()
        order = list(calls)  # call order; layers the forward pass never ran are left out
        modules = dict(layers)
        weights = [modules[name].weight for name in order]
        grads = torch.autograd.grad(loss, [calls[name][1] for name in order] + weights)
        grad_out, exact = grads[: len(order)], grads[len(order) :]
        e2e = {}
        if end_to_end:
            for band in ("lfc", "hfc"):
                approx = _compressed_grads(model, x, y, weights, band=band, ratio=ratio, rule=rule,
                                           loss_fn=loss_fn, seed=seed)
                e2e[band] = [float((g - g0).norm()) for g, g0 in zip(approx, exact)]

    rows = []
    for i, name in enumerate(order):
        rows.append(_layer_row(name, modules[name], calls[name][0], grad_out[i], ratio, rule))
        if end_to_end:
            rows[-1].update(e2e_err_L=e2e["lfc"][i], e2e_err_H=e2e["hfc"][i])
    return rows


def _tightness(err: float, bound: float) -> float | None:
    return err / bound if bound > 0 else None


def _layer_row(name: str, module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, ratio: float,
               rule: str) -> dict:
    """The Theorem 3.1 quantities of one conv layer, in x's precision (float32 for half inputs)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x, grad_out = x.to(dtype), grad_out.to(dtype)
    dims = len(module.kernel_size)
    lfc, hfc = dct.split(x, ratio, dims=dims, rule=rule)  # a full mask: hfc exactly 0
    exact = weight_grad(module, x, grad_out)
    err_l = float((weight_grad(module, lfc, grad_out) - exact).norm())
    err_h = float((weight_grad(module, hfc, grad_out) - exact).norm())
    c = kernel_factor(module, x.shape)
    gy_norm = float(grad_out.norm())
    lam_l, lam_h = float(lfc.norm()), float(hfc.norm())
    geb_l, geb_h = c * gy_norm * lam_h, c * gy_norm * lam_l
    slack = _BOUND_RTOL[dtype] * c * gy_norm * float(x.norm())
    holds_l, holds_h = err_l <= geb_l + slack, err_h <= geb_h + slack
    return {
        "layer": name,
        "kind": type(module).__name__,
        "c": c,
        "grad_out_norm": gy_norm,
        "lam_L": lam_l,
        "lam_H": lam_h,
        "err_L": err_l,
        "err_H": err_h,
        "GEB_L": geb_l,
        "GEB_H": geb_h,
        "bound_L_holds": holds_l,
        "bound_H_holds": holds_h,
        "bound_holds": holds_l and holds_h,
        "tightness_L": _tightness(err_l, geb_l),
        "tightness_H": _tightness(err_h, geb_h),
        "err_L_lt_err_H": err_l < err_h,
    }


def gradient_fidelity(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    ratio: float = 0.1,
    rule: str = "nearest",
    train: bool = True,
    seed: int = 0,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
) -> dict:
    """How close the whole-network gradients of LFC-ACT and HFC-ACT are to the exact gradient.

    The gradients of every parameter that receives one, flattened and concatenated, from one
    exact pass and one pass each under `engine.compress(model, "lfc" | "hfc", ratio=ratio,
    window_rule=rule)` on the same batch and dropout masks (the codecs keep (N, F) classifier
    inputs exact). Model mode and buffers are restored.

    Args:
        model, x, y, train, seed, loss_fn: as in `measure`.
        ratio, rule: the codecs' settings.

    Returns:
        {"grad_norm": ‖g‖, "cos_L": cos(g^L, g), "cos_H": cos(g^H, g), "rel_err_L": ‖g^L − g‖/‖g‖,
        "rel_err_H"}; cos of g with itself is 1.

    Raises:
        ValueError: if no parameter receives a gradient.
    """
    _validate.floating_tensor("x", x)
    _validate.unit_ratio("ratio", ratio)
    _validate.choice("rule", rule, dct.WINDOW_RULES)
    params = [p for p in model.parameters() if p.requires_grad]
    with scratch_state(model, train):
        exact = torch.autograd.grad(_seeded_loss(model, x, y, loss_fn, seed), params, allow_unused=True)
        used = [i for i, g in enumerate(exact) if g is not None]
        if not used:
            raise ValueError(f"model: no parameter of {type(model).__name__} receives a gradient")
        g = torch.cat([exact[i].reshape(-1) for i in used]).double()
        out = {"grad_norm": float(g.norm())}
        for band, key in (("lfc", "L"), ("hfc", "H")):
            approx = _compressed_grads(model, x, y, params, band=band, ratio=ratio, rule=rule,
                                       loss_fn=loss_fn, seed=seed)
            a = torch.cat([(approx[i] if approx[i] is not None else torch.zeros_like(exact[i])).reshape(-1)
                           for i in used]).double()
            out[f"cos_{key}"] = float(F.cosine_similarity(a, g, dim=0, eps=1e-300))
            out[f"rel_err_{key}"] = float((a - g).norm() / g.norm()) if g.norm() > 0 else float("nan")
    return out


def from_checkpoints(
    paths: Sequence[str | os.PathLike],
    *,
    ratio: float = 0.1,
    rule: str = "nearest",
    images: int = 128,
    end_to_end: bool = True,
    data_dir: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
) -> tuple[list[dict], list[dict]]:
    """`measure` and `gradient_fidelity` on each checkpoint, on its run's first `images` test
    images (the same real batch at every checkpoint of a run).

    Args:
        paths: checkpoint files and/or run directories (see `common.resolve_checkpoints`).
        ratio, rule, end_to_end: as in `measure`.
        images: batch size taken from the test set (`common.eval_batch`).
        data_dir: overrides the data directory the runs recorded.
        device: where to run the models.

    Returns:
        (layer rows, fidelity rows): `measure`'s rows and one `gradient_fidelity` row per
        checkpoint, each with "run" (`common.run_of`), "checkpoint" (path) and "epoch" first.

    Raises:
        ValueError: if the checkpoints come from runs of different models or datasets.
    """
    layer_rows: list[dict] = []
    fidelity: list[dict] = []
    for path, model, ckpt in load_checkpoints(paths, device):
        x, y = eval_batch(model, ckpt["config"], images, data_dir, device)
        placed = where(path, ckpt)
        for row in measure(model, x, y, ratio=ratio, rule=rule, end_to_end=end_to_end):
            layer_rows.append({**placed, **row})
        fidelity.append({**placed, **gradient_fidelity(model, x, y, ratio=ratio, rule=rule)})
    return layer_rows, fidelity


def summarize(rows: Sequence[dict]) -> dict:
    """Counts and tightness over the layers of a `measure` table (one checkpoint).

    Returns:
        {"layers", "bound_holds" (both bounds), "bound_L_holds", "bound_H_holds",
        "median_tightness_L", "median_tightness_H", "max_tightness_L", "max_tightness_H"
        (None without a positive bound), "err_L_lt_err_H" (layers where the LFC-cached input
        gives the smaller weight-gradient error)}.
    """
    out = {
        "layers": len(rows),
        "bound_holds": sum(bool(r["bound_holds"]) for r in rows),
        "bound_L_holds": sum(bool(r["bound_L_holds"]) for r in rows),
        "bound_H_holds": sum(bool(r["bound_H_holds"]) for r in rows),
        "err_L_lt_err_H": sum(bool(r["err_L_lt_err_H"]) for r in rows),
    }
    for band in ("L", "H"):
        values = [r[f"tightness_{band}"] for r in rows if r[f"tightness_{band}"] is not None]
        out[f"median_tightness_{band}"] = statistics.median(values) if values else None
        out[f"max_tightness_{band}"] = max(values) if values else None
    return out
