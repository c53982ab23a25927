"""benchmarks/codec_bench.py runs: its memory case in a fresh process and its codec timing.

Small sizes, no timing asserted (speed goals are met in the benchmark itself, not in tests).
"""
from __future__ import annotations

import json

import pytest

from benchmarks import codec_bench

pytestmark = pytest.mark.slow


def test_memory_cases_measure_what_the_meter_counts():
    rows = {mode: codec_bench._memory_in_fresh_process("resnet18", 4, mode, "cpu")
            for mode in ("normal", "division")}
    for mode, row in rows.items():
        assert row["mode"] == mode and row["batch"] == 4
        assert row["held_bytes"] > 0 and row["meter_bytes"] > 0
    # ResNet-18 at batch 4 holds ~18 MiB for normal training and ~1.7 MiB with DIVISION.
    assert rows["division"]["held_bytes"] * 5 < rows["normal"]["held_bytes"]
    assert rows["normal"]["meter_bytes"] == pytest.approx(rows["normal"]["held_bytes"], rel=0.15)


def test_codec_speed_reports_the_ratio_of_the_format():
    speed = codec_bench.codec_speed("cpu", repeats=1)
    assert speed["shape"] == list(codec_bench.CODEC_SHAPE)
    assert speed["encode_ms"] > 0 and speed["decode_ms"] > 0 and speed["clone_ms"] > 0
    # 32x32 maps, B = 8, Q = 2: 4096 bytes of float32 become 256 + 32 + 4 per map.
    assert speed["ratio"] == pytest.approx(4096 / 292)


def test_spectral_step_times_cover_every_mode():
    steps = codec_bench.spectral_step_times("cpu", rounds=1, batch=2)
    assert set(steps) == set(codec_bench.SPECTRAL_MODES) == {"normal", "lfc", "hfc"}
    assert all(seconds > 0 for seconds in steps.values())


def test_spectral_mode_writes_its_table_and_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(codec_bench, "SPECTRAL_CASE", ("resnet20", 2, (3, 8, 8)))
    argv = ["--spectral", "--repeats", "1", "--processes", "1", "--out", str(tmp_path)]
    assert codec_bench.main(argv) == 0
    document = json.loads((tmp_path / "codec-spectral-cpu.json").read_text())
    assert document["settings"]["batch"] == 2 and len(document["per_process"]) == 1
    (run,) = document["per_process"]
    for mode in ("lfc", "hfc"):  # one process: its own ratio is the median and both ends
        ratio = run["step_seconds"][mode] / run["step_seconds"]["normal"]
        assert document["step_vs_normal"][mode] == pytest.approx(ratio)
        assert document["step_vs_normal_range"][mode] == pytest.approx([ratio, ratio])
    assert f"{document['step_vs_normal']['hfc']:.4g}" in capsys.readouterr().out  # the table's cell


def test_spectral_ratios_come_from_fresh_processes_with_their_median_and_range(tmp_path, monkeypatch):
    # One real fresh process, then three faked ones for the arithmetic of median and range.
    real = codec_bench._spectral_in_fresh_process("cpu", 1, 1, 2)
    assert set(real) == set(codec_bench.SPECTRAL_MODES) and all(s > 0 for s in real.values())
    runs = iter([{"normal": 1.0, "lfc": 1.2, "hfc": 1.5}, {"normal": 2.0, "lfc": 2.2, "hfc": 2.4},
                 {"normal": 1.0, "lfc": 1.4, "hfc": 1.1}])
    monkeypatch.setattr(codec_bench, "_spectral_in_fresh_process", lambda *args: next(runs))
    argv = ["--spectral", "--repeats", "1", "--processes", "3", "--out", str(tmp_path)]
    assert codec_bench.main(argv) == 0
    document = json.loads((tmp_path / "codec-spectral-cpu.json").read_text())
    assert document["settings"]["processes"] == 3 and len(document["per_process"]) == 3
    assert document["step_vs_normal"]["lfc"] == pytest.approx(1.2)
    assert document["step_vs_normal_range"]["lfc"] == pytest.approx([1.1, 1.4])
    assert document["step_vs_normal"]["hfc"] == pytest.approx(1.2)
    assert document["step_vs_normal_range"]["hfc"] == pytest.approx([1.1, 1.5])
    assert document["step_seconds"]["normal"] == pytest.approx(1.0)


@pytest.mark.parametrize("argv", [["--spectral", "--processes", "0"], ["--processes", "2"],
                                  ["--spectral-batch", "2"]])
def test_spectral_process_options_are_checked(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        codec_bench.main(argv)
    assert exit_info.value.code == 2 and argv[-2] in capsys.readouterr().err
