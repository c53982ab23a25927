"""Robustness sweep (issue 8), part 3: hostile files never run their payload.

Each payload is first shown to work (its loader of choice creates a marker directory), then fed to
freqact's loaders, which refuse or read it as data; the marker never appears.
"""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from freqact import checkpoint, data, sweep, train
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
