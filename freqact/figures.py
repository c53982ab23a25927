"""Every figure of a set of training runs, regenerated from their run directories.

    results = make_all(["runs/normal", "runs/lfc", "runs/hfc", "runs/division"], "figures")

`freqact figures RUN...` and `freqact demo` both call `make_all`, so the demo's figures and the
published ones come from one path. From the run directories (`config.json`, `metrics.jsonl`,
`ckpt/epoch-*.pt`, `ckpt/last.pt`) it computes and writes, each as a table (CSV) and a figure
(PNG + PDF) in `out`:

- `lambdas`: λ^L and λ^H per block output across the epoch checkpoints of the analysis run
  (`analysis.lambdas.from_checkpoints`; the paper's Fig. 4).
- `training`: test accuracy and training loss per epoch of every run (`metrics.jsonl`) and the
  activation memory each run's mode caches for one training batch (the paper's Fig. 3 b, c:
  LFC-ACT vs HFC-ACT vs normal, with DIVISION beside them).
- `theorem31`: per conv layer, weight-gradient errors of LFC/HFC caching against the Theorem 3.1 bounds,
  on the analysis run's last checkpoint (`analysis.theorem31.measure`).
- `pooling`: DIVISION's block-mean LFC against the DCT low-pass on the same checkpoint's maps
  (`analysis.pooling.measure`; Theorem 4.1).
- `compression`: bytes cached per layer by each run's mode, and the per-layer ratio.

Memory is measured from checkpoints, not recorded during training: the run's last model does one
training-mode forward pass on its first `batch_size` test images inside
`engine.compress(model, <the run's codec>)` and the meter's `per_layer()` table is kept (for
`normal` runs its plain-PyTorch column, `exact_bytes`). Every codec's packed size depends only on
the tensor shapes, so this is exactly what one training step of that batch size caches, and any
finished run can be measured again without retraining. The analysis run is the `normal` run when
one is given (the paper's analyses are of normal training), else the first run.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from freqact import _validate, dct, distributed, engine, plots, rundir, train
from freqact.analysis import common, pipelines, pooling

FIGURES = ("lambdas", "training", "theorem31", "pooling", "compression")
# The metrics columns the training figure plots (a bad row is refused naming file and line).
TRAINING_COLUMNS = ("train_loss", "test_acc")
# The config.json keys the figures read (a run lacking one is refused naming file and key).
RUN_KEYS = ("model", "dataset", "mode", "batch_size")

CAPTIONS = {
    "lambdas": "λ^L (low band) beside λ^H (high band) of every block output (conv/linear input with "
               "--layers convs), mean ± std over test "
               "images, one panel per checkpoint of the analysis run (the paper's Fig. 4). λ^L above "
               "λ^H means the block's maps live mostly in the low frequencies.",
    "training": "Test accuracy and training loss per epoch of every run, and the activation memory "
                "one training batch caches in each mode (plain PyTorch bytes as the outline): "
                "LFC-ACT vs HFC-ACT vs normal training (the paper's Fig. 3 b, c), with DIVISION.",
    "theorem31": "Theorem 3.1 per conv layer of the analysis run's last checkpoint: (a) the "
                 "weight-gradient error when only that layer caches its input's LFC (err^L) or HFC "
                 "(err^H), against the bounds GEB^L = c‖∇y‖λ^H, GEB^H = c‖∇y‖λ^L (c: the layer's "
                 "kernel factor, √ of the most kernel taps that read one input element); (b) the "
                 "bounds' tightness err/GEB; (c) err^L / err^H measured directly; (d) the "
                 "whole-network gradient cosine with the exact gradient per checkpoint.",
    "pooling": "DIVISION's block-mean LFC against the DCT low-pass keeping W/N = 1/B, per activation "
               "map and block size B: their relative distance and the energy share each captures "
               "(Theorem 4.1: average pooling is a low-pass filter). The distance is 0 where B covers "
               "the whole map: both then keep its mean alone.",
    "compression": "Bytes each layer caches for backward in each run's mode (one training batch; layers "
                   "in forward order from the top), and their running total along the forward pass "
                   "against plain PyTorch's. A storage "
                   "several layers save belongs to the first (a conv reading a ReLU's output shows "
                   "no plain bytes: the ReLU holds them).",
}


@dataclasses.dataclass
class Figure:
    """One regenerated figure with the table it was drawn from.

    Attributes:
        name: one of `FIGURES`.
        caption: what the figure shows.
        files: the written figure files (PNG, PDF) and tables (CSV).
        rows: the table the figure was drawn from (list of dicts).
    """

    name: str
    caption: str
    files: list[Path]
    rows: list[dict]


# How figures name the data sets of `freqact.data.DATASETS`.
_DATASET_NAMES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "digits": "scikit-learn digits",
                  "synthetic": "synthetic data"}
# How figure notes name the maps of `common.LAYER_SETS`.
_MAPS = {"blocks": "block outputs", "convs": "conv/linear inputs", "all": "block outputs and conv/linear inputs"}
# The paper's symbols for the codec settings (W/N kept fraction, B block size, Q HFC bits).
_SYMBOLS = {"ratio": "W/N", "block": "B", "bits": "Q"}


def settings_label(config: dict) -> str:
    """A run's codec settings in the paper's symbols, e.g. "B=8, Q=2"; "" for normal/exact."""
    params = train.RunConfig.from_dict(config).label_params()
    return ", ".join(f"{_SYMBOLS.get(k, k)}={v}" for k, v in params.items())


def run_label(config: dict) -> str:
    """A short label of a run's mode and codec settings, e.g. "division (B=8, Q=2)"."""
    settings = settings_label(config)
    return f"{config['mode']} ({settings})" if settings else config["mode"]


