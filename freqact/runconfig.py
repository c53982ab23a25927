"""The settings of a training run: `RunConfig` (checked on construction, stored as plain JSON in
config.json and checkpoints) and the training modes it names.

`freqact.train` runs a `RunConfig` and re-exports every name here (`train.RunConfig`).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Iterable
from pathlib import Path

import torch

from freqact import _validate, codecs, data
from freqact.codecs.settings import Setting
from freqact.errors import UsageError, UsageTypeError

NORMAL_TITLE = "normal training (plain PyTorch)"
MODES = ("normal", *codecs.modes())
"""Training modes: `normal` (no hooks) and the codecs a whole model trains with."""
# The SGD recipe's numbers: finite and in a range that can train (NaN or 1e30 would train to NaN).
_HYPER = (
    Setting("lr", float, 0.1, "initial learning rate", low=0.0, high=10.0),
    Setting("momentum", float, 0.9, "SGD momentum", low=0.0, high=1.0),
    Setting("weight_decay", float, 5e-4, "SGD weight decay", low=0.0, high=1.0),
)
OPTIMIZERS = ("sgd", "adamw")
# include/exclude: bounded lists of torch.nn class names or qualified module names.
SELECTORS = ("include", "exclude")
MAX_SELECTORS = 256
MAX_SELECTOR_CHARS = 256
# Seeds reach torch.manual_seed as seed and seed * 65536 + rank: keep both inside 64 bits.
SEED = Setting("seed", int, 0, "random seed", low=0, high=2**32 - 1)


def mode_title(mode: str) -> str:
    """What a training mode does, in words ("LFC-ACT (only the DCT low band cached)")."""
    _validate.choice("mode", mode, MODES)
    return NORMAL_TITLE if mode == "normal" else codecs.codec_class(mode).title


def mode_settings(mode: str) -> tuple[Setting, ...]:
    """The codec settings `mode` takes (none for `normal`)."""
    _validate.choice("mode", mode, MODES)
    return () if mode == "normal" else codecs.codec_class(mode).settings


def refuse_unused(mode: str, given, name_of=str) -> None:
    """Refuse settings `mode` does not use among the names in `given`: codec settings outside
    `mode_settings(mode)`, and include/exclude under `normal` (it compresses nothing). The
    command line and sweep specs check alike (a normal run given bits ran as a plain one).

    Args:
        name_of: how a setting is named in the error (the command line's flags: "--bits").

    Raises:
        UsageError: naming the first such setting and the mode's own.
    """
    used = [s.name for s in mode_settings(mode)]
    codec_settings = {s.name for s in codecs.mode_settings()}
    for name in given:
        if name in SELECTORS and mode == "normal":
            raise UsageError(f"{name_of(name)}: mode 'normal' does not use it (it compresses "
                             f"nothing)")
        if name in codec_settings and name not in used:
            flags = ", ".join(name_of(n) for n in used) or "none"
            raise UsageError(f"{name_of(name)}: mode {mode!r} does not use it (its settings: "
                             f"{flags})")


@dataclasses.dataclass
class _Identity:
    model: str = "resnet20"
    dataset: str = "cifar10"
    mode: str = "normal"


# One field per setting of the training modes' codecs, declared by the codecs themselves.
_WithCodecSettings = dataclasses.make_dataclass(
    "_WithCodecSettings",
    [(s.name, s.type, dataclasses.field(default=s.default)) for s in codecs.mode_settings()],
    bases=(_Identity,))


@dataclasses.dataclass
class RunConfig(_WithCodecSettings):
    """Everything that defines a training run; plain JSON types only (it goes into checkpoints).

    Attributes:
        model: a `freqact.models` name.
        dataset: one of `freqact.data.DATASETS`.
        mode: one of `MODES`.
        codec settings: one field per setting that a training mode's codec declares
            (`freqact.codecs.mode_settings()`, e.g. ratio, block, bits, backend), with the
            declared default and range. Each mode uses its own codec's settings (`codec_params`);
            the others are checked but not used, and `to_dict` leaves them out.
        epochs, batch_size, lr, momentum, weight_decay: the SGD + cosine recipe; batch_size is
            global (split over the ranks under torchrun); lr in [0, 10], momentum and
            weight_decay in [0, 1], all finite.
        optimizer: "sgd" (default) or "adamw" (momentum unused; see the module docstring).
        model_options: keyword settings of the model's builder (plain JSON: numbers, strings,
            lists for tuples), e.g. {"dim": 64}; {} for the family's defaults.
        subset: train on the first `subset` training images only (the test set is always whole);
            for synthetic, the number of training images drawn.
        seed: seeds the model initialisation, data order, augmentation and codec noise; an
            integer in [0, 2**32 - 1].
        amp: autocast (bfloat16 on CPU; float16 with a GradScaler on CUDA).
        device: "cpu", "cuda", "cuda:N" or None for CUDA when available.
        data_dir: CIFAR data directory (else $FREQACT_DATA, else ./data); made absolute.
        download: download CIFAR when missing.
        out: run directory; None means runs/<model>-<dataset>-<mode>.
        save_epochs: epochs after which `ckpt/epoch-XXXX.pt` is kept.
        save_every: also keep every K-th epoch's checkpoint (None: only `save_epochs`).
        resume: continue the run in `out` from `ckpt/last.pt`, else from its newest loadable
            `ckpt/epoch-XXXX.pt` (start it if there is none yet, so a preemptible job can always
            be relaunched with the same command).
        log_every: print a progress line every N training steps; None: every ~10 % of an epoch
            when stdout is not a terminal (a terminal gets a progress bar instead).
        fsdp: under torchrun, shard the model with FSDP2 instead of wrapping it in DDP (one
            process: no effect).
        include, exclude: None, or a list of torch.nn module type names ("Conv2d", "BatchNorm2d")
            and/or qualified module names of the model ("fc", "layer1.0.conv1"), passed to
            `freqact.compress` as types and names (`selectors`); include restricts compression
            to them, exclude keeps them exact (exclude wins). Checked against the model when the
            run starts; unused by `normal` (and left out of its `to_dict`).
    """

    epochs: int = 100  # the original code's CIFAR runs (94.89 % normal, 94.72 % DIVISION)
    batch_size: int = 256
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    optimizer: str = "sgd"
    model_options: dict = dataclasses.field(default_factory=dict)
    subset: int | None = None
    seed: int = 0
    amp: bool = False
    device: str | None = None
    data_dir: str | None = None
    download: bool = False
    out: str | None = None
    save_epochs: list[int] = dataclasses.field(default_factory=lambda: [20, 40, 60])
    save_every: int | None = None
    resume: bool = False
    log_every: int | None = None
    fsdp: bool = False
    include: list[str] | None = None
    exclude: list[str] | None = None

    def __post_init__(self) -> None:
        _validate.choice("dataset", self.dataset, data.DATASETS)
        _validate.choice("mode", self.mode, MODES)
        _validate.choice("optimizer", self.optimizer, OPTIMIZERS)
        if not isinstance(self.model_options, dict):
            raise UsageError(f"model_options: expected a dict of model settings, got "
                             f"{self.model_options!r}")
        for setting in (*codecs.mode_settings(), *_HYPER, SEED):
            setattr(self, setting.name, setting.check(getattr(self, setting.name)))
        for name in ("epochs", "batch_size"):
            _validate.positive_int(name, getattr(self, name))
        for name in ("subset", "save_every", "log_every"):
            if getattr(self, name) is not None:
                _validate.positive_int(name, getattr(self, name))
        if isinstance(self.save_epochs, (str, bytes)) or not isinstance(self.save_epochs, Iterable):
            raise UsageTypeError(f"save_epochs: expected a list of epochs (integers >= 1), got "
                                 f"{self.save_epochs!r}")
        self.save_epochs = sorted({_validate.positive_int("save_epochs", e)
                                   for e in self.save_epochs})
        for name in SELECTORS:
            setattr(self, name, _selector_list(name, getattr(self, name)))
        if self.out is None:
            self.out = str(Path("runs") / f"{self.model}-{self.dataset}-{self.mode}")
        if self.data_dir is not None:  # recorded absolute: eval and the analyses run elsewhere
            self.data_dir = str(Path(self.data_dir).expanduser().absolute())

    @classmethod
    def from_dict(cls, stored: dict) -> RunConfig:
        """The config of a stored run (`config.json` or a checkpoint's "config"), old or new.

        Keys that are not fields (num_classes, world_size, kernels, the removed `workers`) are
        ignored, and settings a stored config leaves out (a mode's unused codec settings, or
        `backend` before it existed) take their defaults, so every config.json freqact wrote still loads.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in fields})

    def codec_params(self) -> dict:
        """The keyword settings of this mode's codec, e.g. {"block": 8, "bits": 2, "backend":
        "auto"} (empty for `normal`)."""
        return {s.name: getattr(self, s.name) for s in mode_settings(self.mode)}

    def label_params(self) -> dict:
        """The codec settings that name a run in labels and tables, e.g. {"block": 8, "bits": 2}
        (those with a `symbol`; the kernel backend is not one)."""
        return {s.name: getattr(self, s.name) for s in mode_settings(self.mode) if s.symbol}

    def to_dict(self) -> dict:
        """The plain-JSON form written to config.json and checkpoints: every field except the
        codec settings this mode does not use (a division run records no "ratio")."""
        unused = {s.name for s in codecs.mode_settings()} - set(self.codec_params())
        if self.mode == "normal":
            unused |= set(SELECTORS)
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in unused}

    def selectors(self, model: torch.nn.Module) -> dict:
        """`include`/`exclude` resolved against `model`, as `freqact.compress` takes them.

        An entry that names a module class of `torch.nn` ("Conv2d") becomes that type (looked up
        in the torch.nn namespace, nothing imported or evaluated); any other entry must be the
        qualified name of a module of `model` ("fc", "layer1.0.conv1").

        Returns:
            {"include": list of types and names or None, "exclude": ...}.

        Raises:
            UsageError: naming the setting, for an entry that is neither (with close matches).
        """
        names = {name for name, _ in model.named_modules() if name}
        return {key: None if getattr(self, key) is None else
                [_selector(key, entry, names, type(model).__name__) for entry in getattr(self, key)]
                for key in SELECTORS}

    def kernels(self, device: str | torch.device) -> str | None:
        """The kernel backend this run's codec resolves to on `device` ("torch", "cpu" or
        "triton"; None for modes without kernels); recorded as "kernels" in config.json, so runs
        with and without a C compiler (same seed, other noise stream) can be told apart."""
        if self.mode == "normal":
            return None
        return codecs.get(self.mode, **self.codec_params()).backend_used(device)


