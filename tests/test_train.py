"""Training: config checks, one tiny run per mode, resume equality, evaluation, the CLI."""
from __future__ import annotations

import csv
import json
import pickle
import shutil

import pytest
import torch
from torch import nn

from freqact import checkpoint, cli, codecs, train
from freqact.errors import UsageTypeError


class Tiny(nn.Module):
    """Conv -> BN -> ReLU -> pool -> Linear on 3x8x8 inputs: every kind of cached tensor, fast."""

    input_shape = (3, 8, 8)

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.relu(self.bn(self.conv(x)))).flatten(1))


def _config(tmp_path, **overrides) -> train.RunConfig:
    settings = dict(model="tiny", dataset="synthetic", epochs=1, batch_size=32, subset=64,
                    out=str(tmp_path / "run"), device="cpu", save_epochs=[])
    return train.RunConfig(**{**settings, **overrides})


def _tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


@pytest.mark.parametrize("overrides, match", [
    (dict(mode="fast"), "mode"),
    (dict(block=0), "block"),
    (dict(bits=3), "bits"),
    (dict(ratio=0.0), "ratio"),
    (dict(ratio=1.5), "ratio"),
    (dict(dataset="imagenet"), "dataset"),
    (dict(epochs=0), "epochs"),
])
def test_bad_config_names_the_argument(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **overrides)


@pytest.mark.parametrize("mode", [m for m in train.MODES if m != "normal"])
def test_each_mode_passes_every_setting_its_codec_takes(mode):
    params = train.RunConfig(mode=mode).codec_params()
    codec = codecs.get(mode, **params)
    assert codec.name == mode and set(params) == {s.name for s in type(codec).settings}
    assert all(getattr(codec, name) == value for name, value in params.items())


@pytest.mark.parametrize("mode", train.MODES)
def test_one_tiny_run_per_mode(tmp_path, mode):
    results = train.train(_config(tmp_path, mode=mode), model=_tiny())
    run = tmp_path / "run"
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["1"] and tuple(rows[0]) == train.METRIC_COLUMNS
    assert json.loads((run / "metrics.jsonl").read_text())["epoch"] == 1
    assert json.loads((run / "config.json").read_text())["mode"] == mode
    final = results["final"]
    assert torch.isfinite(torch.tensor([final["train_loss"], final["test_loss"]])).all()
    if mode == "normal":
        assert final["saved_bytes"] is None
    elif mode == "exact":  # exact codec, but the engine still stores ReLU outputs as 1-bit masks
        assert 0 < final["saved_bytes"] <= final["exact_bytes"]
    else:
        assert final["saved_bytes"] < final["exact_bytes"] and final["compression_ratio"] > 1.0
    assert checkpoint.load(run / "ckpt" / "last.pt")["epoch"] == 1


def test_exact_mode_trains_bit_identically_to_normal(tmp_path):
    runs = {}
    for mode in ("normal", "exact"):
        train.train(_config(tmp_path, mode=mode, epochs=2, out=str(tmp_path / mode)), model=_tiny())
        runs[mode] = checkpoint.load(tmp_path / mode / "ckpt" / "last.pt")["model"]
    for name, value in runs["normal"].items():
        assert torch.equal(value, runs["exact"][name]), name


@pytest.mark.slow
def test_training_learns_the_synthetic_task(tmp_path):
    results = train.train(_config(tmp_path, epochs=3, subset=256), model=_tiny())
    accuracies = [row["test_acc"] for row in results["metrics"]]
    assert accuracies[-1] > 0.8  # chance is 0.1


def _timeless(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("epoch_time_s", "images_per_s")}
            for row in metrics]


