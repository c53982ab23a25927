"""Shared fixtures: the real CIFAR-10 folder and the devices to test on; the Triton interpreter
switched on where there is no GPU."""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter. triton.jit reads this when a
    # kernel is decorated, i.e. when freqact.kernels.triton_division is first imported, which any
    # test module may do: so here, before pytest imports them (set in a test module, it came too
    # late whenever an earlier module had imported the kernels: test_gpu_bench failed after
    # test_compile_bench).
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture
def held_by_another():
    """A context manager factory: `with held_by_another(folder):` holds `rundir.output_lock(folder)`
    in another thread for the block (another freqact process writing the folder, as the lock
    sees it), released and joined after."""
    from freqact import rundir

    @contextlib.contextmanager
    def hold(folder):
        held, release = threading.Event(), threading.Event()

        def writer():
            with rundir.output_lock(folder):
                held.set()
                release.wait(60)

        thread = threading.Thread(target=writer)
        thread.start()
        try:
            assert held.wait(60)
            yield
        finally:
            release.set()
            thread.join()

    return hold
