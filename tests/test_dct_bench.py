"""benchmarks/dct_bench.py: every method timed in turns and alone, ratios from its own medians.

Tiny shapes, no timing asserted (speed goals are met in the benchmark itself, not in tests).
"""
from __future__ import annotations

import json

import pytest

from benchmarks import dct_bench


def test_rows_hold_both_protocols_and_ratios_of_their_own_medians(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dct_bench, "SHAPES", [(2, 3, 8, 8)])
    calls: dict[str, int] = {}
    methods = dct_bench._methods

    def counted(x, workers):
        def wrap(name, fn):
            def call():
                calls[name] = calls.get(name, 0) + 1
                return fn()
            return call
        return {name: wrap(name, fn) for name, fn in methods(x, workers).items()}

    monkeypatch.setattr(dct_bench, "_methods", counted)
    assert dct_bench.main(["--repeats", "3", "--threads", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "dct-cpu-1thread.json").read_text())["rows"]
    by_method = {r["method"]: r for r in rows}
    assert {"freqact", "freqact-out", "freqact-matmul", "scipy"} <= set(by_method)
    scipy_row = by_method["scipy"]
    for row in rows:
        assert row["shape"] == [2, 3, 8, 8] and row["max_rel_error"] <= 2e-6
        assert row["speedup_over_scipy"] == pytest.approx(scipy_row["median_ms"] / row["median_ms"])
        assert row["alone_speedup_over_scipy"] == pytest.approx(
            scipy_row["alone_median_ms"] / row["alone_median_ms"])
        assert row["min_ms"] <= row["median_ms"]
    # Per method: the error check, 1 more warm-up, 3 rounds in turns, then 2 + 3 calls alone.
    assert calls and set(calls.values()) == {1 + 1 + 3 + 2 + 3}
    assert "scipy / this alone" in capsys.readouterr().out
