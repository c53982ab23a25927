"""Tests for freqact.models: registry, shapes, gradients, published parameter counts, blocks."""
from __future__ import annotations

import collections
import functools
import math

import pytest
import torch
from torch import nn

from freqact import models

NAMES = ["convnext", "densenet121", "gpt", "mlp", "mobilenet_v2", "mobilenet_v3", "resnet18",
         "resnet20", "resnet50", "swin", "vit"]


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@functools.cache
def _built(name: str, num_classes: int = 10) -> nn.Module:
    """A model built once per session, in eval mode; only for tests that do not change it."""
    torch.manual_seed(0)
    return models.get(name, num_classes=num_classes).eval()


def _small_input(model: nn.Module, batch: int = 2) -> torch.Tensor:
    """A batch of the model's input shape; ResNet-50 gets 64x64 instead of 224x224 to stay fast.

    The language model gets int64 token ids (batch, T) in [0, vocabulary).
    """
    shape = model.input_shape
    if isinstance(model, models.GPT):
        return torch.randint(0, model.vocab_size, (batch, *shape))
    if shape == (3, 224, 224):
        shape = (3, 64, 64)
    return torch.randn(batch, *shape)


# --- registry ---------------------------------------------------------------------------------

def test_names_sorted_and_complete():
    assert models.names() == NAMES


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="name") as err:
        models.get("resnet19")
    for name in NAMES:
        assert name in str(err.value)


def test_unknown_setting_is_type_error_naming_model():
    with pytest.raises(TypeError, match="resnet20"):
        models.get("resnet20", depth=32)


@pytest.mark.parametrize(
    "num_classes, error", [(0, ValueError), (2.5, TypeError), (True, TypeError)]
)
def test_bad_num_classes(num_classes, error):
    with pytest.raises(error, match="num_classes"):
        models.get("mlp", num_classes=num_classes)


@pytest.mark.parametrize(
    "name, kwargs, error, arg",
    [
        ("resnet18", {"width": 0}, ValueError, "width"),
        ("mlp", {"dropout": 1.5}, ValueError, "dropout"),
        ("mlp", {"dropout": "0.1"}, TypeError, "dropout"),
        ("mlp", {"input_shape": 3072}, TypeError, "input_shape"),
        ("mlp", {"input_shape": (1, 3, 32, 32)}, ValueError, "input_shape"),
        ("mobilenet_v2", {"width_mult": -1.0}, ValueError, "width_mult"),
        ("densenet121", {"reduction": 0.0}, ValueError, "reduction"),
        ("vit", {"dim": 100, "heads": 3}, ValueError, "dim"),
        ("vit", {"image_size": 30}, ValueError, "image_size"),
        ("swin", {"dim": 50}, ValueError, "dim"),
        ("swin", {"depths": (2, 2)}, TypeError, "depths"),
        ("swin", {"image_size": 36}, ValueError, "image_size"),
        ("convnext", {"dims": (8, 0), "depths": (1, 1)}, ValueError, r"dims\[1\]"),
        ("convnext", {"dims": [8]}, TypeError, "dims"),
        ("gpt", {"dim": 12, "heads": 4}, ValueError, "dim"),
        ("gpt", {"context": 0}, ValueError, "context"),
        ("mobilenet_v3", {"dropout": 1.0}, ValueError, "dropout"),
    ],
)
def test_bad_settings_name_the_argument(name, kwargs, error, arg):
    with pytest.raises(error, match=arg):
        models.get(name, **kwargs)


# --- every model: forward, backward, modes ----------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_forward_backward(name):
    torch.manual_seed(0)
    model = models.get(name, num_classes=7)
    x = _small_input(model)

    # Every leaf module runs exactly once per forward: no module object is reused (the engine
    # meters per module) and none is dead weight.
    calls = collections.Counter()
    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    handles = [m.register_forward_hook(lambda *_, n=n: calls.update([n])) for n, m in leaves]
    out = model(x)
    for h in handles:
        h.remove()
    assert calls == {n: 1 for n, _ in leaves}

    assert out.shape == ((2, *model.input_shape, 7) if name == "gpt" else (2, 7))
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    # Not every gradient may be zero (a detached path would give all zeros).
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_eval_is_deterministic_and_keeps_buffers(name):
    model = _built(name)
    x = _small_input(model)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    with torch.no_grad():
        first, second = model(x), model(x)
    assert torch.equal(first, second)
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    # Each sample is processed on its own in eval mode (no batch statistics).
    with torch.no_grad():
        alone = model(x[:1])
    torch.testing.assert_close(alone, first[:1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["mlp", "vit", "mobilenet_v2", "swin", "gpt"])
def test_dropout_random_in_train_only(name):
    torch.manual_seed(0)
    model = models.get(name, dropout=0.5)
    x = _small_input(model)
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))
        model.eval()
        assert torch.equal(model(x), model(x))


@pytest.mark.parametrize("name", NAMES)
def test_no_inplace_activations(name):
    # In-place activations would modify tensors already cached for backward (DESIGN pitfall 4).
    for m in _built(name).modules():
        assert not getattr(m, "inplace", False), type(m).__name__


