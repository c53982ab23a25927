"""Evaluation: test loss and accuracy of a model or a stored checkpoint, a plain forward under
`torch.no_grad()`, and the cross-entropy rule training shares with it.

`freqact.train` uses these for its per-epoch test pass and re-exports `evaluate`,
`evaluate_checkpoint` and `cross_entropy` (`train.evaluate`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from freqact import _validate, checkpoint, data, distributed

# The config keys `evaluate_checkpoint` reads (data_dir and subset may be None: the run had none).
CONFIG_KEYS = ("dataset", "data_dir", "subset", "seed")


def evaluate(model: torch.nn.Module, loader: Iterable, device: str | torch.device) -> dict:
    """Mean cross-entropy and accuracy of `model` over `loader`, without gradients.

    Args:
        model: a classifier (logits (N, K)) or a language model (logits (N, T, V)); put in
            eval mode here.
        loader: iterable of (inputs, labels) batches, inputs shaped as the model expects, labels
            (N,) or (N, T).
        device: where to run.

    Returns:
        {"loss": float, "accuracy": float in [0, 1], "count": int}, over every target (every
        token for a language model: loss in nats per token).
    """
    sums = eval_sums(model, loader, torch.device(device))
    return summarise(sums)



def evaluate_checkpoint(path: str, *, data_dir: str | None = None, device: str | None = None,
                        batch_size: int = 512) -> dict:
    """Test loss and accuracy of a checkpoint on its run's dataset.

    Args:
        path: a checkpoint written by `train`.
        data_dir: CIFAR data directory (default: the run's, else $FREQACT_DATA, else ./data).
        device: where to evaluate (default: CUDA when available).
        batch_size: evaluation batch size.

    Raises:
        ValueError: naming the file, for one `checkpoint.load_model` refuses, or whose config
            lacks one of `CONFIG_KEYS`.

    Returns:
        `evaluate`'s dict plus "epoch", "checkpoint" and "unit" (what "count" counts: "images",
        or "tokens" for the text dataset, whose every next byte is a target).
    """
    ctx = distributed.Context(device=distributed.pick_device(device))
    net, ckpt = checkpoint.load_model(path, ctx.device, required=CONFIG_KEYS)
    cfg = ckpt["config"]
    ds = data.load_for_model(cfg["dataset"], net, data_dir or cfg["data_dir"], subset=cfg["subset"],
                             seed=cfg["seed"], device=ctx.device)
    batches = eval_batches(ds, net, ctx, _validate.positive_int("batch_size", batch_size))
    unit = "tokens" if cfg["dataset"] == data.TEXT_DATASET else "images"
    return {**evaluate(net, batches, ctx.device), "epoch": ckpt["epoch"], "checkpoint": str(path),
            "unit": unit}



def eval_batches(ds: data.Dataset, net, ctx: distributed.Context, batch: int, *,
                  even: bool = False) -> Iterator:
    """This rank's share (every world_size-th image) of the whole test set, in batches.

    even: every rank gets as many batches, as FSDP2 needs (each forward gathers weights from all
    ranks): the share is cut into the largest rank's number of batches (none empty for batch >= 2,
    since shares differ by at most one image; some models cannot run an empty batch).
    """
    idx = torch.arange(ctx.rank, len(ds.test_labels), ctx.world_size, device=ctx.device)
    most = math.ceil(math.ceil(len(ds.test_labels) / ctx.world_size) / batch)
    for chunk in idx.tensor_split(most) if even else idx.split(batch):
        yield (data.model_inputs(ds, ds.test_images[chunk], net),
               ds.test_labels[chunk])


def eval_sums(model: torch.nn.Module, loader: Iterable, device: torch.device) -> torch.Tensor:
    """float64 tensor [loss sum, correct, count] over `loader`, under no_grad in eval mode."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    with torch.no_grad():
        for x, y in loader:
            logits = model(x.to(device))
            y = y.to(device)
            sums[0] += cross_entropy(logits.float(), y, reduction="sum").double()
            sums[1] += (logits.argmax(-1) == y).sum()
            sums[2] += y.numel()
    return sums


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits (..., K) against int64 targets (...): a classifier's (N, K)/(N,)
    or a language model's next-token loss (N, T, V)/(N, T), averaged (or summed) over targets."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction=reduction)


def summarise(sums: torch.Tensor) -> dict:
    """[loss sum, correct, count] -> {"loss", "accuracy", "count"} (NaN means for count 0)."""
    loss_sum, correct, count = sums.tolist()
    return {"loss": loss_sum / count if count else float("nan"),
            "accuracy": correct / count if count else float("nan"), "count": int(count)}

