"""Robustness sweep (issue 8), part 3: hostile files never run their payload.

Each payload is first shown to work (its loader of choice creates a marker directory), then fed to
freqact's loaders, which refuse or read it as data; the marker never appears.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from freqact import checkpoint, data, download, sweep, train
from tests.robustness.helpers import run_cli


class _Payload:
    """Unpickling this runs os.mkdir(path): a stand-in for arbitrary code in a file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _armed(marker: Path, run_payload) -> None:
    """Prove the payload works (it creates `marker`), then remove the evidence."""
    run_payload()
    assert marker.exists(), "the payload would not have run anyway: the test proves nothing"
    marker.rmdir()


def test_hostile_checkpoint_is_refused_and_never_run(tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "run" / "ckpt" / "last.pt"
    evil.parent.mkdir(parents=True)
    torch.save({"format": checkpoint.FORMAT, "epoch": 1, "config": {"model": "mlp"},
                "model": _Payload(marker)}, evil)
    _armed(marker, lambda: torch.load(evil, weights_only=False))
    with pytest.raises(ValueError, match=r"last\.pt: .*GLOBAL \w+\.mkdir"):
        checkpoint.load(evil)
    run = evil.parent.parent
    for argv in (["eval", evil, "--device", "cpu"], ["pooling", evil], ["lambdas", run],
                 ["train", "--model", "mlp", "--dataset", "synthetic", "--out", run,
                  "--device", "cpu", "--resume"]):
        code, err = run_cli(argv, capsys)
        assert code == 2 and "last.pt" in err, argv
    assert not marker.exists()


def test_hostile_cifar_batch_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    payload = pickle.dumps({b"data": _Payload(marker), b"labels": [0]}, protocol=2)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (folder / name).write_bytes(payload)
    _armed(marker, lambda: pickle.loads(payload))
    with pytest.raises(ValueError, match=r"data_batch_1: not a plain-data pickle .*\w+\.mkdir"):
        data.load("cifar10", tmp_path)
    assert not marker.exists()


def _run_dir_with_code_in_its_results(run: Path, code: str) -> None:
    """A run directory whose result files hold Python source where values belong."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": code, "mode": "division", "epochs": 1}))
    (run / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "test_acc": code}) + "\n")


def test_results_files_are_read_as_data_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    code = f"__import__('os').mkdir({str(marker)!r})"
    _armed(marker, lambda: eval(code))  # what an eval-based reader would do
    run = tmp_path / "run"
    _run_dir_with_code_in_its_results(run, code)
    assert sweep.read_metrics(run) == [{"epoch": 1, "test_acc": code}]
    assert train.read_metrics(run) == [{"epoch": 1, "test_acc": code}]
    assert train.read_config(run)["model"] == code
    assert not marker.exists()


def test_pickle_disguised_as_results_or_spec_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    blob = pickle.dumps(_Payload(marker))
    _armed(marker, lambda: pickle.loads(blob))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(blob)
    with pytest.raises(ValueError, match=r"metrics\.jsonl: not valid JSON"):
        sweep.read_metrics(run)
    spec = tmp_path / "study.yaml"
    spec.write_text(f"!!python/object/apply:os.mkdir [{str(marker)!r}]\n")
    yaml = pytest.importorskip("yaml", reason="pyyaml reads .yaml specs")
    _armed(marker, lambda: yaml.unsafe_load(spec.read_text()))
    with pytest.raises(ValueError, match="study.yaml"):
        sweep.load_spec(spec)
    assert not marker.exists()


# ---- issue 15.3: data files cannot exhaust memory; batches hold what CIFAR holds ----------------

def _pickle_file(tmp_path, raw: bytes, name: str = "data_batch_1"):
    path = tmp_path / name
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("label, raw", [
    # PROTO 2, BININT1 1, LONG_BINPUT 2**31 - 1, STOP: the C unpickler's memo asks for 16 GiB
    ("memo-index", b"\x80\x02K\x01r\xff\xff\xff\x7f."),
    # BINBYTES8 / BINUNICODE8 stating 2**62 bytes that are not there
    ("bytes8", b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b"abc."),
    ("unicode8", b"\x80\x04\x8d" + (1 << 62).to_bytes(8, "little") + b"abc."),
    # BYTEARRAY8 allocates its stated length before reading
    ("bytearray8", b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little") + b"abc."),
    # numpy.ndarray((2**40,)) called directly, and _reconstruct asked for a huge shape
    ("ndarray-call", b"\x80\x02cnumpy\nndarray\nJ\x00\x00\x00\x40\x85R."),
    ("reconstruct", b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
                    b"J\x00\x00\x00\x40\x85C\x01b\x87R."),
    ("frame", b"\x80\x04\x95" + (1 << 62).to_bytes(8, "little") + b"."),
    ("memo-get", b"\x80\x02h\x05."),
    ("empty-stack", b"\x80\x02e."),
    ("truncated-int", b"\x80\x02J\x01"),
])
def test_hostile_pickles_are_a_valueerror_naming_the_file_in_bounded_memory(tmp_path, label, raw):
    import tracemalloc

    path = _pickle_file(tmp_path, raw)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"{path.name}: not a plain-data pickle"):
            data.load_pickle(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, (label, peak)


def _text(s: str) -> bytes:
    return b"X" + len(s).to_bytes(4, "little") + s.encode()


_DTYPE_U8 = b"cnumpy\ndtype\n" + _text("u8") + b"\x89\x88\x87R"  # numpy.dtype("u8", False, True)
_MINUS_1 = b"J\xff\xff\xff\xff"


def _dtype_state(byte_order: str = "|", subarray: bytes = b"N", flags: int = 0) -> bytes:
    """(3, byte_order, subarray, None, None, -1, -1, flags) then BUILD: numpy's dtype state."""
    return (b"(K\x03" + _text(byte_order) + subarray + b"NN" + _MINUS_1 + _MINUS_1
            + b"K" + bytes([flags]) + b"tb")


@pytest.mark.parametrize("label, raw", [
    # a uint64 dtype given numpy's "holds objects" flags: numpy then takes numbers for pointers
    ("object-flags", b"\x80\x02" + _DTYPE_U8 + _dtype_state(flags=63) + b"."),
    # ... and an array of it, its data a list (what object arrays pickle): loads, numpy errors later
    ("object-flags-array", b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85"
     + _DTYPE_U8 + b"\x87R(K\x01K\x02\x85" + _DTYPE_U8 + _dtype_state(flags=63)
     + b"\x89]K\x01K\x02etb."),
    # a uint64 dtype turned into a subarray of 4 bytes by its state: kind "u", 4 values an element
    ("subarray", b"\x80\x02" + _DTYPE_U8 + _dtype_state(
        subarray=b"cnumpy\ndtype\n" + _text("u1") + b"\x89\x88\x87RK\x04\x85\x86") + b"."),
    # numpy.dtype(("u1", {"r": ("u1", 0)})): kind "u" with fields
    ("fields", b"\x80\x02cnumpy\ndtype\n" + _text("u1") + b"}" + _text("r") + _text("u1")
     + b"K\x00\x86s\x86\x85R."),
    # BUILD on the loader's own function: a data file setting attributes in the process
    ("build-function", b"\x80\x02c_codecs\nencode\n}" + _text("planted") + b"K\x01sb."),
], ids=lambda v: v if isinstance(v, str) else "")
def test_pickled_dtypes_are_plain_and_build_sets_nothing_else(tmp_path, label, raw):
    from freqact import safepickle

    path = _pickle_file(tmp_path, raw)
    with pytest.raises(ValueError, match=rf"{path.name}: not a plain-data pickle \(refusing"):
        data.load_pickle(path)
    assert not hasattr(safepickle._latin1_bytes, "planted")
    # what numpy itself writes still loads, big-endian and Python 2 files included
    for array in (np.arange(6, dtype=">f4").reshape(2, 3), np.array([True]), np.int8([-1])):
        path.write_bytes(pickle.dumps(array, protocol=2))
        loaded = data.load_pickle(path)
        assert loaded.dtype == pickle.loads(path.read_bytes()).dtype and (loaded == array).all()


def test_a_deeply_nested_tuple_key_is_refused_not_a_crash(tmp_path):
    import subprocess
    import sys

    # {(((...),),): 1} with the tuple 10**6 deep, 1 MB: hashing it recursed in C until Python crashed
    path = _pickle_file(tmp_path, b"\x80\x02})" + b"\x85" * 10**6 + b"K\x01s.")
    code = "import sys; from freqact.safepickle import load_pickle; load_pickle(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 1, (done.returncode, done.stderr[-500:])
    assert f"{path}: not a plain-data pickle (it nests values more than" in done.stderr
    # the depth a plain pickle uses loads: numpy's own state, and a key of tuples up to the bound
    path.write_bytes(b"\x80\x02})" + b"\x85" * (checkpoint.MAX_PICKLE_DEPTH - 2) + b"K\x01s.")
    assert list(data.load_pickle(path).values()) == [1]


def _batch(images, labels) -> bytes:
    return pickle.dumps({b"data": images, b"labels": labels}, protocol=2)


@pytest.mark.parametrize("images, labels, match", [
    (np.zeros((2, 3072), np.uint8), [1, 3.7], "list of integers"),
    (np.zeros((2, 3072), np.uint8), [1, True], "list of integers"),
    (np.zeros((2, 3072), np.uint8), [1, 10], r"labels outside \[0, 10\)"),
    (np.zeros((2, 3072), np.uint8), [-1, 0], r"labels outside \[0, 10\)"),
    (np.zeros((2, 3072), np.uint8), [1], "expected 2 labels"),
    (np.full((2, 3072), 300.7), [1, 2], r"integer array \(N, 3072\)"),
    (np.full((2, 3072), 300, np.int64), [1, 2], "pixel values in 0..255"),
    (np.zeros((2, 3071), np.uint8), [1, 2], r"\(N, 3072\), got uint8 \(2, 3071\)"),
    (np.zeros((2, 3, 32, 32), np.uint8), [1, 2], r"\(N, 3072\)"),
    ([[0] * 3072], [1], r"integer array \(N, 3072\), got list"),
])
def test_cifar_batches_hold_uint8_pixels_and_integer_labels_in_range(tmp_path, images, labels,
                                                                      match):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    good = _batch(np.zeros((2, 3072), np.uint8), [0, 1])
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(good)
    data.load("cifar10", tmp_path)  # the good files load
    (folder / "data_batch_4").write_bytes(_batch(images, labels))
    with pytest.raises(ValueError, match=rf"data_batch_4: .*{match}"):
        data.load("cifar10", tmp_path)


def _tar_gz(members: dict[str, bytes], links: dict[str, str] = ()) -> bytes:
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        for name, target in dict(links).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buffer.getvalue()


def _serve(monkeypatch, blob: bytes) -> None:
    import hashlib
    import io

    monkeypatch.setattr(download.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(blob))
    monkeypatch.setitem(data._CIFAR, "cifar10",
                        {**data._CIFAR["cifar10"], "md5": hashlib.md5(blob).hexdigest()})


def test_download_unpacks_only_the_data_folder_and_never_overwrites(tmp_path, monkeypatch):
    root = tmp_path / "data"
    root.mkdir()
    (root / "README").write_text("mine")
    batch = _batch(np.zeros((1, 3072), np.uint8), [0])
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    blob = _tar_gz({"README": b"theirs", **{f"cifar-10-batches-py/{n}": batch for n in names}})
    _serve(monkeypatch, blob)
    assert data.load("cifar10", root, download=True).train_images.shape == (5, 3, 32, 32)
    assert (root / "README").read_text() == "mine"
    assert sorted(p.name for p in root.iterdir()) == ["README", "cifar-10-batches-py"]
    # a partial folder: only its missing files are added, the others left as they are
    (root / "cifar-10-batches-py" / "data_batch_2").unlink()
    (root / "cifar-10-batches-py" / "test_batch").write_bytes(b"kept")
    data.download_cifar("cifar10", root)
    assert (root / "cifar-10-batches-py" / "test_batch").read_bytes() == b"kept"
    assert (root / "cifar-10-batches-py" / "data_batch_2").read_bytes() == batch
    assert sorted(p.name for p in root.iterdir()) == ["README", "cifar-10-batches-py"]
    # a file where the folder goes: a one-line error naming it, not a rename failing in a temp folder
    shutil.rmtree(root / "cifar-10-batches-py")
    (root / "cifar-10-batches-py").write_text("mine")
    with pytest.raises(ValueError, match=r"^\S+/data/cifar-10-batches-py: expected the folder"):
        data.load("cifar10", root, download=True)
    assert (root / "cifar-10-batches-py").read_text() == "mine"
    assert sorted(p.name for p in root.iterdir()) == ["README", "cifar-10-batches-py"]


@pytest.mark.parametrize("members, links, match", [
    ({"../escape": b"x"}, {}, "cannot unpack the archive safely"),
    ({"/abs/escape": b"x"}, {}, "holds no folder"),  # the data filter strips the leading /
    ({}, {"cifar-10-batches-py": "/etc"}, "cannot unpack the archive safely|holds no folder"),
    ({"other/file": b"x"}, {}, "holds no folder cifar-10-batches-py"),
])
def test_hostile_archives_end_in_one_line_and_leave_nothing(tmp_path, monkeypatch, capsys,
                                                            members, links, match):
    root = tmp_path / "data"
    _serve(monkeypatch, _tar_gz(members, links))
    with pytest.raises(ValueError, match=match) as caught:
        data.download_cifar("cifar10", root)
    assert len(str(caught.value).splitlines()) == 1
    assert list(root.iterdir()) == [] and not (tmp_path / "escape").exists()
    code, err = run_cli(["train", "--model", "mlp", "--out", tmp_path / "run", "--device", "cpu",
                         "--data-dir", root, "--download"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1


# ---- issue 15.5: specs, checkpoints and metrics files with hostile contents --------------------

@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "..", "a/b", "a\\b"])
def test_a_spec_name_cannot_leave_the_sweeps_folder(name):
    spec = {"name": name, "base": {"model": "mlp", "dataset": "synthetic", "epochs": 1}}
    with pytest.raises(ValueError, match="name: expected one folder name"):
        sweep.expand(spec)


def test_variant_labels_and_grid_values_stay_one_folder_inside_out(tmp_path):
    spec = {"name": "s", "base": {"model": "mlp", "dataset": "synthetic", "epochs": 1},
            "grid": {"lr": [0.1], "seed": [0]},
            "variants": [{"label": "../../up", "mode": "normal"}, {"label": "/abs", "mode": "exact"}]}
    study = sweep.expand(spec, tmp_path / "out")
    for run in study.runs:
        assert run.run_dir.resolve().is_relative_to((tmp_path / "out").resolve())
        assert len(run.run_dir.relative_to(tmp_path / "out").parts) == 3
    assert [r.run_dir.parts[-3] for r in study.runs] == ["up", "abs"]


def test_a_grid_of_a_billion_runs_is_refused_before_expanding(tmp_path, capsys):
    spec = tmp_path / "huge.json"
    grid = {field: list(range(10)) for field in ("seed", "epochs", "batch_size", "subset",
                                                  "block", "save_every", "weight_decay", "lr", "momentum")}
    spec.write_text(json.dumps({"base": {"model": "mlp", "dataset": "synthetic"}, "grid": grid}))
    code, err = run_cli(["sweep", spec, "--dry-run"], capsys)
    assert code == 2 and "1,000,000,000 runs" in err and "at most 10,000" in err


@pytest.mark.parametrize("suffix, text", [
    # each level aliases the one before 9 times: 9**9 values once expanded
    (".yaml", "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n"
        for i in range(8)) + "description: *i\n"),
    (".yaml", "name: &n [*n]\n"),  # an alias to itself
    (".yaml", "[" * 100_000 + "]" * 100_000),
    (".json", "[" * 100_000 + "]" * 100_000),
    (".toml", "x = " + "[" * 100_000 + "]" * 100_000),
    # integers past Python's 4300 digits, and a date that is none: a ValueError without the file
    (".json", '{"x": ' + "1" * 5000 + "}"),
    (".toml", "x = " + "1" * 5000),
    (".yaml", "x: " + "1" * 5000),
    (".yaml", "x: 2023-13-45"),
])
def test_spec_bombs_end_in_one_line_naming_the_file(tmp_path, capsys, suffix, text):
    pytest.importorskip("yaml", reason="pyyaml reads .yaml specs")
    spec = tmp_path / f"bomb{suffix}"
    spec.write_text(text)
    code, err = run_cli(["sweep", spec, "--dry-run"], capsys)
    assert code == 2 and spec.name in err and len(err.strip().splitlines()) == 1, err[-500:]