# --- parameter counts ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, num_classes, published",
    [
        ("resnet18", 10, 11_173_962),  # CIFAR ResNet-18 (kuangliu/pytorch-cifar)
        # ResNet-20 with projection shortcuts: He et al.'s zero-padding version (269,722) plus a
        # 1x1 conv + BN for 16->32 and 32->64 channels.
        ("resnet20", 10, 272_474),
        ("resnet50", 1000, 25_557_032),  # torchvision resnet50
        ("mobilenet_v2", 10, 2_236_682),  # torchvision mobilenet_v2(num_classes=10), "2.24M"
        ("mobilenet_v3", 1000, 2_542_856),  # torchvision mobilenet_v3_small(), "2.5M"
        ("densenet121", 10, 6_956_298),  # DenseNet-BC-121 CIFAR, "6.96M"
    ],
)
def test_published_parameter_counts(name, num_classes, published):
    assert _numel(_built(name, num_classes)) == published


def test_mlp_parameter_count_by_formula():
    model = models.get("mlp", num_classes=5, hidden=(64, 32), input_shape=(1, 8, 8))
    assert _numel(model) == (64 * 64 + 64) + (64 * 32 + 32) + (32 * 5 + 5)


def test_vit_parameter_count_by_formula():
    d, depth, classes, tokens = 192, 6, 10, (32 // 4) ** 2 + 1
    norms, qkv, proj = 2 * (2 * d), d * 3 * d + 3 * d, d * d + d
    block = norms + qkv + proj + (d * 4 * d + 4 * d) + (4 * d * d + d)
    embed = (3 * 4 * 4 * d + d) + d + tokens * d  # patch projection, class token, positions
    expected = embed + depth * block + 2 * d + (d * classes + classes)
    assert _numel(_built("vit", classes)) == expected


# --- blocks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, block_type, count",
    [
        ("resnet18", models.BasicBlock, 8),
        ("resnet20", models.BasicBlock, 9),
        ("resnet50", models.Bottleneck, 16),
        ("densenet121", models.DenseBlock, 4),
        ("vit", models.TransformerBlock, 6),
        ("swin", models.SwinBlock, 6),
        ("convnext", models.ConvNeXtBlock, 6),
        ("gpt", models.DecoderBlock, 4),
        ("mlp", None, 0),
        ("mobilenet_v2", None, 0),
        ("mobilenet_v3", None, 0),
    ],
)
def test_block_types_found_by_isinstance(name, block_type, count):
    assert isinstance(models.BLOCK_TYPES, tuple)
    blocks = [m for m in _built(name).modules() if isinstance(m, models.BLOCK_TYPES)]
    assert len(blocks) == count
    assert all(type(b) is block_type for b in blocks)


@pytest.mark.parametrize("block_type", [models.BasicBlock, models.Bottleneck])
def test_residual_block_with_silenced_branch_is_relu_of_input(block_type):
    # Zeroing the last BN scale silences the residual branch: out = ReLU(0 + x).
    channels = 8 * block_type.expansion
    block = block_type(channels, 8).eval()
    last_bn = block.bn3 if block_type is models.Bottleneck else block.bn2
    nn.init.zeros_(last_bn.weight)
    x = torch.randn(2, channels, 5, 5)
    with torch.no_grad():
        assert torch.equal(block(x), torch.relu(x))


def test_transformer_block_with_silenced_branches_is_identity():
    # Pre-norm residual form: zero output projections leave the tokens unchanged.
    block = models.TransformerBlock(dim=8, heads=2)
    for linear in (block.attn.proj, block.mlp[-1]):
        nn.init.zeros_(linear.weight)
        nn.init.zeros_(linear.bias)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        assert torch.equal(block(x), x)


def test_densenet_block_outputs_are_concatenations():
    # Block output channels 64 + 6*32, 128 + 12*32, 256 + 24*32, 512 + 16*32 at halving sizes.
    shapes = []
    hooks = [m.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
             for m in _built("densenet121").modules() if isinstance(m, models.DenseBlock)]
    with torch.no_grad():
        _built("densenet121")(torch.randn(1, 3, 32, 32))
    for h in hooks:
        h.remove()
    assert shapes == [(1, 256, 32, 32), (1, 512, 16, 16), (1, 1024, 8, 8), (1, 1024, 4, 4)]


def test_dense_block_output_starts_with_its_input():
    block = models.DenseBlock(3, in_channels=5, growth=4)
    x = torch.randn(2, 5, 6, 6)
    out = block(x)
    assert out.shape == (2, 5 + 3 * 4, 6, 6)
    assert torch.equal(out[:, :5], x)


# --- input shapes and variants -------------------------------------------------------------------

def test_input_shapes():
    expected = {"resnet50": (3, 224, 224), "gpt": (64,)}
    for name in NAMES:
        assert _built(name).input_shape == expected.get(name, (3, 32, 32)), name


