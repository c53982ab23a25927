"""Tests for freqact.engine (compress + Meter) and the exact-but-cheap codecs it routes to."""
from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from freqact import codecs, kernels
from freqact.codecs.base import Exact
from freqact.engine import compress

# --- helpers ------------------------------------------------------------------------------------


class Cloning(codecs.Codec):
    """A lossless codec that is not `exact`: the engine still applies the 1-bit masks with it."""

    name = "cloning"

    def encode(self, x):
        return x.clone()

    def decode(self, packed):
        return packed


class Recording(Cloning):
    """A lossless codec remembering every tensor it was asked to encode."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def encode(self, x):
        self.seen.append(x)
        return super().encode(x)


class CopyingExact(Cloning):
    """A lossless codec that copies (like every compressing codec), counting its encodes."""

    def __init__(self) -> None:
        self.encodes = 0

    def encode(self, x):
        self.encodes += 1
        return super().encode(x)


class Zoo(nn.Module):
    """Every module kind the engine routes: conv 1d/2d/3d (grouped), norms, pools, activations."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.gn = nn.GroupNorm(2, 8)
        self.relu6 = nn.ReLU6()
        self.avg = nn.AvgPool2d(2)
        self.conv1d = nn.Conv1d(8, 8, 3, padding=1)
        self.leaky = nn.LeakyReLU(0.1)
        self.conv3d = nn.Conv3d(1, 2, 3, padding=1)
        self.hardtanh = nn.Hardtanh(-0.5, 0.5, inplace=True)
        self.adapt = nn.AdaptiveAvgPool2d(3)
        self.ln = nn.LayerNorm(18)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(18, 5)

    def forward(self, x):
        x = self.pool(self.relu(self.bn(self.conv(x))))  # (N, 8, 8, 8)
        x = self.avg(self.relu6(self.gn(self.dw(x))))  # (N, 8, 4, 4)
        x = self.leaky(self.conv1d(x.flatten(2))).view(-1, 1, 8, 4, 4)  # (N, 1, 8, 4, 4)
        x = self.hardtanh(self.conv3d(x)).flatten(1, 2)  # (N, 16, 4, 4)
        x = self.adapt(x).flatten(2).mean(1)  # (N, 9)
        x = torch.cat([F.relu(x), x * x], 1)  # functional ops: kept exactly
        return self.fc(self.drop(self.ln(x)))


