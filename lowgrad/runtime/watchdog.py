"""The watchdog of a communicator whose calls block (NCCL's blocking mode): one thread per
communicator that bounds what the issuing thread can no longer bound itself.

A blocking NCCL call returns once its work is queued on the stream, without a thread or a poll
per call, but then nothing in the issuing thread watches that work: a peer that never issues the
matching collective leaves it spinning on the device, and the first call at a new peer (NCCL's
lazy connection setup) can block the host inside the call. The :class:`Watchdog` watches three
things, one round (:meth:`Watchdog.tick`) every ``interval`` seconds:

- the target's health, through ``poll()`` (NCCL's asynchronous error, ``run_threads``'
  :class:`~lowgrad.runtime.threads.AbortEvent`): an exception it returns is the failure;
- a call that blocks the host: :meth:`Watchdog.enter` / :meth:`Watchdog.leave` bracket it, and
  one open for longer than ``timeout`` fails with CommTimeoutError;
- outstanding work: :meth:`Watchdog.leave` records the next of a fixed ring of ``markers``
  (CUDA events) on the call's stream; the oldest one not complete ``timeout`` seconds after its
  call fails with CommTimeoutError. Work of one communicator completes in call order, so only
  the oldest marker is ever waited for.

The first failure calls ``abort(exc)`` once (``ncclCommAbort``: it unblocks a call stuck in the
host and stops the device work) and stays: :meth:`Watchdog.error` gives it to every waiter, then
and later. Everything it touches is injected (``clock``, ``poll``, ``abort``, the markers, and
``on_start``, run first on the watchdog's thread: the CUDA backend puts that thread in CUDA's
relaxed capture mode there, so this module stays free of CUDA), so its logic is tested on the CPU
against stand-ins (tests/test_watchdog.py).

Hot path: :meth:`enter` is one clock read; :meth:`leave` one lock and one ``marker.record``.
Nothing is allocated per call: the ring is made once. When the ring is full (``len(markers)``
calls outstanding), the newest marker is recorded again and its time becomes this call's: a
marker completes only after every call it covers, so no call is aborted before its own
``timeout`` has passed; an earlier call it covers is bounded later than its own time, by at most
how long the ring stayed full (the older markers it waits behind are not refreshed).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from lowgrad.base.errors import CommTimeoutError
from lowgrad.base.timeouts import check_timeout

INTERVAL_MAX = 0.05  # seconds between rounds at most: the abort comes within timeout + this


class Marker(Protocol):
    """What the ring holds (a CUDA event): recorded after a call on its stream, queried later."""

    def record(self, stream: Any) -> Any: ...

    def query(self) -> bool: ...


class Watchdog:
    """Watch ``name`` (``"rank 1 of 2"``) for ``timeout`` seconds (``inf``: only ``poll``);
    ``abort(exc)`` is called at most once, from the watchdog's thread (or the thread that calls
    :meth:`fail`). ``on_start()`` runs first on the watchdog's thread (an exception it raises is
    the failure). ``start=False`` runs no thread: the caller drives :meth:`tick` (tests)."""

    def __init__(self, name: str, timeout: float, markers: Sequence[Marker], poll: Callable[[], Exception | None],
                 abort: Callable[[Exception], None], clock: Callable[[], float] = time.monotonic,
                 interval: float | None = None, start: bool = True,
                 on_start: Callable[[], None] | None = None) -> None:
        self.timeout = check_timeout(timeout)
        if not markers:
            raise ValueError("Watchdog needs at least one marker")
        self.interval = min(self.timeout / 20, INTERVAL_MAX) if interval is None else check_timeout(interval)
        self.name = name
        self._markers = list(markers)
        self._size = len(self._markers)
        self._times = [0.0] * self._size
        self._head = self._tail = 0  # calls recorded / retired (slot = count % size)
        self._ring = threading.Lock()
        self._poll, self._abort, self._clock, self._on_start = poll, abort, clock, on_start
        self._host_since: float | None = None  # when the call now blocking the host began
        self._failure: Exception | None = None
        self._fail_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name=f"lowgrad-watchdog {name}", daemon=True)
            self._thread.start()

    # ---- the issuing thread (hot path) -------------------------------------------------
    def enter(self) -> None:
        """A call that may block the host begins (one at a time: the communicator's lock)."""
        self._host_since = self._clock()

    def leave(self, stream: Any = None) -> None:
        """The call returned; with ``stream`` (not None) its work was queued there: watch it."""
        self._host_since = None
        if stream is None:
            return
        with self._ring:
            head = self._head
            if head - self._tail == self._size:  # full: fold into the newest, its time refreshed (module docstring)
                i = (head - 1) % self._size
            else:
                i = head % self._size
                self._head = head + 1
            self._times[i] = self._clock()
            self._markers[i].record(stream)

    # ---- every thread ------------------------------------------------------------------
    def error(self) -> Exception | None:
        """A new instance of the failure (each waiter raises its own: a raise writes the
        traceback into the instance), or None."""
        f = self._failure
        return None if f is None else _copy(f)

    def fail(self, exc: Exception) -> bool:
        """Fail with ``exc`` and call ``abort(exc)`` (the first failure only: True when it was
        this one). An exception of ``abort`` is noted on the failure, never raised: the failure is
        what every waiter must hear."""
        with self._fail_lock:
            if self._failure is not None:
                return False
            self._failure = _copy(exc)
        try:
            self._abort(exc)
        except Exception as abort_exc:  # noqa: BLE001 - the failure stays what waiters raise
            self._failure = _copy(exc, f" (aborting raised {type(abort_exc).__name__}: {abort_exc})")
        return True

    def tick(self) -> None:
        """One round: the target's health, the blocked call, the oldest outstanding marker."""
        if self._failure is not None:
            return
        try:
            why = self._poll()
        except Exception as exc:  # noqa: BLE001 - a failing look is a failure of the target
            why = exc
        if why is not None:
            self.fail(why)
            return
        now = self._clock()
        since = self._host_since
        if since is not None and now - since > self.timeout:
            self.fail(CommTimeoutError(f"{self.name}: a call blocked the host for more than {self.timeout:g} s (a "
                                       "peer that never joined it?); communicator aborted"))
            return
        late = None
        try:
            with self._ring:
                while self._tail < self._head:
                    i = self._tail % self._size
                    if not self._markers[i].query():
                        if now - self._times[i] > self.timeout:
                            late = now - self._times[i]
                        break
                    self._tail += 1
        except Exception as exc:  # noqa: BLE001 - a failing query (a CUDA error) fails the target
            self.fail(exc)
            return
        if late is not None:
            self.fail(CommTimeoutError(f"{self.name}: a collective queued {late:.3g} s ago has not completed "
                                       f"within {self.timeout:g} s (a peer that never issued it, or died?); "
                                       "communicator aborted"))

    # ---- lifetime ----------------------------------------------------------------------
    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception as exc:  # noqa: BLE001 - a watchdog that cannot watch fails its target
                self.fail(exc)
                return
        while not self._stop.wait(self.interval):
            self.tick()
            if self._failure is not None:
                return  # aborted: nothing more to watch

    def close(self) -> None:
        """Stop the thread and wait for it (idempotent; from the watchdog's own thread, an
        ``abort`` callback, it only stops it)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()


def _copy(exc: Exception, suffix: str = "") -> Exception:
    """A new instance of ``exc``'s type with its attributes and message (``suffix`` appended),
    made without calling its ``__init__`` (NcclError's takes other arguments than its message)."""
    new = type(exc).__new__(type(exc))
    new.__dict__.update(exc.__dict__)
    new.args = (f"{exc}{suffix}",) if suffix else exc.args
    return new
