"""benchmarks/step_breakdown.py: exclusive part times, restored functions, one tiny family."""
from __future__ import annotations

import json
import time
import types
from collections import Counter

import pytest
import torch

from benchmarks import architectures, step_breakdown
from freqact.kernels import cpu


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture
def threads():
    """Set torch's thread count for the test (restored after it)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_a_part_is_timed_without_the_parts_it_calls(monkeypatch, threads):
    threads(1)  # thread CPU time: what _burn spends
    ns = types.SimpleNamespace()

    def inner():
        _burn(0.04)

    def outer():
        _burn(0.02)
        ns.inner()

    ns.inner, ns.outer = inner, outer
    monkeypatch.setattr(step_breakdown, "PARTS", ((ns, "inner", "in"), (ns, "outer", "out")))
    with step_breakdown.timed_parts(Counter()) as seconds:
        ns.outer()
    assert seconds["in"] == pytest.approx(0.04, abs=0.01)
    assert seconds["out"] == pytest.approx(0.02, abs=0.01)  # 0.06 if inner were counted twice
    assert ns.inner is inner and ns.outer is outer


def test_tiny_gpt_breakdown_names_its_parts():
    case = architectures._cases(quick=True)["gpt"]
    row = step_breakdown.breakdown(case, steps=1)
    assert row["parts_ms"]["C token encode"] > 0 and row["parts_ms"]["pack hook, rest"] > 0
    # exclusive times: the parts together never take longer than the division steps
    assert sum(row["parts_ms"].values()) < row["division_ms"]
    assert cpu.token_encode.__name__ == "token_encode"  # restored after the run


def test_steps_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        step_breakdown.main(["--steps", "0"])
    assert exit_.value.code == 2 and "--steps: expected an integer >= 1, got 0" in (
        capsys.readouterr().err)


def test_one_thread_times_cpu_time_and_more_threads_wall_time(threads):
    # the thread CPU time misses the work of the team the calling thread splits its ops with
    threads(1)
    assert step_breakdown.clock() is time.thread_time
    threads(2)
    assert step_breakdown.clock() is time.perf_counter


def test_threads_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        step_breakdown.main(["--threads", "0"])
    assert exit_.value.code == 2 and "--threads: expected an integer >= 1, got 0" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("count, name", [(1, "step-breakdown-cpu"), (2, "step-breakdown-cpu-2thread")])
def test_main_runs_at_the_threads_asked_and_names_its_file_by_them(count, name, monkeypatch,
                                                                    tmp_path, threads):
    seen = {}

    def fake_breakdown(case, steps):
        seen.setdefault("threads", torch.get_num_threads())
        return {"family": case.family, "batch": case.batch, "threads": torch.get_num_threads(),
                "normal_ms": 10.0, "division_ms": 12.0, "parts_ms": {"C token encode": 1.0},
                "other_ms": 1.0}
    monkeypatch.setattr(step_breakdown, "breakdown", fake_breakdown)
    monkeypatch.setattr(step_breakdown, "RESULTS_DIR", tmp_path)
    threads(3)
    assert step_breakdown.main(["--families", "gpt", "--threads", str(count)]) == 0
    settings = json.loads((tmp_path / f"{name}.json").read_text())["settings"]
    assert seen["threads"] == count == settings["threads"]
    assert settings["clock"] == ("thread CPU time" if count == 1 else "wall time")
