"""freqact.figures: every figure from run directories, and the plots it adds."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import matplotlib
import pytest
import torch

from freqact import checkpoint, cli, figures, memory, plots, train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny finished runs (normal, division) on synthetic data, 2 epochs, 2 checkpoints each."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for mode in ("division", "normal"):  # normal second: make_all must still pick it for analysis
        config = train.RunConfig(model="resnet20", dataset="synthetic", mode=mode, epochs=2,
                                 batch_size=16, subset=32, device="cpu", out=str(root / mode),
                                 save_epochs=[1, 2])
        dirs[mode] = train.train(config)["run_dir"]
    return dirs


@pytest.fixture(scope="module")
def made(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("figures")
    return out, figures.make_all([runs["division"], runs["normal"]], out, lambda_images=4,
                                 theorem_images=4, pooling_images=4, memory_images=4)


def test_read_metrics_gives_the_rows_as_written(tmp_path):
    rows = [{"epoch": 1, "test_acc": 0.25, "saved_bytes": None},
            {"epoch": 2, "test_acc": 0.5, "saved_bytes": 1024}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert train.read_metrics(tmp_path) == rows
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        train.read_metrics(tmp_path / "missing")


@pytest.mark.parametrize("config,label", [
    ({"mode": "normal", "ratio": 0.5, "block": 8, "bits": 2}, "normal"),
    ({"mode": "lfc", "ratio": 0.25, "block": 8, "bits": 2}, "lfc (W/N=0.25)"),
    ({"mode": "division", "ratio": 0.5, "block": 4, "bits": 1, "num_classes": 10},
     "division (B=4, Q=1)"),
])
def test_run_label_names_mode_and_codec_settings(config, label):
    assert figures.run_label(config) == label


def test_describe_names_model_data_set_and_subset():
    config = {"model": "resnet20", "dataset": "cifar10", "subset": 5000, "batch_size": 128}
    assert figures.describe(config) == "resnet20 on CIFAR-10 (5000 training images)"
    assert figures.describe({**config, "dataset": "digits", "subset": None}) == "resnet20 on scikit-learn digits"


def test_read_config_refuses_a_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        train.read_config(tmp_path)


@pytest.mark.slow
def test_layer_memory_is_linear_in_the_batch_and_matches_the_storage_formula(runs):
    """Packed sizes depend only on shapes, so two batch sizes give the per-sample bytes that
    `memory.per_sample_bytes` computes on all-zero inputs of a fresh copy of the model."""
    last = f"{runs['division']}/ckpt/last.pt"
    rng = torch.get_rng_state()
    small, large = (figures.layer_memory(last, images=n) for n in (2, 3))
    assert torch.equal(torch.get_rng_state(), rng)  # model init and codec noise used a private stream
    assert {r["images"] for r in small} == {2} and {r["images"] for r in large} == {3}
    model, _ = checkpoint.load_model(last)
    exact, saved = memory.per_sample_bytes(model, (3, 32, 32), "division", block=8, bits=2)
    assert sum(r["exact_bytes"] for r in large) - sum(r["exact_bytes"] for r in small) == exact
    assert sum(r["saved_bytes"] for r in large) - sum(r["saved_bytes"] for r in small) == saved


@pytest.mark.slow
def test_layer_memory_of_a_normal_run_is_plain_storage(runs):
    normal = figures.layer_memory(f"{runs['normal']}/ckpt/last.pt", images=4)
    division = figures.layer_memory(f"{runs['division']}/ckpt/last.pt", images=4)
    plain = sum(r["exact_bytes"] for r in normal)
    assert plain == sum(r["exact_bytes"] for r in division)  # same network, same batch
    assert sum(r["saved_bytes"] for r in division) * 5 < plain
    assert all(r["saved_bytes"] == r["exact_bytes"] and r["ratio"] == 1.0 for r in normal)


def test_memory_totals_sum_per_run():
    rows = [{"run": "a", "images": 4, "exact_bytes": 10, "saved_bytes": 5},
            {"run": "b", "images": 4, "exact_bytes": 8, "saved_bytes": 8},
            {"run": "a", "images": 4, "exact_bytes": 30, "saved_bytes": 5}]
    assert figures.memory_totals(rows) == [
        {"run": "a", "images": 4, "exact_bytes": 40, "saved_bytes": 10, "ratio": 4.0},
        {"run": "b", "images": 4, "exact_bytes": 8, "saved_bytes": 8, "ratio": 1.0},
    ]


@pytest.mark.slow
def test_make_all_writes_every_figure_and_table(made, runs):
    out, result = made
    assert list(result) == list(figures.FIGURES)
    for name, fig in result.items():
        assert {p.name for p in fig.files} == {f"{name}.csv", f"{name}.png", f"{name}.pdf"}
        assert all(p.parent == out and p.stat().st_size > 0 for p in fig.files)
        assert fig.rows and fig.caption == figures.CAPTIONS[name]
    # the analyses read the normal run although it came second
    assert {r["checkpoint"] for r in result["lambdas"].rows} == {
        f"{runs['normal']}/ckpt/epoch-0001.pt", f"{runs['normal']}/ckpt/epoch-0002.pt"}
    assert {(r["run"], r["epoch"]) for r in result["training"].rows} == {
        (run, e) for run in ("normal", "division (B=8, Q=2)") for e in (1, 2)}
    assert {r["run"] for r in result["compression"].rows} == {"normal", "division (B=8, Q=2)"}


@pytest.mark.slow
def test_make_all_training_rows_are_the_runs_metrics(made, runs):
    _, result = made
    stored = json.loads((Path(runs["division"]) / "metrics.jsonl").read_text().splitlines()[-1])
    row = [r for r in result["training"].rows if r["run"].startswith("division") and r["epoch"] == 2][0]
    assert row["test_acc"] == pytest.approx(stored["test_acc"], rel=1e-12)
    assert row["saved_bytes"] == stored["saved_bytes"]


@pytest.mark.slow
def test_make_all_refuses_bad_arguments(runs, tmp_path):
    with pytest.raises(ValueError, match="run_dirs"):
        figures.make_all([], tmp_path)
    with pytest.raises(ValueError, match="run_dirs"):
        figures.make_all(runs["normal"], tmp_path)  # a single path, not a list
    with pytest.raises(ValueError, match="analysis_run"):
        figures.make_all([runs["normal"]], tmp_path, analysis_run=runs["division"])
    with pytest.raises(FileNotFoundError, match="config.json"):
        figures.make_all([tmp_path / "nothing"], tmp_path)
    with pytest.raises(ValueError, match="ratio"):
        figures.make_all([runs["normal"]], tmp_path, ratio=1.5)


def _memory_rows():
    return [{"run": run, "layer": layer, "saved_bytes": saved, "exact_bytes": exact}
            for run, scale in (("normal", 1), ("division", 8))
            for layer, saved, exact in (("", 64, 64), ("conv1", 4096 // scale, 4096),
                                        ("relu", 0, 0), ("fc", 512 // scale, 512))]


def _metric_rows():
    return [{"run": run, "epoch": e, "test_acc": 0.1 * e, "train_loss": 2.0 / e}
            for run in ("normal", "lfc (W/N=0.5)") for e in (1, 2, 3)]


@pytest.mark.parametrize("draw", [
    lambda stem: plots.training_figure(_metric_rows(), stem),
    lambda stem: plots.training_figure(_metric_rows(), stem, memory=[
        {"run": "normal", "exact_bytes": 100, "saved_bytes": 100},
        {"run": "lfc", "exact_bytes": 100, "saved_bytes": 0}]),  # nothing cached: no division by 0
    lambda stem: plots.compression_figure(_memory_rows(), stem),
], ids=["training", "training+memory", "compression"])
def test_new_plots_write_png_and_pdf_without_global_state(draw, tmp_path):
    before = copy.deepcopy(dict(matplotlib.rcParams))
    paths = draw(tmp_path / "sub" / "fig")
    assert [p.name for p in paths] == ["fig.png", "fig.pdf"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[1].read_bytes()[:4] == b"%PDF"
    assert dict(matplotlib.rcParams) == before


@pytest.mark.parametrize("draw,match", [
    (lambda stem: plots.training_figure([], stem), "metrics"),
    (lambda stem: plots.training_figure([{"run": "a", "epoch": 1}], stem), "test_acc"),
    (lambda stem: plots.training_figure(_metric_rows(), stem, memory=[{"run": "a"}]), "exact_bytes"),
    (lambda stem: plots.compression_figure([{"run": "a", "layer": "x"}], stem), "saved_bytes"),
])
def test_new_plots_refuse_incomplete_tables(draw, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        draw(tmp_path / "fig")


def test_cli_figures_maps_arguments_to_make_all(monkeypatch, tmp_path, capsys):
    seen = {}

    def fake_make_all(run_dirs, out, **kwargs):
        seen.update(run_dirs=run_dirs, out=out, **kwargs)
        return {"lambdas": figures.Figure("lambdas", "", [tmp_path / "lambdas.png"], [])}

    monkeypatch.setattr(figures, "make_all", fake_make_all)
    assert cli.main(["figures", "r1", "r2", "--out", str(tmp_path), "--ratio", "0.2",
                     "--analysis-run", "r2"]) == 0
    assert seen["run_dirs"] == ["r1", "r2"] and seen["out"] == str(tmp_path)
    assert seen["ratio"] == 0.2 and seen["analysis_run"] == "r2" and seen["device"] == "cpu"
    assert seen["layers"] == "blocks" and seen["rule"] == "nearest"
    assert cli.main(["figures", "r1", "--out", str(tmp_path), "--layers", "convs",
                     "--window-rule", "official"]) == 0
    assert seen["layers"] == "convs" and seen["rule"] == "official"
    assert "lambdas.png" in capsys.readouterr().out


def test_cli_figures_reports_a_missing_run_in_one_line(tmp_path, capsys):
    assert cli.main(["figures", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("freqact figures: error:") and err.count("\n") == 1


@pytest.mark.parametrize("config", [{}, {"model": "resnet20", "dataset": "synthetic", "batch_size": 16}])
def test_cli_figures_refuses_a_config_lacking_a_key_in_one_line(tmp_path, capsys, config):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config))
    assert cli.main(["figures", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    missing = "model" if not config else "mode"
    assert err.count("\n") == 1 and str(run / "config.json") in err and f"lacks {missing!r}" in err


@pytest.mark.parametrize("argv, match", [
    (["--pooling-images", "0"], "pooling_images: expected an integer >= 1, got 0"),
    (["--theorem-images", "-2"], "theorem_images: expected an integer >= 1, got -2"),
    (["--lambda-images", "0"], "lambda_images: expected an integer >= 1, got 0"),
    (["--memory-images", "0"], "memory_images: expected an integer >= 1, got 0"),
    (["--device", "gpu"], "device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
])
def test_cli_figures_checks_every_setting_before_the_first_analysis(monkeypatch, tmp_path, capsys, argv, match):
    monkeypatch.setattr(figures.pipelines, "lambdas_analysis", lambda *a, **k: pytest.fail("measured"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": "resnet20", "dataset": "synthetic", "mode": "normal",
                                                 "batch_size": 16}))
    (run / "metrics.jsonl").write_text('{"epoch": 1, "test_acc": 0.1, "train_loss": 2.0}\n')
    assert cli.main(["figures", str(run), "--out", str(tmp_path / "out"), *argv]) == 2
    assert capsys.readouterr().err == f"freqact figures: error: {match}\n"
    with pytest.raises(ValueError, match="blocks"):
        figures.make_all([run], tmp_path / "out", blocks=[8, 0])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad, match", [({"batch_size": "16"}, "batch_size: expected an integer >= 1, got '16'"),
                                        ({"model": 5}, "model: expected a model name, got 5"),
                                        ({"mode": "division", "block": "x"}, "block: expected an integer")])
def test_cli_figures_names_the_config_json_holding_a_bad_setting(tmp_path, capsys, bad, match):
    run = tmp_path / "run dir"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": "resnet20", "dataset": "synthetic", "mode": "normal",
                                                 "batch_size": 16, **bad}))
    assert cli.main(["figures", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"freqact figures: error: {run / 'config.json'}: {match}") and err.count("\n") == 1


def test_make_all_refuses_runs_of_different_models_before_measuring(tmp_path):
    for name, model in (("a", "resnet20"), ("b", "mobilenet_v2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(
            {"model": model, "dataset": "synthetic", "mode": "normal", "batch_size": 16}))
    with pytest.raises(ValueError, match="run_dirs: expected runs of one model on one dataset.*mobilenet_v2"):
        figures.make_all([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_figures_label_checkpoints_and_lines_by_run_when_there_are_several():
    from matplotlib.figure import Figure

    one_run = [{"run": "runs/a", "checkpoint": "runs/a/ckpt/epoch-0001.pt", "epoch": 1}]
    two_runs = one_run + [{"run": "runs/b", "checkpoint": "runs/b/ckpt/epoch-0001.pt", "epoch": 1}]
    assert plots._checkpoint_title(one_run[0], several_runs=False) == "epoch 1"
    assert [plots._checkpoint_title(r, several_runs=True) for r in two_runs] == ["runs/a, epoch 1", "runs/b, epoch 1"]
    fidelity = [{"run": run, "epoch": e, "cos_L": c, "cos_H": c / 2}
                for run, c in (("runs/a", 0.9), ("runs/b", 0.5)) for e in (1, 2)]
    ax = Figure().subplots()
    plots._fidelity_panel(ax, fidelity)
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    # one line per run and band, never a line through both runs' points
    assert lines == {"LFC-ACT (runs/a)": [0.9, 0.9], "HFC-ACT (runs/a)": [0.45, 0.45],
                     "LFC-ACT (runs/b)": [0.5, 0.5], "HFC-ACT (runs/b)": [0.25, 0.25]}
    ax = Figure().subplots()
    plots._fidelity_panel(ax, fidelity[:2])
    assert [line.get_label() for line in ax.get_lines()] == ["LFC-ACT", "HFC-ACT"]


@pytest.mark.slow
def test_figures_on_a_model_without_blocks_reads_conv_inputs_with_layers_convs(tmp_path, capsys):
    config = train.RunConfig(model="mobilenet_v2", dataset="synthetic", mode="normal", epochs=1,
                             batch_size=16, subset=16, device="cpu", out=str(tmp_path / "run"),
                             model_options={"width_mult": 0.25})
    run = train.train(config)["run_dir"]
    small = ["--lambda-images", "2", "--theorem-images", "2", "--pooling-images", "2"]
    assert cli.main(["figures", str(run), "--out", str(tmp_path / "a"), *small]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no 'blocks' layers" in err and "--layers convs" in err
    assert cli.main(["figures", str(run), "--out", str(tmp_path / "b"), "--layers", "convs", *small]) == 0
    layers = {row["layer"] for row in _csv(tmp_path / "b" / "lambdas.csv")}
    assert layers and "features.0.0" in layers  # the stem conv's input: a conv/linear input


def _csv(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))
