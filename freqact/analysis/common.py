"""Helpers shared by the analyses: which layers to look at, capturing their maps, fixed batches.

The analyses are pure functions (model + batch in, list of dicts out). This module also holds the
few I/O edges the command line needs to feed them: resolving checkpoint paths, drawing the fixed
test batch a checkpoint's run was evaluated on, and writing a table as CSV.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

from freqact import _validate, checkpoint, data
from freqact.checkpoint import atomic_write
from freqact.kernels import format
from freqact.models import BLOCK_TYPES
from freqact.rundir import RunDir

LAYER_SETS = ("blocks", "convs", "all")

# Modules whose cached input is the one Theorem 3.1 is about: the weight gradient reads it.
WEIGHT_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def map_dims(x: torch.Tensor) -> int:
    """How many trailing dims of `x` form one activation map (the codecs' map-layout policy,
    `kernels.format.map_dims`).

    (N, F) and (N, C, L) / (N, T, F) hold 1D maps, (N, C, H, W) 2D maps, (N, C, D, H, W) 3D maps.

    Raises:
        ValueError: for any other rank.
    """
    return format.map_dims(x.shape)


MAP_LAYOUTS = ("channels_first", "channels_last", "tokens")


def _map_layout(name: str, module: nn.Module, which: str, rank: int | None = None) -> str | None:
    """How a selected layer's map is laid out, one of `MAP_LAYOUTS`, tokens refused.

    A Linear's input by its rank: (N, F) channels-first, (N, T, F) tokens, (N, *spatial, F)
    channels-last (None while the rank is not known, before the forward); any other map by its
    module's declared `map_layout` (`freqact.models`; default channels-first).

    Args:
        name, module, which: the layer as `select_layers` gives it ("output" or "input").
        rank: the captured tensor's number of dims; None before the forward.

    Raises:
        ValueError: for an unknown `map_layout`, and for tokens (ViT, GPT): a sequence has no
            spatial map, and a DCT over its features or over the token order would not be one;
            refused, naming the layer.
    """
    if which == "input" and isinstance(module, nn.Linear):
        if rank is None:
            return None
        layout = "channels_first" if rank == 2 else "tokens" if rank == 3 else "channels_last"
    else:
        layout = getattr(module, "map_layout", "channels_first")
    _validate.choice(f"{type(module).__name__}.map_layout", layout, MAP_LAYOUTS)
    if layout == "tokens":
        raise ValueError(f"layers: the {which} of {name!r} ({type(module).__name__}) holds tokens (N, T, F), "
                         "which have no spatial map for λ or pooling; the analyses read image-like maps "
                         "(N, C, *spatial)")
    return layout


def to_channels_first(name: str, module: nn.Module, which: str, h: torch.Tensor) -> torch.Tensor:
    """A captured tensor laid out as the analyses read maps: channels-first, (N, C, *spatial)
    ((N, F) for a flat one), whose trailing `map_dims` dims are the spatial ones.

    Args:
        name, module, which: the layer as `select_layers` gives it ("output" or "input").
        h: the captured tensor, laid out as `_map_layout` says.

    Returns:
        `h`, or a channels-last `h` (N, *spatial, C) as the view `h.movedim(-1, 1)`.

    Raises:
        ValueError: for tokens (N, T, F), naming the layer (`_map_layout`).
    """
    return h.movedim(-1, 1) if _map_layout(name, module, which, h.dim()) == "channels_last" else h


def select_layers(model: nn.Module, layers: str = "blocks") -> list[tuple[str, nn.Module, str]]:
    """The modules whose activation maps an analysis reads, in definition order.

    Args:
        model: any module.
        layers: `"blocks"`: the residual/dense/transformer blocks (`freqact.models.BLOCK_TYPES`),
            whose *outputs* are read (the paper's Fig. 4); `"convs"`: every Conv1d/2d/3d and Linear,
            whose *inputs* are read (the tensors cached for their weight gradients); `"all"`: both.

    Returns:
        [(name, module, "output" | "input")], one entry per selected module.

    Raises:
        ValueError: if `layers` is unknown, the model has no module of the chosen kind, or a selected
            block outputs tokens (ViT, GPT; `_map_layout`), before anything runs. A Linear reading
            tokens is known by its input's rank only: `capture` refuses it.
    """
    _validate.choice("layers", layers, LAYER_SETS)
    picked = []
    for name, module in model.named_modules():
        if layers in ("blocks", "all") and isinstance(module, BLOCK_TYPES):
            picked.append((name, module, "output"))
        elif layers in ("convs", "all") and isinstance(module, WEIGHT_LAYERS):
            picked.append((name, module, "input"))
    if not picked:
        hint = (" (residual/dense/transformer blocks, freqact.models.BLOCK_TYPES); choose "
                "layers='convs' (--layers convs) to read its conv/linear inputs") if layers == "blocks" else ""
        raise ValueError(f"layers: the model {type(model).__name__} has no {layers!r} layers{hint}")
    for name, module, which in picked:
        _map_layout(name, module, which)
    return picked


@contextlib.contextmanager
def scratch_state(model: nn.Module, train: bool) -> Iterator[nn.Module]:
    """Run `model` in train/eval mode, then restore its mode and its buffers.

    Forward passes in training mode update BatchNorm running statistics; an analysis must leave the
    model it was given exactly as it found it. Run backward inside the block: BatchNorm saves its
    running statistics for backward, and restoring them in place invalidates that graph.
    """
    was_training = model.training
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    model.train(train)
    try:
        yield model
    finally:
        model.train(was_training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def capture(
    model: nn.Module, x: torch.Tensor, picked: Sequence[tuple[str, nn.Module, str]]
) -> list[tuple[str, torch.Tensor]]:
    """Run `model(x)` in eval mode without autograd and return the selected maps.

    Args:
        model: the network.
        x: its input batch, shape (N, *model input).
        picked: from `select_layers`.

    Returns:
        [(layer name, detached tensor laid out channels-first by `to_channels_first`)] in call
        order; a module called k > 1 times in one forward pass gives entries `name`, `name@1`, ...,
        `name@{k-1}`.

    Raises:
        ValueError: for a selected map of tokens (`to_channels_first`).
    """
    captured: list[tuple[str, torch.Tensor]] = []
    calls: dict[str, int] = {}

    def hook_for(name: str, which: str):
        def hook(module, inputs, output):
            count = calls.get(name, 0)
            calls[name] = count + 1
            tensor = output if which == "output" else inputs[0]
            maps = to_channels_first(name, module, which, tensor.detach())
            captured.append((name if count == 0 else f"{name}@{count}", maps))

        return hook

    handles = [m.register_forward_hook(hook_for(name, which)) for name, m, which in picked]
    try:
        with scratch_state(model, train=False), torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def resolve_checkpoints(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand run directories into their epoch checkpoints; keep checkpoint files as given.

    A run directory `RUN` contributes `RUN/ckpt/epoch-*.pt` in epoch order, or `RUN/ckpt/last.pt`
    when it holds no epoch checkpoint. A file named twice (a run and one of its checkpoints, or
    two spellings of one path) is kept once, where it first appears.

    Raises:
        FileNotFoundError: if a path does not exist or a run directory holds no checkpoint.
    """
    found: list[Path] = []
    for entry in map(Path, paths):
        if entry.is_file():
            found.append(entry)
        elif entry.is_dir():
            # a run directory, or a folder of checkpoints laid out as its ckpt/
            folder = RunDir(entry).ckpt_dir if RunDir(entry).ckpt_dir.is_dir() else entry
            epochs = RunDir.checkpoints_in(folder)
            if not epochs:
                raise FileNotFoundError(f"{entry}: no epoch-*.pt or last.pt checkpoint in {folder}")
            found.extend(epochs)
        else:
            raise FileNotFoundError(f"{entry}: no such checkpoint or run directory")
    unique: dict[Path, Path] = {}
    for path in found:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                    config_keys: Sequence[str] = ("dataset",)) -> tuple[nn.Module, dict]:
    """`checkpoint.load_model(path, device, required=config_keys)`: a checkpoint without its
    "epoch" or a config without one of `config_keys` (what the analyses read: the dataset the fixed
    test batch comes from) is refused in one line naming the file and the keys, before its model
    is built.

    Returns:
        (model in eval mode, checkpoint dict).
    """
    return checkpoint.load_model(path, device, required=config_keys)


