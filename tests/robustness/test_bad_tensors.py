"""Robustness sweep (issue 8), part 1a: bad tensors given to the codecs and `compress`.

Integer, bool and complex tensors; NaN/Inf (the policy: a non-finite value makes its own map decode
non-finite, never finite garbage, and never touches other maps); constant channels; a zero-size
batch; awkward map sizes; ranks 1 to 6; strided layouts; half and double precision. Each gives the
right result (checked against float64 oracles and the one-step quantisation bound) or an error
naming the argument.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import freqact
from freqact import codecs, kernels
from tests.robustness.helpers import grads, tiny

# Codecs that read values (the cheap masks and `exact` take any tensor they are routed).
VALUE_CODECS = {"division": {}, "division-no-hfc": {}, "division-no-lfc": {}, "quant": {},
                "lfc": {"ratio": 0.5}, "hfc": {"ratio": 0.5}}
QUANTISED = ("division", "division-no-lfc", "quant")


def _round_trip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = codecs.get(name, **VALUE_CODECS.get(name, {}))
    return codec.decode(codec.encode(x))


def _target(name: str, x: torch.Tensor, block: int = 8) -> torch.Tensor:
    """What a codec's decode estimates: x, or for `division-no-lfc` x minus its bf16 B x B means
    (that ablation drops the means by design)."""
    if name != "division-no-lfc":
        return x.float()
    means = torch.from_numpy(_block_means64(x, block)).to(torch.bfloat16).float()
    bh, bw = min(block, x.shape[-2]), min(block, x.shape[-1])
    up = means.repeat_interleave(bh, -2).repeat_interleave(bw, -1)[..., :x.shape[-2], :x.shape[-1]]
    return x.float() - up


def _quantisation_bound(x: torch.Tensor, packed) -> torch.Tensor:
    """Per-element bound on |decode - x| for a quantised form: one step, plus output rounding."""
    # step is (N, C) per map; for (N, F) inputs (N, 1), one map per sample.
    step = packed.step.float().reshape(*packed.step.shape, *[1] * (x.dim() - packed.step.dim()))
    eps = torch.finfo(x.dtype).eps
    return step * (1 + 1e-3) + 2 * eps * x.float().abs() + 1e-6


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("name", sorted(VALUE_CODECS))
def test_non_real_float_tensors_are_refused_naming_x(name, dtype):
    x = torch.ones(2, 3, 4, 4, dtype=dtype)
    with pytest.raises(TypeError, match=r"x: expected a real floating-point tensor.*" + str(dtype)):
        codecs.get(name, **VALUE_CODECS[name]).encode(x)


@pytest.mark.parametrize("fn", [lambda x: freqact.split(x, 0.5), lambda x: freqact.dct.dct(x),
                                lambda x: freqact.band_energy(x, 0.5)])
def test_dct_tools_refuse_integer_tensors(fn):
    with pytest.raises(TypeError, match="x: expected a real floating-point tensor"):
        fn(torch.ones(2, 3, 4, 4, dtype=torch.int32))


@pytest.mark.parametrize("name", QUANTISED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_makes_its_map_decode_to_nan_and_leaves_the_others(name, bad):
    # Policy (docs/ARCHITECTURE.md): a non-finite value poisons its own map, visibly, never more.
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    x[1, 2, 3, 5] = bad
    x_hat = _round_trip(name, x)
    assert x_hat[1, 2].isnan().all()
    others = torch.ones(2, 3, dtype=torch.bool)
    others[1, 2] = False
    assert torch.isfinite(x_hat[others]).all()
    packed = codecs.get(name).encode(x)
    bound = _quantisation_bound(x, packed)
    assert ((x_hat - _target(name, x)).abs() <= bound)[others].all()


@pytest.mark.parametrize("name", ["lfc", "hfc", "division-no-hfc"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_stays_visible_in_the_other_value_codecs(name, bad):
    x = torch.randn(2, 3, 8, 8)
    x[0, 1, 0, 0] = bad
    x_hat = _round_trip(name, x)
    assert not torch.isfinite(x_hat[0, 1]).all()
    assert torch.isfinite(x_hat[1]).all()


def test_nan_input_gives_nan_gradients_under_compress_as_in_plain_pytorch():
    x = torch.randn(2, 3, 8, 8)
    x[0, 0, 2, 2] = float("nan")
    plain = grads(tiny(), x)
    exact = grads(tiny(), x, "exact")
    assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(plain, exact))
    division = grads(tiny(), x, "division")
    assert plain[0].isnan().any() and division[0].isnan().any(), "the NaN input was hidden"


@pytest.mark.parametrize("name", QUANTISED + ("division-no-hfc",))
def test_constant_channels(name):
    x = torch.randn(2, 3, 8, 8)
    x[0, 1] = 0.0          # an all-zero ReLU map: exact
    x[1, 0] = 0.75         # bf16-representable: exact
    x[1, 2] = 0.1          # not bf16-representable: within a tiny step, never NaN
    x_hat = _round_trip(name, x)
    target = _target(name, x)
    assert torch.equal(x_hat[0, 1], target[0, 1]) and torch.equal(x_hat[1, 0], target[1, 0])
    assert torch.isfinite(x_hat).all()
    assert (x_hat[1, 2] - target[1, 2]).abs().max() <= 1e-3


def test_zero_size_batch():
    empty = torch.zeros(0, 3, 8, 8)
    for name in ("division", "quant", "lfc", "hfc"):  # empty in, empty out (issue 15.6)
        assert _round_trip(name, empty).shape == empty.shape
    # Inside a training step a zero-size batch is plain PyTorch's business, not the codec's.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))
    with freqact.compress(model, "division") as meter:
        out = model(empty)
    out.sum().backward()
    assert out.shape == (0, 2) and meter.saved_bytes == 0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_meta_tensors_are_kept_not_coded():
    # shape-only tracing on the meta device: the codec cannot read the values (it raised
    # "Tensor.item() cannot be called on meta tensors"); kept, the step runs as plain PyTorch's
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to("meta")
    x = torch.randn(8, 65, 64, device="meta")
    with freqact.compress(model, "division") as meter:
        out = model(x)
    out.sum().backward()
    assert model[0].weight.grad.shape == (64, 64) and model[0].weight.grad.is_meta
    assert set(meter.by_route()) == {"kept"}


def _block_means64(x: torch.Tensor, block: int) -> np.ndarray:
    """float64 oracle: means of B x B blocks, edge blocks over what they cover."""
    a = x.double().numpy()
    h, w = a.shape[-2:]
    bh, bw = min(block, h), min(block, w)
    rows = range(0, h, bh)
    cols = range(0, w, bw)
    return np.stack([np.stack([a[..., i:i + bh, j:j + bw].mean(axis=(-2, -1)) for j in cols], -1)
                     for i in rows], -2)


@pytest.mark.parametrize("hw, block", [((1, 1), 8), ((7, 7), 8), ((14, 14), 8), ((4, 12), 8),
                                       ((7, 7), 16), ((3, 5), 2)])
def test_awkward_map_sizes(hw, block):
    torch.manual_seed(1)
    x = torch.randn(2, 3, *hw)
    codec = codecs.get("division", block=block, bits=2)
    packed = codec.encode(x)
    means = _block_means64(x, block)
    assert packed.lfc.shape == means.shape
    # bf16 rounding of the float32 mean: relative 2**-8.
    assert np.allclose(packed.lfc.double().numpy(), means, rtol=2 ** -8, atol=1e-6)
    x_hat = codec.decode(packed)
    assert x_hat.shape == x.shape and ((x_hat - x).abs() <= _quantisation_bound(x, packed)).all()


@pytest.mark.parametrize("shape", [(8,), (1, 1, 1, 1, 2, 2)])
def test_ranks_outside_two_to_five_are_refused_naming_x(shape):
    for name in VALUE_CODECS:
        with pytest.raises(ValueError, match=r"x: expected a tensor of rank 2 .*got rank"):
            codecs.get(name, **VALUE_CODECS[name]).encode(torch.randn(shape))


@pytest.mark.parametrize("shape", [(4, 10), (2, 5, 12), (1, 2, 3, 5, 6)])
def test_linear_token_and_volume_inputs_round_trip(shape):
    x = torch.randn(shape)
    codec = codecs.get("division", block=4, bits=4)
    packed = codec.encode(x)
    x_hat = codec.decode(packed)
    assert x_hat.shape == x.shape and ((x_hat - x).abs() <= _quantisation_bound(x, packed)).all()


@pytest.mark.parametrize("layout", ["channels_last", "permuted", "sliced"])
def test_strided_inputs_encode_like_their_contiguous_copy(layout):
    torch.manual_seed(2)
    base = torch.randn(2, 3, 9, 16)
    x = {"channels_last": base.to(memory_format=torch.channels_last),
         "permuted": base.permute(0, 1, 3, 2),
         "sliced": base[..., ::2]}[layout]
    noise = torch.rand(x.shape)
    a = kernels.division_encode(x, 8, 2, noise)
    b = kernels.division_encode(x.contiguous(), 8, 2, noise)
    for part in ("lfc", "lo", "step", "codes"):
        assert torch.equal(getattr(a, part), getattr(b, part)), part
    out = kernels.division_decode(a)
    assert out.is_contiguous() and torch.equal(out, kernels.division_decode(b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_reduced_and_double_precision(dtype):
    x = torch.randn(2, 3, 8, 8).to(dtype)
    for name in QUANTISED:
        codec = codecs.get(name)
        packed = codec.encode(x)
        x_hat = codec.decode(packed)
        assert x_hat.dtype == dtype
        assert ((x_hat.float() - _target(name, x)).abs() <= _quantisation_bound(x, packed)).all()
    model = tiny().to(dtype)
    assert all(torch.isfinite(g).all() for g in grads(model, x, "division"))
