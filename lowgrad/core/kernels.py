"""The kernel table contract: what :attr:`lowgrad.core.backend.DeviceBase.kernels` returns on
every backend (CUDA: compiled NVRTC kernels; host: the numpy reference). :mod:`lowgrad.ops`
checks arguments and calls into it."""
from __future__ import annotations

from typing import Protocol


class Kernels(Protocol):
    """A backend's kernels, behind :mod:`lowgrad.ops` (the full method list is defined with the
    kernels themselves)."""
