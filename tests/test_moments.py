"""Norm inputs decoded onto each token's exact mean and standard deviation (`engine.moments`):
the statistics against numpy in float64, the decode's moments, and the gradient of a LayerNorm
over a constant token (a zero-initialised class token), eager and compiled."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import freqact
from freqact import codecs
from freqact.engine.layouts import LayoutPacked, TokenLayout
from freqact.engine.moments import MomentsPacked, NormLayout, token_moments, with_moments


def test_token_moments_match_numpy_float64():
    x = torch.randn(3, 5, 24, dtype=torch.float64) * 3 + 1
    mean, std = token_moments(x)
    ref = x.numpy()
    assert mean.dtype == std.dtype == torch.float32 and mean.shape == (3, 5)
    np.testing.assert_allclose(mean.numpy(), ref.mean(-1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(std.numpy(), ref.std(-1), rtol=1e-5)


def test_with_moments_gives_the_held_moments_and_constant_tokens_exactly():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32)
    target_mean, target_std = torch.randn(2, 6), torch.rand(2, 6) + 0.1
    target_std[0, 1] = 0.0  # a constant token: every element its mean, exactly
    x[1, 2] = 0.5  # a decode without spread: moved to the mean too
    out = with_moments(x, target_mean, target_std)
    mean, std = token_moments(out)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 1] = keep[1, 2] = False
    torch.testing.assert_close(mean, target_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std[keep], target_std[keep], rtol=1e-5, atol=1e-6)
    assert torch.equal(out[0, 1], target_mean[0, 1].expand(32))
    assert torch.equal(out[1, 2], target_mean[1, 2].expand(32))
    assert with_moments(x.bfloat16(), target_mean, target_std).dtype == torch.bfloat16


@pytest.mark.parametrize("blocks", ["tile", "feat"])
def test_norm_layout_round_trip_holds_each_tokens_moments(blocks):
    torch.manual_seed(1)
    layout = NormLayout(codecs.get("division", block=8, bits=2), blocks, "tok")
    x = torch.randn(4, 16, 48) * torch.rand(4, 16, 1) * 5
    x[:, 0] = 0.3  # a class token without spread, 0.3 not a bf16 number
    packed = layout.encode(x)
    assert isinstance(packed, MomentsPacked)
    assert packed.nbytes == layout.nbytes_for(tuple(x.shape))
    out = layout.decode(packed)
    assert torch.equal(out[:, 0], x[:, 0])
    mean, std = token_moments(x)
    got_mean, got_std = token_moments(out)
    torch.testing.assert_close(got_mean, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_std, std, rtol=1e-4, atol=1e-6)
    with pytest.raises(TypeError, match="packed: expected a MomentsPacked or LayoutPacked"):
        layout.decode(packed.layout.quant)


def test_norm_layout_without_a_flat_token_holds_the_layout_alone():
    torch.manual_seed(2)
    division = codecs.get("division", block=8, bits=2)
    norm, plain = NormLayout(division, "tile", "tok"), TokenLayout(division, "tile", "tok")
    x = torch.randn(4, 16, 48)
    packed = norm.encode(x, seed=5)
    assert isinstance(packed, LayoutPacked) and packed.nbytes < norm.nbytes_for(tuple(x.shape))
    assert torch.equal(norm.decode(packed), plain.decode(plain.encode(x, seed=5)))
    x[2, 3] = x[2, 3] * 1e-3  # one token a thousand times flatter than its neighbours
    assert isinstance(norm.encode(x, seed=5), MomentsPacked)


class _ClassTokenNorm(nn.Module):
    """A zero class token beside projected patches, then LayerNorm (HF DeiT/BEiT at init)."""

    def __init__(self, features: int = 32) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.zeros(1, 1, features))
        self.proj = nn.Linear(features, features)
        self.norm = nn.LayerNorm(features, eps=1e-12)
        self.head = nn.Linear(features, features)

    def forward(self, x):
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.proj(x)], 1)
        return self.head(self.norm(tokens))


def _relative_error(model, run, x) -> float:
    target = torch.randn(x.shape[0], x.shape[1] + 1, x.shape[2],
                         generator=torch.Generator().manual_seed(1))
    grads = []
    for codec in (None, "division"):
        model.zero_grad(set_to_none=True)
        if codec is None:
            out = run(x)
        else:
            with freqact.compress(run, codec, block=8, bits=2):
                out = run(x)
        (out * target).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    plain, coded = grads
    return float((plain - coded).norm() / plain.norm())


def test_layernorm_over_a_constant_token_keeps_gradients_eager():
    # tile/tok alone: 4.7e7 (the token's residual noise came from its block's 7 other tokens,
    # times LayerNorm's rstd = 1/sqrt(eps))
    torch.manual_seed(0)
    model = _ClassTokenNorm()
    assert _relative_error(model, model, torch.randn(4, 63, 32)) < 0.01


@pytest.mark.slow
def test_layernorm_over_a_constant_token_keeps_gradients_compiled():
    torch.manual_seed(0)
    model = _ClassTokenNorm()
    assert _relative_error(model, torch.compile(model), torch.randn(4, 63, 32)) < 0.01
