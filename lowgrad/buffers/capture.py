"""The CUDA-graph capture in progress on this thread (set by :class:`lowgrad.Graph`), and the
guards that refuse what a capture cannot contain: host syncs, allocations, kernel compiles,
copies through pageable host memory. Each raises :class:`CaptureError` before anything reaches
the driver. Checking costs one global read when no capture is active anywhere.
"""
from __future__ import annotations

import threading
from typing import Any

from lowgrad.base.errors import CaptureError

_local = threading.local()
active = [0]  # captures in progress in any thread


def current() -> Any:
    """The :class:`lowgrad.Graph` capturing on this thread, or None."""
    return getattr(_local, "graph", None) if active[0] else None


def begin(graph: Any) -> None:
    if current() is not None:
        raise CaptureError("a lowgrad.Graph capture is already in progress on this thread (captures do not nest)")
    _local.graph = graph
    active[0] += 1


def end(graph: Any) -> None:
    if getattr(_local, "graph", None) is graph:
        _local.graph = None
        active[0] -= 1


def forbid(what: str) -> None:
    """Raise CaptureError if this thread is capturing a CUDA graph."""
    g = current()
    if g is not None:
        raise CaptureError(f"{what} is not allowed during CUDA-graph capture (stream 0x{g.stream_handle:x}); "
                           "do it before the capture or after it ends")


def keep_tensors(*tensors: Any) -> None:
    """:func:`keep` for the allocations of ``tensors`` (a no-op unless a capture is active)."""
    if active[0]:
        keep(tuple(t._alloc for t in tensors))


def keep(allocations: tuple[Any, ...]) -> None:
    """Tie ``allocations`` to the graph being captured on this thread (if any): a replay checks
    they are still open, and the graph holds them alive."""
    g = current()
    if g is not None:
        g.keep(allocations)
