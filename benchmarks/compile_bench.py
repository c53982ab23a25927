"""DIVISION inside torch.compile graphs: activation memory held and training-step time.

In one run, for CIFAR ResNet-18 and the small ViT (`freqact.models.get("vit")`), batch 64, 32x32:

1. activation memory held after the forward pass, `torch.compile(model)` alone ("compiled") vs
   inside `freqact.compress(compiled, "division")` ("compiled+division"): the growth of the
   resident set across the forward pass, each case in a fresh process (as benchmarks/codec_bench.py
   measures it: MALLOC_MMAP_THRESHOLD_=65536, one warm-up step that also compiles, then the freed
   heap trimmed) (goal: >= 8x less);
2. training-step time (forward, backward, SGD step), modes taking turns: compiled,
   compiled+division, eager+division (the uncompiled model in compress) and "compiled
   layout-off" (compiled normal training with Inductor's layout optimization off, as division
   compiles the graphs: it splits compiled+division's cost into the layout's and the codec's)
   (goal on the CPU: compiled+division <= 1.15x compiled);
3. with `--alone N`, the same step as a user's training runs it: compiled and compiled+division
   each in a fresh process of its own (3 warm-up steps, the first compiling, then the median of
   10 timed steps and of their minor page faults), N rounds of one process per mode, their order
   alternating; the ratio of each round's pair, median and range. Taking turns in one process
   keeps the allocator's heap populated by the other modes; alone, glibc's malloc hands the
   freed activations back to the system after each step and the next step faults them in again
   (compiled ViT b64: 12-64k faults a step; `MALLOC_TRIM_THRESHOLD_` and `MALLOC_MMAP_THRESHOLD_`,
   inherited by the processes and recorded in the JSON, change that).

Prints a table and writes benchmarks/results/compile-cpu.json (`--out` another file).

    python -m benchmarks.compile_bench                   # both models
    python -m benchmarks.compile_bench --models resnet18
    python -m benchmarks.compile_bench --repeats 3 --out X.json   # a rerun beside the table's
    python -m benchmarks.compile_bench --profile          # per-op breakdown of the extra time
    python -m benchmarks.compile_bench --alone 3          # + each mode in fresh processes
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    FRESH_MEMORY_ENV,
    RESULTS_DIR,
    json_from_fresh_process,
    median_time,
    print_table,
    release_free_heap,
    resident_bytes,
    write_results,
)
from freqact import models
from freqact.engine import compress
from freqact.engine.compiled import division_compile_settings

REPO_ROOT = Path(__file__).resolve().parents[1]
CASES = (("resnet18", 64), ("vit", 64))
MEMORY_MODES = ("compiled", "compiled+division")
STEP_MODES = ("compiled", "compiled+division", "eager+division", "compiled layout-off")
DIVISION = {"block": 8, "bits": 2}


def _setup(name: str, batch: int):
    torch.manual_seed(0)
    model = models.get(name, num_classes=10)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    return model, torch.compile(model), x, y


def _loss(model, compiled, x, y, mode: str) -> torch.Tensor:
    net = model if mode.startswith("eager") else compiled
    if mode.endswith("division"):
        with compress(net, "division", **DIVISION):
            return F.cross_entropy(net(x), y)
    with (division_compile_settings() if mode.endswith("layout-off")
          else contextlib.nullcontext()):
        return F.cross_entropy(net(x), y)


def measure_memory(name: str, batch: int, mode: str) -> dict:
    """Resident-set growth across one forward pass, after a warm-up step that compiles."""
    model, compiled, x, y = _setup(name, batch)
    _loss(model, compiled, x, y, mode).backward()
    model.zero_grad(set_to_none=False)
    release_free_heap()
    before = resident_bytes()
    loss = _loss(model, compiled, x, y, mode)
    held = resident_bytes() - before
    loss.backward()
    return {"model": name, "batch": batch, "mode": mode, "held_bytes": held}


def _memory_in_fresh_process(name: str, batch: int, mode: str) -> dict:
    return json_from_fresh_process("benchmarks.compile_bench", ["--memory-case", name, str(batch), mode],
                                   env=FRESH_MEMORY_ENV)


def layout_off_twin(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(a copy of model, the copy compiled with Inductor's layout optimization off): graphs of
    its own. Dynamo guards on the compile backend, not on which module instance runs, so
    `torch.compile(copy.deepcopy(model))` alone reused model's compiled (layout-on) graphs: the
    "compiled layout-off" row timed the "compiled" graphs until 2026-12-02."""
    twin = copy.deepcopy(model)
    return twin, torch.compile(twin, options={"layout_optimization": False})


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def _train_step(model, compiled, optimizer, x, y, mode: str) -> None:
    """One training step (forward, backward, SGD step) of `mode` (see `_loss`)."""
    optimizer.zero_grad(set_to_none=True)
    _loss(model, compiled, x, y, mode).backward()
    optimizer.step()


