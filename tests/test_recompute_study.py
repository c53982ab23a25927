"""benchmarks/recompute_study.py: the variants switch the rule and restore it; tiny models, seconds."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import architectures, recompute_study
from benchmarks.recompute_study import ROUTE, VARIANTS, rule
from freqact import compress, models, text
from freqact.engine import recompute


def _rule_now() -> tuple:
    return recompute.RECOMPUTABLE, recompute.PRODUCTS, recompute.Recomputer.recipe_for


def _tiny_gpt():
    """A decoder whose RMSNorm and SwiGLU tensors are large enough to be packed (dim 32, 4 x 64)."""
    torch.manual_seed(0)
    model = models.get("gpt", num_classes=text.VOCAB_SIZE, dim=32, depth=1, heads=2, context=64)
    ids = torch.randint(0, text.VOCAB_SIZE, (4, 65))
    return model, ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_each_variant_restores_the_rule_even_when_the_run_raises(variant):
    before = _rule_now()
    with pytest.raises(RuntimeError, match="inside"), rule(variant):
        assert recompute.RECOMPUTABLE is variant.recomputable and recompute.PRODUCTS is variant.products
        assert (recompute.Recomputer.recipe_for is not before[2]) == variant.chained
        raise RuntimeError("inside")
    assert _rule_now() == before


def test_the_default_variant_is_the_engines_rule():
    (default,) = (v for v in VARIANTS if v.name == "activations and products")
    assert (default.recomputable, default.products, default.chained) == (
        recompute.RECOMPUTABLE, recompute.PRODUCTS, False)


def test_both_encoded_rebuilds_nothing_and_the_default_does():
    model, x, y = _tiny_gpt()
    routes = {}
    for variant in (VARIANTS[0], VARIANTS[2]):
        with rule(variant), compress(model, "division", **architectures.DIVISION) as meter:
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        routes[variant.name] = meter.by_route()
    assert ROUTE not in routes["both encoded"]
    assert routes["activations and products"][ROUTE]["count"] > 0
    assert routes["activations and products"][ROUTE]["saved_bytes"] == 0


def test_each_variant_rebuilds_more_and_holds_less_on_a_tiny_decoder():
    model, x, y = _tiny_gpt()
    result = recompute_study.measure(model, x, y, seeds=(0, 1))
    assert result["exact_grads_identical"]
    rows = [result["variants"][v.name] for v in VARIANTS]
    # both encoded < activations (SwiGLU's SiLU) < products (RMSNorm's x_n) < chained (y = w * x_n)
    counts = [r["recomputed"] for r in rows[:4]]
    assert counts[0] == 0 and counts == sorted(set(counts))
    ratios = [r["meter_ratio"] for r in rows[:4]]
    assert ratios == sorted(set(ratios))
    # the decoder has no LayerNorm: the last variant is the chained one
    assert rows[4]["recomputed"] == rows[3]["recomputed"]
    for r in rows:
        assert 0.5 < r["cosine"]["mean"] < 1.0 and r["rel_error"]["mean"] > 0
        assert len(r["cosine"]["per_seed"]) == 2 and r["cosine"]["sd"] >= 0


def test_layer_norm_too_rebuilds_the_vits_layer_norm_outputs():
    case = architectures._cases(quick=True)["vit"]
    model = case.build()
    x, y = architectures.random_batch(case, model)
    chained, layer_norm = VARIANTS[3], VARIANTS[4]
    rows = recompute_study.measure(model, x, y, seeds=(0,), variants=(chained, layer_norm))["variants"]
    assert rows[layer_norm.name]["recomputed"] > rows[chained.name]["recomputed"]
    assert rows[layer_norm.name]["meter_ratio"] > rows[chained.name]["meter_ratio"]


def test_quick_run_writes_every_variant_and_skips_vision_without_cifar(tmp_path, capsys):
    out = tmp_path / "study.json"
    assert recompute_study.main(["--quick", "--families", "gpt", "gpt-trained", "vit", "--seeds", "2",
                                 "--data-dir", str(tmp_path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["family"] for r in doc["rows"]] == ["gpt", "gpt-trained"]
    assert "cifar-10-batches-py" in doc["skipped"]["vit"]
    for row in doc["rows"]:
        assert row["exact_grads_identical"]
        assert list(row["variants"]) == [v.name for v in VARIANTS]
        assert row["variants"]["both encoded"]["recomputed"] == 0
    assert doc["rows"][1]["mode"] == "eval" and doc["settings"]["seeds"] == [0, 1]
    captured = capsys.readouterr()
    assert "skipped vit" in captured.err and "activations and products" in captured.out


def test_seeds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        recompute_study.main(["--quick", "--seeds", "0"])
    assert exit_.value.code == 2 and "--seeds: expected an integer >= 1, got 0" in capsys.readouterr().err
