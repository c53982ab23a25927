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

# name -> module it comes from. Imported on first use (PEP 562), so that `python -m freqact
# --help` and `import freqact.errors` do not pay for importing torch.
_EXPORTS = {
    "codecs": None,
    "models": None,
    **dict.fromkeys(("band_energy", "block_dct", "highpass", "highpass_mask", "idct", "lowpass",
                     "lowpass_mask", "radial_spectrum", "split"), "freqact.dct"),
    **dict.fromkeys(("Meter", "compress"), "freqact.engine"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'freqact' has no attribute {name!r}")
    source = _EXPORTS[name]
    value = (importlib.import_module(f"freqact.{name}") if source is None
             else getattr(importlib.import_module(source), name))
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
