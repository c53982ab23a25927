"""Numerics at the edges for every value codec (issue 15.6): finite in, finite out at the ends of
each dtype's range, on every backend; a batch without samples round-trips (empty in, empty out)."""
from __future__ import annotations

import pytest
import torch

from freqact import codecs
from freqact.kernels import cpu
from tests.kernels.helpers import TRITON, TRITON_DEVICE

VALUE_CODECS = {"division": {}, "division-no-hfc": {}, "division-no-lfc": {}, "quant": {},
                "lfc": {"ratio": 0.5}, "hfc": {"ratio": 0.5}, "hfc-quant": {"ratio": 0.5},
                "exact": {}}
BACKENDS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(
        not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}")),
    pytest.param("triton", marks=TRITON),
]


@pytest.fixture(params=BACKENDS)
def device(request, monkeypatch) -> str:
    monkeypatch.setenv("FREQACT_KERNELS", request.param)
    return TRITON_DEVICE if request.param == "triton" else "cpu"


def _edges(dtype: torch.dtype) -> torch.Tensor:
    """Maps (2, 3, 4, 8) of values at the end of dtype's range: both signs mixed, all at the
    maximum, and just below it."""
    top = torch.finfo(dtype).max
    signs = torch.randint(0, 2, (1, 3, 4, 8), generator=torch.Generator().manual_seed(0)) * 2 - 1
    mixed = signs * top * 0.9
    return torch.cat([mixed, torch.full_like(mixed, top)]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", VALUE_CODECS)
def test_finite_in_finite_out(device, name, dtype):
    codec = codecs.get(name, **VALUE_CODECS[name])
    x = _edges(dtype).to(device)
    assert bool(x.isfinite().all())
    out = codec.decode(codec.encode(x))
    assert out.dtype == dtype and out.shape == x.shape
    assert bool(out.isfinite().all())


@pytest.mark.parametrize("name", VALUE_CODECS)
def test_a_batch_without_samples_round_trips(device, name):
    codec = codecs.get(name, **VALUE_CODECS[name])
    for shape in [(0, 3, 5, 5), (0, 7), (0, 2, 9)]:
        x = torch.zeros(shape, device=device)
        packed = codec.encode(x)
        out = codec.decode(packed)
        assert out.shape == x.shape and out.dtype == x.dtype and packed.nbytes == 0


def test_spectral_bytes_are_unchanged_for_ordinary_inputs():
    # The edge rule is taken only when the coefficients overflow: here they do not.
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)).half()
    codec = codecs.get("lfc", ratio=0.5)
    packed = codec.encode(x)
    assert packed.scale_exp == 0
    from freqact import dct
    # The stored bytes are the plain DCT's corner (the fast lfc encode computes only that corner).
    assert torch.equal(packed.pieces[0], dct.dct(x, dims=2)[..., :4, :4])
    want = dct.idct(dct.dct(x, dims=2) * dct.lowpass_mask((8, 8), 0.5).to(x.dtype), dims=2)
    # Decode synthesises from the corner (not the zero-padded full iDCT): equal up to rounding.
    torch.testing.assert_close(codec.decode(packed), want)
