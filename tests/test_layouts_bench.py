"""benchmarks/layouts.py: its round trips are DIVISION, its hooks select the routes, it runs.

The quick run needs the real CIFAR-10 (skipped with the reason where it is absent); the other
tests use tiny random models and run in a second or two.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import layouts
from benchmarks.common import gradient_error
from freqact import kernels, models


def _noise(shape, seed=0):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def test_feature_layout_is_the_division_codec():
    # Blocks of 8 features with min/step per token is today's map rule for (N, T, F): the same
    # reference encoder with the same noise gives the same values (to float32 rounding, the two
    # sum the three parts in another order) and exactly the same bytes.
    v = torch.randn(2, 5, 40) * torch.linspace(0.1, 3, 40)
    v_hat, nbytes = layouts.roundtrip(v, "feat/tok", torch.Generator().manual_seed(1))
    packed = kernels.division_encode(v, 8, 2, _noise(v.shape, 1), backend="torch")
    torch.testing.assert_close(v_hat, kernels.division_decode(packed, backend="torch"), rtol=1e-6, atol=1e-6)
    assert nbytes == packed.nbytes


def test_token_channel_layout_is_the_codec_on_the_transposed_tensor():
    v = torch.randn(2, 19, 6)
    gen = torch.Generator().manual_seed(2)
    v_hat, nbytes = layouts.roundtrip(v, "tok/chan", gen)
    w = v.transpose(1, 2).contiguous()
    packed = kernels.division_encode(w, 8, 2, _noise(w.shape, 2), backend="torch")
    expected = kernels.division_decode(packed, backend="torch").transpose(1, 2)
    torch.testing.assert_close(v_hat, expected, rtol=1e-6, atol=1e-6)
    assert nbytes == packed.nbytes


@pytest.mark.parametrize("layout", list(layouts.LAYOUTS))
def test_every_layout_is_unbiased_and_keeps_block_means(layout):
    # 65 ViT tokens (class token + 8x8 grid), 16 features; bytes: 8 elements per block.
    v = torch.randn(3, 65, 16)
    gen = torch.Generator().manual_seed(0)
    runs = torch.stack([layouts.roundtrip(v, layout, gen)[0] for _ in range(200)])
    assert runs.shape[1:] == v.shape
    err = (runs.mean(0) - v).abs().max()
    spread = (runs - v).abs().max()
    assert 0 < err < spread / 5  # stochastic rounding: averages converge, single runs do not
    _, nbytes = layouts.roundtrip(v, layout, gen)
    stats_maps = 3 * (65 if layout.endswith("/tok") else 16)
    blocks = 3 * 16 * 9 if layout.split("/")[0] != "feat" else 3 * 65 * 2
    code_bytes = stats_maps * -(-(16 if layout.endswith("/tok") else 65) * 2 // 8)
    assert nbytes == 2 * blocks + code_bytes + 4 * stats_maps


def test_grid_order_puts_2x4_tiles_together_and_the_class_token_last():
    order = layouts.token_order(65, (2, 4))
    assert sorted(order.tolist()) == list(range(65))
    assert order[:8].tolist() == [1 + p for p in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert order[-1] == 0
    with pytest.raises(ValueError, match="tokens"):
        layouts.token_order(64, (2, 4))


def _tiny_gpt():
    torch.manual_seed(0)
    model = models.get("gpt", num_classes=50, dim=32, depth=2, heads=2, context=24).eval()
    x = torch.randint(0, 50, (2, 24))
    return model, x, torch.randint(0, 50, (2, 24))


def test_hooks_alone_are_exact_and_routes_find_their_tensors():
    model, x, y = _tiny_gpt()
    model.zero_grad()
    layouts.loss_of(model, x, y).backward()
    plain = torch.cat([p.grad.flatten().double() for p in model.parameters()])
    hooked, counts = layouts.gradients(model, x, y)
    assert torch.equal(hooked, plain)
    # Per block: the attention input (shared by q/k/v), o_proj's, the MLP's (gate/up) and
    # down_proj's inputs, plus the head's: a tensor saved by two Linears counts once.
    assert counts["linear_in"]["tensors"] == 2 * 4 + 1
    assert counts["act_in"]["tensors"] == 2
    # RMSNorm saves its input and the normalised input (5 norms); statistics stay exact.
    assert counts["norm_in"]["tensors"] == 5 * 2
    assert counts["sdpa_qk"]["tensors"] == 2 * 2  # q, k per block
    assert counts["sdpa_v"]["tensors"] == counts["sdpa_o"]["tensors"] == 2  # v, out per block
    assert layouts.route_count(counts, "sdpa_vo", "tensors") == 2 * 2
    assert layouts.route_count(counts, "sdpa_qkvo", "tensors") == 2 * 4
    assert counts["attn_probs"]["tensors"] == 0
    _, math_counts = layouts.gradients(model, x, y, math_attention=True)
    assert math_counts["attn_probs"]["tensors"] == 2
    assert math_counts["attn_probs"]["elements"] == 2 * 2 * 2 * 24 * 24
    assert math_counts["math_qkv"]["tensors"] == 2 * 3  # scaled q, scaled k^T, v per block


def test_recomputed_out_and_logsumexp_are_the_kernel_s_own():
    q, k, v = (torch.randn(2, 2, 24, 16) for _ in range(3))
    replacer = layouts.SavedTensorReplacer(nn.Identity(), "sdpa_qk_re", "feat/chan", 0)
    out, lse = replacer._recomputed((q, k, v), {"is_causal": True})
    ref = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_zero_kept_probabilities_count_their_mask_and_stay_close():
    model, x, y = _tiny_gpt()
    exact, _ = layouts.gradients(model, x, y, math_attention=True)
    g, counts = layouts.gradients(model, x, y, route="attn_probs_zero", layout="feat/chan",
                                  math_attention=True)
    _, plain_counts = layouts.gradients(model, x, y, route="attn_probs", layout="feat/chan",
                                        math_attention=True)
    elements = counts["attn_probs"]["elements"]
    assert counts["attn_probs"]["bytes"] == plain_counts["attn_probs"]["bytes"] + elements // 8
    rel, cos = gradient_error(g, exact)
    assert 0 < rel < 0.5 and cos > 0.9


def test_replacing_a_route_changes_gradients_a_little():
    model, x, y = _tiny_gpt()
    exact, _ = layouts.gradients(model, x, y)
    g, counts = layouts.gradients(model, x, y, route="act_in", layout="tok/chan", seed=3)
    rel, cos = gradient_error(g, exact)
    assert 0 < rel < 0.5 and cos > 0.9
    assert counts["act_in"]["bytes"] > 0


@pytest.mark.slow
def test_quick_run_writes_a_table_and_json(cifar_dir, tmp_path, capsys):
    assert layouts.main(["--quick", "--data-dir", str(cifar_dir.parent),
                         "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "layouts-quick.json").read_text())
    assert set(doc["models"]) == {"vit", "gpt"}
    for name, m in doc["models"].items():
        assert set(m["routes"]) == set(layouts.ROUTES), name
        for r in m["routes"].values():
            for v in r["layouts"].values():
                # smaller than fp32 (4 bytes); quick mode's tiny views cost more than the full run's
                assert 0 < v["bytes_per_element"] < 4 and v["rel_error"] >= 0
    assert "rel. grad error" in capsys.readouterr().out


def test_missing_data_is_one_line_exit_2(tmp_path, capsys):
    assert layouts.main(["--quick", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data-dir" in err
