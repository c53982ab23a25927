"""Studies: spec parsing and its errors, grid expansion, skipping/resuming runs, the results table."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from freqact import checkpoint, cli, rundir, sweep

# One optimizer step per epoch of a small MLP on synthetic data: the cheapest real run.
TINY_BASE = {"model": "mlp", "dataset": "synthetic", "subset": 32, "epochs": 1, "batch_size": 32,
             "save_epochs": []}


def _spec(**overrides) -> dict:
    spec = {"name": "tiny", "base": dict(TINY_BASE), "grid": {"seed": [0]},
            "variants": [{"label": "normal", "mode": "normal"},
                         {"mode": "division", "block": 4, "bits": 2}]}
    return {**spec, **overrides}


TOML_SPEC = """
name = "tiny"
[base]
model = "mlp"
dataset = "synthetic"
subset = 32
epochs = 1
batch_size = 32
save_epochs = []
[grid]
seed = [0]
[[variants]]
label = "normal"
mode = "normal"
[[variants]]
mode = "division"
block = 4
bits = 2
"""


# ---- spec parsing and checks --------------------------------------------------------------------

@pytest.mark.parametrize("overrides, error, match", [
    (dict(colour="red"), ValueError, "unknown key 'colour'; expected keys name"),
    (dict(base={**TINY_BASE, "epoch": 3}), ValueError, r"base: unknown key 'epoch'.*epochs, batch_size"),
    (dict(base={**TINY_BASE, "out": "x"}), ValueError, "base.out: set by the sweep"),
    (dict(base={**TINY_BASE, "device": "cpu"}), ValueError, "base.device: set by the sweep"),
    (dict(grid={}), ValueError, "grid: expected at least one field"),
    (dict(grid={"seed": []}), ValueError, r"grid.seed: expected a non-empty list"),
    (dict(grid={"seed": 3}), ValueError, r"grid.seed: expected a non-empty list"),
    (dict(grid={"sed": [1]}), ValueError, "grid: unknown key 'sed'"),
    (dict(grid={"epochs": [1]}), ValueError, "grid.epochs: also set in base"),
    (dict(variants=[]), ValueError, "variants: expected a non-empty list"),
    (dict(variants=[{"mode": "normal", "seed": 2}]), ValueError, r"variants\[0\].seed: also in grid"),
    (dict(variants=["normal"]), TypeError, r"variants\[0\]: expected a table"),
    (dict(variants=[{"mode": "quant", "bit": 2}]), ValueError, r"variants\[0\]: unknown key 'bit'"),
    (dict(variants=[{"label": "a b", "mode": "normal"}, {"label": "A-B", "mode": "exact"}]),
     ValueError, r"variants\[1\].label: 'A-B' repeats"),
    (dict(variants=[{"label": "q", "mode": "quant", "bits": 3}]), ValueError, "variant 'q': bits"),
    (dict(variants=[{"mode": "quant", "bits": 3}]), ValueError, r"variants\[0\]: bits"),
    (dict(base={**TINY_BASE, "model": "resnet99"}), ValueError, "model: expected one of"),
    # settings the mode does not use, refused as on the command line (they named runs that were
    # the same run)
    (dict(variants=[{"label": "n", "mode": "normal", "bits": 2}]), ValueError,
     r"variant 'n': bits: mode 'normal' does not use it \(its settings: none\)"),
    (dict(grid={"seed": [0], "ratio": [0.1, 0.2]}), ValueError,
     r"variant 'normal'.*ratio: mode 'normal' does not use it"),
    (dict(variants=[{"mode": "division", "ratio": 0.1}]), ValueError,
     r"ratio: mode 'division' does not use it \(its settings: block, bits"),
    (dict(variants=[{"label": "n", "mode": "normal", "include": ["Linear"]}]), ValueError,
     r"variant 'n': include: mode 'normal' does not use it"),
    (dict(base={**TINY_BASE, "epochs": "4"}), TypeError, "epochs"),
    (dict(name=""), ValueError, "name: expected a non-empty string"),
    (dict(base=[1, 2]), TypeError, "base: expected a table"),
])
def test_bad_specs_name_the_key(tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        sweep.expand(_spec(**overrides), tmp_path)


def test_spec_files_toml_json_yaml_agree(tmp_path):
    (tmp_path / "s.toml").write_text(TOML_SPEC)
    (tmp_path / "s.json").write_text(json.dumps(_spec()))
    studies = [sweep.expand(sweep.load_spec(tmp_path / "s.toml"), tmp_path / "out"),
               sweep.expand(sweep.load_spec(tmp_path / "s.json"), tmp_path / "out")]
    yaml = pytest.importorskip("yaml", reason="pyyaml (a dev dependency) is not installed")
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(_spec()))
    studies.append(sweep.expand(sweep.load_spec(tmp_path / "s.yaml"), tmp_path / "out"))
    assert studies[0].runs and all(s == studies[0] for s in studies[1:])


def test_spec_file_errors(tmp_path):
    (tmp_path / "bad.toml").write_text("name = [unclosed")
    with pytest.raises(ValueError, match="not valid TOML"):
        sweep.load_spec(tmp_path / "bad.toml")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        sweep.load_spec(tmp_path / "bad.json")
    (tmp_path / "spec.ini").write_text("")
    with pytest.raises(ValueError, match=r"expected a \.toml"):
        sweep.load_spec(tmp_path / "spec.ini")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(TypeError, match="expected a mapping"):
        sweep.load_spec(tmp_path / "list.json")
    with pytest.raises(FileNotFoundError, match="presets: ablation-cpu"):
        sweep.load_spec(tmp_path / "missing.toml")


def test_grid_expansion_layout_and_default_labels(tmp_path):
    spec = _spec(grid={"seed": [0, 1, 2], "bits": [2, 4]},
                 variants=[{"mode": "division", "block": 4}, {"label": "Quant!", "mode": "quant"}])
    study = sweep.expand(spec, tmp_path, data_dir="/data")
    assert len(study.runs) == 2 * 3 * 2 and study.group_fields == ("bits",)
    for (label, slug), seed, bits in itertools.product(
            (("division B=4", "division-b-4"), ("Quant!", "quant")), (0, 1, 2), (2, 4)):
        [r] = [r for r in study.runs if r.label == label and r.config.seed == seed
               and r.config.bits == bits]
        assert r.run_dir == tmp_path / slug / f"bits-{bits}" / f"seed-{seed}"
        assert r.group == (("bits", bits),) and r.config.resume and r.config.data_dir == "/data"
        assert r.config.subset == TINY_BASE["subset"]
    assert len({r.run_dir for r in study.runs}) == len(study.runs)


def test_presets_cover_the_paper_studies():
    assert set(sweep.presets()) >= {"ablation-cpu", "ablation-paper", "bq-cpu", "bq-paper"}
    for size in ("cpu", "paper"):
        ablation = sweep.expand(sweep.load_spec(f"ablation-{size}"), "out")
        arms = {(r.config.mode, tuple(r.config.label_params().items())) for r in ablation.runs}
        assert {mode for mode, _ in arms} == {"normal", "lfc", "hfc", "division",
                                              "division-no-hfc", "division-no-lfc", "quant"}
        assert {p for mode, p in arms if mode == "quant"} == {(("bits", 2),), (("bits", 4),)}
        bq = sweep.expand(sweep.load_spec(f"bq-{size}"), "out")
        division = {(r.config.block, r.config.bits) for r in bq.runs if r.config.mode == "division"}
        assert division == set(itertools.product((8, 12, 18), (2, 4, 8)))
        assert {r.config.mode for r in bq.runs} == {"normal", "division"}
        for study in (ablation, bq):
            seeds = {r.config.seed for r in study.runs}
            configs = [r.config for r in study.runs]
            if size == "cpu":
                assert len(seeds) == 2 and {c.model for c in configs} == {"resnet20"}
                assert all(c.subset and c.subset <= 10000 and c.epochs <= 5 for c in configs)
            else:
                assert {(c.model, c.subset, c.epochs, c.batch_size, c.lr) for c in configs} == {
                    ("resnet18", None, 100, 256, 0.1)}


# ---- the results table on fabricated runs -------------------------------------------------------

def _fake_run(run, accs, images_per_s, compression=None, saved=None):
    """Write a run directory whose metrics.jsonl holds the given per-epoch values."""
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(run.config)))
    rows = [{"epoch": e + 1, "test_acc": a, "images_per_s": s, "compression_ratio": compression,
             "saved_bytes": saved} for e, (a, s) in enumerate(zip(accs, images_per_s))]
    (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_results_table_statistics(tmp_path, monkeypatch, held_by_another):
    base = {**TINY_BASE, "epochs": 3}
    study = sweep.expand(_spec(base=base, grid={"seed": [0, 1, 2]}), tmp_path)
    rng = np.random.default_rng(0)
    accs = rng.uniform(0.1, 0.9, (2, 3, 3))  # (variant, seed, epoch)
    speeds = rng.uniform(50, 200, (2, 3, 3))
    for r in study.runs:
        v, s = int(r.label != "normal"), r.config.seed
        if (v, s) == (1, 2):  # half-finished: must not count
            _fake_run(r, accs[v, s, :2], speeds[v, s, :2], 9.0, 1.0)
        else:
            _fake_run(r, accs[v, s], speeds[v, s], *((4.0 + s, 2.0**20 * s) if v else ()))
    normal, division = sweep.results_table(study)
    assert (normal["label"], normal["mode"], normal["block"], normal["bits"]) == (
        "normal", "normal", None, None)
    assert (division["mode"], division["block"], division["bits"], division["ratio"]) == (
        "division", 4, 2, None)
    for row, v, seeds in ((normal, 0, [0, 1, 2]), (division, 1, [0, 1])):
        assert (row["seeds"], row["runs"], row["epochs"]) == (len(seeds), 3, 3)
        final, best = accs[v, seeds, -1], accs[v, seeds].max(axis=1)
        assert row["final_acc_mean"] == pytest.approx(final.mean(), rel=1e-12)
        assert row["final_acc_std"] == pytest.approx(final.std(ddof=1), rel=1e-12)
        assert row["best_acc_mean"] == pytest.approx(best.mean(), rel=1e-12)
        assert row["best_acc_std"] == pytest.approx(best.std(ddof=1), rel=1e-12)
        # throughput leaves out the first (warm-up) epoch
        assert row["images_per_s"] == pytest.approx(speeds[v, seeds, 1:].mean(), rel=1e-12)
    assert normal["compression_ratio"] is None and normal["saved_mib"] is None
    assert division["compression_ratio"] == pytest.approx(4.5)
    assert division["saved_mib"] == pytest.approx(0.5)

    atomic = []
    real_write = checkpoint.atomic_write
    def recorded(path, data):
        atomic.append(Path(path).name)
        real_write(path, data)

    from freqact.analysis import common
    monkeypatch.setattr(checkpoint, "atomic_write", recorded)
    monkeypatch.setattr(common, "atomic_write", recorded)
    with held_by_another(tmp_path), pytest.raises(rundir.RunDirBusy):  # another writer of the study
        sweep.write_results(study, [normal, division])
    assert not (tmp_path / "results.md").exists()
    written = sweep.write_results(study, [normal, division])
    assert {p.name for p in written} == {"results.csv", "results.md", "tiny.png", "tiny.pdf"}
    assert set(atomic) == {p.name for p in written}  # every file atomically
    markdown = (tmp_path / "results.md").read_text()
    expected = f"{100 * accs[0, :, -1].mean():.2f} ± {100 * accs[0, :, -1].std(ddof=1):.2f}"
    assert expected in markdown and "| 2/3 |" in markdown and "4.5x" in markdown
    header = (tmp_path / "results.csv").read_text().splitlines()[0].split(",")
    assert header[:2] == ["label", "mode"] and "final_acc_std" in header


def test_results_table_with_one_seed_and_none_finished(tmp_path):
    study = sweep.expand(_spec(grid={"seed": [0]}), tmp_path)
    _fake_run(study.runs[0], [0.5], [100.0])
    one, none = sweep.results_table(study)
    assert one["final_acc_mean"] == 0.5 and one["final_acc_std"] is None
    assert one["images_per_s"] == 100.0  # a single epoch is all there is
    assert none["seeds"] == 0 and none["final_acc_mean"] is None and none["images_per_s"] is None
    assert "| 50.00 |" in sweep.markdown_table(study, [one, none])


# ---- running, skipping, resuming ----------------------------------------------------------------

def _untimed(metrics: list[dict]) -> list[dict]:
    """Metrics without the timing columns, which differ between any two runs."""
    return [{k: v for k, v in row.items() if k not in ("epoch_time_s", "images_per_s")}
            for row in metrics]


def test_sweep_runs_missing_skips_finished_and_resumes_partial(tmp_path):
    spec = _spec(base={**TINY_BASE, "epochs": 2, "save_epochs": [1]})
    first = sweep.run(spec, tmp_path, device="cpu")
    assert first["failed"] == [] and len(first["ran"]) == 2 and first["skipped"] == []
    assert all(row["seeds"] == 1 for row in first["rows"])
    finished = {r: sweep.read_metrics(r) for r in first["ran"]}

    again = sweep.run(spec, tmp_path, device="cpu")  # nothing left to do
    assert again["ran"] == [] and sorted(again["skipped"]) == sorted(first["ran"])

    # interrupt the division run after epoch 1: its state and files as an interrupted run leaves them
    run_dir = tmp_path / "division-b-4-q-2" / "seed-0"
    shutil.copy(run_dir / "ckpt" / "epoch-0001.pt", run_dir / "ckpt" / "last.pt")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text(lines[0])
    study, states = sweep.plan(spec, tmp_path)
    assert states == {r.run_dir: "finished" if r.label == "normal" else "partial"
                      for r in study.runs}
    resumed = sweep.run(spec, tmp_path, device="cpu")
    assert resumed["ran"] == [str(run_dir)] and resumed["failed"] == []
    assert _untimed(sweep.read_metrics(run_dir)) == _untimed(finished[str(run_dir)])

    edited = _spec(base={**TINY_BASE, "epochs": 3, "save_epochs": [1]})
    with pytest.raises(ValueError, match=r"other settings \(epochs: 2 -> 3\)"):
        sweep.run(edited, tmp_path, device="cpu")


def test_a_failing_run_is_reported_and_the_others_still_run(tmp_path):
    spec = _spec(variants=[{"label": "no data", "mode": "normal", "dataset": "cifar10"},
                           {"label": "fine", "mode": "normal"}])
    outcome = sweep.run(spec, tmp_path / "out", device="cpu", data_dir=str(tmp_path / "empty"))
    [(run_dir, message)] = outcome["failed"]
    assert run_dir == str(tmp_path / "out" / "no-data" / "seed-0")
    log = tmp_path / "out" / "no-data" / "seed-0" / "error.log"
    assert message.startswith("FileNotFoundError") and "Traceback" in log.read_text()
    assert message.endswith(f"(traceback in {log})")
    assert [row["seeds"] for row in outcome["rows"]] == [0, 1]


def test_bad_jobs_or_device_fail_before_any_run(tmp_path):
    with pytest.raises(TypeError, match="jobs"):
        sweep.run(_spec(), tmp_path, jobs=1.5)
    with pytest.raises(ValueError, match="device"):
        sweep.run(_spec(), tmp_path, device="tpu")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_under_torchrun_each_run_uses_both_ranks(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    (tmp_path / "s.toml").write_text(TOML_SPEC)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "freqact", "sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out"),
               "--device", "cpu"]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for arm in ("normal", "division-b-4-q-2"):
        run_dir = tmp_path / "out" / arm / "seed-0"
        assert json.loads((run_dir / "config.json").read_text())["world_size"] == 2
    assert done.stdout.count("wrote ") == 1  # rank 0 alone writes the table
    assert "| 1/1 |" in (tmp_path / "out" / "results.md").read_text()


@pytest.mark.slow
def test_parallel_jobs_give_the_sequential_results(tmp_path):
    spec = _spec(grid={"seed": [0, 1]})
    parallel = sweep.run(spec, tmp_path / "par", jobs=2, device="cpu")
    sequential = sweep.run(spec, tmp_path / "seq", jobs=1, device="cpu")
    assert parallel["failed"] == [] and len(parallel["ran"]) == 4
    for a, b in zip(parallel["rows"], sequential["rows"]):
        assert a["final_acc_mean"] == b["final_acc_mean"] and a["seeds"] == b["seeds"] == 2


# ---- command line ------------------------------------------------------------------------------

def test_cli_sweep_dry_run_then_run(tmp_path, capsys):
    (tmp_path / "s.toml").write_text(TOML_SPEC)
    argv = ["sweep", str(tmp_path / "s.toml"), "--out", str(tmp_path / "out"), "--device", "cpu"]
    assert cli.main([*argv, "--dry-run"]) == 0
    assert capsys.readouterr().out.count("new ") == 2 and not (tmp_path / "out").exists()
    assert cli.main(argv) == 0
    assert "results.md" in capsys.readouterr().out
    assert cli.main([*argv, "--dry-run"]) == 0
    assert capsys.readouterr().out.count("finished ") == 2


def test_cli_bad_spec_exits_2_with_one_line(tmp_path, capsys):
    (tmp_path / "s.json").write_text(json.dumps(_spec(grid={"seed": []})))
    assert cli.main(["sweep", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "grid.seed" in err


def test_a_run_another_process_is_writing_fails_alone_and_is_left_alone(tmp_path, capsys):
    from freqact.rundir import RunDir

    study = sweep.expand(_spec(), tmp_path / "out")
    busy = study.runs[0].run_dir
    with RunDir(busy).lock():
        outcome = sweep.run(_spec(), tmp_path / "out", device="cpu")
    assert [run_dir for run_dir, _ in outcome["failed"]] == [str(busy)]
    assert "in use by another freqact process" in outcome["failed"][0][1]
    assert not (busy / "error.log").exists() and not (busy / "ckpt").exists()
    assert "error.log" not in outcome["failed"][0][1]  # no traceback is promised where none was written
    assert outcome["rows"][1]["seeds"] == 1  # the other run trained
    printed = capsys.readouterr().out  # a fresh run says so; it does not claim to resume
    assert f"{study.runs[1].run_dir}: no checkpoint to resume from; starting fresh at epoch 1" in printed
    assert "resume:" not in printed


def test_include_exclude_in_specs_are_checked_against_the_model_up_front(tmp_path):
    variants = [{"label": "normal", "mode": "normal"},
                {"label": "lfc", "mode": "lfc", "ratio": 0.2, "include": ["Linear"],
                 "exclude": ["layers.0"]}]
    study = sweep.expand(_spec(variants=variants), tmp_path)
    assert [r.config.to_dict().get("include") for r in study.runs] == [None, ["Linear"]]
    bad = [variants[0], {**variants[1], "exclude": ["layers.9"]}]
    with pytest.raises(ValueError, match=r"variant 'lfc': exclude: 'layers.9' is neither .*module of MLP"):
        sweep.expand(_spec(variants=bad), tmp_path)
    with pytest.raises(ValueError, match=r"variant 'lfc': include: expected 1 to 256"):
        sweep.expand(_spec(variants=[variants[0], {**variants[1], "include": []}]), tmp_path)


def _workers(pid: int) -> list[int]:
    """The pids of the multiprocessing workers whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if parent == pid and b"spawn_main" in command:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the workers")
