"""Shared fixtures: the real CIFAR-10 folder and the devices to test on."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_CIFAR10 = REPO_ROOT.parent / "shared" / "data" / "cifar-10-batches-py"


@pytest.fixture(scope="session")
def cifar_dir() -> Path:
    """The folder holding the real CIFAR-10 `cifar-10-batches-py` (its parent is the data dir)."""
    if not (SHARED_CIFAR10 / "data_batch_1").is_file():
        pytest.skip(f"real CIFAR-10 not found at {SHARED_CIFAR10} (only present in the dev sandbox)")
    return SHARED_CIFAR10


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every device available here: cpu always, cuda when present."""
    return request.param
