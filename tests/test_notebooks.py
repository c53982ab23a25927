"""The example notebooks: committed without outputs, and each runs headless.

The notebooks are committed without outputs (small diffs; these tests execute them). Each one is
executed top to bottom by nbclient in a fresh python3 kernel, in a temporary working directory,
with its small default parameters; any cell error fails the test, and several cells assert the
properties they show (DCT against scipy, Parseval, the Theorem 3.1 bound, the block-DC identity).
The kernel reads real CIFAR-10 from `../shared/data` where it exists and otherwise takes the
notebooks' own fallback (scikit-learn's digits), which `test_fallback_without_cifar` exercises on
purpose.
"""
from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

from tests.conftest import REPO_ROOT, SHARED_CIFAR10

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
STEMS = ("01_dct_masking", "02_lfc_hfc_act", "03_lambda_theorem31", "04_pooling_vs_dct",
         "05_division_memory")
FALLBACK_LINE = "falling back to the digits dataset"
# Notebooks that write runs or figures: to OUT_DIR (default "out", relative to the working directory).
WRITES_FILES = ("02_lfc_hfc_act", "03_lambda_theorem31", "04_pooling_vs_dct")


def _execute(stem: str, workdir: Path, data_dir: Path, monkeypatch) -> str:
    """Run one notebook in `workdir` with $FREQACT_DATA = data_dir; return its text output."""
    nb = nbformat.read(NOTEBOOK_DIR / f"{stem}.ipynb", as_version=4)
    # The kernel inherits this environment. One OpenMP thread: on a shared 2-core machine several
    # spinning OpenMP threads per process make PyTorch several times slower (measured 5x). The
    # working directory is pytest's tmp_path, so the notebooks' OUT_DIR ("out") lands there; TMPDIR
    # keeps any other temporary file there too.
    monkeypatch.setenv("FREQACT_DATA", str(data_dir))
    monkeypatch.setenv("TMPDIR", str(workdir))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    return "\n".join(
        out.get("text", "")
        for cell in nb.cells if cell.cell_type == "code"
        for out in cell.outputs if out.get("output_type") == "stream"
    )


def test_notebooks_committed_clean():
    """Every notebook is listed here, valid, free of outputs, and opens with its parameters."""
    assert sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(STEMS)
    for stem in STEMS:
        nb = nbformat.read(NOTEBOOK_DIR / f"{stem}.ipynb", as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert "FULL = False" in code[0].source and "DATA_DIR = None" in code[0].source, stem
        for cell in code:
            assert cell.outputs == [] and cell.execution_count is None, f"{stem}: cell {cell.id}"


@pytest.mark.slow
@pytest.mark.parametrize("stem", STEMS)
def test_notebook_runs(stem, tmp_path, monkeypatch):
    """Top to bottom without error, on real CIFAR-10 where present, else on the fallback."""
    has_cifar = (SHARED_CIFAR10 / "data_batch_1").is_file()
    data_dir = SHARED_CIFAR10.parent if has_cifar else tmp_path / "no-data"
    text = _execute(stem, tmp_path, data_dir, monkeypatch)
    assert ("dataset: cifar10" in text) == has_cifar
    assert (FALLBACK_LINE in text) != has_cifar
    if stem in WRITES_FILES:  # into a visible folder under the working directory, which it names
        (written,) = (tmp_path / "out").iterdir()
        assert written.name.startswith(f"{stem}-")
        assert f"writing runs and figures to {written.resolve()}" in text
        assert any(written.rglob("*.png")) or any(written.rglob("metrics.csv"))


@pytest.mark.slow
def test_fallback_without_cifar(tmp_path, monkeypatch):
    """With no CIFAR-10 anywhere, a notebook says so and runs on the digits instead."""
    if not (SHARED_CIFAR10 / "data_batch_1").is_file():
        pytest.skip("CIFAR-10 is absent here, so test_notebook_runs already ran on the fallback")
    text = _execute("01_dct_masking", tmp_path, tmp_path / "no-data", monkeypatch)
    assert FALLBACK_LINE in text
    assert "dataset: digits" in text


def test_notebook_03_gives_lambda_and_theorem31_one_window_rule():
    """λ and Theorem 3.1 must use the same masks: every from_checkpoints call passes RULE."""
    nb = nbformat.read(NOTEBOOK_DIR / "03_lambda_theorem31.ipynb", as_version=4)
    calls = [line for cell in nb.cells if cell.cell_type == "code"
             for line in cell.source.splitlines() if "from_checkpoints(" in line]
    assert len(calls) == 2 and all("rule=RULE" in line for line in calls), calls
