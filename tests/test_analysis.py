"""freqact.analysis: λ band norms, Theorem 3.1 errors and bounds, pooling vs DCT, the commands."""
from __future__ import annotations

import copy
import csv
import math
import os

import numpy as np
import pytest
import scipy.fft
import torch
import torch.nn.functional as F
from torch import nn

import freqact
from freqact import checkpoint, cli, dct, models
from freqact.analysis import common, lambdas, pooling, theorem31

# padding="same" with an even kernel makes PyTorch warn that it pads a copy; expected here
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


def _scipy_band_norms(x: np.ndarray, ratio: float, dims: int) -> tuple[np.ndarray, np.ndarray]:
    """Oracle: per-instance band norms from scipy's orthonormal DCT and a hand-built mask."""
    axes = tuple(range(x.ndim - dims, x.ndim))
    coeffs = scipy.fft.dctn(x, type=2, norm="ortho", axes=axes)
    mask = np.zeros(x.shape[x.ndim - dims :], dtype=bool)
    mask[tuple(slice(0, max(1, math.floor(ratio * n + 0.5))) for n in mask.shape)] = True
    summed = tuple(range(1, x.ndim))
    return (
        np.sqrt((coeffs**2 * mask).sum(axis=summed)),
        np.sqrt((coeffs**2 * ~mask).sum(axis=summed)),
    )


def _tiny_net(dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2),
        nn.ReLU(),
        nn.Conv2d(8, 6, 3, stride=2, dilation=2, padding=2, padding_mode="reflect"),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 5),
    )
    return net.to(dtype)


# ------------------------------------------------------------------------------------------- λ


@pytest.mark.parametrize("shape", [(4, 3, 16, 16), (3, 2, 9, 13), (5, 40), (2, 6, 20), (2, 2, 6, 5, 7)])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 1.0])
def test_instance_lambdas_match_scipy(shape, ratio):
    x = torch.randn(*shape, dtype=torch.float64)
    lam_l, lam_h = lambdas.instance_lambdas(x, ratio)
    ref_l, ref_h = _scipy_band_norms(x.numpy(), ratio, common.map_dims(x))
    np.testing.assert_allclose(lam_l.numpy(), ref_l, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lam_h.numpy(), ref_h, rtol=1e-10, atol=1e-12)
    # Parseval: the two bands share the instance's energy
    np.testing.assert_allclose((lam_l**2 + lam_h**2).numpy(), x.flatten(1).square().sum(1).numpy(), rtol=1e-10)


def test_constant_map_has_no_high_band_and_checkerboard_no_low_band():
    n = 32
    constant = torch.full((2, 3, n, n), 1.5)
    lam_l, lam_h = lambdas.instance_lambdas(constant, 0.1)
    assert torch.all(lam_h < 1e-5 * lam_l)
    torch.testing.assert_close(lam_l, constant[0].norm().double().expand(2))
    i = torch.arange(n)
    board = ((-1.0) ** (i[:, None] + i[None, :])).expand(2, 3, n, n)
    lam_l, lam_h = lambdas.instance_lambdas(board, 0.1)
    assert torch.all(lam_l < 0.01 * lam_h)


def test_measure_convs_reads_each_conv_input_and_leaves_model_untouched():
    net = _tiny_net().train()
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    rows = lambdas.measure(net, x, ratio=0.25, layers="convs")
    assert net.training and all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
    with torch.no_grad():  # the conv/linear inputs, computed by hand in eval mode
        net.eval()
        h1 = net[2](net[1](net[0](x)))
        h3 = net[4](net[3](h1))
        expected = {"0": x, "3": h1, "5": h3, "7": net[6](net[5](h3))}
    assert [r["layer"] for r in rows] == [name for name in expected for _ in range(3)]
    for name, h in expected.items():
        ref_l, ref_h = _scipy_band_norms(h.numpy(), 0.25, common.map_dims(h))
        got = [r for r in rows if r["layer"] == name]
        np.testing.assert_allclose([r["lam_L"] for r in got], ref_l, rtol=1e-9)
        np.testing.assert_allclose([r["lam_H"] for r in got], ref_h, rtol=1e-9)


def test_measure_blocks_on_resnet_and_summary():
    net = models.get("resnet20", width=4)
    rows = lambdas.measure(net, torch.randn(2, 3, 32, 32), layers="blocks")
    blocks = [name for name, m in net.named_modules() if isinstance(m, models.BLOCK_TYPES)]
    assert len(blocks) == 9 and [r["layer"] for r in rows] == [b for b in blocks for _ in range(2)]
    summary = lambdas.summarize(rows)
    assert [s["layer"] for s in summary] == blocks + ["(all)"]
    share = sum(r["lam_L"] > r["lam_H"] for r in rows) / len(rows)
    assert summary[-1]["share_L_gt_H"] == pytest.approx(share) and summary[-1]["instances"] == 18
    first = [r for r in rows if r["layer"] == blocks[0]]
    assert summary[0]["median_lam_L"] == pytest.approx(float(np.median([r["lam_L"] for r in first])))


