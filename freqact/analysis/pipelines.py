"""One pipeline per analysis: load the checkpoints → take a test batch → measure → write the table
(CSV) → draw the figure. `freqact lambdas|theorem31|pooling`, `freqact figures` and the demo all call
these, so each analysis has one set of defaults (the module constants below).

Each table is written with a settings sidecar (`NAME.settings.json`: the analysis settings and the
checkpoints' sizes and modification times). With `reuse=True` a table whose sidecar matches is read
back instead of measured again (`freqact figures` on a folder it already filled). Each pipeline
holds the folder's writer lock (`rundir.output_lock`) while it reads and writes there. A sidecar is removed
before its table is replaced and written again after it, so one never vouches for another table.
"""
from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from freqact import checkpoint, plots, rundir
from freqact.analysis import common, lambdas, pooling, theorem31

RATIO = 0.1  # kept fraction W/N of each frequency axis (λ, Theorem 3.1)
RULE = "nearest"  # how W/N becomes W (see freqact.dct.keep_count)
LAYERS = "blocks"  # which activation maps λ and pooling read
BLOCKS = pooling.BLOCKS  # DIVISION block sizes the pooling analysis compares
LAMBDA_IMAGES = 512
THEOREM_IMAGES = 128
POOLING_IMAGES = 64


@dataclass
class Analysis:
    """What a pipeline produced.

    Attributes:
        rows: the analysis table (one dict per row).
        files: every file written: the table's CSV first, then extra tables, then the figure files.
        extra: a second table: λ, the summary; Theorem 3.1, the whole-network fidelity per
            checkpoint; pooling, its run, checkpoint and epoch (empty when reused).
        reused: whether the tables were read back from `out` instead of measured.
    """

    rows: list[dict]
    files: list[Path]
    extra: list[dict] = field(default_factory=list)
    reused: bool = False


def lambdas_analysis(checkpoints: Sequence[str | os.PathLike], out: str | os.PathLike, *, ratio: float = RATIO,
                     layers: str = LAYERS, rule: str = RULE, images: int = LAMBDA_IMAGES,
                     data_dir: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                     note: str = "", reuse: bool = False) -> Analysis:
    """λ^L, λ^H per layer and image at every checkpoint: OUT/lambdas.csv, lambdas_summary.csv and
    the lambdas figure. Args as in `lambdas.from_checkpoints`; `out` the folder; `note` a line
    above the figure; `reuse` see the module docstring.

    >>> lambdas_analysis([], "out")
    Traceback (most recent call last):
    ...
    ValueError: checkpoints: expected at least one checkpoint or run directory, got []
    """
    paths = _checkpoints(checkpoints)
    settings = _settings(paths, ratio=ratio, layers=layers, rule=rule, images=images, data_dir=data_dir)
    out = Path(out)
    with rundir.output_lock(out):
        rows = _reused(out, "lambdas", settings) if reuse else None
        reused = rows is not None
        if rows is None:
            rows = lambdas.from_checkpoints(paths, ratio=ratio, layers=layers, rule=rule, images=images,
                                            data_dir=data_dir, device=device)
        summary = lambdas.summarize(rows)
        files = [_write(rows, out, "lambdas", settings), common.write_csv(summary, out / "lambdas_summary.csv"),
                 *plots.lambdas_figure(rows, out / "lambdas", note=note)]
    return Analysis(rows, files, summary, reused)


