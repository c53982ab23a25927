"""Code habits the tests hold the tree to: ruff's configured rules find nothing."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the [dev] extra)")
    done = subprocess.run([ruff, "check", "--no-cache", "freqact", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_config_json_with_the_removed_workers_setting_still_loads():
    from freqact import train

    stored = train.RunConfig(model="mlp", dataset="synthetic", mode="division").to_dict()
    assert "workers" not in stored
    assert train.RunConfig.from_dict({**stored, "workers": 4}) == train.RunConfig.from_dict(stored)
