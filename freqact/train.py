"""One training loop for every mode: `RunConfig` in, a run directory and a results dict out.

    config = RunConfig(model="resnet20", dataset="cifar10", mode="division", block=8, bits=2)
    results = train(config)          # writes config.json, metrics.csv/.jsonl, ckpt/*.pt

Modes: `normal` is plain PyTorch (no hooks). Every other mode names a codec; the forward pass of
each training step runs inside `freqact.engine.compress(model, mode, **codec params)`, so the
activations cached for backward are stored compressed and rebuilt during backward. Evaluation is a
plain forward under `torch.no_grad()`.

Recipe (defaults, the paper's CIFAR setting): SGD with momentum 0.9, weight decay 5e-4, lr 0.1,
cosine schedule over the epochs (stepped once per epoch), batch 256, CIFAR augmentation (random
crop of the 4-pixel padded image + horizontal flip).

Data: whole datasets are moved to the device once as uint8 tensors; each epoch's order comes
from a `DistributedSampler` seeded with (seed, epoch) (also with one process; under torchrun it
pads the order by repeating a few indices so every rank gets as many), batches are gathered by
index on the device and augmented/normalised there; the last, smaller batch is kept. `workers` is
accepted for command-line compatibility but unused: there is no loader to parallelise.

Determinism and resume: every epoch ends with `ckpt/last.pt` holding model, optimizer, scheduler,
GradScaler, the torch (and CUDA) RNG states and the augmentation generator of every rank, and the
metrics so far. Resuming restores all of them, so on the CPU with a fixed seed the resumed run's
metrics equal an uninterrupted run's, except the timing columns (epoch_time_s, images_per_s). On
CUDA, nondeterministic kernels (cuDNN autotuning, atomics in backward) make runs differ in the last
bits with or without a resume. A resume needs the same number of ranks (the RNG states are per
rank) and the same training settings; only device, workers, out, data_dir, download and the
checkpoint cadence may change.

Under `torchrun` (see `freqact.distributed`) each rank trains on its shard of every epoch with a
per-rank batch of batch_size / world_size, compresses its own activations, and the model is
wrapped in DistributedDataParallel; losses and accuracies are summed over ranks, the meter's bytes
are rank 0's (the memory one device holds), and only rank 0 prints and writes files. BatchNorm
statistics are per rank, as usual with DDP.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from freqact import _validate, checkpoint, data, distributed, engine, models

MODES = ("normal", "exact", "lfc", "hfc", "division", "division-no-hfc", "division-no-lfc", "quant")
BITS = (1, 2, 4, 8)
# Which RunConfig fields each mode's codec takes.
_CODEC_PARAMS = {
    "normal": (), "exact": (), "lfc": ("ratio",), "hfc": ("ratio",), "division": ("block", "bits"),
    "division-no-hfc": ("block",), "division-no-lfc": ("block", "bits"), "quant": ("bits",),
}
# Fields that may change when a run is resumed; all others must match the checkpoint.
RESUMABLE_CHANGES = ("device", "workers", "out", "resume", "save_epochs", "save_every", "download",
                      "data_dir")
METRIC_COLUMNS = (
    "epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_time_s",
    "images_per_s", "saved_bytes", "exact_bytes", "compression_ratio", "cuda_peak_bytes",
)


@dataclasses.dataclass
class RunConfig:
    """Everything that defines a training run; plain JSON types only (it goes into checkpoints).

    Attributes:
        model: a `freqact.models` name.
        dataset: one of `freqact.data.DATASETS`.
        mode: one of `MODES`.
        ratio: kept fraction W/N of each frequency axis for lfc/hfc, in (0, 1].
        block: DIVISION block size B (division, division-no-hfc), >= 1.
        bits: quantisation bits Q (division, division-no-lfc, quant), one of 1, 2, 4, 8.
            division-no-lfc also takes `block`: its residual is taken against the BxB means.
        epochs, batch_size, lr, momentum, weight_decay: the SGD + cosine recipe; batch_size is
            global (split over the ranks under torchrun).
        subset: train on the first `subset` training images only (the test set is always whole);
            for synthetic, the number of training images drawn.
        seed: seeds the model initialisation, data order, augmentation and codec noise.
        amp: autocast (bfloat16 on CPU; float16 with a GradScaler on CUDA).
        device: "cpu", "cuda", "cuda:N" or None for CUDA when available.
        workers: unused (data are in-memory tensors); kept for command-line compatibility.
        data_dir: CIFAR data directory (else $FREQACT_DATA, else ./data).
        download: download CIFAR when missing.
        out: run directory; None means runs/<model>-<dataset>-<mode>.
        save_epochs: epochs after which `ckpt/epoch-XXXX.pt` is kept.
        save_every: also keep every K-th epoch's checkpoint (None: only `save_epochs`).
        resume: continue the run in `out` from `ckpt/last.pt` (start it if there is none yet, so
            a preemptible job can always be relaunched with the same command).
    """

    model: str = "resnet20"
    dataset: str = "cifar10"
    mode: str = "normal"
    ratio: float = 0.5
    block: int = 8
    bits: int = 2
    epochs: int = 100  # the original code's CIFAR runs (94.89 % normal, 94.72 % DIVISION)
    batch_size: int = 256
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    subset: int | None = None
    seed: int = 0
    amp: bool = False
    device: str | None = None
    workers: int = 0
    data_dir: str | None = None
    download: bool = False
    out: str | None = None
    save_epochs: list[int] = dataclasses.field(default_factory=lambda: [20, 40, 60])
    save_every: int | None = None
    resume: bool = False

    def __post_init__(self) -> None:
        _validate.choice("dataset", self.dataset, data.DATASETS)
        _validate.choice("mode", self.mode, MODES)
        _validate.unit_ratio("ratio", self.ratio)
        _validate.positive_int("block", self.block)
        # positive_int first: True and 2.0 compare equal to members of BITS.
        _validate.choice("bits", _validate.positive_int("bits", self.bits), BITS)
        for name in ("epochs", "batch_size"):
            _validate.positive_int(name, getattr(self, name))
        for name in ("subset", "save_every"):
            if getattr(self, name) is not None:
                _validate.positive_int(name, getattr(self, name))
        for name in ("lr", "momentum", "weight_decay"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) < 0:
                raise ValueError(f"{name}: expected a number >= 0, got {getattr(self, name)!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"workers: expected an integer >= 0, got {self.workers!r}")
        self.save_epochs = sorted({_validate.positive_int("save_epochs", e)
                                   for e in self.save_epochs})
        if self.out is None:
            self.out = str(Path("runs") / f"{self.model}-{self.dataset}-{self.mode}")

    def codec_params(self) -> dict:
        """The keyword settings of this mode's codec, e.g. {"block": 8, "bits": 2}."""
        return {name: getattr(self, name) for name in _CODEC_PARAMS[self.mode]}


