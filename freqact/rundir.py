"""The run directory: one type owns its layout, its files, "finished?" and "resumable?".

    run = RunDir("runs/resnet20-cifar10-division")
    run.read_config(), run.read_metrics(), run.last, run.epoch_checkpoints()
    with run.lock():            # one writer per directory
        run.write_config(cfg); run.write_metrics(rows)
    with output_lock("figures"):  # the same lock on an output folder, re-entrant in a thread

Layout (`freqact train` writes it, `figures`, `sweep` and the analyses read it)::

    RUN/config.json         the stored run config (RunConfig fields + num_classes, world_size)
    RUN/metrics.csv         one row per finished epoch (METRIC_COLUMNS), for spreadsheets
    RUN/metrics.jsonl       the same rows as JSON lines: what every reader reads
    RUN/ckpt/epoch-XXXX.pt  kept checkpoints (`save_epochs`, `save_every`)
    RUN/ckpt/last.pt        the state after the newest finished epoch
    RUN/.lock               held (flock) by the one process writing the run

Output folders of the analyses, `freqact figures` and `freqact demo` take the same lock
(`output_lock`: OUT/.lock), so a second process writing into one is refused too.

Files are written atomically (`checkpoint.atomic_write`); JSON files are read as data (never
evaluated), with a size bound, and every error names the file (and the line of a JSON-lines file).

The lock is `fcntl.flock(LOCK_EX | LOCK_NB)` on `RUN/.lock`: the kernel releases it when its
process exits, however it exits, so a lock left by a crashed (even SIGKILLed) process never blocks
the next run. The file itself stays in place (deleting it would let two processes lock two
different files of the same name). Where `fcntl` does not exist (Windows) runs are not locked.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from freqact import checkpoint

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, runs are not locked
    fcntl = None

# Fields that may change when a run is resumed; all others must match the stored run. The kernel
# backend changes like the device does (same format, another noise stream); `kernels` records it.
# `layer_windows` is derived from settings that must match (runs before it existed lack it).
RESUMABLE_CHANGES = ("device", "out", "resume", "save_epochs", "save_every", "download",
                     "data_dir", "log_every", "backend", "kernels", "layer_windows")
# Settings added after runs were written: what a stored config without them trained with (runs
# written before the fsdp setting existed were not sharded).
ADDED_SETTINGS = {"optimizer": "sgd", "model_options": {}, "window_rule": "nearest",
                  "include": None, "exclude": None, "fsdp": False}
METRIC_COLUMNS = (
    "epoch", "lr", "train_loss", "train_acc", "test_loss", "test_acc", "epoch_time_s",
    "images_per_s", "saved_bytes", "exact_bytes", "compression_ratio", "cuda_peak_bytes",
)
# What a resume restores from a checkpoint (`check_resume_state`), with the type train writes.
RESUME_STATE = {"epoch": int, "config": dict, "model": dict, "optimizer": dict, "scheduler": dict,
                "scaler": dict, "rng": dict, "metrics": list}
# Bounds on what a reader takes in: a run's config is a few hundred bytes, a metrics line ~300.
MAX_CONFIG_BYTES = 1 << 20
MAX_METRICS_BYTES = 64 << 20


class RunDirBusy(ValueError):
    """Another process holds the run directory's lock."""


