"""Data: CIFAR parsing (generated official-format files and the real data), the safe unpickler,
download, digits, synthetic, and the tensor augmentation."""
from __future__ import annotations

import hashlib
import io
import pickle
import tarfile
import urllib.error

import numpy as np
import pytest
import torch

from freqact import data, download


def _write_batch(path, images: np.ndarray, labels, label_key=b"labels", protocol=2) -> None:
    """A batch file in the official layout: rows of 3072 channel-major bytes (python-2 pickle)."""
    batch = {b"batch_label": b"generated", b"data": images.reshape(len(images), -1),
             label_key: labels}
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=protocol)


def _fake_cifar10(root, n_train=(3, 2, 4, 1, 5), n_test=7, seed=0, protocol=2):
    """Write cifar-10-batches-py under root; return the source (images, labels) per split."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train_x, train_y = [], []
    for i, n in enumerate(n_train, 1):
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, n).tolist()
        _write_batch(folder / f"data_batch_{i}", x, y, protocol=protocol)
        train_x.append(x)
        train_y += y
    test_x = rng.integers(0, 256, (n_test, 3, 32, 32), dtype=np.uint8)
    test_y = rng.integers(0, 10, n_test).tolist()
    _write_batch(folder / "test_batch", test_x, test_y, protocol=protocol)
    return np.concatenate(train_x), train_y, test_x, test_y


@pytest.mark.parametrize("protocol", [2, 4])
def test_generated_cifar10_parses_pixel_exact(tmp_path, protocol):
    train_x, train_y, test_x, test_y = _fake_cifar10(tmp_path, protocol=protocol)
    ds = data.load("cifar10", tmp_path)
    assert ds.train_images.dtype == torch.uint8 and ds.train_images.shape == (15, 3, 32, 32)
    assert ds.test_images.shape == (7, 3, 32, 32)  # any test size, not 10,000
    np.testing.assert_array_equal(ds.train_images.numpy(), train_x)
    np.testing.assert_array_equal(ds.test_images.numpy(), test_x)
    assert ds.train_labels.tolist() == train_y and ds.test_labels.tolist() == test_y
    assert ds.num_classes == 10 and ds.augment


def test_generated_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
    fine, coarse = [99, 0, 42, 7], [19, 0, 3, 1]
    for name in ("train", "test"):
        batch = {b"data": x.reshape(4, -1), b"fine_labels": fine, b"coarse_labels": coarse}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    ds = data.load("cifar100", tmp_path)
    assert ds.num_classes == 100 and ds.train_labels.tolist() == fine
    np.testing.assert_array_equal(ds.test_images.numpy(), x)


def test_subset_takes_first_training_images_and_whole_test_set(tmp_path):
    train_x, _, test_x, _ = _fake_cifar10(tmp_path)
    ds = data.load("cifar10", tmp_path, subset=4)
    np.testing.assert_array_equal(ds.train_images.numpy(), train_x[:4])
    assert len(ds.test_labels) == len(test_x)


def test_real_cifar10(cifar_dir):
    ds = data.load("cifar10", cifar_dir.parent)
    assert ds.train_images.shape == (50000, 3, 32, 32)
    assert sorted(ds.train_labels.unique().tolist()) == list(range(10))
    per_channel = ds.train_images.transpose(0, 1).reshape(3, -1)
    means = per_channel.sum(1, dtype=torch.int64) / (255 * per_channel.shape[1])
    np.testing.assert_allclose(means.numpy(), [0.4914, 0.4822, 0.4465], atol=5e-4)
    assert len(ds.test_labels) > 0 and int(ds.test_labels.max()) < 10


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("FREQACT_DATA", raising=False)
    assert data.resolve_data_dir() == data.resolve_data_dir("data")
    monkeypatch.setenv("FREQACT_DATA", str(tmp_path))
    assert data.resolve_data_dir() == tmp_path
    assert data.resolve_data_dir(tmp_path / "x") == tmp_path / "x"


def test_missing_cifar_says_where_and_how(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py") as err:
        data.load("cifar10", tmp_path)
    assert "--download" in str(err.value) and "FREQACT_DATA" in str(err.value)


class _Payload:
    """Unpickling this creates `path` (by calling `open(path, "w")`): a stand-in for any code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_crafted_pickle_runs_nothing(tmp_path):
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(proof)))  # the plain unpickler runs the payload
    assert proof.exists()

    target = tmp_path / "pwned"
    bad = tmp_path / "cifar-10-batches-py"
    _fake_cifar10(tmp_path)
    (bad / "data_batch_3").write_bytes(pickle.dumps({b"data": _Payload(target), b"labels": []}))
    with pytest.raises(ValueError, match="data_batch_3"):
        data.load("cifar10", tmp_path)
    assert not target.exists()


