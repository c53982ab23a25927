"""Datasets as in-memory uint8 tensors, and augmentation on the training device.

Every dataset becomes a `Dataset`: train and test images as uint8 tensors (N, C, H, W), int64
labels and per-channel normalisation constants. Whole datasets are small (CIFAR is 150 MB), so they
are loaded once; batches are drawn by index and augmented as one tensor on the device, with no
per-image Python loop.

- `cifar10`, `cifar100`: the official python layout (`cifar-10-batches-py/`, `cifar-100-python/`)
  in a data directory: the argument, else `$FREQACT_DATA`, else `./data`. The pickled batches are
  parsed by `load_pickle` (`freqact.safepickle`), an unpickler that can only rebuild plain
  containers and numeric numpy arrays with bounded memory, so a crafted file cannot run code or
  exhaust memory; each batch is checked (integer pixels 0..255 of shape (N, 3072), N integer
  labels in range). `download=True` fetches the official archive, checks its md5 and unpacks it
  through a temporary folder (see `download_cifar`).
- `digits`: scikit-learn's bundled 8x8 handwritten digits (works offline), resized bilinearly to
  the requested (C, H, W) (default 3x32x32) with the gray level replicated over the channels.
- `synthetic`: a seeded, learnable random dataset (class-dependent smooth patterns plus noise).
- `stdlib-text`: byte-level text (`freqact.text`, the standard library's own sources) for the
  language model `gpt`: "images" are uint8 token windows (N, T) and "labels" their next bytes
  (N, T), T the model's context (`load_text`). Every consumer treats both kinds alike: a batch is
  gathered by index, `model_inputs` turns it into what the model takes, and a loss over
  `logits.flatten(0, -2)` against `labels.flatten()` is the classifier's or the next-byte loss.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from freqact import _validate, text
from freqact.download import fetch_archive
from freqact.safepickle import load_pickle

DATASETS = ("cifar10", "cifar100", "digits", "synthetic", "stdlib-text")
TEXT_DATASET = "stdlib-text"
# Bytes of the standard library read for `stdlib-text` (train + test, ~1/10 test): enough text
# for CPU-sized runs, and a test split (~100 kB) that evaluates in seconds.
TEXT_BYTES = 2**20

# Official archives (https://www.cs.toronto.edu/~kriz/cifar.html) and their published md5 sums.
_CIFAR = {
    "cifar10": dict(
        folder="cifar-10-batches-py",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        md5="c58f30108f718f92721af3b95e74349a",
        train=[f"data_batch_{i}" for i in range(1, 6)],
        test=["test_batch"],
        label_key=b"labels",
        num_classes=10,
    ),
    "cifar100": dict(
        folder="cifar-100-python",
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        md5="eb9058c3a382ffc7106e4002c42a8d85",
        train=["train"],
        test=["test"],
        label_key=b"fine_labels",
        num_classes=100,
    ),
}
# Published CIFAR training-set statistics (the shared data's README confirms the CIFAR-10 ones).
_CIFAR_MEAN = {"cifar10": (0.4914, 0.4822, 0.4465), "cifar100": (0.5071, 0.4865, 0.4409)}
_CIFAR_STD = {"cifar10": (0.2470, 0.2435, 0.2616), "cifar100": (0.2673, 0.2564, 0.2762)}

CIFAR_PADDING = 4  # the paper's recipe: random 32x32 crop of the 4-pixel zero-padded image


@dataclass
class Dataset:
    """A whole dataset in memory.

    Attributes:
        name: one of `DATASETS`.
        train_images: uint8, shape (N_train, C, H, W); text: token windows (N_train, T).
        train_labels: int64, shape (N_train,); text: the next bytes (N_train, T).
        test_images: uint8, shape (N_test, C, H, W); text: (N_test, T).
        test_labels: int64, shape (N_test,); text: (N_test, T).
        num_classes: number of classes; labels lie in [0, num_classes) (text: 256 byte values).
        mean, std: per-channel normalisation constants for images scaled to [0, 1], length C
            (empty for text).
        augment: whether training batches get CIFAR augmentation (crop + flip).
    """

    name: str
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory: `data_dir`, else `$FREQACT_DATA`, else `./data`."""
    if data_dir is not None:
        return Path(data_dir)
    return Path(os.environ.get("FREQACT_DATA") or "data")