def test_layer_selection_errors():
    with pytest.raises(ValueError, match=r"no 'blocks' layers .*--layers convs"):
        common.select_layers(_tiny_net(), "blocks")  # a plain Sequential has no residual blocks
    with pytest.raises(ValueError, match="layers"):
        common.select_layers(_tiny_net(), "everything")
    with pytest.raises(ValueError, match="ratio"):
        lambdas.measure(_tiny_net(), torch.randn(1, 3, 16, 16, dtype=torch.float64), ratio=0.0, layers="convs")


# ---------------------------------------------------------------------------------- Theorem 3.1

CONVS = [
    dict(dim=2, k=3, stride=1, padding=1, dilation=1, groups=1, mode="zeros"),
    dict(dim=2, k=3, stride=2, padding=1, dilation=1, groups=2, mode="zeros"),
    dict(dim=2, k=5, stride=2, padding=4, dilation=2, groups=1, mode="zeros"),  # 5 taps share a parity
    dict(dim=2, k=4, stride=3, padding=0, dilation=1, groups=4, mode="zeros"),
    dict(dim=2, k=3, stride=1, padding="same", dilation=2, groups=1, mode="zeros"),
    dict(dim=2, k=4, stride=1, padding="same", dilation=1, groups=1, mode="zeros"),  # asymmetric
    dict(dim=2, k=3, stride=1, padding=2, dilation=1, groups=1, mode="reflect"),
    dict(dim=2, k=3, stride=2, padding=3, dilation=1, groups=1, mode="replicate"),
    dict(dim=2, k=3, stride=1, padding=1, dilation=1, groups=1, mode="circular"),
    dict(dim=1, k=7, stride=3, padding=3, dilation=1, groups=1, mode="zeros"),
    dict(dim=3, k=3, stride=2, padding=1, dilation=1, groups=1, mode="zeros"),
    dict(dim=2, k=1, stride=1, padding=0, dilation=1, groups=1, mode="zeros"),
]


def _conv(cfg, cin=4, cout=8, groups=None) -> nn.Module:
    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[cfg["dim"]]
    return cls(cin, cout, cfg["k"], stride=cfg["stride"], padding=cfg["padding"], dilation=cfg["dilation"],
               groups=cfg["groups"] if groups is None else groups, padding_mode=cfg["mode"], bias=False).double()


def _spatial(cfg) -> tuple[int, ...]:
    return {1: (23,), 2: (11, 9), 3: (6, 7, 5)}[cfg["dim"]]


