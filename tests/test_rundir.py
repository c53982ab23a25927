"""freqact.rundir: the layout, readers and writers, finished/resumable, the lock, resume choice."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from freqact import checkpoint, cli, rundir, train
from freqact.rundir import RunDir


def _ckpt(epoch: int) -> dict:
    return {"format": checkpoint.FORMAT, "epoch": epoch, "config": {"model": "mlp"},
            "model": {"w": torch.full((2,), float(epoch))}, "optimizer": {}, "scheduler": {}, "scaler": {},
            "rng": {}, "metrics": []}


def test_layout_is_the_documented_one(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.config_path == tmp_path / "run" / "config.json"
    assert run.metrics_jsonl.name == "metrics.jsonl" and run.metrics_csv.name == "metrics.csv"
    assert run.last == tmp_path / "run" / "ckpt" / "last.pt"
    assert run.epoch_path(7) == tmp_path / "run" / "ckpt" / "epoch-0007.pt"
    assert run.checkpoints() == [] and not run.has_state()


def test_an_old_run_directory_written_by_hand_reads_back(tmp_path):
    """Files in the format train wrote before RunDir existed (indented JSON, CSV + JSON lines)."""
    (tmp_path / "ckpt").mkdir()
    config = {"model": "mlp", "mode": "division", "epochs": 2}
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    rows = [{c: (i if c == "epoch" else 0.5) for c in train.METRIC_COLUMNS} for i in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("epoch-0002.pt", "epoch-0001.pt", "last.pt"):
        (tmp_path / "ckpt" / name).write_bytes(b"")
    run = RunDir(tmp_path)
    assert run.read_config() == config and run.read_metrics() == rows
    assert [p.name for p in run.checkpoints()] == ["epoch-0001.pt", "epoch-0002.pt"]
    assert run.finished(2) and not run.finished(3)
    assert run.state(config, 2) == "finished" and run.state(config, 3) == "partial"


def test_write_metrics_gives_the_csv_and_json_lines_train_always_wrote(tmp_path):
    run = RunDir(tmp_path)
    rows = [{**dict.fromkeys(train.METRIC_COLUMNS), "epoch": 1, "train_loss": 0.25}]
    run.write_metrics(rows)
    assert run.metrics_jsonl.read_text() == json.dumps(rows[0]) + "\n"
    with run.metrics_csv.open(newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == list(train.METRIC_COLUMNS) and table[1][:3] == ["1", "", "0.25"]
    assert run.read_metrics() == rows


@pytest.mark.parametrize("line, match", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ('{"epoch": "2"}', "line 2: epoch: expected an integer"),
    ('{"epoch": 2, "test_acc": "high"}', "line 2: test_acc: expected a number"),
    ('{"epoch": 2, "test_acc": true}', "line 2: test_acc: expected a number"),
])
def test_a_bad_metrics_line_is_named_by_file_and_line(tmp_path, line, match):
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "test_acc": 0.5}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"metrics\.jsonl {match}"):
        RunDir(tmp_path).read_metrics(numbers=("test_acc",))


def test_huge_or_deeply_nested_run_files_are_refused_naming_them(tmp_path):
    run = RunDir(tmp_path)
    run.config_path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON \(nested too deeply\)"):
        run.read_config()
    with open(run.config_path, "wb") as f:
        f.truncate(rundir.MAX_CONFIG_BYTES + 1)
    with pytest.raises(ValueError, match=r"config\.json: larger than"):
        run.read_config()
    run.config_path.write_text('{"seed": ' + "1" * 5000 + "}")  # past Python's 4300 digits
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON \(Exceeds the limit"):
        run.read_config()


def test_resumable_lists_every_differing_field(tmp_path):
    saved = {"lr": 0.1, "bits": 2, "device": "cpu"}
    rundir.check_resumable(saved, {**saved, "device": "cuda"}, tmp_path)  # may change
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.1 -> 0.5; bits: 2 -> 4\)"):
        rundir.check_resumable(saved, {**saved, "lr": 0.5, "bits": 4}, tmp_path)


def test_a_config_written_before_the_fsdp_setting_resumes_unsharded_only(tmp_path):
    # rundir.ADDED_SETTINGS is the one default of settings older runs lack (train's resume and
    # a sweep's RunDir.state both read it): such a run was not sharded
    saved = {"lr": 0.1}
    rundir.check_resumable(saved, {"lr": 0.1, "fsdp": False}, tmp_path)
    with pytest.raises(ValueError, match=r"fsdp: False -> True"):
        rundir.check_resumable(saved, {"lr": 0.1, "fsdp": True}, tmp_path)


def test_a_config_json_matches_the_run_whose_settings_held_tuples(tmp_path):
    # config.json holds a Python-API tuple (model_options={"hidden": (64, 32)}) as a list: a
    # resume from config.json alone (or a sweep's state check) refused the run as another's
    config = train.RunConfig(model="mlp", out=str(tmp_path), model_options={"hidden": (64, 32)})
    run = RunDir(tmp_path)
    run.write_config(config.to_dict())
    rundir.check_resumable(run.read_config(), config.to_dict(), run.config_path)
    with pytest.raises(ValueError, match=r"model_options: \{'hidden': \[64, 32\]\} -> \{'hidden': \(64, 16\)"):
        rundir.check_resumable(run.read_config(), {**config.to_dict(), "model_options": {"hidden": (64, 16)}},
                               run.config_path)


def test_empty_path_is_refused():
    with pytest.raises(ValueError, match="out: expected a run directory path, got ''"):
        RunDir("")


def test_lock_is_exclusive_and_released(tmp_path):
    run = RunDir(tmp_path / "run")
    with run.lock():
        with pytest.raises(rundir.RunDirBusy, match=rf"{tmp_path / 'run'} is in use"):
            with run.lock():
                pass
    with run.lock():  # released on exit
        pass


def test_output_lock_is_reentrant_in_its_thread_and_refuses_other_writers(tmp_path):
    out = tmp_path / "figures"
    refused = []

    def other_writer():
        try:
            with rundir.output_lock(out):
                refused.append(False)
        except rundir.RunDirBusy as err:
            refused.append(str(err))

    with rundir.output_lock(out):
        with rundir.output_lock(tmp_path / "." / "figures"):  # a pipeline inside make_all
            (out / "table.csv").write_text("a\n")
        thread = threading.Thread(target=other_writer)
        thread.start()
        thread.join()
        with pytest.raises(rundir.RunDirBusy):  # the run lock is the same lock
            with RunDir(out).lock():
                pass
    assert len(refused) == 1 and f"out: {out} is in use by another freqact process" in refused[0]
    other_writer()  # released on exit
    assert refused[-1] is False


def test_a_run_directory_left_empty_is_removed_with_its_lock(tmp_path):
    # a run refused before it wrote anything (a bad --include) left RUN/ holding only `.lock`,
    # which `freqact figures` then called "not a run directory"
    run = RunDir(tmp_path / "runs" / "a")
    with run.lock():
        pass
    assert not run.path.exists() and (tmp_path / "runs").is_dir()
    with run.lock():
        run.write_config({"model": "resnet20"})
    assert run.config_path.is_file() and run.lock_path.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    with RunDir(mine).lock():  # a folder that was there before is left as it was
        pass
    assert mine.is_dir()
    out = tmp_path / "refused"
    assert cli.main(["train", "--out", str(out), "--mode", "division", "--include", "Conv2D",
                     "--dataset", "synthetic", "--epochs", "1"]) == 2
    assert not out.exists()


def test_a_lock_on_a_lock_file_removed_meanwhile_is_taken_again(tmp_path, monkeypatch):
    # B opens RUN/.lock, A (which wrote nothing) removes it with the folder, B locks the removed
    # file: a lock on nothing, while C would lock a new one; B must take the path's lock again
    run = RunDir(tmp_path / "run")
    with run.lock():
        stale = os.open(run.lock_path, os.O_RDWR)  # B's open, before A's block ends
    assert not run.path.exists()
    real_open, opened = os.open, []

    def b_open(path, *args):
        opened.append(path)
        return stale if len(opened) == 1 else real_open(path, *args)

    monkeypatch.setattr(rundir.os, "open", b_open)
    with run.lock():
        assert run.lock_path.exists() and len(opened) == 2
        with pytest.raises(rundir.RunDirBusy):  # C
            with RunDir(run.path).lock():
                pass


def test_lock_of_a_killed_process_does_not_block(tmp_path):
    """flock dies with its process: a crashed (SIGKILLed) writer leaves no blocking lock."""
    run = RunDir(tmp_path / "run")
    holder = ("import sys, time; from freqact.rundir import RunDir\n"
              "with RunDir(sys.argv[1]).lock():\n    print('locked', flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", holder, str(run.path)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(rundir.RunDirBusy):
            with run.lock():
                pass
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    deadline = time.monotonic() + 5
    while True:
        try:
            with run.lock():
                break
        except rundir.RunDirBusy:
            assert time.monotonic() < deadline, "the dead process's lock still blocks"
            time.sleep(0.05)
    assert run.lock_path.exists()


def test_resume_checkpoint_takes_last_else_the_newest_loadable_epoch(tmp_path):
    run = RunDir(tmp_path)
    assert run.resume_checkpoint() == (None, None, [])
    for epoch in (1, 2, 3):
        checkpoint.save(run.epoch_path(epoch), _ckpt(epoch))
    run.epoch_path(3).write_bytes(b"truncated")
    path, ckpt, notes = run.resume_checkpoint()
    assert path == run.epoch_path(2) and ckpt["epoch"] == 2
    assert len(notes) == 1 and "epoch-0003.pt" in notes[0]
    checkpoint.save(run.last, _ckpt(3))
    assert run.resume_checkpoint()[0] == run.last
    run.last.write_bytes(b"garbage")  # the newest state is never skipped silently
    with pytest.raises(ValueError, match="last.pt"):
        run.resume_checkpoint()
    run.last.unlink()
    for epoch in (1, 2):
        run.epoch_path(epoch).write_bytes(b"x")
    with pytest.raises(ValueError, match="no last.pt and no loadable epoch checkpoint"):
        run.resume_checkpoint()


@pytest.mark.parametrize("damage", [{"scaler": None}, {"rng": [1]}, {"config": [1]}, {"epoch": "3"}, {"epoch": 0},
                                    {"epoch": True}, {"metrics": 5}, {"metrics": [1]}, {"optimizer": None}])
def test_resume_checkpoint_refuses_one_that_lacks_what_a_resume_restores(tmp_path, damage):
    run = RunDir(tmp_path)
    checkpoint.save(run.epoch_path(1), _ckpt(1))
    checkpoint.save(run.epoch_path(2), {**_ckpt(2), **damage})  # skipped, with a note naming it
    path, ckpt, notes = run.resume_checkpoint()
    assert path == run.epoch_path(1) and len(notes) == 1
    key = next(iter(damage))
    assert notes[0] == (f"{run.epoch_path(2)}: cannot resume from it: {key!r} missing or not what freqact train "
                        "writes (damaged, or not a training checkpoint)")
    checkpoint.save(run.last, {**_ckpt(3), **damage})  # the newest state: refused, never skipped
    with pytest.raises(ValueError, match=f"last.pt: cannot resume from it: {key!r}"):
        run.resume_checkpoint()


def test_cli_resume_from_a_checkpoint_whose_state_does_not_fit_is_one_line(tmp_path, capsys):
    argv = ["train", "--model", "mlp", "--dataset", "synthetic", "--epochs", "1", "--subset", "16",
            "--batch-size", "16", "--out", str(tmp_path / "run a"), "--device", "cpu", "--save-epochs"]
    assert cli.main(argv) == 0
    last = RunDir(tmp_path / "run a").last
    ckpt = checkpoint.load(last)
    for damage in ({"optimizer": {"state": {}}}, {"rng": {"torch": []}}, {"model": {}}):
        checkpoint.save(last, {**ckpt, **damage})
        capsys.readouterr()
        assert cli.main([*argv, "--resume"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"freqact train: error: resume: {last}: its saved state does not fit this run (")
        assert err.count("\n") == 1


@pytest.mark.parametrize("command", [["train", "--dataset", "synthetic", "--epochs", "1"],
                                     ["sweep", "lfc-hfc-cpu", "--dry-run"]])
def test_out_at_a_file_is_refused_naming_the_argument(tmp_path, capsys, command):
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "below"):
        assert cli.main([*command, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"out: expected a folder, got {out}" in err and "Errno" not in err


def test_check_folder_stats_each_level_once_up_to_the_first_folder(tmp_path, monkeypatch):
    stats, real_stat = [], os.stat

    def counted(path, *args, **kwargs):
        stats.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counted)
    out = tmp_path / "a" / "b"
    assert rundir.check_folder(out) == out
    assert stats == [str(out), str(out.parent), str(tmp_path)]
