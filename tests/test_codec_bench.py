"""benchmarks/codec_bench.py runs: its memory case in a fresh process and its codec timing.

Small sizes, no timing asserted (speed goals are met in the benchmark itself, not in tests).
"""
from __future__ import annotations

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