def _cifar_split(folder: Path, files: list[str], label_key: bytes, num_classes: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate CIFAR batch files into (uint8 (N, 3, 32, 32), int64 (N,))."""
    images, labels = [], []
    for file in files:
        x, y = _cifar_batch(folder / file, load_pickle(folder / file), label_key, num_classes)
        images.append(x)
        labels.append(y)
    return torch.cat(images), torch.cat(labels)


def _cifar_batch(path: Path, batch: object, label_key: bytes, num_classes: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One checked CIFAR batch: data an integer (N, 3072) array of 0..255, N integer labels in
    [0, num_classes); returns (uint8 (N, 3, 32, 32), int64 (N,)). Errors name the file."""
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise ValueError(f"{path}: expected a dict with b'data' and {label_key!r}")
    images = _cifar_pixels(path, batch[b"data"])
    labels = _cifar_labels(path, batch[label_key], label_key, num_classes)
    if len(labels) != len(images):
        raise ValueError(f"{path}: expected {len(images)} labels (one per image), "
                         f"got {len(labels)}")
    return images, labels


def _cifar_pixels(path: Path, data: object) -> torch.Tensor:
    """An integer (N, 3072) array of values 0..255 -> uint8 (N, 3, 32, 32)."""
    if not isinstance(data, np.ndarray) or data.dtype.kind not in "ui" or data.ndim != 2 \
            or data.shape[1] != 3 * 32 * 32:
        found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{path}: expected data as an integer array (N, 3072), got {found}")
    if data.size and not 0 <= int(data.min()) <= int(data.max()) <= 255:
        raise ValueError(f"{path}: expected pixel values in 0..255, got {data.min()}..{data.max()}")
    return torch.from_numpy(data.astype(np.uint8).reshape(-1, 3, 32, 32))


def _cifar_labels(path: Path, labels: object, label_key: bytes, num_classes: int) -> torch.Tensor:
    """A list (or 1-D integer array) of ints in [0, num_classes) -> int64 (N,)."""
    if isinstance(labels, np.ndarray) and labels.ndim == 1 and labels.dtype.kind in "ui":
        labels = labels.tolist()
    if not isinstance(labels, list) or any(type(v) is not int for v in labels):
        raise ValueError(f"{path}: expected {label_key!r} as a list of integers")
    if labels and not 0 <= min(labels) <= max(labels) < num_classes:
        raise ValueError(f"{path}: labels outside [0, {num_classes}): "
                         f"{min(labels)}..{max(labels)}")
    return torch.tensor(labels, dtype=torch.int64)


def load_cifar(name: str, data_dir: str | os.PathLike | None = None, *,
               download: bool = False) -> Dataset:
    """Load CIFAR-10 or CIFAR-100 from the official python layout.

    Args:
        name: "cifar10" or "cifar100".
        data_dir: the folder holding `cifar-10-batches-py/` or `cifar-100-python/`; default as in
            `resolve_data_dir`.
        download: fetch and unpack the official archive (md5-checked) when the folder is missing.

    Returns:
        The dataset; train images (50000, 3, 32, 32) for the official files. The test set's size
        is whatever the test file holds.

    Raises:
        FileNotFoundError: if the files are missing and `download` is False, or the download fails
            (the message says where it looked and how to provide the files).
        ValueError: if a file is not a valid CIFAR batch.
    """
    _validate.choice("name", name, tuple(_CIFAR))
    spec = _CIFAR[name]
    root = resolve_data_dir(data_dir)
    folder = root / spec["folder"]
    missing = [f for f in spec["train"] + spec["test"] if not (folder / f).is_file()]
    if missing and download:
        download_cifar(name, root)
    elif missing:
        raise FileNotFoundError(
            f"{name}: {folder} lacks {', '.join(missing)}. Pass --download (or download=True) to "
            f"fetch {spec['url']}, unpack that archive into {root}, or point --data-dir / "
            "$FREQACT_DATA at the folder that holds it"
        )
    train_x, train_y = _cifar_split(folder, spec["train"], spec["label_key"], spec["num_classes"])
    test_x, test_y = _cifar_split(folder, spec["test"], spec["label_key"], spec["num_classes"])
    return Dataset(name, train_x, train_y, test_x, test_y, spec["num_classes"],
                   _CIFAR_MEAN[name], _CIFAR_STD[name], augment=True)


def download_cifar(name: str, data_dir: str | os.PathLike | None = None, *,
                   timeout: float = 10.0) -> Path:
    """Download the official CIFAR archive, check its md5 and unpack it into the data directory.

    Args:
        name: "cifar10" or "cifar100".
        data_dir: where to unpack; default as in `resolve_data_dir`.
        timeout: seconds to wait for the server before failing (offline fails at once).

    Returns:
        The unpacked folder, e.g. `DATA/cifar-10-batches-py`.

    Raises:
        FileNotFoundError: if the server cannot be reached or the archive's md5 is wrong.
        ValueError: if the archive cannot be unpacked safely (see `freqact.download`).
    """
    _validate.choice("name", name, tuple(_CIFAR))
    spec = _CIFAR[name]
    return fetch_archive(name, spec["url"], spec["md5"], spec["folder"], resolve_data_dir(data_dir),
                         timeout=timeout)


def load_digits(shape: tuple[int, int, int] = (3, 32, 32), *,
                test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's bundled 8x8 digits, resized to `shape`; works offline.

    The 0-16 gray levels are scaled to 0-255, resized bilinearly (F.interpolate,
    align_corners=False) to (H, W), replicated over the C channels and rounded to uint8. The split
    is deterministic: every sample whose index i satisfies i % round(1 / test_fraction) == 0 is a
    test sample (every 5th at the default 0.2), which keeps the class balance of the file's order.

    Args:
        shape: (C, H, W) of the images to produce.
        test_fraction: approximate fraction of the 1797 samples held out for testing, in (0, 1].

    Returns:
        The dataset, 10 classes, no augmentation.
    """
    from sklearn.datasets import load_digits as sk_digits

    channels, height, width = _image_shape(shape)
    _validate.unit_ratio("test_fraction", test_fraction)
    digits = sk_digits()
    gray = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) * (255.0 / 16.0)
    gray = F.interpolate(gray, size=(height, width), mode="bilinear", align_corners=False)
    images = gray.round().clamp(0, 255).to(torch.uint8).expand(-1, channels, -1, -1).contiguous()
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    is_test = torch.arange(len(labels)) % max(1, round(1 / test_fraction)) == 0
    mean, std = _channel_stats(images[~is_test])
    return Dataset("digits", images[~is_test], labels[~is_test], images[is_test], labels[is_test],
                   10, mean, std)


def load_synthetic(
    num_train: int = 512,
    num_test: int = 256,
    *,
    shape: tuple[int, int, int] = (3, 32, 32),
    num_classes: int = 10,
    seed: int = 0,
) -> Dataset:
    """A seeded random dataset a small network learns within a few steps.

    Each class owns a smooth pattern (random 4x4 grid, bilinearly upsampled to (H, W)); a sample is
    its class pattern plus independent pixel noise, mapped to uint8. Same arguments, same data.

    Args:
        num_train, num_test: number of training / test samples.
        shape: (C, H, W) of the images.
        num_classes: number of classes.
        seed: seed of the generator that draws patterns, labels and noise.

    Returns:
        The dataset, no augmentation.
    """
    channels, height, width = _image_shape(shape)
    for arg, value in (("num_train", num_train), ("num_test", num_test),
                       ("num_classes", num_classes)):
        _validate.positive_int(arg, value)
    gen = torch.Generator().manual_seed(seed)
    grid = torch.randn(num_classes, channels, 4, 4, generator=gen)
    patterns = F.interpolate(grid, size=(height, width), mode="bilinear", align_corners=False)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(num_classes, (n,), generator=gen)
        x = patterns[labels] + 0.5 * torch.randn(n, channels, height, width, generator=gen)
        return (128 + 40 * x).round().clamp(0, 255).to(torch.uint8), labels

    train_x, train_y = draw(num_train)
    test_x, test_y = draw(num_test)
    mean, std = _channel_stats(train_x)
    return Dataset("synthetic", train_x, train_y, test_x, test_y, num_classes, mean, std)


def num_classes(name: str) -> int:
    """The number of classes of dataset `name` (the model's output size): 256 for text."""
    _validate.choice("dataset", name, DATASETS)
    if name == TEXT_DATASET:
        return text.VOCAB_SIZE
    return _CIFAR["cifar100"]["num_classes"] if name == "cifar100" else 10


def load_text(context: int = 64, subset: int | None = None) -> Dataset:
    """`stdlib-text`: the standard library's sources (`TEXT_BYTES` of them) as next-byte windows.

    Both splits are cut into non-overlapping windows (`text.tiled_windows`), so an epoch reads
    the training text once, in a shuffled window order.

    Args:
        context: window length T (the model's context).
        subset: keep only the first `subset` training windows.

    Returns:
        The dataset: uint8 windows (M, T) as images, their next bytes, int64 (M, T), as labels.
    """
    corpus = text.load_stdlib_corpus(TEXT_BYTES)
    (train_x, train_y), (test_x, test_y) = (text.tiled_windows(split, context)
                                            for split in (corpus.train, corpus.test))
    if subset is not None:
        train_x, train_y = train_x[:subset], train_y[:subset]
    return Dataset(TEXT_DATASET, train_x.to(torch.uint8), train_y, test_x.to(torch.uint8), test_y,
                   corpus.vocab_size, (), ())


def load(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool = False,
    shape: tuple[int, int, int] = (3, 32, 32),
    subset: int | None = None,
    seed: int = 0,
) -> Dataset:
    """Load a dataset by name.

    Args:
        name: one of `DATASETS`.
        data_dir: CIFAR's data directory (see `resolve_data_dir`); ignored by the others.
        download: CIFAR only: fetch the archive when missing.
        shape: (C, H, W) for digits and synthetic; CIFAR is always (3, 32, 32); (T,) for text,
            the window length.
        subset: keep only the first `subset` training images (the test set is always whole);
            synthetic draws exactly `subset` training images (default 512).
        seed: synthetic only: its generator seed.

    Returns:
        The dataset.
    """
    _validate.choice("dataset", name, DATASETS)
    if subset is not None:
        _validate.positive_int("subset", subset)
    if name == TEXT_DATASET:
        return load_text(_validate.positive_int("shape", shape[0]), subset)
    if name in _CIFAR:
        ds = load_cifar(name, data_dir, download=download)
    elif name == "digits":
        ds = load_digits(shape)
    else:
        ds = load_synthetic(subset or 512, shape=shape, seed=seed)
    if subset is not None:
        ds.train_images, ds.train_labels = ds.train_images[:subset], ds.train_labels[:subset]
    return ds


def load_for_model(
    name: str,
    model: torch.nn.Module,
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool = False,
    subset: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Dataset:
    """`load` shaped for `model`, with the whole dataset moved to `device` once.

    digits/synthetic are made at the model's (C, H, W) `input_shape`; a model with a 1D input
    (F,) gets 3x32x32 images flattened by `model_inputs`, so F must be 3072; for text, (F,) is
    the model's context T, the window length.

    Args:
        name, data_dir, download, subset, seed: as in `load`.
        model: a network with an `input_shape` attribute ((C, H, W) or (F,); default (3, 32, 32)).
        device: where the uint8 images and labels are kept (batches are then gathered there).

    Returns:
        The dataset, its tensors on `device`.

    Raises:
        ValueError: if the model's 1D input size does not match the images.
    """
    shape = tuple(getattr(model, "input_shape", (3, 32, 32)))
    if name == TEXT_DATASET and len(shape) != 1:
        raise ValueError(f"model: {name} needs a language model with input_shape (T,), got "
                         f"{shape}")
    ds = load(name, data_dir, download=download, subset=subset, seed=seed,
              shape=shape if len(shape) == 3 or name == TEXT_DATASET else (3, 32, 32))
    if name == TEXT_DATASET:
        return _to_device(ds, device)
    image_numel = ds.train_images[0].numel()
    if len(shape) == 1 and shape[0] != image_numel:
        raise ValueError(f"model: its input has {shape[0]} features but {name} images have "
                         f"{tuple(ds.train_images.shape[1:])} = {image_numel} values")
    return _to_device(ds, device)


def _to_device(ds: Dataset, device: str | torch.device) -> Dataset:
    for field in ("train_images", "train_labels", "test_images", "test_labels"):
        setattr(ds, field, getattr(ds, field).to(device))
    return ds


def model_inputs(ds: Dataset, images: torch.Tensor, model: torch.nn.Module,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 images of `ds` -> the float input `model` trains on, on the images' device.

    Args:
        ds: the dataset the images come from (its normalisation constants are used).
        images: uint8, shape (N, C, H, W); text: token windows (N, T).
        model: reads its `input_shape`; a 1D input (F,) gets the images flattened to (N, F).
        generator: CPU generator for CIFAR augmentation (`augment_cifar`); None: no augmentation.

    Returns:
        float32, shape (N, C, H, W) or (N, C*H*W); text: int64 token ids (N, T).
    """
    if ds.name == TEXT_DATASET:
        return images.long()
    if generator is not None:
        images = augment_cifar(images, generator)
    x = normalize(images, ds.mean, ds.std)
    return x.flatten(1) if len(getattr(model, "input_shape", (3, 32, 32))) == 1 else x


def load_or_digits(name: str = "cifar10", data_dir: str | os.PathLike | None = None) -> tuple[Dataset, str]:
    """CIFAR where `load` finds it, else scikit-learn's bundled digits (offline, 3x32x32).

    Args:
        name: "cifar10" or "cifar100".
        data_dir: CIFAR's data directory (see `resolve_data_dir`).

    Returns:
        (dataset, note): the note is one line saying which dataset was taken and why.
    """
    _validate.choice("name", name, tuple(_CIFAR))
    try:
        return load(name, data_dir), f"dataset: {name} from {resolve_data_dir(data_dir)}"
    except FileNotFoundError as err:
        return load("digits"), f"{name} not found, falling back to the digits dataset ({err})"


def augment_cifar(images: torch.Tensor, generator: torch.Generator,
                  padding: int = CIFAR_PADDING) -> torch.Tensor:
    """Random crop from the zero-padded image plus random horizontal flip, on the whole batch.

    The random offsets and flips are drawn on the CPU from `generator` (so runs are reproducible on
    any device) and applied on the images' device by advanced indexing.

    Args:
        images: shape (N, C, H, W), any dtype, on any device.
        generator: CPU generator for the offsets and flips.
        padding: zero padding on each side before cropping back to (H, W).

    Returns:
        Shape (N, C, H, W), same dtype and device.
    """
    n, _, height, width = images.shape
    offsets = torch.randint(2 * padding + 1, (2, n), generator=generator).to(images.device)
    flip = (torch.rand(n, generator=generator) < 0.5).to(images.device)
    padded = F.pad(images, (padding,) * 4)
    rows = offsets[0, :, None] + torch.arange(height, device=images.device)
    rows = rows[:, :, None]  # (N, H, 1)
    cols = offsets[1, :, None] + torch.arange(width, device=images.device)  # (N, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)[:, None, :]  # (N, 1, W)
    batch = torch.arange(n, device=images.device)[:, None, None]
    # padded[batch, :, rows, cols] puts the indexed dims first: (N, H, W, C) -> (N, C, H, W)
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2).contiguous()


def normalize(images: torch.Tensor, mean: tuple[float, ...],
              std: tuple[float, ...]) -> torch.Tensor:
    """uint8 images (N, C, H, W) -> float32 `(x / 255 - mean) / std` per channel, same device."""
    mean_t = torch.tensor(mean, device=images.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=images.device).view(1, -1, 1, 1)
    return (images.float() / 255.0 - mean_t) / std_t


def _image_shape(shape) -> tuple[int, int, int]:
    """Check `shape` is (C, H, W) of positive ints."""
    if not isinstance(shape, (tuple, list)) or len(shape) != 3:
        raise ValueError(f"shape: expected (C, H, W), got {shape!r}")
    return tuple(_validate.positive_int("shape", s) for s in shape)


def _channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of uint8 images (N, C, H, W) scaled to [0, 1]."""
    x = images.double().div(255.0).transpose(0, 1).reshape(images.shape[1], -1)
    std = x.std(dim=1).clamp_min(1e-3)  # a constant channel must not divide by zero
    return tuple(x.mean(dim=1).tolist()), tuple(std.tolist())
