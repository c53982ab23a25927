"""Figures drawn from result tables (lists of dicts, as `freqact.analysis` returns them).

Each function takes a table and a path stem and writes `stem.png` and `stem.pdf`; `note`, a line
saying what the table was measured on (data set, model, batch size, W/N or B, Q), is drawn under
the figure's title. Accuracy is drawn in %. Figures are built as `matplotlib.figure.Figure`
objects, never through pyplot, so nothing needs a display and no global state (backend,
rcParams) is touched.
"""
from __future__ import annotations

import io
import itertools
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

_LOW, _HIGH = "tab:blue", "tab:orange"


def _save(fig: Figure, stem: str | os.PathLike, note: str = "") -> list[Path]:
    """Write `fig` as stem.png and stem.pdf (each atomically), with `note` as a line above the
    panels; return both paths."""
    if note:
        fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    from freqact.checkpoint import atomic_write  # imports torch: only when a figure is saved

    stem = Path(stem)
    paths = [stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")]
    for path in paths:  # atomically: a reader never sees half a figure
        buffer = io.BytesIO()
        fig.savefig(buffer, format=path.suffix[1:], dpi=150, bbox_inches="tight")
        atomic_write(path, buffer.getvalue())
    return paths


def _require(rows: Sequence[dict], columns: Sequence[str], table: str) -> None:
    """Refuse an empty table or one missing a column the figure needs."""
    if not rows:
        raise ValueError(f"rows: expected a non-empty {table} table, got no rows")
    missing = [c for c in columns if c not in rows[0]]
    if missing:
        raise ValueError(f"rows: expected {table} columns {', '.join(missing)}, got {', '.join(rows[0])}")


def _runs(rows: Sequence[dict]) -> list[str]:
    """The distinct "run" values of a table, in first-seen order ([""] without the column)."""
    return list(dict.fromkeys(str(r.get("run") or "") for r in rows))


def _checkpoint_title(row: dict, several_runs: bool) -> str:
    """"epoch E" of a row's checkpoint, "RUN, epoch E" when its table holds several runs; the
    checkpoint's file name without an epoch."""
    if row.get("epoch") in (None, ""):
        return Path(str(row.get("checkpoint", ""))).name
    run = f"{row['run']}, " if several_runs else ""
    return f"{run}epoch {row['epoch']}"


def _layer_axis(ax, layers: Sequence[str]) -> None:
    """Layer names along x, rotated so that long dotted names stay readable."""
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(layers, rotation=60, ha="right", fontsize=7)
    ax.set_xlabel("layer")


def lambdas_figure(rows: Sequence[dict], stem: str | os.PathLike, *, note: str = "") -> list[Path]:
    """The paper's Fig. 4: per layer λ^L beside λ^H (mean ± std over instances), log scale.

    Args:
        rows: `analysis.lambdas` rows ("layer", "lam_L", "lam_H"), optionally with "run",
            "checkpoint" and "epoch" columns; one panel per checkpoint, titled by its epoch (and
            its run, when the rows hold several).
        stem: output path without suffix.
        note: what the rows were measured on, drawn above the panels.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("layer", "lam_L", "lam_H"), "lambdas")
    panels: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    titles: dict[str, str] = {}
    several_runs = len(_runs(rows)) > 1  # once: a table has a row per layer and image
    for row in rows:
        key = str(row.get("checkpoint", ""))
        panels[key][row["layer"]].append(row)
        if key not in titles:
            titles[key] = _checkpoint_title(row, several_runs)
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
    return _save(fig, stem, note)


def lambdas_scatter_figure(rows: Sequence[dict], stem: str | os.PathLike, *,
                           note: str = "") -> list[Path]:
    """The paper's Fig. 4 as a scatter: λ^L against λ^H of every (layer, instance) pair, one
    panel per epoch (columns) and W/N (rows), the diagonal λ^L = λ^H drawn; points above it
    have λ^L > λ^H. Log axes; each panel's title gives the share above the diagonal.

    Args:
        rows: `analysis.lambdas` rows with "epoch", "ratio", "lam_L", "lam_H" and optionally
            "seed" (one colour per seed).
        stem: output path without suffix.
        note: what the rows were measured on, drawn above the panels.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("epoch", "ratio", "lam_L", "lam_H"), "λ")
    epochs = sorted({r["epoch"] for r in rows})
    ratios = sorted({r["ratio"] for r in rows}, reverse=True)
    seeds = list(dict.fromkeys(r.get("seed") for r in rows))
    fig = Figure(figsize=(3.3 * len(epochs), 3.2 * len(ratios)))
    axes = np.asarray(fig.subplots(len(ratios), len(epochs), squeeze=False))
    positive = [v for r in rows for v in (r["lam_L"], r["lam_H"]) if v > 0]
    span = (min(positive) / 1.5, max(positive) * 1.5) if positive else (1e-3, 1.0)
    for (i, ratio), (j, epoch) in itertools.product(enumerate(ratios), enumerate(epochs)):
        panel = [r for r in rows if r["ratio"] == ratio and r["epoch"] == epoch]
        _scatter_panel(axes[i, j], panel, seeds, span)
        above = sum(r["lam_L"] > r["lam_H"] for r in panel) / len(panel) if panel else float("nan")
        axes[i, j].set_title(f"epoch {epoch}, W/N = {ratio:g}: λ^L > λ^H in {above:.1%}",
                             fontsize=8)
    if seeds != [None]:
        axes[0, 0].legend(fontsize=7, markerscale=3, loc="upper left")
    return _save(fig, stem, note)