@pytest.mark.parametrize("cfg", CONVS, ids=lambda c: "-".join(map(str, c.values())))
def test_kernel_factor_is_the_largest_read_count(cfg):
    conv = _conv(cfg, cin=1, cout=1, groups=1)  # groups do not change which elements a tap reads
    nn.init.ones_(conv.weight)
    x = torch.ones(1, 1, *_spatial(cfg), dtype=torch.float64, requires_grad=True)
    # d(sum of an all-ones conv)/dx counts, per input element, the (tap, position) pairs reading it
    (reads,) = torch.autograd.grad(conv(x).sum(), x)
    assert theorem31.kernel_factor(conv, x.shape) ** 2 == pytest.approx(float(reads.max()))
    if cfg["mode"] == "zeros":
        per_dim = math.ceil(cfg["k"] / (cfg["stride"] // math.gcd(cfg["stride"], cfg["dilation"])))
        assert float(reads.max()) <= per_dim ** cfg["dim"]


@pytest.mark.parametrize("cfg", CONVS, ids=lambda c: "-".join(map(str, c.values())))
def test_weight_grad_is_autograd_and_the_bound_holds_on_random_inputs(cfg):
    conv = _conv(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, *_spatial(cfg), dtype=torch.float64, generator=gen)
    y = conv(x)
    c = theorem31.kernel_factor(conv, x.shape)
    for trial in range(6):
        gy = torch.randn(y.shape, dtype=torch.float64, generator=gen)
        if trial % 2:  # sparse, heavy-tailed gradients and inputs probe the corners of the bound
            gy = gy * (torch.rand(y.shape, generator=gen) < 0.1).double()
        z = torch.randn(x.shape, dtype=torch.float64, generator=gen) ** 3
        (ref,) = torch.autograd.grad(conv(z), conv.weight, gy)
        got = theorem31.weight_grad(conv, z, gy)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        assert float(got.norm()) <= c * float(gy.norm()) * float(z.norm()) * (1 + 1e-12)


def test_bound_is_attained_by_constant_maps_with_circular_padding():
    # every element is read k*k times and every Cauchy-Schwarz step is an equality
    conv = nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular", bias=False).double()
    z = torch.full((2, 2, 8, 8), 0.7, dtype=torch.float64)
    gy = torch.full((2, 3, 8, 8), -1.3, dtype=torch.float64)
    c = theorem31.kernel_factor(conv, z.shape)
    assert c == 3.0
    bound = c * float(gy.norm()) * float(z.norm())
    assert float(theorem31.weight_grad(conv, z, gy).norm()) == pytest.approx(bound, rel=1e-12)


def test_linear_weight_grad_and_unit_factor():
    lin = nn.Linear(7, 4).double()
    z, gy = torch.randn(3, 5, 7, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    (ref,) = torch.autograd.grad(lin(z), lin.weight, gy)
    torch.testing.assert_close(theorem31.weight_grad(lin, z, gy), ref)
    assert theorem31.kernel_factor(lin, z.shape) == 1.0
    with pytest.raises(TypeError, match="module"):
        theorem31.kernel_factor(nn.ReLU(), z.shape)


def _replace_cached_input(net, layer, keep):
    """A forward hook giving the same output while the layer's weight gradient reads one band."""
    module = dict(net.named_modules())[layer]
    twin = copy.deepcopy(module)  # same hyper-parameters, calling it does not re-enter the hook
    twin.weight, twin.bias = module.weight, None
    dims = 1 if isinstance(module, nn.Linear) else 2

    def hook(mod, inputs, output):
        part = dct.split(inputs[0].detach(), 0.25, dims=dims)[0 if keep == "low" else 1]
        for_weight = twin(part)  # d/dW from the band only
        for_input = torch.func.functional_call(twin, {"weight": module.weight.detach()}, (inputs[0],))
        # the value stays the exact output; d/dx stays exact (it reads W, not the cached input)
        return output.detach() + (for_weight - for_weight.detach()) + (for_input - for_input.detach())

    return module.register_forward_hook(hook)


def test_measure_errors_match_an_independent_autograd_computation():
    net = _tiny_net()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    y = torch.randint(0, 5, (4,))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    rows = theorem31.measure(net, x, y, ratio=0.25, end_to_end=False)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())  # BN stats restored
    # conv layers only: the classifier Linear ("7") is outside the conv theorem
    assert [r["layer"] for r in rows] == ["0", "3", "5"]

    def weight_grads(layer=None, keep=None):
        handle = _replace_cached_input(net, layer, keep) if layer else None
        with common.scratch_state(net, train=True):  # BN saves its running stats: backward inside
            loss = F.cross_entropy(net(x), y)
            grads = torch.autograd.grad(loss, [net[i].weight for i in (0, 3, 5, 7)])
        if handle:
            handle.remove()
        return dict(zip(["0", "3", "5", "7"], grads))

    exact = weight_grads()
    for row in rows:
        err_l = float((weight_grads(row["layer"], "low")[row["layer"]] - exact[row["layer"]]).norm())
        err_h = float((weight_grads(row["layer"], "high")[row["layer"]] - exact[row["layer"]]).norm())
        assert row["err_L"] == pytest.approx(err_l, rel=1e-9)
        assert row["err_H"] == pytest.approx(err_h, rel=1e-9)
        assert row["bound_holds"] and row["err_L"] <= row["GEB_L"] and row["err_H"] <= row["GEB_H"]
        assert row["err_L_lt_err_H"] == (row["err_L"] < row["err_H"])
        assert row["tightness_L"] == pytest.approx(row["err_L"] / row["GEB_L"], rel=1e-12)
        assert 0 < row["tightness_H"] <= 1
    summary = theorem31.summarize(rows)
    assert summary["layers"] == 3 and summary["bound_holds"] == 3 == summary["bound_H_holds"]
    assert summary["max_tightness_L"] == max(r["tightness_L"] for r in rows)
    assert summary["err_L_lt_err_H"] == sum(r["err_L"] < r["err_H"] for r in rows)


@pytest.mark.parametrize("seed", range(5))
def test_bound_never_violated_on_random_networks(seed):
    torch.manual_seed(seed)
    stride, groups = 1 + seed % 3, (1, 2, 4)[seed % 3]
    net = nn.Sequential(
        nn.Conv2d(4, 8, 2 + seed % 3, stride=stride, padding=seed % 2, dilation=1 + seed % 2, groups=groups),
        nn.Tanh(),
        nn.Conv2d(8, 8, 3, padding=1, padding_mode=("zeros", "reflect", "circular")[seed % 3]),
        nn.AdaptiveAvgPool2d(3),
        nn.Flatten(),
        nn.Linear(72, 3),
    ).double()
    x = torch.randn(3, 4, 12, 12, dtype=torch.float64) * torch.rand(3, 4, 1, 1, dtype=torch.float64)
    rule = ("nearest", "official")[seed % 2]
    rows = theorem31.measure(net, x, torch.randint(0, 3, (3,)), ratio=0.1 + 0.2 * seed, rule=rule, end_to_end=False)
    assert len(rows) == 2 and all(r["kind"] == "Conv2d" for r in rows)
    # float64: no slack needed, err <= GEB for each band, and tightness is a fraction
    assert all(r["err_L"] <= r["GEB_L"] and r["err_H"] <= r["GEB_H"] for r in rows)
    assert all(0 <= r[f"tightness_{b}"] <= 1 for r in rows for b in "LH" if r[f"tightness_{b}"] is not None)


def test_bound_is_attained_and_tightness_is_one():
    # A 1x1 conv on one channel (c = 1): G(z) = <∇y, z>. With ∇y parallel to x_H the
    # Cauchy-Schwarz step is an equality, so err^L = ‖G(x_H)‖ = ‖∇y‖ λ^H = GEB^L.
    conv = nn.Conv2d(1, 1, 1, bias=False).double()
    net = nn.Sequential(conv)
    x = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    # loss = <conv(x), v> with v = x_H / w gives ∇y = v.
    high = dct.split(x, 0.25)[1]
    w = float(conv.weight.detach())
    rows = theorem31.measure(net, x, high / w, ratio=0.25, end_to_end=False,
                             loss_fn=lambda out, v: (out * v).sum())
    assert rows[0]["tightness_L"] == pytest.approx(1.0, rel=1e-9)


def test_end_to_end_keep_everything_is_exact():
    net = _tiny_net(torch.float32)
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 5, (2,))
    rows = theorem31.measure(net, x, y, ratio=1.0)
    for row in rows:
        assert row["lam_H"] <= 1e-5 * row["lam_L"] and row["bound_holds"]
        assert row["e2e_err_L"] <= 1e-4 * row["e2e_err_H"]  # LFC with W = N keeps every activation
        # the high band is empty: exactly no energy, no error, no bound, so no tightness (not noise/noise)
        assert row["lam_H"] == row["err_L"] == row["GEB_L"] == 0 and row["tightness_L"] is None
    assert theorem31.summarize(rows)["median_tightness_L"] is None


def test_gradient_fidelity_is_a_cosine_with_the_exact_gradient():
    net = _tiny_net(torch.float32)
    x, y = torch.randn(3, 3, 16, 16), torch.randint(0, 5, (3,))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    full = theorem31.gradient_fidelity(net, x, y, ratio=1.0)
    # W = N keeps every coefficient: LFC-ACT's gradient is the exact one up to float32 rounding
    assert full["cos_L"] == pytest.approx(1.0, abs=1e-6) and full["rel_err_L"] <= 1e-4
    low = theorem31.gradient_fidelity(net, x, y, ratio=0.25, rule="official")
    for band in "LH":
        assert -1.0 <= low[f"cos_{band}"] <= 1.0 and low[f"rel_err_{band}"] > 0
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())


