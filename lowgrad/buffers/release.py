"""GC-safe release: finalizers only queue work; normal code runs it at safe points.

The cyclic garbage collector can run at any bytecode that allocates, including inside a critical
section of a lowgrad lock, and it runs the finalizers of what it collects right there, on that
thread. A finalizer that took the same lock would wait for itself forever; one that called CUDA or
NCCL could do so in the middle of a stream capture. So a :class:`Finalizer` callback (and every
DLPack deleter) does one thing: it puts the release into a queue. :func:`drain` runs the queued
releases (``cuMemFree``, stream/event/graph destroy, ``ncclCommAbort``, the memory report) from
normal code: before an allocation, at a device or stream synchronize, in ``close()`` and at exit,
and never while a lowgrad CUDA-graph capture is open (in any thread).

The queue is a :class:`queue.SimpleQueue`: its ``put`` is documented as reentrant (safe from
``__del__``, weakref callbacks and signal handlers, even when it interrupts a ``put`` or ``get`` of
the same queue on the same thread), takes no lock that Python code can hold, and never blocks.
``collections.deque.append`` would also be atomic, but only as a CPython implementation detail.
"""
from __future__ import annotations

import atexit
import queue
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from lowgrad.buffers import capture

_queue: queue.SimpleQueue[Finalizer] = queue.SimpleQueue()
_live: dict[Finalizer, None] = {}  # finalizers whose release has not been queued or run yet
_pollers: list[Callable[[], None]] = []  # run by each drain (e.g. DLPack capsules never consumed)


class Finalizer(weakref.ref):  # type: ignore[type-arg]
    """Release ``fn(*args)`` once: explicitly (``f()``, in normal code, synchronously) or after
    ``obj`` is collected (queued for the next :func:`drain`). ``fn`` must not refer to ``obj``.
    The interface follows :class:`weakref.finalize`: call, :meth:`detach`, :attr:`alive`."""

    __slots__ = ("_fn", "_args")
    __hash__ = object.__hash__  # identity: the referent may be gone
    __eq__ = object.__eq__

    def __new__(cls, obj: Any, fn: Callable[..., Any], *args: Any) -> Finalizer:
        return super().__new__(cls, obj, _collected)

    def __init__(self, obj: Any, fn: Callable[..., Any], *args: Any) -> None:
        super().__init__(obj, _collected)  # type: ignore[call-arg]  # weakref.ref.__init__(obj, callback)
        self._fn, self._args = fn, args
        _live[self] = None

    def __call__(self) -> None:
        """Run the release now (normal code only); idempotent."""
        if _live.pop(self, False) is None:
            self._run()

    def detach(self) -> bool:
        """Forget the release (the caller took it over); True when it had not run yet."""
        return _live.pop(self, False) is None

    @property
    def alive(self) -> bool:
        return self in _live

    def _run(self) -> None:
        self._fn(*self._args)


def _collected(f: Finalizer) -> None:
    """The weakref callback (runs inside the GC or a deallocation): queue, nothing else."""
    if _live.pop(f, False) is None:
        _queue.put(f)


def add_poller(fn: Callable[[], None]) -> None:
    """Run ``fn`` (normal code, no arguments) at the start of every drain."""
    _pollers.append(fn)


def drain() -> None:
    """Run every queued release (a safe point: call from normal code only). Does nothing while a
    lowgrad CUDA-graph capture is open in any thread; concurrent drains share the work."""
    if capture.active[0]:
        return
    for poll in _pollers:
        poll()
    while True:
        try:
            f = _queue.get_nowait()
        except queue.Empty:
            return
        try:
            f._run()
        except Exception as exc:  # noqa: BLE001 - a failed free must not fail the unrelated call that drains
            warnings.warn(f"lowgrad: a deferred release failed: {exc!r}", RuntimeWarning, stacklevel=2)


def pending() -> int:
    """Releases queued and not yet run (for tests and diagnostics)."""
    return _queue.qsize()


def _at_exit() -> None:
    """Release what is still alive (as :class:`weakref.finalize` does at exit), then drain."""
    while _live:
        try:
            f, _ = _live.popitem()
        except KeyError:
            break
        _queue.put(f)
    drain()


atexit.register(_at_exit)
