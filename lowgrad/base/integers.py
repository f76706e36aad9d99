"""The one rule for integer arguments of the layers below ``managers``: a Python or NumPy integer
is taken as the ``int`` it holds (a rank read from a numpy array is a rank); bools, Python's or
NumPy's, and floats, even integral ones, are refused, since they are always a mistake there."""
from __future__ import annotations

from typing import Any

import numpy as np


def integer(what: str, value: Any) -> int:
    """``value`` as an int; TypeError naming ``what`` for anything but a Python or NumPy integer
    (bools and floats included, even integral ones)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)
