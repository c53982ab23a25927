"""Fetching a published archive: download with a timeout, check its md5, unpack one folder safely.

`freqact.data.download_cifar` is the caller: it names the archive (url, md5, folder) and the data
directory; this module knows nothing about the datasets themselves.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path


def fetch_archive(name: str, url: str, md5: str, folder: str, root: Path, *,
                  timeout: float = 10.0) -> Path:
    """Download the .tar.gz at `url`, check its md5 and unpack its `folder` into `root`.

    Args:
        name: the dataset, for the messages ("cifar10").
        url: the archive's address.
        md5: its published md5 (hex).
        folder: the folder of the archive to unpack, e.g. "cifar-10-batches-py".
        root: the data directory (created when missing).
        timeout: seconds to wait for the server before failing (offline fails at once).

    Returns:
        The unpacked folder, `root / folder`.

    Raises:
        FileNotFoundError: if the server cannot be reached or the archive's md5 is wrong.
        ValueError: if the archive cannot be unpacked safely (see `_unpack`).
    """
    root.mkdir(parents=True, exist_ok=True)
    digest = hashlib.md5()
    with tempfile.TemporaryFile(dir=root) as archive:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                for chunk in iter(lambda: response.read(1 << 20), b""):
                    digest.update(chunk)
                    archive.write(chunk)
        except (urllib.error.URLError, OSError) as err:
            raise FileNotFoundError(
                f"{name}: could not download {url} ({err}); offline, download it elsewhere "
                f"and unpack it into {root} (giving {root / folder}), or set --data-dir / "
                "$FREQACT_DATA"
            ) from None
        if digest.hexdigest() != md5:
            raise FileNotFoundError(
                f"{name}: {url} has md5 {digest.hexdigest()}, expected {md5}; "
                "the download is corrupt, try again"
            )
        archive.seek(0)
        _unpack(archive, folder, root, url)
    return root / folder


def _unpack(archive, folder: str, root: Path, source: str) -> None:
    """Extract `folder` of a .tar.gz into `root`: nothing but that folder ever lands there.

    The archive goes into a fresh temporary folder beside the target, then `folder` is moved into
    place whole (one rename). When `root/folder` already exists (some files missing), only the
    missing files are moved in: an existing file is never overwritten, and members outside
    `folder` are dropped with the temporary folder.

    Raises:
        ValueError: one line naming `source`, if the archive is not a clean tar.gz (the `data`
            filter refuses absolute paths, links out of the tree, devices) or lacks `folder`;
            naming `root/folder`, if that is a file.
    """
    scratch = Path(tempfile.mkdtemp(dir=root, prefix=".freqact-unpack-"))
    try:
        try:
            with tarfile.open(fileobj=archive, mode="r:gz") as tar:
                tar.extractall(scratch, filter="data")
        except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise ValueError(f"{source}: cannot unpack the archive safely "
                             f"({type(err).__name__}: {err})") from None
        unpacked, target = scratch / folder, root / folder
        if not unpacked.is_dir() or unpacked.is_symlink():
            raise ValueError(f"{source}: the archive holds no folder {folder}")
        if not target.exists():
            os.rename(unpacked, target)
            return
        if not target.is_dir():
            raise ValueError(f"{target}: expected the folder {folder} (or nothing) there, found a "
                             "file; move it away to unpack the archive")
        for path in sorted(unpacked.iterdir()):
            if not (target / path.name).exists() and path.is_file() and not path.is_symlink():
                os.rename(path, target / path.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