def step_times(name: str, batch: int, repeats: int) -> dict:
    """Median training-step seconds per mode; the modes take turns (one step each per round)."""
    model, compiled, x, y = _setup(name, batch)
    twin, compiled_twin = layout_off_twin(model)
    nets = {mode: (model, compiled) for mode in STEP_MODES}
    nets["compiled layout-off"] = (twin, compiled_twin)
    optimizers = {id(m): _optimizer(m) for m in (model, twin)}

    def step(mode):
        net, compiled_net = nets[mode]
        _train_step(net, compiled_net, optimizers[id(net)], x, y, mode)

    for mode in STEP_MODES:  # compiles each mode's graphs before any timing
        step(mode)
    times = {mode: [] for mode in STEP_MODES}
    for _ in range(repeats):
        for mode in STEP_MODES:
            times[mode].append(median_time(lambda m=mode: step(m), warmup=0, repeats=1))
    return {mode: statistics.median(seconds) for mode, seconds in times.items()}


ALONE_MODES = ("compiled", "compiled+division")
ALONE_WARMUP = 3  # untimed steps in each fresh process, the first compiling
ALONE_STEPS = 10


def step_alone(name: str, batch: int, mode: str, steps: int = ALONE_STEPS) -> dict:
    """One mode's training step in this process alone: median seconds and minor page faults per
    step over `steps` steps, after ALONE_WARMUP untimed ones (the first compiles)."""
    model, compiled, x, y = _setup(name, batch)
    optimizer = _optimizer(model)
    seconds, faults = [], []
    for i in range(ALONE_WARMUP + steps):
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        _train_step(model, compiled, optimizer, x, y, mode)
        if i >= ALONE_WARMUP:
            seconds.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    return {"model": name, "mode": mode, "median_s": statistics.median(seconds),
            "min_s": min(seconds), "page_faults": statistics.median(faults)}


def steps_alone(name: str, batch: int, rounds: int) -> dict:
    """`rounds` pairs of fresh processes (`step_alone`, the modes' order alternating): each
    process's result, and the ratio compiled+division / compiled of each pair's medians."""
    runs, ratios = [], []
    for round_ in range(rounds):
        order = ALONE_MODES if round_ % 2 == 0 else ALONE_MODES[::-1]
        pair = {mode: json_from_fresh_process(
            "benchmarks.compile_bench", ["--step-case", name, str(batch), mode]) for mode in order}
        runs += [pair[mode] for mode in order]
        ratios.append(pair["compiled+division"]["median_s"] / pair["compiled"]["median_s"])
    return {"runs": runs, "ratios": ratios, "ratio_median": statistics.median(ratios)}


def alone_rows(alone: dict) -> list[list]:
    """Table rows of `steps_alone` results per model: per mode the processes' median steps, their
    median page faults, and (on the division row) the pairs' ratio, median and range."""
    rows = []
    for name, result in alone.items():
        for mode in ALONE_MODES:
            runs = [r for r in result["runs"] if r["mode"] == mode]
            ratio = (f"{result['ratio_median']:.3f} ({min(result['ratios']):.3f}-"
                     f"{max(result['ratios']):.3f})" if mode == "compiled+division" else "")
            rows.append([name, mode, " ".join(f"{r['median_s']:.3f}" for r in runs),
                         statistics.median(r["page_faults"] for r in runs), ratio])
    return rows


