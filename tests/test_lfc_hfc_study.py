"""benchmarks/lfc_hfc_study.py end to end on a tiny sweep shaped like the lfc-hfc-cpu preset."""
from __future__ import annotations

import csv
import json
import statistics

import pytest

from benchmarks import lfc_hfc_study
from freqact import rundir, sweep

SPECTRAL = ("LFC-ACT W/N=0.2", "HFC-ACT W/N=0.2", "LFC-ACT W/N=0.1", "HFC-ACT W/N=0.1")
# The preset's arms at toy size: ResNet-20 of width 4 on 64 synthetic images, 2 epochs, 2 seeds.
SPEC = {
    "name": "tiny-lfc-hfc",
    "base": {"model": "resnet20", "model_options": {"width": 4}, "dataset": "synthetic",
             "subset": 64, "epochs": 2, "batch_size": 32, "save_epochs": []},
    "grid": {"seed": [0, 1]},
    "variants": [{"label": "normal", "mode": "normal", "save_epochs": [1, 2]},
                 *({"label": label, "mode": label[:3].lower(), "ratio": float(label[-3:]),
                    "window_rule": "official"} for label in SPECTRAL)],
}


def _files(folder) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_report_of_a_tiny_study(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    runs = tmp_path / "sweep"
    assert not sweep.run(str(spec), runs, device="cpu")["failed"]
    study = sweep.expand(SPEC, runs)
    final = {(r.label, r.config.seed): rundir.RunDir(r.run_dir).read_metrics()[-1] for r in study.runs}
    before, out = _files(runs), tmp_path / "report"
    argv = [str(runs), "--spec", str(spec), "--out", str(out), "--lambda-images", "12",
            "--theorem-images", "8"]
    assert lfc_hfc_study.main(argv) == 0
    assert _files(runs) == before  # the sweep is only read
    printed = capsys.readouterr().out
    summary = json.loads((out / "study.json").read_text())

    # a. arms: mean and sample std over the seeds of the runs' final metrics
    for arm in summary["arms"]:
        for metric in ("test_acc", "train_loss"):
            values = [final[(arm["label"], s)][metric] for s in (0, 1)]
            assert arm[metric]["mean"] == pytest.approx(statistics.fmean(values), rel=1e-12)
            assert arm[metric]["std"] == pytest.approx(statistics.stdev(values), rel=1e-12)
    # paired differences: LFC − HFC at each W/N, then each spectral arm − normal, per seed
    pairs = {(p["a"], p["b"]): p for p in summary["paired"]}
    assert list(pairs) == [SPECTRAL[0:2], SPECTRAL[2:4], *((a, "normal") for a in SPECTRAL)]
    rows = _csv(out / "paired.csv")
    assert len(rows) == 6 * 2
    for row in rows:
        a, b, seed = row["a"], row["b"], int(row["seed"])
        for metric in ("test_acc", "train_loss"):
            want = final[(a, seed)][metric] - final[(b, seed)][metric]
            assert float(row[f"d_{metric}"]) == pytest.approx(want, abs=1e-12)
            assert pairs[(a, b)]["per_seed"][str(seed)][metric] == pytest.approx(want, abs=1e-12)

    # b. λ: 2 W/N x 2 seeds x 2 checkpoints, each share recomputed from the pipeline's λ table
    shares = _csv(out / "lambda_shares.csv")
    assert sorted((float(s["ratio"]), int(s["seed"]), int(s["epoch"])) for s in shares) == sorted(
        (r, s, e) for r in (0.2, 0.1) for s in (0, 1) for e in (1, 2))
    for share in shares:
        folder = out / "analysis" / f"ratio-{float(share['ratio']):g}" / f"seed-{share['seed']}"
        assert json.loads((folder / "lambdas.settings.json").read_text())["rule"] == "official"
        pairs_here = [r for r in _csv(folder / "lambdas.csv") if r["checkpoint"] == share["checkpoint"]]
        assert int(share["pairs"]) == len(pairs_here) == 9 * 12  # 9 blocks x 12 test images
        above = sum(float(r["lam_L"]) > float(r["lam_H"]) for r in pairs_here) / len(pairs_here)
        assert 0.0 <= float(share["share_L_gt_H"]) <= 1.0
        assert float(share["share_L_gt_H"]) == pytest.approx(above, abs=1e-12)

    # c. Theorem 3.1: conv layers only (no classifier), the bound holds, cosines are cosines
    layers = _csv(out / "theorem31_layers.csv")
    assert {r["kind"] for r in layers} == {"Conv2d"} and all(r["bound_holds"] == "True" for r in layers)
    assert len(layers) == 8 * 21  # 8 checkpoints x (stem + 18 block convs + 2 shortcuts)
    theorem = _csv(out / "theorem31_summary.csv")
    assert len(theorem) == 8 and all(int(t["bound_holds"]) == int(t["layers"]) == 21 for t in theorem)
    assert all(-1.0 <= float(t[c]) <= 1.0 for t in theorem for c in ("cos_L", "cos_H"))
    for name in ("lambdas_scatter", "training", "curves"):
        assert (out / f"{name}.png").stat().st_size > 0 and (out / f"{name}.pdf").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert report in printed and "| LFC-ACT W/N=0.2 − HFC-ACT W/N=0.2 | 2 |" in report


@pytest.mark.parametrize("sweep_dir, out, match", [
    ("{tmp}", "{tmp}/report", "--out: expected a folder outside the sweep"),
    ("{tmp}/missing", "{tmp}/report", "sweep_dir: expected the study's folder"),
])
def test_bad_folders_exit_2_with_one_line(tmp_path, capsys, sweep_dir, out, match):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in (sweep_dir, "--out", out)]
    assert lfc_hfc_study.main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "report").exists()