def test_object_arrays_and_truncated_files_are_refused(tmp_path):
    path = tmp_path / "obj"
    path.write_bytes(pickle.dumps({b"data": np.array([1, "a"], dtype=object)}, protocol=2))
    with pytest.raises(ValueError, match="non-numeric"):
        data.load_pickle(path)
    good = pickle.dumps({b"data": np.zeros((2, 3), np.uint8)}, protocol=2)
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=str(path)):
        data.load_pickle(path)


def _archive(tmp_path) -> bytes:
    """The generated CIFAR-10 folder as a .tar.gz, like the official archive."""
    source = tmp_path / "source"
    _fake_cifar10(source)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return buffer.getvalue()


def test_download_checks_md5_then_unpacks(tmp_path, monkeypatch):
    blob = _archive(tmp_path)
    monkeypatch.setattr(download.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(blob))
    with pytest.raises(FileNotFoundError, match="md5"):
        data.load("cifar10", tmp_path / "d1", download=True)
    assert not (tmp_path / "d1" / "cifar-10-batches-py").exists()

    spec = {**data._CIFAR["cifar10"], "md5": hashlib.md5(blob).hexdigest()}
    monkeypatch.setitem(data._CIFAR, "cifar10", spec)
    ds = data.load("cifar10", tmp_path / "d2", download=True)
    assert ds.train_images.shape == (15, 3, 32, 32)


