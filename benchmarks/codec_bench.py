"""DIVISION in training: codec speed, activation memory really held, and training-step time.

In one run:

1. division (B=8, Q=2) encode and decode of a (128, 64, 32, 32) float32 tensor, as ratios to
   `x.clone()` (goals: encode <= 5x, decode <= 3x);
2. activation memory held after the forward pass, normal vs `freqact.compress(model, "division")`
   vs `torch.utils.checkpoint` (one checkpoint per stage, the built-in peer), for CIFAR ResNet-18
   (batch 64, 32x32) and ResNet-50 (batch 4, 224x224). On the CPU: the growth of the resident set
   across the forward pass, each case in a fresh process run with MALLOC_MMAP_THRESHOLD_=65536 so
   that freed large buffers leave the resident set, after one warm-up step of the same batch
   whose freed memory is then trimmed (malloc_trim) so that it leaves the resident set too; on
   CUDA: `torch.cuda.memory_allocated`. Beside
   it the meter's figure for the same forward (saved_bytes with the codec, exact_bytes otherwise);
   they should agree within 10 % (goals: >= 10.5x less on ResNet-18, >= 11x on ResNet-50);
3. training-step time (forward, backward, SGD step) on CIFAR ResNet-18, batch 64, relative to
   normal training (goal: division <= 1.25x).

Prints a table and writes benchmarks/results/codec-<device>.json.

    python -m benchmarks.codec_bench                 # CPU
    python -m benchmarks.codec_bench --device cuda

`--spectral` instead times the paper's spectral caches in training (issue 16): the step time
(forward, backward, SGD step) of CIFAR ResNet-20, batch 128, normal vs `lfc` vs `hfc` (W/N 0.2,
the official window rule, as in the lfc-hfc-cpu study), the modes interleaved round by round and
the minimum over rounds kept (goal: lfc and hfc <= 1.3x normal). On a shared CPU that ratio moves
by 10-20 % from one process to the next (page faults, the heap's state, the neighbours' load), so
`--processes N` (default 5) repeats the measurement in N fresh processes and reports each
process's ratio, their median and range. Writes
benchmarks/results/codec-spectral-<device>[-<N>thread].json.

    python -m benchmarks.codec_bench --spectral --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    FRESH_MEMORY_ENV,
    json_from_fresh_process,
    median_time,
    print_table,
    release_free_heap,
    resident_bytes,
    write_results,
)
from freqact import codecs, models
from freqact.engine import compress

REPO_ROOT = Path(__file__).resolve().parents[1]
CODEC_SHAPE = (128, 64, 32, 32)
MEMORY_CASES = (("resnet18", 64, (3, 32, 32)), ("resnet50", 4, (3, 224, 224)))
MODES = ("normal", "division", "checkpoint")
DIVISION = {"block": 8, "bits": 2}
SPECTRAL_MODES = ("normal", "lfc", "hfc")
SPECTRAL = {"ratio": 0.2, "window_rule": "official"}
SPECTRAL_CASE = ("resnet20", 128, (3, 32, 32))


def _forward(model, x: torch.Tensor, mode: str) -> torch.Tensor:
    """The model's logits; with one non-reentrant checkpoint per ResNet stage for "checkpoint"."""
    if mode != "checkpoint":
        return model(x)
    h = model.stem(x)
    for stage in model.stages:
        h = checkpoint(stage, h, use_reentrant=False)
    return model.fc(torch.flatten(model.pool(h), 1))


def training_loss(model, x, y, mode: str):
    """Cross-entropy of one forward pass, and the meter when the forward ran inside compress."""
    if mode == "division":
        with compress(model, "division", **DIVISION) as meter:
            return F.cross_entropy(_forward(model, x, mode), y), meter
    return F.cross_entropy(_forward(model, x, mode), y), None


