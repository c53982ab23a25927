"""benchmarks/dct_bench.py: every method timed in turns (this process) and alone (fresh processes),
ratios from each protocol's own medians, and the goal decided by the alone ratio over processes.

Tiny shapes, no timing asserted (speed goals are met in the benchmark itself, not in tests).
"""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import dct_bench

TINY = [(2, 3, 8, 8)]


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """`--threads 1` sets torch's threads for the process: give the later tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _counting(monkeypatch) -> dict[str, int]:
    """Make dct_bench's methods count their calls; returns the counts, by method."""
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
    return calls


def test_rows_hold_both_protocols_and_ratios_of_their_own_medians(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dct_bench, "SHAPES", TINY)
    calls = _counting(monkeypatch)
    argv = ["--repeats", "3", "--threads", "1", "--processes", "1", "--out", str(tmp_path)]
    assert dct_bench.main(argv) == 0
    document = json.loads((tmp_path / "dct-cpu-1thread.json").read_text())
    rows = document["rows"]
    by_method = {r["method"]: r for r in rows}
    assert {"freqact", "freqact-out", "freqact-matmul", "scipy"} <= set(by_method)
    scipy_row = by_method["scipy"]
    (alone,) = document["alone_per_process_ms"]
    for row in rows:
        assert row["shape"] == [2, 3, 8, 8] and row["max_rel_error"] <= 2e-6
        assert row["speedup_over_scipy"] == pytest.approx(scipy_row["median_ms"] / row["median_ms"])
        ratio = alone["2x3x8x8"]["scipy"] / alone["2x3x8x8"][row["method"]]
        assert row["alone_speedup_over_scipy"] == pytest.approx(ratio)  # one process: its own
        assert row["alone_speedup_range"] == pytest.approx([ratio, ratio])
        assert row["alone_median_ms"] == pytest.approx(alone["2x3x8x8"][row["method"]])
        assert row["min_ms"] <= row["median_ms"]
    # Per method: the error check, 1 more warm-up, 3 rounds in turns, then 2 + 3 calls alone.
    assert calls and set(calls.values()) == {1 + 1 + 3 + 2 + 3}
    goal = document["goal"]
    assert goal["speedup"] == pytest.approx(by_method["freqact"]["alone_speedup_over_scipy"])
    assert goal["in_turns"] == pytest.approx(by_method["freqact"]["speedup_over_scipy"])
    assert goal["met"] == (goal["speedup"] >= 2.0) and goal["threads"] == 1
    assert not goal["applies"]  # the goal is stated for 2 threads
    out = capsys.readouterr().out
    assert "scipy / this alone" in out and "decided by" in out


def test_alone_columns_come_from_fresh_processes_with_their_median_and_range(tmp_path, monkeypatch):
    monkeypatch.setattr(dct_bench, "SHAPES", TINY)
    # One real fresh process: it times the shapes it is given, every method, in seconds.
    real = dct_bench._alone_in_fresh_process(TINY, "cpu", 0, 1, 1, 0)
    assert set(real) == {"2x3x8x8"}
    assert {"freqact", "freqact-out", "freqact-matmul", "scipy"} <= set(real["2x3x8x8"])
    assert all(seconds > 0 for seconds in real["2x3x8x8"].values())
    # Three faked ones for the arithmetic: the median of each process's own ratio, and the range.
    runs = iter([{"freqact": 1.0, "scipy": 3.0}, {"freqact": 2.0, "scipy": 3.0},
                 {"freqact": 4.0, "scipy": 10.0}])
    faked = []

    def fake(shapes, device, warmup, repeats, threads, seed):
        faked.append((list(shapes), threads))
        return {"2x3x8x8": {**real["2x3x8x8"], **next(runs)}}

    monkeypatch.setattr(dct_bench, "_alone_in_fresh_process", fake)
    argv = ["--repeats", "1", "--threads", "1", "--processes", "3", "--out", str(tmp_path)]
    assert dct_bench.main(argv) == 0
    assert faked == [(TINY, 1)] * 3
    document = json.loads((tmp_path / "dct-cpu-1thread.json").read_text())
    assert document["settings"]["processes"] == 3 and len(document["alone_per_process_ms"]) == 3
    freqact = next(r for r in document["rows"] if r["method"] == "freqact")
    assert freqact["alone_speedup_over_scipy"] == pytest.approx(2.5)  # ratios 3, 1.5, 2.5
    assert freqact["alone_speedup_range"] == pytest.approx([1.5, 3.0])
    assert freqact["alone_median_ms"] == pytest.approx(2000.0)
    assert document["goal"]["speedup"] == pytest.approx(2.5) and document["goal"]["met"]
    assert document["goal"]["range"] == pytest.approx([1.5, 3.0])
    assert document["goal"]["processes"] == 3


def test_the_goal_applies_to_two_threads_on_the_cpu_only():
    rows = [{"shape": list(dct_bench.SHAPES[0]), "method": "freqact", "alone_speedup_over_scipy": 1.9,
             "alone_speedup_range": [1.8, 2.1], "speedup_over_scipy": 2.2}]
    goal = dct_bench.goal_check(rows, "cpu", 2, 5)
    assert goal["applies"] and not goal["met"] and goal["in_turns"] == 2.2  # the alone ratio decides
    assert not dct_bench.goal_check(rows, "cpu", None, 5)["applies"]
    assert not dct_bench.goal_check(rows, "cuda", 2, 5)["applies"]


@pytest.mark.parametrize("argv", [["--processes", "0"], ["--repeats", "0"], ["--threads", "0"],
                                  ["--warmup", "-1"]])
def test_options_are_checked(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        dct_bench.main(argv)
    assert exit_info.value.code == 2 and argv[0] in capsys.readouterr().err
