"""One training loop for every mode: `RunConfig` in, a run directory and a results dict out.

    config = RunConfig(model="resnet20", dataset="cifar10", mode="division", block=8, bits=2)
    results = train(config)          # writes config.json, metrics.csv/.jsonl, ckpt/*.pt

Modes: `normal` is plain PyTorch (no hooks). Every other mode names a codec (`freqact.codecs.modes()`);
the forward pass of each training step runs inside `freqact.engine.compress(model, mode, **codec
params)`, so the activations cached for backward are stored compressed and rebuilt during backward.
The codec settings are the codec's own declarations (`Codec.settings`); config.json records those
the mode uses and, as "kernels", the kernel backend the codec resolved to on the run's device.
Evaluation is a plain forward under `torch.no_grad()`.

Recipe (defaults, the paper's CIFAR setting): SGD with momentum 0.9, weight decay 5e-4, lr 0.1,
cosine schedule over the epochs (stepped once per epoch), batch 256, CIFAR augmentation (random
crop of the 4-pixel padded image + horizontal flip). `optimizer="adamw"` (what transformers train
with) takes `torch.optim.AdamW` instead: the same lr and cosine schedule, betas (0.9, 0.999),
`weight_decay` decoupled (each step multiplies the weights by 1 - lr * weight_decay; typical 0.05),
`momentum` unused. `model_options` are the model's own settings (`freqact.models.get` keywords,
e.g. {"dim": 64, "depth": 2}), so a run can train a smaller member of a family.

Loss: cross-entropy of `logits.flatten(0, -2)` against `labels.flatten()`, the same rule for
classifiers (logits (N, K), labels (N,)) and the language model on `stdlib-text` (logits (N, T, V),
labels (N, T): next-byte loss in nats per byte); accuracy and the `images_per_s` column then count
tokens (next-byte accuracy, tokens per second).

Data: whole datasets are moved to the device once as uint8 tensors; each epoch's order comes
from a `DistributedSampler` seeded with (seed, epoch) (also with one process; under torchrun it
pads the order by repeating a few indices so every rank gets as many), batches are gathered by
index on the device and augmented/normalised there; the last, smaller batch is kept (there is no loader
to parallelise, hence no `workers` setting; `freqact train --workers` is accepted and ignored). Progress
within an epoch: a tqdm bar on a terminal, else a line every ~10 % of the epoch (or `log_every`
steps).

Determinism and resume: every epoch ends with `ckpt/last.pt` holding model, optimizer, scheduler,
GradScaler, the torch (and CUDA) RNG states and the augmentation generator of every rank, and the
metrics so far. Resuming restores all of them, so on the CPU with a fixed seed the resumed run's
metrics equal an uninterrupted run's, except the timing columns (epoch_time_s, images_per_s). On
CUDA, nondeterministic kernels (cuDNN autotuning, atomics in backward) make runs differ in the last
bits with or without a resume. A resume needs the same number of ranks (the RNG states are per
rank) and the same training settings; only device, out, data_dir, download, log_every and
the checkpoint cadence may change. Without `ckpt/last.pt` a resume continues from the newest
loadable `ckpt/epoch-XXXX.pt` (and says so); it always prints the epoch it continues after.

One writer per run directory: rank 0 holds `RunDir.lock()` for the whole run, so a second `train`
with the same `out` is refused (`rundir.RunDirBusy`). SIGINT and SIGTERM raise `Interrupted`
(after the epoch's files are written if they arrive during the writing), so every checkpoint on
disk stays whole; `freqact train` turns it into one line and exit code 130 / 143.

Under `torchrun` (see `freqact.distributed`) each rank trains on its shard of every epoch with a
per-rank batch of batch_size / world_size, compresses its own activations, and the model is
wrapped in DistributedDataParallel; losses and accuracies are summed over ranks, the meter's bytes
are rank 0's (the memory one device holds), and only rank 0 prints and writes files. BatchNorm
statistics are per rank, as usual with DDP. With `fsdp` the model is sharded with FSDP2 instead
(`fully_shard` on each `models.BLOCK_TYPES` block, then the root; `distributed.wrap`): each rank
holds a shard of the weights and optimizer state, the engine treats the gathered weights as
parameters, and checkpoints hold the whole model state dict gathered on rank 0 (so `freqact
eval` and the analyses read them as any other) and the optimizer state keyed by parameter name.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from freqact import _validate, checkpoint, codecs, data, distributed, engine, models, rundir
from freqact.codecs.settings import Setting
from freqact.errors import UsageError

NORMAL_TITLE = "normal training (plain PyTorch)"
MODES = ("normal", *codecs.modes())
"""Training modes: `normal` (no hooks) and the codecs a whole model trains with."""
# Re-exported: the run directory owns them (`freqact.rundir`).
RESUMABLE_CHANGES = rundir.RESUMABLE_CHANGES
METRIC_COLUMNS = rundir.METRIC_COLUMNS
# The SGD recipe's numbers: finite and in a range that can train (NaN or 1e30 would train to NaN).
_HYPER = (
    Setting("lr", float, 0.1, "initial learning rate", low=0.0, high=10.0),
    Setting("momentum", float, 0.9, "SGD momentum", low=0.0, high=1.0),
    Setting("weight_decay", float, 5e-4, "SGD weight decay", low=0.0, high=1.0),
)
OPTIMIZERS = ("sgd", "adamw")
# Seeds reach torch.manual_seed as seed and seed * 65536 + rank: keep both inside 64 bits.
SEED = Setting("seed", int, 0, "random seed", low=0, high=2**32 - 1)


def mode_title(mode: str) -> str:
    """What a training mode does, in words ("LFC-ACT (only the DCT low band cached)")."""
    _validate.choice("mode", mode, MODES)
    return NORMAL_TITLE if mode == "normal" else codecs.codec_class(mode).title


def mode_settings(mode: str) -> tuple[Setting, ...]:
    """The codec settings `mode` takes (none for `normal`)."""
    _validate.choice("mode", mode, MODES)
    return () if mode == "normal" else codecs.codec_class(mode).settings


@dataclasses.dataclass
class _Identity:
    model: str = "resnet20"
    dataset: str = "cifar10"
    mode: str = "normal"


# One field per setting of the training modes' codecs, declared by the codecs themselves.
_WithCodecSettings = dataclasses.make_dataclass(
    "_WithCodecSettings",
    [(s.name, s.type, dataclasses.field(default=s.default)) for s in codecs.mode_settings()],
    bases=(_Identity,))


@dataclasses.dataclass
class RunConfig(_WithCodecSettings):
    """Everything that defines a training run; plain JSON types only (it goes into checkpoints).

    Attributes:
        model: a `freqact.models` name.
        dataset: one of `freqact.data.DATASETS`.
        mode: one of `MODES`.
        codec settings: one field per setting that a training mode's codec declares
            (`freqact.codecs.mode_settings()`, e.g. ratio, block, bits, backend), with the
            declared default and range. Each mode uses its own codec's settings (`codec_params`);
            the others are checked but not used, and `to_dict` leaves them out.
        epochs, batch_size, lr, momentum, weight_decay: the SGD + cosine recipe; batch_size is
            global (split over the ranks under torchrun); lr in [0, 10], momentum and
            weight_decay in [0, 1], all finite.
        optimizer: "sgd" (default) or "adamw" (momentum unused; see the module docstring).
        model_options: keyword settings of the model's builder (plain JSON: numbers, strings,
            lists for tuples), e.g. {"dim": 64}; {} for the family's defaults.
        subset: train on the first `subset` training images only (the test set is always whole);
            for synthetic, the number of training images drawn.
        seed: seeds the model initialisation, data order, augmentation and codec noise; an
            integer in [0, 2**32 - 1].
        amp: autocast (bfloat16 on CPU; float16 with a GradScaler on CUDA).
        device: "cpu", "cuda", "cuda:N" or None for CUDA when available.
        data_dir: CIFAR data directory (else $FREQACT_DATA, else ./data).
        download: download CIFAR when missing.
        out: run directory; None means runs/<model>-<dataset>-<mode>.
        save_epochs: epochs after which `ckpt/epoch-XXXX.pt` is kept.
        save_every: also keep every K-th epoch's checkpoint (None: only `save_epochs`).
        resume: continue the run in `out` from `ckpt/last.pt`, else from its newest loadable
            `ckpt/epoch-XXXX.pt` (start it if there is none yet, so a preemptible job can always
            be relaunched with the same command).
        log_every: print a progress line every N training steps; None: every ~10 % of an epoch
            when stdout is not a terminal (a terminal gets a progress bar instead).
        fsdp: under torchrun, shard the model with FSDP2 instead of wrapping it in DDP (one
            process: no effect).
    """

    epochs: int = 100  # the original code's CIFAR runs (94.89 % normal, 94.72 % DIVISION)
    batch_size: int = 256
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    optimizer: str = "sgd"
    model_options: dict = dataclasses.field(default_factory=dict)
    subset: int | None = None
    seed: int = 0
    amp: bool = False
    device: str | None = None
    data_dir: str | None = None
    download: bool = False
    out: str | None = None
    save_epochs: list[int] = dataclasses.field(default_factory=lambda: [20, 40, 60])
    save_every: int | None = None
    resume: bool = False
    log_every: int | None = None
    fsdp: bool = False

    def __post_init__(self) -> None:
        _validate.choice("dataset", self.dataset, data.DATASETS)
        _validate.choice("mode", self.mode, MODES)
        _validate.choice("optimizer", self.optimizer, OPTIMIZERS)
        if not isinstance(self.model_options, dict):
            raise UsageError(f"model_options: expected a dict of model settings, got "
                             f"{self.model_options!r}")
        for setting in (*codecs.mode_settings(), *_HYPER, SEED):
            setattr(self, setting.name, setting.check(getattr(self, setting.name)))
        for name in ("epochs", "batch_size"):
            _validate.positive_int(name, getattr(self, name))
        for name in ("subset", "save_every", "log_every"):
            if getattr(self, name) is not None:
                _validate.positive_int(name, getattr(self, name))
        self.save_epochs = sorted({_validate.positive_int("save_epochs", e)
                                   for e in self.save_epochs})
        if self.out is None:
            self.out = str(Path("runs") / f"{self.model}-{self.dataset}-{self.mode}")

    @classmethod
    def from_dict(cls, stored: dict) -> RunConfig:
        """The config of a stored run (`config.json` or a checkpoint's "config"), old or new.

        Keys that are not fields (num_classes, world_size, kernels, the removed `workers`) are
        ignored, and settings a stored config leaves out (a mode's unused codec settings, or
        `backend` before it existed) take their defaults, so every config.json freqact wrote still loads.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in fields})

    def codec_params(self) -> dict:
        """The keyword settings of this mode's codec, e.g. {"block": 8, "bits": 2, "backend":
        "auto"} (empty for `normal`)."""
        return {s.name: getattr(self, s.name) for s in mode_settings(self.mode)}

    def label_params(self) -> dict:
        """The codec settings that name a run in labels and tables, e.g. {"block": 8, "bits": 2}
        (those with a `symbol`; the kernel backend is not one)."""
        return {s.name: getattr(self, s.name) for s in mode_settings(self.mode) if s.symbol}

    def to_dict(self) -> dict:
        """The plain-JSON form written to config.json and checkpoints: every field except the
        codec settings this mode does not use (a division run records no "ratio")."""
        unused = {s.name for s in codecs.mode_settings()} - set(self.codec_params())
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in unused}

    def kernels(self, device: str | torch.device) -> str | None:
        """The kernel backend this run's codec resolves to on `device` ("torch", "cpu" or
        "triton"; None for modes without kernels); recorded as "kernels" in config.json, so runs
        with and without a C compiler (same seed, other noise stream) can be told apart."""
        if self.mode == "normal":
            return None
        return codecs.get(self.mode, **self.codec_params()).backend_used(device)


