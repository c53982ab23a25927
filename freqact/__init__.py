"""freqact: activation maps in the frequency domain, and training with compressed activations.

The main names are importable from the package root::

    import freqact
    lfc, hfc = freqact.split(x, ratio=0.1)           # DCT low-/high-frequency components
    with freqact.compress(model, "division") as meter:
        loss = criterion(model(x), y)
    loss.backward()

`freqact.dct` stays the DCT module (`freqact.dct.dct(x)`, `freqact.dct.idct(X)`): re-exporting the
function `dct` at the root would hide the module of the same name.
"""
__version__ = "0.1.0"

import importlib

# Imported on first use (PEP 562), so that `python -m freqact --help` and `import freqact.errors`
# do not pay for importing torch: the submodules, engine's two names, and the dct helpers.
__all__ = [
    "Meter", "band_energy", "block_dct", "codecs", "compress", "highpass", "highpass_mask",
    "idct", "lowpass", "lowpass_mask", "models", "radial_spectrum", "split",
]
_SUBMODULES = ("codecs", "models")
_FROM_ENGINE = ("Meter", "compress")


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'freqact' has no attribute {name!r}")
    if name in _SUBMODULES:
        value = importlib.import_module(f"freqact.{name}")
    else:
        source = "freqact.engine" if name in _FROM_ENGINE else "freqact.dct"
        value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
