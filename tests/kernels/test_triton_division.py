"""The Triton DIVISION kernels as torch.library custom ops: fake shapes and opcheck.

Their bytes against the reference are tested with the C kernels' in test_fused_kernels.py. Without
a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set here before triton is imported).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # triton.jit reads this when a kernel is decorated, i.e. when triton_division is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import freqact.kernels as K  # noqa: E402
from freqact.kernels import reference as R  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
from tests.kernels.helpers import FIELDS  # noqa: E402

needs_triton = pytest.mark.skipif(not K._triton_importable(), reason="triton is not importable")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    needs_triton = pytest.mark.skip(reason="no CUDA and TRITON_INTERPRET was set to something else")


@needs_triton
@pytest.mark.triton
def test_fake_shapes_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for shape in [(2, 13), (2, 3, 11), (2, 3, 7, 9), (1, 2, 3, 9, 10)]:
        want = R.division_encode(torch.randn(shape), 4, 2)
        with FakeTensorMode():
            fake = torch.ops.freqact.division_encode(torch.empty(shape), 4, 2, None, 0)
        assert [tuple(t.shape) for t in fake] == [tuple(getattr(want, n).shape) for n in FIELDS]
    x = torch.randn(1, 2, 3, 4, device=DEVICE)
    noise = torch.rand(x.shape, device=DEVICE)
    torch.library.opcheck(torch.ops.freqact.division_encode.default, (x, 8, 2, noise, 0))
    p = R.division_encode(x, 8, 2, noise)
    torch.library.opcheck(torch.ops.freqact.division_decode.default,
                          (p.lfc, p.lo, p.step, p.codes, list(x.shape), x.dtype, 8, 2))
