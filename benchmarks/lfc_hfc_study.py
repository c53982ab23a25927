"""The report of the LFC-ACT vs HFC-ACT study (issue 16; the paper's Fig. 3, Fig. 4, Theorem 3.1).

Reads a finished (or partly finished) sweep of the preset `lfc-hfc-cpu` (or any spec with a
`normal` arm keeping checkpoints and spectral arms at one or more W/N), never writes into it, and
writes to `--out`:

- training: per arm, final test accuracy and final train loss, mean ± sample std over the
  finished seeds (`arms.csv`); per seed, the paired differences (same seed: same initial weights
  and data order) between the spectral arms at each W/N (LFC-ACT − HFC-ACT in the preset) and of
  each spectral arm against normal (`paired.csv`); the sweep's bar figure and the seed-mean
  curves (`training.png/.pdf`, `curves.png/.pdf`);
- λ (Fig. 4): λ^L and λ^H per block output and test image at every checkpoint of each normal run,
  at every (W/N, window rule) the spectral arms use (`freqact.analysis.pipelines.lambdas_analysis`,
  tables and figures under `analysis/ratio-R/seed-S/`); the share of (layer, image) pairs with
  λ^L > λ^H per checkpoint, W/N and seed (`lambda_shares.csv`) and the scatter figure
  (`lambdas_scatter.png/.pdf`, one panel per epoch x W/N, the diagonal drawn);
- Theorem 3.1 (`pipelines.theorem31_analysis`, conv layers only): per conv layer and checkpoint
  whether err ≤ GEB holds, the tightness err/GEB and err^L against err^H
  (`theorem31_layers.csv`), per checkpoint the counts and the whole-network gradient cosine of
  LFC-ACT and HFC-ACT with the exact gradient on a real test batch (`theorem31_summary.csv`);
- everything in `study.json` and the tables in `report.md` (also printed).

    freqact sweep lfc-hfc-cpu --data-dir ../shared/data --out sweeps/lfc-hfc-cpu --jobs 2
    python -m benchmarks.lfc_hfc_study sweeps/lfc-hfc-cpu --data-dir ../shared/data --out figures/lfc-hfc-cpu

The analyses reuse their tables when rerun with the same settings and checkpoints (the pipelines'
settings sidecars), so a rerun only redraws. Arms are read from the spec's variants: nothing here
knows the preset's labels.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/X.py): make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freqact import checkpoint, plots, rundir, sweep
from freqact.analysis import common, pipelines, theorem31

PRESET = "lfc-hfc-cpu"
METRICS = ("test_acc", "train_loss")
DEFAULT_OUT = Path("figures") / PRESET


def _spread(values: list[float]) -> dict:
    """{"mean", "std"} (sample std; None for fewer than two values; both None for none)."""
    return {"mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None}


# ---- training: arms and paired differences -----------------------------------------------------

def arms(study: sweep.Study) -> list[dict]:
    """Per arm (variant x non-seed grid values): the finished seeds' final metrics and spread.

    Returns:
        [{"label", "group", "mode", "ratio" (None for non-spectral arms), "window_rule",
        "seeds": [...], "per_seed": {seed: {"test_acc", "train_loss"}}, "test_acc": spread,
        "train_loss": spread, "compression_ratio", "results": the `sweep.results_table` row}].
    """
    table = {(row["label"], tuple((f, row[f]) for f in study.group_fields)): row
             for row in sweep.results_table(study)}
    grouped: dict[tuple, list[sweep.Run]] = {}
    for run in study.runs:
        grouped.setdefault((run.label, run.group), []).append(run)
    out = []
    for key, runs in grouped.items():
        config = runs[0].config
        per_seed = {}
        for run in runs:
            metrics = sweep.read_metrics(run.run_dir)
            if rundir.reaches(metrics, config.epochs):
                per_seed[run.config.seed] = {m: metrics[-1][m] for m in METRICS}
        params = config.codec_params()
        out.append({"label": key[0], "group": dict(key[1]), "mode": config.mode,
                    "ratio": params.get("ratio"), "window_rule": params.get("window_rule"),
                    "seeds": sorted(per_seed), "per_seed": per_seed,
                    **{m: _spread([v[m] for v in per_seed.values()]) for m in METRICS},
                    "compression_ratio": table[key]["compression_ratio"], "results": table[key]})
    return out


def pairs(arm_rows: list[dict]) -> list[tuple[dict, dict]]:
    """(a, b) arm pairs to difference: every two spectral arms at one W/N and grid point (in
    variant order: LFC-ACT − HFC-ACT in the preset), then each spectral arm against the normal
    arm of its grid point."""
    spectral = [a for a in arm_rows if a["ratio"] is not None]
    found = []
    for key in dict.fromkeys((a["ratio"], repr(a["group"])) for a in spectral):
        same = [a for a in spectral if (a["ratio"], repr(a["group"])) == key]
        found += list(itertools.combinations(same, 2))
    normal = [a for a in arm_rows if a["mode"] == "normal"]
    found += [(a, n) for a in spectral for n in normal if n["group"] == a["group"]]
    return found


def paired(arm_rows: list[dict]) -> list[dict]:
    """Per pair of `pairs`: a − b of the final metrics for every seed both arms finished.

    Returns:
        [{"a", "b", "ratio", "seeds", "per_seed": {seed: {"test_acc", "train_loss"}},
        "test_acc": spread of the differences, "train_loss": spread}].
    """
    rows = []
    for a, b in pairs(arm_rows):
        seeds = [s for s in a["seeds"] if s in b["per_seed"]]
        per_seed = {s: {m: a["per_seed"][s][m] - b["per_seed"][s][m] for m in METRICS}
                    for s in seeds}
        rows.append({"a": a["label"], "b": b["label"], "ratio": a["ratio"], "seeds": seeds,
                     "per_seed": per_seed,
                     **{m: _spread([d[m] for d in per_seed.values()]) for m in METRICS}})
    return rows


def curves(study: sweep.Study, arm_rows: list[dict]) -> list[dict]:
    """Seed-mean test accuracy and train loss per arm and epoch (finished seeds only), as
    `plots.training_figure` rows."""
    finished = {(a["label"], repr(a["group"])): set(a["seeds"]) for a in arm_rows}
    sums: dict[tuple, list[dict]] = defaultdict(list)
    for run in study.runs:
        if run.config.seed in finished[(run.label, repr(dict(run.group)))]:
            for row in sweep.read_metrics(run.run_dir):
                sums[(_arm_name(run.label, dict(run.group)), row["epoch"])].append(row)
    return [{"run": name, "epoch": epoch,
             **{m: statistics.fmean(r[m] for r in rows) for m in METRICS}}
            for (name, epoch), rows in sums.items()]


def _arm_name(label: str, group: dict) -> str:
    return " ".join([label, *(f"{k}={v}" for k, v in group.items())])


# ---- λ and Theorem 3.1 on the normal runs' checkpoints --------------------------------------------

def analysis_targets(study: sweep.Study, arm_rows: list[dict]) -> tuple[list, list]:
    """([(W/N, window rule)] of the spectral arms, [(seed, run dir, checkpoints)] of the
    normal runs that kept epoch checkpoints)."""
    settings = list(dict.fromkeys((a["ratio"], a["window_rule"]) for a in arm_rows
                                  if a["ratio"] is not None))
    runs = []
    for run in study.runs:
        if run.config.mode == "normal":
            kept = rundir.RunDir(run.run_dir).epoch_checkpoints()
            if kept:
                runs.append((run.config.seed, run.run_dir, kept))
    return settings, runs


def analyse(study: sweep.Study, arm_rows: list[dict], out: Path, *, data_dir: str | None,
            device: str, lambda_images: int, theorem_images: int, layers: str,
            progress=print) -> dict:
    """Run the λ and Theorem 3.1 pipelines per (W/N, rule) and normal run into OUT/analysis/.

    Returns:
        {"lambdas": every λ row with "ratio", "window_rule", "seed" added, "shares": one row per
        (ratio, seed, checkpoint) with the "(all)" share, "theorem_layers": per conv layer rows,
        "theorem_summary": one row per (ratio, seed, checkpoint), "files": written paths}.
    """
    settings, runs = analysis_targets(study, arm_rows)
    found = {"lambdas": [], "shares": [], "theorem_layers": [], "theorem_summary": [], "files": []}
    for (ratio, rule), (seed, run_dir, kept) in itertools.product(settings, runs):
        where = out / "analysis" / f"ratio-{ratio:g}" / f"seed-{seed}"
        note = f"{study.name}: normal run seed {seed}, W/N = {ratio:g} ({rule} window rule)"
        progress(f"λ and Theorem 3.1: {run_dir} at W/N = {ratio:g} ({rule}) -> {where}")
        tags = {"ratio": ratio, "window_rule": rule, "seed": seed}
        lam = pipelines.lambdas_analysis(kept, where, ratio=ratio, rule=rule, layers=layers,
                                         images=lambda_images, data_dir=data_dir, device=device,
                                         note=note, reuse=True)
        epoch_of = {str(r["checkpoint"]): r["epoch"] for r in lam.rows}
        found["lambdas"] += [{**tags, **r} for r in lam.rows]
        found["shares"] += [{**tags, "epoch": epoch_of[str(s["checkpoint"])],
                             "checkpoint": s["checkpoint"], "pairs": s["instances"],
                             "share_L_gt_H": s["share_L_gt_H"]}
                            for s in lam.extra if s["layer"] == "(all)"]
        thm = pipelines.theorem31_analysis(kept, where, ratio=ratio, rule=rule,
                                           images=theorem_images, data_dir=data_dir,
                                           device=device, note=note, reuse=True)
        found["theorem_layers"] += [{**tags, **r} for r in thm.rows]
        found["theorem_summary"] += [_theorem_summary(tags, f, thm.rows) for f in thm.extra]
        found["files"] += lam.files + thm.files
    return found


def _theorem_summary(tags: dict, fidelity: dict, rows: list[dict]) -> dict:
    """One checkpoint's `theorem31.summarize` counts with its whole-network gradient fidelity."""
    mine = [r for r in rows if str(r["checkpoint"]) == str(fidelity["checkpoint"])]
    return {**tags, "epoch": fidelity["epoch"], "checkpoint": fidelity["checkpoint"],
            **theorem31.summarize(mine),
            **{k: fidelity[k] for k in ("cos_L", "cos_H", "rel_err_L", "rel_err_H")}}


