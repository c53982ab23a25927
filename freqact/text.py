"""A real text corpus that ships with every machine: the Python standard library's own source.

Character-level (byte-level) language-modelling data for the `gpt` model, offline and
deterministic::

    corpus = freqact.text.load_stdlib_corpus(max_bytes=2**21)
    x, y = freqact.text.sample_windows(corpus.train, context=64, batch=32, generator=g)
    # x, y: int64 (32, 64) token ids in [0, 256); y is x shifted left by one byte

The files are the `*.py` files under `sysconfig.get_paths()["stdlib"]` (third-party
`site-packages`/`dist-packages` and `__pycache__` folders pruned), in sorted order of their
relative POSIX path. They are read one by one until `max_bytes` are taken (the last file is
truncated), so memory stays bounded by the budget plus one file. Tokens are the bytes themselves
(vocabulary 256, no tokenizer to build or ship). Train and test are split by file: every
`test_every`-th file of the sorted list goes to the test split, so no text is shared and both
splits span the whole library. The corpus is the same on every run of one Python installation;
another Python version gives another (also fixed) corpus, which `TextCorpus.sha256` identifies.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from freqact import _validate

VOCAB_SIZE = 256
_PRUNED = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class TextCorpus:
    """Byte-level text, split by file.

    Attributes:
        train: uint8 (L_train,), the training files' bytes concatenated.
        test: uint8 (L_test,), the test files' bytes concatenated.
        train_files: relative POSIX paths of the training files, in order.
        test_files: relative POSIX paths of the test files, in order.
        sha256: hex digest of train then test bytes (identifies the corpus across machines).
        vocab_size: 256 (token id = byte value).
    """

    train: torch.Tensor
    test: torch.Tensor
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    sha256: str
    vocab_size: int = VOCAB_SIZE


def stdlib_root() -> Path:
    """The folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: str | os.PathLike | None = None) -> list[str]:
    """Relative POSIX paths of the `*.py` files under `root` (default `stdlib_root()`), sorted.

    Raises:
        ValueError: if `root` is not a directory.
    """
    root = Path(stdlib_root() if root is None else root)
    if not root.is_dir():
        raise ValueError(f"root: expected a directory of Python sources, got {str(root)!r}")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _PRUNED]  # prune in place: os.walk skips them
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def load_stdlib_corpus(max_bytes: int = 2**21, *, test_every: int = 10,
                       root: str | os.PathLike | None = None) -> TextCorpus:
    """Read the standard library's sources into a byte-level train/test corpus.

    Args:
        max_bytes: total bytes to take (train + test), in file order.
        test_every: every `test_every`-th file (1-based) goes to the test split; >= 2.
        root: folder to read instead of the standard library (tests use small folders).

    Returns:
        The corpus; see `TextCorpus`.

    Raises:
        ValueError: if an argument is out of range, `root` is not a directory, or fewer than
            `test_every` files could be read (no test split).
    """
    _validate.positive_int("max_bytes", max_bytes)
    if _validate.positive_int("test_every", test_every) < 2:
        raise ValueError(f"test_every: expected an integer >= 2, got {test_every}")
    root = Path(stdlib_root() if root is None else root)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    left, index = max_bytes, 0
    for name in source_files(root):
        if left == 0:
            break
        try:
            data = (root / name).read_bytes()[:left]
        except OSError:  # an unreadable file is skipped; the rest of the order is unchanged
            continue
        index += 1
        is_test = index % test_every == 0
        parts[is_test].append(data)
        names[is_test].append(name)
        left -= len(data)
    if not names[True]:
        raise ValueError(f"root: expected at least test_every={test_every} readable .py files "
                         f"under {str(root)!r} within max_bytes={max_bytes}, got {index}")
    train, test = b"".join(parts[False]), b"".join(parts[True])
    return TextCorpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        test=torch.frombuffer(bytearray(test), dtype=torch.uint8),
        train_files=tuple(names[False]),
        test_files=tuple(names[True]),
        sha256=hashlib.sha256(train + test).hexdigest(),
    )


def _check_windows(data: object, context: int) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError(f"data: expected a 1D uint8 tensor of bytes, got {data!r:.60}")
    _validate.positive_int("context", context)
    if data.numel() < context + 1:
        raise ValueError(f"data: expected at least context + 1 = {context + 1} bytes, "
                         f"got {data.numel()}")


def sample_windows(data: torch.Tensor, context: int, batch: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random training windows and their next-byte targets.

    Args:
        data: uint8 (L,) bytes, e.g. `TextCorpus.train`.
        context: window length T.
        batch: number of windows N (start offsets uniform, drawn from `generator`).
        generator: the source of the offsets (the same state gives the same batch).

    Returns:
        (x, y), both int64 (N, T): x = data[o : o + T], y = data[o + 1 : o + T + 1].
    """
    _check_windows(data, context)
    _validate.positive_int("batch", batch)
    starts = torch.randint(0, data.numel() - context, (batch,), generator=generator)
    index = starts[:, None] + torch.arange(context + 1)  # (N, T + 1)
    seq = data[index].long()
    return seq[:, :-1], seq[:, 1:]


def tiled_windows(data: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows covering `data` from the start (evaluation batches).

    Args:
        data: uint8 (L,) bytes, e.g. `TextCorpus.test`.
        context: window length T.

    Returns:
        (x, y), both int64 (M, T) with M = (L - 1) // T: window i is data[i T : (i + 1) T]
        and y the same bytes shifted by one.
    """
    _check_windows(data, context)
    count = (data.numel() - 1) // context
    x = data[: count * context].long().view(count, context)
    y = data[1: count * context + 1].long().view(count, context)
    return x, y
