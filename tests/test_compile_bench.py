"""benchmarks/compile_bench.py: the layout-off mode compiles graphs of its own."""
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


def test_steps_alone_pairs_fresh_processes_in_alternating_order(monkeypatch):
    from benchmarks import compile_bench

    monkeypatch.setattr(compile_bench, "_setup", _tiny)
    calls = []

    def fresh(module, args, env=None):  # one process per call: here the same code in-process
        assert module == "benchmarks.compile_bench" and args[0] == "--step-case"
        name, batch, mode = args[1:]
        calls.append(mode)
        result = compile_bench.step_alone(name, int(batch), mode, steps=2)
        # a known median per mode, so the ratio is checkable
        return {**result, "median_s": 2.0 if mode == "compiled" else 3.0}

    monkeypatch.setattr(compile_bench, "json_from_fresh_process", fresh)
    result = compile_bench.steps_alone("tiny", 2, rounds=3)
    assert calls == ["compiled", "compiled+division", "compiled+division", "compiled",
                     "compiled", "compiled+division"]
    assert result["ratios"] == [1.5] * 3 and result["ratio_median"] == 1.5
    assert [r["mode"] for r in result["runs"]] == calls
    assert all(r["page_faults"] >= 0 and r["min_s"] > 0 for r in result["runs"])


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
        "ratios": [1.2] * rounds, "ratio_median": 1.2})
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")
    out = tmp_path / "alone.json"
    assert compile_bench.main(["--models", "vit", "--alone", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["steps_alone"]["vit"]["ratio_median"] == 1.2
    assert payload["settings"]["step_malloc_env"]["MALLOC_TRIM_THRESHOLD_"] == "123"
    assert "1.200 (1.200-1.200)" in capsys.readouterr().out


def test_step_case_prints_one_process_result_as_json(monkeypatch, capsys):
    import json

    from benchmarks import compile_bench

    monkeypatch.setattr(compile_bench, "_setup", _tiny)
    assert compile_bench.main(["--step-case", "tiny", "2", "compiled+division"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["mode"] == "compiled+division" and result["median_s"] >= result["min_s"] > 0