def test_gradient_fidelity_agrees_with_an_independent_computation():
    net = _tiny_net(torch.float64)
    x, y = torch.randn(2, 3, 16, 16, dtype=torch.float64), torch.randint(0, 5, (2,))
    params = list(net.parameters())
    with common.scratch_state(net, train=True):
        g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(F.cross_entropy(net(x), y), params)])
        with freqact.compress(net, "hfc", ratio=0.5):
            loss = F.cross_entropy(net(x), y)
        a = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
    got = theorem31.gradient_fidelity(net, x, y, ratio=0.5)
    assert got["cos_H"] == pytest.approx(float(a @ g / (a.norm() * g.norm())), rel=1e-9)
    assert got["rel_err_H"] == pytest.approx(float((a - g).norm() / g.norm()), rel=1e-9)
    assert got["grad_norm"] == pytest.approx(float(g.norm()), rel=1e-12)


def test_measure_refuses_shared_layers():
    conv = nn.Conv2d(2, 2, 3, padding=1)
    net = nn.Sequential(conv, nn.ReLU(), conv, nn.Flatten(), nn.LazyLinear(2))
    net(torch.randn(1, 2, 6, 6))
    with pytest.raises(ValueError, match="more than once"):
        theorem31.measure(net, torch.randn(2, 2, 6, 6), torch.tensor([0, 1]), end_to_end=False)