def _grads(model, x, seed=0, ctx=None, **kwargs):
    """Parameter gradients (and the loss) of sum(model(x)^2); inside compress when ctx is given."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if ctx is None:
        loss = model(x).square().sum()
    else:
        with compress(model, ctx, **kwargs) as meter:
            loss = model(x).square().sum()
        assert meter.saved_bytes > 0
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_bitwise(a, b):
    assert torch.equal(a[0], b[0])
    for ga, gb in zip(a[1], b[1]):
        assert torch.equal(ga, gb)


def _param_storages(model):
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


# --- exactness ----------------------------------------------------------------------------------


def _exact_run(model, x, codec):
    with compress(model, codec) as meter:
        torch.manual_seed(0)
        loss = model(x).square().sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return meter, (loss.detach(), [p.grad for p in model.parameters()])


def test_cheap_routes_bitwise_on_every_module_kind():
    torch.manual_seed(0)
    model = Zoo()
    x = torch.randn(3, 3, 16, 16)
    plain = _grads(model, x)
    meter, got = _exact_run(model, x, Cloning())
    _assert_bitwise(plain, got)
    routes = meter.by_route()
    for name in ("cloning", "relu-mask", "hardtanh-mask", "sign-mask", "dropout-mask",
                 "maxpool-indices", "shape-only", "kept"):
        assert routes[name]["count"] >= 1, name
    # ReLU masks: 1 bit per element; MaxPool indices: 1 byte instead of 8.
    assert routes["relu-mask"]["saved_bytes"] * 32 == 3 * 8 * 16 * 16 * 4
    assert routes["maxpool-indices"]["saved_bytes"] == 3 * 8 * 8 * 8


def test_exact_bitwise_and_never_holds_more_than_plain():
    torch.manual_seed(0)
    model = Zoo()
    x = torch.randn(3, 3, 16, 16)
    plain = _grads(model, x)
    meter, got = _exact_run(model, x, "exact")
    _assert_bitwise(plain, got)
    # No activation masks beside the kept storages: held bytes can only be fewer (indices, shapes).
    assert set(meter.by_route()) == {"exact", "dropout-mask", "maxpool-indices", "shape-only",
                                     "kept"}
    assert 0 < meter.saved_bytes < meter.exact_bytes
    for row in meter.per_layer():
        assert row.saved_bytes <= row.exact_bytes, row


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mlp", "vit"])
def test_exact_bitwise_on_registry_models(name):
    models = pytest.importorskip("freqact.models")
    if name not in models.names():
        pytest.skip(f"model {name!r} is not registered yet")
    torch.manual_seed(0)
    model = models.get(name)
    x = torch.randn(2, *model.input_shape)
    _assert_bitwise(_grads(model, x), _grads(model, x, ctx="exact"))


def test_retain_graph_decodes_twice_to_the_same_gradients():
    torch.manual_seed(0)
    model = Zoo()
    x = torch.randn(2, 3, 16, 16)
    with compress(model, "division", bits=2) as meter:
        loss = model(x).square().sum()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    second = torch.autograd.grad(loss, list(model.parameters()))
    assert meter.ratio > 1
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# --- division: approximate but close ------------------------------------------------------------


def _rel_error(approx, exact):
    num = sum((a - b).square().sum() for a, b in zip(approx, exact))
    den = sum(b.square().sum() for b in exact)
    return math.sqrt(num / den)


def test_division_gradients_close_and_finer_settings_closer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    # Smooth inputs (low-frequency content), as images are: DIVISION's premise.
    x = F.interpolate(torch.randn(8, 3, 4, 4), size=16, mode="bilinear", align_corners=False)
    _, exact = _grads(model, x)
    _, coarse = _grads(model, x, ctx="division", block=8, bits=2)
    _, fine = _grads(model, x, ctx="division", block=1, bits=8)
    err_coarse, err_fine = _rel_error(coarse, exact), _rel_error(fine, exact)
    assert err_coarse < 0.2
    assert err_fine < err_coarse / 10


# --- parameters are never packed ----------------------------------------------------------------


class TwoLinear(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.a = nn.Linear(n, n)
        self.b = nn.Linear(n, n)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_parameters_never_reach_the_codec(autocast, frozen):
    torch.manual_seed(0)
    n = 6
    model = TwoLinear(n)  # batch == features: weight copies and inputs have the same shape
    model.a.weight.requires_grad_(not frozen)
    x = torch.randn(n, n, requires_grad=True)
    rec = Recording()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with compress(model, rec) as meter:
            out = model(x)
        plain = model(x)
    out.float().sum().backward()
    # The Linear inputs, nothing else; a frozen weight needs no input for its (absent) gradient.
    assert len(rec.seen) == (1 if frozen else 2)
    params = [p.detach() for p in model.parameters()]
    storages = _param_storages(model)
    for t in rec.seen:
        assert t.untyped_storage().data_ptr() not in storages
        assert not any(t.shape == p.shape and torch.equal(t, p.to(t.dtype)) for p in params)
    assert torch.equal(out, plain)
    assert meter.exact_bytes > 0


def test_autocast_exact_bitwise():
    torch.manual_seed(0)
    model = Zoo()
    x = torch.randn(2, 3, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _grads(model, x)
        packed = _grads(model, x, ctx="exact")
    _assert_bitwise(plain, packed)


# --- dedup, in-place, no_grad -------------------------------------------------------------------


class Fork(nn.Module):
    """A ReLU output read by two convolutions (as a ResNet block input with a projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.left = nn.Conv2d(4, 4, 3, padding=1)
        self.right = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        h = self.relu(x)
        return self.left(h) + self.right(h)


def test_shared_activation_is_packed_once():
    model = Fork()
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    codec = CopyingExact()
    with compress(model, codec) as meter:
        out = model(x)
    assert codec.encodes == 1
    layers = {row.layer: row for row in meter.per_layer()}
    # Charged to the first layer that saved the storage: the ReLU's mask and the conv's copy.
    plain, mask = x.numel() * 4, x.numel() // 8
    assert (layers["relu"].saved_bytes, layers["relu"].exact_bytes) == (mask + plain, plain)
    assert layers["relu"].routes == ("relu-mask",)
    for name in ("left", "right"):
        assert layers[name].shared and layers[name].routes == ("cloning",)
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    model(x).sum().backward()
    assert torch.equal(grad, x.grad)


@pytest.mark.parametrize("codec,freed", [(None, False), ("exact", False), ("division", True)])
def test_compressing_codecs_do_not_keep_the_activation_alive(codec, freed):
    model = Fork()
    refs = []
    handle = model.relu.register_forward_hook(lambda m, i, out: refs.append(weakref.ref(out)))
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    if codec is None:
        out = model(x)
    else:
        with compress(model, codec):
            out = model(x)
    handle.remove()
    assert (refs[0]() is None) == freed
    out.sum().backward()


class InPlaceAfterSave(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x, in_place: bool):
        h = self.relu(x)
        y = self.conv(h)
        h2 = h.mul_(3) if in_place else h.mul(3)  # h was saved by ReLU and by the conv
        return y * h2


def test_in_place_after_save_compressing_codec_keeps_the_saved_values():
    torch.manual_seed(0)
    model = InPlaceAfterSave()
    x = torch.randn(2, 2, 6, 6, requires_grad=True)
    with compress(model, CopyingExact()):
        model(x, in_place=True).sum().backward()
    got = (x.grad.clone(), model.conv.weight.grad.clone())
    x.grad = None
    model.zero_grad()
    model(x, in_place=False).sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], model.conv.weight.grad)


