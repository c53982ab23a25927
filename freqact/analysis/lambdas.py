"""λ^L and λ^H of activation maps: the energy the DCT low-pass keeps and the energy it drops.

For one activation tensor H of one instance, with M the low-pass mask of `freqact.dct` and H̃ its
orthonormal DCT over the map dims, λ^L = ‖H̃ ⊙ M‖_F and λ^H = ‖H̃ ⊙ (1 − M)‖_F (the paper's
Section 3); by Parseval they are also ‖LFC‖_F and ‖HFC‖_F. Theorem 3.1 ties λ^L > λ^H to
GEB^L < GEB^H, which is what the paper's Fig. 4 checks on block outputs.
"""
from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn

from freqact import _validate, dct
from freqact.analysis.common import (
    capture,
    eval_batch,
    load_checkpoints,
    map_dims,
    select_layers,
    where,
)


def instance_lambdas(h: torch.Tensor, ratio: float = 0.1, rule: str = "nearest") -> tuple[torch.Tensor, torch.Tensor]:
    """λ^L and λ^H of every instance of one activation tensor.

    Args:
        h: activations, shape (N, F), (N, C, L), (N, T, F), (N, C, H, W) or (N, C, D, H, W);
            the map dims follow the codecs' map-layout policy (`common.map_dims`).
        ratio: kept fraction W/N of each frequency axis, in (0, 1].
        rule: how ratio becomes W, "nearest" or "official" (`freqact.dct.windows`).

    Returns:
        (lam_L, lam_H): float64, shape (N,), Frobenius norms over everything but the batch dim.
    """
    _validate.floating_tensor("h", h)
    lam_l, lam_h = dct.band_energy(h.double(), ratio, dims=map_dims(h), reduce="instance", rule=rule)
    return lam_l, lam_h


def measure(model: nn.Module, x: torch.Tensor, *, ratio: float = 0.1, layers: str = "blocks",
            rule: str = "nearest") -> list[dict]:
    """λ^L and λ^H per layer and per instance of a batch.

    The model runs in eval mode without autograd; its mode and buffers are left untouched.

    Args:
        model: the network.
        x: input batch, shape (N, *input_shape).
        ratio: kept fraction of each frequency axis, in (0, 1].
        layers: `"blocks"` (block outputs), `"convs"` (conv/linear inputs) or `"all"`
            (see `common.select_layers`).
        rule: how ratio becomes W, "nearest" or "official" (`freqact.dct.windows`).

    Returns:
        One row per (layer, instance): {"layer", "instance", "lam_L", "lam_H"}, layers in call order.
    """
    _validate.floating_tensor("x", x)
    _validate.unit_ratio("ratio", ratio)
    _validate.choice("rule", rule, dct.WINDOW_RULES)
    rows = []
    for name, h in capture(model, x, select_layers(model, layers)):
        lam_l, lam_h = instance_lambdas(h, ratio, rule)
        for i, (lo, hi) in enumerate(zip(lam_l.tolist(), lam_h.tolist())):
            rows.append({"layer": name, "instance": i, "lam_L": lo, "lam_H": hi})
    return rows


def summarize(rows: Sequence[dict]) -> list[dict]:
    """Per (checkpoint, layer): median λ^L and λ^H and the share of instances with λ^L > λ^H.

    Args:
        rows: from `measure` or `from_checkpoints` (whose "checkpoint" column keeps the
            checkpoints apart).

    Returns:
        One row per (checkpoint, layer) in first-seen order, {"checkpoint", "layer", "instances",
        "median_lam_L", "median_lam_H", "share_L_gt_H"}, then one row per checkpoint with layer
        "(all)" pooling every (layer, instance) pair.
    """
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows:
        groups[(str(row.get("checkpoint", "")), row["layer"])].append(row)
        groups[(str(row.get("checkpoint", "")), "(all)")].append(row)
    out = []
    # the "(all)" rows go last within the table, in checkpoint order
    for key in sorted(groups, key=lambda k: k[1] == "(all)"):
        members = groups[key]
        out.append(
            {
                "checkpoint": key[0],
                "layer": key[1],
                "instances": len(members),
                "median_lam_L": statistics.median(r["lam_L"] for r in members),
                "median_lam_H": statistics.median(r["lam_H"] for r in members),
                "share_L_gt_H": sum(r["lam_L"] > r["lam_H"] for r in members) / len(members),
            }
        )
    return out


def from_checkpoints(
    paths: Sequence[str | os.PathLike],
    *,
    ratio: float = 0.1,
    layers: str = "blocks",
    rule: str = "nearest",
    images: int = 512,
    data_dir: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
) -> list[dict]:
    """`measure` on each checkpoint of one or more runs, all on the same fixed test batch.

    Args:
        paths: checkpoint files and/or run directories (see `common.resolve_checkpoints`).
        ratio, layers, rule: as in `measure`.
        images: the first `images` test images of the run's dataset (`common.eval_batch`).
        data_dir: overrides the data directory the runs recorded.
        device: where to run the models.

    Returns:
        `measure`'s rows with "run" (`common.run_of`), "checkpoint" (path) and "epoch" first.

    Raises:
        ValueError: if the checkpoints come from runs of different models or datasets.
    """
    rows: list[dict] = []
    batch = None
    for path, model, ckpt in load_checkpoints(paths, device):
        if batch is None:
            batch, _ = eval_batch(model, ckpt["config"], images, data_dir, device)
        for row in measure(model, batch, ratio=ratio, layers=layers, rule=rule):
            rows.append({**where(path, ckpt), **row})
    return rows