def evaluate(model: torch.nn.Module, loader: Iterable, device: str | torch.device) -> dict:
    """Mean cross-entropy and accuracy of `model` over `loader`, without gradients.

    Args:
        model: a classifier (logits (N, K)) or a language model (logits (N, T, V)); put in
            eval mode here.
        loader: iterable of (inputs, labels) batches, inputs shaped as the model expects, labels
            (N,) or (N, T).
        device: where to run.

    Returns:
        {"loss": float, "accuracy": float in [0, 1], "count": int}, over every target (every
        token for a language model: loss in nats per token).
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


@dataclasses.dataclass
class _Trainer:
    """Everything one training run holds while its epochs run (built by `_setup`)."""

    config: RunConfig
    ctx: distributed.Context
    run: rundir.RunDir
    net: torch.nn.Module
    ddp: torch.nn.Module
    ds: data.Dataset
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    aug_gen: torch.Generator
    sampler: DistributedSampler
    stored_config: dict
    metrics: list = dataclasses.field(default_factory=list)
    start_epoch: int = 0
    saved: list = dataclasses.field(default_factory=list)


def _run(config: RunConfig, ctx: distributed.Context, model: torch.nn.Module | None) -> dict:
    """The body of `train` inside the (possibly distributed) context: lock, setup, resume, epochs."""
    if config.batch_size % ctx.world_size:
        raise ValueError(f"batch_size: expected a multiple of the {ctx.world_size} ranks, "
                         f"got {config.batch_size}")
    if model is None:  # a typo lists the known models, before the run directory is created
        _validate.choice("model", config.model, tuple(models.names()))
    run = rundir.RunDir(config.out)
    with _writer_lock(run, ctx), _Interrupts() as interrupts:
        if not config.resume and (run.last.is_file() or run.epoch_checkpoints()):
            raise ValueError(f"out: {run} already holds a run; pass --resume to continue it or "
                             "choose another --out")
        state = _setup(config, ctx, model, run)
        if config.resume:
            _resume(state)
        interrupts.epoch = state.start_epoch
        if ctx.is_main:
            run.write_config(state.stored_config)
        for epoch in range(state.start_epoch + 1, config.epochs + 1):
            row = _epoch(state, epoch)
            with interrupts.deferred():  # a signal waits until the epoch's files are whole
                _save(state, epoch, row)
                interrupts.epoch = epoch
    metrics = state.metrics
    return {"run_dir": str(run), "rank": ctx.rank, "config": state.stored_config,
            "metrics": metrics, "final": metrics[-1] if metrics else {},
            "last_checkpoint": str(run.last), "checkpoints": state.saved}


def _setup(config: RunConfig, ctx: distributed.Context, model: torch.nn.Module | None,
           run: rundir.RunDir) -> _Trainer:
    """Model, data, optimizer, schedule, scaler and sampler of a fresh run."""
    num_classes = data.num_classes(config.dataset)
    torch.manual_seed(config.seed)  # same initial weights on every rank
    net = model if model is not None else checkpoint.build_model(
        config.model, num_classes, config.model_options)
    torch.manual_seed(config.seed + ctx.rank)  # then per-rank streams for dropout / codec noise
    net.to(ctx.device)
    if ctx.is_main and config.download:  # one rank downloads, the others wait and then read
        data.load_for_model(config.dataset, net, config.data_dir, download=True)
    distributed.barrier(ctx)
    ds = data.load_for_model(config.dataset, net, config.data_dir, subset=config.subset,
                             seed=config.seed, device=ctx.device)
    ddp = distributed.wrap(net, ctx, fsdp=config.fsdp, blocks=models.BLOCK_TYPES)
    # after wrap: FSDP2 replaces the parameters by their shards
    optimizer = _optimizer(net, config)
    return _Trainer(
        config, ctx, run, net, ddp, ds, optimizer,
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.epochs),
        torch.amp.GradScaler(ctx.device.type, enabled=config.amp and ctx.device.type == "cuda"),
        torch.Generator().manual_seed(config.seed * 65536 + ctx.rank),
        DistributedSampler(range(len(ds.train_labels)), num_replicas=ctx.world_size,
                           rank=ctx.rank, shuffle=True, seed=config.seed),
        {**config.to_dict(), "num_classes": num_classes, "world_size": ctx.world_size,
         "kernels": config.kernels(ctx.device)},
        saved=[str(p) for p in run.epoch_checkpoints()])


def _optimizer(net: torch.nn.Module, config: RunConfig) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW (decoupled weight decay), as `config.optimizer` says."""
    if config.optimizer == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=config.lr,
                                 weight_decay=config.weight_decay)
    return torch.optim.SGD(net.parameters(), lr=config.lr, momentum=config.momentum,
                           weight_decay=config.weight_decay)


