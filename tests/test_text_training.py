"""`freqact train` on the byte-level text corpus: the next-byte loss, AdamW, resume, model options."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from freqact import checkpoint, cli, data, text, train

TINY = {"dim": 32, "depth": 1, "heads": 2, "context": 32}


def _train_args(out, *extra: str) -> list[str]:
    return ["train", "--model", "gpt", "--model-options", json.dumps(TINY),
            "--dataset", "stdlib-text", "--subset", "48", "--batch-size", "16",
            "--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.05",
            "--device", "cpu", "--save-epochs", "--out", str(out), *extra]


def test_text_windows_are_next_bytes():
    ds = data.load_text(context=16, subset=5)
    assert ds.train_images.shape == (5, 16) and ds.train_images.dtype == torch.uint8
    assert ds.train_labels.dtype == torch.int64 and ds.num_classes == 256
    assert torch.equal(ds.train_images[:, 1:].long(), ds.train_labels[:, :-1])
    # windows tile the text: each one's last target is the next window's first byte
    assert torch.equal(ds.train_labels[:-1, -1], ds.train_images[1:, 0].long())


def test_gpt_trains_one_epoch_from_the_cli(tmp_path):
    out = tmp_path / "run"
    assert cli.main(_train_args(out, "--epochs", "1", "--mode", "division")) == 0
    config = train.read_config(out)
    assert config["optimizer"] == "adamw" and config["model_options"] == TINY
    assert config["num_classes"] == 256
    (row,) = train.read_metrics(out)
    assert row["test_loss"] < math.log(256)  # better than a uniform guess over bytes
    assert row["compression_ratio"] is not None
    # The test loss is the next-byte cross-entropy in nats per byte over the whole test split.
    net, _ = checkpoint.load_model(out / "ckpt" / "last.pt")
    x, y = text.tiled_windows(text.load_stdlib_corpus(data.TEXT_BYTES).test, TINY["context"])
    with torch.no_grad():
        nats = sum(F.cross_entropy(net(xb).flatten(0, 1), yb.flatten(), reduction="sum")
                   for xb, yb in zip(x.split(512), y.split(512))) / y.numel()
    assert row["test_loss"] == pytest.approx(float(nats), rel=1e-5)


def test_eval_of_a_text_run_counts_tokens(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_train_args(out, "--epochs", "1")) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(out / "ckpt" / "last.pt"), "--device", "cpu"]) == 0
    test_windows = len(data.load_text(context=TINY["context"]).test_labels)
    assert capsys.readouterr().out.rstrip().endswith(f"({test_windows * TINY['context']} tokens)")


def test_resume_continues_the_same_text_run(tmp_path):
    out = tmp_path / "run"
    args = _train_args(out, "--epochs", "2", "--save-every", "1", "--mode", "division")
    assert cli.main(args) == 0
    whole = train.read_metrics(out)
    # Cut the run back to its first epoch, as if killed then, and resume: the losses and
    # accuracies of epoch 2 (AdamW state, schedule, codec noise) equal the uninterrupted run's.
    first = torch.load(out / "ckpt" / "epoch-0001.pt", weights_only=True)
    checkpoint.save(out / "ckpt" / "last.pt", first)
    (out / "metrics.jsonl").write_text(json.dumps(first["metrics"][0]) + "\n")
    assert cli.main([*args, "--resume"]) == 0
    timing = {"epoch_time_s", "images_per_s"}
    resumed = train.read_metrics(out)
    assert len(resumed) == 2
    for a, b in zip(whole, resumed):
        assert {k: v for k, v in a.items() if k not in timing} == \
            {k: v for k, v in b.items() if k not in timing}


def test_old_runs_without_optimizer_still_resume(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model", "mlp", "--dataset", "synthetic", "--subset", "32", "--epochs", "2",
            "--batch-size", "16", "--device", "cpu", "--save-epochs", "1", "--out", str(out)]
    assert cli.main(args) == 0
    ckpt = torch.load(out / "ckpt" / "epoch-0001.pt", weights_only=True)
    for key in ("optimizer", "model_options"):  # as freqact wrote configs before they existed
        del ckpt["config"][key]
    checkpoint.save(out / "ckpt" / "last.pt", ckpt)
    assert cli.main([*args, "--resume"]) == 0
    assert [r["epoch"] for r in train.read_metrics(out)] == [1, 2]
    # ... while a real change of optimizer is refused
    assert cli.main([*args, "--resume", "--optimizer", "adamw"]) == 2


def test_adamw_is_decoupled_weight_decay(tmp_path):
    config = train.RunConfig(model="mlp", dataset="synthetic", optimizer="adamw", lr=0.01,
                             weight_decay=0.05, out=str(tmp_path))
    net = torch.nn.Linear(3, 1)
    opt = train._optimizer(net, config)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["lr"] == 0.01 and opt.defaults["weight_decay"] == 0.05
    sgd = train._optimizer(net, train.RunConfig(model="mlp", out=str(tmp_path)))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9


@pytest.mark.parametrize("extra, message", [
    (["--model-options", "[1]"], "argument --model-options: expected a JSON object"),
    (["--model-options", "{dim"], "argument --model-options: expected a JSON object"),
    (["--model-options", '{"width": 3}'], "unknown setting 'width'"),
    (["--optimizer", "adam"], "argument --optimizer: invalid choice"),
])
def test_bad_text_run_arguments_are_one_line(tmp_path, capsys, extra, message):
    try:
        code = cli.main([*_train_args(tmp_path / "run", "--epochs", "1"), *extra])
    except SystemExit as exit_:  # argparse's own errors exit from parse_args
        code = exit_.code
    err = capsys.readouterr().err.strip()
    # argparse's own errors come after its usage lines; ours are one line
    assert code == 2 and message in err.splitlines()[-1]
    assert "Traceback" not in err


def test_text_needs_a_language_model(tmp_path, capsys):
    code = cli.main(["train", "--model", "resnet20", "--dataset", "stdlib-text", "--epochs", "1",
                     "--device", "cpu", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "needs a language model" in err and len(err.splitlines()) == 1


def test_checkpoint_with_inflated_model_options_is_refused(tmp_path):
    out = tmp_path / "run"
    assert cli.main(_train_args(out, "--epochs", "1")) == 0
    ckpt = torch.load(out / "ckpt" / "last.pt", weights_only=True)
    assert checkpoint.load_model(out / "ckpt" / "last.pt")[0].input_shape == (TINY["context"],)
    ckpt["config"]["model_options"] = {**TINY, "dim": 2**12, "depth": 2**6}  # ~1e10 weights
    bad = tmp_path / "bad.pt"
    checkpoint.save(bad, ckpt)
    with pytest.raises(ValueError, match=r"bad\.pt: weights do not fit model 'gpt'"):
        checkpoint.load_model(bad)
    ckpt["config"]["model_options"] = [1]
    checkpoint.save(bad, ckpt)
    with pytest.raises(ValueError, match="config model_options: expected dict"):
        checkpoint.load_model(bad)
