"""Diagnostics that cost nothing when off: NVTX ranges and an opt-in trace of every kernel
launch, copy and NCCL call.

- NVTX: where the optional ``nvtx`` package is importable, :func:`nvtx_range` pushes and pops a
  named range (visible in Nsight Systems); otherwise it does nothing.
- ``LOWGRAD_TRACE=1`` writes one line per kernel launch, copy and NCCL call, with sizes and the
  stream, to stderr; ``LOWGRAD_TRACE=/path/file`` appends them to that file. Read once at import
  (:func:`enable` switches it at run time).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TextIO

try:
    import nvtx as _nvtx
except ImportError:  # optional
    _nvtx = None

ENABLED: bool = False
_out: TextIO | None = None
_lock = threading.Lock()


def enable(target: str | None) -> None:
    """Trace to stderr (``"1"``), to a file (a path), or switch tracing off (``None``/``""``).
    Safe while other threads log: the switch and the close of the previous file happen under the
    lock every line is written under."""
    global ENABLED, _out
    new = None if not target else (sys.stderr if target == "1" else open(target, "a", buffering=1))
    with _lock:
        old, _out = _out, new
        ENABLED = new is not None
    if old not in (None, sys.stderr, new):
        old.close()  # type: ignore[union-attr]  # no writer can hold it: they write under _lock


def log(kind: str, name: str, **fields: Any) -> None:
    """One trace line: time (s, monotonic), thread, kind ("kernel" | "copy" | "nccl"), name, fields."""
    if _out is None:
        return
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    line = f"lowgrad-trace {time.monotonic():.6f} {threading.current_thread().name} {kind} {name} {extra}\n"
    with _lock:
        if _out is not None:  # switched off since the check above
            _out.write(line)


_NO_RANGE = nullcontext()


def nvtx_range(name: str) -> AbstractContextManager[None]:
    """An NVTX range around the block when the ``nvtx`` package is present (else a shared no-op)."""
    return _NO_RANGE if _nvtx is None else _range(name)


@contextmanager
def _range(name: str) -> Iterator[None]:
    _nvtx.push_range(name)
    try:
        yield
    finally:
        _nvtx.pop_range()


enable(os.environ.get("LOWGRAD_TRACE"))