def _resume(state: _Trainer) -> None:
    """Restore the newest checkpoint of the run (last.pt, else the newest loadable epoch file)."""
    run, ctx = state.run, state.ctx
    if ctx.is_main:  # a run killed while writing leaves temporary files; we hold the lock
        run.remove_stale_temps()
    distributed.barrier(ctx)
    path, ckpt, notes = run.resume_checkpoint()
    say = print if ctx.is_main else (lambda *a, **k: None)
    for note in notes:
        say(f"resume: skipping {note}", flush=True)
    if ckpt is None:
        say(f"resume: {run} has no checkpoint yet; starting at epoch 1", flush=True)
        return
    # runs written before the fsdp setting existed were not sharded
    rundir.check_resumable({"fsdp": False, **ckpt["config"]}, state.stored_config, path)
    distributed.load_full_state(state.net, state.optimizer, ckpt["model"], ckpt["optimizer"], ctx,
                                state.config.fsdp)
    state.scheduler.load_state_dict(ckpt["scheduler"])
    state.scaler.load_state_dict(ckpt["scaler"])
    _set_rng(ckpt["rng"], ctx, state.aug_gen)
    state.metrics, state.start_epoch = list(ckpt["metrics"]), ckpt["epoch"]
    missing = "" if path == run.last else f" ({run.last.name} is missing)"
    left = (f"epochs {state.start_epoch + 1}-{state.config.epochs} to go"
            if state.start_epoch < state.config.epochs else "nothing left to train")
    say(f"resume: continuing {run} after epoch {state.start_epoch} from {path.name}{missing}; "
        f"{left}", flush=True)


