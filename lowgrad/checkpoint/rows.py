"""``Rows``: one rank's part of a named array in a checkpoint, rows ``[start, start + len(data))``
along dim 0 of a global array of ``shape``. Sharded state (master weights, optimizer moments)
is this; state every rank holds alike (a step count) is the whole array at ``start=0``."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lowgrad.base.integers import integer


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, start + data.shape[0])`` of the global array ``shape`` (a 0-d array: the
    whole of it, ``start`` 0). ``data`` is a numpy array (bf16 through ``ml_dtypes``)."""

    data: np.ndarray
    shape: tuple[int, ...]
    start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.data, np.ndarray):
            raise TypeError(f"Rows data must be a numpy array, got {type(self.data).__name__}")
        if not isinstance(self.shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in self.shape):
            raise TypeError(f"Rows shape must be a tuple of non-negative ints, got {self.shape!r}")
        start = integer("Rows start", self.start)
        if self.data.ndim != len(self.shape) or self.data.shape[1:] != self.shape[1:] or start < 0 or \
                (self.shape and start + self.data.shape[0] > self.shape[0]) or (not self.shape and start):
            raise ValueError(f"Rows: data of shape {self.data.shape} at row {start} does not fit the global "
                             f"shape {self.shape}")
        object.__setattr__(self, "start", start)

    @property
    def stop(self) -> int:
        """One past the last row held."""
        return self.start + (self.data.shape[0] if self.shape else 1)

    @property
    def whole(self) -> bool:
        """Whether these rows are the whole array (every rank holds it alike: rank 0 writes it)."""
        return not self.shape or (self.start == 0 and self.data.shape[0] == self.shape[0])