def model_identity(config: dict) -> tuple[str, str, str]:
    """What makes two runs' maps comparable: (model, its options as sorted JSON, dataset)."""
    options = json.dumps(config.get("model_options") or {}, sort_keys=True)
    return str(config.get("model")), options, str(config.get("dataset"))


def check_one_model(first: tuple[str | os.PathLike, dict], other: tuple[str | os.PathLike, dict],
                    what: str = "checkpoints") -> None:
    """Refuse to put two runs of different models or datasets into one table or figure.

    Args:
        first, other: (where, config) of the first checkpoint/run and of another one.
        what: the argument named in the message.

    Raises:
        ValueError: one line naming both and what differs.
    """
    a, b = model_identity(first[1]), model_identity(other[1])
    if a != b:
        def name(identity):
            options = "" if identity[1] == "{}" else f" {identity[1]}"
            return f"{identity[0]}{options} on {identity[2]!r}"
        raise ValueError(f"{what}: expected runs of one model on one dataset, got {name(a)} "
                         f"({first[0]}) and {name(b)} ({other[0]}); analyse them separately")


def load_checkpoints(paths: Sequence[str | os.PathLike], device: str | torch.device = "cpu"
                     ) -> Iterator[tuple[Path, nn.Module, dict]]:
    """(path, model, checkpoint) for each checkpoint `resolve_checkpoints(paths)` names, loaded
    one at a time with `load_checkpoint`.

    Raises:
        ValueError: when a checkpoint's model or dataset differs from the first's
            (`check_one_model`), before its model is used.
    """
    first = None
    for path in resolve_checkpoints(paths):
        model, ckpt = load_checkpoint(path, device)
        if first is None:
            first = (path, ckpt["config"])
        else:
            check_one_model(first, (path, ckpt["config"]))
        yield path, model, ckpt