def _small_cifar10(root) -> str:
    """A 40-image CIFAR-10 folder in the official layout (so runs use the CIFAR augmentation)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        images = torch.randint(0, 256, (8, 3 * 32 * 32), generator=gen, dtype=torch.uint8)
        labels = torch.randint(0, 10, (8,), generator=gen).tolist()
        batch = {b"data": images.numpy(), b"labels": labels}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=4))
    return str(root)


def test_resume_equals_an_uninterrupted_run(tmp_path):
    """Resuming from epoch 1's checkpoint gives the same later epochs as running through.

    CIFAR augmentation draws crops and flips from the augmentation generator, and division mode
    draws stochastic-rounding noise from the torch RNG, so both states must travel with the
    checkpoint for the metrics and weights to match exactly.
    """
    settings = dict(dataset="cifar10", data_dir=_small_cifar10(tmp_path), batch_size=16,
                    subset=None, mode="division", epochs=2, save_epochs=[1])
    whole = train.train(_config(tmp_path, **settings, out=str(tmp_path / "full")), model=_tiny())
    interrupted = tmp_path / "resumed" / "ckpt"
    interrupted.mkdir(parents=True)
    shutil.copy(tmp_path / "full" / "ckpt" / "epoch-0001.pt", interrupted / "last.pt")
    torch.manual_seed(123)  # the resumed process starts from an unrelated RNG state
    resumed = train.train(_config(tmp_path, **settings, resume=True, out=str(tmp_path / "resumed")),
                          model=_tiny(seed=7))
    assert _timeless(resumed["metrics"]) == _timeless(whole["metrics"])
    a = checkpoint.load(tmp_path / "full" / "ckpt" / "last.pt")
    b = checkpoint.load(tmp_path / "resumed" / "ckpt" / "last.pt")
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name


def test_existing_run_needs_resume_and_matching_settings(tmp_path):
    train.train(_config(tmp_path), model=_tiny())
    with pytest.raises(ValueError, match="--resume"):
        train.train(_config(tmp_path), model=_tiny())
    with pytest.raises(ValueError, match="lr"):
        train.train(_config(tmp_path, lr=0.5, resume=True), model=_tiny())


def test_evaluate_matches_a_float64_oracle():
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, y = torch.randn(37, 5), torch.randint(0, 3, (37,))
    result = train.evaluate(model, [(x[i:i + 8], y[i:i + 8]) for i in range(0, 37, 8)], "cpu")
    logits = x.double() @ model.weight.double().T + model.bias.double()
    assert result["count"] == 37
    assert result["loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-6)
    assert result["accuracy"] == pytest.approx((logits.argmax(1) == y).double().mean().item())


def test_amp_bfloat16_on_cpu_runs(tmp_path):
    results = train.train(_config(tmp_path, amp=True, mode="division"), model=_tiny())
    assert torch.isfinite(torch.tensor(results["final"]["train_loss"]))


@pytest.mark.slow
def test_cli_train_then_eval(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--dataset", "synthetic", "--mode", "division",
            "--epochs", "2", "--subset", "64", "--batch-size", "32", "--out", str(out),
            "--device", "cpu", "--save-every", "1"]
    assert cli.main(argv) == 0
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["epoch-0001.pt", "epoch-0002.pt",
                                                                 "last.pt"]
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    assert cli.main(["eval", str(out / "ckpt" / "last.pt"), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert f"accuracy {last['test_acc']:.4f}" in printed
    assert f"loss {last['test_loss']:.4f}" in printed
    assert printed.rstrip().endswith("images)")


@pytest.mark.parametrize("argv, match", [
    (["--model", "resnet1000"], "model: expected one of"),
    (["--dataset", "cifar10", "--data-dir", "{tmp}"], "--download"),
    (["--bits", "3"], "bits"),
    (["--block", "0"], "block"),
    (["--ratio", "2"], "ratio"),
    # model settings of the wrong type: the family's UsageTypeError, not a traceback
    (["--model-options", '{"hidden": 64}'], "hidden: expected a tuple"),
    (["--model-options", '{"input_shape": 5}'], "input_shape: expected a tuple"),
    (["--model-options", '{"input_shape": [1, 2, 3, 4]}'], "input_shape: expected (F,)"),
    (["--model", "swin", "--model-options", '{"depths": 2}'], "depths, heads: expected tuples"),
    (["--model", "mobilenet_v2", "--model-options", '{"width_mult": "x"}'], "width_mult: expected a number"),
])
def test_cli_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, match):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = cli.main(["train", "--model", "mlp", "--dataset", "synthetic", "--out",
                     str(tmp_path / "run"), "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("save_epochs", [3, "12"])
def test_run_config_refuses_save_epochs_that_is_not_a_list(save_epochs):
    # a config.json or a Python caller's save_epochs=3 was a bare "'int' object is not iterable"
    # (and "12" read as epochs 1 and 2)
    with pytest.raises(UsageTypeError, match="save_epochs: expected a list of epochs"):
        train.RunConfig(model="mlp", dataset="synthetic", save_epochs=save_epochs)


def test_cli_refuses_a_gpu_index_this_machine_lacks_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for argv in (["train", "--model", "mlp", "--dataset", "synthetic", "--out", str(tmp_path / "run")],
                 ["figures", str(tmp_path / "run")]):
        assert cli.main([*argv, "--device", "cuda:2"]) == 2
        err = capsys.readouterr().err
        assert err.endswith("error: device: expected 'cuda' or 'cuda:N' with N < 2 (the GPUs this machine has), "
                            "got 'cuda:2'\n") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_real_cifar_smoke(tmp_path, cifar_dir):
    results = train.train(_config(tmp_path, dataset="cifar10", data_dir=str(cifar_dir.parent),
                                  subset=128, mode="division"), model=_tiny())
    assert results["final"]["epoch"] == 1
    assert torch.isfinite(torch.tensor(results["final"]["test_loss"]))


def test_progress_lines_off_a_terminal_every_tenth_of_an_epoch_or_log_every(tmp_path, capsys):
    """pytest's stdout is not a terminal: ~10 lines per epoch, or one per `log_every` steps."""
    train.train(_config(tmp_path, subset=320, batch_size=16, out=str(tmp_path / "a")),
                model=_tiny())  # 20 steps: a line every 2 steps but the last
    lines = [line for line in capsys.readouterr().out.splitlines() if "step" in line]
    assert [line.split("step ")[1].split()[0] for line in lines] == [
        f"{k}/20" for k in range(2, 20, 2)]
    assert lines[0].startswith("  epoch 1/1 step 2/20  train loss ")
    train.train(_config(tmp_path, subset=320, batch_size=16, log_every=7,
                        out=str(tmp_path / "b")), model=_tiny())
    lines = [line for line in capsys.readouterr().out.splitlines() if "step" in line]
    assert [line.split("step ")[1].split()[0] for line in lines] == ["7/20", "14/20"]
    with pytest.raises(ValueError, match="log_every"):
        _config(tmp_path, log_every=0)
    assert cli.build_parser().parse_args(["train", "--log-every", "5"]).log_every == 5