def test_in_place_after_save_exact_codec_raises():
    model = InPlaceAfterSave()
    x = torch.randn(2, 2, 6, 6, requires_grad=True)
    with compress(model, "exact"):
        loss = model(x, in_place=True).sum()
    with pytest.raises(RuntimeError, match="in-place"):
        loss.backward()


def test_no_grad_and_inference_forwards_are_untouched():
    torch.manual_seed(0)
    model = Zoo().eval()
    x = torch.randn(2, 3, 16, 16)
    expected = model(x)
    rec = Recording()
    for guard in (torch.no_grad, torch.inference_mode):
        with guard(), compress(model, rec) as meter:
            out = model(x)
        assert torch.equal(out, expected)
        assert rec.seen == [] and meter.saved_bytes == 0 and meter.per_layer() == []
    # Hooks are gone after the block.
    assert not model.conv._forward_pre_hooks and not model.conv._forward_hooks


# --- checkpoint ---------------------------------------------------------------------------------


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.stage = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                   nn.MaxPool2d(2))
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        x = checkpoint(self.stage, self.stem(x), use_reentrant=False)
        return self.head(x.flatten(1))


def test_checkpoint_inside_compress():
    torch.manual_seed(0)
    model = Checkpointed()
    x = torch.randn(2, 3, 8, 8)
    plain = _grads(model, x)
    _assert_bitwise(plain, _grads(model, x, ctx="exact"))
    rec = Recording()
    with compress(model, rec):
        loss = model(x).square().sum()
        loss.backward()  # recomputation while the block is active must not reach the codec
    inputs = [t.shape for t in rec.seen]
    assert inputs == [torch.Size([2, 3, 8, 8]), torch.Size([2, 4, 8, 8]), torch.Size([2, 64])]


def test_nested_compress_is_refused():
    model = Fork()
    with compress(model, "exact"):
        with pytest.raises(RuntimeError, match="nested"):
            with compress(model, "exact"):
                pass
    with compress(model, "exact"):  # the refusal left no state behind
        pass


# --- the meter ----------------------------------------------------------------------------------


def test_meter_matches_a_hand_count():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with compress(model, "division", block=8, bits=2) as meter:
        model(x).sum().backward()
    # DIVISION per map of P elements: ceil(2 P / 8) code bytes + 2 bytes per 8-block + 4 (lo, step).
    first = 5 * (math.ceil(2 * 8 / 8) + 2 * 1 + 4)
    second = 5 * (math.ceil(2 * 16 / 8) + 2 * 2 + 4)
    mask = math.ceil(5 * 16 / 8)
    # The ReLU output saved by "2" is charged, held and plain, to "1", the layer that saved it first.
    assert [(r.layer, r.routes, r.saved_bytes, r.exact_bytes) for r in meter.per_layer()] == [
        ("0", ("division",), first, 5 * 8 * 4), ("1", ("relu-mask",), mask + second, 5 * 16 * 4),
        ("2", ("division",), 0, 0)]
    assert meter.saved_bytes == first + mask + second
    assert meter.exact_bytes == (5 * 8 + 5 * 16) * 4
    assert meter.ratio == meter.exact_bytes / meter.saved_bytes


def test_exact_bytes_do_not_depend_on_the_codec():
    # Compression frees activations, and their addresses are reused by later tensors: the meter
    # must still count what plain PyTorch would hold, the same as when nothing is freed.
    torch.manual_seed(0)
    model = Zoo()
    x = torch.randn(4, 3, 16, 16)
    totals = []
    for codec in ("exact", "division"):
        with compress(model, codec) as meter:
            out = model(x)
        totals.append(meter.exact_bytes)
        del out
    assert totals[0] == totals[1]


def test_include_and_exclude_by_type_and_name():
    model = Zoo()
    x = torch.randn(2, 3, 16, 16)
    rec = Recording()
    with compress(model, rec, include=[nn.Linear]) as meter:
        model(x)
    assert [t.shape[-1] for t in rec.seen] == [18]
    assert set(meter.by_route()) == {"cloning", "kept"}
    rec = Recording()
    with compress(model, rec, exclude=[nn.Conv2d, "fc"]) as meter:
        model(x)
    assert [t.dim() for t in rec.seen] == [4, 4, 3, 5, 2]  # bn, gn, conv1d, conv3d, ln
    rec = Recording()
    with compress(model, rec, include=["conv3d", nn.ReLU]) as meter:
        model(x)
    assert [t.dim() for t in rec.seen] == [5]
    assert set(meter.by_route()) == {"cloning", "relu-mask", "kept"}
    assert {row.layer for row in meter.per_layer() if "cloning" in row.routes} == {"conv3d"}