def _epoch(state: _Trainer, epoch: int) -> dict:
    """Train and evaluate one epoch; returns its metrics row (METRIC_COLUMNS)."""
    config, ctx = state.config, state.ctx
    state.sampler.set_epoch(epoch)
    row = _train_epoch(config, ctx, state.ddp, state.net, state.ds, list(state.sampler),
                       state.optimizer, state.scaler, state.aug_gen, epoch)
    row["lr"] = state.scheduler.get_last_lr()[0]
    state.scheduler.step()
    test = _summarise(distributed.all_reduce_sum(
        _eval_sums(state.net, _eval_batches(state.ds, state.net, ctx, 2 * config.batch_size,
                                            even=config.fsdp), ctx.device), ctx))
    row.update(test_loss=test["loss"], test_acc=test["accuracy"])
    return {c: row.get(c) for c in METRIC_COLUMNS}


def _save(state: _Trainer, epoch: int, row: dict) -> None:
    """Append the row; rank 0 writes the epoch's checkpoints and metrics and prints its line."""
    config, ctx, run = state.config, state.ctx, state.run
    state.metrics.append(row)
    rng = distributed.all_gather(_get_rng(ctx, state.aug_gen), ctx)
    model, optim = distributed.full_state(state.net, state.optimizer, ctx, config.fsdp)
    if not ctx.is_main:
        return
    ckpt = {"format": checkpoint.FORMAT, "epoch": epoch, "config": state.stored_config,
            "model": model, "optimizer": optim,
            "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(),
            "rng": {key: [r[key] for r in rng] for key in rng[0]}, "metrics": state.metrics}
    every = config.save_every
    if epoch in config.save_epochs or (every and epoch % every == 0):
        path = str(run.epoch_path(epoch))
        checkpoint.save(path, ckpt)
        if path not in state.saved:
            state.saved.append(path)
    checkpoint.save(run.last, ckpt)
    run.write_metrics(state.metrics)
    print(_epoch_line(row, config.epochs), flush=True)