# ---- include/exclude and the recorded windows -----------------------------------------------------

def test_include_exclude_resolve_to_torch_nn_types_and_module_names():
    config = train.RunConfig(mode="lfc", ratio=0.2, include=["Conv2d", "fc"], exclude="bn")
    assert config.exclude == ["bn"]  # one name is a list of one
    assert config.selectors(_tiny()) == {"include": [nn.Conv2d, "fc"], "exclude": ["bn"]}
    assert "include" not in train.RunConfig(include=["Conv2d"]).to_dict()  # normal: unused
    assert train.RunConfig(mode="lfc", ratio=0.2, include=["Conv2d"]).to_dict()["include"] == ["Conv2d"]


@pytest.mark.parametrize("value, error, match", [
    (["Conv2D"], ValueError, r"include: 'Conv2D' is neither a torch.nn module type .*did you mean 'Conv2d'"),
    (["layer1.0.conv1"], ValueError, "include: 'layer1.0.conv1' is neither .* module of Tiny"),
    (["os.system"], ValueError, "include: 'os.system' is neither"),
    ([], ValueError, "include: expected 1 to 256"),
    ([""], ValueError, "include: expected a module type name or module name"),
    (["x" * 300], ValueError, "include: expected a module type name or module name of 1 to 256"),
    ([nn.Conv2d], TypeError, "include: expected a list of module type names"),
    (3, TypeError, "include: expected a list"),
])
def test_bad_include_is_refused_before_anything_is_written(tmp_path, value, error, match):
    with pytest.raises(error, match=match):
        train.train(_config(tmp_path, mode="lfc", ratio=0.5, include=value), model=_tiny())
    assert not (tmp_path / "run" / "config.json").exists()


