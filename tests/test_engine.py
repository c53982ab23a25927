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
    with compress(model, "exact") as meter:
        model(x)
    assert 0 < meter.saved_bytes <= meter.exact_bytes


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
    n = 64  # the ReLU output's 4096 elements go to its mask, not kept (then b's input would be)
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
    # Whether the ReLU output's memory outlives the forward: kept by plain autograd and `exact`,
    # freed by a compressing codec (the storage is watched: `exact` may hold another tensor
    # object on the same storage).
    model = Fork()
    refs = []
    handle = model.relu.register_forward_hook(
        lambda m, i, out: refs.append(out.untyped_storage()._weak_ref()))
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    if codec is None:
        out = model(x)
    else:
        with compress(model, codec):
            out = model(x)
    handle.remove()
    assert torch.UntypedStorage._expired(refs[0]) == freed
    torch.UntypedStorage._free_weak_ref(refs[0])
    out.sum().backward()


class SavesOutputs(nn.Module):
    """Ops that save their outputs for backward (tanh, sigmoid, softmax, BatchNorm's statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        h = torch.tanh(self.bn(self.conv(x)))
        h = torch.sigmoid(h) * h
        return torch.softmax(self.fc(h.flatten(1)), dim=-1)


@pytest.mark.parametrize("codec", ["exact", "division"])
def test_a_forward_without_backward_leaves_nothing_behind(codec):
    # Saved outputs held as they are would reach their own grad_fn, a cycle through C++ that no
    # collector frees: a forward without backward (evaluation with grad on) then kept its whole
    # graph, every activation included, alive.
    torch.manual_seed(0)
    model = SavesOutputs()
    x = torch.randn(4, 3, 8, 8)
    probes = []  # the storage of each forward's output, which softmax saves as it is
    for _ in range(3):
        with compress(model, codec):
            out = model(x)
        probes.append(out.untyped_storage()._weak_ref())
        del out
    try:
        assert all(torch.UntypedStorage._expired(probe) for probe in probes)
    finally:
        for probe in probes:
            torch.UntypedStorage._free_weak_ref(probe)


def test_double_backward_through_kept_tensors_matches_plain_autograd():
    # A gradient penalty (create_graph=True) under `exact`: autograd rebuilds each unpacked
    # tensor's history from its own records, so what the codec holds needs none of its own.
    torch.manual_seed(0)
    model = SavesOutputs()
    x = torch.randn(4, 3, 8, 8, requires_grad=True)

    def penalty_grads(use_codec: bool):
        model.zero_grad(set_to_none=True)
        if use_codec:
            with compress(model, "exact"):
                out = model(x)
        else:
            out = model(x)
        (grad_x,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        grad_x.pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for plain, kept in zip(penalty_grads(False), penalty_grads(True)):
        assert torch.equal(plain, kept)


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


def test_a_storage_held_as_is_gets_no_copy_beside_it():
    # include=[Conv2d]: ReLU (left out) keeps its output as is, the next conv saves the same
    # storage: coding it as well held more than plain PyTorch (0.97x on ResNet-20) and made the
    # gradient lossy for nothing
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(4, 3, 16, 16)
    model(x).square().sum().backward()
    plain = model[3].weight.grad.clone()
    model.zero_grad()
    with compress(model, "division", block=4, bits=2, include=[nn.Conv2d]) as meter:
        out = model(x)
    out.square().sum().backward()
    assert torch.equal(model[3].weight.grad, plain)  # its input is held as is
    assert meter.saved_bytes <= meter.exact_bytes
    assert meter.by_route()["division"]["count"] == 1  # the batch, the first conv's input

    class Logged(nn.Module):  # a statistic taken with grad on: its graph (and save) freed at once
        def __init__(self):
            super().__init__()
            self.a, self.relu, self.b = model[0], nn.ReLU(), model[3]

        def forward(self, x):
            h = self.relu(self.a(x))
            self.mean = h.abs().mean().item()
            return self.b(h)

    logged = Logged()
    with compress(logged, "division", block=4, bits=2) as meter:
        logged(x)
    assert meter.by_route()["division"]["count"] == 2  # nothing holds h as is any more


class _TanhMatmul(nn.Module):
    """tanh(x @ w1) @ w2 in functional code: tanh saves its output (coded), then the plain
    matmul after it saves the same storage as it is (kept)."""

    def __init__(self, edit: bool = False):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(32, 128) / 6)
        self.w2 = nn.Parameter(torch.randn(128, 32) / 11)
        self.edit = edit

    def forward(self, x):
        h = torch.tanh(x @ self.w1)
        if self.edit:  # in place between the two saves: the coded form holds other values
            h.mul_(1.0)
        return h @ self.w2


def test_a_coded_storage_that_a_later_save_keeps_is_held_once_as_is():
    # the later save holds the storage whole: the coded copy made first was bytes beside it
    # (350,208 against plain PyTorch's 327,680 here), and a lossy gradient for nothing
    torch.manual_seed(0)
    model, x = _TanhMatmul(), torch.randn(8, 64, 32)
    model(x).square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with compress(model, "division") as meter:
        out = model(x)
    assert meter.saved_bytes == meter.exact_bytes == 8 * 64 * (32 + 128) * 4
    assert meter.by_route()["kept"]["saved_bytes"] == meter.saved_bytes
    out.square().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))


def test_a_coded_form_of_older_values_stays_coded():
    # an in-place edit between the saves: the coded form holds values the storage no longer has
    torch.manual_seed(0)
    model, x = _TanhMatmul(edit=True), torch.randn(8, 64, 32)
    with compress(model, "division") as meter:
        model(x)
    assert meter.saved_bytes > meter.exact_bytes  # the copy and the storage, as before
    assert meter.by_route()["division tile/chan"]["saved_bytes"] > 0


class _Probabilities(nn.Module):
    def forward(self, q, k, v):
        self.p = torch.softmax(q @ k.transpose(-1, -2), -1)  # coded in a token view
        return self.p @ v  # matmul saves p's (N * heads, T, T) view: the same coded form


class _Square(nn.Module):
    def forward(self, x):
        return x * x


class _KeptAfter(nn.Module):
    """`first`'s saves, then `keep` (left out of the block) saving one of them as it is."""

    def __init__(self, first: nn.Module, kept: str):
        super().__init__()
        self.first, self.keep, self.kept = first, _Square(), kept

    def forward(self, q, k, v):
        out = self.first(q, k, v)
        held = {"k": k, "p": getattr(self.first, "p", None)}[self.kept]
        return out.sum() + self.keep(held).mean()


