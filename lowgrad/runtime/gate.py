"""The device gate: ranks sharing one GPU as threads (the loopback communicator) queue a
collective part by part, each rank's part waiting on the device for the others'; the driver
calls that wait for the whole device while holding the driver's lock must not run in between.

Why. CUDA documents frees, allocations of device and page-locked memory and synchronous copies
as points of implicit synchronisation: they wait for the device, and while ``cuMemFree`` waits
it holds a lock of the driver that ``cuLaunchKernel`` and ``cuEventRecord`` in other threads
also take. When rank a has queued its device-side wait
for rank b and rank b's launch waits for that lock, the free waits for a's kernel, a's kernel
for b's launch, and b's launch for the free: the GPU hangs until the loopback's timeout. Seen on
an H100 on 2026-12-06 (every rank's stack dumped: three launches and an event record blocked,
one thread in ``cuMemFree``); NCCL's users met the same with ``cudaFree`` beside NCCL kernels.

The rule: a rank opens a *window* (:meth:`DeviceGate.open`) once its peers have met it on the
host and before it queues anything, and closes it once every peer has queued its part; a
device-wide call (:attr:`DeviceGate.device_wide`) waits until no window is open, and no window
opens while one runs. So a device-wide call only ever waits for collectives queued whole, which
finish."""
from __future__ import annotations

import threading
from types import TracebackType


class _DeviceWide:
    """The reusable context manager of :attr:`DeviceGate.device_wide` (no allocation per use:
    frees and copies go through it)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: DeviceGate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        g = self._gate
        with g._cond:
            while g._windows:
                g._cond.wait()
            g._device_wide += 1

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        g = self._gate
        with g._cond:
            g._device_wide -= 1
            if not g._device_wide:
                g._cond.notify_all()


class DeviceGate:
    """One per device: windows (ranks part-way through queuing a collective) and device-wide
    calls exclude each other; windows share, and so do device-wide calls (they nest)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._windows = 0  # ranks between meeting their peers and every peer having queued
        self._device_wide = 0  # device-wide calls running
        #: ``with gate.device_wide:`` around a driver call that waits for the whole device
        self.device_wide = _DeviceWide(self)

    def open(self) -> None:
        """A rank is about to queue its part of a collective its peers have met it for (waits
        while a device-wide call runs: it waits only for work queued whole, so it ends)."""
        with self._cond:
            while self._device_wide:
                self._cond.wait()
            self._windows += 1

    def close(self) -> None:
        """Every peer of the rank has queued its part (or the collective failed)."""
        with self._cond:
            self._windows -= 1
            if not self._windows:
                self._cond.notify_all()

    @property
    def windows(self) -> int:
        """Windows open now (for tests and diagnostics)."""
        return self._windows
