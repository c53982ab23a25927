"""The matmul machinery behind `freqact.dct`: cached orthonormal DCT matrices (built in float64,
then cast) and the separable transform that applies one small matrix along each axis, with its
exact autograd. `freqact.dct` is the public API; this module has no checks of its own (its callers
check their arguments).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from freqact.kernels import cpu_dct

# On the CPU the maps are transformed a chunk at a time so that the intermediate results of the
# per-axis stages live in bounded, reused buffers instead of a second activation-sized temporary:
# the peak memory is input + output + 1 chunk, and a buffer this small is recycled by the C
# allocator (below glibc's 32 MiB mmap ceiling) rather than page-faulted in afresh on every call,
# which costs as much as the matmuls themselves. Chunks stay large because every matmul is one
# OpenMP parallel region, and many short regions stall badly when the cores are oversubscribed.
_CPU_CHUNK_BYTES = 16 << 20


# ----------------------------------------------------------------------------------------------
# Cached matrices (float64 construction, then cast: the cast is the only rounding)
# ----------------------------------------------------------------------------------------------


def _dct_matrix64(n: int) -> torch.Tensor:
    """The (n, n) orthonormal DCT-II matrix in float64 on the CPU."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2.0 * i + 1.0) * k / (2.0 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d


def _constant(matrix64: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Cast a float64 CPU matrix into a cached constant: never an inference tensor, never grad."""
    with torch.inference_mode(False), torch.no_grad():
        return matrix64.to(device=device, dtype=dtype).contiguous()


@functools.lru_cache(maxsize=256)
def _basis(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Cached (n, n) DCT-II matrix D (rows are frequencies). Callers must not modify it."""
    return _constant(_dct_matrix64(n), dtype, device)


@functools.lru_cache(maxsize=256)
def _lowpass_projection(n: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Cached (n, n) symmetric projection D[:w].T @ D[:w]: keeps the first `window` frequencies."""
    d = _dct_matrix64(n)[:window]
    return _constant(d.T @ d, dtype, device)


@functools.lru_cache(maxsize=256)
def _block_basis(n: int, block: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Cached (n, n) block-diagonal DCT matrix: full blocks of `block`, then one smaller edge block."""
    sizes = [block] * (n // block) + ([n % block] if n % block else [])
    return _constant(torch.block_diag(*[_dct_matrix64(s) for s in sizes]), dtype, device)


# ----------------------------------------------------------------------------------------------
# The separable transform
# ----------------------------------------------------------------------------------------------


def _apply_stage(src: torch.Tensor, matrix: torch.Tensor, axis: int, sizes, dst: torch.Tensor) -> None:
    """dst = `matrix` applied along map axis `axis` of src; src/dst: flat (maps, prod(sizes))."""
    n = sizes[axis]
    if axis == len(sizes) - 1:
        # Last axis: one GEMM over all rows, (rows, n) @ (n, n)^T.
        torch.matmul(src.view(-1, n), matrix.mT, out=dst.view(-1, n))
    else:
        # Other axes: view as (outer, n, inner) and left-multiply every (n, inner) slab.
        inner = math.prod(sizes[axis + 1 :])
        torch.matmul(matrix, src.view(-1, n, inner), out=dst.view(-1, n, inner))


def _apply_axes(x: torch.Tensor, mats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Apply mats[j] along the j-th of the last len(mats) axes of x (no autograd)."""
    sizes = tuple(x.shape[x.dim() - len(mats) :])
    map_numel = math.prod(sizes)
    maps = x.numel() // map_numel
    flat = x.reshape(maps, map_numel)
    out = torch.empty_like(flat)
    if maps == 0:
        return out.view(x.shape)
    per_chunk = maps
    if x.device.type == "cpu" and len(mats) > 1:  # a single stage has no intermediate to bound
        per_chunk = min(maps, max(1, _CPU_CHUNK_BYTES // (map_numel * x.element_size())))
    # Last axis first (a plain GEMM). Stages alternate between the output and one buffer, chosen
    # so that the last stage writes the output: src and dst never alias.
    stages = [(j, mats[j]) for j in reversed(range(len(mats)))]
    buffer = flat.new_empty(per_chunk, map_numel) if len(stages) > 1 else None
    for start in range(0, maps, per_chunk):
        src = flat[start : start + per_chunk]
        rows = src.shape[0]
        for k, (axis, matrix) in enumerate(stages):
            writes_output = (len(stages) - 1 - k) % 2 == 0
            dst = out[start : start + rows] if writes_output else buffer[:rows]
            _apply_stage(src, matrix, axis, sizes, dst)
            src = dst
    return out.view(x.shape)


class _Separable(torch.autograd.Function):
    """y = x transformed by one matrix per axis. Linear, so the backward applies the transposes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *mats: torch.Tensor) -> torch.Tensor:
        # The matrices are cached constants that never require grad: keep them as attributes rather
        # than saved tensors so that saved-tensor hooks (the compression engine) never see them.
        ctx.mats = mats
        return _apply_axes(x, mats)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Through _Separable again, so double backward works too.
        grad_x = _Separable.apply(grad, *[m.mT for m in ctx.mats])
        return (grad_x,) + (None,) * len(ctx.mats)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for the half types, the input dtype otherwise."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _fast(x: torch.Tensor, dims: int) -> bool:
    """Whether the C kernels compute this transform (see the module docstring)."""
    return (
        x.device.type == "cpu"
        and dims <= 2
        and _compute_dtype(x) == torch.float32
        and not (x.requires_grad and torch.is_grad_enabled())
        and x.numel() > 0
        and max(x.shape[x.dim() - dims :]) <= cpu_dct.MAX_SIZE
        and cpu_dct.available()
    )


def _as_2d(x: torch.Tensor, dims: int) -> torch.Tensor:
    """x in float32 with its last `dims` (1 or 2) dims as (h, w) maps; 1D data is h = 1."""
    x = x.float()
    return x.unsqueeze(-2) if dims == 1 else x


def _separable(x: torch.Tensor, dims: int, matrix) -> torch.Tensor:
    """x's last `dims` axes transformed by matrix(axis, n, dtype, device), in x's compute dtype.

    Returns the result in the compute dtype (float32 for half inputs); callers cast back.
    """
    xc = x.to(_compute_dtype(x))
    sizes = xc.shape[xc.dim() - dims :]
    mats = [matrix(axis, n, xc.dtype, xc.device) for axis, n in enumerate(sizes)]
    return _Separable.apply(xc, *mats)