def _scatter_panel(ax, panel: Sequence[dict], seeds: Sequence, span: tuple[float, float]) -> None:
    """λ^L (y) against λ^H (x), one colour per seed, on log axes over `span`, with the diagonal."""
    for k, seed in enumerate(seeds):
        mine = [r for r in panel if r.get("seed") == seed]
        ax.scatter([r["lam_H"] for r in mine], [r["lam_L"] for r in mine], s=3, alpha=0.3,
                   color=f"C{k}", label=None if seed is None else f"seed {seed}", rasterized=True)
    ax.plot(span, span, "k--", linewidth=0.8)
    ax.set(xscale="log", yscale="log", xlim=span, ylim=span, xlabel="λ^H", ylabel="λ^L")


def theorem31_figure(rows: Sequence[dict], stem: str | os.PathLike, *,
                     fidelity: Sequence[dict] | None = None, note: str = "") -> list[Path]:
    """Theorem 3.1 per conv layer, tested for what it claims (log scales):

    (a) measured errors err^L, err^H against their bounds GEB^L, GEB^H (the bound holds when each
    dot is at or below its dash); (b) tightness err/GEB (1 = the bound is attained); (c) err^L /
    err^H measured directly (below 1: the LFC-cached input gives the better weight gradient); and,
    with `fidelity`, (d) whole-network gradient cosine with the exact gradient per epoch.
    With several checkpoints in `rows`, (a)-(c) show the last one.

    Args:
        rows: `analysis.theorem31.measure` rows (optionally with "checkpoint"/"epoch").
        stem: output path without suffix.
        fidelity: `theorem31.gradient_fidelity` rows with "epoch", "cos_L", "cos_H" and optionally
            "run" (one line per run in (d)).
        note: what the rows were measured on, drawn above the panels.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("layer", "err_L", "err_H", "GEB_L", "GEB_H"), "theorem31")
    last = rows[-1].get("checkpoint")
    several = len({r.get("checkpoint") for r in rows}) > 1
    shown = _checkpoint_title(rows[-1], len(_runs(rows)) > 1) if several else ""
    rows = [r for r in rows if r.get("checkpoint") == last]
    layers = [r["layer"] for r in rows]
    panels = 3 + bool(fidelity)
    fig = Figure(figsize=(max(6.0, 0.3 * len(layers) + 2), 3.0 * panels))
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    _theorem_layer_panels(axes[:3], rows)
    if shown:  # several checkpoints: say which one (a)-(c) show
        axes[0].set_title(f"{axes[0].get_title()}\n(a)-(c): the last checkpoint, {shown}", fontsize=9)
    for ax in axes[:3]:
        ax.set_yscale("log", nonpositive="mask")
        _layer_axis(ax, layers)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if fidelity:
        _fidelity_panel(axes[3], fidelity)
    return _save(fig, stem, note)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else np.nan


def _theorem_layer_panels(axes, rows: Sequence[dict]) -> None:
    """Panels (a)-(c) of `theorem31_figure` on three axes."""
    bound_ax, tight_ax, ratio_ax = axes
    pos = np.arange(len(rows))
    for column, color, label in (("err_L", _LOW, "err^L (LFC cached)"), ("err_H", _HIGH, "err^H (HFC cached)")):
        bound_ax.plot(pos, [r[column] for r in rows], "o", color=color, label=label)
    bound_ax.plot(pos, [r["GEB_L"] for r in rows], "_", color=_LOW, markersize=14, label="GEB^L = c‖∇y‖λ^H")
    bound_ax.plot(pos, [r["GEB_H"] for r in rows], "_", color=_HIGH, markersize=14, label="GEB^H = c‖∇y‖λ^L")
    bound_ax.set_ylabel("‖∇̂W − ∇W‖_F")
    bound_ax.set_title("(a) weight-gradient error of one layer's cached input vs its bound\n"
                       "c = √(most kernel taps reading one input element): 3 for a stride-1 3×3 conv",
                       fontsize=9)
    for band, color in (("L", _LOW), ("H", _HIGH)):
        tight = [_ratio(r[f"err_{band}"], r[f"GEB_{band}"]) for r in rows]
        tight_ax.plot(pos, tight, "o", color=color, label=f"err^{band} / GEB^{band}")
    tight_ax.axhline(1.0, color="gray", linewidth=0.8, label="bound attained")
    tight_ax.set_ylabel("err / GEB")
    tight_ax.set_title("(b) tightness of the bound")
    ratio_ax.plot(pos, [_ratio(r["err_L"], r["err_H"]) for r in rows], "o", color="tab:green",
                  label="err^L / err^H")
    ratio_ax.axhline(1.0, color="gray", linewidth=0.8)
    ratio_ax.set_ylabel("err^L / err^H")
    ratio_ax.set_title("(c) LFC- vs HFC-cached input, measured (< 1: LFC better)")


def _fidelity_panel(ax, fidelity: Sequence[dict]) -> None:
    """Panel (d) of `theorem31_figure`: whole-network gradient cosine per epoch, one line per
    run (marker shapes tell runs apart), never joining two runs' points."""
    runs = _runs(fidelity)
    ticks = set()
    for run, marker in zip(runs, itertools.cycle("osD^v")):
        mine = [(f.get("epoch", i), f) for i, f in enumerate(fidelity) if str(f.get("run") or "") == run]
        epochs = [e for e, _ in mine]
        ticks.update(epochs)
        suffix = f" ({run})" if len(runs) > 1 else ""
        for column, color, label in (("cos_L", _LOW, "LFC-ACT"), ("cos_H", _HIGH, "HFC-ACT")):
            ax.plot(epochs, [f[column] for _, f in mine], f"{marker}-", color=color, label=label + suffix)
    ax.set_xticks(sorted(ticks))
    ax.set_xlabel("epoch")
    ax.set_ylabel("cos(∇̂θ, ∇θ)")
    ax.set_title("(d) whole-network gradient cosine with the exact gradient")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def pooling_figure(rows: Sequence[dict], stem: str | os.PathLike, *, note: str = "") -> list[Path]:
    """Block-mean LFC vs DCT low-pass: relative distance, and energy each captures, per layer
    and block size.

    The distance axis is linear: where B covers the whole map both keep only the DC coefficient
    and the distance is 0 to rounding, which a log axis would stretch down to 1e-16.

    Args:
        rows: `analysis.pooling` rows ("layer", "block", "rel_dist", "energy_pool", "energy_dct").
        stem: output path without suffix.
        note: what the rows were measured on, drawn above the panels.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("layer", "block", "rel_dist", "energy_pool", "energy_dct"), "pooling")
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    blocks = sorted({r["block"] for r in rows})
    table = {(r["layer"], r["block"]): r for r in rows}
    fig = Figure(figsize=(max(6.0, 0.35 * len(layers) + 2), 6.8))
    dist_ax, energy_ax = fig.subplots(2, 1)
    colors = [f"C{i}" for i in range(len(blocks))]
    for block, color in zip(blocks, colors):
        present = [(i, table[(layer, block)]) for i, layer in enumerate(layers) if (layer, block) in table]
        idx = [i for i, _ in present]
        dist_ax.plot(idx, [r["rel_dist"] for _, r in present], "o-", color=color, label=f"B={block}")
        energy_ax.plot(idx, [r["energy_pool"] for _, r in present], "o-", color=color, label=f"pool B={block}")
        energy_ax.plot(idx, [r["energy_dct"] for _, r in present], "x--", color=color, label=f"DCT W=N/{block}")
    dist_ax.set_ylabel("‖LFC_pool − LFC_DCT‖ / ‖H‖")
    dist_ax.set_title("block-mean LFC vs DCT low-pass (0 where B ≥ the map: both keep the DC alone)",
                      fontsize=9)
    energy_ax.set_ylabel("energy share ‖LFC‖² / ‖H‖²")
    energy_ax.set_ylim(0, 1.02)
    for ax in (dist_ax, energy_ax):
        _layer_axis(ax, layers)
        ax.legend(fontsize=7, ncol=2)
    return _save(fig, stem, note)


def training_figure(rows: Sequence[dict], stem: str | os.PathLike,
                    memory: Sequence[dict] | None = None, *, note: str = "") -> list[Path]:
    """The paper's Fig. 3 (b, c): test accuracy and training loss per epoch of several runs and,
    given `memory`, the activation memory each run caches for one batch.

    Args:
        rows: metrics rows ("run", "epoch", "test_acc", "train_loss"), e.g. every run's
            metrics.csv with a "run" label column; one curve per run.
        stem: output path without suffix.
        memory: optional rows ("run", "exact_bytes", "saved_bytes"), one per run: a third panel
            with bars of the cached bytes and plain PyTorch's bytes as outlines.
        note: what the runs trained on (data set, model, batch size), drawn above the panels.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("run", "epoch", "test_acc", "train_loss"), "metrics")
    if memory is not None:
        _require(memory, ("run", "exact_bytes", "saved_bytes"), "memory")
    curves: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        curves[row["run"]].append(row)
    fig = Figure(figsize=(13.0 if memory is not None else 9.0, 4.2))
    axes = fig.subplots(1, 3 if memory is not None else 2)
    for i, (run, members) in enumerate(curves.items()):
        members = sorted(members, key=lambda r: r["epoch"])
        epochs = [r["epoch"] for r in members]
        axes[0].plot(epochs, [100 * r["test_acc"] for r in members], "o-", color=f"C{i}", label=run)
        axes[1].plot(epochs, [r["train_loss"] for r in members], "o-", color=f"C{i}", label=run)
    axes[0].set_ylabel("test accuracy (%)")
    axes[1].set_ylabel("training loss")
    for ax in axes[:2]:
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # one legend for both curve panels, below them, where it covers no point
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.18), ncol=2)
    if memory is not None:
        _memory_panel(axes[2], memory)
    return _save(fig, stem, note)


