"""DistributedDataParallel: `freqact train` under torchrun with 2 gloo processes on the CPU."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch

from freqact import checkpoint, train

pytestmark = pytest.mark.slow

# One step of the MLP (no BatchNorm, whose per-rank statistics would legitimately differ).
ARGS = ["train", "--model", "mlp", "--dataset", "synthetic", "--epochs", "1", "--subset", "8",
        "--batch-size", "8", "--device", "cpu", "--seed", "3"]


def _torchrun(tmp_path, mode: str, out) -> None:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this torch build")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "freqact", *ARGS, "--mode", mode, "--out", str(out)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_ranks_equal_one_process_on_the_same_global_batch(tmp_path):
    _torchrun(tmp_path, "exact", tmp_path / "ddp")
    single = train.train(train.RunConfig(**_config(tmp_path / "single")))
    ddp_ckpt = checkpoint.load(tmp_path / "ddp" / "ckpt" / "last.pt")
    single_ckpt = checkpoint.load(tmp_path / "single" / "ckpt" / "last.pt")
    assert ddp_ckpt["config"]["world_size"] == 2
    for name, value in single_ckpt["model"].items():
        torch.testing.assert_close(ddp_ckpt["model"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    # the loss of the step (before the update) and the test metrics are reduced over both ranks
    ddp_row, single_row = ddp_ckpt["metrics"][0], single["metrics"][0]
    for key in ("train_loss", "train_acc", "test_loss", "test_acc"):
        assert ddp_row[key] == pytest.approx(single_row[key], rel=1e-5), key


def test_division_runs_under_ddp_and_only_rank_0_writes(tmp_path):
    _torchrun(tmp_path, "division", tmp_path / "run")
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    assert len(rows) == 1 and float(rows[0]["compression_ratio"]) > 1
    leftovers = [p.name for p in (tmp_path / "run").rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def _config(out) -> dict:
    """ARGS as RunConfig fields (the single-process reference run)."""
    pairs = dict(zip(ARGS[1::2], ARGS[2::2]))
    return dict(model=pairs["--model"], dataset=pairs["--dataset"], mode="exact", epochs=1,
                subset=int(pairs["--subset"]), batch_size=int(pairs["--batch-size"]), device="cpu",
                seed=int(pairs["--seed"]), out=str(out))
