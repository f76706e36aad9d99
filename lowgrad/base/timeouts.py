"""The one rule for timeouts (seconds, ``inf`` for no limit) of every blocking call: communicators,
the threads' rendezvous, the unique-id exchange."""
from __future__ import annotations

import math
from numbers import Real
from typing import Any

DEFAULT_TIMEOUT = 300.0  # seconds, for initialisation, waits and host rendezvous
WAIT_SLICE = 3600.0  # seconds: the longest single blocking wait (an infinite timeout waits in slices)


def check_timeout(timeout: Any, default: float = DEFAULT_TIMEOUT) -> float:
    """Seconds to wait: ``None`` gives ``default``; a positive int or float, ``float('inf')``
    meaning no limit. NaN, zero, negative values are a ValueError; bools and non-numbers a
    TypeError."""
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, Real):
        raise TypeError(f"timeout must be seconds (an int or float, inf for none), got {timeout!r}")
    t = float(timeout)
    if math.isnan(t) or t <= 0:
        raise ValueError(f"timeout must be positive seconds (inf for no limit), got {timeout!r}")
    return t


def wait_slice(left: float) -> float:
    """A blocking wait of ``left`` seconds capped to :data:`WAIT_SLICE` (``Condition.wait``,
    ``socket.settimeout`` and ``Lock.acquire`` overflow on ``inf``); callers loop to the deadline."""
    return min(left, WAIT_SLICE)
