"""freqact: activation maps in the frequency domain, and training with compressed activations.

The main names are importable from the package root; the submodules hold the rest.
"""
__version__ = "0.1.0"