# -------------------------------------------------------------------------------------- pooling


@pytest.mark.parametrize("shape,dims", [((2, 3, 13, 7), 2), ((2, 30), 1), ((1, 2, 9, 5, 6), 3)])
@pytest.mark.parametrize("block", [1, 2, 4, 8, 16])
def test_block_means_match_a_loop(shape, dims, block):
    x = torch.randn(*shape, dtype=torch.float64)
    means = pooling.block_means(x, block, dims)
    lfc = pooling.block_mean_lfc(x, block, dims)
    assert lfc.shape == x.shape
    sizes = shape[len(shape) - dims :]
    starts = [range(0, s, min(block, s)) for s in sizes]
    for idx in np.ndindex(*means.shape[len(shape) - dims :]):
        window = tuple(slice(st[i], st[i] + min(block, s)) for st, i, s in zip(starts, idx, sizes))
        ref = x[(..., *window)].reshape(*shape[: len(shape) - dims], -1).mean(-1)
        torch.testing.assert_close(means[(..., *idx)], ref)
        assert torch.all(lfc[(..., *window)] == means[(..., *idx)][(...,) + (None,) * dims])


def test_block_mean_is_the_block_dct_dc_over_b():
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    means = pooling.block_means(x, 8, 2)
    block = x[..., 8:16, 16:24].numpy()
    dc = scipy.fft.dctn(block, type=2, norm="ortho", axes=(-2, -1))[..., 0, 0]
    np.testing.assert_allclose(means[..., 1, 2].numpy(), dc / 8, rtol=1e-12)
    for size, block_size in ((32, 8), (13, 4), (5, 16)):
        row = pooling.compare(torch.randn(2, 3, size, size + 1), block_size)
        assert row["dc_identity_err"] < 1e-12


def test_compare_properties():
    # B covering the whole map: both estimators are the global mean
    x = torch.randn(3, 2, 8, 8)
    row = pooling.compare(x, 16)
    assert row["rel_dist"] < 1e-12 and row["window"] == "1x1" and row["map"] == "8x8"
    # a map constant on 4x4 blocks is all LFC for the pooling estimator
    piecewise = torch.randn(2, 2, 4, 4).repeat_interleave(4, -1).repeat_interleave(4, -2)
    assert pooling.compare(piecewise, 4)["energy_pool"] == pytest.approx(1.0)
    # a smooth cosine inside the DCT window is all LFC for the DCT estimator
    n = torch.arange(32, dtype=torch.float64)
    wave = torch.cos(math.pi * (2 * n + 1) * 2 / 64)[None, None, :, None].expand(1, 1, 32, 32)
    row = pooling.compare(wave, 8)
    assert row["energy_dct"] == pytest.approx(1.0) and 0 < row["energy_pool"] < 1


@pytest.mark.parametrize("size,block,kept", [(20, 8, 3), (12, 8, 2), (4, 8, 1), (36, 8, 5)])
def test_compare_window_rounds_size_over_block_half_up(size, block, kept):
    # 20/8 = 2.5 -> 3 (Python's round would give 2), 36/8 = 4.5 -> 5 (round: 4)
    row = pooling.compare(torch.randn(1, 2, size, size, dtype=torch.float64), block)
    assert row["window"] == f"{kept}x{kept}"  # the parametrised values, worked out by hand


def test_pooling_measure_rows():
    net = models.get("resnet20", width=4)
    rows = pooling.measure(net, torch.randn(2, 3, 32, 32), blocks=(4, 8))
    assert rows[0]["layer"] == "input" and len(rows) == 2 * (1 + 9)
    assert all(r["dc_identity_err"] < 1e-9 and 0 <= r["energy_pool"] <= 1 + 1e-9 for r in rows)


# ------------------------------------------------------------------------------ checkpoints, CLI


@pytest.fixture
def tiny_run(tmp_path):
    """A run directory with two resnet20 checkpoints of a synthetic-data run."""
    torch.manual_seed(0)
    net = models.get("resnet20")
    config = {"model": "resnet20", "num_classes": 10, "dataset": "synthetic", "data_dir": None, "seed": 0,
              "subset": 32}
    for epoch in (1, 2):
        checkpoint.save(tmp_path / "run" / "ckpt" / f"epoch-{epoch:04d}.pt",
                        {"format": checkpoint.FORMAT, "epoch": epoch, "config": config, "model": net.state_dict()})
    return tmp_path / "run"


