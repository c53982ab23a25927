"""DIVISION on every family of the zoo, side by side (issue 14.4): memory, gradient and time.

For each family (CIFAR ResNet-18, ViT, Swin, ConvNeXt, MobileNetV3, the GPT/Llama-style `gpt`),
at the zoo's default size, and the three transformers again at the widths of ViT-S/16 (384),
Swin-T (96, heads 3/6/12) and a 512-wide decoder, one batch each, fp32, `division` B=8 Q=2:

- meter ratio: `freqact.compress`'s meter, exact_bytes / saved_bytes of one forward; beside it
  the same under `codec="exact"` (a sanity column: it must be 1.0) and whether `exact`'s
  parameter gradients are bit-identical to plain PyTorch's;
- resident-set ratio: activation memory held after the forward pass, normal / division, each in a
  fresh process by codec_bench's protocol (MALLOC_MMAP_THRESHOLD_=65536, one warm-up training
  step of the same batch, malloc_trim, then the growth of the resident set across the forward
  pass, from /proc/self/smaps_rollup), with meter / held for both modes (should be 1 +- 10 %);
- gradient cosine (and relative error ||g - g_exact|| / ||g_exact||) of all parameter gradients
  with division against the exact backward, over a real batch: the first CIFAR-10 training
  images (`freqact.data`, `--data-dir`, default ../shared/data) or the first windows of the
  standard-library text (`freqact.text`);
- step time: forward + backward + SGD step, division / normal, the two modes interleaved (one
  step each per round), the minimum over the rounds of each (`ROUNDS`: on a shared VM a normal
  step alone moves by 10-30 % between rounds, and the minimum of 3 rounds still did).

Goals (issue 14): >= 8x held activation memory on every family with meter and resident set within
10 %, >= 10.5x on ResNet-18 CIFAR, step time <= 1.3x normal for the transformer families on the CPU.
The memory cases use random inputs of the batch's shape (bytes depend on shapes only).

    python -m benchmarks.architectures --data-dir ../shared/data    # -> results/architectures-cpu.json
    python -m benchmarks.architectures --quick                      # seconds: tiny models
    python -m benchmarks.architectures --families vit swin gpt --batch 64 --out X.json  # larger batch
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    FRESH_MEMORY_ENV,
    RESULTS_DIR,
    gradient_error,
    json_from_fresh_process,
    print_table,
    release_free_heap,
    resident_bytes,
    write_results,
)
from freqact import data, models, train
from freqact.engine import compress

REPO_ROOT = Path(__file__).resolve().parents[1]
DIVISION = {"block": 8, "bits": 2}
MODES = ("normal", "division")
ROUNDS = 10
"""Timed rounds per step time by default."""
# the families the step-time goal is about: the zoo's defaults, and the same models at the widths
# of ViT-S/16, Swin-T and a 512-wide decoder (the codec's Python cost is fixed per saved tensor and
# its kernels' grows with the elements saved, the matmuls' with the width squared: the zoo's small
# defaults are the hard case)
TRANSFORMERS = ("vit", "swin", "gpt", "vit-s", "swin-t", "gpt-512")


@dataclass(frozen=True)
class Case:
    """One family: a zoo model, its settings and the batch it is measured on."""

    family: str
    model: str
    batch: int
    options: dict = field(default_factory=dict)
    dataset: str = "cifar10"

    def build(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return models.get(self.model, num_classes=data.num_classes(self.dataset), **self.options)


# Batches sized for 2 shared CPU cores (ratios hardly depend on the batch: bytes scale with it).
CASES = (
    Case("resnet18-cifar", "resnet18", 32),
    Case("vit", "vit", 16),
    Case("swin", "swin", 16),
    Case("convnext", "convnext", 16),
    Case("mobilenet_v3", "mobilenet_v3", 16),
    Case("gpt", "gpt", 16, dataset=data.TEXT_DATASET),
    Case("vit-s", "vit", 16, {"dim": 384, "heads": 6}),
    Case("swin-t", "swin", 16, {"dim": 96, "heads": (3, 6, 12)}),
    Case("gpt-512", "gpt", 16, {"dim": 512, "heads": 8}, dataset=data.TEXT_DATASET),
)
# --quick: the same families, tiny, so that the whole benchmark runs in seconds.
QUICK = (
    Case("resnet18-cifar", "resnet18", 2, {"width": 8}),
    Case("vit", "vit", 2, {"dim": 32, "depth": 1, "heads": 2}),
    Case("swin", "swin", 2, {"dim": 16, "depths": (1, 1), "heads": (1, 2)}),
    Case("convnext", "convnext", 2, {"dims": (16, 32), "depths": (1, 1)}),
    Case("mobilenet_v3", "mobilenet_v3", 2),
    Case("gpt", "gpt", 2, {"dim": 32, "depth": 1, "heads": 2, "context": 32},
         dataset=data.TEXT_DATASET),
)
_WIDE = {"vit-s": "vit", "swin-t": "swin", "gpt-512": "gpt"}  # wide family -> its zoo default
QUICK += tuple(replace(c, family=wide) for wide, base in _WIDE.items() for c in QUICK
               if c.family == base)  # --quick runs the wide families as the tiny ones


def _cases(quick: bool, batch: int | None = None) -> dict[str, Case]:
    """The families' cases, each at `batch` when given (else its own)."""
    return {c.family: c if batch is None else replace(c, batch=batch)
            for c in (QUICK if quick else CASES)}