def evaluate(model: torch.nn.Module, loader: Iterable, device: str | torch.device) -> dict:
    """Mean cross-entropy and accuracy of `model` over `loader`, without gradients.

    Args:
        model: a classifier; put in eval mode here.
        loader: iterable of (inputs, labels) batches, inputs shaped as the model expects.
        device: where to run.

    Returns:
        {"loss": float, "accuracy": float in [0, 1], "count": int}.
    """
    sums = _eval_sums(model, loader, torch.device(device))
    return _summarise(sums)


def train(config: RunConfig, *, model: torch.nn.Module | None = None) -> dict:
    """Train as `config` says, writing the run directory; see the module docstring.

    Args:
        config: the run.
        model: train this module instead of `freqact.models.get(config.model)` (tests, notebooks);
            `config.model` then only labels the run, and `checkpoint.load_model` cannot rebuild it.

    Returns:
        {"run_dir": str, "rank": int, "config": dict, "metrics": list of per-epoch dicts, "final":
        last epoch's dict, "last_checkpoint": str, "checkpoints": list of str} (also on ranks > 0,
        which write nothing).

    Raises:
        ValueError: for an unknown model, a batch size not divisible by the number of ranks, a
            model input that does not fit the data, or a resume that does not match the run.
        FileNotFoundError: if CIFAR files are missing (and not downloaded).
    """
    ctx = distributed.setup(config.device)
    try:
        return _run(config, ctx, model)
    finally:
        distributed.teardown(ctx)