def _qkv_grads(model, q, k, v, **kwargs):
    for t in (q, k, v):
        t.grad = None
    if kwargs:
        exclude = ["keep"] if hasattr(model, "keep") else None
        with compress(model, "division", exclude=exclude) as meter:
            out = model(q, k, v)
    else:
        out, meter = model(q, k, v), None
    out.sum().backward()
    return [t.grad.clone() for t in (q, k, v)], meter


def test_every_view_of_a_coded_form_is_held_as_is_when_a_later_save_keeps_it():
    # the softmax's (N, heads, T, T) form and matmul's (N * heads, T, T) view of it share the
    # coded data: only the first was turned into a view, so the second still held the coded copy
    # the meter no longer charged (13,824 B here) and v's gradient stayed lossy
    gen = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(2, 3, 64, 16, generator=gen).requires_grad_() for _ in range(3)]
    model = _KeptAfter(_Probabilities(), "p")
    plain, _ = _qkv_grads(model, q, k, v)
    got, meter = _qkv_grads(model, q, k, v, exclude=True)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert meter.saved_bytes == meter.exact_bytes


def test_an_sdpa_input_a_later_save_keeps_stays_packed_with_its_call():
    # SDPA's output and logsumexp are recomputed from the call's decoded q, k, v: k turned into
    # the exact view beside the logsumexp of its decode gave gradient errors of 265-372x plain's
    # norm here (the codec's own: 1.4-1.7)
    class Attend(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    gen = torch.Generator().manual_seed(0)
    q, k, v = [(torch.randn(2, 3, 48, 16, generator=gen) * 3).requires_grad_() for _ in range(3)]
    model = _KeptAfter(Attend(), "k")
    plain, _ = _qkv_grads(model, q, k, v)
    got, meter = _qkv_grads(model, q, k, v, exclude=True)
    err = float(sum(((a - b) ** 2).sum() for a, b in zip(got, plain)).sqrt()
                / sum((b ** 2).sum() for b in plain).sqrt())
    assert err < 2
    _, alone = _qkv_grads(model.first, q, k, v, exclude=True)
    coded = [m.by_route()["division feat/chan"]["saved_bytes"] for m in (meter, alone)]
    assert coded[0] == coded[1]  # q, k, v all charged: the call holds all three


def test_a_functional_relu_is_routed_as_the_module():
    # F.relu / torch.relu save their output as nn.ReLU does: a 1-bit mask, and the next layer's
    # input coded (kept as is, it was held beside its coded copy)
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Functional()
    with compress(model, "division", block=4, bits=2) as meter:
        model(torch.randn(4, 3, 16, 16)).sum().backward()
    routes = meter.by_route()
    assert routes["relu-mask"]["count"] == 1 and routes["division"]["count"] == 2
    assert "kept" not in routes


def test_bad_arguments_name_the_argument():
    model = Fork()
    with pytest.raises(ValueError, match=r"^codec: expected one of .*'division'.*, got "
                                         r"'no-such-codec'$") as err:
        compress(model, "no-such-codec")
    assert "relu-mask" not in str(err.value)  # the engine's own codecs are not offered
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
    with pytest.raises(ValueError, match=r"include: no module named 'Conv2d' in the model \(a "
                                         r"module type is passed as the class: torch.nn.Conv2d\)"):
        compress(model, "exact", include=["Conv2d"])
    with pytest.raises(ValueError, match="include: an empty list would compress nothing"):
        compress(model, "exact", include=[])
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


# --- the route table ----------------------------------------------------------------------------


class Twice(nn.Module):
    """One tensor saved twice through the same route: a Hardtanh and a MaxPool called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.ht = nn.Hardtanh(-0.5, 0.5)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        return self.ht(x) + self.ht(x) + self.pool(x).sum() + self.pool(x).sum()


def test_routes_are_built_once_so_a_tensor_saved_twice_is_packed_once():
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    model = Twice()
    with compress(model, "division") as meter:
        out = model(x)
    routes = meter.by_route()
    assert routes["hardtanh-mask"]["count"] == 2
    assert routes["hardtanh-mask"]["saved_bytes"] == x.numel() // 8  # one mask, not two
    # The two max-pools save distinct index tensors, each through the one route of that geometry.
    assert routes["maxpool-indices"]["count"] == 2
    assert routes["maxpool-indices"]["saved_bytes"] == 2 * x.numel() // 4
    out.sum().backward()


class SavedByTwoOps(nn.Module):
    """A functional RMSNorm: pow and mul both save its input x, one packed form for two saves."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_tensor_saved_by_two_ops_is_decoded_once_per_backward(monkeypatch):
    from freqact.engine.layouts import TokenLayout

    counts, outputs = {"encode": 0, "decode": 0}, []
    encode, decode = TokenLayout.encode, TokenLayout.decode

    def counted_encode(self, x, *args, **kwargs):
        counts["encode"] += 1
        return encode(self, x, *args, **kwargs)

    def counted_decode(self, packed):
        counts["decode"] += 1
        out = decode(self, packed)
        outputs.append(weakref.ref(out))
        return out

    monkeypatch.setattr(TokenLayout, "encode", counted_encode)
    monkeypatch.setattr(TokenLayout, "decode", counted_decode)
    x = torch.randn(2, 64, 64, requires_grad=True)
    with compress(SavedByTwoOps(), "division") as meter:
        loss = SavedByTwoOps()(x).square().sum()
    assert meter.by_route()["division tile/tok"]["count"] == 2 and counts["encode"] == 1
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    assert counts["decode"] == 1  # both saves unpack the one decode
    assert all(ref() is None for ref in outputs)  # not held once both have unpacked it
    second = torch.autograd.grad(loss, x)[0]  # a retained graph decodes again, the same values
    assert counts["decode"] == 2 and torch.equal(first, second)


def test_maxpool_routes_are_cached_per_input_size():
    from freqact.engine import routes

    pool = nn.MaxPool2d(2)
    site = routes.Site("pool", pool, routes.Kind.MAXPOOL, routes.Routes.for_codec(Cloning()))
    idx = torch.zeros(1, 1, 2, 2, dtype=torch.int64)

    def route(size):
        return routes.choose(site, routes.Saved(idx, "", torch.zeros(1, 1, *size), False))

    assert route((4, 4)) is route((4, 4)) and route((4, 4)).name == "maxpool-indices"
    assert route((6, 6)) is not route((4, 4))


def _rel_grad_error(model, x, codec="division"):
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with compress(model, codec):
        loss = model(x).square().sum()
    loss.backward()
    return _rel_error([p.grad for p in model.parameters()], exact)


@pytest.mark.parametrize("batch", [2, 8, 32])
def test_batchnorm1d_on_features_keeps_gradients(batch):
    # Per-sample maps over the features made this 1e3-1e4 at batch 2: backward divides by the
    # per-channel spread over the batch, which per-sample quantisation destroyed.
    for seed in range(3):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
        assert _rel_grad_error(model, torch.randn(batch, 16)) < 2


@pytest.mark.parametrize(("cls", "shape", "coded"), [
    (nn.BatchNorm1d, (2, 32), False), (nn.BatchNorm1d, (7, 32), False), (nn.BatchNorm1d, (8, 32), True),
    (nn.BatchNorm1d, (1, 8, 6), False), (nn.BatchNorm2d, (1, 8, 2, 3), False),
    (nn.BatchNorm2d, (2, 8, 2, 2), True)])
def test_batchnorm_over_few_values_per_channel_is_kept(cls, shape, coded):
    # Statistics over P < 8 values per channel (HF LeViT's 1-token stages: the (N * T, C) rows of
    # batch 2 are 2 values) keep the input: at P = 2 the exact input gradient is 0 and the coded
    # input's noise was all of it (LeViT: relative gradient errors up to 55; test_hf_models).
    bn = cls(shape[1])
    with compress(bn, "division") as meter:
        bn(torch.randn(shape)).sum().backward()
    (row,) = meter.per_layer()
    assert row.routes == (("division", "kept") if coded else ("kept",))


@pytest.mark.parametrize("codec", ["exact", "cloning"])
@pytest.mark.parametrize("shape", [(16, 16), (4, 48)])
def test_batchnorm1d_on_features_lossless_is_bitwise(codec, shape):
    # Under `exact` the (N, C) channels route held the tensor as is but unpacked it transposed:
    # wrong gradients when N == C, a shape error in backward otherwise.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(shape[1], shape[1]), nn.BatchNorm1d(shape[1]))
    x = torch.randn(shape)
    plain = _grads(model, x)
    _, got = _exact_run(model, x, Cloning() if codec == "cloning" else codec)
    _assert_bitwise(plain, got)


def _channels_last_net() -> nn.Module:
    """Every route that decodes a 4D tensor: codec, masks, max-pool indices, shape-only."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU6(), nn.LeakyReLU(0.1), nn.AvgPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    ).to(memory_format=torch.channels_last)


@pytest.mark.parametrize("codec", ["exact", "cloning"])
def test_channels_last_bitwise(codec):
    torch.manual_seed(0)
    model = _channels_last_net()
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    plain = _grads(model, x)
    meter, got = _exact_run(model, x, Cloning() if codec == "cloning" else codec)
    _assert_bitwise(plain, got)
    if codec == "cloning":  # the masks and shape-only ran, and decoded channels-last
        assert {"relu-mask", "hardtanh-mask", "sign-mask", "shape-only"} <= set(meter.by_route())


class Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.body = torch.jit.script(nn.Linear(4, 4))

    def forward(self, x):
        return self.body(self.head(x))


def test_failed_enter_names_the_cause_and_leaves_nothing_behind():
    model = Scripted()
    entering = compress(model, "division")
    with pytest.raises(RuntimeError, match=r"cannot hook module 'body' \(RecursiveScriptModule\)"):
        entering.__enter__()
    assert not model.head._forward_pre_hooks and not model.head._forward_hooks
    plain = nn.Linear(4, 4)
    with compress(plain, "division") as meter:  # no "cannot be nested" left over
        plain(torch.randn(2, 4, requires_grad=True))
    assert meter.saved_bytes > 0


@pytest.mark.parametrize("frozen", [False, True])
def test_autocast_weight_copies_are_not_counted(frozen):
    torch.manual_seed(0)
    n = 6
    model = TwoLinear(n)
    for p in model.parameters():
        p.requires_grad_(not frozen)
    x = torch.randn(n, n, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), compress(model, Cloning()) as meter:
        model(x)
    # Activations only, in bf16: a's input copy (its weight needs it; a frozen one needs only
    # the weight, which is not an activation) and the ReLU output b reads.
    expected = (n * n * 2) * (1 if frozen else 2)
    assert meter.exact_bytes == expected


@pytest.mark.parametrize("name", ["shape-only", "relu-mask", "sign-mask", "hardtanh-mask",
                                  "dropout-mask", "maxpool-indices"])
def test_cheap_codecs_are_refused_as_the_whole_model_codec(name):
    with pytest.raises(ValueError, match=r"^codec: expected a whole-model codec \(.*division.*"
                                         r"exact.*\), got '" + name):
        compress(Fork(), name)
    with pytest.raises(ValueError, match="codec: expected a whole-model codec"):
        compress(Fork(), codecs.get("sign-mask"))


class SaveIt(torch.autograd.Function):
    """Saves its first argument as it is and hands it to `seen` in backward."""

    @staticmethod
    def forward(ctx, t, w, seen):
        ctx.save_for_backward(t)
        ctx.seen = seen
        return w * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(ctx.saved_tensors[0])
        return None, grad * 2, None


class SavesItsInput(nn.Linear):
    """A Linear (the codec route) that saves its input through a custom op."""

    def forward(self, t, seen):
        return SaveIt.apply(t, self.weight, seen)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 4).relu().to_sparse(),
    lambda: torch.randn(4, 4).relu().to_sparse_csr(),
    lambda: torch.randn(4, 4).to(torch.float8_e4m3fn),
], ids=["coo", "csr", "float8"])
def test_sparse_nested_and_float8_tensors_are_kept_exactly(make):
    t = make()
    model = SavesItsInput(4, 4)
    seen: list = []
    with compress(model, "division") as meter:
        out = model(t, seen)
    out.sum().backward()
    # No codec reads these layouts/dtypes: kept, never approximated (held detached: same values).
    kept = seen[0]
    assert kept.layout == t.layout and kept.dtype == t.dtype
    dense = (lambda v: v.to_dense()) if t.layout != torch.strided else (lambda v: v)
    assert torch.equal(dense(kept).view(torch.uint8), dense(t).view(torch.uint8))
    assert meter.by_route() == {"kept": meter.by_route()["kept"]}
    assert torch.equal(model.weight.grad, torch.full((4, 4), 2.0))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_kept_exactly():
    nested = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    model = nn.Linear(4, 2)
    with compress(model, "division") as meter:
        out = model(nested)
    saved = out.grad_fn._saved_input  # (this torch cannot run a nested backward here)
    assert saved.is_nested and all(torch.equal(a, b) for a, b in zip(saved.unbind(), nested.unbind()))
    assert [(r.routes, r.saved_bytes, r.count) for r in meter.per_layer()] == [(("kept",), 0, 1)]


def test_zero_size_batch_is_kept():
    model = Zoo()
    with compress(model, "division") as meter:
        out = model(torch.zeros(0, 3, 16, 16))
    out.sum().backward()
    assert set(meter.by_route()) <= {"kept"} and meter.saved_bytes == 0


# --- the printed table --------------------------------------------------------------------------


def test_meter_table_reads_at_a_glance():
    from freqact.engine.meter import human_bytes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    with compress(model, "division") as meter:
        model(torch.randn(32, 64))
    text = str(meter)
    assert text == meter.table()
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "type", "route(s)", "held", "plain", "ratio"]
    rows = {line.split()[0]: line for line in lines[2:5]}
    assert rows["0"].split()[:3] == ["0", "Linear", "division"]
    # The ReLU row holds its mask and the next Linear's division copy of the same output.
    relu = meter.per_layer()[1]
    assert rows["1"].split()[:3] == ["1", "ReLU", "relu-mask"]
    assert f"{relu.ratio:.1f}x" in rows["1"] and human_bytes(relu.exact_bytes) in rows["1"]
    assert rows["2"].split()[-1] == "shared"
    total = next(line for line in lines if line.startswith("total"))
    assert total.split()[1:] == [*human_bytes(meter.saved_bytes).split(),
                                 *human_bytes(meter.exact_bytes).split(), f"{meter.ratio:.1f}x"]
    assert "first" in text  # the charging rule is stated under the table


def test_human_bytes_rounds():
    from freqact.engine.meter import human_bytes

    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 2**20 * 20.26, 2**30 * 1.5)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "20.3 MiB", "1.5 GiB"]


def test_rows_read_like_dicts():
    model = Fork()
    with compress(model, "division") as meter:
        model(torch.randn(2, 4, 8, 8, requires_grad=True))
    row = meter.per_layer()[0]
    assert {**row} == {"layer": "relu", "type": "ReLU", "saved_bytes": row.saved_bytes,
                       "exact_bytes": row.exact_bytes, "ratio": row.ratio, "count": 1}
