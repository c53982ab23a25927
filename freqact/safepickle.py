"""A pickle loader for data files: plain containers and numeric numpy arrays, bounded memory.

`load_pickle(path)` reads the CIFAR batches (`freqact.data`); nothing in a file can run code,
and nothing in it can make the loader allocate more than a small multiple of the file's size.
"""
from __future__ import annotations

import io
import os
import pickle
import struct

import numpy as np

from freqact.checkpoint import check_pickle_depth, read_bounded

# Bounds on a pickle freqact reads: CIFAR-100's training file is 155 MB and memoises ~100k objects.
MAX_PICKLE_BYTES = 1 << 30
MAX_PICKLE_MEMO = 1 << 22


class _ArrayClass:
    """What `numpy.ndarray` resolves to in a data pickle: only numpy's reconstructor takes it.

    Calling `numpy.ndarray(shape)` from a pickle would allocate whatever shape the file names.
    """

    def __call__(self, *args, **kwargs):
        raise pickle.UnpicklingError("refusing to call numpy.ndarray")


_ARRAY_CLASS = _ArrayClass()


class _BoundedMemo(dict):
    """The unpickler's memo, refusing indices past MAX_PICKLE_MEMO.

    (Python's C unpickler preallocates its memo up to the index a file names: a 10-byte file
    asking for index 2**31 - 1 takes 16 GiB. The pure-Python unpickler's dict does not, and this
    bounds it anyway.)
    """

    def __setitem__(self, key, value) -> None:
        if not 0 <= key < MAX_PICKLE_MEMO:
            raise pickle.UnpicklingError(f"memo index {key} outside [0, {MAX_PICKLE_MEMO})")
        super().__setitem__(key, value)


class _SafeUnpickler(pickle._Unpickler):
    """An unpickler that can only rebuild builtin containers and numeric numpy arrays.

    The CIFAR batches hold dicts, lists, bytes, ints and numpy arrays; rebuilding an array needs
    three globals (numpy's array reconstructor, `numpy.ndarray` and `numpy.dtype`), and files
    re-pickled by Python 3 at protocol <= 2 spell bytes as `_codecs.encode(str, "latin1")`.
    Every other global, which is how a pickle runs code, is refused before anything is called.
    Object dtypes are refused too: their payload would be unpickled objects, not numbers.
    BUILD (`__setstate__`) only reaches what numpy writes it for: an array's state, and a
    dtype's byte order (`_plain_dtype_state`); any other state would let a file give a dtype
    fields, a subarray or numpy's "holds objects" flags (numpy then reads numbers as object
    pointers), or set attributes on the loader's own functions.

    Memory: the pure-Python unpickler (not the C one, see `_BoundedMemo`) reads from an in-memory
    copy of the file, so every length a file states is bounded by the bytes it really has; the
    array reconstructor only makes empty arrays (their data come from the file), and
    `bytearray8`, which allocates its stated length before reading, is refused.
    """

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch.pop(pickle.BYTEARRAY8[0])

    def __init__(self, file, **kwargs) -> None:
        super().__init__(file, **kwargs)
        self.memo = _BoundedMemo()

    def load_build(self) -> None:
        inst, state = self.stack[-2], self.stack[-1]
        if isinstance(inst, np.dtype):
            if not _plain_dtype_state(state):
                raise pickle.UnpicklingError(f"refusing numpy dtype state {state!r:.80}")
        elif type(inst) is not np.ndarray:
            raise pickle.UnpicklingError(f"refusing BUILD of a {type(inst).__name__}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str):
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return _empty_array
        if module == "numpy" and name == "ndarray":
            return _ARRAY_CLASS
        if module == "numpy" and name == "dtype":
            return _numeric_dtype
        if module == "_codecs" and name == "encode":  # how Python 3 writes bytes at protocol <= 2
            return _latin1_bytes
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


_RECONSTRUCT = np.ndarray(0).__reduce__()[0]  # numpy's own array reconstructor, any version


def _empty_array(cls, shape, dtype) -> np.ndarray:
    """numpy's `_reconstruct(ndarray, (0,), dtype)`, the only call `ndarray.__reduce__` writes."""
    if cls is not _ARRAY_CLASS or shape != (0,):
        raise pickle.UnpicklingError(f"refusing numpy _reconstruct of shape {shape!r}")
    return _RECONSTRUCT(np.ndarray, (0,), dtype)


def _numeric_dtype(*args) -> np.dtype:
    """`numpy.dtype(*args)` for the pickle loader: a plain bool, integer or float dtype; object
    and other non-numeric dtypes, and numeric ones with fields, a subarray or flags, refused."""
    dtype = np.dtype(*args)
    if dtype.kind not in "biuf" or dtype.names is not None or dtype.subdtype is not None \
            or dtype.flags or dtype.metadata is not None:
        raise pickle.UnpicklingError(f"refusing non-numeric numpy dtype {dtype!r:.80}")
    return dtype


def _plain_dtype_state(state: object) -> bool:
    """Whether `state` is what numpy pickles for a plain numeric dtype: only a byte order.

    `np.dtype("<f4").__reduce__()[2] == (3, "<", None, None, None, -1, -1, 0)`; a Python 2 file
    read with encoding="bytes" (the official CIFAR batches) spells the byte order b"|".
    """
    return (isinstance(state, tuple) and len(state) == 8 and type(state[0]) is int
            and state[0] == 3 and state[1] in _BYTE_ORDERS
            and state[2:5] == (None, None, None)
            and all(type(v) is int for v in state[5:]) and state[5:] == (-1, -1, 0))


_BYTE_ORDERS = ("<", ">", "|", "=", b"<", b">", b"|", b"=")


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """`_codecs.encode(text, "latin1")` for the pickle loader; nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


# What a damaged or hostile pickle raises inside the pure-Python unpickler and numpy.
_PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                  KeyError, IndexError, struct.error, OverflowError, MemoryError, RecursionError)


def load_pickle(path: str | os.PathLike) -> object:
    """Load a pickle that may only contain builtin containers and numeric numpy arrays.

    Args:
        path: the pickle file (e.g. a CIFAR batch), at most MAX_PICKLE_BYTES. Python 2 pickles
            are read with bytes keys.

    Returns:
        The unpickled object.

    Raises:
        ValueError: naming the file, if it is not such a pickle (truncated, corrupt, too large,
            asking for absurd sizes, nesting values more than `checkpoint.MAX_PICKLE_DEPTH` deep, or
            for any other global, which is how a pickle would run code).
    """
    raw = read_bounded(path, MAX_PICKLE_BYTES, "a data file")
    try:
        check_pickle_depth("it", raw)  # a tuple key nested 10**6 deep crashed Python as it hashed
        return _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except _PICKLE_ERRORS as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{path}: not a plain-data pickle ({reason})") from None