def evaluate_checkpoint(path: str, *, data_dir: str | None = None, device: str | None = None,
                        batch_size: int = 512) -> dict:
    """Test loss and accuracy of a checkpoint on its run's dataset.

    Args:
        path: a checkpoint written by `train`.
        data_dir: CIFAR data directory (default: the run's, else $FREQACT_DATA, else ./data).
        device: where to evaluate (default: CUDA when available).
        batch_size: evaluation batch size.

    Returns:
        `evaluate`'s dict plus "epoch" and "checkpoint".
    """
    ctx = distributed.Context(device=distributed.pick_device(device))
    net, ckpt = checkpoint.load_model(path, ctx.device)
    cfg = ckpt["config"]
    ds = data.load_for_model(cfg["dataset"], net, data_dir or cfg["data_dir"], subset=cfg["subset"],
                             seed=cfg["seed"], device=ctx.device)
    batches = _eval_batches(ds, net, ctx, _validate.positive_int("batch_size", batch_size))
    return {**evaluate(net, batches, ctx.device), "epoch": ckpt["epoch"], "checkpoint": str(path)}


def _run(config: RunConfig, ctx: distributed.Context, model: torch.nn.Module | None) -> dict:
    """The body of `train` inside the (possibly distributed) context."""
    if config.batch_size % ctx.world_size:
        raise ValueError(f"batch_size: expected a multiple of the {ctx.world_size} ranks, "
                         f"got {config.batch_size}")
    run_dir = Path(config.out)
    last_path = run_dir / "ckpt" / "last.pt"
    if last_path.exists() and not config.resume:
        raise ValueError(f"out: {run_dir} already holds a run; pass --resume to continue it or "
                         "choose another --out")
    num_classes = 100 if config.dataset == "cifar100" else 10
    torch.manual_seed(config.seed)  # same initial weights on every rank
    net = model if model is not None else _build_model(config.model, num_classes)
    torch.manual_seed(config.seed + ctx.rank)  # then per-rank streams for dropout / codec noise
    net.to(ctx.device)
    if ctx.is_main and config.download:  # one rank downloads, the others wait and then read
        data.load_for_model(config.dataset, net, config.data_dir, download=True)
    distributed.barrier(ctx)
    ds = data.load_for_model(config.dataset, net, config.data_dir, subset=config.subset,
                             seed=config.seed, device=ctx.device)

    stored_config = {**dataclasses.asdict(config), "num_classes": num_classes,
                     "world_size": ctx.world_size}
    optimizer = torch.optim.SGD(net.parameters(), lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.epochs)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=config.amp and ctx.device.type == "cuda")
    aug_gen = torch.Generator().manual_seed(config.seed * 65536 + ctx.rank)
    metrics: list[dict] = []
    start_epoch = 0
    if config.resume and ctx.is_main:
        # A run killed while writing leaves temporary files (its last complete files are intact).
        for folder in (run_dir, run_dir / "ckpt"):
            checkpoint.remove_stale_temps(folder)
    if config.resume and last_path.exists():
        ckpt = checkpoint.load(last_path)
        _check_resumable(ckpt["config"], stored_config, last_path)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        _set_rng(ckpt["rng"], ctx, aug_gen)
        metrics, start_epoch = list(ckpt["metrics"]), ckpt["epoch"]
    if ctx.is_main:
        checkpoint.atomic_write(run_dir / "config.json",
                                json.dumps(stored_config, indent=2).encode())

    ddp = net if ctx.world_size == 1 else torch.nn.parallel.DistributedDataParallel(
        net, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    sampler = DistributedSampler(range(len(ds.train_labels)), num_replicas=ctx.world_size,
                                 rank=ctx.rank, shuffle=True, seed=config.seed)
    saved = [str(p) for p in sorted((run_dir / "ckpt").glob("epoch-*.pt"))]
    for epoch in range(start_epoch + 1, config.epochs + 1):
        sampler.set_epoch(epoch)
        row = _train_epoch(config, ctx, ddp, net, ds, list(sampler), optimizer, scaler, aug_gen,
                           epoch)
        row["lr"] = scheduler.get_last_lr()[0]
        scheduler.step()
        test = _summarise(distributed.all_reduce_sum(
            _eval_sums(net, _eval_batches(ds, net, ctx, 2 * config.batch_size), ctx.device), ctx))
        row.update(test_loss=test["loss"], test_acc=test["accuracy"])
        metrics.append({c: row.get(c) for c in METRIC_COLUMNS})
        rng = distributed.all_gather(_get_rng(ctx, aug_gen), ctx)
        if ctx.is_main:
            ckpt = {"format": checkpoint.FORMAT, "epoch": epoch, "config": stored_config,
                    "model": net.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "rng": {key: [r[key] for r in rng] for key in rng[0]}, "metrics": metrics}
            every = config.save_every
            if epoch in config.save_epochs or (every and epoch % every == 0):
                saved.append(str(run_dir / "ckpt" / f"epoch-{epoch:04d}.pt"))
                checkpoint.save(saved[-1], ckpt)
            checkpoint.save(last_path, ckpt)
            _write_metrics(run_dir, metrics)
            print(_epoch_line(metrics[-1], config.epochs), flush=True)
    return {"run_dir": str(run_dir), "rank": ctx.rank, "config": stored_config, "metrics": metrics,
            "final": metrics[-1] if metrics else {}, "last_checkpoint": str(last_path),
            "checkpoints": saved}


def _train_epoch(config, ctx, ddp, net, ds, order, optimizer, scaler, aug_gen, epoch) -> dict:
    """One pass over this rank's `order` of training indices; returns the epoch's metrics."""
    per_rank = config.batch_size // ctx.world_size
    steps = (len(order) + per_rank - 1) // per_rank
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss sum, correct, count
    amp_dtype = torch.float16 if ctx.device.type == "cuda" else torch.bfloat16
    meter = None
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    ddp.train()
    bar = tqdm(total=steps, desc=f"epoch {epoch}/{config.epochs}", leave=False,
               disable=not (ctx.is_main and sys.stderr.isatty()))
    start = time.perf_counter()
    for step in range(steps):
        idx = torch.as_tensor(order[step * per_rank:(step + 1) * per_rank], device=ctx.device)
        x = data.model_inputs(ds, ds.train_images[idx], net, aug_gen if ds.augment else None)
        y = ds.train_labels[idx]
        autocast = torch.autocast(ctx.device.type, amp_dtype, enabled=config.amp)
        with _compressing(net, config) as step_meter, autocast:
            logits = ddp(x)
            loss = F.cross_entropy(logits, y)
        if step == 0:  # a full batch (the last one may be short): what one step holds
            meter = step_meter
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        with torch.no_grad():
            sums[0] += loss.detach().double() * len(y)
            sums[1] += (logits.argmax(1) == y).sum()
            sums[2] += len(y)
        bar.update()
    bar.close()
    elapsed = time.perf_counter() - start
    summary = _summarise(distributed.all_reduce_sum(sums, ctx))
    row = {"epoch": epoch, "train_loss": summary["loss"], "train_acc": summary["accuracy"],
           "epoch_time_s": elapsed, "images_per_s": summary["count"] / elapsed}
    if meter is not None:  # the first step's meter: what one full step holds for backward
        row.update(saved_bytes=meter.saved_bytes, exact_bytes=meter.exact_bytes,
                   compression_ratio=meter.ratio)
    if ctx.device.type == "cuda":
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    return row


def _compressing(net: torch.nn.Module, config: RunConfig):
    """The context the training forward runs in: none for `normal`, else the mode's codec."""
    if config.mode == "normal":
        return contextlib.nullcontext()
    return engine.compress(net, config.mode, **config.codec_params())


def _build_model(name: str, num_classes: int) -> torch.nn.Module:
    """`freqact.models.get` after checking the name, so a typo lists the known models."""
    _validate.choice("model", name, tuple(models.names()))
    return models.get(name, num_classes=num_classes)


def _eval_batches(ds: data.Dataset, net, ctx: distributed.Context, batch: int) -> Iterator:
    """This rank's share (every world_size-th image) of the whole test set, in batches."""
    idx = torch.arange(ctx.rank, len(ds.test_labels), ctx.world_size, device=ctx.device)
    for chunk in idx.split(batch):
        yield (data.model_inputs(ds, ds.test_images[chunk], net),
               ds.test_labels[chunk])


def _eval_sums(model: torch.nn.Module, loader: Iterable, device: torch.device) -> torch.Tensor:
    """float64 tensor [loss sum, correct, count] over `loader`, under no_grad in eval mode."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in loader:
            logits = model(x.to(device))
            y = y.to(device)
            sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(1) == y).sum()
            sums[2] += len(y)
    return sums


def _summarise(sums: torch.Tensor) -> dict:
    """[loss sum, correct, count] -> {"loss", "accuracy", "count"} (NaN means for count 0)."""
    loss_sum, correct, count = sums.tolist()
    return {"loss": loss_sum / count if count else float("nan"),
            "accuracy": correct / count if count else float("nan"), "count": int(count)}


def _get_rng(ctx: distributed.Context, aug_gen: torch.Generator) -> dict:
    """This rank's RNG states as tensors (weights_only checkpoints can hold them)."""
    rng = {"torch": torch.get_rng_state(), "augment": aug_gen.get_state()}
    if ctx.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(ctx.device)
    return rng


def _set_rng(rng: dict, ctx: distributed.Context, aug_gen: torch.Generator) -> None:
    """Restore this rank's entries of a checkpoint's per-rank RNG states."""
    torch.set_rng_state(rng["torch"][ctx.rank])
    aug_gen.set_state(rng["augment"][ctx.rank])
    if ctx.device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"][ctx.rank], ctx.device)


def _check_resumable(saved: dict, current: dict, path: Path) -> None:
    """Refuse to resume when a setting that shapes the run differs from the checkpoint's."""
    diffs = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in current.items()
             if k not in RESUMABLE_CHANGES and saved.get(k) != v]
    if diffs:
        raise ValueError(f"resume: {path} was trained with other settings ({'; '.join(diffs)})")