def test_analyses_refuse_a_missing_device_and_a_text_model_with_their_reason(tiny_run, tmp_path,
                                                                          capsys):
    ckpt = str(tiny_run / "ckpt" / "epoch-0001.pt")
    if not torch.cuda.is_available():  # torch's own assertion was a traceback
        for command in (["lambdas", ckpt], ["pooling", ckpt], ["theorem31", ckpt]):
            assert cli.main([*command, "--device", "cuda"]) == 2
            assert "device: expected 'cpu' on this machine" in capsys.readouterr().err
    config = {"model": "gpt", "num_classes": 256, "dataset": "stdlib-text", "data_dir": None,
              "seed": 0, "subset": 32}
    text = tmp_path / "text" / "ckpt" / "epoch-0001.pt"
    checkpoint.save(text, {"format": checkpoint.FORMAT, "epoch": 1, "config": config,
                           "model": models.get("gpt", num_classes=256).state_dict()})
    assert cli.main(["lambdas", str(text), "--images", "2"]) == 2
    assert "the analyses read the activation maps of image models" in capsys.readouterr().err


def test_resolve_checkpoints(tiny_run):
    found = common.resolve_checkpoints([tiny_run])
    assert [p.name for p in found] == ["epoch-0001.pt", "epoch-0002.pt"]
    assert common.default_out_dir(found[0]) == tiny_run.resolve() / "analysis"
    with pytest.raises(FileNotFoundError):
        common.resolve_checkpoints([tiny_run / "nope.pt"])
    # a checkpoint named twice (inside its run, or by another spelling) counts once, first place
    again = common.resolve_checkpoints([tiny_run / "ckpt" / "epoch-0002.pt", tiny_run,
                                        tiny_run / "ckpt" / ".." / "ckpt" / "epoch-0002.pt"])
    assert [p.name for p in again] == ["epoch-0002.pt", "epoch-0001.pt"]
    assert again[0] == tiny_run / "ckpt" / "epoch-0002.pt"


@pytest.mark.slow
def test_cli_commands_end_to_end(tiny_run, tmp_path, capsys):
    assert cli.main(["lambdas", str(tiny_run), "--images", "3"]) == 0
    with open(tiny_run / "analysis" / "lambdas.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 2 * 9 * 3 and {r["epoch"] for r in table} == {"1", "2"}
    ckpt = str(tiny_run / "ckpt" / "epoch-0002.pt")
    assert cli.main(["theorem31", ckpt, "--images", "2", "--window-rule", "official",
                     "--out", str(tmp_path / "t31")]) == 0
    printed = capsys.readouterr().out
    assert "err <= GEB held in 21/21 conv layers" in printed and "gradient cosine with exact" in printed
    with open(tmp_path / "t31" / "theorem31_fidelity.csv") as f:
        fidelity = list(csv.DictReader(f))
    assert len(fidelity) == 1 and -1 <= float(fidelity[0]["cos_L"]) <= 1
    assert cli.main(["pooling", ckpt, "--images", "2", "--blocks", "4", "8", "--out", str(tmp_path / "p")]) == 0
    for path in (tiny_run / "analysis" / "lambdas.pdf", tmp_path / "t31" / "theorem31.csv",
                 tmp_path / "p" / "pooling.png"):
        assert path.stat().st_size > 0
    assert cli.main(["lambdas", str(tmp_path / "missing")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_eval_batch_real_cifar(cifar_dir):
    net = models.get("resnet20", width=4)
    config = {"dataset": "cifar10", "data_dir": str(cifar_dir.parent), "seed": 0}
    x, y = common.eval_batch(net, config, 16)
    x2, _ = common.eval_batch(net, config, 8)
    assert x.shape == (16, 3, 32, 32) and y.shape == (16,) and torch.equal(x[:8], x2)
    assert abs(float(x.mean())) < 0.5  # normalised


def test_pipeline_reuses_a_table_only_when_its_settings_match(tiny_run, tmp_path):
    from freqact.analysis import pipelines

    ckpt = tiny_run / "ckpt" / "epoch-0002.pt"
    out = tmp_path / "out"
    first = pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=2, reuse=True)
    assert not first.reused and (out / "pooling.settings.json").is_file()
    again = pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=2, reuse=True)
    assert again.reused and again.rows == first.rows  # CSV cells come back as the numbers written
    assert not pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=3, reuse=True).reused
    assert not pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=3).reused  # reuse is opt-in
    os.utime(ckpt, ns=(0, 0))  # a rewritten checkpoint is measured again
    assert not pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=3, reuse=True).reused


@pytest.mark.parametrize("sidecar", ["[" * 100_000 + "]" * 100_000, " " * (2 << 20) + "{}", "{"])
def test_a_damaged_sidecar_means_measure_again(tiny_run, tmp_path, sidecar):
    # the settings sidecar was read whole and parsed unbounded: a deeply nested one escaped as
    # a RecursionError, a huge one was read whole; now the table is measured again
    from freqact.analysis import pipelines

    ckpt = tiny_run / "ckpt" / "epoch-0002.pt"
    out = tmp_path / "out"
    pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=2)
    (out / "pooling.settings.json").write_text(sidecar)
    again = pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=2, reuse=True)
    assert not again.reused
    assert pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=2, reuse=True).reused


