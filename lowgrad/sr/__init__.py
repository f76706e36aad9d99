"""Stochastic rounding: the argument rules of the SR kernels (checks), Philox4x32-10, per-use
seeds, the numpy reference of every kernel, and the device-side seed counter. Imports only
``base``, ``buffers`` and ``contracts``."""