def describe(config: dict) -> str:
    """A run's model and data for figure notes, e.g. "resnet20 on CIFAR-10 (5000 training images)"."""
    images = f" ({config['subset']} training images)" if config.get("subset") else ""
    return f"{config['model']} on {_DATASET_NAMES.get(config['dataset'], config['dataset'])}{images}"


def layer_memory(path: str | os.PathLike, *, images: int | None = None,
                 data_dir: str | os.PathLike | None = None,
                 device: str | torch.device = "cpu") -> list[dict]:
    """Bytes each layer caches for backward in one training step of a checkpoint's run mode.

    One training-mode forward pass (BatchNorm batch statistics, as in training) of the checkpoint's
    model on the first `images` test images, inside `engine.compress` with the run's codec
    (for `normal` runs: `exact`, and the rows report plain PyTorch's bytes, `exact_bytes`, as saved).

    Args:
        path: a checkpoint written by `freqact.train`.
        images: batch size (default: the run's training batch size; fewer if the test set is
            smaller).
        data_dir: overrides the data directory the run recorded.
        device: where to run.

    Returns:
        `engine.Meter.per_layer()` rows ({"layer", "type", "saved_bytes", "exact_bytes", "ratio",
        "count"}) in forward order, plus "images" (the batch size used).
    """
    # a private RNG stream: building the model and the codec's stochastic rounding draw numbers
    with torch.random.fork_rng(devices=[]):
        model, ckpt = common.load_checkpoint(path, device, ("dataset", "mode", "batch_size"))
        config = ckpt["config"]
        images = _validate.positive_int("images", config["batch_size"] if images is None else images)
        x, _ = common.eval_batch(model, config, images, data_dir, device)
        codec = "exact" if config["mode"] == "normal" else config["mode"]
        with common.scratch_state(model, train=True):
            with engine.compress(model, codec, **_codec_params(config)) as meter:
                out = model(x)
            del out  # frees the graph and with it the packed activations
    rows = meter.per_layer()
    if config["mode"] == "normal":
        # plain PyTorch holds exactly the meter's exact_bytes (`exact` still packs pool indices)
        rows = [{**row, "saved_bytes": row["exact_bytes"], "ratio": 1.0} for row in rows]
    return [{**row, "images": len(x)} for row in rows]