class RunDir:
    """A run directory's paths, readers and writers.

    Args:
        path: the run directory (need not exist yet).

    Raises:
        ValueError: if `path` is empty (it would mean the current directory).

    Example:
        >>> run = RunDir("runs/demo")
        >>> run.last.as_posix(), run.epoch_path(3).as_posix()
        ('runs/demo/ckpt/last.pt', 'runs/demo/ckpt/epoch-0003.pt')
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if isinstance(path, str) and not path.strip():
            raise ValueError(f"out: expected a run directory path, got {path!r}")
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __str__(self) -> str:
        return str(self.path)

    # -- paths ------------------------------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics_jsonl(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def metrics_csv(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def ckpt_dir(self) -> Path:
        return self.path / "ckpt"

    @property
    def last(self) -> Path:
        """RUN/ckpt/last.pt."""
        return self.ckpt_dir / "last.pt"

    @property
    def lock_path(self) -> Path:
        return self.path / ".lock"

    def epoch_path(self, epoch: int) -> Path:
        """RUN/ckpt/epoch-XXXX.pt of `epoch`."""
        return self.ckpt_dir / f"epoch-{epoch:04d}.pt"

    def epoch_checkpoints(self) -> list[Path]:
        """The kept epoch checkpoints, oldest first (`epoch_path`'s zero-padded names sort)."""
        return sorted(self.ckpt_dir.glob("epoch-*.pt"))

    def checkpoints(self) -> list[Path]:
        """The epoch checkpoints, else [last.pt] when there is none, else []."""
        return self.checkpoints_in(self.ckpt_dir)

    @staticmethod
    def checkpoints_in(folder: str | os.PathLike) -> list[Path]:
        """`checkpoints()` of a folder laid out as RUN/ckpt (epoch-*.pt, else last.pt)."""
        folder = Path(folder)
        last = folder / "last.pt"
        return sorted(folder.glob("epoch-*.pt")) or ([last] if last.is_file() else [])

    def has_state(self) -> bool:
        """Whether anything of a run was written here (config, metrics or checkpoints)."""
        return self.config_path.is_file() or self.ckpt_dir.is_dir()

    # -- readers ----------------------------------------------------------------------------
    def read_config(self, required: Sequence[str] = ()) -> dict:
        """The stored settings (`RUN/config.json`).

        Args:
            required: keys that must be present (what the caller reads).

        Raises:
            FileNotFoundError: if there is no config.json (not a run directory).
            ValueError: naming the file, if it is not a JSON object, too large, or lacks a
                `required` key (naming the key).
        """
        if not self.config_path.is_file():
            raise FileNotFoundError(f"{self.path} is not a run directory (no config.json)")
        value = read_json(self.config_path)
        if not isinstance(value, dict):
            raise ValueError(f"{self.config_path}: expected a JSON object, got "
                             f"{type(value).__name__}; delete or repair the file")
        require_keys(self.config_path, value, required)
        return value

    def read_metrics(self, numbers: Sequence[str] = ()) -> list[dict]:
        """The per-epoch rows (`RUN/metrics.jsonl`), values as written.

        Args:
            numbers: columns that must hold a number in every row (what a plot reads).

        Raises:
            FileNotFoundError: if there is no metrics.jsonl (no finished epoch).
            ValueError: naming the file and line, for a line that is not a JSON object with an
                integer "epoch" >= 1, or a `numbers` column missing or holding something else.
        """
        if not self.metrics_jsonl.is_file():
            raise FileNotFoundError(f"{self.path} has no metrics.jsonl (no finished epoch)")
        text = _read_text(self.metrics_jsonl, MAX_METRICS_BYTES)
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                rows.append(_metrics_row(f"{self.metrics_jsonl} line {number}", line, numbers))
        return rows

    def metrics_or_empty(self) -> list[dict]:
        """`read_metrics()`, or [] when the run has not finished an epoch."""
        try:
            return self.read_metrics()
        except FileNotFoundError:
            return []

    def finished(self, epochs: int) -> bool:
        """Whether the metrics reach epoch `epochs`."""
        return reaches(self.metrics_or_empty(), epochs)

    def state(self, config: dict, epochs: int) -> str:
        """"finished", "partial" (something written, epochs missing) or "new".

        Raises:
            ValueError: if the stored config differs from `config` in a non-resumable field.
        """
        if self.config_path.is_file():
            check_resumable(self.read_config(), config, self.path)
        if self.finished(epochs):
            return "finished"
        return "partial" if self.has_state() else "new"

    # -- writers ----------------------------------------------------------------------------
    def write_config(self, config: dict) -> None:
        """Write config.json atomically (indented JSON)."""
        checkpoint.atomic_write(self.config_path, json.dumps(config, indent=2).encode())

    def write_metrics(self, rows: Sequence[dict]) -> None:
        """Rewrite metrics.csv and .jsonl from all rows (so a resumed run stays consistent)."""
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=METRIC_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
        checkpoint.atomic_write(self.metrics_csv, table.getvalue().encode())
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        checkpoint.atomic_write(self.metrics_jsonl, lines.encode())

    def remove_stale_temps(self) -> None:
        """Delete temporary files a writer killed mid-save left (call only under the lock)."""
        for folder in (self.path, self.ckpt_dir):
            checkpoint.remove_stale_temps(folder)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the run's exclusive lock for the block (creates the directory; a directory it
        created that holds nothing but the lock when the block ends, a run refused before it
        wrote anything, is removed again).

        Raises:
            RunDirBusy: if another process holds it; the message names the directory.
        """
        if fcntl is None:  # pragma: no cover
            yield
            return
        created, fd = self._locked()
        try:
            yield
        finally:
            if created and [p.name for p in self.path.iterdir()] == [self.lock_path.name]:
                with contextlib.suppress(OSError):  # still under the lock
                    self.lock_path.unlink()
                    self.path.rmdir()
            os.close(fd)  # closing the descriptor releases the lock

    def _locked(self) -> tuple[bool, int]:
        """(whether the directory was made here, the descriptor holding the lock).

        A lock taken on a lock file that its holder has just removed with the empty directory
        (see `lock`) is a lock on nothing: the file at the path is checked to be the one locked,
        else the directory and lock file are made again.
        """
        check_folder(self.path)
        while True:
            created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirBusy(f"out: {self.path} is in use by another freqact process; wait "
                                 "for it to finish or choose another --out") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.lock_path))
            except FileNotFoundError:
                same = False
            if same:
                return created, fd
            os.close(fd)  # removed while we waited to lock it: take the path's lock again

    # -- resume -----------------------------------------------------------------------------
    def resume_checkpoint(self) -> tuple[Path | None, dict | None, list[str]]:
        """The checkpoint a resume continues from: last.pt, else the newest loadable epoch file.

        Returns:
            (path, checkpoint dict, notes): (None, None, notes) when there is no checkpoint; notes
            say which epoch files were skipped as unloadable and why.

        Raises:
            ValueError: if last.pt exists but cannot be loaded or lacks what a resume restores
                (`check_resume_state`; it is never skipped: it is the run's newest state), or
                every epoch checkpoint is so.
        """
        if self.last.is_file():
            return self.last, check_resume_state(self.last, checkpoint.load(self.last)), []
        notes = []
        for path in reversed(self.epoch_checkpoints()):
            try:
                return path, check_resume_state(path, checkpoint.load(path)), notes
            except ValueError as err:
                notes.append(str(err))
        if notes:
            raise ValueError(f"resume: {self.ckpt_dir} has no last.pt and no loadable epoch "
                             f"checkpoint ({notes[0]})")
        return None, None, []


_HELD = threading.local()  # per thread: the output folders `output_lock` holds, with their depth


@contextlib.contextmanager
def output_lock(path: str | os.PathLike) -> Iterator[None]:
    """One writer per output folder (analysis tables, figures, a demo): `RunDir(path).lock()`,
    re-entrant within one thread, so a pipeline may lock the folder that its caller
    (`figures.make_all`) already holds. Another process, or another thread, is refused.

    Raises:
        RunDirBusy: if another process or thread writes into `path`; the message names it.
    """
    held = _HELD.__dict__.setdefault("folders", {})  # folder -> depth of this thread's holds
    key = Path(path).resolve()
    with contextlib.ExitStack() as stack:
        if key not in held:
            stack.enter_context(RunDir(path).lock())
        held[key] = held.get(key, 0) + 1
        try:
            yield
        finally:
            held[key] -= 1
            if not held[key]:
                del held[key]


def reaches(metrics: Sequence[dict], epochs: int) -> bool:
    """Whether metrics rows (as `RunDir.read_metrics` gives them) reach epoch `epochs`."""
    return bool(metrics) and metrics[-1]["epoch"] >= epochs


def check_folder(path: str | os.PathLike, argument: str = "out") -> Path:
    """`path` as a Path, refused in one line naming `argument` when it, or a folder above it, is a
    file (mkdir's bare "[Errno 17] File exists" otherwise).

    Raises:
        ValueError: naming `argument` and the file in the way.
    """
    path = Path(path)
    for place in (path, *path.parents):
        try:
            mode = place.stat().st_mode
        except OSError:  # not there (or not reachable): mkdir makes it, or says why not
            continue
        if not stat.S_ISDIR(mode):
            raise ValueError(f"{argument}: expected a folder, got {path}"
                             + (" (a file)" if place == path else f" ({place} is a file)"))
        break
    return path


def require_keys(where: str | os.PathLike, mapping: dict, keys: Sequence[str]) -> None:
    """Refuse a stored dict (a run's config) that lacks one of `keys` (`checkpoint.missing_keys`:
    absent, or None where train never writes None), as `checkpoint.load_model(required=)` does.

    Args:
        where: the file, named in the message.
        mapping: what was read from it.
        keys: the keys the caller reads.

    Raises:
        ValueError: one line naming `where` and every missing key.

    >>> require_keys("config.json", {"mode": "normal", "seed": None}, ["mode", "dataset", "seed"])
    Traceback (most recent call last):
    ...
    ValueError: config.json: lacks 'dataset', 'seed', which freqact train writes (not a freqact run's file, or damaged)
    """
    missing = checkpoint.missing_keys(mapping, keys)
    if missing:
        raise ValueError(f"{where}: lacks {', '.join(map(repr, missing))}, which freqact train "
                         "writes (not a freqact run's file, or damaged)")


def check_resume_state(path: str | os.PathLike, ckpt: dict) -> dict:
    """Return `ckpt` if it holds every entry a resume restores, of the type `freqact train`
    writes (`RESUME_STATE`: an "epoch" >= 1, dicts of state, a list of metrics rows), else refuse
    it in one line naming the file and the entries (a damaged or hand-made checkpoint reached
    KeyErrors and TypeErrors deep in the restore).

    Raises:
        ValueError: naming `path` and every entry missing or of the wrong type.
    """
    bad = [key for key, kind in RESUME_STATE.items()
           if isinstance(ckpt.get(key), bool) or not isinstance(ckpt.get(key), kind)]
    if "epoch" not in bad and ckpt["epoch"] < 1:
        bad.append("epoch")
    if "metrics" not in bad and not all(isinstance(row, dict) for row in ckpt["metrics"]):
        bad.append("metrics")
    if bad:
        raise ValueError(f"{path}: cannot resume from it: {', '.join(map(repr, bad))} missing or not what "
                         "freqact train writes (damaged, or not a training checkpoint)")
    return ckpt


def check_resumable(saved: dict, current: dict, where: str | os.PathLike) -> None:
    """Refuse when a setting that shapes the run differs between `saved` and `current`.

    Raises:
        ValueError: naming `where` and every differing field (saved -> current).
    """
    saved = {**ADDED_SETTINGS, **saved}
    # compared as JSON holds them: config.json turns a tuple (model_options={"hidden": (64,)}
    # from the Python API) into a list, which is the same setting
    diffs = [f"{key}: {saved.get(key)!r} -> {value!r}" for key, value in current.items()
             if key not in RESUMABLE_CHANGES and _as_json(saved.get(key)) != _as_json(value)]
    if diffs:
        raise ValueError(f"resume: {where} was written with other settings ({'; '.join(diffs)}); "
                         "delete it or choose another --out")


def _as_json(value: object) -> object:
    """value with its tuples as lists, at any depth (as it reads back from JSON)."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value


def read_json(path: str | os.PathLike, limit: int = MAX_CONFIG_BYTES) -> object:
    """A small JSON file freqact wrote (a run's config, an analysis table's settings sidecar), read
    within `limit` bytes.

    Raises:
        OSError: if it cannot be read (FileNotFoundError when missing).
        ValueError: naming the file, if it is larger, not UTF-8, not JSON or nested too deeply.
    """
    path = Path(path)
    return _parse_json(path, _read_text(path, limit))


def _read_text(path: Path, limit: int) -> str:
    """The UTF-8 text of `path`, refused past `limit` bytes (errors name the file)."""
    raw = checkpoint.read_bounded(path, limit, "a file freqact wrote")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); delete or repair the file") from None


def _parse_json(where: str | Path, text: str) -> object:
    """json.loads as data; malformed or absurdly nested input is a ValueError naming `where`."""
    try:
        return json.loads(text)
    except ValueError as err:  # JSONDecodeError, or an integer of more than 4300 digits
        raise ValueError(f"{where}: not valid JSON ({err}); delete or repair the file") from None
    except RecursionError:
        raise ValueError(f"{where}: not valid JSON (nested too deeply)") from None


def _metrics_row(where: str, line: str, numbers: Sequence[str]) -> dict:
    """One checked metrics row: a JSON object, integer epoch >= 1, `numbers` numeric."""
    row = _parse_json(where, line)
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    epoch = row.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
        raise ValueError(f"{where}: epoch: expected an integer >= 1, got {epoch!r}")
    for key in numbers:
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {key}: expected a number, got {value!r}")
    return row
