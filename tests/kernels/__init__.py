"""Tests of freqact.kernels (the Triton kernels and their dispatch)."""
