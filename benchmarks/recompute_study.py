"""What rebuilding saved outputs from their packed arguments costs in gradient and saves in memory.

The engine's recompute rule (`freqact/engine/recompute.py`) stores some saved outputs as a recipe,
f of an argument already packed, instead of a second encode. This study switches the rule for one
run at a time and measures each variant under `freqact.compress(model, "division", block=8,
bits=2)` (`architectures.DIVISION`):

- `both encoded`: nothing rebuilt (`RECOMPUTABLE` and `PRODUCTS` empty): an activation's input and
  output, RMSNorm's x and x_n, each encoded on its own route;
- `activations`: GELU/SiLU/Hardswish/Mish outputs rebuilt from their packed input, products not;
- `activations and products`: today's rule (also RMSNorm's x_n = x * rstd and a
  squeeze-excitation's x * scale);
- `products chained`: today's sets with the per-channel condition of `Recomputer.recipe_for`
  lifted, so a save that reads per-channel statistics (a Linear's input, `*/chan`) is rebuilt
  from an argument packed per token too: RMSNorm's y = weight * x_n through x_n's recipe from x's
  `tile/tok` encode (the wrapped `recipe_for` is handed a route that reads no channel statistics);
- `layer_norm too`: as `products chained`, with `layer_norm` in `RECOMPUTABLE` (its output, the
  next Linear's input, rebuilt from its per-token-quantised input).

Each variant patches the module's sets (and `recipe_for`) for its run and restores them after.

Per family and variant: the meter ratio (exact_bytes / saved_bytes of the forward), the number of
saves the meter routed `recomputed activation`, and all parameter gradients against plain
backward: cosine and relative Frobenius error ||g - g_plain|| / ||g_plain||, mean and sd over noise
seeds (`torch.manual_seed(s)` before each division forward); per family also whether `exact`'s
gradients are bit-identical to plain backward's. One thread.

Families: the zoo models of `benchmarks.architectures` (default vit, swin, gpt, convnext,
mobilenet_v3; any of its `CASES` by name; random init, its `real_batch`: the first
CIFAR-10 training images from `--data-dir`, or text windows; a vision family is skipped, with the
reason printed, when CIFAR-10 is absent) and `gpt-trained`: `benchmarks.layouts.gpt_case` at its
full settings (dim 96, depth 4, 250 AdamW steps on the standard-library text, ~50 s), measured in
eval mode on its test batch, as the layouts study does.

    python -m benchmarks.recompute_study --data-dir ../shared/data   # -> results/recompute-study-cpu.json
    python -m benchmarks.recompute_study --quick                     # seconds: tiny models
    python -m benchmarks.recompute_study --families gpt gpt-trained --seeds 8 --out X.json
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import architectures, layouts
from benchmarks.common import RESULTS_DIR, gradient_error, print_table, write_results
from freqact.engine import recompute

ROUTE = recompute.Recompute.name  # the meter's label of a rebuilt save
TRAINED = "gpt-trained"
FAMILIES = ("vit", "swin", "gpt", "convnext", "mobilenet_v3", TRAINED)  # the default run
CHOICES = (*(c.family for c in architectures.CASES), TRAINED)  # resnet18-cifar, the wide ones too


@dataclass(frozen=True)
class Variant:
    """One recompute rule: the function sets and whether the per-channel condition holds."""

    name: str
    recomputable: frozenset
    products: frozenset
    chained: bool = False


NONE = frozenset()
VARIANTS = (
    Variant("both encoded", NONE, NONE),
    Variant("activations", recompute.RECOMPUTABLE, NONE),
    Variant("activations and products", recompute.RECOMPUTABLE, recompute.PRODUCTS),
    Variant("products chained", recompute.RECOMPUTABLE, recompute.PRODUCTS, chained=True),
    Variant("layer_norm too", recompute.RECOMPUTABLE | {"layer_norm"}, recompute.PRODUCTS,
            chained=True),
)
# What `recipe_for` is handed under a chained variant: a route whose layout reads no per-channel
# statistics, so the condition "the save reads */chan and its argument was not packed per
# channel" never refuses (the route is used for nothing else there).
_NO_CHANNELS = types.SimpleNamespace(layout="")


@contextlib.contextmanager
def rule(variant: Variant):
    """Run the block under `variant`'s recompute rule; restore the engine's own afterwards."""
    saved = recompute.RECOMPUTABLE, recompute.PRODUCTS, recompute.Recomputer.recipe_for
    recipe_for = saved[2]

    def lifted(self, t, storage, ptr, route):
        return recipe_for(self, t, storage, ptr, _NO_CHANNELS)

    try:
        recompute.RECOMPUTABLE, recompute.PRODUCTS = variant.recomputable, variant.products
        if variant.chained:
            recompute.Recomputer.recipe_for = lifted
        yield
    finally:
        recompute.RECOMPUTABLE, recompute.PRODUCTS, recompute.Recomputer.recipe_for = saved


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "per_seed": values}


def measure(model, x, y, seeds: tuple[int, ...], variants=VARIANTS) -> dict:
    """Per variant: meter ratio, recomputed saves, gradient cosine and relative error vs plain."""
    plain, _ = architectures.gradients(model, x, y, "normal", seeds[0])
    exact, _ = architectures.gradients(model, x, y, "exact", seeds[0])
    rows = {}
    for variant in variants:
        cosines, errors, ratios, rebuilt = [], [], set(), set()
        with rule(variant):
            for seed in seeds:
                g, meter = architectures.gradients(model, x, y, "division", seed)
                rel_error, cosine = gradient_error(g, plain)
                cosines.append(cosine)
                errors.append(rel_error)
                ratios.add(meter.ratio)
                rebuilt.add(meter.by_route().get(ROUTE, {}).get("count", 0))
        assert len(ratios) == 1 and len(rebuilt) == 1, "bytes depend on shapes, not on the noise"
        rows[variant.name] = {"meter_ratio": ratios.pop(), "recomputed": rebuilt.pop(),
                              "cosine": _stats(cosines), "rel_error": _stats(errors)}
    return {"exact_grads_identical": torch.equal(plain, exact), "variants": rows}


def family_case(family: str, quick: bool, data_dir: str) -> tuple[torch.nn.Module, torch.Tensor,
                                                                   torch.Tensor, dict]:
    """The model, batch and facts of one family (raises FileNotFoundError without CIFAR-10)."""
    if family == TRAINED:
        model, x, y, facts = layouts.gpt_case(layouts.QUICK if quick else layouts.FULL)
        return model, x, y, {"mode": "eval", **facts}
    case = architectures._cases(quick)[family]
    model = case.build()
    x, y = architectures.real_batch(case, model, data_dir)
    return model, x, y, {"mode": "train", "model": case.model, "options": case.options,
                         "batch": case.batch}


def table_rows(rows: list[dict]) -> list[list[object]]:
    out = []
    for row in rows:
        for name, v in row["variants"].items():
            out.append([row["family"], name, v["meter_ratio"], v["recomputed"],
                        f"{v['cosine']['mean']:.5f} +- {v['cosine']['sd']:.5f}",
                        f"{v['rel_error']['mean']:.4f} +- {v['rel_error']['sd']:.4f}",
                        "yes" if row["exact_grads_identical"] else "NO"])
    return out


HEADER = ["family", "variant", "meter x", "rebuilt", "grad cos (mean +- sd)", "grad rel err",
          "exact bit-id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, a smoke run")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=CHOICES,
                        metavar="FAMILY", help=f"some of {' '.join(CHOICES)} (default "
                        f"{' '.join(FAMILIES)})")
    parser.add_argument("--seeds", type=int, default=4, help="noise seeds 0..N-1 (default 4)")
    parser.add_argument("--data-dir", default=None,
                        help="CIFAR-10's parent folder (default $FREQACT_DATA, else ../shared/data)")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default results/"
                        "recompute-study-cpu.json; --quick: not written unless given)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds: expected an integer >= 1, got {args.seeds}")
    data_dir = str(args.data_dir or layouts.default_data_dir())
    torch.set_num_threads(1)
    torch.set_grad_enabled(True)
    seeds = tuple(range(args.seeds))
    rows, skipped = [], {}
    for family in args.families:
        try:
            model, x, y, facts = family_case(family, args.quick, data_dir)
        except FileNotFoundError as e:
            skipped[family] = str(e)
            print(f"skipped {family}: CIFAR-10 not found ({e})", file=sys.stderr, flush=True)
            continue
        rows.append({"family": family, **facts, **measure(model, x, y, seeds)})
        print(f"measured {family}", file=sys.stderr, flush=True)
    print(f"division {architectures.DIVISION}, noise seeds 0-{args.seeds - 1}, one thread; "
          f"gradients vs plain backward; rebuilt: saves routed {ROUTE!r}")
    print_table(HEADER, table_rows(rows))
    settings = {"division": architectures.DIVISION, "seeds": list(seeds), "threads": 1,
                "quick": args.quick, "variants": [v.name for v in VARIANTS]}
    if args.out or not args.quick:
        path = args.out or RESULTS_DIR / "recompute-study-cpu.json"
        written = write_results(path.stem, {"settings": settings, "rows": rows, "skipped": skipped},
                                directory=path.parent)
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