@contextlib.contextmanager
def _writer_lock(run: rundir.RunDir, ctx: distributed.Context) -> Iterator[None]:
    """Rank 0 holds the run directory's lock for the run; every rank learns if it got it."""
    with contextlib.ExitStack() as stack:
        error = None
        if ctx.is_main:
            try:
                stack.enter_context(run.lock())
            except rundir.RunDirBusy as err:
                error = str(err)
        error = distributed.all_gather(error, ctx)[0]
        if error is not None:
            raise rundir.RunDirBusy(error)
        yield


class Interrupted(KeyboardInterrupt):
    """Training stopped by SIGINT (Ctrl-C) or SIGTERM; the checkpoints on disk are whole.

    Attributes:
        signum: the signal.
        epoch: the last epoch whose checkpoint was written (0: none).
        exit_code: 128 + signum, the shell's convention (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int, epoch: int) -> None:
        super().__init__(f"interrupted after epoch {epoch}; rerun with --resume")
        self.signum, self.epoch, self.exit_code = signum, epoch, 128 + signum


class _Interrupts:
    """SIGINT/SIGTERM raise `Interrupted` while training (handlers restored on exit).

    Inside `deferred()` (while an epoch's files are written) a signal is held until the block
    ends, so a checkpoint and its metrics are never cut apart. Handlers can only be installed in
    the main thread; elsewhere signals keep Python's defaults.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self._old: dict = {}
        self._deferring = False
        self._pending: int | None = None

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame) -> None:
        if self._deferring:
            self._pending = signum
            return
        raise Interrupted(signum, self.epoch)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None:
            raise Interrupted(self._pending, self.epoch)


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
    progress = _Progress(config, ctx, epoch, steps)
    start = time.perf_counter()
    for step in range(steps):
        idx = torch.as_tensor(order[step * per_rank:(step + 1) * per_rank], device=ctx.device)
        x = data.model_inputs(ds, ds.train_images[idx], net, aug_gen if ds.augment else None)
        y = ds.train_labels[idx]
        autocast = torch.autocast(ctx.device.type, amp_dtype, enabled=config.amp)
        with _compressing(net, config) as step_meter, autocast:
            logits = ddp(x)
            loss = cross_entropy(logits, y)
        if step == 0:  # a full batch (the last one may be short): what one step holds
            meter = step_meter
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        with torch.no_grad():
            sums[0] += loss.detach().double() * y.numel()
            sums[1] += (logits.argmax(-1) == y).sum()
            sums[2] += y.numel()
        progress.step(step + 1, sums, start)
    progress.close()
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


