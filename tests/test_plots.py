"""freqact.plots: every figure writes a PNG and a PDF, touches no global matplotlib state."""
from __future__ import annotations

import copy

import matplotlib
import pytest

from freqact import plots


def _lambda_rows():
    return [
        {"checkpoint": f"run/ckpt/epoch-{e:04d}.pt", "epoch": e, "layer": f"stages.{i}", "instance": n,
         "lam_L": 10.0 + i + n, "lam_H": 0.0 if i == 0 else 1.0 + n}  # a zero λ^H must not break the log axis
        for e in (20, 40) for i in range(3) for n in range(4)
    ]


def _theorem_rows(end_to_end=True):
    rows = []
    for i in range(4):
        row = {"layer": f"conv{i}", "err_L": 0.1 * (i + 1), "err_H": 0.2, "GEB_L": 1.0, "GEB_H": 2.0 + i}
        if end_to_end:
            row.update(e2e_err_L=0.3, e2e_err_H=0.4 + i)
        rows.append(row)
    return rows


def _pooling_rows():
    return [
        {"layer": layer, "block": b, "rel_dist": 0.0 if b == 16 else 0.1 / b, "energy_pool": 0.5,
         "energy_dct": 0.6}
        for layer in ("input", "stages.0", "stages.1") for b in (2, 4, 8, 16)
    ]


@pytest.mark.parametrize(
    "draw,rows",
    [
        (plots.lambdas_figure, _lambda_rows()),
        (plots.theorem31_figure, _theorem_rows()),
        (plots.theorem31_figure, _theorem_rows(end_to_end=False)),
        (plots.pooling_figure, _pooling_rows()),
        (plots.lambdas_scatter_figure, [{**r, "ratio": q, "seed": s} for r in _lambda_rows()
                                        for q in (0.2, 0.1) for s in (0, 1)]),
        (plots.lambdas_scatter_figure, [{**r, "ratio": 0.2} for r in _lambda_rows()]),  # no seed
    ],
)
def test_figures_write_png_and_pdf_without_global_state(tmp_path, draw, rows):
    params, backend = copy.deepcopy(dict(matplotlib.rcParams)), matplotlib.get_backend()
    paths = draw(rows, tmp_path / "sub" / "fig")
    assert [p.name for p in paths] == ["fig.png", "fig.pdf"]
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["fig.pdf", "fig.png"]  # no temps
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[1].read_bytes()[:5] == b"%PDF-"
    assert dict(matplotlib.rcParams) == params and matplotlib.get_backend() == backend


@pytest.mark.parametrize("draw", [plots.lambdas_figure, plots.theorem31_figure, plots.pooling_figure,
                                  plots.lambdas_scatter_figure])
def test_figures_refuse_empty_or_foreign_tables(tmp_path, draw):
    with pytest.raises(ValueError, match="rows"):
        draw([], tmp_path / "fig")
    with pytest.raises(ValueError, match="columns"):
        draw([{"layer": "a", "unrelated": 1.0}], tmp_path / "fig")