def test_a_huge_spec_file_is_refused(tmp_path):
    spec = tmp_path / "big.json"
    spec.write_text(" " * (sweep.MAX_SPEC_BYTES + 1) + "{}")
    with pytest.raises(ValueError, match="big.json: larger than"):
        sweep.load_spec(spec)


@pytest.mark.parametrize("field, value, match", [
    ("num_classes", 10**9, r"num_classes: expected an integer in \[1, 100000\]"),
    ("num_classes", True, "num_classes"),
    ("num_classes", "10", "num_classes"),
    ("model", "os.system", "config model: expected one of"),
    ("seed", "0", "config seed: expected int"),
])
def test_a_checkpoint_config_is_checked_before_a_model_is_built(tmp_path, monkeypatch, field,
                                                                value, match):
    from freqact import models
    from tests.robustness.helpers import checkpoint_of

    ckpt = checkpoint_of("mlp", models.get("mlp"))
    ckpt["config"][field] = value
    path = tmp_path / "c.pt"
    checkpoint.save(path, ckpt)
    monkeypatch.setattr(models, "get", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(ValueError, match=match):
        checkpoint.load_model(path)


def test_figures_on_a_bad_metrics_line_names_file_and_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": "mlp", "mode": "normal", "dataset": "cifar10",
                                                   "batch_size": 8}))
    good = '{"epoch": 1, "test_acc": 0.5, "train_loss": 1.0}\n'
    for bad, match in (('{"epoch": 2,', "line 2: not valid JSON"),
                       ('{"epoch": 2, "test_acc": "0.5", "train_loss": 1}', "line 2: test_acc"),
                       ('{"epoch": 2, "test_acc": 0.5}', "line 2: train_loss"),
                       ('{"epoch": ' + "2" * 5000 + "}", "line 2: not valid JSON")):
        (run / "metrics.jsonl").write_text(good + bad + "\n")
        code, err = run_cli(["figures", run, "--out", tmp_path / "figs"], capsys)
        assert code == 2 and f"metrics.jsonl {match}" in err and len(err.strip().splitlines()) == 1