class _Progress:
    """Progress within an epoch: a tqdm bar on a terminal, else a plain line every few steps.

    Lines (rank 0 only) come every `config.log_every` steps, or every ~10 % of the epoch when
    stdout is not a terminal (a log file, a batch job); an explicit `log_every` prints lines on a
    terminal too, instead of the bar. Lines start with two spaces, so "epoch ..." lines stay the
    per-epoch summaries.
    """

    def __init__(self, config: RunConfig, ctx: distributed.Context, epoch: int,
                 steps: int) -> None:
        self.epoch, self.epochs, self.steps = epoch, config.epochs, steps
        self.every = config.log_every or max(1, math.ceil(steps / 10))
        self.lines = ctx.is_main and (config.log_every is not None or not sys.stdout.isatty())
        self.bar = tqdm(total=steps, desc=f"epoch {epoch}/{config.epochs}", leave=False,
                        disable=self.lines or not (ctx.is_main and sys.stderr.isatty()))

    def step(self, done: int, sums: torch.Tensor, start: float) -> None:
        """After `done` steps; `sums` = [loss sum, correct, count] so far on this rank."""
        self.bar.update()
        if self.lines and done % self.every == 0 and done < self.steps:
            loss_sum, _, count = sums.tolist()
            rate = count / max(time.perf_counter() - start, 1e-9)
            print(f"  epoch {self.epoch}/{self.epochs} step {done}/{self.steps}  "
                  f"train loss {loss_sum / count:.4f}  {rate:.0f} img/s", flush=True)

    def close(self) -> None:
        self.bar.close()


def _compressing(net: torch.nn.Module, config: RunConfig):
    """The context the training forward runs in: none for `normal`, else the mode's codec."""
    if config.mode == "normal":
        return contextlib.nullcontext()
    return engine.compress(net, config.mode, **config.codec_params())


def _eval_batches(ds: data.Dataset, net, ctx: distributed.Context, batch: int, *,
                  even: bool = False) -> Iterator:
    """This rank's share (every world_size-th image) of the whole test set, in batches.

    even: every rank gets as many batches, as FSDP2 needs (each forward gathers weights from all
    ranks): the share is cut into the largest rank's number of batches (none empty for batch >= 2,
    since shares differ by at most one image; some models cannot run an empty batch).
    """
    idx = torch.arange(ctx.rank, len(ds.test_labels), ctx.world_size, device=ctx.device)
    most = math.ceil(math.ceil(len(ds.test_labels) / ctx.world_size) / batch)
    for chunk in idx.tensor_split(most) if even else idx.split(batch):
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
            sums[0] += cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(-1) == y).sum()
            sums[2] += y.numel()
    return sums


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits (..., K) against int64 targets (...): a classifier's (N, K)/(N,)
    or a language model's next-token loss (N, T, V)/(N, T), averaged (or summed) over targets."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


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


def read_config(run_dir: str | os.PathLike) -> dict:
    """The stored settings of a run (`RUN/config.json`): `rundir.RunDir(run_dir).read_config()`."""
    return rundir.RunDir(run_dir).read_config()


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The per-epoch rows of a run (`RUN/metrics.jsonl`): `rundir.RunDir(run_dir).read_metrics()`."""
    return rundir.RunDir(run_dir).read_metrics()


def _epoch_line(row: dict, epochs: int) -> str:
    """One plain progress line per epoch."""
    line = (f"epoch {row['epoch']}/{epochs}  train loss {row['train_loss']:.4f} acc "
            f"{row['train_acc']:.4f}  test loss {row['test_loss']:.4f} acc {row['test_acc']:.4f}  "
            f"{row['images_per_s']:.0f} img/s")
    if row.get("compression_ratio") is not None:
        line += f"  saved {row['saved_bytes'] / 2**20:.2f} MiB ({row['compression_ratio']:.1f}x)"
    return line