def _write_metrics(run_dir: Path, metrics: list[dict]) -> None:
    """Rewrite metrics.csv and .jsonl from the whole list (so a resumed run stays consistent)."""
    table = io.StringIO()
    writer = csv.DictWriter(table, fieldnames=METRIC_COLUMNS)
    writer.writeheader()
    writer.writerows(metrics)
    checkpoint.atomic_write(run_dir / "metrics.csv", table.getvalue().encode())
    lines = "".join(json.dumps(row) + "\n" for row in metrics)
    checkpoint.atomic_write(run_dir / "metrics.jsonl", lines.encode())


def read_config(run_dir: str | os.PathLike) -> dict:
    """The stored settings of a run (`RUN/config.json`), as written by `train`.

    Raises:
        FileNotFoundError: if run_dir holds no config.json (it is not a run directory).
        ValueError: if the file is not valid JSON (the message names it).
    """
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json)")
    return _read_json(path)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The per-epoch rows of a run (`RUN/metrics.jsonl`), values as written (None where a mode
    has no value); metrics.csv holds the same rows for spreadsheets.

    Raises:
        FileNotFoundError: if the run has no metrics.jsonl (it has not finished an epoch).
        ValueError: if the file is not valid JSON lines (the message names it).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl (no finished epoch)")
    return _read_json(path, lines=True)


def _read_json(path: Path, *, lines: bool = False):
    """The JSON value of a run file, or with `lines` the list of its JSON lines.

    Data only: the file is never evaluated or unpickled. Errors name the file.
    """
    try:
        text = path.read_text(encoding="utf-8")
        if lines:
            return [json.loads(line) for line in text.splitlines() if line]
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); delete or repair the file") from None


def _epoch_line(row: dict, epochs: int) -> str:
    """One plain progress line per epoch."""
    line = (f"epoch {row['epoch']}/{epochs}  train loss {row['train_loss']:.4f} acc "
            f"{row['train_acc']:.4f}  test loss {row['test_loss']:.4f} acc {row['test_acc']:.4f}  "
            f"{row['images_per_s']:.0f} img/s")
    if row.get("compression_ratio") is not None:
        line += f"  saved {row['saved_bytes'] / 2**20:.2f} MiB ({row['compression_ratio']:.1f}x)"
    return line
