"""`freqact demo`: the whole study at CPU scale, end to end, in a few minutes.

    report = run("demo")        # writes demo/report.md, demo/figures/*, demo/runs/<mode>/

1. data: CIFAR-10 from the data directory (`--data-dir`, else $FREQACT_DATA, else ./data); else
   the official download, when asked to (`download=True`) or when a short connectivity check
   succeeds; else scikit-learn's bundled digits, announced in one line.
2.-5. a small ResNet-20 trained briefly in each of `MODES` (normal, LFC-ACT, HFC-ACT, DIVISION),
   a checkpoint after every epoch, into OUT/runs/<mode>.
6. `freqact.figures.make_all` on those runs (λ across checkpoints, Theorem 3.1, pooling vs DCT,
   memory per layer): tables and figures in OUT/figures.
7. OUT/report.md: what was run, the tables, and links to the figures.

The plan (`PLAN`, `QUICK_PLAN`) is sized for 2 CPU cores: ResNet-20 trains at roughly 100-200
images/s there in normal mode and 2-3.5x slower with a codec (LFC-ACT, HFC-ACT, DIVISION encode
and decode every cached map), so 1280 images x 3 epochs x 4 modes plus the analyses stay under 10
minutes. Batch 64 rather than 128 gives twice the SGD steps for the same compute. Each epoch also
evaluates the whole test set (1000 images in the shared copy, 10000 in the official one, which adds
about 2-3 minutes); `quick` is a seconds-long smoke run for tests.
"""
from __future__ import annotations

import datetime
import os
import shlex
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from freqact import _validate, checkpoint, data, distributed, figures, rundir, train
from freqact.analysis import lambdas, pipelines, theorem31

MODES = ("normal", "lfc", "hfc", "division")
# Host of the official CIFAR archive (see freqact.data): the connectivity check only opens a TCP
# connection to it.
CIFAR_HOST = ("www.cs.toronto.edu", 443)


@dataclass(frozen=True)
class Plan:
    """What the demo trains and analyses.

    Attributes:
        model: a `freqact.models` name with residual blocks (the λ and pooling analyses read block
            outputs).
        subset: training images (the first N of the training set).
        epochs: epochs per mode; a checkpoint is kept after each.
        batch_size, lr: the SGD recipe of `freqact.train` (cosine schedule over `epochs`).
        ratio: kept fraction W/N of each frequency axis, one value for LFC-ACT / HFC-ACT training
            and for the λ and Theorem 3.1 analyses (the paper's 0.1), so that the analyses explain
            the runs beside them.
        block, bits: DIVISION's block size B and HFC bits Q.
        lambda_images, theorem_images, pooling_images: test images each analysis reads.
        seed: one seed for every run (same initial weights and data order in every mode).
    """

    model: str = "resnet20"
    subset: int = 1280
    epochs: int = 3
    batch_size: int = 64
    lr: float = 0.1
    ratio: float = pipelines.RATIO
    block: int = 8
    bits: int = 2
    lambda_images: int = pipelines.LAMBDA_IMAGES
    theorem_images: int = pipelines.THEOREM_IMAGES
    pooling_images: int = pipelines.POOLING_IMAGES
    seed: int = 0

    def figure_settings(self) -> dict:
        """The settings the demo draws its figures with: `figures.make_all`'s keyword arguments,
        which `regenerate_command` names as `freqact figures` options."""
        return {"ratio": self.ratio, "lambda_images": self.lambda_images,
                "theorem_images": self.theorem_images, "pooling_images": self.pooling_images}


PLAN = Plan()
QUICK_PLAN = Plan(subset=64, epochs=2, batch_size=32, lambda_images=8, theorem_images=8,
                  pooling_images=4)


@dataclass(frozen=True)
class DataChoice:
    """The dataset the demo trains on.

    Attributes:
        dataset: "cifar10" or "digits".
        data_dir: the CIFAR data directory (None for digits).
        note: one line saying what was chosen and why.
    """

    dataset: str
    data_dir: str | None
    note: str