def make_all(
    run_dirs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    analysis_run: str | os.PathLike | None = None,
    ratio: float = pipelines.RATIO,
    rule: str = pipelines.RULE,
    layers: str = pipelines.LAYERS,
    blocks: Sequence[int] = pipelines.BLOCKS,
    lambda_images: int = pipelines.LAMBDA_IMAGES,
    theorem_images: int = pipelines.THEOREM_IMAGES,
    pooling_images: int = pipelines.POOLING_IMAGES,
    memory_images: int | None = None,
    data_dir: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Figure]:
    """Compute every table from the run directories and draw every figure into `out`.

    The λ, Theorem 3.1 and pooling tables come from `freqact.analysis.pipelines` (the same
    pipelines as `freqact lambdas|theorem31|pooling`); a table already in `out` whose settings
    sidecar matches is reused instead of measured again.

    Args:
        run_dirs: run directories written by `freqact.train` (one per mode, typically).
        out: folder for the figures (`NAME.png`, `NAME.pdf`) and tables (`NAME.csv`).
        analysis_run: the run whose checkpoints the λ, Theorem 3.1 and pooling analyses read
            (default: the `normal` run, else the first).
        ratio: kept fraction W/N of each frequency axis for λ and Theorem 3.1, in (0, 1].
        rule: how W/N becomes W for λ and Theorem 3.1, "nearest" or "official".
        layers: which maps λ and pooling read: "blocks" (block outputs), "convs" (conv/linear
            inputs: for models without residual blocks) or "all" (`common.select_layers`).
        blocks: DIVISION block sizes compared with the DCT low-pass.
        lambda_images, theorem_images, pooling_images: test images each analysis reads.
        memory_images: batch size of the memory measurement (default: each run's batch size).
        data_dir: overrides the data directory the runs recorded.
        device: where to run the models.
        progress: called with a short line before each step (e.g. `print`).

    Returns:
        {name: Figure} for every name in `FIGURES`, in that order.

    Raises:
        ValueError: if `run_dirs` is empty, holds runs of different models or datasets, or
            `analysis_run` is not one of them, or a setting is out of range (all checked before
            anything is computed).
        FileNotFoundError: if a run directory lacks config.json, metrics.jsonl or checkpoints.
    """
    if isinstance(run_dirs, (str, os.PathLike)) or not run_dirs:
        raise ValueError(f"run_dirs: expected a non-empty list of run directories, got {run_dirs!r}")
    _validate.unit_ratio("ratio", ratio)
    _validate.choice("rule", rule, dct.WINDOW_RULES)
    _validate.choice("layers", layers, common.LAYER_SETS)
    # every setting is checked before the first analysis runs (a bad pooling_images would
    # otherwise be refused minutes later, after λ and the memory runs, as "images")
    for name, images in (("lambda_images", lambda_images), ("theorem_images", theorem_images),
                         ("pooling_images", pooling_images)):
        _validate.positive_int(name, images)
    if memory_images is not None:
        _validate.positive_int("memory_images", memory_images)
    pooling.check_blocks(blocks)
    distributed.pick_device(str(device))
    runs = [Path(r) for r in run_dirs]
    configs = [_run_config(r) for r in runs]
    for run, config in zip(runs[1:], configs[1:]):  # one model on one dataset in every figure
        common.check_one_model((runs[0], configs[0]), (run, config), what="run_dirs")
    labels = _unique_labels([run_label(c) for c in configs], runs)
    # every run's metrics are read (and checked) before anything is computed
    metrics = [{"run": label, **row}
               for label, r in zip(labels, runs)
               for row in rundir.RunDir(r).read_metrics(numbers=TRAINING_COLUMNS)]
    main_run = _analysis_run(runs, configs, analysis_run)
    main_config = configs[runs.index(main_run)]
    model_data = describe(main_config)
    out = Path(out)
    with rundir.output_lock(out):  # one writer per figures folder
        say = progress or (lambda line: None)
        made: dict[str, Figure] = {}

        say(f"lambdas: λ of the {_MAPS[layers]} across the checkpoints of {main_run}")
        shared = {"data_dir": data_dir, "device": device, "reuse": True}  # every analysis pipeline's
        done = pipelines.lambdas_analysis(
            [main_run], out, ratio=ratio, rule=rule, layers=layers, images=lambda_images, **shared,
            note=f"{main_run.name} run: {model_data}; {_MAPS[layers]}, {lambda_images} test images, "
                 f"W/N = {ratio} ({rule} rule)")
        made["lambdas"] = _analysis_figure("lambdas", done)

        say("memory: bytes cached per layer, one training batch per run")
        memory = [{"run": label, **row} for label, path in zip(labels, map(_last_checkpoint, runs))
                  for row in layer_memory(path, images=memory_images, data_dir=data_dir, device=device)]
        totals = memory_totals(memory)
        trained = "; ".join(dict.fromkeys(f"{describe(c)}, batch {c['batch_size']}" for c in configs))
        memory_note = f"memory: one training batch of {totals[0]['images']} test images"
        made["training"] = _figure(
            "training", out, metrics,
            lambda rows, stem, note: plots.training_figure(rows, stem, memory=totals, note=note),
            f"{trained}; {memory_note}")

        main_ckpt = _last_checkpoint(main_run)
        say(f"theorem31: gradient errors vs bounds on {main_ckpt}")
        last = f"{main_run.name} run, last checkpoint: {model_data}"
        done = pipelines.theorem31_analysis(
            [main_ckpt], out, ratio=ratio, rule=rule, images=theorem_images, **shared,
            note=f"{last}; a batch of {theorem_images} test images, W/N = {ratio} ({rule} rule)")
        made["theorem31"] = _analysis_figure("theorem31", done)

        say(f"pooling: block means vs DCT low-pass on {main_ckpt}")
        done = pipelines.pooling_analysis(main_ckpt, out, blocks=blocks, layers=layers, images=pooling_images,
                                          **shared, note=f"{last}; {_MAPS[layers]}, {pooling_images} test images")
        made["pooling"] = _analysis_figure("pooling", done)

        made["compression"] = _figure("compression", out, memory, plots.compression_figure,
                                      f"{model_data}, each run's last checkpoint; {memory_note}")
    return made


