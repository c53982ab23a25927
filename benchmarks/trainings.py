"""Short real trainings, normal vs DIVISION, with their spread (issue 14.4).

Runs the sweep preset `archs-cpu` (`freqact/presets/archs-cpu.toml`: a small ViT on CIFAR-10 and
a small byte-level GPT on the standard library's sources, 3 seeds each; only runs not finished
yet are trained), then summarises, per arm, the final test loss (GPT: nats per byte) and test
accuracy (GPT: next-byte accuracy) as mean +- sample std over the seeds, and per model the paired
differences DIVISION - normal of the same seed (same initial weights and data order), their mean
+- std and each seed's value. Prints the tables and writes benchmarks/results/<preset>-cpu.json.

    python -m benchmarks.trainings --data-dir ../shared/data        # 10-15 min on 2 shared cores
    python -m benchmarks.trainings --spec my.toml --out sweeps/mine  # another study, same summary
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, print_table, write_results
from freqact import sweep

REPO_ROOT = Path(__file__).resolve().parents[1]
METRICS = ("test_loss", "test_acc", "train_loss")


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else None}


def summarise(study: sweep.Study) -> dict:
    """Per arm: final metrics per seed and their spread; per model: paired differences.

    Returns:
        {"arms": [{"label", "model", "mode", "seeds": [...], METRIC: {"per_seed", "mean",
        "std"}}], "paired": [{"model", "against", "seeds", METRIC: {"per_seed", "mean",
        "std"}}]}: paired values are (other mode - normal) for the seeds both arms finished;
        unfinished runs are left out.
    """
    arms = _arms(study)
    paired = []
    for arm in arms:
        base = next((a for a in arms if a["model"] == arm["model"] and a["mode"] == "normal"),
                    None)
        if arm["mode"] != "normal" and base is not None:
            paired.append(_paired(arm, base))
    return {"arms": arms, "paired": paired}


def _arms(study: sweep.Study) -> list[dict]:
    """One entry per variant: its finished runs' last metrics, per seed and their spread."""
    arms: dict[str, dict] = {}
    for run in study.runs:
        metrics = sweep.read_metrics(run.run_dir)
        if not metrics or metrics[-1]["epoch"] < run.config.epochs:
            continue
        arm = arms.setdefault(run.label, {"label": run.label, "model": run.config.model,
                                          "mode": run.config.mode, "seeds": [],
                                          "compression_ratio": metrics[-1]["compression_ratio"]})
        arm["seeds"].append(run.config.seed)
        for name in METRICS:
            arm.setdefault(name, {"per_seed": []})["per_seed"].append(metrics[-1][name])
    for arm in arms.values():
        for name in METRICS:
            arm[name].update(_spread(arm[name]["per_seed"]))
    return list(arms.values())


def _paired(arm: dict, base: dict) -> dict:
    """arm - base for every seed both finished (same seed: same initial weights, data order)."""
    seeds = [s for s in arm["seeds"] if s in base["seeds"]]
    row = {"model": arm["model"], "against": f"{arm['label']} - {base['label']}", "seeds": seeds}
    for name in METRICS:
        diffs = [arm[name]["per_seed"][arm["seeds"].index(s)]
                 - base[name]["per_seed"][base["seeds"].index(s)] for s in seeds]
        row[name] = {"per_seed": diffs, **(_spread(diffs) if diffs else {})}
    return row


def _pm(value: dict, digits: int = 4) -> str:
    std = value.get("std")
    return f"{value['mean']:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")


def tables(summary: dict) -> tuple[list[list[object]], list[list[object]]]:
    arms = [[a["label"], len(a["seeds"]), _pm(a["test_loss"]), _pm(a["test_acc"]),
             _pm(a["train_loss"]),
             "-" if a["compression_ratio"] is None else f"{a['compression_ratio']:.2f}x"]
            for a in summary["arms"]]
    paired = [[p["against"], len(p["seeds"]), _pm(p["test_loss"]), _pm(p["test_acc"]),
               " ".join(f"{d:+.4f}" for d in p["test_loss"]["per_seed"])]
              for p in summary["paired"] if p["seeds"]]
    return arms, paired


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="archs-cpu", help="preset or spec file (default "
                        "%(default)s)")
    parser.add_argument("--out", default=None, help="the study's folder (default sweeps/NAME)")
    parser.add_argument("--data-dir", default=None,
                        help="CIFAR-10's parent folder (default $FREQACT_DATA, else ../shared/data)")
    parser.add_argument("--results", default=None,
                        help="summary JSON (default benchmarks/results/NAME-cpu.json)")
    args = parser.parse_args(argv)
    data_dir = args.data_dir or os.environ.get("FREQACT_DATA") or str(REPO_ROOT.parent / "shared"
                                                                        / "data")
    outcome = sweep.run(args.spec, args.out, device="cpu", data_dir=data_dir)
    for run_dir, message in outcome["failed"]:
        print(f"{run_dir} failed: {message}", file=sys.stderr)
    study = outcome["study"]
    summary = summarise(study)
    arms, paired = tables(summary)
    print_table(["arm", "seeds", "test loss", "test acc", "train loss", "compression"], arms)
    print()
    print_table(["paired (same seed)", "seeds", "Δ test loss", "Δ test acc", "Δ loss per seed"],
                paired)
    path = Path(args.results) if args.results else RESULTS_DIR / f"{study.name}.json"
    written = write_results(path.stem, {"study": study.name, "description": study.description,
                                        "out": str(study.out), **summary},
                            device="cpu", directory=path.parent)
    print(f"wrote {written}")
    return 1 if outcome["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
