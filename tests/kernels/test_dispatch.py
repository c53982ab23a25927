"""Choosing the kernels: the `backend=` keyword, FREQACT_KERNELS, auto, and the errors.

No CUDA is needed: "cpu" on a non-CPU tensor is checked with a meta tensor.
"""
from __future__ import annotations

import pytest
import torch

import freqact.kernels as K
from freqact.kernels import cpu
from tests.kernels.helpers import assert_same_bytes


def test_auto_picks_the_c_kernels_on_the_cpu_and_torch_can_be_forced(monkeypatch):
    monkeypatch.delenv("FREQACT_KERNELS", raising=False)
    x = torch.randn(2, 3, 5, 5)
    assert K.backend_for(x) == ("cpu" if cpu.available() else "torch")
    monkeypatch.setenv("FREQACT_KERNELS", "torch")
    assert K.backend_for(x) == "torch"
    noise = torch.rand(x.shape)
    got = K.division_encode(x, 4, 2, noise)
    assert_same_bytes(got, K.division_encode(x, 4, 2, noise, backend="torch"))


def test_keyword_overrides_environment(monkeypatch):
    monkeypatch.setenv("FREQACT_KERNELS", "triton")
    assert K.backend_for(torch.zeros(1), "torch") == "torch"
    monkeypatch.setenv("FREQACT_KERNELS", "torch")
    if cpu.available():
        assert K.backend_for(torch.zeros(1), "cpu") == "cpu"


def test_every_entry_point_follows_the_choice(monkeypatch):
    if not cpu.available():
        pytest.skip(f"C kernels unavailable: {cpu.unavailable_reason()}")
    calls = []
    for name in ("encode", "decode", "pack_codes", "unpack_codes", "pack_mask", "unpack_mask"):
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    x = torch.randn(2, 3, 6, 6)
    for backend in ("torch", "cpu"):
        calls.clear()
        packed = K.division_encode(x, backend=backend)
        K.division_decode(packed, backend=backend)
        K.quantize_encode(x, 2, backend=backend)
        K.pack_codes(K.unpack_codes(packed.codes, 36, 2, backend=backend), 2, backend=backend)
        K.unpack_mask(K.pack_mask(x, 0.0, backend=backend), x.shape, x.dtype, 0.0, 1.0,
                      backend=backend)
        expected = ["encode", "decode", "encode", "unpack_codes", "pack_codes", "pack_mask",
                    "unpack_mask"]
        assert calls == (expected if backend == "cpu" else [])
    # Masks of other dtypes than float32 use the reference.
    calls.clear()
    K.unpack_mask(K.pack_mask(x.half(), 0.0, backend="cpu"), x.shape, torch.half, 0.0, 1.0,
                  backend="cpu")
    assert calls == []
    # LFC-only forms have no codes to decode: always the reference.
    calls.clear()
    K.division_decode(K.lfc_encode(x, 4), backend="cpu")
    assert calls == []


def test_errors_name_what_was_wrong(monkeypatch):
    x = torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError, match="backend"):
        K.division_encode(x, backend="cuda")
    with pytest.raises(ValueError, match="backend 'cpu': expected a CPU tensor"):
        K.backend_for(torch.empty(1, device="meta"), "cpu")
    monkeypatch.setenv("FREQACT_KERNELS", "fast")
    with pytest.raises(ValueError, match="FREQACT_KERNELS"):
        K.division_encode(x)
    monkeypatch.delenv("FREQACT_KERNELS")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if K._triton_importable():
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            K.division_encode(x, backend="triton")
    monkeypatch.setattr(K, "_triton_importable", lambda: False)
    with pytest.raises(RuntimeError, match="triton"):
        K.backend_for(x, "triton")
    with pytest.raises(TypeError, match="x"):
        K.division_encode(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="x"):
        K.quantize_encode(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="bits"):
        K.quantize_encode(x, 3)
    with pytest.raises(TypeError, match="packed"):
        K.division_decode(x)


def test_a_missing_compiler_falls_back_to_the_reference_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("FREQACT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    monkeypatch.delenv("FREQACT_KERNELS", raising=False)
    cpu._library.cache_clear()
    K._cpu_kernels_available.cache_clear()
    try:
        assert not cpu.available()
        assert "could not be built" in cpu.unavailable_reason()
        assert "false" in cpu.unavailable_reason()
        x = torch.randn(2, 3, 5, 5)
        with pytest.warns(RuntimeWarning, match="slower torch reference"):
            assert K.backend_for(x) == "torch"
        with pytest.raises(RuntimeError, match="backend 'cpu' was requested but the C kernels"):
            K.division_encode(x, backend="cpu")
        assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    finally:
        cpu._library.cache_clear()
        K._cpu_kernels_available.cache_clear()