def memory_totals(rows: Sequence[dict]) -> list[dict]:
    """Per run: the summed bytes of a `layer_memory` table with a "run" column.

    Returns:
        One row per run in first-seen order: {"run", "images", "exact_bytes", "saved_bytes",
        "ratio"} (ratio = exact / saved).
    """
    totals: dict[str, dict] = {}
    for row in rows:
        total = totals.setdefault(row["run"], {"run": row["run"], "images": row["images"],
                                               "exact_bytes": 0, "saved_bytes": 0})
        total["exact_bytes"] += row["exact_bytes"]
        total["saved_bytes"] += row["saved_bytes"]
    for total in totals.values():
        total["ratio"] = total["exact_bytes"] / total["saved_bytes"] if total["saved_bytes"] else float("inf")
    return list(totals.values())


def _run_config(run: Path) -> dict:
    """A run's config.json with `RUN_KEYS`, its settings checked as `RunConfig` checks them; a bad
    value is refused naming the file (not as if the caller had passed it)."""
    run_dir = rundir.RunDir(run)
    config = run_dir.read_config(required=RUN_KEYS)
    if not isinstance(config["model"], str):
        raise ValueError(f"{run_dir.config_path}: model: expected a model name, got {config['model']!r}")
    try:
        train.RunConfig.from_dict(config)
    except ValueError as err:  # UsageError and UsageTypeError
        raise ValueError(f"{run_dir.config_path}: {err}") from None
    return config


def _last_checkpoint(run: Path) -> Path:
    """RUN/ckpt/last.pt, the run's final state."""
    path = rundir.RunDir(run).last
    if not path.is_file():
        raise FileNotFoundError(f"run_dirs: {run} has no ckpt/last.pt (no finished epoch)")
    return path


def _codec_params(config: dict) -> dict:
    """The codec settings of a stored run config's mode, e.g. {"block": 8, "bits": 2}."""
    return train.RunConfig.from_dict(config).codec_params()


def _figure(name: str, out: Path, rows: list[dict], draw: Callable, note: str) -> Figure:
    """Write `rows` as out/NAME.csv and draw them as out/NAME.png/.pdf with `note` above."""
    files = [common.write_csv(rows, out / f"{name}.csv"), *draw(rows, out / name, note=note)]
    return Figure(name, CAPTIONS[name], files, rows)


def _analysis_figure(name: str, done: pipelines.Analysis) -> Figure:
    """A pipeline's table and figure as a Figure (its extra tables stay in the folder, unlisted)."""
    files = [p for p in done.files if p.stem == name and p.suffix in (".csv", ".png", ".pdf")]
    return Figure(name, CAPTIONS[name], files, done.rows)


def _analysis_run(runs: list[Path], configs: list[dict], chosen) -> Path:
    """The run the analyses read: `chosen`, else the first `normal` run, else the first run."""
    if chosen is not None:
        matches = [r for r in runs if r.resolve() == Path(chosen).resolve()]
        if not matches:
            raise ValueError(f"analysis_run: expected one of the run directories "
                             f"{', '.join(map(str, runs))}, got {chosen}")
        return matches[0]
    return next((r for r, c in zip(runs, configs) if c["mode"] == "normal"), runs[0])


def _unique_labels(labels: list[str], runs: list[Path]) -> list[str]:
    """Labels, with the run directory's name appended where two runs share one."""
    return [f"{label} [{run.name}]" if labels.count(label) > 1 else label
            for label, run in zip(labels, runs)]
