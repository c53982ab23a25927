"""Declared codec settings: name, type, default, range or choices, help, table symbol.

Each codec class lists its settings once (`Codec.settings`, a tuple of `Setting`); everything else
reads them from there: `codecs.get` (keyword and range checks before a value reaches a kernel),
the codec's constructor, `train.RunConfig`'s codec fields and their validation, the `freqact train`
flags and their help, the sweep labels and result columns. A new codec parameter is one new
`Setting` in its codec's tuple (and its use in `encode`).

Settings that several codecs share are the module constants below (one object each, so a run
config has one field per name). This module imports no torch.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from freqact.errors import UsageError, UsageTypeError

# Largest block size B. Any B at or above a map dim already means one block along it, so a larger
# cap buys nothing (activation maps are far smaller; a Linear input of F > 65536 features just gets
# ceil(F / 65536) blocks); and B**3 = 2**48 keeps 3D block volumes far inside int64 in the C kernels
# (ctypes would silently mask an int that does not fit its C type).
MAX_BLOCK = 2**16


@dataclass(frozen=True)
class Setting:
    """One keyword setting of a codec.

    Attributes:
        name: the keyword (and the `RunConfig` field and `--name` flag for training modes).
        type: int, float, str, or tuple (an int or a sequence of ints, e.g. pooling geometry).
        default: used when the setting is not given.
        help: what it means, for the docs and the command line.
        low, high: inclusive bounds of numbers (None: unbounded); `low_open` makes low exclusive.
        choices: the allowed values, when the setting is a choice.
        required: `codecs.get` demands it explicitly (the default then only serves run configs).
        symbol: short name in run labels ("division B=8 Q=2") and tables; None keeps the setting
            out of labels and tables (implementation choices such as the kernel backend).
        column: the results table header (default: `symbol`).
    """

    name: str
    type: type
    default: object
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple = ()
    required: bool = False
    symbol: str | None = None
    column: str | None = None

    @property
    def header(self) -> str | None:
        """The table header of a labelled setting."""
        return self.column or self.symbol

    def expected(self) -> str:
        """What a valid value is, in words: "an integer in [1, 65536]", "one of 1, 2, 4, 8"."""
        if self.choices:
            return "one of " + ", ".join(map(repr, self.choices))
        noun = {int: "an integer", float: "a number", str: "a string",
                tuple: "an integer or a sequence of integers"}[self.type]
        if self.low is None and self.high is None:
            return "a finite number" if self.type is float else noun
        low, high = (f"{b:g}" if self.type is float else str(b) for b in (self.low, self.high))
        if self.high is None:
            return f"{noun} {'>' if self.low_open else '>='} {low}"
        if self.low is None:
            return f"{noun} <= {high}"
        return f"{noun} in {'(' if self.low_open else '['}{low}, {high}]"

    def check(self, value: object, where: str = "") -> object:
        """Return `value` converted to the setting's type if valid, else raise naming the setting.

        Args:
            value: the value given.
            where: prefix of the message, e.g. "codec 'division': ".

        Raises:
            UsageTypeError: a value of the wrong type (bools are not numbers here).
            UsageError: a value outside the range or choices.
        """
        if self.type is tuple and not isinstance(value, numbers.Integral):
            if not isinstance(value, (tuple, list)):
                self._fail(value, where, UsageTypeError)
            return tuple(self._scalar(v, int, value, where) for v in value)
        return self._scalar(value, int if self.type is tuple else self.type, value, where)

    def _scalar(self, value: object, kind: type, given: object, where: str) -> object:
        if kind is str:
            if not isinstance(value, str):
                self._fail(given, where, UsageTypeError)
        elif isinstance(value, bool) or not isinstance(
                value, numbers.Integral if kind is int else numbers.Real):
            self._fail(given, where, UsageTypeError)
        else:
            value = kind(value)
            if kind is float and not math.isfinite(value):
                self._fail(given, where, UsageError)
        if self.choices and value not in self.choices:
            self._fail(given, where, UsageError)
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if below or (self.high is not None and value > self.high):
            self._fail(given, where, UsageError)
        return value

    def _fail(self, value: object, where: str, error: type) -> None:
        raise error(f"{where}{self.name}: expected {self.expected()}, got {value!r}")


def resolve(codec: str, settings: tuple[Setting, ...], args: tuple, params: dict) -> dict:
    """The checked values of every setting of `codec`, from positional `args` and keywords.

    Args:
        codec: the codec's name, for messages.
        settings: its declared settings; positional arguments follow their order.
        args, params: what the caller gave.

    Returns:
        {setting name: checked value} for every setting, defaults filled in, in declared order.

    Raises:
        UsageTypeError: too many positional arguments, an unknown keyword (the message lists the
            known ones), a setting given twice, or a required setting missing (named, with its
            meaning).
        UsageError, UsageTypeError: a value `Setting.check` refuses.
    """
    where = f"codec {codec!r}: "
    known = ", ".join(s.name for s in settings) or "none"
    if len(args) > len(settings):
        raise UsageTypeError(f"{where}expected at most {len(settings)} positional settings "
                             f"({known}), got {len(args)}")
    given = dict(zip((s.name for s in settings), args))
    for name, value in params.items():
        if name in given:
            raise UsageTypeError(f"{where}setting {name!r} given twice")
        given[name] = value
    names = {s.name for s in settings}
    unknown = [name for name in given if name not in names]
    if unknown:
        raise UsageTypeError(f"{where}unknown setting {unknown[0]!r}; its settings: {known}")
    values = {}
    for s in settings:
        if s.name in given:
            values[s.name] = s.check(given[s.name], where)
        elif s.required:
            raise UsageTypeError(f"{where}missing required setting {s.name!r} ({s.help}: "
                                 f"{s.expected()})")
        else:
            values[s.name] = s.default
    return values


RATIO = Setting("ratio", float, 0.5, "kept fraction W/N of each spatial frequency axis",
                low=0.0, high=1.0, low_open=True, required=True, symbol="r", column="ratio")
BLOCK = Setting("block", int, 8, "block size B per spatial dim (a dim shorter than B is one block)",
                low=1, high=MAX_BLOCK, symbol="B")
BITS = Setting("bits", int, 2, "bits Q per residual code", choices=(1, 2, 4, 8), symbol="Q")
BACKEND = Setting(
    "backend", str, "auto",
    "kernels: auto ($FREQACT_KERNELS when set, else Triton on CUDA, C on the CPU, the torch "
    "reference where those are missing), or force torch, cpu or triton",
    choices=("auto", "torch", "cpu", "triton"))
WINDOW_RULE = Setting(
    "window_rule", str, "nearest",
    "how ratio becomes the kept window W of each axis (freqact.dct.windows): nearest (W = r*N "
    "rounded half up, at least 1) or official (the DIVISION code's round(r*N + 0.5))",
    # = freqact.dct.WINDOW_RULES, written out because this module imports no torch (tested equal).
    choices=("nearest", "official"))
