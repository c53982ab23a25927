"""Where an eager DIVISION training step's extra time goes, per part of the codec (issue 14).

For each family of `benchmarks.architectures` (the same models, batches and random inputs as its
memory cases), at one thread by default: the median time of a normal and of a division training
step (forward, backward, SGD step; the modes in turns), and, averaged over the division steps,
the exclusive time of each part of the codec. At one thread the clock is the thread's CPU time
(the machine's other work does not count); with `--threads N` above 1 it is wall time, because
the thread CPU time counts the calling thread only, not the team its kernels and torch's split
work with (a part's time then includes waits for the team):

- the C kernels (`freqact.kernels.cpu`: token and map encode/decode, their Python wrappers
  included);
- the attention rerun in backward (SDPA's flash kernel or its MATH decomposition on the decoded
  q, k, v) and the activation outputs recomputed from their decoded inputs, each without the
  decodes they call;
- the pack and unpack hooks without everything above: routing, metering, the codec wrappers'
  torch calls (allocation, views, copies of non-viewable inputs).

"other" is the step's extra time the parts do not cover (the function tracker, block entry and
exit, the model's own ops running differently); it moves by +-15 ms between runs here, because
the normal step itself does. Each part's function is wrapped for the run by a timer that
subtracts the time of wrapped functions it calls, and restored afterwards.

    python -m benchmarks.step_breakdown --families gpt swin vit   # -> results/step-breakdown-cpu.json
    python -m benchmarks.step_breakdown --threads 2   # -> results/step-breakdown-cpu-2thread.json
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import architectures
from benchmarks.common import RESULTS_DIR, print_table, write_results
from freqact.engine import attention, block, recompute, sdpa_math
from freqact.kernels import cpu

PARTS = (
    (cpu, "token_encode", "C token encode"),
    (cpu, "token_decode", "C token decode"),
    (cpu, "encode", "C map encode"),
    (cpu, "decode", "C map decode"),
    (attention.SdpaCall, "_value", "attention rerun (flash)"),
    (sdpa_math.MathSaves, "_rerun", "attention rerun (math)"),
    (recompute.Recipe, "rebuild", "activation recompute"),
    (block._Compress, "_pack", "pack hook, rest"),
    (block, "_unpack", "unpack hook, rest"),
)
"""(owner, attribute, label) of each timed part; the engine looks each up at call time (the
hooks at block entry), so replacing the attribute times every call."""


def clock() -> Callable[[], float]:
    """The clock of this thread count: thread CPU time at one thread, else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


@contextlib.contextmanager
def timed_parts(seconds: Counter):
    """Add each part's exclusive time (`clock`) to seconds[label] while the block is open."""
    stack: list[float] = []  # per open call: the time of the wrapped calls inside it
    now = clock()

    def timed(fn, label):
        def wrapper(*args, **kwargs):
            stack.append(0.0)
            start = now()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = now() - start
                seconds[label] += spent - stack.pop()
                if stack:
                    stack[-1] += spent
        return wrapper

    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS]
    try:
        for (owner, name, fn), (_, _, label) in zip(originals, PARTS):
            setattr(owner, name, timed(fn, label))
        yield seconds
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def breakdown(case: architectures.Case, steps: int) -> dict:
    """One family's step medians and per-part means (ms), after one warm-up step per mode."""
    model = case.build()
    x, y = architectures.random_batch(case, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    seconds: Counter = Counter()
    times = {mode: [] for mode in architectures.MODES}
    now = clock()
    with timed_parts(seconds):
        for round_ in range(steps + 1):  # round 0 warms up
            if round_ == 1:
                seconds.clear()
            for mode in architectures.MODES:
                start = now()
                optimizer.zero_grad(set_to_none=True)
                loss, _ = architectures._loss(model, x, y, mode)
                loss.backward()
                optimizer.step()
                if round_:
                    times[mode].append(now() - start)
    normal, division = (statistics.median(times[m]) * 1e3 for m in architectures.MODES)
    parts = {label: seconds[label] * 1e3 / steps for _, _, label in PARTS if seconds[label]}
    return {"family": case.family, "batch": case.batch, "threads": torch.get_num_threads(),
            "normal_ms": normal, "division_ms": division, "parts_ms": parts,
            "other_ms": division - normal - sum(parts.values())}


def table_rows(row: dict) -> list[list[object]]:
    normal = row["normal_ms"]
    return [*([label, ms, 100 * ms / normal] for label, ms in row["parts_ms"].items()),
            ["other", row["other_ms"], 100 * row["other_ms"] / normal],
            ["extra (division - normal)", row["division_ms"] - normal,
             100 * (row["division_ms"] - normal) / normal]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cases = architectures._cases(quick=False)
    parser.add_argument("--families", nargs="+", default=["gpt", "swin", "vit"],
                        choices=list(cases), help="families to break down (default gpt swin vit)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode (default 12)")
    parser.add_argument("--batch", type=int, default=None, help="every family at this batch")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: thread CPU time; above 1: wall time)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default results/step-breakdown-cpu.json at one thread, "
                             "results/step-breakdown-cpu-Nthread.json at N)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name}: expected an integer >= 1, got {value}")
    torch.set_num_threads(args.threads)
    timing = "thread CPU time" if args.threads == 1 else "wall time"
    cases = architectures._cases(quick=False, batch=args.batch)
    rows = []
    for family in args.families:
        row = breakdown(cases[family], args.steps)
        rows.append(row)
        print(f"{family} b{row['batch']}, {args.threads} thread(s), {timing}: normal step "
              f"{row['normal_ms']:.1f} ms, division {row['division_ms']:.1f} ms (medians of "
              f"{args.steps}); parts: means per division step")
        print_table(["part", "ms a step", "% of normal step"], table_rows(row))
    settings = {"steps": args.steps, "threads": args.threads, "clock": timing,
                "division": architectures.DIVISION}
    out = args.out or RESULTS_DIR / ("step-breakdown-cpu.json" if args.threads == 1
                                     else f"step-breakdown-cpu-{args.threads}thread.json")
    written = write_results(out.stem, {"settings": settings, "rows": rows}, directory=out.parent)
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
