"""Checkpoints: atomic writes, safe loading, and rebuilding the model a checkpoint was trained as.

A checkpoint is a dict (see docs/ARCHITECTURE.md)::

    {"format": "freqact-ckpt-1", "epoch": int, "config": dict of plain JSON types,
     "model": state_dict, "optimizer": state_dict, "scheduler": state_dict,
     "rng": {name: uint8 tensor or int}, "metrics": list[dict]}

Files are only ever loaded with `torch.load(..., weights_only=True)`, which cannot run code, so the
config must stay plain JSON types and RNG states are stored as tensors.
"""
from __future__ import annotations

import io
import os
import pickle
import pickletools
import secrets
import zipfile
from collections.abc import Sequence
from pathlib import Path

import torch

from freqact import models
from freqact.distributed import pick_device

FORMAT = "freqact-ckpt-1"
# The most classes a stored config may ask a rebuilt model for (ImageNet-21k has 21,841).
MAX_CLASSES = 100_000
# How deep a pickle freqact reads may nest values (a checkpoint nests ~10 deep, a CIFAR batch 4):
# Python hashes a tuple recursively in C with no depth check, so a 1 MB file keyed by a tuple
# 10**6 deep crashed torch.load and the CIFAR loader (SIGSEGV) instead of being refused.
MAX_PICKLE_DEPTH = 200
# Pickle opcodes that add to a container already on the stack (the first value they take).
_IN_PLACE = frozenset({"SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS", "BUILD"})
# Types of the stored config fields the analyses read (None is accepted where a run has none).
_CONFIG_TYPES = {"dataset": (str,), "mode": (str,), "data_dir": (str,), "subset": (int,),
                 "seed": (int,), "batch_size": (int,), "epochs": (int,), "model_options": (dict,)}
# Config keys `freqact train` writes as None when the run has none (the RunConfig fields that
# default to None, and "kernels" of a normal run): present with None is a value, not a gap.
MAY_BE_NONE = frozenset({"subset", "data_dir", "device", "save_every", "log_every", "include",
                         "exclude", "kernels"})


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part.

    The bytes go to a temporary file in the same directory, which is flushed, fsynced and renamed
    over `path`; the directory is fsynced so the rename itself survives a crash. The file gets the
    permissions a plain `open(path, "wb")` gives a new file (0o666 less the umask, which the kernel
    applies), not `tempfile.mkstemp`'s 0o600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, uniquely named ".NAME.*.tmp" beside `path` (the pattern `remove_stale_temps` looks
    for), opened for writing with mode 0o666 & ~umask: (descriptor, its path)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:  # pragma: no cover - 64 random bits collided
            continue


