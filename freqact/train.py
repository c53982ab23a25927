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
Without resume, an `out` that holds a run (checkpoints, or config.json alone: a run stopped in its
first epoch, or another tool's file) is refused; with resume and no checkpoint, its config.json
must match the run's settings, as a checkpoint's must, so another run's files are never overwritten.

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
from collections.abc import Iterator

import torch
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

from freqact import _validate, checkpoint, codecs, data, distributed, engine, evaluation, models, rundir
from freqact.analysis import common as analysis_common

# Re-exported: `train.RunConfig`, `train.evaluate` etc. stay where callers have always found them.
from freqact.evaluation import cross_entropy, evaluate, evaluate_checkpoint  # noqa: F401
from freqact.runconfig import MODES, NORMAL_TITLE, OPTIMIZERS, SEED, SELECTORS, RunConfig, mode_settings, mode_title  # noqa: F401

# Re-exported: the run directory owns them (`freqact.rundir`).
RESUMABLE_CHANGES = rundir.RESUMABLE_CHANGES
METRIC_COLUMNS = rundir.METRIC_COLUMNS


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
        result = _run(config, ctx, model)
        # Every rank done before any leaves the group: a rank that writes nothing finished first
        # and tore gloo down under rank 0's last exchange (one SIGABRT at exit in a CI run).
        distributed.barrier(ctx)
        return result
    finally:
        distributed.teardown(ctx)



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
    selectors: dict  # include/exclude resolved against net, as `engine.compress` takes them
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
        # config.json alone: a run stopped in its first epoch, or another tool's file (not overwritten)
        if not config.resume and (run.last.is_file() or run.epoch_checkpoints() or run.config_path.is_file()):
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
    selectors = config.selectors(net)  # a bad --include/--exclude fails before data are loaded
    if ctx.is_main and config.download:  # one rank downloads, the others wait and then read
        data.load_for_model(config.dataset, net, config.data_dir, download=True)
    distributed.barrier(ctx)
    ds = data.load_for_model(config.dataset, net, config.data_dir, subset=config.subset,
                             seed=config.seed, device=ctx.device)
    windows = _layer_windows(net, config, selectors, data.model_inputs(ds, ds.train_images[:2], net))
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
         "kernels": config.kernels(ctx.device), **({"layer_windows": windows} if windows else {})},
        selectors, saved=[str(p) for p in run.epoch_checkpoints()])


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
        if run.config_path.is_file():  # a run stopped in its first epoch: the same one, not another's
            rundir.check_resumable(run.read_config(), state.stored_config, run.config_path)
        say(f"{run}: no checkpoint to resume from; starting fresh at epoch 1", flush=True)
        return
    rundir.check_resumable(ckpt["config"], state.stored_config, path)
    try:  # the entries are there (`rundir.check_resume_state`); their contents come from a file
        distributed.load_full_state(state.net, state.optimizer, ckpt["model"], ckpt["optimizer"], ctx,
                                    state.config.fsdp)
        state.scheduler.load_state_dict(ckpt["scheduler"])
        state.scaler.load_state_dict(ckpt["scaler"])
        _set_rng(ckpt["rng"], ctx, state.aug_gen)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"resume: {path}: its saved state does not fit this run "
                         f"({type(err).__name__}: {first}); delete it or choose another --out") from None
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
                       state.optimizer, state.scaler, state.aug_gen, epoch, state.selectors)
    row["lr"] = state.scheduler.get_last_lr()[0]
    state.scheduler.step()
    test = evaluation.summarise(distributed.all_reduce_sum(
        evaluation.eval_sums(state.net, evaluation.eval_batches(state.ds, state.net, ctx, 2 * config.batch_size,
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


def _train_epoch(config, ctx, ddp, net, ds, order, optimizer, scaler, aug_gen, epoch,
                 selectors) -> dict:
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
        with _compressing(net, config, selectors) as step_meter, autocast:
            logits = ddp(x)
            loss = evaluation.cross_entropy(logits, y)
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
    summary = evaluation.summarise(distributed.all_reduce_sum(sums, ctx))
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


def _compressing(net: torch.nn.Module, config: RunConfig, selectors: dict):
    """The context the training forward runs in: none for `normal`, else the mode's codec on
    the modules `selectors` (include/exclude) leave in."""
    if config.mode == "normal":
        return contextlib.nullcontext()
    return engine.compress(net, config.mode, **selectors, **config.codec_params())


def _layer_windows(net: torch.nn.Module, config: RunConfig, selectors: dict,
                   x: torch.Tensor) -> list[dict] | None:
    """The windows W a spectral mode keeps for each module input it compresses (config.json's
    "layer_windows"); None for the other modes.

    One eval-mode forward of `x` (two training inputs) under the run's `compress` block, RNG
    and BatchNorm statistics restored: the meter says which modules' inputs went through the
    codec (include/exclude and declined (N, F) inputs included), a pre-hook their shapes.

    Returns:
        [{"layer", "type", "shape" (the input's, batch dim first), "windows": [W_d per map dim]}]
        in call order.
    """
    if config.mode == "normal":
        return None
    codec = codecs.get(config.mode, **config.codec_params())
    if not callable(getattr(codec, "windows", None)):  # only the spectral codecs keep windows
        return None
    shapes: dict[str, list[int]] = {}

    def hook_for(name: str):
        def hook(module, args):
            if args and isinstance(args[0], torch.Tensor):
                shapes.setdefault(name, list(args[0].shape))
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in net.named_modules()]
    try:
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), \
                analysis_common.scratch_state(net, train=False), \
                engine.compress(net, codec, **selectors) as meter:
            net(x)
    finally:
        for handle in handles:
            handle.remove()
    return [{"layer": row.layer, "type": row.type, "shape": shapes[row.layer],
             "windows": list(codec.windows(shapes[row.layer]))}
            for row in meter.per_layer() if codec.name in row.routes and row.layer in shapes]



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
