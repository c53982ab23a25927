"""Checkpoints: atomic save, safe and strict loading, model rebuild."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from freqact import checkpoint, models


def _ckpt(model: torch.nn.Module, name: str = "mlp") -> dict:
    return {"format": checkpoint.FORMAT, "epoch": 3, "config": {"model": name, "num_classes": 10},
            "model": model.state_dict(), "rng": {"torch": [torch.get_rng_state()]}, "metrics": []}


def test_round_trip_and_no_temp_files(tmp_path):
    obj = _ckpt(torch.nn.Linear(3, 2))
    path = tmp_path / "sub" / "last.pt"
    checkpoint.save(path, obj)
    checkpoint.save(path, {**obj, "epoch": 4})  # replaces the file in place
    loaded = checkpoint.load(path)
    assert loaded["epoch"] == 4 and loaded["config"] == obj["config"]
    assert torch.equal(loaded["model"]["weight"], obj["model"]["weight"])
    assert torch.equal(loaded["rng"]["torch"][0], obj["rng"]["torch"][0])
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt"]


@pytest.mark.skipif(not hasattr(os, "umask") or os.name != "posix", reason="POSIX permissions")
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_atomic_writes_get_the_mode_a_plain_open_gives(tmp_path, umask):
    old = os.umask(umask)
    try:
        (tmp_path / "plain.txt").write_bytes(b"x")
        checkpoint.atomic_write(tmp_path / "table.csv", b"a,b\n")
        checkpoint.save(tmp_path / "ckpt" / "last.pt", _ckpt(torch.nn.Linear(3, 2)))
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    assert (tmp_path / "plain.txt").stat().st_mode & 0o777 == expected
    for path in (tmp_path / "table.csv", tmp_path / "ckpt" / "last.pt"):
        assert path.stat().st_mode & 0o777 == expected, path


def test_failed_save_keeps_the_old_file(tmp_path):
    path = tmp_path / "last.pt"
    checkpoint.save(path, _ckpt(torch.nn.Linear(3, 2)))
    before = path.read_bytes()
    with pytest.raises(Exception):
        checkpoint.save(path, {"format": checkpoint.FORMAT, "bad": lambda: None})  # unpicklable
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_truncated_corrupt_and_foreign_files_name_the_file(tmp_path):
    good = tmp_path / "good.pt"
    checkpoint.save(good, _ckpt(torch.nn.Linear(3, 2)))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:200])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 10)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    for path in (truncated, garbage, foreign):
        with pytest.raises(ValueError, match=path.name):
            checkpoint.load(path)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        checkpoint.load(tmp_path / "missing.pt")


class _Payload:
    """Unpickling this creates `path`: a stand-in for arbitrary code in a checkpoint."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_code_in_a_checkpoint_is_refused_and_not_run(tmp_path):
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(proof)))
    assert proof.exists()  # the payload works when unpickled without restrictions

    target = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "x": _Payload(target)}, path)
    with pytest.raises(ValueError, match="evil.pt"):
        checkpoint.load(path)
    assert not target.exists()


def _rewritten(source, target, edit) -> None:
    """Copy the zip `source` to `target`, each member through edit(info, bytes) -> (bytes, method)."""
    import zipfile

    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            content, method = edit(info, old.read(info))
            new.writestr(info.filename, content, compress_type=method)


def test_a_compressed_storage_is_refused_before_it_is_inflated(tmp_path):
    import zipfile

    # 2**22 zero floats (16 MB) deflate to 16 kB: torch.load inflated such a member whatever its
    # size, so a small file could ask for any amount of memory
    source, bomb = tmp_path / "source.pt", tmp_path / "bomb.pt"
    checkpoint.save(source, {"format": checkpoint.FORMAT, "t": torch.zeros(2**22)})
    _rewritten(source, bomb, lambda info, content: (
        content, zipfile.ZIP_DEFLATED if info.filename.endswith("/data/0") else zipfile.ZIP_STORED))
    assert bomb.stat().st_size < 2**16
    assert torch.load(bomb, weights_only=True)["t"].numel() == 2**22  # torch alone inflates it
    with pytest.raises(ValueError, match=r"bomb.pt: .*member \S+/data/0 is compressed"):
        checkpoint.load(bomb)
    assert checkpoint.load(source)["t"].numel() == 2**22


