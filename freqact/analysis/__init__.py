"""Frequency analyses of trained networks: pure functions, model + batch in, list of dicts out.

- `lambdas`: λ^L, λ^H (DCT band norms) per layer and instance, from one model or from checkpoints
  (the paper's Fig. 4): `lambdas.measure(model, x)`, `lambdas.from_checkpoints(paths)`.
- `theorem31`: measured weight-gradient errors of LFC-/HFC-cached inputs against the bounds of
  Theorem 3.1: `theorem31.measure(model, x, y)`.
- `pooling`: DIVISION's block-mean LFC against the DCT low-pass (Theorem 4.1):
  `pooling.measure(model, x)`.
- `common`: layer selection, activation capture, checkpoint paths, the fixed test batch, CSV.

Each module's `summarize(rows)` condenses its table; `freqact.plots` draws the figures.
"""
from freqact.analysis import common, lambdas, pooling, theorem31

__all__ = ["common", "lambdas", "pooling", "theorem31"]