def theorem31_analysis(checkpoints: Sequence[str | os.PathLike], out: str | os.PathLike, *,
                       ratio: float = RATIO, rule: str = RULE, images: int = THEOREM_IMAGES,
                       end_to_end: bool = True, data_dir: str | os.PathLike | None = None,
                       device: str | torch.device = "cpu", note: str = "", reuse: bool = False) -> Analysis:
    """Theorem 3.1 per conv layer and whole-network gradient fidelity at every checkpoint:
    OUT/theorem31.csv, theorem31_fidelity.csv and the 4-panel theorem31 figure. Args as in
    `theorem31.from_checkpoints`; `out`, `note`, `reuse` as in `lambdas_analysis`."""
    paths = _checkpoints(checkpoints)
    settings = _settings(paths, ratio=ratio, rule=rule, images=images, end_to_end=end_to_end, data_dir=data_dir)
    out = Path(out)
    with rundir.output_lock(out):
        rows = _reused(out, "theorem31", settings) if reuse else None
        fidelity = _reused(out, "theorem31_fidelity", settings) if rows is not None else None
        reused = fidelity is not None
        if not reused:
            rows, fidelity = theorem31.from_checkpoints(paths, ratio=ratio, rule=rule, images=images,
                                                        end_to_end=end_to_end, data_dir=data_dir,
                                                        device=device)
        files = [_write(rows, out, "theorem31", settings), _write(fidelity, out, "theorem31_fidelity", settings),
                 *plots.theorem31_figure(rows, out / "theorem31", fidelity=fidelity, note=note)]
    return Analysis(rows, files, fidelity, reused)


def pooling_analysis(checkpoint_path: str | os.PathLike, out: str | os.PathLike, *,
                     blocks: Sequence[int] = BLOCKS, layers: str = LAYERS, images: int = POOLING_IMAGES,
                     data_dir: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                     note: str = "", reuse: bool = False) -> Analysis:
    """Block means vs the DCT low-pass on one checkpoint: OUT/pooling.csv and the pooling figure.
    Args as in `pooling.measure` and `common.eval_batch`; `out`, `note`, `reuse` as in
    `lambdas_analysis`."""
    paths = [Path(checkpoint_path)]
    settings = _settings(paths, blocks=[int(b) for b in blocks], layers=layers, images=images,
                         data_dir=data_dir)
    out = Path(out)
    with rundir.output_lock(out):
        rows = _reused(out, "pooling", settings) if reuse else None
        reused = rows is not None
        if rows is None:
            model, ckpt = common.load_checkpoint(paths[0], device)
            x, _ = common.eval_batch(model, ckpt["config"], images, data_dir, device)
            rows = pooling.measure(model, x, blocks=blocks, layers=layers)
            extra = [common.where(paths[0], ckpt)]
        files = [_write(rows, out, "pooling", settings), *plots.pooling_figure(rows, out / "pooling", note=note)]
    return Analysis(rows, files, [] if reused else extra, reused)


def _checkpoints(paths: Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)) or not paths:
        raise ValueError(f"checkpoints: expected at least one checkpoint or run directory, got {paths!r}")
    return common.resolve_checkpoints(paths)


def _settings(paths: Sequence[Path], **settings) -> dict:
    """The sidecar's content: the settings plus each checkpoint's identity (path, size, mtime)."""
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in map(Path, paths)]
    return json.loads(json.dumps({**settings, "checkpoints": stats}, default=str))


def _write(rows: list[dict], out: Path, name: str, settings: dict) -> Path:
    """OUT/NAME.csv and its settings sidecar OUT/NAME.settings.json, consistent under a crash.

    The old sidecar is removed before the table is replaced and the new one written (atomically,
    under a unique temporary name) only after it, so at any moment a sidecar present vouches for
    the table beside it: a crash in between leaves a table without one, which is measured again.
    """
    sidecar = out / f"{name}.settings.json"
    sidecar.unlink(missing_ok=True)
    path = common.write_csv(rows, out / f"{name}.csv")
    checkpoint.atomic_write(sidecar, (json.dumps(settings, indent=1) + "\n").encode("utf-8"))
    return path


def _reused(out: Path, name: str, settings: dict) -> list[dict] | None:
    """OUT/NAME.csv's rows when its sidecar records exactly `settings`, else None (a sidecar that
    is missing, unreadable, too large or malformed included: the table is measured again)."""
    try:
        recorded = rundir.read_json(out / f"{name}.settings.json")
        with open(out / f"{name}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, ValueError):
        return None
    if recorded != settings or not rows:
        return None
    return [{key: _value(text) for key, text in row.items()} for row in rows]


def _value(text: str):
    """A CSV cell back as the value `write_csv` wrote: None, bool, int, float or str.

    >>> [_value(s) for s in ("", "True", "3", "0.25", "inf", "layer1.0")]
    [None, True, 3, 0.25, inf, 'layer1.0']
    """
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
