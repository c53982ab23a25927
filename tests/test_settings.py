"""Declared codec settings: one declaration per setting, checked before any value reaches a kernel,
and read by codecs.get, RunConfig, the train flags, sweep labels and the user-error type."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from freqact import cli, codecs, errors, kernels, models, sweep, train
from freqact.codecs import base
from freqact.codecs.settings import BLOCK, MAX_BLOCK, Setting


@pytest.mark.parametrize("name", codecs.names())
def test_every_codec_builds_from_its_declared_defaults(name):
    declared = codecs.codec_class(name).settings
    given = {s.name: s.default for s in declared if s.required}
    if name == "maxpool-indices":  # geometry is per dim: it needs the input's size
        given["input_size"] = (4, 4)
    codec = codecs.get(name, **given)
    defaults = {s.name: s.default for s in declared if not s.required}
    if name != "maxpool-indices":  # which expands ints to one per dim
        assert {key: getattr(codec, key) for key in defaults} == defaults
    assert all(isinstance(s, Setting) and s.help for s in declared)


@pytest.mark.parametrize("block", [0, -1, MAX_BLOCK + 1, 2**63, 2**64 + 2])
def test_block_out_of_range_is_one_line_naming_block_and_its_range(block):
    for name in ("division", "division-no-hfc", "division-no-lfc"):
        with pytest.raises(ValueError, match=r"block: expected an integer in \[1, 65536\]") as err:
            codecs.get(name, block=block)
        assert "\n" not in str(err.value) and isinstance(err.value, errors.UsageError)


def test_the_largest_block_still_encodes():
    x = torch.randn(1, 2, 3, 5)
    codec = codecs.get("division", block=MAX_BLOCK, backend="torch")
    assert codec.decode(codec.encode(x)).shape == x.shape


@pytest.mark.parametrize("value, error", [
    (float("nan"), errors.UsageError), (float("inf"), errors.UsageError),
    (True, errors.UsageTypeError), ("0.5", errors.UsageTypeError), (0, errors.UsageError),
])
def test_ratio_is_a_finite_number_in_its_range(value, error):
    with pytest.raises(error, match="ratio"):
        codecs.get("lfc", ratio=value)


def test_unknown_setting_lists_the_known_ones():
    with pytest.raises(TypeError, match=r"codec 'division': unknown setting 'ratio'; "
                       r"its settings: block, bits, backend"):
        codecs.get("division", ratio=0.5)


def test_missing_required_setting_is_named_not_a_constructor_message():
    with pytest.raises(TypeError, match=r"codec 'lfc': missing required setting 'ratio' \(kept "
                       r"fraction W/N") as err:
        codecs.get("lfc")
    assert "__init__" not in str(err.value)
    with pytest.raises(TypeError, match="missing required setting 'ratio'") as err:
        import freqact
        freqact.compress(torch.nn.Linear(2, 2), "lfc")
    assert "__init__" not in str(err.value)


def test_positional_settings_follow_the_declared_order():
    codec = codecs.codec_class("division")(4, 8)
    assert (codec.block, codec.bits, codec.backend) == (4, 8, "auto")
    with pytest.raises(TypeError, match="given twice"):
        codecs.codec_class("division")(4, block=4)
    with pytest.raises(TypeError, match="at most 3 positional"):
        codecs.codec_class("division")(4, 2, "auto", 1)


def test_a_type_error_inside_a_codec_is_a_bug_and_keeps_its_type(monkeypatch):
    class Broken(base.Codec):
        name = "broken"
        settings = (BLOCK,)

        def _check_settings(self):
            raise TypeError("a bug, not a bad setting")

    monkeypatch.setitem(base._REGISTRY, "broken", Broken)
    with pytest.raises(TypeError, match="^a bug, not a bad setting$") as err:
        codecs.get("broken", block=2)
    assert not isinstance(err.value, errors.UsageError)


def test_a_type_error_inside_a_model_builder_is_a_bug_and_keeps_its_type(monkeypatch):
    def builder(num_classes=10, *, width=4):
        raise TypeError("inside the builder")

    monkeypatch.setitem(models._REGISTRY, "broken", builder)
    with pytest.raises(TypeError, match="^inside the builder$"):
        models.get("broken", width=8)
    with pytest.raises(errors.UsageTypeError, match="model 'broken': unknown setting 'depth'; "
                       "its settings: width"):
        models.get("broken", depth=8)


def test_the_backend_setting_reaches_the_kernels(monkeypatch):
    monkeypatch.delenv("FREQACT_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 3, 4, 4)
    for name in ("division", "division-no-lfc", "quant"):
        assert codecs.get(name, backend="torch").backend_used("cpu") == "torch"
        codec = codecs.get(name, backend="triton")
        if name == "quant":  # no Triton kernel for this form: dispatch refuses the device
            continue
        with pytest.raises((ValueError, RuntimeError), match="triton"):
            codec.encode(x)
    assert codecs.get("lfc", ratio=0.5).backend_used("cpu") is None
    # "auto" leaves the choice to $FREQACT_KERNELS, the default it keeps.
    monkeypatch.setenv("FREQACT_KERNELS", "torch")
    assert codecs.get("division").backend_used("cpu") == "torch"
    monkeypatch.delenv("FREQACT_KERNELS")
    assert codecs.get("division").backend_used("cpu") == kernels.backend_for(x)


def test_torch_and_cpu_backends_decode_each_others_packed_form():
    if kernels.backend_for(torch.empty(0)) != "cpu":
        pytest.skip("the C kernels cannot be built here")
    x = torch.randn(2, 3, 6, 6)
    on_torch, on_cpu = codecs.get("division", backend="torch"), codecs.get("division", backend="cpu")
    packed = on_torch.encode(x)
    torch.testing.assert_close(on_cpu.decode(packed), on_torch.decode(packed), rtol=0, atol=0)


def test_run_config_fields_are_the_training_modes_settings():
    fields = {f for f in train.RunConfig.__dataclass_fields__}
    assert {s.name for s in codecs.mode_settings()} <= fields
    assert set(train.MODES) == {"normal", *codecs.modes()}
    assert all(train.mode_title(m) for m in train.MODES)


def test_stored_config_keeps_only_the_modes_settings_and_old_files_still_load():
    config = train.RunConfig(mode="division", bits=4, dataset="synthetic")
    stored = config.to_dict()
    assert "ratio" not in stored and (stored["block"], stored["bits"], stored["backend"]) == \
        (8, 4, "auto")
    assert "block" not in train.RunConfig(mode="lfc", ratio=0.1).to_dict()
    assert "backend" not in train.RunConfig(mode="normal").to_dict()
    # A config.json written before: every codec field, no backend, plus trainer keys.
    old = {**{k: v for k, v in stored.items() if k != "backend"}, "ratio": 0.5,
           "num_classes": 10, "world_size": 1}
    assert train.RunConfig.from_dict(json.loads(json.dumps(old))) == config


@pytest.mark.parametrize("field, value", [
    ("lr", math.nan), ("lr", math.inf), ("lr", 11.0), ("lr", -0.1), ("momentum", math.nan),
    ("momentum", 1.5), ("weight_decay", 1e30), ("weight_decay", math.nan), ("seed", -1),
    ("seed", 2**32), ("lr", "0.1"),
])
def test_hyper_parameters_are_finite_and_in_range(field, value):
    with pytest.raises(ValueError, match=rf"^{field}: expected"):
        train.RunConfig(**{field: value})


def test_sweep_labels_and_columns_come_from_the_symbols():
    spec = {"name": "s", "base": {"dataset": "synthetic", "epochs": 1},
            "variants": [{"mode": "division", "block": 4}, {"mode": "lfc", "ratio": 0.1},
                         {"mode": "normal"}]}
    study = sweep.expand(spec, "out")
    assert [r.label for r in study.runs] == ["division B=4 Q=2", "lfc r=0.1", "normal"]
    header = sweep.markdown_table(study, sweep.results_table(study)).splitlines()[2]
    assert "| mode | B | Q | ratio | seeds |" in header


def test_help_and_version_do_not_import_torch():
    probe = ("import runpy, sys\n"
             "sys.argv = ['freqact', sys.argv[1]]\n"
             "try:\n    runpy.run_module('freqact', run_name='__main__')\n"
             "except SystemExit as stop:\n    assert stop.code == 0, stop.code\n"
             "print('torch' in sys.modules, file=sys.stderr)\n")
    for flag in ("--help", "--version"):
        done = subprocess.run([sys.executable, "-c", probe, flag], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stderr.strip().splitlines()[-1] == "False", done.stderr
        assert "freqact" in done.stdout


def test_cli_turns_only_user_errors_into_one_line(monkeypatch, capsys):
    def handler_raising(error):
        def handler(args):
            raise error
        return handler

    for error, code in ((errors.UsageTypeError("block: expected an integer"), 2),
                        (errors.UsageError("bad"), 2), (FileNotFoundError("gone"), 2)):
        monkeypatch.setattr(cli, "_eval", handler_raising(error))
        assert cli.main(["eval", "x.pt"]) == code
        assert capsys.readouterr().err.count("\n") == 1
    for bug in (TypeError("a bug"), KeyError("a bug")):
        monkeypatch.setattr(cli, "_eval", handler_raising(bug))
        with pytest.raises(type(bug)):
            cli.main(["eval", "x.pt"])


def test_setting_messages_describe_the_range():
    assert Setting("n", int, 1, "", low=0).expected() == "an integer >= 0"
    assert Setting("x", float, 0.5, "", low=0.0, high=1.0, low_open=True).expected() == \
        "a number in (0, 1]"
    assert Setting("x", float, 0.0, "").expected() == "a finite number"
    with pytest.raises(errors.UsageError, match="x: expected a finite number, got nan"):
        Setting("x", float, 0.0, "").check(math.nan)


def _tiny_config(tmp_path, **overrides) -> train.RunConfig:
    settings = dict(model="mlp", dataset="synthetic", epochs=1, batch_size=32, subset=64,
                    out=str(tmp_path / "run"), device="cpu", save_epochs=[])
    return train.RunConfig(**{**settings, **overrides})


def test_run_records_the_kernels_and_an_old_format_run_still_resumes(tmp_path):
    from freqact import checkpoint

    def mlp():
        return models.get("mlp", input_shape=(3, 8, 8))

    config = _tiny_config(tmp_path, mode="division", backend="torch", epochs=2, save_epochs=[1])
    train.train(config, model=mlp())
    stored = train.read_config(tmp_path / "run")
    assert stored["kernels"] == "torch" and stored["backend"] == "torch" and "ratio" not in stored
    # Back to epoch 1, written as freqact wrote runs before settings were declared: every codec
    # field, no backend, no kernels record.
    old = {**{k: v for k, v in stored.items() if k not in ("backend", "kernels")}, "ratio": 0.5}
    ckpt = tmp_path / "run" / "ckpt"
    checkpoint.save(ckpt / "last.pt", {**checkpoint.load(ckpt / "epoch-0001.pt"), "config": old})
    (tmp_path / "run" / "config.json").write_text(json.dumps(old))
    assert train.RunConfig.from_dict(old).codec_params() == {"block": 8, "bits": 2,
                                                             "backend": "auto"}
    results = train.train(_tiny_config(tmp_path, mode="division", epochs=2, save_epochs=[1],
                                       resume=True), model=mlp())
    assert [m["epoch"] for m in results["metrics"]] == [1, 2]
    assert train.read_config(tmp_path / "run")["kernels"] == kernels.backend_for(torch.empty(0))
    train.train(_tiny_config(tmp_path, out=str(tmp_path / "plain")), model=mlp())
    assert train.read_config(tmp_path / "plain")["kernels"] is None


def test_the_window_rule_setting_offers_exactly_the_rules_dct_knows():
    # settings.py imports no torch, so it writes the choices out; they must not drift apart.
    from freqact import dct
    from freqact.codecs.settings import WINDOW_RULE

    assert WINDOW_RULE.choices == dct.WINDOW_RULES
    assert all(WINDOW_RULE in codecs.codec_class(n).settings for n in ("lfc", "hfc", "hfc-quant"))


def test_a_relative_data_dir_is_recorded_absolute(tmp_path, monkeypatch):
    # `eval` and the analyses read the run's data_dir from wherever they are run
    from freqact.runconfig import RunConfig

    monkeypatch.chdir(tmp_path)
    config = RunConfig(model="resnet20", dataset="synthetic", data_dir="data")
    assert config.data_dir == str(tmp_path / "data")
    assert RunConfig(model="resnet20", dataset="synthetic").data_dir is None
