"""GPU benchmark of the DIVISION Triton kernels and of training with compressed activations.

One prepared run (under 8 minutes on one H200), in this order:
1. correctness on the device: Triton vs the torch reference, byte for byte with shared uniforms,
   and cross decoding; any difference is reported and makes the exit code 1 (the measurements
   still run);
2. device copy bandwidth (a large device-to-device copy; bytes read + written);
3. encode / decode GB/s of the Triton kernels (and the torch reference beside them) on
   (256, 64, 56, 56) and (128, 256, 14, 14), fp32 and bf16: encode moves input read + packed
   written, decode the reverse;
4. training images/s of CIFAR ResNet-18 (batch 256) and ResNet-50 at 224² (batches 64 and 128) in
   normal, division and torch.utils.checkpoint modes, with `torch.cuda.memory_allocated` growth
   over the forward pass (what backward will read) and the peak growth over the step.
Times are medians over timed iterations after warm-up, synchronised. The table comes last; JSON
goes to `--out`. Goals: encode and decode >= 75 % of copy bandwidth, division / normal images/s
>= 0.90, activation memory >= 11.5x smaller on ResNet-50.

`--quick` is a CPU-safe dry run of every stage on tiny sizes (the kernels in Triton's interpreter
when TRITON_INTERPRET=1, else the torch reference alone); tests/test_gpu_bench.py runs it.

Run from the repository root: ``python -m benchmarks.gpu_bench --out results.json``.
"""
from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.codec_bench import DIVISION, MODES, training_loss
from benchmarks.common import RESULTS_DIR, format_table, median_time, write_results
from freqact import kernels, models
from freqact.kernels import format

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Correctness cases: (shape, dtypes, bits values). Every case compiles its own kernels (shapes are
# compile-time constants), so the full grid runs on one odd 2D shape and spot checks on the rest.
FULL = {
    "checks": [((3, 5, 7, 9), ALL_DTYPES, format.BITS), ((2, 3, 20, 23), ALL_DTYPES, (2,)),
               ((4, 64, 56, 56), (torch.float32,), (2,)), ((2, 7), (torch.bfloat16,), (4,)),
               ((2, 3, 3, 9, 10), (torch.float16,), (1, 8))],
    "copy_bytes": 2**30,
    "codec_shapes": [(256, 64, 56, 56), (128, 256, 14, 14)],
    "codec_dtypes": [torch.float32, torch.bfloat16],
    "calls_per_timing": 10,
    "train": [("resnet18", 256, 10), ("resnet50", 64, 1000), ("resnet50", 128, 1000)],
    "warmup": 3,
    "repeats": 10,
}
QUICK = {
    "checks": [((1, 2, 5, 9), ALL_DTYPES, format.BITS)],
    "copy_bytes": 2**20,
    "codec_shapes": [(2, 3, 9, 9)],
    "codec_dtypes": [torch.float32],
    "calls_per_timing": 1,
    "train": [("resnet20", 2, 10)],
    "warmup": 0,
    "repeats": 1,
}
GOALS = {"codec_vs_copy": 0.75, "division_vs_normal_ips": 0.90, "resnet50_memory_ratio": 11.5}


def triton_usable(device: str) -> bool:
    """Whether the Triton backend can run on `device` here (natively or interpreted)."""
    try:
        return kernels.backend_for(torch.empty(0, device=device), "triton") == "triton"
    except (RuntimeError, ValueError):
        return False


def check_correctness(device: str, cases) -> list[dict]:
    """Triton vs reference on `device`; `cases` lists (shape, dtypes, bits values); one row per
    shape x dtype x bits.

    Inputs lie on a 2**-8 grid so that block sums are exact in any summation order: every byte
    must then match. `ok` also requires that each backend decodes the other's form bit-identically.
    """
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape, dtypes, bits_values in cases:
        for dtype in dtypes:
            for bits in bits_values:
                x = torch.randn(shape, generator=gen).mul_(256).round_().div_(256)
                x = x.to(device=device, dtype=dtype)
                noise = torch.rand(shape, generator=gen).to(device)
                got = kernels.division_encode(x, 8, bits, noise, backend="triton")
                want = kernels.division_encode(x, 8, bits, noise, backend="torch")
                same = all(
                    torch.equal(getattr(got, f).view(torch.uint8), getattr(want, f).view(torch.uint8))
                    for f in ("lfc", "lo", "step", "codes"))
                x_hat = kernels.division_decode(want, backend="torch")
                cross = (torch.equal(kernels.division_decode(want, backend="triton"), x_hat)
                         and torch.equal(kernels.division_decode(got, backend="torch"), x_hat))
                rows.append({"shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                             "bits": bits, "bytes_equal": same, "cross_decode_equal": cross,
                             "ok": same and cross})
    return rows


def copy_bandwidth(device: str, nbytes: int, warmup: int, repeats: int) -> float:
    """GB/s of a device-to-device copy of `nbytes`, counting bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, device=device)
    return 2 * nbytes / seconds / 1e9


def codec_bandwidth(device: str, shape, dtype, backend: str, calls: int, warmup: int,
                    repeats: int) -> dict:
    """Encode / decode GB/s on one shape; `calls` back-to-back calls per timing (launch overhead
    overlaps with the kernels, as in training)."""
    x = torch.randn(shape, device=device, dtype=dtype)
    packed = kernels.division_encode(x, backend=backend, **DIVISION)
    moved = x.numel() * x.element_size() + packed.nbytes

    def encode():
        for _ in range(calls):
            kernels.division_encode(x, backend=backend, **DIVISION)

    def decode():
        for _ in range(calls):
            kernels.division_decode(packed, backend=backend)

    enc = median_time(encode, warmup=warmup, repeats=repeats, device=device) / calls
    dec = median_time(decode, warmup=warmup, repeats=repeats, device=device) / calls
    return {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "backend": backend,
            "bytes_moved": moved, "encode_ms": enc * 1e3, "decode_ms": dec * 1e3,
            "encode_gbs": moved / enc / 1e9, "decode_gbs": moved / dec / 1e9}


def train_throughput(device: str, name: str, batch: int, classes: int, mode: str, warmup: int,
                     repeats: int) -> dict:
    """Images/s of SGD steps, and the memory autograd holds after the forward pass."""
    torch.manual_seed(0)
    model = models.get(name, num_classes=classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, *model.input_shape, device=device)
    y = torch.randint(classes, (batch,), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss, _ = training_loss(model, x, y, mode)
        loss.backward()
        optimizer.step()

    seconds = median_time(step, warmup=warmup, repeats=repeats, device=device)
    row = {"model": name, "batch": batch, "mode": mode, "images_per_s": batch / seconds,
           "step_ms": seconds * 1e3, "activation_bytes": None, "peak_bytes": None}
    optimizer.zero_grad(set_to_none=True)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        loss, meter = training_loss(model, x, y, mode)
        row["activation_bytes"] = torch.cuda.memory_allocated(device) - base
        loss.backward()
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    else:
        loss, meter = training_loss(model, x, y, mode)
        loss.backward()
    row["meter_saved_bytes"] = None if meter is None else meter.saved_bytes
    return row


def _goals(copy_gbs: float, codec_rows: list[dict], train_rows: list[dict]) -> dict:
    """Each goal: measured value, target and whether it is met (None when not measured)."""
    triton_rows = [r for r in codec_rows if r["backend"] == "triton"]
    worst = min((min(r["encode_gbs"], r["decode_gbs"]) for r in triton_rows), default=None)
    by_key = {(r["model"], r["batch"], r["mode"]): r for r in train_rows}
    ips = [r["images_per_s"] / by_key[(r["model"], r["batch"], "normal")]["images_per_s"]
           for r in train_rows if r["mode"] == "division"]
    mem = [by_key[(r["model"], r["batch"], "normal")]["activation_bytes"] / r["activation_bytes"]
           for r in train_rows
           if r["mode"] == "division" and r["model"] == "resnet50" and r["activation_bytes"]]
    values = {"codec_vs_copy": None if worst is None else worst / copy_gbs,
              "division_vs_normal_ips": min(ips, default=None),
              "resnet50_memory_ratio": min(mem, default=None)}
    return {k: {"value": v, "target": GOALS[k], "met": None if v is None else v >= GOALS[k]}
            for k, v in values.items()}


def tables(result: dict) -> str:
    """The plain-text tables of a result document."""
    copy = result["copy_gbs"]
    parts = [f"device copy bandwidth: {copy:.4g} GB/s (read + write)", format_table(
        ["shape", "dtype", "backend", "encode GB/s", "decode GB/s", "enc/copy", "dec/copy"],
        [[tuple(r["shape"]), r["dtype"], r["backend"], r["encode_gbs"], r["decode_gbs"],
          r["encode_gbs"] / copy, r["decode_gbs"] / copy] for r in result["codec"]])]
    mib = 2.0**20
    parts.append(format_table(
        ["model", "batch", "mode", "images/s", "step ms", "activations MiB", "peak MiB",
         "meter MiB"],
        [[r["model"], r["batch"], r["mode"], r["images_per_s"], r["step_ms"],
          *(None if r[k] is None else r[k] / mib
            for k in ("activation_bytes", "peak_bytes", "meter_saved_bytes"))]
         for r in result["train"]]))
    parts.append(format_table(["goal", "value", "target", "met"],
                              [[k, g["value"], g["target"], g["met"]]
                               for k, g in result["goals"].items()]))
    return "\n\n".join(parts)


def run(device: str, sizes: dict) -> dict:
    """Every stage of the benchmark on `device` with the given sizes; the result document."""
    checks = check_correctness(device, sizes["checks"]) if triton_usable(device) else []
    backends = ["triton", "torch"] if triton_usable(device) else ["torch"]
    warmup, repeats = sizes["warmup"], sizes["repeats"]
    copy_gbs = copy_bandwidth(device, sizes["copy_bytes"], warmup, repeats)
    codec = [codec_bandwidth(device, shape, dtype, backend, sizes["calls_per_timing"], warmup,
                             repeats)
             for shape in sizes["codec_shapes"] for dtype in sizes["codec_dtypes"]
             for backend in backends]
    train = [train_throughput(device, name, batch, classes, mode, warmup, repeats)
             for name, batch, classes in sizes["train"] for mode in MODES]
    # correct is None when the Triton backend cannot run here (nothing was checked).
    correct = all(r["ok"] for r in checks) if checks else None
    return {"device": device, "correct": correct, "checks": checks,
            "copy_gbs": copy_gbs, "codec": codec, "train": train,
            "goals": _goals(copy_gbs, codec, train)}


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run, print the tables, write the JSON; 1 if a correctness check failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"gpu-{stamp}.json",
                        help="JSON result path (default: benchmarks/results/gpu-<date>.json)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny CPU-safe dry run of every stage (for the tests)")
    args = parser.parse_args(argv)
    if args.quick:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("gpu_bench: no CUDA device; use --quick for a CPU dry run", file=sys.stderr)
        return 2
    if not args.quick:
        torch.backends.cudnn.benchmark = True  # warm-up iterations absorb the autotuning
    result = run(device, QUICK if args.quick else FULL)
    result["quick"] = args.quick
    bad = [r for r in result["checks"] if not r["ok"]]
    if bad:
        print(f"gpu_bench: {len(bad)} correctness checks failed, first: {bad[0]}", file=sys.stderr)
    path = write_results(args.out.stem, result, device=device, directory=args.out.parent)
    print(tables(result))
    print(f"\nwritten: {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
