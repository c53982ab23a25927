"""Shared pieces of the robustness sweep: a tiny model, gradients, the CLI runner, checkpoints."""
from __future__ import annotations

import torch
from torch import nn

import freqact
from freqact import checkpoint, cli, train


class Tiny(nn.Module):
    """Conv -> BN -> ReLU -> max-pool -> Linear on 3x8x8: every kind of cached tensor, fast."""

    input_shape = (3, 8, 8)

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.relu(self.bn(self.conv(x)))).flatten(1))


def tiny(seed: int = 0) -> Tiny:
    """A Tiny with weights drawn after torch.manual_seed(seed) (global: not from threads)."""
    torch.manual_seed(seed)
    return Tiny()


def grads(model: nn.Module, x: torch.Tensor, codec: str | None = None, **params) -> list:
    """Parameter gradients of sum(model(x)), plain or inside compress(model, codec)."""
    model.zero_grad(set_to_none=True)
    if codec is None:
        out = model(x)
    else:
        with freqact.compress(model, codec, **params):
            out = model(x)
    out.sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run `freqact ARGV`; argparse's own refusals (SystemExit) count as their exit code."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def checkpoint_of(model_name: str, weights: nn.Module, fmt: str = checkpoint.FORMAT) -> dict:
    """A checkpoint dict that says it holds `model_name` and holds `weights`' state dict."""
    return {"format": fmt, "epoch": 1, "model": weights.state_dict(), "metrics": [],
            "config": {"model": model_name, "num_classes": 10, "dataset": "synthetic",
                       "data_dir": None, "subset": 32, "seed": 0}}


def tiny_config(tmp_path, **overrides) -> train.RunConfig:
    """A 2-epoch division run of a Tiny (pass model=tiny()) on 64 synthetic images."""
    settings = dict(model="tiny", dataset="synthetic", mode="division", epochs=2, batch_size=32,
                    subset=64, out=str(tmp_path / "run"), device="cpu", save_epochs=[])
    return train.RunConfig(**{**settings, **overrides})
