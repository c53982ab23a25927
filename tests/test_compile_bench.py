"""benchmarks/compile_bench.py: the layout-off mode compiles graphs of its own."""
import torch
from torch import nn
from torch._dynamo.utils import counters

from benchmarks.compile_bench import layout_off_twin


def test_layout_off_twin_compiles_its_own_graphs():
    torch._dynamo.reset()
    counters.clear()
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    x = torch.randn(2, 3, 8, 8)
    torch.compile(model)(x)
    twin, compiled_twin = layout_off_twin(model)
    compiled_twin(x)
    assert counters["stats"]["unique_graphs"] == 2  # a plain torch.compile(twin) made 1
    assert all(p is not q for p, q in zip(twin.parameters(), model.parameters()))
