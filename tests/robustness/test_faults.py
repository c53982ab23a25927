"""Robustness sweep (issue 8), part 2: faults never lose a run.

A `freqact train` killed with SIGKILL mid-epoch resumes losing at most that epoch and leaves every
checkpoint loadable; truncated or corrupted checkpoints are refused naming the file (never loaded
as wrong weights); a disk that fills up while saving leaves the previous checkpoint intact and no
temporary files.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from freqact import checkpoint, models, train
from tests.robustness.helpers import checkpoint_of, run_cli, tiny, tiny_config


def _corruptions(raw: bytes) -> dict[str, bytes]:
    middle = len(raw) // 2
    return {"empty": b"", "first-bytes": raw[:10], "half": raw[:middle],
            "flipped-byte": raw[:200] + bytes([raw[200] ^ 0xFF]) + raw[201:],
            "zeroed-middle": raw[:middle] + bytes(256) + raw[middle + 256:],
            "zeroed-tail": raw[:-30] + bytes(30), "text": b"not a checkpoint\n" * 20}


def test_truncated_or_corrupted_checkpoints_name_the_file(tmp_path, capsys):
    good = tmp_path / "good.pt"
    checkpoint.save(good, checkpoint_of("mlp", models.get("mlp", hidden=(8,))))
    for label, content in _corruptions(good.read_bytes()).items():
        path = tmp_path / f"{label}.pt"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"{path.name}: not a loadable checkpoint"):
            checkpoint.load(path)
        code, err = run_cli(["eval", path, "--device", "cpu"], capsys)
        assert code == 2 and path.name in err and "weights_only` set to `False`" not in err, label


class _DiskFull:
    """A file object whose writes fail with ENOSPC after `budget` bytes (a disk filling up)."""

    def __init__(self, f, budget: int) -> None:
        self._f, self._budget = f, budget

    def write(self, data) -> int:
        if len(data) > self._budget:
            self._f.write(bytes(data[:self._budget]))
            raise OSError(errno.ENOSPC, "No space left on device")
        self._budget -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


@pytest.mark.parametrize("where", ["write", "fsync"])
def test_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    path = tmp_path / "ckpt" / "last.pt"
    checkpoint.save(path, checkpoint_of("mlp", models.get("mlp", hidden=(8,))))
    before = path.read_bytes()
    if where == "write":
        real_fdopen = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _DiskFull(real_fdopen(fd, *a, **k),
                                                                         budget=100))
    else:
        def no_space(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError) as caught:
        checkpoint.save(path, checkpoint_of("mlp", models.get("mlp", hidden=(16,))))
    assert caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == before and checkpoint.load(path)["epoch"] == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pt"]


def test_full_disk_during_training_then_resume(tmp_path, monkeypatch, capsys):
    real_save, calls = checkpoint.save, []

    def save_then_fill(path, obj):
        calls.append(path)
        if len(calls) == 2:  # epoch 2's last.pt
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(path, obj)

    monkeypatch.setattr(checkpoint, "save", save_then_fill)
    with pytest.raises(OSError, match="No space left"):
        train.train(tiny_config(tmp_path), model=tiny())
    monkeypatch.undo()
    last = tmp_path / "run" / "ckpt" / "last.pt"
    assert checkpoint.load(last)["epoch"] == 1
    results = train.train(tiny_config(tmp_path, resume=True), model=tiny())
    assert [m["epoch"] for m in results["metrics"]] == [1, 2]
    capsys.readouterr()


def test_cli_reports_a_full_disk_in_one_line(tmp_path, monkeypatch, capsys):
    def no_space(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "save", no_space)
    code, err = run_cli(["train", "--model", "mlp", "--dataset", "synthetic", "--epochs", "1",
                      "--subset", "16", "--batch-size", "16", "--out", tmp_path / "run",
                      "--device", "cpu", "--save-epochs"], capsys)
    assert code == 2 and "No space left on device" in err and "last.pt" in err
    assert len(err.strip().splitlines()) == 1


def test_resume_removes_temp_files_of_a_killed_writer(tmp_path, capsys):
    train.train(tiny_config(tmp_path, epochs=1), model=tiny())
    ckpt_dir = tmp_path / "run" / "ckpt"
    stale = [ckpt_dir / ".last.pt.abc123.tmp", tmp_path / "run" / ".metrics.csv.def456.tmp"]
    for path in stale:
        path.write_bytes(b"half a file")
    train.train(tiny_config(tmp_path, epochs=1, resume=True), model=tiny())
    assert not any(path.exists() for path in stale)
    capsys.readouterr()


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_loses_at_most_that_epoch(tmp_path):
    out, epochs = tmp_path / "run", 5
    argv = [sys.executable, "-m", "freqact", "train", "--model", "mlp", "--dataset", "synthetic",
            "--mode", "division", "--epochs", str(epochs), "--subset", "256", "--batch-size", "16",
            "--out", str(out), "--device", "cpu", "--save-every", "1", "--save-epochs"]
    last = out / "ckpt" / "last.pt"
    # One intra-op thread: on a shared 2-core machine more threads only oversubscribe it.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    try:
        deadline = time.monotonic() + 60
        while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert last.exists() and proc.poll() is None, "no checkpoint before the run ended"
        time.sleep(0.15)  # into the next epoch (an epoch takes about half a second)
        os.kill(proc.pid, signal.SIGKILL)
        printed = proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    for path in sorted((out / "ckpt").glob("*.pt")):
        assert checkpoint.load(path)["format"] == checkpoint.FORMAT, path
    kept = checkpoint.load(last)
    done = sum(line.startswith("epoch ") for line in printed.splitlines())
    assert done <= kept["epoch"] < epochs  # printed epochs were saved first; the run was cut
    before = kept["metrics"]
    resumed = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=120,
                             env=env)
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, epochs + 1))
    assert rows[:len(before)] == before
    assert checkpoint.load(last)["epoch"] == epochs
    assert not list(out.rglob("*.tmp"))


# ---- issue 15.4: one writer per run directory, no silent restart, clean interrupts ----------------

def test_resume_without_last_pt_continues_from_the_newest_epoch_checkpoint(tmp_path, capsys):
    """Losing last.pt must not restart from epoch 1 over the kept epoch checkpoints."""
    train.train(tiny_config(tmp_path, epochs=3, save_epochs=[1, 2]), model=tiny())
    run = tmp_path / "run"
    reference = train.read_metrics(run)
    (run / "ckpt" / "last.pt").unlink()
    (run / "ckpt" / "epoch-0002.pt").write_bytes(b"damaged")
    capsys.readouterr()
    results = train.train(tiny_config(tmp_path, epochs=3, save_epochs=[1, 2], resume=True),
                          model=tiny())
    printed = capsys.readouterr().out
    assert "skipping" in printed and "epoch-0002.pt" in printed
    assert "continuing" in printed and "after epoch 1 from epoch-0001.pt (last.pt is missing)" in printed
    assert [m["epoch"] for m in results["metrics"]] == [1, 2, 3]
    assert results["metrics"][0] == reference[0]
    assert checkpoint.load(run / "ckpt" / "epoch-0002.pt")["epoch"] == 2  # rewritten, whole


def test_resume_says_from_which_epoch_it_continues(tmp_path, capsys):
    train.train(tiny_config(tmp_path, epochs=1), model=tiny())
    capsys.readouterr()
    train.train(tiny_config(tmp_path, epochs=1, resume=True), model=tiny())
    assert f"resume: continuing {tmp_path / 'run'} after epoch 1 from last.pt; nothing left" in (
        capsys.readouterr().out)
    code, _ = run_cli(["train", "--model", "mlp", "--dataset", "synthetic", "--epochs", "1",
                       "--subset", "16", "--batch-size", "16", "--out", tmp_path / "new",
                       "--device", "cpu", "--save-epochs", "--resume"], capsys)
    assert code == 0


def test_epoch_checkpoints_without_resume_are_not_overwritten(tmp_path, capsys):
    train.train(tiny_config(tmp_path, epochs=1, save_epochs=[1]), model=tiny())
    (tmp_path / "run" / "ckpt" / "last.pt").unlink()
    with pytest.raises(ValueError, match="already holds a run; pass --resume"):
        train.train(tiny_config(tmp_path, epochs=1, save_epochs=[1]), model=tiny())
    capsys.readouterr()


def test_a_config_json_train_did_not_write_for_this_run_is_never_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    foreign = '{"tool": "another", "notes": "keep me"}'
    (run / "config.json").write_text(foreign)
    with pytest.raises(ValueError, match="already holds a run; pass --resume"):
        train.train(tiny_config(tmp_path, epochs=1), model=tiny())
    with pytest.raises(ValueError, match=r"resume: .*config.json was written with other settings \(model: None"):
        train.train(tiny_config(tmp_path, epochs=1, resume=True), model=tiny())
    assert (run / "config.json").read_text() == foreign
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json"]
    # a run stopped in its first epoch (config.json only) resumes from the start with its own settings
    (run / "config.json").unlink()
    train.train(tiny_config(tmp_path, epochs=1), model=tiny())
    for name in ("ckpt", "metrics.jsonl", "metrics.csv"):
        shutil.rmtree(run / name) if name == "ckpt" else (run / name).unlink()
    results = train.train(tiny_config(tmp_path, epochs=1, resume=True), model=tiny())
    assert [m["epoch"] for m in results["metrics"]] == [1]
    capsys.readouterr()


def test_empty_out_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(["train", "--model", "mlp", "--dataset", "synthetic", "--out", "",
                         "--device", "cpu"], capsys)
    assert code == 2 and "out: expected a run directory path" in err
    assert len(err.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_prints_one_line_and_keeps_the_checkpoints(tmp_path, sig, code):
    out, epochs = tmp_path / "run", 40
    argv = [sys.executable, "-m", "freqact", "train", "--model", "mlp", "--dataset", "synthetic",
            "--mode", "division", "--epochs", str(epochs), "--subset", "256", "--batch-size", "16",
            "--out", str(out), "--device", "cpu", "--save-every", "1", "--save-epochs"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (out / "ckpt" / "last.pt").exists() and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    kept = checkpoint.load(out / "ckpt" / "last.pt")
    assert err.strip() == (f"freqact train: interrupted after epoch {kept['epoch']}; "
                           "rerun with --resume")
    for path in sorted((out / "ckpt").glob("*.pt")):
        assert checkpoint.load(path)["epoch"] <= kept["epoch"], path
    assert [r["epoch"] for r in train.read_metrics(out)] == list(range(1, kept["epoch"] + 1))
    assert not list(out.rglob("*.tmp"))