@functools.cache
def _nn_types() -> dict[str, type]:
    """The module classes of the torch.nn namespace by name ("Conv2d" -> nn.Conv2d)."""
    return {name: cls for name, cls in vars(torch.nn).items()
            if isinstance(cls, type) and issubclass(cls, torch.nn.Module)}


def _selector_list(name: str, value: object) -> list[str] | None:
    """include/exclude as given: None, or a non-empty bounded list of non-empty strings."""
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise UsageTypeError(f"{name}: expected a list of module type names (Conv2d, Linear, ...) "
                             f"or module names (fc, layer1.0.conv1), got {value!r}")
    if not items or len(items) > MAX_SELECTORS:
        raise UsageError(f"{name}: expected 1 to {MAX_SELECTORS} module types or names, "
                         f"got {len(items)}")
    for item in items:
        if not item.strip() or len(item) > MAX_SELECTOR_CHARS:
            raise UsageError(f"{name}: expected a module type name or module name of 1 to "
                             f"{MAX_SELECTOR_CHARS} characters, got {item[:40]!r}")
    return list(items)


def _selector(name: str, entry: str, modules: set[str], model: str) -> type | str:
    """One include/exclude entry as a torch.nn type or a module name of the model."""
    types = _nn_types()
    if entry in types:
        return types[entry]
    if entry in modules:
        return entry
    close = difflib.get_close_matches(entry, [*sorted(modules), *types], n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    raise UsageError(f"{name}: {entry!r} is neither a torch.nn module type (Conv2d, BatchNorm2d, "
                     f"Linear, ...) nor the name of a module of {model}{hint}")
