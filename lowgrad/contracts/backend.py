"""The device contract both backends implement (CUDA: :class:`lowgrad.cuda.device.Device`; host:
:class:`lowgrad.host.device.HostDevice`), and what they share: allocation bookkeeping, the memory
report, stream resolution and copies.

A backend supplies the abstract methods of :class:`DeviceBase` (raw allocation, copies, streams,
events, kernels, capture lookup, priorities); its streams and events satisfy :class:`Stream`
and :class:`Event`. Managers and ops are written against these only: they never ask which
backend they run on. Who may address an allocation (GPU, CPU) is reported per allocation by the
backend (:class:`~lowgrad.buffers.memory.RawBlock`), and decides DLPack and the CUDA array
interface.

Units: sizes in bytes, shapes in elements, stream priorities as CUDA numbers (lower is more
urgent). Every ``stream=`` argument takes what :func:`~lowgrad.buffers.streams.stream_handle` takes.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lowgrad.base import trace
from lowgrad.base.dtypes import DType, as_dtype
from lowgrad.base.integers import integer
from lowgrad.buffers import capture, release
from lowgrad.buffers.memory import (
    Allocation,
    MemoryReport,
    RawBlock,
    Registry,
    check_kind,
    check_nbytes,
)
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import LazyAllocator, Tensor, check_shape
from lowgrad.contracts.kernels import Kernels


@runtime_checkable
class Event(Protocol):
    """An event of either backend: a marker in a stream's work."""

    device: Any
    name: str  # a label for traces
    timing: bool  # created with timing=True: elapsed_ms works

    def record(self, stream: StreamLike = None) -> Event:
        """Mark the work queued on ``stream`` so far (asynchronous); returns self."""

    def wait(self, stream: StreamLike = None) -> None:
        """Make ``stream``'s later work wait for the recorded work (no host sync)."""

    def query(self) -> bool:
        """Whether the recorded work has finished (never blocks)."""

    def synchronize(self) -> None:
        """Block the host until the recorded work has finished."""

    def elapsed_ms(self, end: Any) -> float:
        """Milliseconds between this record and ``end``'s (both timing events)."""

    def close(self) -> None:
        """Release the event (idempotent)."""


@runtime_checkable
class Stream(Protocol):
    """A stream of either backend: ``handle`` is the raw handle every ``stream=`` accepts;
    ``priority`` a CUDA priority within the device's :attr:`DeviceBase.stream_priority_range`."""

    device: Any
    handle: int
    priority: int

    def synchronize(self) -> None:
        """Block the host until the stream's queued work has finished; a safe point."""

    def query(self) -> bool:
        """Whether the stream's queued work has finished (never blocks)."""

    def wait(self, event: Any) -> None:
        """Make the stream's later work wait for ``event`` (no host sync)."""

    def close(self) -> None:
        """Release the stream (idempotent; a wrapped foreign handle is never destroyed)."""


def check_priority(device: DeviceBase, priority: Any) -> int:
    """``priority`` as a stream priority of ``device``: a Python or NumPy integer within its
    range (TypeError, ValueError otherwise)."""
    priority = integer("stream priority", priority)
    lo, hi = device.stream_priority_range
    if not min(lo, hi) <= priority <= max(lo, hi):
        raise ValueError(f"stream priority {priority} outside the device's range [{hi}, {lo}]")
    return priority


