"""Streams and events of the CUDA backend (any ``stream=`` argument: :mod:`lowgrad.buffers.streams`)."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from lowgrad.base.errors import ClosedError
from lowgrad.buffers import capture, release
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.contracts.backend import check_priority
from lowgrad.cuda import driver as _cuda

if TYPE_CHECKING:
    from lowgrad.contracts.backend import DeviceBase as Device

_CU_STREAM_NON_BLOCKING = 1
_CU_EVENT_DISABLE_TIMING = 2
_CUDA_ERROR_NOT_READY = 600
_event_fns: list[Any] = []  # [cuEventRecord, cuStreamWaitEvent] as ctypes functions, bound at the first Event


class Stream:
    """A CUDA stream on one device (a :class:`lowgrad.contracts.backend.Stream`). ``handle`` is the
    raw ``CUstream`` value as an int.

    Created streams are non-blocking with respect to the legacy default stream; a wrapped foreign
    handle (:meth:`wrap`) is not owned and never destroyed by lowgrad.
    """

    __slots__ = ("device", "handle", "priority", "_cu", "_owned", "_finalizer", "__weakref__")
    _finalizer: release.Finalizer | None

    def __init__(self, device: Device, priority: int = 0) -> None:
        drv = _cuda.driver()
        device.activate()
        priority = check_priority(device, priority)
        self._cu = _cuda.check("cuStreamCreateWithPriority",
                               drv.cuStreamCreateWithPriority(_CU_STREAM_NON_BLOCKING, priority))
        self.device, self.handle, self.priority, self._owned = device, int(self._cu), priority, True
        self._finalizer = release.Finalizer(self, _destroy_stream, drv, self._cu)

    @classmethod
    def wrap(cls, device: Device, handle: StreamLike) -> Stream:
        """A non-owning lowgrad Stream around a foreign stream (int handle or stream object)."""
        s = cls.__new__(cls)
        s.device, s.handle, s.priority, s._owned = device, stream_handle(handle), 0, False
        s._cu = _cuda.driver().CUstream(s.handle)
        s._finalizer = None
        return s

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream is done."""
        self._live()
        capture.forbid("Stream.synchronize (a host sync)")
        self.device.activate()
        _cuda.check("cuStreamSynchronize", _cuda.driver().cuStreamSynchronize(self._cu))
        release.drain()

    def query(self) -> bool:
        """True when all work queued on this stream is done (never blocks)."""
        self._live()
        capture.forbid("Stream.query")
        (err,) = _cuda.driver().cuStreamQuery(self._cu)
        if int(err) == _CUDA_ERROR_NOT_READY:
            return False
        _cuda.check("cuStreamQuery", (err,))
        return True

    def wait(self, event: Event) -> None:
        """Make future work on this stream wait for ``event`` (no host sync)."""
        self._live()
        event.wait(self.handle)

    def close(self) -> None:
        """Destroy an owned stream (a wrapped one is only forgotten)."""
        if self._finalizer is not None:
            self._finalizer()
        self.handle = -1

    def _live(self) -> None:
        if self.handle < 0:
            raise ClosedError("stream used after close()")

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Stream(device={self.device.ordinal}, handle=0x{self.handle:x}, owned={self._owned})"


def _destroy_stream(drv: Any, cu: Any) -> None:
    drv.cuStreamDestroy(cu)


class Event:
    """A CUDA event. ``timing=True`` enables :meth:`elapsed_ms`; ``name`` labels it in traces."""

    __slots__ = ("device", "name", "timing", "handle", "_cu", "_finalizer", "_closed", "__weakref__")

    def __init__(self, device: Device, timing: bool = False, name: str = "") -> None:
        drv = _cuda.driver()
        device.activate()
        flags = 0 if timing else _CU_EVENT_DISABLE_TIMING
        self._cu = _cuda.check("cuEventCreate", drv.cuEventCreate(flags))
        self.device, self.name, self.timing, self._closed, self.handle = device, name, timing, False, int(self._cu)
        self._finalizer = release.Finalizer(self, _destroy_event, drv, self._cu)
        if not _event_fns:
            _event_fns[:] = [_cuda.c_function("cuEventRecord", ctypes.c_void_p, ctypes.c_void_p),
                             _cuda.c_function("cuStreamWaitEvent", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)]

    def _live(self) -> None:
        if self._closed:
            raise ClosedError(f"event {self.name!r} used after close()")

    def record(self, stream: StreamLike = None) -> Event:
        """Record this event on ``stream`` (asynchronous); returns self."""
        if self._closed:
            self._live()
        err = _event_fns[0](self.handle, stream_handle(stream))
        if err:
            raise _cuda.fail("cuEventRecord", err)
        return self

    def wait(self, stream: StreamLike = None) -> None:
        """Make ``stream`` wait for this event (no host sync)."""
        if self._closed:
            self._live()
        err = _event_fns[1](stream_handle(stream), self.handle, 0)
        if err:
            raise _cuda.fail("cuStreamWaitEvent", err)

    def query(self) -> bool:
        """True when the work captured by the last record has completed."""
        self._live()
        capture.forbid("Event.query")
        (err,) = _cuda.driver().cuEventQuery(self._cu)
        if int(err) == _CUDA_ERROR_NOT_READY:
            return False
        _cuda.check("cuEventQuery", (err,))
        return True

    def synchronize(self) -> None:
        """Block the host until the recorded work is complete."""
        self._live()
        capture.forbid("Event.synchronize (a host sync)")
        _cuda.check("cuEventSynchronize", _cuda.driver().cuEventSynchronize(self._cu))

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end`` (both recorded with timing=True)."""
        if not (self.timing and end.timing):
            raise ValueError("elapsed_ms needs two events created with timing=True")
        self._live()
        end._live()
        return float(_cuda.check("cuEventElapsedTime", _cuda.driver().cuEventElapsedTime(self._cu, end._cu)))

    def close(self) -> None:
        """Destroy the event; later use raises ClosedError."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        return f"Event(device={self.device.ordinal}, name={self.name!r})"


def _destroy_event(drv: Any, cu: Any) -> None:
    drv.cuEventDestroy(cu)
