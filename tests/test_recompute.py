"""Activation outputs rebuilt from their packed inputs (`freqact.engine.recompute`)."""
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import freqact


class _Mlp(nn.Module):
    """Linear -> activation -> Linear on token tensors (N, T, F): the transformer MLP."""

    def __init__(self, act, hidden: int = 64, inplace_scale: float | None = None) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(32, hidden), nn.Linear(hidden, 32), act
        self.inplace_scale = inplace_scale

    def forward(self, x):
        h = self.act(self.fc1(x))
        if self.inplace_scale is not None:
            h.mul_(self.inplace_scale)  # an in-place edit after the activation returned
        return self.fc2(h)


def _node(root, name: str):
    """The first autograd node named `name` reachable from root."""
    seen, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            return node
        todo.extend(n for n, _ in node.next_functions)
    raise AssertionError(f"no {name} in the graph")


@pytest.mark.parametrize("act, node, saved", [
    (nn.GELU(), "GeluBackward0", "_saved_self"),
    (nn.GELU(approximate="tanh"), "GeluBackward0", "_saved_self"),
    (nn.SiLU(), "SiluBackward0", "_saved_self"),
    (nn.Hardswish(), "HardswishBackward0", "_saved_self"),
    (nn.Mish(), "MishBackward0", "_saved_self"),
])
def test_the_next_layer_saves_the_activation_of_the_decoded_input(act, node, saved):
    torch.manual_seed(0)
    model = _Mlp(act)
    x = torch.randn(4, 64, 32)
    with freqact.compress(model, "division") as meter:
        out = model(x)
    routes = meter.by_route()
    assert routes["recomputed activation"]["count"] == 1
    assert routes["recomputed activation"]["saved_bytes"] == 0
    # What the two backwards unpack: the activation's decoded input, and fc2's input, which must
    # be exactly the activation of that decoded input (not a second decoded copy).
    x_hat = getattr(_node(out.grad_fn, node), saved)
    fc2_input = _node(out.grad_fn, "AddmmBackward0")._saved_mat1
    assert torch.equal(fc2_input, act(x_hat).reshape(fc2_input.shape))
    assert not torch.equal(x_hat, model.fc1(x))  # the input really is the decoded one


def test_recomputing_saves_the_output_bytes_and_keeps_the_gradient():
    torch.manual_seed(0)
    model = _Mlp(nn.GELU(), hidden=128)
    x = torch.randn(8, 64, 32)
    model(x).square().mean().backward()
    plain = torch.cat([p.grad.flatten() for p in model.parameters()])

    def run():
        model.zero_grad(set_to_none=True)
        with freqact.compress(model, "division") as meter:
            loss = model(x).square().mean()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), meter
    with_recipe, meter = run()
    # The same model with the activation's output edited in place by x1.0: the recipe is refused
    # (version changed), so the output takes its normal codec route.
    model.inplace_scale = 1.0
    normal_route, meter_without = run()
    assert "recomputed activation" not in meter_without.by_route()
    assert meter.saved_bytes < meter_without.saved_bytes
    assert meter.exact_bytes == meter_without.exact_bytes
    for grad in (with_recipe, normal_route):
        assert F.cosine_similarity(grad, plain, dim=0) > 0.95


def test_only_division_recomputes_and_exact_stays_bit_identical():
    torch.manual_seed(0)
    model = _Mlp(nn.GELU())
    x = torch.randn(4, 64, 32)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    for codec, params in (("exact", {}), ("lfc", {"ratio": 0.5}), ("quant", {})):
        model.zero_grad(set_to_none=True)
        with freqact.compress(model, codec, **params) as meter:
            loss = model(x).sum()
        loss.backward()
        assert "recomputed activation" not in meter.by_route(), codec
        if codec == "exact":
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


def test_a_forward_without_backward_frees_the_packed_input():
    from freqact.engine.block import _Packed

    def live_packed() -> int:
        gc.collect()
        return sum(type(o) is _Packed for o in gc.get_objects())
    torch.manual_seed(0)
    model = _Mlp(nn.GELU())
    x = torch.randn(4, 64, 32)
    before = live_packed()
    with freqact.compress(model, "division"):
        out = model(x)
        assert live_packed() > before
        del out
        # inside the block: the recipe table holds weak references only
        assert live_packed() == before
