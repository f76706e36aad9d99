"""The host backend: the same device surface on the CPU with numpy memory, eager streams and
trivially complete events. It is the executable reference of the CUDA backend."""
from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from lowgrad.base.limits import HOST_ALLOC_LIMIT
from lowgrad.buffers import release
from lowgrad.buffers.memory import RawBlock, aligned_host_buffer
from lowgrad.buffers.streams import StreamLike
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.backend import DeviceBase, check_priority
from lowgrad.contracts.kernels import Kernels

_ids = itertools.count()


class HostStream:
    """An eager stream (a :class:`lowgrad.contracts.backend.Stream`): work is done when the call that
    queues it returns. ``priority`` is checked against the device's range like CUDA's and has
    no effect."""

    __slots__ = ("device", "handle", "priority")

    def __init__(self, device: HostDevice, priority: int = 0, handle: int = 0) -> None:
        self.device, self.priority, self.handle = device, check_priority(device, priority), handle

    def synchronize(self) -> None:
        """Nothing to wait for; a safe point for deferred releases."""
        release.drain()

    def query(self) -> bool:
        return True

    def wait(self, event: HostEvent) -> None:
        """Eager streams need no waits."""

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> HostStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostStream(handle={self.handle})"


class HostEvent:
    """A trivially complete event (a :class:`lowgrad.contracts.backend.Event`); records the host clock
    for :meth:`elapsed_ms`."""

    __slots__ = ("device", "name", "timing", "_t")

    def __init__(self, device: HostDevice, timing: bool = False, name: str = "") -> None:
        self.device, self.name, self.timing, self._t = device, name, timing, 0.0

    def record(self, stream: Any = None) -> HostEvent:
        self._t = time.perf_counter()
        return self

    def wait(self, stream: Any = None) -> None:
        """Eager streams need no waits."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_ms(self, end: HostEvent) -> float:
        if not (self.timing and end.timing):
            raise ValueError("elapsed_ms needs two events created with timing=True")
        return (end._t - self._t) * 1e3

    def close(self) -> None:
        """Nothing to release."""


class HostDevice(DeviceBase):
    """The CPU backend. Every memory kind is numpy memory (aligned to 256 bytes); ``kind`` is
    kept for the report. Kernels are the numpy reference (:mod:`lowgrad.sr.reference`)."""

    backend = "host"
    stream_type = HostStream
    ordinal = None

    def __init__(self, name: str = "") -> None:
        super().__init__()
        self.name = name or f"host{next(_ids)}"
        self.default_stream = HostStream(self)
        self._kernels: Any = None

    def activate(self) -> None:
        """No context on the host."""

    def synchronize(self) -> None:
        """Host work is already complete; a safe point for deferred releases."""
        release.drain()

    def stream(self, priority: int = 0) -> HostStream:
        """A new eager stream; ``priority`` must lie in :attr:`stream_priority_range`."""
        return HostStream(self, priority)

    def event(self, timing: bool = False, name: str = "") -> HostEvent:
        return HostEvent(self, timing, name)

    @property
    def stream_priority_range(self) -> tuple[int, int]:
        """(0, 0): eager streams have one priority."""
        return (0, 0)

    def capture_of(self, stream: StreamLike) -> None:
        """None: the host backend runs work eagerly, nothing is ever captured."""
        return None

    def _wrap_stream(self, handle: int) -> HostStream:
        return HostStream(self, 0, handle)

    @property
    def kernels(self) -> Kernels:
        """The numpy reference kernels (:class:`lowgrad.host.kernels.HostKernels`)."""
        if self._kernels is None:
            from lowgrad.host.kernels import HostKernels
            self._kernels = HostKernels()
        return self._kernels

    def memory_limit(self, kind: str) -> int:
        return HOST_ALLOC_LIMIT

    def _raw_alloc(self, kind: str, nbytes: int) -> RawBlock:
        """Every kind is pageable CPU memory here: host-accessible only."""
        ptr, view = aligned_host_buffer(nbytes)
        return RawBlock(ptr, _noop, view, device_accessible=False)

    def _copy(self, dst: Tensor, src: Tensor, stream: int) -> None:
        d, s = dst.allocation.host_bytes(), src.allocation.host_bytes()
        d[dst.offset:dst.offset + dst.nbytes] = s[src.offset:src.offset + src.nbytes]

    def copy_to_host(self, out: np.ndarray, src: Tensor) -> None:
        out.reshape(-1).view(np.uint8)[:] = src.allocation.host_bytes()[src.offset:src.offset + src.nbytes]

    def copy_from_host(self, dst: Tensor, arr: np.ndarray) -> None:
        dst.numpy()[...] = arr.reshape(dst.shape)

    def __repr__(self) -> str:
        return f"HostDevice({self.name!r})"


def _noop() -> None:
    return None
