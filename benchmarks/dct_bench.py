"""Time `freqact.dct` against `scipy.fft.dctn` and (when installed) `torch_dct.dct_2d`.

2D orthonormal DCT-II of float32 activation batches, all methods side by side in one run:
`freqact` (what `freqact.dct.dct` runs: the fused C kernels on the CPU when no gradient is needed),
`freqact-out` (the same into a reused buffer, `dct(x, out=buf)`: no fresh output pages),
`freqact-matmul` (its matmul reference path, FREQACT_KERNELS=torch; the path autograd uses), scipy
and torch-dct. The methods take turns, one call each per round (drift on a shared machine reaches
all alike); then each method is also timed alone, `repeats` calls in a row, as timeit would
(scipy then runs with its own data warm in the caches, which the turns deny it). Prints a table
(median and min time over the rounds, scipy's median over each method's, the same ratio timed
alone, freqact's speed-up over each method, max relative error against a float64 scipy oracle,
rel. error = max|a - b| / max|b|) and writes <out>/dct-<device>[-<N>thread].json (default out:
benchmarks/results).

    python -m benchmarks.dct_bench                # CPU
    python -m benchmarks.dct_bench --device cuda  # freqact/torch-dct on the GPU, scipy on the CPU

By default scipy uses every core (workers=-1) and torch its default thread count; `--threads N`
gives both N threads (`--threads 1` compares the algorithms when other jobs share the cores).
The issue's target shape is the first one, (128, 64, 32, 32), with `--threads 2`.
torch-dct is optional (`pip install torch-dct`), never a freqact dependency.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy
import scipy.fft
import torch

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median_time, print_table, write_results
from freqact.dct import dct

SHAPES = ((128, 64, 32, 32), (32, 64, 56, 56))


def _matmul_reference(x: torch.Tensor) -> torch.Tensor:
    """freqact's matmul path (the reference and the autograd path), with the C kernels off."""
    before = os.environ.get("FREQACT_KERNELS")
    os.environ["FREQACT_KERNELS"] = "torch"
    try:
        return dct(x, dims=2)
    finally:
        if before is None:
            del os.environ["FREQACT_KERNELS"]
        else:
            os.environ["FREQACT_KERNELS"] = before


def _methods(x: torch.Tensor, workers: int) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a call returning the 2D DCT of x (as a tensor) with that implementation."""
    x_np = x.cpu().numpy()
    buffer = torch.empty_like(x)
    methods = {
        "freqact": lambda: dct(x, dims=2),
        "freqact-out": lambda: dct(x, dims=2, out=buffer),
        "freqact-matmul": lambda: _matmul_reference(x),
        "scipy": lambda: torch.from_numpy(
            scipy.fft.dctn(x_np, type=2, norm="ortho", axes=(-2, -1), workers=workers)
        ),
    }
    if importlib.util.find_spec("torch_dct") is not None:
        import torch_dct

        methods["torch-dct"] = lambda: torch_dct.dct_2d(x, norm="ortho")
    return methods


def _torch_dct_version() -> str | None:
    """The installed torch-dct version, or None when it is absent."""
    try:
        return importlib.metadata.version("torch-dct")
    except importlib.metadata.PackageNotFoundError:
        return None


def _rel_error(result: torch.Tensor, reference: np.ndarray) -> float:
    """max|a - b| / max|b| against the float64 reference."""
    diff = np.abs(result.detach().cpu().double().numpy() - reference).max()
    return float(diff / np.abs(reference).max())


def run(
    device: str = "cpu", warmup: int = 2, repeats: int = 7, workers: int = -1, seed: int = 0
) -> list[dict]:
    """Time every method on every shape; return one dict per (shape, method).

    Each method gets `warmup` untimed calls, then `repeats` rounds in which every method runs
    once; then each method alone, `warmup` untimed and `repeats` timed calls in a row ("alone"
    columns). `workers` is scipy's thread count (-1: every core); set torch's with
    torch.set_num_threads.
    """
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for shape in SHAPES:
        x = torch.randn(shape, generator=generator).to(device)
        reference = scipy.fft.dctn(x.cpu().double().numpy(), type=2, norm="ortho", axes=(-2, -1))
        methods = _methods(x, workers)
        errors = {name: _rel_error(fn(), reference) for name, fn in methods.items()}
        for fn in methods.values():
            for _ in range(warmup - 1):  # the error check was the first warm-up call
                fn()
        times = {name: [] for name in methods}
        for _ in range(repeats):
            for name, fn in methods.items():
                # scipy always runs on the host, so only the torch methods synchronize the device.
                sync = None if name == "scipy" else device
                times[name].append(median_time(fn, warmup=0, repeats=1, device=sync))
        median = {name: float(np.median(seconds)) for name, seconds in times.items()}
        alone = {name: median_time(fn, warmup=warmup, repeats=repeats,
                                   device=None if name == "scipy" else device)
                 for name, fn in methods.items()}
        for name, seconds in times.items():
            rows.append(
                {
                    "shape": list(shape),
                    "method": name,
                    "device": "cpu" if name == "scipy" else device,
                    "median_ms": median[name] * 1e3,
                    "min_ms": min(seconds) * 1e3,
                    "speedup_over_scipy": median["scipy"] / median[name],
                    "alone_median_ms": alone[name] * 1e3,
                    "alone_speedup_over_scipy": alone["scipy"] / alone[name],
                    "freqact_speedup": median[name] / median["freqact"],
                    "max_rel_error": errors[name],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch and scipy threads")
    parser.add_argument("--out", default=None, help="folder of the JSON results (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads: expected an integer >= 1, got {args.threads}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = run(args.device, args.warmup, args.repeats, workers=args.threads or -1)
    print_table(
        ["shape", "method", "device", "median ms", "min ms", "scipy / this", "alone ms",
         "scipy / this alone", "freqact speed-up", "max rel. error"],
        [
            ["x".join(map(str, r["shape"])), r["method"], r["device"], r["median_ms"], r["min_ms"],
             r["speedup_over_scipy"], r["alone_median_ms"], r["alone_speedup_over_scipy"],
             r["freqact_speedup"], r["max_rel_error"]]
            for r in rows
        ],
    )
    settings = {
        "dtype": "float32",
        "dims": 2,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "scipy_workers": args.threads or -1,
        "versions": {
            "numpy": np.__version__,
            "scipy": scipy.__version__,
            "torch_dct": _torch_dct_version(),
        },
    }
    name = f"dct-{args.device}" + (f"-{args.threads}thread" if args.threads else "")
    path = write_results(name, {"settings": settings, "rows": rows}, device=args.device,
                         directory=None if args.out is None else Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