def test_a_deeply_nested_checkpoint_is_refused_not_a_crash(tmp_path):
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    # {"format": ..., ((...),): 1}, the tuple 10**6 deep (1 MB): torch.load's dict hashed it,
    # recursing in C until Python crashed
    deep = (b"\x80\x02}(X\x06\x00\x00\x00format" + pickle.dumps(checkpoint.FORMAT, 2)[2:-1]
            + b")" + b"\x85" * 10**6 + b"K\x01u.")
    source, path = tmp_path / "source.pt", tmp_path / "deep.pt"
    checkpoint.save(source, {"format": checkpoint.FORMAT})
    _rewritten(source, path, lambda info, content: (
        deep if info.filename.endswith("data.pkl") else content, zipfile.ZIP_STORED))
    code = "import sys; from freqact import checkpoint; checkpoint.load(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[1])
    assert done.returncode == 1, (done.returncode, done.stderr[-500:])
    assert f"{path}: not a loadable checkpoint" in done.stderr
    assert f"nests values more than {checkpoint.MAX_PICKLE_DEPTH} deep" in done.stderr
    # a checkpoint as train writes it is far from the bound
    model = models.get("resnet18", num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.zeros(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    checkpoint.save(path, {**_ckpt(model, "resnet18"), "optimizer": optimizer.state_dict()})
    with zipfile.ZipFile(path) as archive:
        pkl = next(name for name in archive.namelist() if name.endswith("data.pkl"))
        assert checkpoint.check_pickle_depth(pkl, archive.read(pkl)) < 20
    checkpoint.load_model(path)


def test_load_model_rebuilds_the_weights(tmp_path):
    torch.manual_seed(0)
    trained = models.get("mlp", num_classes=10)
    path = tmp_path / "c.pt"
    checkpoint.save(path, _ckpt(trained))
    model, ckpt = checkpoint.load_model(path)
    assert ckpt["epoch"] == 3 and not model.training
    x = torch.randn(2, *trained.input_shape)
    torch.testing.assert_close(model(x), trained.eval()(x), rtol=0, atol=0)


def test_load_model_names_every_missing_key_before_building(tmp_path, monkeypatch):
    ckpt = _ckpt(models.get("mlp", num_classes=10))
    del ckpt["epoch"]
    path = tmp_path / "c.pt"
    checkpoint.save(path, ckpt)
    monkeypatch.setattr(models, "get", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(ValueError) as refusal:
        checkpoint.load_model(path, required=("dataset", "mode", "dataset"))
    assert str(refusal.value) == (f"{path}: lacks 'epoch' and its config lacks 'dataset', 'mode', which "
                                  "freqact train writes (not a freqact checkpoint, or damaged)")


def test_load_model_mismatch_is_a_clear_error(tmp_path):
    path = tmp_path / "c.pt"
    checkpoint.save(path, _ckpt(torch.nn.Linear(3, 2), name="mlp"))
    with pytest.raises(ValueError, match="do not fit model 'mlp'"):
        checkpoint.load_model(path)


def test_missing_keys_takes_none_only_where_train_writes_none():
    import dataclasses

    from freqact import runconfig
    # the RunConfig fields that default to None (out is always filled in), and a normal run's kernels
    written_as_none = {f.name for f in dataclasses.fields(runconfig.RunConfig) if f.default is None}
    assert (written_as_none - {"out"}) | {"kernels"} == checkpoint.MAY_BE_NONE
    config = {"dataset": "synthetic", "subset": None, "data_dir": None, "seed": None}
    assert checkpoint.missing_keys(config, ["dataset", "subset", "data_dir", "seed", "epochs"]) == ["seed", "epochs"]


def _eval_ckpt(tmp_path, drop=(), **config) -> str:
    ckpt = _ckpt(models.get("mlp", num_classes=10))
    ckpt["config"].update({"dataset": "synthetic", "data_dir": None, "subset": 16, "seed": 0, **config})
    for key in drop:
        del ckpt["config"][key]
    path = tmp_path / "dir with spaces" / f"no-{'-'.join(drop) or 'gap'}.pt"
    checkpoint.save(path, ckpt)
    return str(path)


@pytest.mark.parametrize("drop, none", [(("data_dir",), ()), (("subset",), ()), (("seed",), ()), (("dataset",), ()),
                                        ((), ("seed",)), ((), ("dataset",))])
def test_cli_eval_names_the_file_and_the_key_a_config_lacks(tmp_path, capsys, drop, none):
    from freqact import cli

    path = _eval_ckpt(tmp_path, drop, **dict.fromkeys(none))
    assert cli.main(["eval", path, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"freqact eval: error: {path}: its config lacks {(drop or none)[0]!r}, which freqact train "
                   "writes (not a freqact checkpoint, or damaged)")


def test_cli_eval_takes_the_none_train_writes_for_data_dir_and_subset(tmp_path, capsys):
    from freqact import cli

    path = _eval_ckpt(tmp_path, subset=None)
    assert cli.main(["eval", path, "--device", "cpu", "--batch-size", "64"]) == 0
    assert capsys.readouterr().out.startswith(f"{path} (epoch 3): test loss ")
