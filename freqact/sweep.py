"""Studies: a grid of training runs from a small spec file, run where missing, summarised as a table.

    outcome = sweep.run("ablation-cpu", data_dir="../shared/data")  # trains what is missing
    outcome["rows"], outcome["written"]   # the table; sweeps/ablation-cpu/results.{csv,md}, figure

Spec (TOML, JSON or YAML; or the name of a preset shipped in `freqact/presets/`, see `presets()`)::

    name = "ablation-cpu"          # optional; default: the file's stem
    description = "..."            # optional; printed above the Markdown table
    [base]                         # RunConfig fields shared by every run
    model = "resnet20"
    dataset = "cifar10"
    subset = 5000
    epochs = 3
    [grid]                         # RunConfig fields -> lists; every combination is run
    seed = [0, 1]
    [[variants]]                   # one arm of the study each: a label + RunConfig fields
    label = "normal"
    mode = "normal"
    [[variants]]
    label = "quant Q=2"
    mode = "quant"
    bits = 2

Rules: keys of `base`, `grid` and the variants are `train.RunConfig` fields, except `out`,
`resume` and `device`, which the sweep sets (`--out`, `--device`). A variant may override `base`;
a field may not be both in `grid` and in `base` or a variant. Every grid entry is a non-empty list.
Without `variants` the study has one arm, `base` itself. A variant without a label is named after
its mode and codec settings ("division B=8 Q=2"). Labels must be unique. The spec is checked whole
(every run's RunConfig is built) before anything runs.

Run directories: `OUT/<label-slug>/[<field>-<value>/...]seed-<seed>`, one level per grid field
other than `seed`. A run is finished when its `metrics.jsonl` reaches the configured last epoch:
finished runs are skipped, any other existing run is resumed (`RunConfig.resume`; a run that
never completed an epoch starts over). A run directory written with other settings (e.g. the spec
was edited) is refused up front, naming the differing fields. A run that fails does not stop the
sweep: its traceback goes to `RUN/error.log` and the sweep reports it at the end.

Results (`results_table`): one row per arm (variant x non-seed grid values), written to
`OUT/results.csv`, `OUT/results.md` and the figure `OUT/<name>.png/.pdf`.

Devices and parallelism:
- `jobs=1` (default): runs one after the other in this process, on `device` (None: CUDA when
  available).
- `jobs=K > 1`: K worker processes (spawned), each taking every K-th missing run in turn. With
  several GPUs (device None or "cuda"), worker k trains on `cuda:(k mod #GPUs)`; otherwise all on
  `device`. On the CPU the workers share the cores (each gets cores // K threads), so K > 1 rarely
  finishes sooner there; it pays on several GPUs.
- Under `torchrun`, every run in turn is one DistributedDataParallel run over all ranks (the
  process group is created once here, as `freqact.distributed` requires); `jobs` must be 1, every
  rank must see OUT (one machine or a shared filesystem), and only rank 0 writes the table.

Stopping: Ctrl-C (SIGINT, which a terminal sends to every worker too) or SIGTERM to the sweep
(forwarded to its workers) stops each run at its next epoch boundary with whole checkpoints, as
`freqact train` does, and raises `Interrupted` once every worker has stopped; rerunning the same
command skips the finished runs and resumes the others.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import multiprocessing
import os
import re
import signal
import statistics
import threading
import traceback
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from freqact import _validate, checkpoint, codecs, distributed, rundir, train
from freqact.errors import UsageTypeError
from freqact.specfile import MAX_SPEC_BYTES, MAX_SPEC_NODES, load_spec, presets  # noqa: F401  (sweep API)

SPEC_KEYS = ("name", "description", "base", "grid", "variants")
# RunConfig fields the sweep sets itself.
MANAGED_FIELDS = ("out", "resume", "device")
# The codec settings that label runs and fill result columns: those the codecs give a symbol.
_LABELLED = tuple(s for s in codecs.mode_settings() if s.symbol)
# Bound on the runs a spec may ask for (the file and its YAML expansion: freqact.specfile).
MAX_RUNS = 10_000


@dataclass(frozen=True)
class Run:
    """One training run of a study.

    Attributes:
        label: its variant's label.
        group: the non-seed grid settings, as (field, value) pairs in grid order.
        config: the complete RunConfig (`out` is the run directory, `resume` True).
    """

    label: str
    group: tuple[tuple[str, object], ...]
    config: train.RunConfig

    @property
    def run_dir(self) -> Path:
        """Where the run writes."""
        return Path(self.config.out)


@dataclass(frozen=True)
class Study:
    """An expanded spec.

    Attributes:
        name: the study's name (file names of the figure).
        description: free text for the Markdown table.
        out: the study's folder.
        group_fields: the grid fields other than `seed`, in grid order.
        runs: every run, variant-major, then group, then seed.
    """

    name: str
    description: str
    out: Path
    group_fields: tuple[str, ...]
    runs: tuple[Run, ...]


def expand(spec: dict, out: str | os.PathLike | None = None, *, data_dir: str | None = None,
           download: bool = False) -> Study:
    """Check a spec and expand it into its runs.

    Args:
        spec: as `load_spec` returns (see the module docstring for its shape).
        out: the study's folder (default `sweeps/<name>`).
        data_dir: CIFAR data directory for every run (overrides the spec's).
        download: let the runs download CIFAR when missing.

    Returns:
        The study.

    Raises:
        ValueError / TypeError: naming the offending key (and the spec part it is in) for unknown
            or managed keys, a field in both grid and base/variant, an empty grid entry or variant
            list, duplicate labels, or a value RunConfig refuses.
    """
    if not isinstance(spec, dict):
        raise UsageTypeError(f"spec: expected a mapping, got {type(spec).__name__}")
    unknown = [key for key in spec if key not in SPEC_KEYS]
    if unknown:
        raise ValueError(f"spec: unknown key {unknown[0]!r}; expected keys {', '.join(SPEC_KEYS)}")
    name = _folder_name(spec.get("name"))
    base = _fields(spec.get("base", {}), "base")
    grid = _grid(spec, base)
    variants = _variants(spec.get("variants", [{}]), base, grid)
    _check_count(len(variants), grid)
    if out is not None and not str(out).strip():
        raise ValueError(f"out: expected a folder path, got {out!r}")
    out = rundir.check_folder(out) if out is not None else Path("sweeps") / name
    group_fields = tuple(key for key in grid if key != "seed")
    extra = {"resume": True, **({"data_dir": data_dir} if data_dir is not None else {}),
             **({"download": True} if download else {})}
    runs = tuple(_runs(variants, grid, group_fields, out, extra))
    _check_selectors(runs)
    return Study(name, str(spec.get("description", "")), out, group_fields, runs)


def _runs(variants: list[tuple[str, dict]], grid: dict, group_fields: tuple[str, ...], out: Path,
          extra: dict) -> Iterator[Run]:
    """Every run: variant-major, then grid point; each in OUT/<label>/[<field>-<value>/]seed-<s>.

    Labels and grid values become folder names through `_slug` (lower-case letters, digits, '.'
    and '-', never starting with '.'), so no run directory leaves `out`.
    """
    for label, settings in variants:
        for point in itertools.product(*grid.values()):
            values = dict(zip(grid, point))
            group = tuple((key, values[key]) for key in group_fields)
            config = _config({**settings, **values, **extra}, f"variant {label!r}")
            run_dir = out.joinpath(_slug(label), *(f"{k}-{_slug(str(v))}" for k, v in group),
                                   f"seed-{config.seed}")
            yield Run(label, group, dataclasses.replace(config, out=str(run_dir)))


def _check_selectors(runs: Sequence[Run]) -> None:
    """Check every run's include/exclude against its model (built once per model on the meta
    device, so nothing is allocated), before anything runs."""
    import torch

    from freqact import checkpoint, data

    checked: set[str] = set()
    for run in runs:
        config = run.config
        if config.mode == "normal" or (config.include is None and config.exclude is None):
            continue
        key = repr((config.model, config.dataset, config.model_options, config.include,
                    config.exclude))
        if key in checked:
            continue
        checked.add(key)
        with torch.device("meta"):
            model = checkpoint.build_model(config.model, data.num_classes(config.dataset),
                                           config.model_options)
        try:
            config.selectors(model)
        except ValueError as err:
            raise type(err)(f"variant {run.label!r}: {err}") from err


def _check_count(variants: int, grid: dict) -> None:
    """Refuse a study of more than MAX_RUNS runs, counted before anything is expanded."""
    count = variants * math.prod(len(values) for values in grid.values())
    if count > MAX_RUNS:
        sizes = " x ".join(str(len(v)) for v in grid.values()) or "1"
        raise ValueError(f"grid: the spec asks for {count:,} runs ({variants} variants x "
                         f"{sizes} grid values); at most {MAX_RUNS:,} per study")


def _folder_name(name: object) -> str:
    """The spec's `name`, checked to be one folder name (it names `sweeps/<name>`)."""
    if isinstance(name, str) and (name in (".", "..") or any(c in name for c in "/\\\0")):
        raise ValueError(f"name: expected one folder name (no '/', '\\' or '..'), got {name!r}")
    if not isinstance(name, str) or not _slug(name):
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    return name