class DeviceBase(ABC):
    """The device contract managers and ops are written against; one object per device.

    Attributes: ``backend`` ("cuda" | "host", for people and traces, never for dispatch);
    ``ordinal`` (the GPU ordinal, None on the host); ``registry`` (live bytes per name and
    kind); ``kernel_kinds`` (the memory kinds its kernels may touch); ``stream_type`` and
    ``default_stream`` (the stream ``stream=None`` means).
    """

    backend: str = ""
    ordinal: int | None = None

    def __init__(self) -> None:
        self.registry = Registry()

    # ---- context, streams, events and capture -------------------------------------------
    @abstractmethod
    def activate(self) -> None:
        """Make this device current on the calling thread (CUDA: its primary context)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work queued on this device has finished; a safe point that
        runs deferred releases."""

    @abstractmethod
    def stream(self, priority: int = 0) -> Stream:
        """A new stream (:class:`Stream`) of ``priority`` (:func:`check_priority`)."""

    @abstractmethod
    def event(self, timing: bool = False, name: str = "") -> Event:
        """A new event (:class:`Event`); ``timing=True`` allows ``elapsed_ms``; ``name`` labels it
        in traces."""

    @property
    @abstractmethod
    def stream_priority_range(self) -> tuple[int, int]:
        """(least, greatest) stream priority, CUDA's convention: numerically lower is more
        urgent; (0, 0) where streams have one priority."""

    @abstractmethod
    def capture_of(self, stream: StreamLike) -> Any:
        """The :class:`lowgrad.Graph` capturing ``stream`` on this thread, or None when nothing
        captures it; :class:`~lowgrad.base.errors.CaptureError` when something a manager cannot
        follow captures it."""

    @property
    @abstractmethod
    def kernels(self) -> Kernels:
        """The backend's kernel table (:class:`~lowgrad.contracts.kernels.Kernels`), the
        implementation behind :mod:`lowgrad.ops`; built at first use."""

    # ---- memory ------------------------------------------------------------------------
    def alloc(self, shape: Any, dtype: DType | str, kind: str = "device", name: str = "tensor") -> Tensor:
        """A new uninitialised tensor of ``shape``/``dtype`` in memory ``kind``, reported under ``name``."""
        dt, shp, kind = as_dtype(dtype), check_shape(shape), check_kind(kind)
        if not isinstance(name, str) or not name:
            raise TypeError("allocation name must be a non-empty str")
        nbytes = check_nbytes(math.prod(shp) * dt.itemsize, self.memory_limit(kind), f"alloc {name!r} {shp} {dt.name}")
        a = Allocation(self, kind, nbytes, {name: nbytes})
        self._bind(a, nbytes)
        return Tensor(a, 0, dt, shp, name)

    def lazy_allocator(self, kind: str = "device") -> LazyAllocator:
        """A lazy allocator on this device: reserve many tensors, then ``commit()`` one block."""
        return LazyAllocator(self, kind)

    def _bind(self, a: Allocation, nbytes: int) -> None:
        capture.forbid(f"allocating {', '.join(a.parts)!r}")
        release.drain()  # a safe point: free what finalizers queued before asking for more
        check_nbytes(nbytes, self.memory_limit(a.kind), f"allocation {', '.join(a.parts)!r}")
        a.bind(self._raw_alloc(a.kind, nbytes))

    #: memory kinds this backend's kernels can read and write
    kernel_kinds: frozenset[str] = frozenset(("device", "pinned", "write_combined", "host"))

    def memory_report(self) -> MemoryReport:
        """Live bytes by allocation name and kind on this device."""
        return self.registry.report()

    # ---- streams -----------------------------------------------------------------------
    def resolve_stream(self, s: StreamLike) -> Any:
        """A stream object for ``s`` (None: the default stream; int: a wrapped foreign handle)."""
        if s is None:
            return self.default_stream
        if isinstance(s, self.stream_type):
            return s
        return self._wrap_stream(stream_handle(s))

    def copy(self, dst: Tensor, src: Tensor, stream: StreamLike = None) -> None:
        """Asynchronous copy of ``src`` into ``dst`` (same dtype and element count) on ``stream``."""
        check_copy(self, dst, src)
        if "host" in (dst.kind, src.kind):
            capture.forbid(f"a copy through pageable host memory ({src.name!r} -> {dst.name!r})")
        h = stream_handle(stream)
        capture.keep_tensors(dst, src)
        self._copy(dst, src, h)
        if trace.ENABLED:
            trace.log("copy", f"{src.kind}->{dst.kind}", bytes=dst.nbytes, dst=dst.name, src=src.name, stream=hex(h))

    # ---- provided by each backend ------------------------------------------------------
    stream_type: type = object
    default_stream: Any = None

    @abstractmethod
    def memory_limit(self, kind: str) -> int:
        """The most bytes one allocation of ``kind`` may ask for (checked before allocating)."""

    @abstractmethod
    def _raw_alloc(self, kind: str, nbytes: int) -> RawBlock:
        """A new block of ``nbytes`` bytes of memory ``kind`` and who can address it."""

    @abstractmethod
    def _wrap_stream(self, handle: int) -> Stream:
        """A non-owning stream object for a raw handle."""

    @abstractmethod
    def _copy(self, dst: Tensor, src: Tensor, stream: int) -> None:
        """Queue the copy of ``src`` into ``dst`` (``dst.nbytes`` bytes, checked) on raw stream
        ``stream``."""

    @abstractmethod
    def copy_to_host(self, out: np.ndarray, src: Tensor) -> None:
        """Synchronous copy of ``src`` into the contiguous numpy array ``out`` (same bytes); a
        host sync."""

    @abstractmethod
    def copy_from_host(self, dst: Tensor, arr: np.ndarray) -> None:
        """Synchronous copy of the contiguous numpy array ``arr`` (same bytes) into ``dst``; a
        host sync."""


def check_copy(device: DeviceBase, dst: Tensor, src: Tensor) -> None:
    """Shared copy argument rules: same device object, dtype and element count."""
    for t, what in ((dst, "dst"), (src, "src")):
        if not isinstance(t, Tensor):
            raise TypeError(f"copy {what} must be a lowgrad Tensor, got {type(t).__name__}")
        if t.device is not device:
            raise ValueError(f"copy {what} {t.name!r} lives on {t.device!r}, not {device!r}")
    if dst.dtype is not src.dtype:
        raise TypeError(f"copy dtype mismatch: dst {dst.name!r} is {dst.dtype.name}, "
                        f"src {src.name!r} is {src.dtype.name}")
    if dst.numel != src.numel:
        raise ValueError(f"copy size mismatch: dst {dst.name!r} {dst.shape} vs src {src.name!r} {src.shape}")
