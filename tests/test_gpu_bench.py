"""The CPU-safe parts of benchmarks/gpu_bench.py: its dry run, goals and tables."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_bench


def _train_row(model, batch, mode, ips, act):
    return {"model": model, "batch": batch, "mode": mode, "images_per_s": ips, "step_ms": 1.0,
            "activation_bytes": act, "peak_bytes": act, "meter_saved_bytes": None}


def _codec_row(backend, enc, dec):
    return {"shape": [1, 1, 8, 8], "dtype": "float32", "backend": backend, "bytes_moved": 1,
            "encode_ms": 1.0, "decode_ms": 1.0, "encode_gbs": enc, "decode_gbs": dec}


def test_goals_use_the_worst_case_and_ignore_the_reference():
    codec = [_codec_row("triton", 80.0, 90.0), _codec_row("triton", 100.0, 70.0),
             _codec_row("torch", 1.0, 1.0)]
    train = [_train_row("resnet50", 64, "normal", 100.0, 1200), _train_row("resnet50", 64,
             "division", 95.0, 100), _train_row("resnet18", 256, "normal", 100.0, 600),
             _train_row("resnet18", 256, "division", 80.0, 100)]
    goals = gpu_bench._goals(100.0, codec, train)
    assert goals["codec_vs_copy"]["value"] == pytest.approx(0.70)
    assert goals["codec_vs_copy"]["met"] is False
    assert goals["division_vs_normal_ips"]["value"] == pytest.approx(0.80)
    assert goals["resnet50_memory_ratio"]["value"] == pytest.approx(12.0)
    assert goals["resnet50_memory_ratio"]["met"] is True


def test_goals_unmeasured_are_none():
    goals = gpu_bench._goals(1.0, [], [_train_row("resnet18", 2, "normal", 1.0, None)])
    assert all(g["value"] is None and g["met"] is None for g in goals.values())


def test_tables_list_every_row():
    result = {"copy_gbs": 10.0, "codec": [_codec_row("triton", 8.0, 9.0)],
              "train": [_train_row("resnet50", 64, "normal", 100.0, 2**20)],
              "goals": gpu_bench._goals(10.0, [], [])}
    text = gpu_bench.tables(result)
    assert "triton" in text and "resnet50" in text and "codec_vs_copy" in text
    assert "0.8" in text  # encode / copy


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal when there is no GPU")
def test_full_run_refuses_without_cuda(tmp_path, capsys):
    assert gpu_bench.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_quick_dry_run_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "quick.json"
    assert gpu_bench.main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert doc["quick"] is True and doc["device"] == device
    if gpu_bench.triton_usable(device):
        assert doc["correct"] is True and len(doc["checks"]) == 12
        assert {r["backend"] for r in doc["codec"]} == {"triton", "torch"}
    else:
        assert doc["correct"] is None and doc["checks"] == []
    assert {r["mode"] for r in doc["train"]} == {"normal", "division", "checkpoint"}
    assert all(r["images_per_s"] > 0 for r in doc["train"])
    assert set(doc["goals"]) == set(gpu_bench.GOALS)
    printed = capsys.readouterr().out
    assert "images/s" in printed and str(out) in printed