def test_bad_arguments_name_the_argument():
    model = Fork()
    with pytest.raises(ValueError, match="codec"):
        compress(model, "no-such-codec")
    with pytest.raises(TypeError, match="model"):
        compress(lambda x: x, "exact")
    with pytest.raises(TypeError, match="codec"):
        compress(model, 3)
    with pytest.raises(TypeError, match="include"):
        compress(model, "exact", include=[3])
    with pytest.raises(TypeError, match="exclude"):
        compress(model, "exact", exclude=[int])
    with pytest.raises(ValueError, match="include"):
        compress(model, "exact", include=["nope"])
    with pytest.raises(TypeError, match="params"):
        compress(model, codecs.get("exact"), bits=2)


# --- the exact-but-cheap codecs -----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 3 * 4096 + 5])
def test_masks_round_trip(n, dtype, backend):
    x = torch.randn(n).to(dtype)
    x[:3] = torch.tensor([0.0, float("inf"), float("nan")], dtype=dtype)[:n]
    for lower, upper in [(0.0, None), (-0.5, 0.5)]:
        inside = x > lower if upper is None else (x > lower) & (x < upper)
        packed = kernels.pack_mask(x, lower, upper, backend=backend)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
        # Bit i of byte j is element 8 j + i.
        assert int(packed[0]) == sum(int(b) << i for i, b in enumerate(inside[:8].tolist()))
        for off, on in [(0.0, 1.0), (-1.0, 0.25)]:
            out = kernels.unpack_mask(packed, x.shape, dtype, off, on, backend=backend)
            assert out.dtype == dtype and out.shape == x.shape
            assert torch.equal(out, torch.where(inside, torch.tensor(on, dtype=dtype),
                                                torch.tensor(off, dtype=dtype)))


@pytest.mark.parametrize("dims,kernel,stride,padding,dilation,ceil_mode", [
    (1, 3, 2, 1, 1, False), (2, 3, 2, 1, 1, False), (2, (2, 3), (1, 2), (1, 0), 1, True),
    (2, 3, 2, 1, 2, True), (3, 2, 2, 0, 1, False),
])
def test_maxpool_indices_round_trip(dims, kernel, stride, padding, dilation, ceil_mode):
    pool = getattr(F, f"max_pool{dims}d")
    x = torch.randn((2, 3) + (11, 9, 7)[:dims])
    _, idx = pool(x, kernel, stride, padding, dilation, ceil_mode=ceil_mode, return_indices=True)
    codec = codecs.get("maxpool-indices", kernel_size=kernel, stride=stride, padding=padding,
                       dilation=dilation, input_size=x.shape[2:])
    packed = codec.encode(idx)
    assert packed.nbytes == idx.numel()
    assert torch.equal(codec.decode(packed), idx)


def test_cheap_codecs_keep_what_backward_reads():
    x = torch.tensor([-2.0, -0.5, 0.0, 0.3, 1.0, 6.0, 7.0])
    assert torch.equal(codecs.get("relu-mask").decode(codecs.get("relu-mask").encode(x)) > 0, x > 0)
    sign = codecs.get("sign-mask")
    assert torch.equal(sign.decode(sign.encode(x)) > 0, x > 0)
    ht = codecs.get("hardtanh-mask", min_val=0.0, max_val=6.0)
    y = ht.decode(ht.encode(x))
    assert torch.equal((y > 0) & (y < 6), (x > 0) & (x < 6))
    drop = codecs.get("dropout-mask")
    noise = torch.tensor([0.0, 2.5, 2.5, 0.0])
    assert torch.equal(drop.decode(drop.encode(noise)), noise)
    with pytest.raises(ValueError, match="x"):
        drop.encode(torch.tensor([0.0, 1.0, 2.0]))
    shape = codecs.get("shape-only")
    z = shape.decode(shape.encode(torch.randn(2, 3, 4)))
    assert z.shape == (2, 3, 4) and z.stride() == (0, 0, 0) and not z.any()
    with pytest.raises(ValueError, match="kernel_size"):
        codecs.get("maxpool-indices", kernel_size=17, stride=1, input_size=(32, 32))
    with pytest.raises(ValueError, match="max_val"):
        codecs.get("hardtanh-mask", min_val=1.0, max_val=1.0)