def profile_breakdown(name: str, batch: int, steps: int = 3, rounds: int = 2) -> list[list]:
    """Where compiled+division's extra step time goes: per op (torch.profiler self CPU time, the
    Inductor-generated kernels and their Python counted under "compiled graph"), ms per training
    step in compiled and compiled+division mode, each the least of `rounds` profiles of `steps`
    steps (the modes take turns). Rows: [op, compiled ms, division ms, extra ms], largest extra
    first, then a total row."""
    from torch.profiler import ProfilerActivity, profile

    model, compiled, x, y = _setup(name, batch)
    modes = ("compiled", "compiled+division")

    def step(mode):
        model.zero_grad(set_to_none=True)
        _loss(model, compiled, x, y, mode).backward()

    for mode in modes * 2:  # compiles, then one warm step each
        step(mode)
    best = {mode: {} for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step(mode)
            per_op: dict = {}
            for event in prof.key_averages():
                key = ("compiled graph" if event.key.startswith("## Call CompiledFxGraph")
                       else event.key)
                per_op[key] = per_op.get(key, 0.0) + event.self_cpu_time_total / 1e3 / steps
            for key in per_op.keys() | best[mode].keys():
                best[mode][key] = min(best[mode].get(key, float("inf")), per_op.get(key, 0.0))
    plain, coded = best["compiled"], best["compiled+division"]
    rows = [[key, plain.get(key, 0.0), coded.get(key, 0.0), coded.get(key, 0.0) - plain.get(key, 0.0)]
            for key in plain.keys() | coded.keys()]
    rows.sort(key=lambda row: -abs(row[3]))
    total = [sum(row[i] for row in rows) for i in (1, 2)]
    return rows + [["total", *total, total[1] - total[0]]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per median")
    parser.add_argument("--models", nargs="+", default=[n for n, _ in CASES],
                        choices=[n for n, _ in CASES], help="the models to run (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="print where compiled+division's extra step time goes, per op "
                             "(torch.profiler), instead of the memory and step tables")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "compile-cpu.json",
                        help="results JSON (default results/compile-cpu.json)")
    parser.add_argument("--alone", type=int, default=0, metavar="N",
                        help="also time each mode alone in fresh processes, N rounds (default 0)")
    parser.add_argument("--step-case", nargs=3, metavar=("MODEL", "BATCH", "MODE"),
                        help=argparse.SUPPRESS)  # internal: one mode's steps alone, JSON on stdout
    parser.add_argument("--memory-case", nargs=3, metavar=("MODEL", "BATCH", "MODE"),
                        help=argparse.SUPPRESS)  # internal: one memory case, JSON on stdout
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: expected an integer >= 1, got {args.repeats}")
    if args.alone < 0:
        parser.error(f"--alone: expected an integer >= 0, got {args.alone}")
    if args.alone and args.profile:
        parser.error("--alone: times the steps, which --profile does not; give one of them")
    if args.step_case:
        name, batch, mode = args.step_case
        print(json.dumps(step_alone(name, int(batch), mode)))
        return 0
    if args.memory_case:
        name, batch, mode = args.memory_case
        print(json.dumps(measure_memory(name, int(batch), mode)))
        return 0

    cases = [(name, batch) for name, batch in CASES if name in args.models]
    if args.profile:
        for name, batch in cases:
            rows = profile_breakdown(name, batch)
            print(f"{name} b{batch}, {torch.get_num_threads()} threads, ms per step "
                  f"(profiler self time)")
            print_table(["op", "compiled", "compiled+division", "extra"],
                        [row for row in rows[:-1] if abs(row[3]) >= 0.5] + rows[-1:])
        return 0
    memory = [_memory_in_fresh_process(name, batch, mode)
              for name, batch in cases for mode in MEMORY_MODES]
    plain = {r["model"]: r["held_bytes"] for r in memory if r["mode"] == "compiled"}
    for r in memory:
        r["less_than_compiled"] = plain[r["model"]] / max(r["held_bytes"], 1)
    print_table(["model", "batch", "mode", "held MB (resident-set growth)", "x less"],
                [[r["model"], r["batch"], r["mode"], r["held_bytes"] / 2**20,
                  r["less_than_compiled"]] for r in memory])
    print()
    steps = {name: step_times(name, batch, args.repeats) for name, batch in cases}
    rows = []
    for name, by_mode in steps.items():
        for mode, seconds in by_mode.items():
            rows.append([name, mode, seconds, seconds / by_mode["compiled"],
                         seconds / by_mode["eager+division"]])
    print_table(["step b64", "mode", "median s", "vs compiled", "vs eager+division"], rows)
    alone = {name: steps_alone(name, batch, args.alone) for name, batch in cases} if args.alone else {}
    if alone:
        print()
        print_table(["alone b64", "mode", "median s (per process)", "page faults a step",
                     "compiled+division / compiled (median, range)"], alone_rows(alone))

    malloc_env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    payload = {"settings": {"division": DIVISION, "repeats": args.repeats,
                            "malloc_mmap_threshold": int(FRESH_MEMORY_ENV["MALLOC_MMAP_THRESHOLD_"]),
                            "torch": torch.__version__,
                            "alone_rounds": args.alone, "alone_steps": ALONE_STEPS,
                            "step_malloc_env": malloc_env},
               "models": args.models, "memory": memory, "step_seconds": steps,
               "steps_alone": alone}
    path = write_results(args.out.stem, payload, device="cpu", directory=args.out.parent)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
