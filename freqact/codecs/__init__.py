"""Codecs: how one cached activation is stored between forward and backward.

Every codec has one interface::

    packed = codec.encode(x)      # x: any tensor the engine routes to this codec
    x_hat = codec.decode(packed)  # same shape, dtype and device as x
    packed.nbytes                 # exact bytes the packed form holds

`get(name, **params)` builds a codec by name and `names()` lists them; each codec declares its
settings once (`Codec.settings`, `freqact.codecs.settings.Setting`), and `modes()` /
`mode_settings()` list the codecs a model trains with and their settings. The codecs live in small
modules by family; importing this package registers all of them.
"""
from freqact.codecs import cheap  # noqa: F401  (registers the exact-but-cheap codecs)
from freqact.codecs.base import (
    Codec,
    Exact,
    codec_class,
    get,
    mode_settings,
    modes,
    names,
    register,
    tensor_nbytes,
)
from freqact.codecs.division import Division, DivisionNoHFC, DivisionNoLFC, Quant
from freqact.codecs.settings import Setting
from freqact.codecs.spectral import (
    HighFrequency,
    LowFrequency,
    QuantizedHighFrequency,
    SpectralPacked,
)
from freqact.kernels.format import DivisionPacked

__all__ = [
    "Codec",
    "Division",
    "DivisionNoHFC",
    "DivisionNoLFC",
    "DivisionPacked",
    "Exact",
    "HighFrequency",
    "LowFrequency",
    "Quant",
    "QuantizedHighFrequency",
    "Setting",
    "SpectralPacked",
    "codec_class",
    "get",
    "mode_settings",
    "modes",
    "names",
    "register",
    "tensor_nbytes",
]