def _held_bytes(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return resident_bytes()


def measure_memory(name: str, batch: int, shape: tuple, mode: str, device: str) -> dict:
    """Bytes held across one forward pass (run in a fresh process for the CPU figure)."""
    torch.manual_seed(0)
    model = models.get(name, num_classes=10).to(device)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    # One full training step of the same batch first: one-time costs of its shapes (oneDNN
    # primitives and their JIT code, thread pools, code pages) are not activations. Then the
    # memory that step freed is handed back, so the measured forward cannot hide in it.
    loss, _ = training_loss(model, x, y, mode)
    loss.backward()
    del loss
    model.zero_grad(set_to_none=False)
    if device == "cpu":
        release_free_heap()
    before = _held_bytes(device)
    loss, meter = training_loss(model, x, y, mode)
    held = _held_bytes(device) - before
    loss.backward()
    del loss
    if meter is None:
        # What plain PyTorch holds for the same forward, counted by the meter: the exact codec keeps
        # every tensor, and exact_bytes counts each storage plain autograd would hold once.
        with compress(model, "exact") as meter:
            _forward(model, x, mode).sum()
        metered = meter.exact_bytes
    else:
        metered = meter.saved_bytes
    return {"model": name, "batch": batch, "mode": mode, "held_bytes": held,
            "meter_bytes": metered}


def _memory_in_fresh_process(name: str, batch: int, mode: str, device: str) -> dict:
    return json_from_fresh_process("benchmarks.codec_bench",
                                   ["--memory-case", name, str(batch), mode, "--device", device],
                                   env=FRESH_MEMORY_ENV)


def codec_speed(device: str, repeats: int) -> dict:
    """Median encode/decode/clone times of division on CODEC_SHAPE."""
    codec = codecs.get("division", **DIVISION)
    x = torch.randn(CODEC_SHAPE, device=device)
    packed = codec.encode(x)
    clone = median_time(lambda: x.clone(), repeats=repeats, device=device)
    encode = median_time(lambda: codec.encode(x), repeats=repeats, device=device)
    decode = median_time(lambda: codec.decode(packed), repeats=repeats, device=device)
    return {"shape": list(CODEC_SHAPE), "clone_ms": clone * 1e3, "encode_ms": encode * 1e3,
            "decode_ms": decode * 1e3, "encode_vs_clone": encode / clone,
            "decode_vs_clone": decode / clone, "ratio": x.numel() * 4 / packed.nbytes}


def step_times(device: str, repeats: int) -> dict:
    """Median training-step time per mode, CIFAR ResNet-18, batch 64.

    The modes take turns (one step each per round, `repeats` rounds after a warm-up round), so a
    drift in the machine's speed reaches every mode alike instead of skewing their ratios.
    """
    torch.manual_seed(0)
    model = models.get("resnet18", num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def step(mode):
        optimizer.zero_grad(set_to_none=True)
        loss, _ = training_loss(model, x, y, mode)
        loss.backward()
        optimizer.step()

    times = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            times[mode].append(median_time(lambda mode=mode: step(mode), warmup=1, repeats=1,
                                           device=device))
    return {mode: statistics.median(seconds) for mode, seconds in times.items()}


def spectral_step_times(device: str, rounds: int, batch: int | None = None) -> dict:
    """Minimum training-step time per mode of SPECTRAL_MODES, on SPECTRAL_CASE (CIFAR ResNet-20).

    The modes take turns (one step each per round, `rounds` rounds after a warm-up round); the
    minimum over rounds is the least disturbed figure on a shared machine. `batch` defaults to
    SPECTRAL_CASE's (128).
    """
    torch.manual_seed(0)
    name, case_batch, shape = SPECTRAL_CASE
    batch = case_batch if batch is None else batch
    model = models.get(name, num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, *shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step(mode):
        optimizer.zero_grad(set_to_none=True)
        if mode == "normal":
            loss = F.cross_entropy(model(x), y)
        else:
            with compress(model, mode, **SPECTRAL):
                loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    times = {mode: [] for mode in SPECTRAL_MODES}
    for round_ in range(rounds + 1):
        for mode in SPECTRAL_MODES:
            seconds = median_time(lambda mode=mode: step(mode), warmup=0, repeats=1, device=device)
            if round_:  # round 0 warms up every mode
                times[mode].append(seconds)
    return {mode: min(seconds) for mode, seconds in times.items()}


def _spectral_in_fresh_process(device: str, rounds: int, threads: int | None,
                               batch: int | None) -> dict:
    """spectral_step_times in a new interpreter: {mode: seconds}."""
    args = ["--spectral-process", "--device", device, "--repeats", str(rounds)]
    args += [] if threads is None else ["--threads", str(threads)]
    args += [] if batch is None else ["--spectral-batch", str(batch)]
    return json_from_fresh_process("benchmarks.codec_bench", args)


def _spectral_main(device: str, rounds: int, threads: int | None, out: str | None,
                   processes: int, batch: int | None) -> int:
    if processes == 1:
        runs = [spectral_step_times(device, rounds, batch)]
    else:
        runs = [_spectral_in_fresh_process(device, rounds, threads, batch) for _ in range(processes)]
    ratios = {m: [run[m] / run["normal"] for run in runs] for m in SPECTRAL_MODES}
    # Each mode's median step over the processes; the ratios are the medians of each process's own
    # ratio (the two medians need not come from one process, so steps need not divide to them).
    steps = {m: statistics.median(run[m] for run in runs) for m in SPECTRAL_MODES}
    name, case_batch, _ = SPECTRAL_CASE
    batch = case_batch if batch is None else batch
    print_table([f"{name} b{batch} step", "median min s", "vs normal (median)", "lowest", "highest"],
                [[m, steps[m], statistics.median(r), min(r), max(r)] for m, r in ratios.items()])
    print(f"{processes} process(es) x {rounds} round(s); per process: " + "; ".join(
        f"{m} " + " ".join(f"{v:.2f}" for v in r) for m, r in ratios.items() if m != "normal"))
    payload = {"settings": {"model": name, "batch": batch, "rounds": rounds,
                            "processes": processes, **SPECTRAL},
               "step_seconds": steps,
               "step_vs_normal": {m: statistics.median(r) for m, r in ratios.items()},
               "step_vs_normal_range": {m: [min(r), max(r)] for m, r in ratios.items()},
               "per_process": [{"step_seconds": run,
                                "step_vs_normal": {m: run[m] / run["normal"] for m in run}}
                               for run in runs]}
    path = write_results(f"codec-spectral-{device}" + (f"-{threads}thread" if threads else ""),
                         payload, device=device, directory=None if out is None else Path(out))
    print(f"wrote {path}")
    return 0


def memory_rows(device: str) -> list[dict]:
    """`measure_memory` of every MEMORY_CASES model and mode (CPU: each in a fresh process), with
    its ratio to normal and the meter's to the held bytes."""
    memory = []
    for name, batch, shape in MEMORY_CASES:
        for mode in MODES:
            if device == "cuda":  # memory_allocated needs no fresh process
                memory.append(measure_memory(name, batch, shape, mode, device))
            else:
                memory.append(_memory_in_fresh_process(name, batch, mode, device))
    normal = {r["model"]: r["held_bytes"] for r in memory if r["mode"] == "normal"}
    for r in memory:
        r["less_than_normal"] = normal[r["model"]] / r["held_bytes"]
        r["meter_vs_held"] = r["meter_bytes"] / r["held_bytes"]
    return memory


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    """The parsed and checked command line (argparse exits with code 2 on bad values)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls per median (--spectral: rounds)")
    parser.add_argument("--spectral", action="store_true",
                        help="only the lfc/hfc training-step times (ResNet-20, batch 128)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--processes", type=int, default=None,
                        help="--spectral: fresh processes to measure in (default 5; 1: this one)")
    parser.add_argument("--out", default=None,
                        help="folder of the --spectral JSON results (default benchmarks/results)")
    parser.add_argument("--spectral-process", action="store_true",
                        help=argparse.SUPPRESS)  # internal: one process's step times, JSON on stdout
    parser.add_argument("--spectral-batch", type=int, default=None,
                        help=argparse.SUPPRESS)  # internal: a smaller batch for tests
    parser.add_argument("--memory-case", nargs=3, metavar=("MODEL", "BATCH", "MODE"),
                        help=argparse.SUPPRESS)  # internal: one memory case, JSON on stdout
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device available")
    for name in ("processes", "spectral_batch"):
        if getattr(args, name) is not None and not (args.spectral or args.spectral_process):
            parser.error(f"--{name.replace('_', '-')}: only with --spectral")
    for name in ("repeats", "threads", "processes", "spectral_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.spectral_process:
        print(json.dumps(spectral_step_times(args.device, args.repeats, args.spectral_batch)))
        return 0
    if args.spectral:
        return _spectral_main(args.device, args.repeats, args.threads, args.out,
                              5 if args.processes is None else args.processes, args.spectral_batch)
    if args.memory_case:
        name, batch, mode = args.memory_case
        shape = dict((n, s) for n, _, s in MEMORY_CASES)[name]
        print(json.dumps(measure_memory(name, int(batch), shape, mode, args.device)))
        return 0

    speed = codec_speed(args.device, args.repeats)
    print_table(["division B=8 Q=2", "clone ms", "encode ms", "decode ms", "encode/clone",
                 "decode/clone", "ratio"],
                [["x".join(map(str, CODEC_SHAPE)), speed["clone_ms"], speed["encode_ms"],
                  speed["decode_ms"], speed["encode_vs_clone"], speed["decode_vs_clone"],
                  speed["ratio"]]])
    print()

    memory = memory_rows(args.device)
    held_by = "resident-set growth" if args.device == "cpu" else "memory_allocated"
    print_table(["model", "batch", "mode", f"held MB ({held_by})", "meter MB", "meter/held",
                 "x less than normal"],
                [[r["model"], r["batch"], r["mode"], r["held_bytes"] / 2**20,
                  r["meter_bytes"] / 2**20, r["meter_vs_held"], r["less_than_normal"]]
                 for r in memory])
    print()

    steps = step_times(args.device, args.repeats)
    print_table(["ResNet-18 b64 step", "median s", "vs normal"],
                [[mode, seconds, seconds / steps["normal"]] for mode, seconds in steps.items()])

    payload = {"settings": {"division": DIVISION, "repeats": args.repeats,
                            "malloc_mmap_threshold": 65536 if args.device == "cpu" else None},
               "codec": speed, "memory": memory,
               "step_seconds": steps,
               "step_vs_normal": {m: s / steps["normal"] for m, s in steps.items()}}
    path = write_results(f"codec-{args.device}", payload, device=args.device)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