def run_of(checkpoint: str | os.PathLike) -> Path:
    """The run directory of a checkpoint in `RUN/ckpt/`, else the checkpoint's folder (as given,
    not resolved: it labels rows and figures)."""
    parent = Path(checkpoint).parent
    return parent.parent if RunDir(parent.parent).ckpt_dir == parent else parent


def where(path: Path, ckpt: dict) -> dict:
    """The columns that place a row: {"run", "checkpoint", "epoch"} (run: `run_of(path)`)."""
    return {"run": str(run_of(path)), "checkpoint": str(path), "epoch": ckpt["epoch"]}


def default_out_dir(checkpoint: Path) -> Path:
    """`RUN/analysis` for a checkpoint in `RUN/ckpt/`, else `analysis/` beside the checkpoint."""
    return run_of(Path(checkpoint).resolve()) / "analysis"


def eval_batch(
    model: nn.Module,
    config: dict,
    images: int,
    data_dir: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `images` test images of a run's dataset, as the run's model sees them.

    Deterministic (no augmentation, no shuffling), so every checkpoint sees the same batch; loaded
    and shaped as `freqact.train` does (`data.load_for_model`, `data.model_inputs`).

    Args:
        model: the run's model (its `input_shape` attribute is read).
        config: the run config stored in its checkpoint (`dataset`, `data_dir`, `seed`, `subset`).
        images: how many test images (fewer if the test set is smaller).
        data_dir: overrides the data directory the run recorded.
        device: where to put the batch.

    Returns:
        (x, y): float32 inputs (n, *model.input_shape) normalised as in training, int64 labels (n,).
    """
    _validate.positive_int("images", images)
    ds = data.load_for_model(
        config["dataset"],
        model,
        data_dir if data_dir is not None else config.get("data_dir"),
        subset=config.get("subset"),
        seed=config.get("seed", 0),
    )
    x = data.model_inputs(ds, ds.test_images[:images], model)
    if not x.is_floating_point():
        raise ValueError(f"checkpoint: the analyses read the activation maps of image models; "
                         f"this run's model reads {config['dataset']!r} token ids")
    return x.to(device), ds.test_labels[:images].to(device)


def write_csv(rows: Sequence[dict], path: str | os.PathLike) -> Path:
    """Write a list of dicts as CSV, atomically (columns: the union of keys in first-seen order)."""
    path = Path(path)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, text.getvalue().encode("utf-8"))
    return path