@pytest.mark.parametrize("rule", ["nearest", "official"])
def test_spectral_runs_record_the_windows_of_the_inputs_they_compress(tmp_path, rule):
    """W per compressed input in config.json: both rules (they differ at 0.3 on 8x8 maps), and
    include/exclude change which inputs are listed (the classifier's (N, 32) input never is)."""
    from freqact import dct

    want = list(dct.windows((8, 8), 0.3, rule=rule))
    cases = {"default": {}, "convs": {"include": ["Conv2d"]}, "no-conv": {"exclude": ["conv"]}}
    listed, saved = {}, {}
    for case, selectors in cases.items():
        results = train.train(_config(tmp_path, mode="lfc", ratio=0.3, window_rule=rule,
                                      out=str(tmp_path / case), **selectors), model=_tiny())
        stored = json.loads((tmp_path / case / "config.json").read_text())
        assert all(row["windows"] == want and row["shape"][1:] == [3 if row["type"] == "Conv2d"
                                                                    else 8, 8, 8]
                   for row in stored["layer_windows"])
        listed[case] = [row["layer"] for row in stored["layer_windows"]]
        saved[case] = results["final"]["saved_bytes"]
    assert listed == {"default": ["conv", "bn"], "convs": ["conv"], "no-conv": ["bn"]}
    assert saved["no-conv"] > saved["default"]  # the conv input is then held whole


def test_non_spectral_runs_record_no_windows_and_old_configs_still_resume(tmp_path):
    from freqact import rundir

    train.train(_config(tmp_path, mode="division"), model=_tiny())
    assert "layer_windows" not in json.loads((tmp_path / "run" / "config.json").read_text())
    # an lfc run written before window_rule, include/exclude and layer_windows existed
    train.train(_config(tmp_path, mode="lfc", ratio=0.5, out=str(tmp_path / "old")), model=_tiny())
    stored = json.loads((tmp_path / "old" / "config.json").read_text())
    old = {k: v for k, v in stored.items()
           if k not in ("window_rule", "include", "exclude", "layer_windows")}
    rundir.check_resumable(old, stored, "old")  # read as nearest, no include/exclude
    with pytest.raises(ValueError, match="window_rule: 'nearest' -> 'official'"):
        rundir.check_resumable(old, {**stored, "window_rule": "official"}, "old")
    with pytest.raises(ValueError, match=r"include: None -> \['Conv2d'\]"):
        rundir.check_resumable(old, {**stored, "include": ["Conv2d"]}, "old")


@pytest.mark.parametrize("argv, match", [
    (["--mode", "normal", "--include", "Conv2d"], "--include: mode 'normal' does not use it"),
    (["--mode", "normal", "--exclude", "fc"], "--exclude: mode 'normal' does not use it"),
    (["--mode", "lfc", "--ratio", "0.2", "--include", "Conv2D"], "include: 'Conv2D' is neither"),
    (["--mode", "hfc", "--ratio", "0.2", "--exclude", "head"], "exclude: 'head' is neither"),
])
def test_cli_bad_include_exclude_exit_2_with_one_line(tmp_path, capsys, argv, match):
    code = cli.main(["train", "--model", "mlp", "--dataset", "synthetic", "--out",
                     str(tmp_path / "run"), "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1


def test_cli_include_exclude_reach_config_json(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["train", "--model", "mlp", "--dataset", "synthetic", "--mode", "division",
                     "--epochs", "1", "--subset", "32", "--batch-size", "32", "--out", str(out),
                     "--device", "cpu", "--save-epochs", "--include", "Linear",
                     "--exclude", "layers.0"]) == 0
    stored = json.loads((out / "config.json").read_text())
    assert stored["include"] == ["Linear"] and stored["exclude"] == ["layers.0"]
