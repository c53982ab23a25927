"""benchmarks/compile_bench.py: the layout-off twin, the profile, the results file, the steps alone."""
import torch
from torch import nn
from torch._dynamo.utils import counters

from benchmarks.compile_bench import layout_off_twin


def test_layout_off_twin_compiles_its_own_graphs():
    torch._dynamo.reset()
    counters.clear()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    torch.compile(model)(x)
    twin, compiled_twin = layout_off_twin(model)
    compiled_twin(x)
    assert counters["stats"]["unique_graphs"] == 2  # a plain torch.compile(twin) made 1
    assert all(p is not q for p, q in zip(twin.parameters(), model.parameters()))


def test_profile_breakdown_names_the_codec_ops(monkeypatch):
    from benchmarks import compile_bench

    def tiny(name, batch):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                              nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
        return model, torch.compile(model), torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))

    monkeypatch.setattr(compile_bench, "_setup", tiny)
    rows = compile_bench.profile_breakdown("tiny", 4, steps=1, rounds=1)
    ops = {row[0]: row for row in rows}
    # the codec's ops run only under division, and the rows come largest extra time first
    for op in ("freqact::division_encode", "freqact::division_decode"):
        assert ops[op][1] == 0 < ops[op][3]
    extras = [abs(row[3]) for row in rows[:-1]]
    assert extras == sorted(extras, reverse=True) and rows[-1][0] == "total"


def test_out_writes_the_results_where_asked(monkeypatch, tmp_path):
    import json

    from benchmarks import compile_bench

    monkeypatch.setattr(compile_bench, "_memory_in_fresh_process", lambda name, batch, mode: {
        "model": name, "batch": batch, "mode": mode,
        "held_bytes": 100 if mode == "compiled" else 10})
    monkeypatch.setattr(compile_bench, "step_times", lambda name, batch, repeats: {
        "compiled": 1.0, "compiled+division": 1.1, "eager+division": 1.2})
    out = tmp_path / "rerun.json"
    assert compile_bench.main(["--models", "resnet18", "--repeats", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["step_seconds"]["resnet18"]["compiled+division"] == 1.1
    assert [r["less_than_compiled"] for r in payload["memory"]][:2] == [1.0, 10.0]


def _tiny(name, batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 10))
    return model, torch.compile(model), torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))


def test_step_alone_times_and_counts_faults_of_the_timed_steps_only(monkeypatch):
    import types

    from benchmarks import compile_bench

    monkeypatch.setattr(compile_bench, "_setup", _tiny)
    # scripted clocks, read at each step's start and, for the 3 timed steps after the 3 warm-ups
    # only, at its end: timed step i (3, 4, 5) takes i + 1 s and makes 10 * (i + 1) faults
    ticks = iter([0.0] * 3 + [t for i in (3, 4, 5) for t in (100.0 * i, 100.0 * i + i + 1)])
    faults = iter([0] * 3 + [f for i in (3, 4, 5) for f in (1000 * i, 1000 * i + 10 * (i + 1))])
    # the module's own names replaced, not the time and resource modules (Inductor uses them)
    monkeypatch.setattr(compile_bench, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    monkeypatch.setattr(compile_bench, "resource", types.SimpleNamespace(
        RUSAGE_SELF=0, getrusage=lambda who: types.SimpleNamespace(ru_minflt=next(faults))))
    result = compile_bench.step_alone("tiny", 2, "compiled", steps=3)
    assert result == {"model": "tiny", "mode": "compiled", "median_s": 5.0, "min_s": 4.0,
                      "page_faults": 50}


def test_steps_alone_pairs_fresh_processes_in_alternating_order(monkeypatch):
    from benchmarks import compile_bench

    calls = []
    seconds = iter([2.0, 2.2, 2.6, 2.0, 2.0, 3.0])  # per process, in call order

    def fresh(module, args, env=None):  # one fresh process per call, faked
        assert module == "benchmarks.compile_bench" and args[0] == "--step-case"
        assert env is None  # the steps run in the environment given, not the memory cases'
        calls.append(args[3])
        return {"model": args[1], "mode": args[3], "median_s": next(seconds), "min_s": 1.0,
                "page_faults": 0}

    monkeypatch.setattr(compile_bench, "json_from_fresh_process", fresh)
    result = compile_bench.steps_alone("tiny", 2, rounds=3)
    assert calls == ["compiled", "compiled+division", "compiled+division", "compiled",
                     "compiled", "compiled+division"]
    assert result["ratios"] == [1.1, 2.6 / 2.0, 1.5] and result["ratio_median"] == 2.6 / 2.0
    assert [r["mode"] for r in result["runs"]] == calls


def test_alone_rounds_are_checked_and_written(monkeypatch, tmp_path, capsys):
    import json

    import pytest

    from benchmarks import compile_bench

    with pytest.raises(SystemExit):
        compile_bench.main(["--alone", "-1"])
    assert "--alone: expected an integer >= 0, got -1" in capsys.readouterr().err
    monkeypatch.setattr(compile_bench, "_memory_in_fresh_process", lambda name, batch, mode: {
        "model": name, "batch": batch, "mode": mode, "held_bytes": 1})
    monkeypatch.setattr(compile_bench, "step_times", lambda name, batch, repeats: {
        "compiled": 1.0, "compiled+division": 1.1, "eager+division": 1.2})
    monkeypatch.setattr(compile_bench, "steps_alone", lambda name, batch, rounds: {
        "runs": [{"mode": m, "median_s": s, "page_faults": 5}
                 for m, s in (("compiled", 1.0), ("compiled+division", 1.2))] * rounds,
        "ratios": [1.3, 1.1][:rounds], "ratio_median": 1.2})
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    out = tmp_path / "alone.json"
    assert compile_bench.main(["--models", "vit", "--alone", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["steps_alone"]["vit"]["ratio_median"] == 1.2
    assert payload["settings"]["step_malloc_env"]["MALLOC_TRIM_THRESHOLD_"] == "123"
    assert "1.200 (1.100-1.300)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        compile_bench.main(["--alone", "1", "--profile"])
    assert "--alone: times the steps" in capsys.readouterr().err


def test_step_case_prints_one_process_result_as_json(monkeypatch, capsys):
    import json

    from benchmarks import compile_bench

    monkeypatch.setattr(compile_bench, "_setup", _tiny)
    assert compile_bench.main(["--step-case", "tiny", "2", "compiled+division"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["mode"] == "compiled+division" and result["median_s"] >= result["min_s"] > 0