def test_sigterm_stops_every_worker_at_an_epoch_boundary_and_a_rerun_resumes(tmp_path):
    spec = TOML_SPEC.replace("epochs = 1", "epochs = 100000").replace("[0]", "[0, 1]")
    (tmp_path / "s.toml").write_text(spec)
    argv = [sys.executable, "-m", "freqact", "sweep", str(tmp_path / "s.toml"), "--out",
            str(tmp_path / "out"), "--device", "cpu", "--jobs", "2"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    started, deadline = 0, time.monotonic() + 120
    while started < 2 and time.monotonic() < deadline:  # both workers are inside a run
        line = proc.stdout.readline()
        started += line.startswith("[1/")
    assert started == 2, proc.stderr.read()[-2000:]
    time.sleep(3)  # a few epochs in
    workers = _workers(proc.pid)
    assert len(workers) == 2
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    finally:  # a sweep that does not stop must not outlive the test
        for pid in [proc.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("freqact sweep: interrupted") and "Traceback" not in err
    deadline = time.monotonic() + 30  # no orphan left training
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers)
    done = [json.loads(line)["epoch"] for run in (tmp_path / "out").glob("*/seed-*")
            for line in (run / "metrics.jsonl").read_text().splitlines()[-1:]]
    assert len(done) >= 2 and all(0 < epoch < 100000 for epoch in done)
    plan = subprocess.run([*argv, "--dry-run"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert plan.returncode == 0 and plan.stdout.count("partial ") == 2, plan.stdout + plan.stderr
