"""What the CUDA and host backends share: allocation bookkeeping, the memory report and
stream resolution. Each backend supplies raw allocation, copies, streams, events and kernels.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from lowgrad.core import capture, release, trace
from lowgrad.core.dtypes import DType, as_dtype
from lowgrad.core.memory import (
    Allocation,
    MemoryReport,
    RawBlock,
    Registry,
    check_kind,
    check_nbytes,
)
from lowgrad.core.streams import StreamLike, stream_handle
from lowgrad.core.tensor import LazyAllocator, Tensor, check_shape


class DeviceBase(ABC):
    """The backend interface that managers are written against.

    Subclasses also provide ``stream()``, ``event()``, ``synchronize()`` and ``kernels`` (the
    backend's implementation of :mod:`lowgrad.ops`).
    """

    backend: str = ""
    ordinal: int | None = None
    kernels: Any

    def __init__(self) -> None:
        self.registry = Registry()

    # ---- context, streams and capture ---------------------------------------------------
    @abstractmethod
    def activate(self) -> None:
        """Make this device current on the calling thread (CUDA: its primary context)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until all work queued on this device has finished; a safe point that
        runs deferred releases."""

    @property
    def stream_priority_range(self) -> tuple[int, int]:
        """(least, greatest) stream priority, CUDA's convention: numerically lower is more
        urgent. A backend without priorities gives (0, 0)."""
        return (0, 0)

    def capture_of(self, stream: StreamLike) -> Any:
        """The :class:`lowgrad.Graph` capturing ``stream`` on this thread, or None. A backend
        without graphs gives None."""
        return None

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
        """The most bytes one allocation of ``kind`` may ask for."""

    @abstractmethod
    def _raw_alloc(self, kind: str, nbytes: int) -> RawBlock:
        """A new block of ``nbytes`` bytes of memory ``kind`` and who can address it."""

    @abstractmethod
    def _wrap_stream(self, handle: int) -> Any:
        """A non-owning stream object for a raw handle."""

    @abstractmethod
    def _copy(self, dst: Tensor, src: Tensor, stream: int) -> None:
        """Queue the copy of ``src`` into ``dst`` on raw stream ``stream``."""

    @abstractmethod
    def copy_to_host(self, out: np.ndarray, src: Tensor) -> None:
        """Synchronous copy of ``src`` into the numpy array ``out``."""

    @abstractmethod
    def copy_from_host(self, dst: Tensor, arr: np.ndarray) -> None:
        """Synchronous copy of the numpy array ``arr`` into ``dst``."""


def check_copy(device: DeviceBase, dst: Tensor, src: Tensor) -> None:
    """Shared copy argument rules: same device object, dtype and element count."""
    for t, what in ((dst, "dst"), (src, "src")):
        if not isinstance(t, Tensor):
            raise TypeError(f"copy {what} must be a lowgrad Tensor, got {type(t).__name__}")
        if t.device is not device:
            raise ValueError(f"copy {what} {t.name!r} lives on {t.device!r}, not {device!r}")
    if dst.dtype is not src.dtype:
        raise TypeError(f"copy dtype mismatch: dst {dst.name!r} is {dst.dtype.name}, src {src.name!r} is {src.dtype.name}")
    if dst.numel != src.numel:
        raise ValueError(f"copy size mismatch: dst {dst.name!r} {dst.shape} vs src {src.name!r} {src.shape}")
