"""The Triton DIVISION kernels as torch.library custom ops: fake shapes and opcheck.

Their bytes against the reference are tested with the C kernels' in test_fused_kernels.py. Without
a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by tests/conftest.py).
"""
from __future__ import annotations

import torch

import freqact.kernels as K
from tests.kernels.helpers import (
    FIELDS,
    TRITON,
    TRITON_DEVICE,
)

pytestmark = TRITON


def test_fake_shapes_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for shape in [(2, 13), (2, 3, 11), (2, 3, 7, 9), (1, 2, 3, 9, 10)]:
        want = K.division_encode(torch.randn(shape), 4, 2, backend="torch")
        with FakeTensorMode():
            fake = torch.ops.freqact.division_encode(torch.empty(shape), 4, 2, None,
                                                      torch.tensor(0), "triton")
        assert [tuple(t.shape) for t in fake] == [tuple(getattr(want, n).shape) for n in FIELDS]
    x = torch.randn(1, 2, 3, 4, device=TRITON_DEVICE)
    noise = torch.rand(x.shape, device=TRITON_DEVICE)
    torch.library.opcheck(torch.ops.freqact.division_encode.default,
                          (x, 8, 2, noise, torch.tensor(0), "triton"))
    p = K.division_encode(x.cpu(), 8, 2, noise.cpu(), backend="torch")
    torch.library.opcheck(torch.ops.freqact.division_decode.default,
                          tuple(t.to(x.device) for t in (p.lfc, p.lo, p.step, p.codes))
                          + (list(x.shape), x.dtype, 8, 2, "triton"))
