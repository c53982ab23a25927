"""Figures drawn from result tables (lists of dicts, as `freqact.analysis` returns them).

Each function takes a table and a path stem and writes `stem.png` and `stem.pdf`. Figures are
built as `matplotlib.figure.Figure` objects, never through pyplot, so nothing needs a display and
no global state (backend, rcParams) is touched.
"""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib.figure import Figure

_LOW, _HIGH = "tab:blue", "tab:orange"


def _save(fig: Figure, stem: str | os.PathLike) -> list[Path]:
    """Write `fig` as stem.png and stem.pdf; return both paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    return paths


def _require(rows: Sequence[dict], columns: Sequence[str], table: str) -> None:
    """Refuse an empty table or one missing a column the figure needs."""
    if not rows:
        raise ValueError(f"rows: expected a non-empty {table} table, got no rows")
    missing = [c for c in columns if c not in rows[0]]
    if missing:
        raise ValueError(f"rows: expected {table} columns {', '.join(missing)}, got {', '.join(rows[0])}")


def _layer_axis(ax, layers: Sequence[str]) -> None:
    """Layer names along x, rotated so that long dotted names stay readable."""
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(layers, rotation=60, ha="right", fontsize=7)
    ax.set_xlabel("layer")


def lambdas_figure(rows: Sequence[dict], stem: str | os.PathLike) -> list[Path]:
    """The paper's Fig. 4: per layer λ^L beside λ^H (mean ± std over instances), log scale.

    Args:
        rows: `analysis.lambdas` rows ("layer", "lam_L", "lam_H"), optionally with "checkpoint"
            and "epoch" columns; one panel per checkpoint.
        stem: output path without suffix.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("layer", "lam_L", "lam_H"), "lambdas")
    panels: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    titles: dict[str, str] = {}
    for row in rows:
        key = str(row.get("checkpoint", ""))
        panels[key][row["layer"]].append(row)
        titles[key] = f"epoch {row['epoch']}" if row.get("epoch") not in (None, "") else Path(key).name
    fig = Figure(figsize=(max(6.0, 0.35 * max(len(p) for p in panels.values()) + 2), 3.2 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (key, layers) in zip(axes, panels.items()):
        pos = np.arange(len(layers))
        for offset, column, color, label in ((-0.2, "lam_L", _LOW, "λ^L"), (0.2, "lam_H", _HIGH, "λ^H")):
            values = [np.array([r[column] for r in members]) for members in layers.values()]
            # markers, not bars: bars start at 0, which a log axis cannot show
            ax.errorbar(pos + offset, [v.mean() for v in values], yerr=[v.std() for v in values],
                        fmt="o", color=color, label=label, capsize=2, markersize=4)
        ax.set_yscale("log", nonpositive="mask")
        ax.set_ylabel("band norm (per instance)")
        ax.set_title(titles[key] or "checkpoint")
        _layer_axis(ax, list(layers))
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, stem)


def theorem31_figure(rows: Sequence[dict], stem: str | os.PathLike) -> list[Path]:
    """Per layer: measured errors err^L, err^H against the bounds GEB^L, GEB^H (log scale); with
    the end-to-end columns, a second panel with the whole-network LFC-ACT / HFC-ACT errors.

    Args:
        rows: `analysis.theorem31` rows.
        stem: output path without suffix.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("layer", "err_L", "err_H", "GEB_L", "GEB_H"), "theorem31")
    layers = [r["layer"] for r in rows]
    pos = np.arange(len(layers))
    end_to_end = "e2e_err_L" in rows[0]
    fig = Figure(figsize=(max(6.0, 0.3 * len(layers) + 2), 3.4 * (1 + end_to_end)))
    axes = fig.subplots(1 + end_to_end, 1, squeeze=False)[:, 0]
    ax = axes[0]
    for column, color, marker, label in (
        ("err_L", _LOW, "o", "err^L (LFC cached)"),
        ("err_H", _HIGH, "o", "err^H (HFC cached)"),
    ):
        ax.plot(pos, [r[column] for r in rows], marker, color=color, label=label)
    ax.plot(pos, [r["GEB_L"] for r in rows], "_", color=_LOW, markersize=14, label="GEB^L = c‖∇y‖λ^H")
    ax.plot(pos, [r["GEB_H"] for r in rows], "_", color=_HIGH, markersize=14, label="GEB^H = c‖∇y‖λ^L")
    ax.set_title("one layer's cached input replaced")
    if end_to_end:
        axes[1].plot(pos, [r["e2e_err_L"] for r in rows], "o-", color=_LOW, label="LFC-ACT")
        axes[1].plot(pos, [r["e2e_err_H"] for r in rows], "o-", color=_HIGH, label="HFC-ACT")
        axes[1].set_title("whole network compressed")
    for ax in axes:
        ax.set_yscale("log", nonpositive="mask")
        ax.set_ylabel("‖∇̂W − ∇W‖_F")
        _layer_axis(ax, layers)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return _save(fig, stem)


def pooling_figure(rows: Sequence[dict], stem: str | os.PathLike) -> list[Path]:
    """Block-mean LFC vs DCT low-pass: relative distance, and energy each captures, per layer
    and block size.

    Args:
        rows: `analysis.pooling` rows ("layer", "block", "rel_dist", "energy_pool", "energy_dct").
        stem: output path without suffix.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("layer", "block", "rel_dist", "energy_pool", "energy_dct"), "pooling")
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    blocks = sorted({r["block"] for r in rows})
    table = {(r["layer"], r["block"]): r for r in rows}
    pos = np.arange(len(layers))
    fig = Figure(figsize=(max(6.0, 0.35 * len(layers) + 2), 6.8))
    dist_ax, energy_ax = fig.subplots(2, 1)
    colors = [f"C{i}" for i in range(len(blocks))]
    for block, color in zip(blocks, colors):
        present = [(i, table[(layer, block)]) for i, layer in enumerate(layers) if (layer, block) in table]
        idx = [i for i, _ in present]
        dist_ax.plot(idx, [r["rel_dist"] for _, r in present], "o-", color=color, label=f"B={block}")
        energy_ax.plot(idx, [r["energy_pool"] for _, r in present], "o-", color=color, label=f"pool B={block}")
        energy_ax.plot(idx, [r["energy_dct"] for _, r in present], "x--", color=color, label=f"DCT W=N/{block}")
    dist_ax.set_yscale("log", nonpositive="mask")
    dist_ax.set_ylabel("‖LFC_pool − LFC_DCT‖ / ‖H‖")
    dist_ax.set_title("block-mean LFC vs DCT low-pass")
    energy_ax.set_ylabel("energy share ‖LFC‖² / ‖H‖²")
    energy_ax.set_ylim(0, 1.02)
    for ax in (dist_ax, energy_ax):
        _layer_axis(ax, layers)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return _save(fig, stem)