def read_bounded(path: str | os.PathLike, limit: int, what: str = "a file freqact reads") -> bytes:
    """The bytes of `path`, refused past `limit` bytes without ever holding more than that.

    Read in 1 MiB chunks: `f.read(limit)` would allocate `limit` bytes up front, and the file's
    stated size says nothing for pipes or devices.

    Raises:
        ValueError: naming the file, if it is larger than `limit` bytes.
    """
    chunks, total = [], 0
    with open(path, "rb") as f:
        while chunk := f.read(min(1 << 20, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ValueError(f"{path}: larger than {limit} bytes; not {what}")
    return b"".join(chunks)


def remove_stale_temps(folder: str | os.PathLike) -> list[Path]:
    """Delete the temporary files `atomic_write` left in `folder` when its process was killed.

    Only call this when no other process writes into `folder` (e.g. when resuming a run).

    Returns:
        The paths removed.
    """
    stale = sorted(Path(folder).glob(".*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def save(path: str | os.PathLike, obj: dict) -> None:
    """Serialise `obj` with torch.save and write it atomically to `path` (see `atomic_write`)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(path, buffer.getvalue())


def load(path: str | os.PathLike) -> dict:
    """Load a freqact checkpoint on the CPU without running any code from the file.

    Args:
        path: a file written by `save` with a checkpoint dict.

    Returns:
        The checkpoint dict (tensors on the CPU).

    Raises:
        FileNotFoundError: if `path` does not exist.
        PermissionError: if `path` cannot be read (the message names it).
        ValueError: naming the file, if it is a directory, truncated, corrupt, needs anything but
            tensors and plain types (weights_only refuses it), has a compressed member or values
            nested more than MAX_PICKLE_DEPTH deep (`_verify_archive`), or is not a freqact
            checkpoint.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"checkpoint: expected a checkpoint file, got the directory {path}")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        _verify_archive(path)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError:
        raise
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path}: not a loadable checkpoint (corrupt, or it needs code to load, "
                         f"which is never run): {_unpickling_reason(err)}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, KeyError, AttributeError,
            OSError) as err:
        # OSError: torch reads a zip whose tail is damaged with seeks past the end (EINVAL).
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: not a loadable checkpoint (truncated or corrupt?): "
                         f"{first_line}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        if not isinstance(ckpt, dict):
            found = f"a {type(ckpt).__name__}"
        elif "format" in ckpt:
            found = f"format {ckpt['format']!r}"
        else:  # e.g. a plain state_dict saved with torch.save
            found = f"a dict without a format entry (keys {sorted(map(str, ckpt))[:3]}...)"
        raise ValueError(f"{path}: expected a freqact checkpoint (format {FORMAT!r}, written by "
                         f"`freqact train`), got {found}")
    return ckpt


def _verify_archive(path: Path) -> None:
    """Check the CRC-32 of every member of the zip torch.save writes, and that none is compressed.

    torch.load does not check checksums, so damaged tensor bytes would otherwise load silently as
    wrong weights. torch.save stores every member as it is; torch.load would inflate a compressed
    one too, so a file of a few MB could hold a storage of zeros of any size (memory without
    bound), while a stored member is never larger than the file.

    Raises:
        zipfile.BadZipFile: if `path` is not a whole zip archive.
        ValueError: if a member is compressed, its bytes do not match their checksum, or a
            pickle in it nests values more than MAX_PICKLE_DEPTH deep (`check_pickle_depth`).
    """
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"member {info.filename} is compressed (torch.save stores "
                                 "every member as it is)")
        damaged = archive.testzip()
        if damaged is not None:
            raise ValueError(f"checksum mismatch in {damaged}")
        for info in archive.infolist():
            if info.filename.endswith(".pkl"):
                check_pickle_depth(info.filename, archive.read(info))


def check_pickle_depth(name: str, data: bytes) -> int:
    """The nesting depth of the values the pickle `data` builds, read from its opcodes without
    building anything (each value on the stack stands for its depth); refused past
    MAX_PICKLE_DEPTH. Checkpoints (`_verify_archive`) and `safepickle` read their pickles past it.

    Raises:
        ValueError: naming `name`, if it nests deeper, or is not a whole pickle.
    """
    stack: list[int | None] = []  # None: a MARK
    memo: dict[object, int] = {}
    deepest = 0
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if op.name == "MEMOIZE" else arg] = (stack[-1] or 0) if stack else 0
            continue
        if op.name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, 0))
            continue
        taken, count = [], len(op.stack_before)
        if pickletools.stackslice in op.stack_before:  # everything above the last MARK, and it
            while stack and stack[-1] is not None:
                taken.append(stack.pop())
            if stack:
                stack.pop()
            count -= 2
        taken += [(stack.pop() or 0) if stack else 0 for _ in range(count)]  # the bottom one last
        if op.name == "DUP":
            made = taken[0] if taken else 0
        elif op.name in _IN_PLACE and taken:
            made = max(taken[-1], 1 + max(taken[:-1], default=-1))
        else:
            made = 1 + max(taken) if taken else 0
        if made > MAX_PICKLE_DEPTH:
            raise ValueError(f"{name} nests values more than {MAX_PICKLE_DEPTH} deep")
        deepest = max(deepest, made)
        stack += [None if item is pickletools.markobject else made for item in op.stack_after]
    return deepest


