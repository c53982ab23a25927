"""Helpers shared by the benchmarks: timing, a plain-text table, and JSON results with machine info.

Typical use::

    from benchmarks.common import median_time, print_table, write_results

    seconds = median_time(lambda: f(x), warmup=2, repeats=7)
    print_table(["case", "time (ms)"], [["f", seconds * 1e3]])
    write_results("dct-cpu", {"rows": rows})   # -> benchmarks/results/dct-cpu.json

Run the benchmarks as modules from the repository root (``python -m benchmarks.dct_bench``), so
that ``benchmarks`` and ``freqact`` both import.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _synchronize(device: torch.device | str | None) -> None:
    """Wait for queued kernels on an accelerator so that wall time covers the work."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], object],
    *,
    warmup: int = 2,
    repeats: int = 7,
    device: torch.device | str | None = None,
) -> float:
    """Median wall time of `fn()` in seconds, after `warmup` untimed calls.

    The median (not the mean) because a shared machine adds one-sided outliers. With a CUDA
    `device` the device is synchronized before and after every timed call.

    Args:
        fn: the work to time, called with no arguments; its result is discarded.
        warmup: untimed calls first (caches, lazy initialisation, allocator growth).
        repeats: timed calls (>= 1).
        device: synchronize this device around each call (CUDA only).

    Returns:
        The median of `repeats` wall times, in seconds.
    """
    if repeats < 1:
        raise ValueError(f"repeats: expected an integer >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cell(value: object) -> str:
    """A table cell: floats with 4 significant digits, everything else as str."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def gradient_error(g: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error ||g - ref|| / ||ref||, cosine) of gradient vector g against ref."""
    rel = float((g - ref).norm() / ref.norm())
    return rel, float(torch.nn.functional.cosine_similarity(g, ref, dim=0))


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A right-aligned plain-text table (header, rule, one line per row)."""
    cells = [[str(h) for h in header]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print `format_table(header, rows)`."""
    print(format_table(header, rows))


def _cpu_model() -> str | None:
    """The CPU's model name with its family and model numbers from /proc/cpuinfo (Linux), else
    None: the name alone can be the same for CPUs generations apart ("AMD EPYC" is Zen 1 on
    family 23 model 1, Zen 3 on family 25 model 1)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model"):
                    fields.setdefault(key, value.strip())
                if not line.strip() and fields:  # the first processor's block is enough
                    break
    except OSError:
        return None
    name = fields.get("model name")
    if name is None or "cpu family" not in fields:
        return name
    return f"{name} (family {fields['cpu family']}, model {fields.get('model', '?')})"


def _c_kernels_vectors() -> str:
    """How the C kernels were built here: in lane groups of 16 (AVX-512) or of 8."""
    from freqact.kernels import cpu

    if not cpu.available():
        return f"unavailable: {cpu.unavailable_reason()}"
    return "groups of 8 lanes (no AVX-512)" if cpu.vector_halves() else "groups of 16 lanes (AVX-512)"


def machine_info(device: torch.device | str | None = None) -> dict:
    """What the numbers depend on: versions, CPU and its vector path in the C kernels, threads,
    CPU count, load and the accelerator."""
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "c_kernels_vectors": _c_kernels_vectors(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        # A busy machine inflates every time; keep the load next to the numbers.
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device is not None and torch.device(device).type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(device)
        info["cuda_version"] = torch.version.cuda
    return info


def write_results(
    name: str, payload: dict, *, device: torch.device | str | None = None, directory: Path | None = None
) -> Path:
    """Write `payload` plus `machine_info(device)` to `<directory>/<name>.json` and return the path.

    Args:
        name: file stem, e.g. "dct-cpu".
        payload: JSON-serialisable results (lists/dicts of numbers and strings).
        device: recorded in the machine info.
        directory: defaults to benchmarks/results/.
    """
    directory = RESULTS_DIR if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    document = {"benchmark": name, "machine": machine_info(device), **payload}
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def resident_bytes() -> int:
    """The process's resident set in bytes, from /proc/self/smaps_rollup (a walk of the page
    tables, rather than statm's running counters)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/smaps_rollup has no Rss line")


def release_free_heap() -> None:
    """Hand memory the allocator holds free back to the system (glibc's malloc_trim), so that a
    later allocation cannot reuse it without growing the resident set. No-op without glibc."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


FRESH_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""What a fresh process measuring resident memory runs with: freed large buffers leave the set."""


def json_from_fresh_process(module: str, args: Sequence[str], env: dict | None = None):
    """The JSON `python -m <module> *args` prints last, run in a new interpreter from the repo root.

    Its stderr goes to ours, so a failing child shows its traceback. `env`: variables added to
    this process's environment (e.g. FRESH_MEMORY_ENV).
    """
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=Path(__file__).resolve().parents[1],
                         env=None if env is None else {**os.environ, **env}, check=True,
                         stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