@pytest.mark.parametrize("fail_at", ["table", "sidecar"])
def test_a_crash_between_table_and_sidecar_never_leaves_a_sidecar_vouching_for_another_table(
        tiny_run, tmp_path, monkeypatch, fail_at):
    from freqact.analysis import pipelines

    ckpt = tiny_run / "ckpt" / "epoch-0002.pt"
    out = tmp_path / "out"
    pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=2)  # table and sidecar for images=2
    real_write_csv, real_atomic_write = common.write_csv, checkpoint.atomic_write

    def write_csv(rows, path):
        if fail_at == "table":
            raise OSError("disk full (injected)")
        return real_write_csv(rows, path)

    def atomic_write(path, data):
        if str(path).endswith(".settings.json"):
            raise OSError("killed (injected)")
        return real_atomic_write(path, data)

    monkeypatch.setattr(common, "write_csv", write_csv)
    monkeypatch.setattr(checkpoint, "atomic_write", atomic_write)
    with pytest.raises(OSError, match="injected"):
        pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=3)
    monkeypatch.undo()
    assert not (out / "pooling.settings.json").exists()
    # the folder's table (images=2 or 3) is never reused as the images=2 one: it is measured again
    assert not pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=2, reuse=True).reused
    assert pipelines.pooling_analysis(ckpt, out, blocks=(4,), images=2, reuse=True).reused
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


