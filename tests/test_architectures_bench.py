"""Smoke test of benchmarks/architectures.py: one family, tiny, every column filled and sane."""
from __future__ import annotations

import json
import os

import pytest

from benchmarks import architectures
from tests.conftest import SHARED_CIFAR10


def _data_dir():
    for folder in (SHARED_CIFAR10.parent, os.environ.get("FREQACT_DATA")):
        if folder and os.path.isfile(os.path.join(folder, "cifar-10-batches-py", "data_batch_1")):
            return str(folder)
    pytest.skip(f"real CIFAR-10 not found at {SHARED_CIFAR10} or $FREQACT_DATA (the benchmark's "
                "gradient cosine uses a real batch)")


def test_quick_benchmark_fills_every_column(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", str(architectures.REPO_ROOT))  # the fresh processes' import
    out = tmp_path / "arch.json"
    assert architectures.main(["--quick", "--families", "vit", "gpt", "--data-dir", _data_dir(),
                               "--batch", "3", "--out", str(out)]) == 0
    rows = {r["family"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"vit", "gpt"}
    for row in rows.values():
        # --batch reaches the fresh memory processes too: their meter counts the bytes (which
        # depend on shapes, bar a few label bytes) of this process's forward of the real batch
        assert row["batch"] == 3
        assert row["meter_bytes"]["division"] == pytest.approx(row["saved_bytes"], rel=0.01)
        assert row["exact_meter_ratio"] == pytest.approx(1.0)
        assert row["exact_grads_identical"]
        # division stores fewer bytes than it would hold exactly, and its gradient points the
        # same way as the exact one (random init, so only roughly)
        assert row["meter_ratio"] > 1.0 and row["saved_bytes"] < row["exact_bytes"]
        assert 0.5 < row["grad_cosine"] <= 1.0 and row["grad_rel_error"] > 0
        assert row["held_bytes"]["normal"] > 0 and row["step_ratio"] > 0
        assert set(row["goals"]) == {"memory", "meter_agrees", "step_time"}
    assert "family" in capsys.readouterr().out


def test_batch_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        architectures.main(["--quick", "--batch", "0"])
    assert exit_.value.code == 2 and "--batch: expected an integer >= 1, got 0" in (
        capsys.readouterr().err)


def test_unknown_family_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        architectures.main(["--quick", "--families", "lenet"])
    assert exit_.value.code == 2 and "--families: unknown 'lenet'" in capsys.readouterr().err


def test_trainings_summary_pairs_seeds(tmp_path):
    from benchmarks import trainings

    spec = tmp_path / "tiny.toml"
    spec.write_text('''name = "tiny"
[base]
model = "gpt"
model_options = { dim = 16, depth = 1, heads = 1, context = 16 }
dataset = "stdlib-text"
subset = 16
epochs = 1
batch_size = 8
optimizer = "adamw"
lr = 3e-3
save_epochs = []
[grid]
seed = [0, 1]
[[variants]]
label = "normal"
mode = "normal"
[[variants]]
label = "division"
mode = "division"
''')
    results = tmp_path / "tiny.json"
    assert trainings.main(["--spec", str(spec), "--out", str(tmp_path / "study"),
                           "--results", str(results)]) == 0
    doc = json.loads(results.read_text())
    arms = {a["label"]: a for a in doc["arms"]}
    assert arms["normal"]["seeds"] == arms["division"]["seeds"] == [0, 1]
    (paired,) = doc["paired"]
    for name in ("test_loss", "test_acc"):
        expected = [d - n for d, n in zip(arms["division"][name]["per_seed"],
                                          arms["normal"][name]["per_seed"])]
        assert paired[name]["per_seed"] == pytest.approx(expected)
        assert paired[name]["mean"] == pytest.approx(sum(expected) / 2)
    # the per-seed values are the runs' own last metrics rows
    last = [json.loads(line) for line in
            (tmp_path / "study" / "division" / "seed-1" / "metrics.jsonl").read_text().splitlines()]
    assert arms["division"]["test_loss"]["per_seed"][1] == last[-1]["test_loss"]