def _memory_panel(ax, memory: Sequence[dict]) -> None:
    """Bars of each run's cached MiB inside outlines of plain PyTorch's, labelled with the ratio."""
    pos = np.arange(len(memory))
    mib = 2.0 ** 20
    ax.bar(pos, [r["exact_bytes"] / mib for r in memory], fill=False, edgecolor="black",
           label="plain PyTorch")
    bars = ax.bar(pos, [r["saved_bytes"] / mib for r in memory], width=0.6,
                  color=[f"C{i}" for i in range(len(memory))], label="cached")
    for bar, r in zip(bars, memory):
        ratio = r["exact_bytes"] / r["saved_bytes"] if r["saved_bytes"] else float("inf")
        ax.annotate(f"{ratio:.1f}×", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(pos)
    ax.set_xticklabels([r["run"] for r in memory], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("MiB cached, one training batch")
    ax.set_ylim(0, 1.3 * max(r["exact_bytes"] for r in memory) / mib)  # room for the legend
    ax.legend(fontsize=7, loc="upper right", ncol=2)


def compression_figure(rows: Sequence[dict], stem: str | os.PathLike, *, note: str = "") -> list[Path]:
    """Per layer and run: bytes cached for backward, and their running total along the forward pass.

    A storage saved by several layers belongs to the first that saved it (the meter's rule), so a
    conv reading a ReLU's output shows no plain bytes of its own; the running totals are free of
    that attribution and end at each run's whole cache.

    Args:
        rows: `engine.Meter.per_layer()` rows ("layer", "saved_bytes", "exact_bytes") with a "run"
            column; one series per run. Layers are placed in first-seen order; the model itself
            (layer "") shows as "(model)". Plain PyTorch's bytes are the first run's exact_bytes.
            Layers run down the y axis, so that every name stays readable.
        stem: output path without suffix.
        note: what the rows were measured on (data set, model, batch size), drawn above the panels.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("run", "layer", "saved_bytes", "exact_bytes"), "per-layer memory")
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    runs: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        runs[row["run"]][row["layer"]] = row
    first = next(iter(runs.values()))
    series = [(run, table, "saved_bytes", f"C{i}", "o") for i, (run, table) in enumerate(runs.items())]
    series.append(("plain PyTorch", first, "exact_bytes", "black", "_"))
    fig = Figure(figsize=(11.0, max(4.0, 0.16 * len(layers) + 1.5)))
    bytes_ax, total_ax = fig.subplots(1, 2, sharey=True)
    for label, table, column, color, marker in series:
        pos = np.array([layers.index(layer) for layer in table])
        values = np.array([r[column] for r in table.values()], dtype=float)
        bytes_ax.plot(values / 2**10, pos, "o" if marker == "o" else "|", color=color, markersize=4,
                      label=label)
        total_ax.plot(np.cumsum(values) / 2**20, pos, "-" if marker == "o" else "--", color=color,
                      label=label)
    bytes_ax.set_xscale("log", nonpositive="mask")
    bytes_ax.set_xlabel("cached by the layer (KiB)")
    bytes_ax.set_title("per layer, one training batch", fontsize=9)
    bytes_ax.set_yticks(range(len(layers)))
    bytes_ax.set_yticklabels([layer or "(model)" for layer in layers], fontsize=7)
    bytes_ax.set_ylim(len(layers) - 0.5, -0.5)  # forward order from the top
    total_ax.set_xlabel("running total (MiB)")
    total_ax.set_title("running total along the forward pass", fontsize=9)
    total_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in (bytes_ax, total_ax):
        ax.grid(axis="x", alpha=0.3)
    return _save(fig, stem, note)


def sweep_figure(rows: Sequence[dict], stem: str | os.PathLike, *, title: str = "",
                 group_fields: Sequence[str] = ()) -> list[Path]:
    """A study's arms side by side: test accuracy (top) and activation compression (bottom).

    Args:
        rows: `freqact.sweep.results_table` rows ("label", "seeds", "final_acc_mean",
            "final_acc_std", "best_acc_mean", "compression_ratio", and each of `group_fields`).
            Arms without a finished seed are left out.
        stem: output path without suffix.
        title: figure title (the study's name).
        group_fields: grid fields other than the seed; their values join the arm's label.

    Returns:
        [stem.png, stem.pdf].
    """
    _require(rows, ("label", "seeds", "final_acc_mean", "final_acc_std", "best_acc_mean",
                    "compression_ratio", *group_fields), "sweep results")
    done = [r for r in rows if r["seeds"]]
    if not done:
        raise ValueError("rows: expected at least one arm with a finished seed, got none")
    labels = [" ".join([r["label"], *(f"{f}={r[f]}" for f in group_fields)]) for r in done]
    pos = np.arange(len(done))
    fig = Figure(figsize=(max(6.0, 0.7 * len(done) + 2), 6.5))
    acc_ax, ratio_ax = fig.subplots(2, 1, sharex=True)
    final = np.array([100 * r["final_acc_mean"] for r in done])
    spread = np.array([100 * (r["final_acc_std"] or 0.0) for r in done])
    acc_ax.bar(pos, final, yerr=spread, capsize=3, color="tab:blue", label="final (mean ± std)")
    acc_ax.plot(pos, [100 * r["best_acc_mean"] for r in done], "D", color="tab:orange",
                markersize=5, label="best epoch (mean)")
    acc_ax.set_ylabel("test accuracy (%)")
    acc_ax.legend(fontsize=7)
    acc_ax.set_title(title)
    ratios = [r["compression_ratio"] or 1.0 for r in done]  # normal training stores activations as they are
    ratio_ax.bar(pos, ratios, color="tab:green")
    ratio_ax.set_yscale("log")
    ratio_ax.set_ylabel("activation compression (x)")
    ratio_ax.set_xticks(pos)
    ratio_ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    return _save(fig, stem)
