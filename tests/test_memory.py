"""Tests for freqact.memory: the per-sample storage-formula compression ratio."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from freqact.memory import per_sample_bytes, theoretical_ratio


def _division_map_bytes(p: int, block: int = 8, bits: int = 2) -> int:
    """DIVISION's bytes for one 1D map of p elements (docs/ARCHITECTURE.md)."""
    return math.ceil(p * bits / 8) + 2 * math.ceil(p / block) + 4


def _division_2d_map_bytes(h: int, w: int, block: int = 8, bits: int = 2) -> int:
    return math.ceil(h * w * bits / 8) + 2 * math.ceil(h / block) * math.ceil(w / block) + 4


def test_mlp_matches_the_formula():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    exact, saved = per_sample_bytes(model, (8,), "division", block=8, bits=2)
    assert exact == (8 + 16) * 4
    assert saved == _division_map_bytes(8) + 16 / 8 + _division_map_bytes(16)
    assert theoretical_ratio(model, (8,)) == exact / saved
    # The exact codec keeps everything and makes no mask beside it (it would be held on top).
    assert theoretical_ratio(model, (8,), "exact") == 1.0


def test_cnn_matches_the_formula():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    exact, saved = per_sample_bytes(model, (3, 16, 16), "division")
    # conv input, BN input, ReLU output (also the MaxPool input), MaxPool int64 indices, fc input.
    assert exact == (3 * 256 + 8 * 256 + 8 * 256) * 4 + 8 * 64 * 8 + 512 * 4
    # DIVISION maps, a 1-bit mask, nothing for the pool input, 1-byte indices, a 512-long map.
    assert saved == (3 * _division_2d_map_bytes(16, 16) + 8 * _division_2d_map_bytes(16, 16)
                     + 8 * 256 / 8 + 0 + 8 * 64 + _division_map_bytes(512))


def test_batchnorm1d_mlp_is_charged_as_a_training_batch():
    # the per-sample difference was taken at batches 2 and 3, where BatchNorm1d's (N, C) input is
    # kept (routes.MIN_BATCH_VALUES): every sample charged plain, ratio 1.88 (the meter at batch
    # 256: 6.8)
    model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 10))
    exact, saved = per_sample_bytes(model, (64,), "division", block=8, bits=2)
    assert exact == (64 + 256 + 256) * 4  # the Linears' inputs and BatchNorm's
    # per sample: a 64-map, the BatchNorm input as 256 per-channel maps over the batch (2 bits
    # and a bf16 mean per 8 samples each), the ReLU output's 1-bit mask and its values for the
    # last Linear (a 256-map)
    assert saved == (_division_map_bytes(64) + 256 * (2 / 8 + 2 / 8) + 256 / 8
                     + _division_map_bytes(256))
    assert theoretical_ratio(model, (64,)) == exact / saved > 6.5


def test_model_state_and_rng_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert theoretical_ratio(model, (3, 8, 8)) > 1
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.slow
def test_resnet18_reaches_the_paper_ratio():
    models = pytest.importorskip("freqact.models")
    if "resnet18" not in models.names():
        pytest.skip("resnet18 is not registered yet")
    ratio = theoretical_ratio(models.get("resnet18"), (3, 32, 32), "division", block=8, bits=2)
    assert ratio >= 10.5


def test_bad_arguments_name_the_argument():
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match="input_shape"):
        theoretical_ratio(model, "abc")
    with pytest.raises(ValueError, match="input_shape"):
        theoretical_ratio(model, (0, 4))
    with pytest.raises(ValueError, match="input_shape"):
        theoretical_ratio(model, ())
    with pytest.raises(TypeError, match="model"):
        theoretical_ratio("resnet18", (4,))
    with pytest.raises(ValueError, match="codec"):
        theoretical_ratio(model, (4,), "nope")
