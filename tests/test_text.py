"""Tests for freqact.text: the standard library as a byte-level corpus."""
from __future__ import annotations

import pytest
import torch

from freqact import text


@pytest.fixture(scope="module")
def corpus() -> text.TextCorpus:
    return text.load_stdlib_corpus(max_bytes=200_000)


def test_corpus_is_deterministic(corpus):
    again = text.load_stdlib_corpus(max_bytes=200_000)
    assert torch.equal(again.train, corpus.train) and torch.equal(again.test, corpus.test)
    assert again.train_files == corpus.train_files and again.sha256 == corpus.sha256


def test_budget_split_and_order(corpus):
    assert corpus.train.numel() + corpus.test.numel() == 200_000
    assert corpus.train.dtype == corpus.test.dtype == torch.uint8
    assert not set(corpus.train_files) & set(corpus.test_files)
    files = text.source_files()
    taken = [f for f in files if f in set(corpus.train_files + corpus.test_files)]
    assert taken == files[: len(taken)]  # a prefix of the sorted list, nothing skipped
    assert list(corpus.test_files) == taken[9::10]
    assert all(f.endswith(".py") and "site-packages" not in f for f in taken)
    # The bytes are the files' bytes: the first training file starts the training split.
    first = (text.stdlib_root() / corpus.train_files[0]).read_bytes()
    assert bytes(corpus.train[: min(len(first), 1000)].tolist()) == first[:1000]


def test_small_root_split_by_file(tmp_path):
    for i in range(5):
        (tmp_path / f"m{i}.py").write_bytes(bytes([65 + i]) * 10)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.py").write_bytes(b"zzz")
    (tmp_path / "notes.txt").write_bytes(b"not python")
    c = text.load_stdlib_corpus(max_bytes=45, test_every=2, root=tmp_path)
    assert c.train_files == ("m0.py", "m2.py", "m4.py") and c.test_files == ("m1.py", "m3.py")
    assert bytes(c.train.tolist()) == b"A" * 10 + b"C" * 10 + b"E" * 5  # the budget cuts m4.py
    assert bytes(c.test.tolist()) == b"B" * 10 + b"D" * 10


def test_sample_windows_shapes_targets_and_seed(corpus):
    g = torch.Generator().manual_seed(3)
    x, y = text.sample_windows(corpus.train, context=16, batch=5, generator=g)
    assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < text.VOCAB_SIZE
    x2, _ = text.sample_windows(corpus.train, 16, 5, torch.Generator().manual_seed(3))
    assert torch.equal(x, x2)
    # Every window is a substring of the training bytes.
    raw = bytes(corpus.train.tolist())
    assert all(bytes(row.tolist()) in raw for row in x)


def test_tiled_windows_cover_the_data_in_order():
    data = torch.arange(23, dtype=torch.uint8)
    x, y = text.tiled_windows(data, context=5)
    assert torch.equal(x.flatten(), torch.arange(20))
    assert torch.equal(y.flatten(), torch.arange(1, 21))


@pytest.mark.parametrize(
    "kwargs, error, arg",
    [({"max_bytes": 0}, ValueError, "max_bytes"), ({"test_every": 1}, ValueError, "test_every"),
     ({"root": "/nonexistent"}, ValueError, "root")],
)
def test_bad_corpus_arguments(kwargs, error, arg):
    with pytest.raises(error, match=arg):
        text.load_stdlib_corpus(**kwargs)


def test_bad_window_arguments():
    g = torch.Generator()
    with pytest.raises(TypeError, match="data"):
        text.sample_windows(torch.zeros(50), 4, 2, g)
    with pytest.raises(ValueError, match="data"):
        text.tiled_windows(torch.zeros(4, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="batch"):
        text.sample_windows(torch.zeros(50, dtype=torch.uint8), 4, 0, g)