def _unpickling_reason(err: pickle.UnpicklingError) -> str:
    """The line of torch's weights_only refusal that says what the file asked for.

    torch's message opens with advice to retry with weights_only=False, which would run the
    file's code; it is never repeated to the user.
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), None)
    return detail or "its pickle asks for more than tensors and plain types"


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", *,
               required: Sequence[str] = ()) -> tuple[torch.nn.Module, dict]:
    """Rebuild the model a checkpoint holds, with its trained weights, in eval mode.

    Args:
        path: a checkpoint written by `freqact train`.
        device: where to put the model.
        required: config keys the caller reads besides "model" and "num_classes" (e.g. "dataset");
            missing (`missing_keys`: absent, or None where train never writes None), they are
            refused with the others, before anything is built.

    Returns:
        (model, ckpt): the model `build_model(config["model"], config["num_classes"],
        config.get("model_options"))` with the checkpoint's weights, and the checkpoint dict.

    Raises:
        ValueError: if the device is not one this machine has, the file is not a checkpoint, it
            lacks its "epoch" or a config key (one line naming the file and every missing key), its
            config is not one `freqact train` writes (all checked before anything is built: a known
            model, 1 <= num_classes <= MAX_CLASSES, ...), or its weights do not fit the named
            model.
    """
    device = pick_device(str(device))  # "cuda" without CUDA: the message, not torch's assertion
    ckpt = load(path)
    config = _checked_config(path, ckpt, required)
    if not isinstance(ckpt.get("model"), dict):
        raise ValueError(f"{path}: expected its 'model' entry to be a state dict")
    _check_size(path, config, ckpt["model"])
    model = build_model(config["model"], config["num_classes"], config.get("model_options"))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as err:
        raise ValueError(f"{path}: weights do not fit model {config['model']!r}: {err}") from None
    return model.to(device).eval(), ckpt


def build_model(name: str, num_classes: int, options: dict | None = None) -> torch.nn.Module:
    """`freqact.models.get(name, num_classes, **options)`, with JSON lists as tuples.

    Args:
        name: a `freqact.models` name.
        num_classes: the output size.
        options: the builder's keyword settings as a run's config stores them (JSON: a tuple
            setting such as Swin's `depths` is a list there); None or {}: the defaults.
    """
    options = {key: tuple(v) if isinstance(v, list) else v for key, v in (options or {}).items()}
    return models.get(name, num_classes=num_classes, **options)


def missing_keys(config: dict, keys: Sequence[str]) -> list[str]:
    """The `keys` a stored run config lacks, each once, in order: absent, or None where `freqact
    train` never writes None (a None "subset" or "data_dir" is a run without one: `MAY_BE_NONE`).

    >>> missing_keys({"dataset": "cifar10", "subset": None, "seed": None}, ["dataset", "subset", "seed", "data_dir"])
    ['seed', 'data_dir']
    """
    return [key for key in dict.fromkeys(keys)
            if key not in config or (config[key] is None and key not in MAY_BE_NONE)]


def _check_size(path, config: dict, state: dict) -> None:
    """Refuse a config whose model would hold more values than the checkpoint's weights (a
    crafted `model_options` must not make the rebuild allocate): built on the meta device first."""
    with torch.device("meta"):
        shell = build_model(config["model"], config["num_classes"], config.get("model_options"))
    needed = sum(t.numel() for t in shell.state_dict().values())
    stored = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
    if needed > stored:
        raise ValueError(f"{path}: weights do not fit model {config['model']!r}: it has {needed} "
                         f"values, the checkpoint {stored}")


def _checked_config(path, ckpt: dict, required: Sequence[str] = ()) -> dict:
    """The checkpoint's config, its fields checked before a model is built from them.

    The checkpoint's "epoch" and the config's "model", "num_classes" and `required` keys must be
    there (`missing_keys`; one line names the file and every one missing). A crafted config must
    not make the rebuild allocate (num_classes = 10**9 is a 10**9-row classifier) nor reach code
    paths with values of the wrong type.
    """
    config = ckpt.get("config")
    config = config if isinstance(config, dict) else {}
    missing = missing_keys(config, ("model", "num_classes", *required))
    lacks = (["lacks 'epoch'"] if ckpt.get("epoch") is None else []) + (
        [f"its config lacks {', '.join(map(repr, missing))}"] if missing else [])
    if lacks:
        raise ValueError(f"{path}: {' and '.join(lacks)}, which freqact train writes "
                         "(not a freqact checkpoint, or damaged)")
    if config["model"] not in models.names():
        raise ValueError(f"{path}: config model: expected one of {', '.join(models.names())}, "
                         f"got {config['model']!r}")
    classes = config["num_classes"]
    if isinstance(classes, bool) or not isinstance(classes, int) or not 1 <= classes <= MAX_CLASSES:
        raise ValueError(f"{path}: config num_classes: expected an integer in [1, {MAX_CLASSES}], "
                         f"got {classes!r}")
    for key, types in _CONFIG_TYPES.items():
        value = config.get(key)
        if value is not None and (isinstance(value, bool) is not (bool in types)
                                  or not isinstance(value, types)):
            raise ValueError(f"{path}: config {key}: expected "
                             f"{' or '.join(t.__name__ for t in types)}, got {value!r}")
    return config
