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

from freqact import codecs, models
from freqact.dct import (
    band_energy,
    block_dct,
    highpass,
    highpass_mask,
    idct,
    lowpass,
    lowpass_mask,
    radial_spectrum,
    split,
)
from freqact.engine import Meter, compress

__all__ = [
    "Meter",
    "band_energy",
    "block_dct",
    "codecs",
    "compress",
    "highpass",
    "highpass_mask",
    "idct",
    "lowpass",
    "lowpass_mask",
    "models",
    "radial_spectrum",
    "split",
]