def random_batch(case: Case, model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of `case`'s batch shape, random (for the memory cases)."""
    shape = tuple(model.input_shape)
    if case.dataset == data.TEXT_DATASET:
        ids = torch.randint(0, model.vocab_size, (case.batch, shape[0] + 1))
        return ids[:, :-1], ids[:, 1:]
    return torch.randn(case.batch, *shape), torch.randint(0, 10, (case.batch,))


def real_batch(case: Case, model: torch.nn.Module, data_dir: str | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `case.batch` training images of CIFAR-10 (normalised), or text windows."""
    ds = data.load_for_model(case.dataset, model, data_dir, subset=case.batch)
    # The labels are a view of the whole training set's storage; a batch owns its labels (the
    # meter charges a kept tensor its storage: 400 KB of CIFAR labels on the ResNet-18 row).
    return data.model_inputs(ds, ds.train_images, model), ds.train_labels.clone()


def _loss(model, x, y, mode: str):
    """Training loss of one forward (inside compress unless `normal`) and the meter (or None)."""
    if mode == "normal":
        return train.cross_entropy(model(x), y), None
    with compress(model, mode, **(DIVISION if mode == "division" else {})) as meter:
        return train.cross_entropy(model(x), y), meter


def gradients(model, x, y, mode: str, seed: int = 1) -> tuple[torch.Tensor, object]:
    """All parameter gradients of one backward, flattened (float64), and the forward's meter.

    The seed is set first, so dropout draws the same masks in every mode (and the codec's noise
    follows `seed`)."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss, meter = _loss(model, x, y, mode)
    loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return torch.cat(grads).double(), meter


def measure_memory(case: Case, mode: str) -> dict:
    """Resident-set growth across one forward (call in a fresh process) and the meter's bytes."""
    model = case.build()
    x, y = random_batch(case, model)
    loss, _ = _loss(model, x, y, mode)  # warm-up: one-time costs of these shapes are not activations
    loss.backward()
    del loss
    model.zero_grad(set_to_none=False)
    release_free_heap()
    before = resident_bytes()
    loss, meter = _loss(model, x, y, mode)
    held = resident_bytes() - before
    loss.backward()
    del loss
    if meter is None:  # plain PyTorch's bytes for the same forward, as the meter counts them
        _, meter = _loss(model, x, y, "exact")
        metered = meter.exact_bytes
    else:
        metered = meter.saved_bytes
    return {"held_bytes": held, "meter_bytes": metered}


def _memory_in_fresh_process(case: Case, mode: str, quick: bool) -> dict:
    return json_from_fresh_process("benchmarks.architectures",
                                   ["--memory-case", case.family, mode, "--batch", str(case.batch),
                                    *(["--quick"] if quick else [])],
                                   env=FRESH_MEMORY_ENV)


def step_ratio(model, x, y, rounds: int) -> dict:
    """Minimum step time (forward, backward, SGD step) per mode over interleaved rounds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    times = {mode: [] for mode in MODES}
    for round_ in range(rounds + 1):  # round 0 warms up
        for mode in MODES:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss, _ = _loss(model, x, y, mode)
            loss.backward()
            optimizer.step()
            if round_:
                times[mode].append(time.perf_counter() - start)
    best = {mode: min(seconds) for mode, seconds in times.items()}
    return {"normal_s": best["normal"], "division_s": best["division"],
            "step_ratio": best["division"] / best["normal"]}


def measure_case(case: Case, data_dir: str | None, rounds: int, quick: bool) -> dict:
    """Every column of one family (the memory cases in fresh processes)."""
    model = case.build()
    x, y = real_batch(case, model, data_dir)
    plain, _ = gradients(model, x, y, "normal")
    exact, exact_meter = gradients(model, x, y, "exact")
    approx, meter = gradients(model, x, y, "division")
    rel_error, cosine = gradient_error(approx, plain)
    memory = {mode: _memory_in_fresh_process(case, mode, quick) for mode in MODES}
    held = {mode: memory[mode]["held_bytes"] for mode in MODES}
    return {
        "family": case.family, "model": case.model, "options": case.options, "batch": case.batch,
        "params": sum(p.numel() for p in model.parameters()),
        "meter_ratio": meter.ratio, "exact_bytes": meter.exact_bytes,
        "saved_bytes": meter.saved_bytes,
        "exact_meter_ratio": exact_meter.ratio, "exact_grads_identical": torch.equal(plain, exact),
        "rss_ratio": held["normal"] / held["division"],
        "held_bytes": held, "meter_bytes": {m: memory[m]["meter_bytes"] for m in MODES},
        "meter_vs_held": {m: memory[m]["meter_bytes"] / held[m] for m in MODES},
        "grad_cosine": cosine, "grad_rel_error": rel_error,
        **step_ratio(model, x, y, rounds),
    }


def check_goals(row: dict) -> dict:
    """Which of issue 14's goals the row meets (None where a goal does not apply)."""
    agree = all(abs(v - 1.0) <= 0.10 for v in row["meter_vs_held"].values())
    need = 10.5 if row["family"] == "resnet18-cifar" else 8.0
    return {"memory": min(row["meter_ratio"], row["rss_ratio"]) >= need,
            "meter_agrees": agree,
            "step_time": row["step_ratio"] <= 1.3 if row["family"] in TRANSFORMERS else None}


def table_rows(rows: list[dict]) -> list[list[object]]:
    def mark(ok):
        return "-" if ok is None else ("yes" if ok else "NO")

    return [[r["family"], r["batch"], r["meter_ratio"], r["rss_ratio"],
             "/".join(f"{r['meter_vs_held'][m]:.2f}" for m in MODES), r["exact_meter_ratio"],
             "yes" if r["exact_grads_identical"] else "NO", r["grad_cosine"], r["grad_rel_error"],
             r["step_ratio"], *(mark(v) for v in r["goals"].values())] for r in rows]


HEADER = ["family", "batch", "meter x", "RSS x", "meter/held n/d", "exact x", "exact bit-id",
          "grad cos", "grad rel err", "step x", "goal mem", "goal agree", "goal step"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, batch 2: a smoke run")
    parser.add_argument("--families", nargs="+", metavar="FAMILY",
                        help=f"only these ({', '.join(c.family for c in CASES)}; default all)")
    parser.add_argument("--data-dir", default=None,
                        help="CIFAR-10's parent folder (default $FREQACT_DATA, else ../shared/data)")
    parser.add_argument("--batch", type=int, default=None,
                        help="every family at this batch (default: each its own, the table's)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per step time (default 10, --quick 1)")
    parser.add_argument("--out", default=None, help="results JSON (default results/"
                        "architectures-cpu.json; --quick: not written unless given)")
    parser.add_argument("--memory-case", nargs=2, metavar=("FAMILY", "MODE"),
                        help=argparse.SUPPRESS)  # internal: one memory case, JSON on stdout
    args = parser.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch: expected an integer >= 1, got {args.batch}")
    cases = _cases(args.quick, args.batch)
    if args.memory_case:
        family, mode = args.memory_case
        print(json.dumps(measure_memory(cases[family], mode)))
        return 0
    unknown = sorted(set(args.families or ()) - set(cases))
    if unknown:
        parser.error(f"--families: unknown {unknown[0]!r}; expected some of {', '.join(cases)}")
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    if rounds < 1:
        parser.error(f"--rounds: expected an integer >= 1, got {rounds}")
    data_dir = args.data_dir or os.environ.get("FREQACT_DATA") or str(REPO_ROOT.parent / "shared"
                                                                        / "data")
    torch.set_grad_enabled(True)
    rows = []
    for family in args.families or list(cases):
        row = measure_case(cases[family], data_dir, rounds, args.quick)
        row["goals"] = check_goals(row)
        rows.append(row)
        print(f"measured {family}", file=sys.stderr, flush=True)
    print_table(HEADER, table_rows(rows))
    if args.out or not args.quick:
        path = Path(args.out) if args.out else RESULTS_DIR / "architectures-cpu.json"
        written = write_results(path.stem, {"settings": {"division": DIVISION, "rounds": rounds,
                                                         "quick": args.quick, "dtype": "float32",
                                                         "batch": args.batch},
                                            "rows": rows}, directory=path.parent)
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