@pytest.mark.parametrize("drop,key", [("config.dataset", "dataset"), ("epoch", "epoch")])
@pytest.mark.parametrize("command", ["lambdas", "theorem31", "pooling"])
def test_a_checkpoint_lacking_what_the_analyses_read_is_refused_in_one_line(tiny_run, tmp_path, capsys,
                                                                            drop, key, command):
    ckpt = checkpoint.load(tiny_run / "ckpt" / "epoch-0001.pt")
    if drop == "epoch":
        del ckpt["epoch"]
    else:
        del ckpt["config"]["dataset"]
    path = tmp_path / "bad" / "ckpt" / "epoch-0001.pt"
    checkpoint.save(path, ckpt)
    assert cli.main([command, str(path), "--images", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and f"lacks {key!r}" in err


def test_a_checkpoint_lacking_several_keys_is_refused_once_before_its_model_is_built(tiny_run, tmp_path,
                                                                                     monkeypatch):
    ckpt = checkpoint.load(tiny_run / "ckpt" / "epoch-0001.pt")
    del ckpt["epoch"], ckpt["config"]["dataset"]
    path = tmp_path / "bad.pt"
    checkpoint.save(path, ckpt)
    monkeypatch.setattr(models, "get", lambda *a, **k: pytest.fail("built a model"))
    with pytest.raises(ValueError, match=r"bad\.pt: lacks 'epoch' and its config lacks 'dataset', 'mode',"):
        common.load_checkpoint(path, config_keys=("dataset", "mode"))


def _other_model_run(root, name="mobilenet_v2", dataset="synthetic"):
    """A run directory with one checkpoint of another model (or dataset) than `tiny_run`'s."""
    config = {"model": name, "num_classes": 10, "dataset": dataset, "data_dir": None, "seed": 0,
              "subset": 32}
    path = root / "ckpt" / "epoch-0001.pt"
    checkpoint.save(path, {"format": checkpoint.FORMAT, "epoch": 1, "config": config,
                           "model": models.get(name).state_dict()})
    return root


@pytest.mark.parametrize("command", ["lambdas", "theorem31"])
@pytest.mark.parametrize("other", [("mobilenet_v2", "synthetic"), ("resnet20", "digits")])
def test_analyses_refuse_runs_of_different_models_or_datasets_in_one_table(tiny_run, tmp_path, capsys,
                                                                           command, other):
    if other[1] == "digits":
        pytest.importorskip("sklearn")
    mixed = _other_model_run(tmp_path / "other", *other)
    assert cli.main([command, str(tiny_run), str(mixed), "--images", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected runs of one model on one dataset" in err
    assert f"{other[0]} on {other[1]!r}" in err and str(mixed) in err
    assert not (tmp_path / "o" / f"{command}.csv").exists()


def test_each_checkpoint_after_the_first_is_compared_with_the_first_once(tiny_run, monkeypatch):
    compared = []
    monkeypatch.setattr(common, "check_one_model", lambda first, other: compared.append((first[0], other[0])))
    paths = [path for path, _, _ in common.load_checkpoints([tiny_run])]
    assert len(paths) == 2 and compared == [(paths[0], paths[1])]


def test_rows_name_their_run_so_two_runs_stay_apart(tiny_run, tmp_path):
    twin = tmp_path / "twin"
    for path in common.resolve_checkpoints([tiny_run]):
        (twin / "ckpt").mkdir(parents=True, exist_ok=True)
        (twin / "ckpt" / path.name).write_bytes(path.read_bytes())
    rows = lambdas.from_checkpoints([tiny_run / "ckpt" / "epoch-0001.pt", twin / "ckpt" / "epoch-0001.pt"],
                                    images=1)
    assert {r["run"] for r in rows} == {str(tiny_run), str(twin)}
    assert {(r["run"], r["epoch"]) for r in rows} == {(str(tiny_run), 1), (str(twin), 1)}
    assert common.run_of(tiny_run / "ckpt" / "last.pt") == tiny_run
    assert common.run_of(tmp_path / "loose.pt") == tmp_path


def test_a_second_writer_into_an_analysis_folder_is_refused(tiny_run, tmp_path, capsys):
    import subprocess
    import sys

    out = tmp_path / "o"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom freqact import rundir\n"
         f"with rundir.output_lock({str(out)!r}):\n    print('held', flush=True)\n    sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        for command in (["lambdas", str(tiny_run)], ["pooling", str(tiny_run / "ckpt" / "epoch-0001.pt")]):
            assert cli.main([*command, "--images", "1", "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{out} is in use by another freqact process" in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written
    finally:
        holder.communicate("")
    assert cli.main(["pooling", str(tiny_run / "ckpt" / "epoch-0001.pt"), "--images", "1", "--blocks", "4",
                     "--out", str(out)]) == 0


def test_swin_block_outputs_are_read_as_spatial_maps_over_h_and_w():
    """Swin's blocks output channels-last (N, H, W, C) grids: λ is the DCT over (H, W), as scipy's
    dctn over axes (1, 2) of the raw output gives it, and pooling names the map H x W."""
    torch.manual_seed(0)
    net = models.get("swin").double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    raw = {}
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: raw.setdefault(name, o.detach()))
             for name, m, _ in common.select_layers(net, "blocks")]
    with torch.no_grad():
        net.eval()(x)
    for hook in hooks:
        hook.remove()
    rows = lambdas.measure(net, x, ratio=0.25)
    for name, h in raw.items():
        n, height, width, _ = h.shape
        coeffs = scipy.fft.dctn(h.numpy(), type=2, norm="ortho", axes=(1, 2))
        mask = np.zeros((height, width, 1), dtype=bool)
        mask[: max(1, math.floor(0.25 * height + 0.5)), : max(1, math.floor(0.25 * width + 0.5))] = True
        mine = [r for r in rows if r["layer"] == name]
        np.testing.assert_allclose([r["lam_L"] for r in mine], np.sqrt((coeffs**2 * mask).sum(axis=(1, 2, 3))),
                                   rtol=1e-9)
        np.testing.assert_allclose([r["lam_H"] for r in mine], np.sqrt((coeffs**2 * ~mask).sum(axis=(1, 2, 3))),
                                   rtol=1e-9)
    maps = {r["layer"]: r["map"] for r in pooling.measure(net, x, blocks=(4,))}
    assert {maps[name] for name in raw} <= {f"{s}x{s}" for s in (16, 8, 4, 2, 1)}


_TOKENS_REFUSED = r"layers: the (output|input) of '.*' \((TransformerBlock|DecoderBlock|Linear)\) holds tokens"


@pytest.mark.parametrize("name,layers", [("vit", "blocks"), ("gpt", "blocks"), ("vit", "convs")])
def test_token_sequences_are_refused_naming_the_layer(name, layers):
    net = models.get(name, num_classes=256 if name == "gpt" else 10)
    x = (torch.randint(0, 256, (2, 16)) if name == "gpt" else torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match=_TOKENS_REFUSED):
        common.capture(net, x, common.select_layers(net, layers))


@pytest.mark.parametrize("name,layers", [("vit", "blocks"), ("gpt", "blocks"), ("gpt", "all")])
def test_token_blocks_are_refused_when_selected_before_any_forward(name, layers):
    net = models.get(name, num_classes=256 if name == "gpt" else 10)
    x = (torch.randint(0, 256, (2, 16)) if name == "gpt" else torch.randn(2, 3, 32, 32))
    forwards = []
    net.register_forward_pre_hook(lambda module, args: forwards.append(module))
    with pytest.raises(ValueError, match=_TOKENS_REFUSED):
        common.capture(net, x, common.select_layers(net, layers))
    assert forwards == []