def online(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the CIFAR host opens within `timeout` seconds.

    The check runs in a daemon thread that is abandoned after `timeout`, so a slow DNS lookup
    (which socket timeouts do not bound) cannot hang the caller.
    """
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection(CIFAR_HOST, timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def choose_data(
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool = False,
    check_online: Callable[[], bool] = online,
    fetch: Callable[..., object] = data.download_cifar,
) -> DataChoice:
    """CIFAR-10 from the data directory, else downloaded, else scikit-learn digits.

    Args:
        data_dir: the CIFAR data directory (default `$FREQACT_DATA`, else ./data).
        download: try the official download without the connectivity check.
        check_online: called (without arguments) when CIFAR-10 is missing and `download` is False;
            the download is tried only if it returns True.
        fetch: `fetch("cifar10", root)` downloads and unpacks the archive (injectable for tests);
            it raises FileNotFoundError on failure.

    Returns:
        The choice; its note is the one line to print.

    Raises:
        ValueError: if CIFAR-10 files are present but not valid CIFAR batches.
    """
    root = data.resolve_data_dir(data_dir)
    if _has_cifar10(root):
        return DataChoice("cifar10", str(root), f"CIFAR-10 found in {root}")
    reason = "offline; --download forces a try, --data-dir points at a CIFAR-10 copy"
    if download or check_online():
        try:
            fetch("cifar10", root)
        except FileNotFoundError as err:
            reason = f"download failed: {err}"
        else:
            if _has_cifar10(root):
                return DataChoice("cifar10", str(root), f"CIFAR-10 downloaded into {root}")
            reason = "the download did not produce cifar-10-batches-py"
    return DataChoice("digits", None, f"CIFAR-10 not found in {root.resolve()}; using scikit-learn digits "
                                      f"(offline fallback: {reason})")


def run(
    out: str | os.PathLike = "demo",
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    offline: bool = False,
    quick: bool = False,
    epochs: int | None = None,
    subset: int | None = None,
    device: str | None = None,
    check_online: Callable[[], bool] = online,
    fetch: Callable[..., object] = data.download_cifar,
    log: Callable[[str], None] = print,
) -> Path:
    """Run the demo: choose data, train every mode, analyse, draw, write OUT/report.md.

    Args:
        out: output folder; must not hold an earlier demo's runs.
        data_dir: CIFAR data directory (see `choose_data`).
        download: try the official CIFAR download without the connectivity check.
        offline: never try to download (no connectivity check).
        quick: the seconds-long `QUICK_PLAN` instead of `PLAN`.
        epochs, subset: override the plan's epochs / training images.
        device: "cpu", "cuda", ... (default: CUDA when available).
        check_online, fetch: as in `choose_data` (injectable for tests).
        log: receives the stage lines and the data line.

    Returns:
        The path of report.md.

    Raises:
        ValueError: if `out` already holds runs, `download` and `offline` are both set, or
            epochs/subset are below 1.
        rundir.RunDirBusy: if another process is writing a demo into `out`.
        TypeError: if epochs/subset are not integers.
    """
    if download and offline:
        raise ValueError("download: expected download or offline, got both")
    plan = QUICK_PLAN if quick else PLAN
    if epochs is not None:
        plan = replace(plan, epochs=_validate.positive_int("epochs", epochs))
    if subset is not None:
        plan = replace(plan, subset=_validate.positive_int("subset", subset))
    device = str(distributed.pick_device(device))
    out = Path(out)
    with rundir.output_lock(out):  # one demo per folder
        runs_dir = out / "runs"
        if runs_dir.exists() and any(runs_dir.iterdir()):
            raise ValueError(f"out: {out} already holds a demo ({runs_dir}); remove it or choose another --out")
        stages = 3 + len(MODES)
        timings: list[tuple[str, float]] = []
        started = time.perf_counter()

        def stage(i: int, text: str) -> None:
            timings.append((text, time.perf_counter()))
            log(f"[{i}/{stages}] {text} ...")

        stage(1, "choosing data")
        choice = choose_data(data_dir, download=download,
                             check_online=(lambda: False) if offline else check_online, fetch=fetch)
        log(choice.note)
        results = {}
        for i, mode in enumerate(MODES, start=2):
            stage(i, f"training {mode}")
            config = train.RunConfig(
                model=plan.model, dataset=choice.dataset, mode=mode, ratio=plan.ratio, block=plan.block,
                bits=plan.bits, epochs=plan.epochs, batch_size=plan.batch_size, lr=plan.lr,
                subset=plan.subset, seed=plan.seed, device=device, data_dir=choice.data_dir,
                out=str(runs_dir / mode), save_epochs=list(range(1, plan.epochs + 1)))
            results[mode] = train.train(config)
        stage(stages - 1, "analysing the runs and drawing the figures")
        figs = figures.make_all([runs_dir / mode for mode in MODES], out / "figures", **plan.figure_settings(),
                                device=device, progress=lambda line: log(f"      {line}"))
        stage(stages, "writing the report")
        timings.append(("done", time.perf_counter()))
        report = out / "report.md"
        checkpoint.atomic_write(report, _report(plan, choice, results, figs, out, timings, started).encode())
        log(f"wrote {report} ({time.perf_counter() - started:.0f} s in all)")
        return report


def regenerate_command(plan: Plan, runs: Sequence[str], out: str = "figures", device: str | None = None) -> str:
    """The `freqact figures` command that redraws the demo's figures with the demo's own settings
    (`plan.figure_settings()` and the device, as `run` passes them to `figures.make_all`; the
    tables are reused), quoted for a POSIX shell (a path with spaces stays one argument).

    Args:
        device: where the demo drew ("cpu", "cuda:0"); None leaves `--device` out (its default).

    >>> regenerate_command(QUICK_PLAN, ["runs/normal"])
    'freqact figures runs/normal --out figures --ratio 0.1 --lambda-images 8 --theorem-images 8 --pooling-images 4'
    >>> regenerate_command(QUICK_PLAN, ["runs/normal"], device="cuda:0").split(" --ratio")[0]
    'freqact figures runs/normal --out figures --device cuda:0'
    """
    options = [word for key, value in plan.figure_settings().items()
               for word in (f"--{key.replace('_', '-')}", str(value))]
    where = [] if device is None else ["--device", str(device)]
    return shlex.join(["freqact", "figures", *map(str, runs), "--out", str(out), *where, *options])


def _has_cifar10(root: Path) -> bool:
    """Whether `root` holds a readable CIFAR-10 (parsing it checks more than file names)."""
    try:
        data.load_cifar("cifar10", root)
    except FileNotFoundError:
        return False
    return True


def _training_row(mode: str, result: dict, totals: dict) -> str:
    """One row of report.md's training table: a run's accuracy (%), loss, speed and memory."""
    metrics = result["metrics"]
    final = metrics[-1]
    total = totals[figures.run_label(result["config"])]
    return (f"| {mode} | {figures.settings_label(result['config']) or '–'} | "
            f"{100 * final['test_acc']:.1f} | {100 * max(m['test_acc'] for m in metrics):.1f} | "
            f"{final['train_loss']:.3f} | {sum(m['images_per_s'] for m in metrics) / len(metrics):.0f} | "
            f"{total['saved_bytes'] / 2**20:.2f} / {total['exact_bytes'] / 2**20:.2f} | "
            f"{total['ratio']:.1f} |")


def _report(plan: Plan, choice: DataChoice, results: dict, figs: dict, out: Path,
            timings: list[tuple[str, float]], started: float) -> str:
    """The text of report.md: the sections below, formatted from the runs' results and tables."""

    def link(path) -> str:
        return Path(os.path.relpath(path, out)).as_posix()

    sections = (_run_lines(plan, choice, results, link, timings[-1][1] - started),
                _training_lines(plan, results, figs), _lambda_lines(figs), _theorem_lines(figs),
                _pooling_lines(figs), _figure_lines(figs, link), _time_lines(timings))
    return "\n".join(line for lines in sections for line in lines) + "\n"


def _run_lines(plan: Plan, choice: DataChoice, results: dict, link: Callable, seconds: float) -> list[str]:
    """report.md's title and "What was run"."""
    config = results["normal"]["config"]
    analysed = Path(results["normal"]["run_dir"])
    return [
        "# freqact demo",
        "",
        f"Written by `freqact demo` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"in {seconds:.0f} s (torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, device {config['device']}).",
        "",
        "## What was run",
        "",
        f"- Data: {choice.note}. Training on the first {plan.subset} training images (all, "
        f"if there are fewer); the test accuracy is over the whole test set, the analyses read its first "
        f"images.",
        f"- Model: {plan.model}, {plan.epochs} epochs, batch {plan.batch_size}, SGD lr {plan.lr} "
        f"(cosine), momentum {config['momentum']}, weight decay {config['weight_decay']}, seed "
        f"{plan.seed}; a checkpoint after every epoch.",
        *(f"- `{figures.run_label(results[mode]['config'])}`: {train.mode_title(mode)}, in "
          f"[runs/{mode}]({link(results[mode]['run_dir'])})" for mode in MODES),
        f"- Analyses on the `normal` run ({link(analysed)}), W/N = {plan.ratio} (as LFC-ACT/HFC-ACT): λ on "
        f"{plan.lambda_images} test images per checkpoint, Theorem 3.1 on {plan.theorem_images}, "
        f"pooling on {plan.pooling_images}. Regenerate every figure from this folder with "
        f"`{regenerate_command(plan, [link(results[m]['run_dir']) for m in MODES], device=config['device'])}`.",
        "",
    ]


def _training_lines(plan: Plan, results: dict, figs: dict) -> list[str]:
    """report.md's training table and the notes under it."""
    lines = [
        "## Training (LFC-ACT vs HFC-ACT vs normal vs DIVISION)",
        "",
        "| run | settings | final test acc (%) | best test acc (%) | final train loss | images/s "
        "| cached / plain MiB per batch | compression × |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    totals = {row["run"]: row for row in figures.memory_totals(figs["compression"].rows)}
    lines += [_training_row(mode, results[mode], totals) for mode in MODES]
    steps = -(-plan.subset // plan.batch_size)  # per epoch, fewer if the training set is smaller
    lines += [
        "",
        f"W/N is the kept fraction of each DCT frequency axis, B × B DIVISION's block and Q its HFC "
        f"bits; compression × is plain PyTorch's bytes over the bytes cached. Test numbers after the "
        f"first epoch can sit far below the training ones (accuracy near chance, loss above 10): "
        f"evaluation normalises with BatchNorm's running statistics, a moving average (momentum 0.1) "
        f"over the last training batches, and after {steps} SGD steps (one epoch) at lr {plan.lr} the weights have "
        f"moved on from the ones those batches saw. The gap closes as the learning rate decays; it "
        f"is not a codec effect (normal training shows it too).",
        "",
        f"Memory: bytes autograd caches for backward in one training-mode forward pass of "
        f"{next(iter(totals.values()))['images']} test images, measured by `freqact.compress`'s meter "
        "(`normal`: plain PyTorch storage); per layer in figures/compression.csv.",
        "",
    ]
    return lines


def _lambda_lines(figs: dict) -> list[str]:
    """report.md's λ table: one row per checkpoint."""
    lines = [
        "## λ^L vs λ^H across checkpoints",
        "",
        "| epoch | block outputs × images | median λ^L | median λ^H | share λ^L > λ^H |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    epochs = {str(r["checkpoint"]): r["epoch"] for r in figs["lambdas"].rows}
    for row in lambdas.summarize(figs["lambdas"].rows):
        if row["layer"] == "(all)":
            lines.append(f"| {epochs[row['checkpoint']]} | {row['instances']} | {row['median_lam_L']:.3g} | "
                         f"{row['median_lam_H']:.3g} | {row['share_L_gt_H']:.1%} |")
    return [*lines, ""]


def _theorem_lines(figs: dict) -> list[str]:
    """report.md's Theorem 3.1 paragraph."""
    s = theorem31.summarize(figs["theorem31"].rows)
    e2e = figs["theorem31"].rows
    return [
        "## Theorem 3.1 (last checkpoint of the normal run)",
        "",
        f"Over {s['layers']} conv layers: err ≤ GEB held in {s['bound_holds']}, with median tightness "
        f"err/GEB {s['median_tightness_L'] or 0:.3g} (LFC cached) and {s['median_tightness_H'] or 0:.3g} "
        f"(HFC cached); err^L < err^H in {s['err_L_lt_err_H']}. Whole network compressed: the median "
        "weight-gradient error is "
        f"{statistics.median(r['e2e_err_L'] for r in e2e):.3g} with LFC-ACT and "
        f"{statistics.median(r['e2e_err_H'] for r in e2e):.3g} with HFC-ACT.",
        "",
    ]


def _pooling_lines(figs: dict) -> list[str]:
    """report.md's pooling table: one row per block size."""
    lines = [
        "## Pooling vs DCT low-pass (Theorem 4.1)",
        "",
        "| B | maps | median ‖LFC_pool − LFC_DCT‖/‖H‖ | mean energy share pool "
        "| mean energy share DCT | max DC identity error |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for block in sorted({r["block"] for r in figs["pooling"].rows}):
        rows = [r for r in figs["pooling"].rows if r["block"] == block]
        lines.append(
            f"| {block} | {len(rows)} | {statistics.median(r['rel_dist'] for r in rows):.3g} | "
            f"{sum(r['energy_pool'] for r in rows) / len(rows):.3f} | "
            f"{sum(r['energy_dct'] for r in rows) / len(rows):.3f} | "
            f"{max(r['dc_identity_err'] for r in rows):.1e} |")
    return [*lines, ""]


def _figure_lines(figs: dict, link: Callable) -> list[str]:
    """report.md's figures, each with its caption and links to its other files."""
    lines = ["## Figures", ""]
    for fig in figs.values():
        png = next(p for p in fig.files if p.suffix == ".png")
        others = ", ".join(f"[{p.suffix[1:]}]({link(p)})" for p in fig.files if p != png)
        lines += [f"### {fig.name}", "", f"![{fig.name}]({link(png)})", "", f"{fig.caption} ({others})", ""]
    return lines


def _time_lines(timings: list[tuple[str, float]]) -> list[str]:
    """report.md's time per stage."""
    return ["## Time per stage", "", "| stage | seconds |", "| --- | ---: |",
            *(f"| {name} | {end - begin:.1f} |" for (name, begin), (_, end) in zip(timings, timings[1:]))]