def test_download_offline_fails_at_once(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(download.urllib.request, "urlopen", offline)
    with pytest.raises(FileNotFoundError, match="could not download") as err:
        data.load("cifar10", tmp_path, download=True)
    assert str(tmp_path) in str(err.value)


def test_digits_resized_and_replicated():
    from sklearn.datasets import load_digits

    ds = data.load("digits", shape=(3, 32, 32))
    n = len(load_digits().target)
    assert len(ds.train_labels) + len(ds.test_labels) == n
    assert ds.train_images.shape[1:] == (3, 32, 32) and ds.train_images.dtype == torch.uint8
    assert torch.equal(ds.train_images[:, 0], ds.train_images[:, 2])
    # bilinear upsampling keeps each image's mean gray level (up to edge effects and rounding)
    original = torch.as_tensor(load_digits().images, dtype=torch.float64) * 255 / 16
    is_test = torch.arange(n) % 5 == 0
    np.testing.assert_allclose(ds.test_images[:, 0].double().mean((1, 2)),
                               original[is_test].mean((1, 2)), atol=6)
    again = data.load("digits", shape=(1, 16, 16))
    assert again.train_images.shape[1:] == (1, 16, 16)
    assert torch.equal(again.test_labels, ds.test_labels)


def test_synthetic_is_seeded_and_learnable():
    a = data.load("synthetic", subset=300, seed=3)
    b = data.load("synthetic", subset=300, seed=3)
    c = data.load("synthetic", subset=300, seed=4)
    assert torch.equal(a.train_images, b.train_images)
    assert not torch.equal(a.train_images, c.train_images)
    assert a.train_images.shape == (300, 3, 32, 32)
    # a nearest-class-mean classifier already separates the classes
    x_tr, x_te = a.train_images.flatten(1).double(), a.test_images.flatten(1).double()
    centroids = torch.stack([x_tr[a.train_labels == k].mean(0) for k in range(a.num_classes)])
    accuracy = (torch.cdist(x_te, centroids).argmin(1) == a.test_labels).double().mean()
    assert accuracy > 0.9


def test_augment_is_a_random_crop_of_the_padded_image_and_a_fair_flip(device):
    n, size, pad = 3000, 6, 4
    images = (torch.arange(size * size) + 1).view(1, 1, size, size).expand(n, 2, -1, -1).to(device)
    out = data.augment_cifar(images, torch.Generator().manual_seed(0), padding=pad).cpu()
    assert out.shape == images.shape and out.dtype == images.dtype
    padded = torch.nn.functional.pad(images[:1].cpu(), (pad,) * 4)[0, 0]
    candidates = torch.stack([w for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)
                              for w in (padded[dy:dy + size, dx:dx + size],
                                        padded[dy:dy + size, dx:dx + size].flip(1))])  # (162, 6, 6)
    match = (out[:, 0, None] == candidates[None]).flatten(2).all(2)  # (n, 162)
    assert match.sum(1).eq(1).all()  # every output is exactly one crop, flipped or not
    choice = match.int().argmax(1)
    assert torch.equal(out[:, 0], out[:, 1])  # same crop for all channels
    flipped = (choice % 2).double().mean()
    assert abs(flipped - 0.5) < 4.5 * (0.25 / n) ** 0.5
    for offsets in (choice // 2 // (2 * pad + 1), choice // 2 % (2 * pad + 1)):
        counts = torch.bincount(offsets, minlength=2 * pad + 1).double()
        chi2 = ((counts - n / (2 * pad + 1)) ** 2 / (n / (2 * pad + 1))).sum()
        assert chi2 < 26.1  # chi-square, 8 degrees of freedom, p = 0.001


def test_normalize_against_float64(device):
    images = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8, device=device)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    mean64 = torch.tensor(mean, dtype=torch.float64).view(3, 1, 1)
    expected = (images.cpu().double() / 255 - mean64) / torch.tensor(std).double().view(3, 1, 1)
    out = data.normalize(images, mean, std)
    assert out.dtype == torch.float32 and out.device == images.device
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="mnist"), "dataset"),
    (dict(name="synthetic", subset=0), "subset"),
    (dict(name="digits", shape=(32, 32)), "shape"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        data.load(**kwargs)



def test_load_for_model_shapes_data_for_the_model():
    class Flat(torch.nn.Module):
        input_shape = (3 * 32 * 32,)

    class Small(torch.nn.Module):
        input_shape = (1, 8, 8)

    ds = data.load_for_model("synthetic", Small(), subset=4)
    assert ds.train_images.shape == (4, 1, 8, 8)
    assert data.model_inputs(ds, ds.test_images[:5], Small()).shape == (5, 1, 8, 8)
    flat = data.load_for_model("synthetic", Flat(), subset=4)
    assert data.model_inputs(flat, flat.train_images, Flat()).shape == (4, 3072)
    Flat.input_shape = (100,)
    with pytest.raises(ValueError, match="100 features"):
        data.load_for_model("synthetic", Flat(), subset=4)


def test_load_or_digits_takes_cifar_when_present_else_the_digits(cifar_dir, tmp_path):
    ds, note = data.load_or_digits("cifar10", cifar_dir.parent)
    assert ds.name == "cifar10" and len(ds.train_labels) == 50_000 and str(cifar_dir.parent) in note
    ds, note = data.load_or_digits("cifar10", tmp_path)
    assert ds.name == "digits" and "falling back to the digits dataset" in note
    assert str(tmp_path) in note  # says where it looked
    with pytest.raises(ValueError, match="name"):
        data.load_or_digits("digits", tmp_path)
