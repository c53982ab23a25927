"""Robustness sweep (issue 8), part 1b: bad settings, names and files, through the API and the CLI.

bits not in {1, 2, 4, 8}, ratio outside (0, 1], unknown codec/model/mode/dataset names, a checkpoint
of another model or an older format, missing, unreadable and directory paths. Each is refused with
an error that names the argument (or the file) and what was expected; the CLI says it in one line
and exits 2.
"""
from __future__ import annotations

import errno

import pytest
import torch

import freqact
from freqact import checkpoint, codecs, data, models, train
from tests.robustness.helpers import checkpoint_of, run_cli, tiny


@pytest.mark.parametrize("bits", [0, 3, 16, -2])
def test_bits_outside_1_2_4_8_name_bits(bits):
    for build in (lambda: codecs.get("division", bits=bits), lambda: codecs.get("quant", bits=bits),
                  lambda: freqact.compress(tiny(), "division", bits=bits),
                  lambda: train.RunConfig(mode="division", bits=bits)):
        with pytest.raises(ValueError, match="bits"):
            build()


@pytest.mark.parametrize("bits", [True, 2.0, "2"])
def test_bits_of_the_wrong_type_name_bits(bits):
    for build in (lambda: codecs.get("division", bits=bits),
                  lambda: train.RunConfig(mode="division", bits=bits)):
        with pytest.raises(TypeError, match="bits"):
            build()


@pytest.mark.parametrize("ratio", [0, 0.0, -0.5, 1.0001, 2, float("nan")])
def test_ratio_outside_0_1_names_ratio(ratio):
    for build in (lambda: codecs.get("lfc", ratio=ratio), lambda: codecs.get("hfc", ratio=ratio),
                  lambda: freqact.split(torch.randn(1, 1, 4, 4), ratio),
                  lambda: freqact.lowpass_mask((4, 4), ratio),
                  lambda: train.RunConfig(mode="lfc", ratio=ratio)):
        with pytest.raises(ValueError, match="ratio"):
            build()


def test_unknown_names_list_the_known_ones():
    for call, arg in ((lambda: codecs.get("divison"), "codec"),
                      (lambda: freqact.compress(tiny(), "divison"), "codec"),
                      (lambda: models.get("resnet1000"), "name"),
                      (lambda: data.load("imagenet"), "dataset"),
                      (lambda: train.RunConfig(mode="fast"), "mode"),
                      (lambda: train.RunConfig(dataset="imagenet"), "dataset")):
        with pytest.raises(ValueError, match=rf"{arg}: expected one of"):
            call()


@pytest.mark.parametrize("args, expected", [
    (["--model", "resnet1000"], "model: expected one of"),
    (["--mode", "fast"], "argument --mode: invalid choice"),
    (["--dataset", "imagenet"], "argument --dataset: invalid choice"),
    (["--mode", "division", "--bits", "3"], "bits: expected one of 1, 2, 4, 8"),
    (["--mode", "lfc", "--ratio", "0"], "ratio: expected a number in (0, 1]"),
    (["--mode", "division", "--block", "0"], "block: expected an integer in [1, 65536]"),
    (["--mode", "division", "--block", str(2**64 + 2)], "block: expected an integer in [1, 65536]"),
    (["--mode", "division", "--backend", "fast"], "argument --backend: invalid choice"),
    (["--mode", "normal", "--bits", "8"], "--bits: mode 'normal' does not use it"),
    (["--mode", "division", "--ratio", "0.1"], "--ratio: mode 'division' does not use it"),
    (["--mode", "lfc", "--backend", "cpu"], "--backend: mode 'lfc' does not use it"),
    (["--lr", "nan"], "lr: expected a number in [0, 10], got nan"),
    (["--lr", "inf"], "lr: expected a number in [0, 10], got inf"),
    (["--momentum", "nan"], "momentum: expected a number in [0, 1], got nan"),
    (["--weight-decay", "1e30"], "weight_decay: expected a number in [0, 1], got 1e+30"),
    (["--seed", "-1"], "seed: expected an integer in [0, 4294967295]"),
    (["--batch-size", "0"], "batch_size: expected an integer >= 1"),
    (["--bits", "two"], "argument --bits: invalid int value"),
    (["--device", "tpu"], "device: expected"),
])
def test_cli_train_refuses_bad_settings_in_one_line(tmp_path, capsys, args, expected):
    code, err = run_cli(["train", "--model", "mlp", "--dataset", "synthetic", "--epochs", "1",
                      "--out", tmp_path / "run", "--device", "cpu", *args], capsys)
    assert code == 2 and expected in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_checkpoint_of_another_model_or_an_older_format(tmp_path, capsys):
    other = tmp_path / "other.pt"
    checkpoint.save(other, checkpoint_of("resnet20", models.get("mlp", hidden=(8,))))
    with pytest.raises(ValueError, match=r"other\.pt: weights do not fit model 'resnet20'"):
        checkpoint.load_model(other)
    code, err = run_cli(["eval", other, "--device", "cpu"], capsys)
    assert code == 2 and "other.pt" in err and "resnet20" in err
    old = tmp_path / "old.pt"
    checkpoint.save(old, checkpoint_of("mlp", models.get("mlp", hidden=(8,)), fmt="freqact-ckpt-0"))
    legacy = tmp_path / "legacy.pt"
    torch.save({"state_dict": models.get("mlp", hidden=(8,)).state_dict(), "epoch": 3}, legacy)
    for path, found in ((old, "format 'freqact-ckpt-0'"),
                        (legacy, r"a dict without a format entry \(keys \['epoch', 'state_dict'\]")):
        with pytest.raises(ValueError, match=rf"{path.name}: expected a freqact checkpoint .*"
                                             rf"got {found}"):
            checkpoint.load(path)
        code, err = run_cli(["eval", path, "--device", "cpu"], capsys)
        assert code == 2 and path.name in err


def test_missing_unreadable_and_directory_paths(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "missing.pt"
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        checkpoint.load(missing)
    with pytest.raises(ValueError, match="expected a checkpoint file, got the directory"):
        checkpoint.load(tmp_path)
    for argv in (["eval", missing], ["theorem31", missing], ["pooling", missing],
                 ["lambdas", tmp_path / "no-run"], ["sweep", tmp_path / "no-spec.toml"],
                 ["eval", tmp_path]):
        code, err = run_cli(argv, capsys)
        assert code == 2 and str(argv[1]) in err and len(err.strip().splitlines()) == 1, argv
    with pytest.raises(FileNotFoundError, match="--download"):
        data.load("cifar10", tmp_path)
    # Unreadable: root reads anything, so deny the read itself.
    locked = tmp_path / "locked.pt"
    checkpoint.save(locked, checkpoint_of("mlp", models.get("mlp", hidden=(8,))))
    real_open = open

    def deny(file, *args, **kwargs):
        if str(file) == str(locked):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", deny)
    code, err = run_cli(["eval", locked, "--device", "cpu"], capsys)
    assert code == 2 and "Permission denied" in err and "locked.pt" in err