def share_spread(shares: list[dict]) -> list[dict]:
    """Mean ± std over seeds of the λ^L > λ^H share per (W/N, epoch)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in shares:
        groups[(row["ratio"], row["window_rule"], row["epoch"])].append(row)
    return [{"ratio": ratio, "window_rule": rule, "epoch": epoch,
             "seeds": [r["seed"] for r in rows], "pairs": sum(r["pairs"] for r in rows),
             **{f"share_{k}": v for k, v in _spread([r["share_L_gt_H"] for r in rows]).items()}}
            for (ratio, rule, epoch), rows in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][2]))]


# ---- tables and files ------------------------------------------------------------------------------

def _pm(spread: dict, scale: float = 1.0, digits: int = 2, sign: bool = False) -> str:
    if spread["mean"] is None:
        return "–"
    fmt = f"{'+' if sign else ''}.{digits}f"
    std = "" if spread["std"] is None else f" ± {scale * spread['std']:.{digits}f}"
    return f"{scale * spread['mean']:{fmt}}{std}"


def _table(head: list[str], rows: list[list[object]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows)]


def markdown(study: sweep.Study, arm_rows: list[dict], paired_rows: list[dict],
             found: dict) -> str:
    """report.md: the training, paired-difference, λ-share and Theorem 3.1 tables."""
    lines = [f"# {study.name}: LFC-ACT vs HFC-ACT, λ and Theorem 3.1", ""]
    if study.description:
        lines += [study.description.strip(), ""]
    lines += ["## Training (final epoch; mean ± sample std over seeds)", "", *_table(
        ["arm", "seeds", "test acc (%)", "train loss", "compression"],
        [[_arm_name(a["label"], a["group"]), len(a["seeds"]), _pm(a["test_acc"], 100),
          _pm(a["train_loss"], digits=4),
          "–" if a["compression_ratio"] is None else f"{a['compression_ratio']:.1f}x"]
         for a in arm_rows]), ""]
    lines += ["## Paired differences (same seed)", "", *_table(
        ["a − b", "seeds", "Δ test acc (points)", "Δ train loss", "Δ test acc per seed",
         "Δ train loss per seed"],
        [[f"{p['a']} − {p['b']}", len(p["seeds"]), _pm(p["test_acc"], 100, sign=True),
          _pm(p["train_loss"], digits=4, sign=True),
          " ".join(f"{100 * d['test_acc']:+.2f}" for d in p["per_seed"].values()),
          " ".join(f"{d['train_loss']:+.4f}" for d in p["per_seed"].values())]
         for p in paired_rows]), ""]
    lines += ["## λ^L > λ^H (Fig. 4): share of (block output, test image) pairs", "", *_table(
        ["W/N", "rule", "epoch", "seeds", "pairs", "share (%)", "per seed (%)"],
        [[f"{s['ratio']:g}", s["window_rule"], s["epoch"], len(s["seeds"]), s["pairs"],
          _pm({"mean": s["share_mean"], "std": s["share_std"]}, 100, 1),
          " ".join(f"{100 * r['share_L_gt_H']:.1f}" for r in found["shares"]
                   if (r["ratio"], r["epoch"]) == (s["ratio"], s["epoch"]))]
         for s in share_spread(found["shares"])]), ""]
    lines += ["## Theorem 3.1 per conv layer, and whole-network gradient fidelity", "", *_table(
        ["W/N", "seed", "epoch", "err ≤ GEB", "tightness err/GEB (median L / H)",
         "err^L < err^H", "cos(g^L, g)", "cos(g^H, g)"],
        [[f"{t['ratio']:g}", t["seed"], t["epoch"], f"{t['bound_holds']}/{t['layers']}",
          f"{t['median_tightness_L'] or 0:.3g} / {t['median_tightness_H'] or 0:.3g}",
          f"{t['err_L_lt_err_H']}/{t['layers']}", f"{t['cos_L']:.4f}", f"{t['cos_H']:.4f}"]
         for t in found["theorem_summary"]]), ""]
    lines += ["Training: final-epoch test accuracy and training loss of each finished seed. "
              "Paired: a − b for each seed both arms finished (same initial weights and data "
              "order). λ: block outputs of the normal runs' checkpoints on the first test images, "
              "at the spectral arms' W/N and window rule. Theorem 3.1: per conv layer of the same "
              "checkpoints (the classifier is outside the conv theorem); cos: the whole-network "
              "gradient under LFC-ACT / HFC-ACT against the exact one on a real test batch.", ""]
    return "\n".join(lines)


def _json_ready(value):
    """Dict keys as strings (seeds are ints), paths as strings: plain JSON."""
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def write(study: sweep.Study, arm_rows: list[dict], paired_rows: list[dict], found: dict,
          out: Path) -> list[Path]:
    """The report's own files in `out` (each written atomically); returns their paths."""
    flat_arms = [{"label": a["label"], **a["group"], "mode": a["mode"], "ratio": a["ratio"],
                  "window_rule": a["window_rule"], "seeds": len(a["seeds"]),
                  **{f"{m}_{k}": v for m in METRICS for k, v in a[m].items()},
                  "compression_ratio": a["compression_ratio"]} for a in arm_rows]
    flat_pairs = [{"a": p["a"], "b": p["b"], "ratio": p["ratio"], "seed": s,
                   **{f"d_{m}": d[m] for m in METRICS}}
                  for p in paired_rows for s, d in p["per_seed"].items()]
    written = [common.write_csv(flat_arms, out / "arms.csv"),
               common.write_csv(flat_pairs, out / "paired.csv")]
    if found["shares"]:
        written += [common.write_csv(found["shares"], out / "lambda_shares.csv"),
                    common.write_csv(found["theorem_layers"], out / "theorem31_layers.csv"),
                    common.write_csv(found["theorem_summary"], out / "theorem31_summary.csv"),
                    *plots.lambdas_scatter_figure(found["lambdas"], out / "lambdas_scatter",
                                                  note=f"{study.name}: normal runs' checkpoints")]
    results = [a["results"] for a in arm_rows]
    if any(r["seeds"] for r in results):
        written += plots.sweep_figure(results, out / "training", title=study.name,
                                      group_fields=study.group_fields)
        written += plots.training_figure(curves(study, arm_rows), out / "curves",
                                         note=f"{study.name}: seed means")
    report = markdown(study, arm_rows, paired_rows, found)
    summary = {"study": study.name, "description": study.description, "sweep": str(study.out),
               "arms": [{k: v for k, v in a.items() if k != "results"} for a in arm_rows],
               "paired": paired_rows, "lambda_shares": found["shares"],
               "lambda_share_spread": share_spread(found["shares"]),
               "theorem31": found["theorem_summary"]}
    for name, data in (("report.md", report),
                       ("study.json", json.dumps(_json_ready(summary), indent=1) + "\n")):
        checkpoint.atomic_write(out / name, data.encode("utf-8"))
        written.append(out / name)
    print(report)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="the study's folder (`freqact sweep --out`); only read")
    parser.add_argument("--spec", default=PRESET,
                        help="the study's spec file or preset (default %(default)s)")
    parser.add_argument("--data-dir", default=None,
                        help="CIFAR folder's parent (default: the runs' own)")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="folder for the report (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="for the analyses (default %(default)s)")
    parser.add_argument("--lambda-images", type=int, default=pipelines.LAMBDA_IMAGES,
                        help="test images per checkpoint for λ (default %(default)s)")
    parser.add_argument("--theorem-images", type=int, default=pipelines.THEOREM_IMAGES,
                        help="test images per checkpoint for Theorem 3.1 (default %(default)s)")
    parser.add_argument("--layers", default=pipelines.LAYERS, choices=common.LAYER_SETS,
                        help="maps λ reads (default %(default)s, the paper's Fig. 4)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    problem = None
    if not Path(args.sweep_dir).is_dir():
        problem = f"sweep_dir: expected the study's folder, got {args.sweep_dir} (no such folder)"
    elif Path(args.sweep_dir).resolve() in (out.resolve(), *out.resolve().parents):
        problem = f"--out: expected a folder outside the sweep {args.sweep_dir}, got {out}"
    if problem:
        print(f"lfc_hfc_study: error: {problem}", file=sys.stderr)
        return 2
    try:
        study, _ = sweep.plan(args.spec, args.sweep_dir, data_dir=args.data_dir)
        arm_rows = arms(study)
        found = analyse(study, arm_rows, out, data_dir=args.data_dir, device=args.device,
                        lambda_images=args.lambda_images, theorem_images=args.theorem_images,
                        layers=args.layers)
        written = write(study, arm_rows, paired(arm_rows), found, out)
    except (ValueError, OSError) as err:
        print(f"lfc_hfc_study: error: {err}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