def _grid(spec: dict, base: dict) -> dict:
    """The spec's grid, checked: non-empty lists of single values, none also set in base."""
    grid = _fields(spec.get("grid", {}), "grid")
    if "grid" in spec and not grid:
        raise ValueError("grid: expected at least one field with a list of values, got an empty grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values or any(
                isinstance(v, (list, dict)) for v in values):
            raise ValueError(f"grid.{key}: expected a non-empty list of single values, "
                             f"got {values!r}")
        if key in base:
            raise ValueError(f"grid.{key}: also set in base; set it in one place")
    return grid


def run_state(run: Run) -> str:
    """"finished", "partial" (a run directory exists but misses epochs) or "new"
    (`rundir.RunDir.state`).

    Raises:
        ValueError: if the run directory was written with settings other than `run.config`'s.
    """
    return rundir.RunDir(run.run_dir).state(run.config.to_dict(), run.config.epochs)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The per-epoch rows of a run (`rundir.RunDir.read_metrics`), [] before its first epoch."""
    return rundir.RunDir(run_dir).metrics_or_empty()


def plan(spec: str | os.PathLike | dict, out: str | os.PathLike | None = None, *,
         data_dir: str | None = None, download: bool = False) -> tuple[Study, dict[Path, str]]:
    """(study, {run directory: `run_state`}) for a spec file, preset name or spec dict; runs
    nothing. `out`, `data_dir`, `download` as in `expand`; raises as `load_spec`, `expand` and
    `run_state` do."""
    study = expand(spec if isinstance(spec, dict) else load_spec(spec), out, data_dir=data_dir,
                   download=download)
    return study, {r.run_dir: run_state(r) for r in study.runs}


def run(spec: str | os.PathLike | dict, out: str | os.PathLike | None = None, *, jobs: int = 1,
        device: str | None = None, data_dir: str | None = None, download: bool = False) -> dict:
    """Run the missing runs of a study, then write its results table and figure.

    Args:
        spec: a spec file, a preset name, or a spec dict.
        out: the study's folder (default `sweeps/<name>`).
        jobs: worker processes (see the module docstring); 1 runs in this process.
        device: "cpu", "cuda", "cuda:N" or None (CUDA when available).
        data_dir, download: as in `expand`.

    Returns:
        {"study": Study, "ran": [run dirs trained now], "skipped": [run dirs already finished],
        "failed": [(run dir, "Error: message (traceback in RUN/error.log)")] (no log for a run
        another process is writing), "rows": results_table rows, "written": [paths]}
        ("written" is empty on ranks > 0 under torchrun).

    Raises:
        ValueError / TypeError / FileNotFoundError: for a bad spec or `jobs`, or a run directory
            written with other settings (before anything runs).
    """
    _validate.positive_int("jobs", jobs)
    distributed.pick_device(device)  # a device this machine lacks fails here, not in every run
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if torchrun and jobs > 1:
        raise ValueError(f"jobs: expected 1 under torchrun (each run uses every rank), got {jobs}")
    study, states = plan(spec, out, data_dir=data_dir, download=download)
    todo = [r for r in study.runs if states[r.run_dir] != "finished"]
    print(f"{study.name}: {len(study.runs)} runs, {len(study.runs) - len(todo)} finished, "
          f"{len(todo)} to run in {study.out}", flush=True)
    with _process_group(torchrun, device) as rank:
        if jobs == 1 or len(todo) <= 1:
            failed, stopped = _run_lane([r.config for r in todo], device, None)
        else:
            failed, stopped = _run_lanes([r.config for r in todo], jobs, device)
        if stopped is not None:
            raise Interrupted(stopped)
        rows = results_table(study)
        written = write_results(study, rows) if rank == 0 else []
    return {"study": study, "ran": [str(r.run_dir) for r in todo],
            "skipped": [str(r.run_dir) for r in study.runs if states[r.run_dir] == "finished"],
            "failed": failed, "rows": rows, "written": written}


def results_table(study: Study) -> list[dict]:
    """One row per arm of the study, from the metrics of its finished runs.

    Images/s is the mean over the epochs after the first (which pays for warm-up), then over seeds;
    compression ratio and saved MiB are the last epoch's (the trainer's meter; None for `normal`).

    Returns:
        Rows with "label", the group fields, "mode", one key per labelled codec setting ("block",
        "bits", "ratio"; None where the mode has no such setting), "epochs", "seeds" (finished runs),
        "runs" (planned runs),
        "final_acc_mean", "final_acc_std", "best_acc_mean", "best_acc_std" (test accuracy in
        [0, 1]; std is the sample std, None with fewer than 2 seeds), "images_per_s",
        "compression_ratio", "saved_mib" (None when no finished run has them).
    """
    arms: dict[tuple, list[Run]] = {}
    for r in study.runs:
        arms.setdefault((r.label, r.group), []).append(r)
    return [_arm_row(label, group, members) for (label, group), members in arms.items()]


def _arm_row(label: str, group: tuple, members: list[Run]) -> dict:
    """`results_table`'s row of one arm (its runs differ only in the seed)."""
    config = members[0].config
    params = config.label_params()
    finished = [m for m in (read_metrics(r.run_dir) for r in members) if rundir.reaches(m, config.epochs)]
    return {"label": label, **dict(group), "mode": config.mode,
            **{s.name: params.get(s.name) for s in _LABELLED}, "epochs": config.epochs,
            "seeds": len(finished), "runs": len(members), **_seed_stats(finished)}