def test_resnet50_accepts_any_size_from_32():
    model = _built("resnet50")
    with torch.no_grad():
        for size in (32, 45):
            assert model(torch.randn(1, 3, size, size)).shape == (1, 10)
        # The stem downsamples by 4 (conv stride 2, max-pool stride 2), the body by 8 more.
        stem = model.stem(torch.randn(1, 3, 64, 64))
        body = model.stages(stem)
    assert stem.shape == (1, 64, 16, 16)
    assert body.shape == (1, 2048, 2, 2)


def test_one_channel_and_flat_inputs():
    conv = models.get("resnet20", in_channels=1)
    assert conv.input_shape == (1, 32, 32)
    assert conv(torch.randn(2, 1, 32, 32)).shape == (2, 10)
    flat = models.get("mlp", input_shape=(64,))
    assert flat.input_shape == (64,)
    assert flat(torch.randn(2, 64)).shape == (2, 10)


def test_vit_rejects_wrong_image_size():
    with pytest.raises(ValueError, match="x"):
        models.get("vit")(torch.randn(1, 3, 28, 28))


# --- initialisation ------------------------------------------------------------------------------

def test_cnn_standard_init():
    model = _built("resnet18")
    conv = model.stages[3][0].conv1  # 256 -> 512, 3x3: fan_out != fan_in, 1.2M weights
    fan_out = conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2.0 / fan_out), rel=0.01)
    assert conv.weight.mean().abs().item() < 3 * math.sqrt(2.0 / fan_out / conv.weight.numel())
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.equal(m.weight, torch.ones_like(m.weight))
            assert torch.equal(m.bias, torch.zeros_like(m.bias))
    # Linear keeps PyTorch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
    bound = 1 / math.sqrt(model.fc.in_features)
    assert model.fc.weight.abs().max().item() <= bound
    assert model.fc.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)


def test_vit_trunc_normal_init():
    model = _built("vit")
    weights = torch.cat([m.weight.flatten() for m in model.modules()
                         if isinstance(m, (nn.Linear, nn.Conv2d))])
    assert weights.std().item() == pytest.approx(0.02, rel=0.01)
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            assert torch.equal(m.bias, torch.zeros_like(m.bias))
        elif isinstance(m, nn.LayerNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight))


# --- the transformer and ConvNeXt families: properties of their building blocks ------------------

def _receptive_tokens(block: nn.Module, size: int, dim: int, at: tuple[int, int]) -> set:
    """Grid positions (row, col) whose input tokens change the block's output token `at`."""
    x = torch.randn(1, size, size, dim, requires_grad=True)
    block(x)[0, at[0], at[1]].sum().backward()
    return {tuple(ix) for ix in (x.grad[0].abs().sum(-1) > 0).nonzero().tolist()}


def test_swin_attends_within_windows_and_shifted_windows_do_not_wrap():
    torch.manual_seed(0)
    plain = models.SwinBlock(dim=8, heads=2, size=8, window=4, shift=0)
    shifted = models.SwinBlock(dim=8, heads=2, size=8, window=4, shift=2)
    window = {(r, c) for r in range(4) for c in range(4)}
    assert _receptive_tokens(plain, 8, 8, (0, 0)) == window
    # The cyclic shift puts rows/cols 6-7 next to 0-1 in one window; the mask keeps them apart.
    assert _receptive_tokens(shifted, 8, 8, (0, 0)) == {(r, c) for r in (0, 1) for c in (0, 1)}
    assert _receptive_tokens(shifted, 8, 8, (3, 3)) == {(r, c) for r in range(2, 6)
                                                        for c in range(2, 6)}


def test_convnext_block_with_zero_layer_scale_is_identity():
    block = models.ConvNeXtBlock(dim=8, layer_scale=0.0)
    x = torch.randn(2, 8, 7, 7)
    with torch.no_grad():
        assert torch.equal(block(x), x)


def test_gpt_is_causal():
    model = _built("gpt", 11)
    ids = torch.randint(0, 11, (2, 20))
    changed = ids.clone()
    changed[:, 12] = (ids[:, 12] + 1) % 11
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert a.shape == (2, 20, 11)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gpt_rejects_float_or_too_long_input():
    model = _built("gpt")
    for bad in (torch.randn(1, 8), torch.zeros(1, 65, dtype=torch.int64)):
        with pytest.raises(ValueError, match="ids"):
            model(bad)


def test_rmsnorm_matches_float64_formula():
    norm = models.RMSNorm(16)
    nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 16)
    x64 = x.double()
    expected = norm.weight.double() * x64 / x64.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-6)


def test_rotary_scores_depend_on_relative_position_only():
    from freqact.models.gpt import _rotary_tables, _rotate

    cos, sin = _rotary_tables(32, 8)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)

    def score(i: int, j: int) -> float:
        qi = _rotate(q.float().expand(1, 1, 32, 8), cos, sin)[0, 0, i]
        kj = _rotate(k.float().expand(1, 1, 32, 8), cos, sin)[0, 0, j]
        return float(qi @ kj)

    assert score(5, 2) == pytest.approx(score(20, 17), rel=1e-5, abs=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)
