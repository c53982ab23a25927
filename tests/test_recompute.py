"""Activation outputs rebuilt from their packed inputs (`freqact.engine.recompute`)."""
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import freqact
from freqact.models.gpt import RMSNorm


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


class _NormLinear(nn.Module):
    """A norm then a Linear on token tensors (N, T, 32): a transformer block's attention input."""

    def __init__(self, norm=None) -> None:
        super().__init__()
        self.norm, self.fc = norm if norm is not None else RMSNorm(32), nn.Linear(32, 16)
        nn.init.uniform_(self.norm.weight, 0.5, 1.5)  # not ones: weight * x_n must not be x_n

    def forward(self, x):
        return self.fc(self.norm(x))


class _EditedRms(nn.Module):
    """RMSNorm as `_NormLinear`'s, written out, with an in-place edit (by x1.0) of the statistic
    or the normalised x after the product, before or after `weight * x_n` saved x_n."""

    def __init__(self, edit: str) -> None:
        super().__init__()
        self.weight, self.fc, self.edit = nn.Parameter(torch.rand(32) + 0.5), nn.Linear(32, 16), edit

    def forward(self, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x_n = x * rstd
        edited = {"statistic": rstd, "statistic after save": rstd, "output": x_n}[self.edit]
        if not self.edit.endswith("after save"):
            edited.mul_(1.0)
        y = self.weight * x_n
        if self.edit.endswith("after save"):
            edited.mul_(1.0)
        return self.fc(y)


def _nodes(root, name: str) -> list:
    """The autograd nodes named `name` reachable from root."""
    seen, todo, found = set(), [root], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            found.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return found


def _node(root, name: str):
    """The first autograd node named `name` reachable from root."""
    found = _nodes(root, name)
    assert found, f"no {name} in the graph"
    return found[0]


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


def test_rmsnorm_saves_its_normalised_x_as_the_product_of_the_decoded_x():
    torch.manual_seed(0)
    model = _NormLinear()
    x = torch.randn(4, 64, 32, requires_grad=True)
    with freqact.compress(model, "division") as meter:
        out = model(x)
    routes = meter.by_route()
    # x packed once (pow and mul share it), x_n a recipe; the Linear's input y = weight * x_n
    # keeps its own per-channel encode (not rebuilt from x's per-token one)
    assert routes["division tile/tok"]["count"] == 2 and routes["division tile/chan"]["count"] == 1
    assert routes["recomputed activation"]["count"] == 1
    assert routes["recomputed activation"]["saved_bytes"] == 0
    scale = next(n for n in _nodes(out.grad_fn, "MulBackward0") if n._saved_other.shape == x.shape)
    product = next(n for n in _nodes(out.grad_fn, "MulBackward0") if n is not scale)
    x_hat, rstd = product._saved_self, product._saved_other
    assert not torch.equal(x_hat, x) and rstd.shape == (4, 64, 1)
    assert torch.equal(scale._saved_self, model.norm.weight)
    assert torch.equal(scale._saved_other, x_hat * rstd)


@pytest.mark.parametrize("edit", ["statistic", "output", "statistic after save"])
def test_an_in_place_edit_after_the_product_keeps_the_normal_route(edit):
    torch.manual_seed(0)
    model = _EditedRms(edit)
    x = torch.randn(4, 64, 32, requires_grad=True)
    with freqact.compress(model, "division") as meter:
        out = model(x)
    routes = meter.by_route()
    if edit == "statistic after save":
        # the recipe was made before the edit: its statistic checks its version at unpack and
        # raises, as plain PyTorch's backward of x * rstd does
        assert routes["recomputed activation"]["count"] == 1
        with pytest.raises(RuntimeError, match="in-place"):
            out.sum().backward()
        return
    # x (pow, mul) and x_n encoded per token; y = weight * x_n, whose argument x_n is now
    # packed per token, keeps its per-channel encode as the Linear's input
    assert "recomputed activation" not in routes
    assert routes["division tile/tok"]["count"] == 3 and routes["division tile/chan"]["count"] == 1
    if edit == "output":  # (an edited statistic makes plain PyTorch's backward raise too)
        out.sum().backward()
        assert torch.isfinite(x.grad).all()


class _ScaledConv(nn.Module):
    """conv(scale * x) with a learned per-channel scale and an input without grad: the product
    saves only x (packed by the map rule) and the conv saves the product (a recipe)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(1, 8, 1, 1) + 0.5)
        self.conv = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(self.scale * x)


@pytest.mark.parametrize("edit", [None, "before the conv", "after the forward"])
def test_a_parameter_factor_edited_in_place_is_never_silently_used(edit):
    torch.manual_seed(0)
    model = _ScaledConv()
    x = torch.randn(2, 8, 16, 16)
    with freqact.compress(model, "division") as meter:
        if edit == "before the conv":  # between the product and the conv's save of it
            y = model.scale * x
            with torch.no_grad():
                model.scale.mul_(3.0)
            out = model.conv(y)
        else:
            out = model(x)
    recipes = meter.by_route().get("recomputed activation", {"count": 0})["count"]
    if edit == "after the forward":  # the recipe exists; rebuilding from the edited scale raises
        assert recipes == 1
        with torch.no_grad():
            model.scale.mul_(3.0)
        with pytest.raises(RuntimeError, match="in-place"):
            out.sum().backward()
        return
    assert recipes == (0 if edit else 1)  # edited before the save: the product is encoded
    if edit is None:  # the conv's input is the product of the scale and the decoded x
        saved = _node(out.grad_fn, "ConvolutionBackward0")._saved_input
        x_hat = _node(out.grad_fn, "MulBackward0")._saved_other
        assert not torch.equal(x_hat, x) and torch.equal(saved, model.scale * x_hat)
    out.sum().backward()
    assert torch.isfinite(model.scale.grad).all()


def test_a_factor_packed_as_a_mask_rebuilds_nothing():
    # Only a packed copy of the values rebuilds a product: a relu mask keeps the signs only.
    from freqact.engine import routes
    from freqact.engine.block import _Packed
    from freqact.engine.recompute import Recomputer

    x = torch.relu(torch.randn(2, 8, 16, 16))
    w = nn.Parameter(torch.rand(1, 8, 1, 1))
    for route, rebuilt in ((routes._RELU_MASK, False), (routes.Route("codec", freqact.codecs.get(
            "division")), True)):
        recomputer = Recomputer(lambda packed: packed)
        packed = _Packed(route, None)
        func = ("mul", (x, w), {}, 7)
        recomputer.saw_input(func, x, packed)
        out = x * w
        recomputer.returned(torch.mul, (x, w), {}, 7, out)
        storage = out.untyped_storage()
        recipe = recomputer.recipe_for(out, storage, storage.data_ptr(), routes.KEEP)
        assert (recipe is not None) is rebuilt


def test_layer_norm_output_is_not_recomputed():
    torch.manual_seed(0)
    model = _NormLinear(nn.LayerNorm(32))
    with freqact.compress(model, "division") as meter:
        model(torch.randn(4, 64, 32, requires_grad=True))
    routes = meter.by_route()
    assert "recomputed activation" not in routes and routes["division tile/chan"]["count"] == 1


@pytest.mark.parametrize("build", [lambda: _Mlp(nn.GELU()), _NormLinear], ids=["gelu", "rmsnorm"])
def test_only_division_recomputes_and_exact_stays_bit_identical(build):
    torch.manual_seed(0)
    model = build()
    x = torch.randn(4, 64, 32, requires_grad=True)  # else RMSNorm saves nothing of x
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


@pytest.mark.parametrize("build", [lambda: _Mlp(nn.GELU()), _NormLinear], ids=["gelu", "rmsnorm"])
def test_a_forward_without_backward_frees_the_packed_input(build):
    from freqact.engine.block import _Packed

    def live_packed() -> int:
        gc.collect()
        return sum(type(o) is _Packed for o in gc.get_objects())
    torch.manual_seed(0)
    model = build()
    x = torch.randn(4, 64, 32, requires_grad=True)
    before = live_packed()
    with freqact.compress(model, "division") as meter:
        out = model(x)
        assert live_packed() > before and "recomputed activation" in meter.by_route()
        del out
        # inside the block: the recipe table holds weak references only
        assert live_packed() == before