def _seed_stats(finished: list[list[dict]]) -> dict:
    """Accuracy mean/std, speed and memory over the finished seeds' metrics (see `results_table`)."""
    row = {}
    for name, values in (("final_acc", [m[-1]["test_acc"] for m in finished]),
                         ("best_acc", [max(e["test_acc"] for e in m) for m in finished])):
        row[f"{name}_mean"] = statistics.fmean(values) if values else None
        row[f"{name}_std"] = statistics.stdev(values) if len(values) > 1 else None
    # the first epoch pays for warm-up (allocator, kernel compilation)
    row["images_per_s"] = _mean([statistics.fmean(e["images_per_s"] for e in m[1:] or m) for m in finished])
    row["compression_ratio"] = _mean([m[-1].get("compression_ratio") for m in finished])
    saved = _mean([m[-1].get("saved_bytes") for m in finished])
    row["saved_mib"] = saved / 2**20 if saved is not None else None
    return row


def markdown_table(study: Study, rows: Sequence[dict]) -> str:
    """The results as a Markdown document: title, description, table (accuracy in %), notes."""
    head = ["variant", *study.group_fields, "mode", *(s.header for s in _LABELLED), "seeds",
            "final acc (%)", "best acc (%)", "images/s", "compression", "saved MiB/step"]
    lines = [f"# {study.name}", ""]
    if study.description:
        lines += [study.description.strip(), ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["label"].replace("|", "\\|"), *(str(row[f]) for f in study.group_fields),
                 row["mode"],
                 *(_cell(row[s.name]) for s in _LABELLED), f"{row['seeds']}/{row['runs']}",
                 _pm(row["final_acc_mean"], row["final_acc_std"]),
                 _pm(row["best_acc_mean"], row["best_acc_std"]), _cell(row["images_per_s"], ".0f"),
                 _cell(row["compression_ratio"], ".1f", "x"), _cell(row["saved_mib"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Test accuracy: mean ± sample std over the finished seeds (seeds: finished/planned). "
              "images/s: training throughput, mean over the epochs after the first. compression: "
              "exact / saved bytes of the activations cached for backward in the last epoch's first "
              "(full-batch) training step (– for normal training, which stores them as they are).", ""]
    return "\n".join(lines)


def write_results(study: Study, rows: Sequence[dict]) -> list[Path]:
    """Write OUT/results.csv, OUT/results.md and the figure OUT/<name>.png/.pdf; return the paths.

    Each file is written atomically, under the folder's `rundir.output_lock` (one writer).

    Raises:
        rundir.RunDirBusy: if another process is writing the study's results.
    """
    from freqact import plots
    from freqact.analysis import common

    with rundir.output_lock(study.out):
        markdown = study.out / "results.md"
        checkpoint.atomic_write(markdown, markdown_table(study, rows).encode("utf-8"))
        written = [common.write_csv(rows, study.out / "results.csv"), markdown]
        if any(row["seeds"] for row in rows):
            written += plots.sweep_figure(rows, study.out / _slug(study.name), title=study.name,
                                          group_fields=study.group_fields)
    return written


def _fields(table: object, where: str) -> dict:
    """Check that `table` maps RunConfig fields the spec may set; return it as a dict."""
    if not isinstance(table, dict):
        raise UsageTypeError(f"{where}: expected a table of RunConfig fields, got {type(table).__name__}")
    allowed = [f.name for f in dataclasses.fields(train.RunConfig) if f.name not in MANAGED_FIELDS]
    for key in table:
        if key in MANAGED_FIELDS:
            raise ValueError(f"{where}.{key}: set by the sweep itself (--out/--device), "
                             "not by the spec")
        if key not in allowed:
            raise ValueError(f"{where}: unknown key {key!r}; expected RunConfig fields "
                             f"{', '.join(allowed)}")
    return dict(table)


def _variants(variants: object, base: dict, grid: dict) -> list[tuple[str, dict]]:
    """(label, base + variant settings) per variant, checked; labels unique (also as folder names)."""
    if not isinstance(variants, list) or not variants:
        raise ValueError(f"variants: expected a non-empty list of tables, got {variants!r}")
    result, slugs = [], {}
    for i, variant in enumerate(variants):
        if not isinstance(variant, dict):
            raise UsageTypeError(f"variants[{i}]: expected a table, got {type(variant).__name__}")
        variant = dict(variant)
        label = variant.pop("label", None)
        settings = {**base, **_fields(variant, f"variants[{i}]")}
        clash = [key for key in variant if key in grid]
        if clash:
            raise ValueError(f"variants[{i}].{clash[0]}: also in grid; set it in one place")
        if label is None:
            label = _default_label(_config(settings, f"variants[{i}]"), skip=tuple(grid))
        if not isinstance(label, str) or not _slug(label):
            raise ValueError(f"variants[{i}].label: expected a non-empty string, got {label!r}")
        if _slug(label) in slugs:
            raise ValueError(f"variants[{i}].label: {label!r} repeats (as a folder name) "
                             f"{slugs[_slug(label)]!r}; labels must be unique")
        slugs[_slug(label)] = label
        result.append((label, settings))
    return result


def _config(fields: dict, where: str) -> train.RunConfig:
    """RunConfig(**fields) with the model name checked and, as on the command line, no setting
    the mode does not use (a normal run given bits, a grid over ratio for division: runs that
    differ in name only); errors say which part of the spec."""
    from freqact import models, runconfig

    try:
        if "model" in fields:
            _validate.choice("model", fields["model"], tuple(models.names()))
        config = train.RunConfig(**fields)  # checks the mode first
        runconfig.refuse_unused(config.mode, [k for k, v in fields.items() if v is not None])
        return config
    except (ValueError, TypeError) as err:
        raise type(err)(f"{where}: {err}") from err


def _default_label(config: train.RunConfig, skip: tuple[str, ...]) -> str:
    """"division B=8 Q=2", "lfc r=0.1", "normal"; settings in `skip` (the grid's) left out."""
    params = config.label_params()
    return " ".join([config.mode, *(f"{s.symbol}={params[s.name]}" for s in _LABELLED
                                    if s.name in params and s.name not in skip)])


def _slug(text: str) -> str:
    """A folder name: lower case, runs of other characters than [a-z0-9.] become one '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")


class Interrupted(KeyboardInterrupt):
    """The sweep stopped by SIGINT or SIGTERM; every run's checkpoints are whole.

    Attributes:
        signum: the signal.
        exit_code: 128 + signum (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int) -> None:
        super().__init__("interrupted; rerun the same command to continue (finished runs are "
                         "skipped, the others resume)")
        self.signum, self.exit_code = signum, 128 + signum


def _ignore_signals() -> None:
    """A worker's initializer: an idle worker ignores SIGINT/SIGTERM (its lane handles them)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _run_lane(configs: Sequence[train.RunConfig], device: str | None,
              threads: int | None) -> tuple[list[tuple[str, str]], int | None]:
    """Train `configs` one after the other on `device`; return (the failures, the signal that
    stopped the lane or None).

    A failure is logged to RUN/error.log and does not stop the lane. A signal does: inside a run
    `train` stops at the epoch boundary (`train.Interrupted`); between runs (in a worker) it is
    noted and the next run is not started.
    """
    pending: list[int] = []
    old = {}
    if threads is not None:  # a worker process: share the cores with the other workers
        import torch

        torch.set_num_threads(threads)
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, lambda signum, frame: pending.append(signum))
    failed = []
    try:
        for i, config in enumerate(configs, 1):
            if pending:
                return failed, pending[0]
            print(f"[{i}/{len(configs)}] {config.out}", flush=True)
            try:
                train.train(dataclasses.replace(config, device=device))
                (Path(config.out) / "error.log").unlink(missing_ok=True)  # an earlier attempt's
            except train.Interrupted as stop:  # checkpoints whole; the rest of the lane waits
                return failed, stop.signum
            except Exception as err:  # one bad run must not cost the others; reported at the end
                message = f"{type(err).__name__}: {err}"
                if not isinstance(err, rundir.RunDirBusy):  # a busy directory is another's
                    log = Path(config.out) / "error.log"
                    checkpoint.atomic_write(log, traceback.format_exc().encode("utf-8"))
                    message += f" (traceback in {log})"
                failed.append((config.out, message))
        return failed, (pending[0] if pending else None)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _run_lanes(configs: Sequence[train.RunConfig], jobs: int,
               device: str | None) -> tuple[list[tuple[str, str]], int | None]:
    """`_run_lane` in `jobs` spawned processes, run i in lane i mod jobs, GPUs round robin;
    returns (the failures, the first signal that stopped the sweep or None).

    While they run, SIGTERM to this process is forwarded to the workers and SIGINT noted (a
    terminal's Ctrl-C reaches every worker itself); the workers stop at their next epoch boundary.
    """
    import torch

    lanes = [list(configs[k::jobs]) for k in range(min(jobs, len(configs)))]
    gpus = torch.cuda.device_count() if device in (None, "cuda") else 0
    devices = [f"cuda:{k % gpus}" if gpus else device for k in range(len(lanes))]
    threads = max(1, (os.cpu_count() or 1) // len(lanes))
    stopped: list[int] = []

    def on_signal(signum: int, frame) -> None:
        stopped.append(signum)
        if signum == signal.SIGTERM:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signum)

    main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        # spawn, not fork: CUDA and torch's thread pools do not survive a fork
        with ProcessPoolExecutor(len(lanes), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_ignore_signals) as pool:
            futures = [pool.submit(_run_lane, lane, dev, threads)
                       for lane, dev in zip(lanes, devices)]
            outcomes = [future.result() for future in futures]
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    signals = stopped + [signum for _, signum in outcomes if signum is not None]
    return [f for failures, _ in outcomes for f in failures], (signals[0] if signals else None)


@contextlib.contextmanager
def _process_group(torchrun: bool, device: str | None) -> Iterator[int]:
    """Under torchrun, create the process group once for all runs (destroyed after); yields the
    rank (0 without torchrun)."""
    if not torchrun:
        yield 0
        return
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if distributed.pick_device(device).type == "cuda" else "gloo")
    try:
        yield dist.get_rank()
    finally:
        if owned:
            dist.destroy_process_group()


def _mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are present; None when none is."""
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _cell(value: float | None, spec: str = "g", suffix: str = "") -> str:
    """A table cell: formatted number, or an en dash when absent."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def _pm(mean: float | None, std: float | None) -> str:
    """Accuracy in percent, "mean ± std" (just the mean for one seed)."""
    if mean is None:
        return "–"
    return f"{100 * mean:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")
