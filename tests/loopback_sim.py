"""The loopback communicator without a GPU: its kernels interpreted in Python on host memory.

:class:`SimDevice` is a host device whose kernel table also "launches" the loopback kernels of
``kernels/loopback.cu``: each launch runs at once on the calling rank thread (a sync blocks that
thread until its peers arrive, as the kernel blocks its stream). That is one legal schedule of
the device work, so it checks the communicator's protocol — the meetings, the table entries, the
copy and reduction arguments, the all-to-all schedule, sends and receives, aborts, timeouts and
departures — but not stream ordering (the GPU tests do). The driver's calls that wait for the whole
device (synchronize, host copies, allocations and frees: CUDA's implicit synchronisation) wait
until no rank's sync is waiting for its peers, and they wait holding the driver's lock, which a
launch takes too (as ``cuMemFree`` held an H100's driver lock against other threads'
``cuLaunchKernel``); if a sync still waits after ``SYNC_BOUND`` seconds the call raises (on a GPU
it would hang until the loopback timeout). The device's gate
(:class:`lowgrad.runtime.gate.DeviceGate`) is around each such call, as on a
:class:`lowgrad.Device`; :class:`UngatedSimDevice` leaves it out. ``patch(monkeypatch)`` swaps the
launcher in :mod:`lowgrad.cuda.loopback`; ``run(world, fn)`` runs ranks through
``lowgrad.run_threads(..., share_gpu=SimDevice())``.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Any

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.buffers.memory import RawBlock
from lowgrad.cuda import loopback
from lowgrad.cuda.compiler import constants
from lowgrad.host.device import HostDevice
from lowgrad.host.kernels import HostKernels
from lowgrad.host.reduce import host_reduce
from lowgrad.runtime.gate import DeviceGate

C = constants("loopback")
OPS = {C["LB_SUM"]: "sum", C["LB_MAX"]: "max", C["LB_AVG"]: "avg"}
REDUCE_DTYPES = {"loopback_reduce_bf16": lg.bf16, "loopback_reduce_fp16": lg.fp16, "loopback_reduce_fp32": lg.fp32,
                 "loopback_reduce_fp64": lg.fp64, "loopback_reduce_byte": lg.byte}


def words(ptr: int, n: int, ctype: Any = ctypes.c_uint64) -> np.ndarray:
    return np.ctypeslib.as_array((ctype * n).from_address(ptr))


def word(ptr: int, i: int) -> int:
    return ctypes.c_uint64.from_address(ptr + 8 * i).value


def sync(a: dict[str, Any]) -> None:
    status = words(a["status"], C["LB_STATUS"], ctypes.c_uint32)
    W, r = a["world"], a["rank"]
    counters = words(a["counters"], W * W + 1)  # then the device copy of "failed"
    if status[C["LB_ERROR"]]:
        counters[W * W] = 1
        return
    for p, e in zip(a["ptrs"][:a["nptrs"]], a["entries"][:a["nptrs"]]):
        ctypes.c_uint64.from_address(a["table"] + 8 * e).value = p
    peers = [q for q in range(W) if q != r and (a["peers"] >> q) & 1]
    mine = {}
    for q in peers:
        counters[r * W + q] += 1  # only rank r writes this word
        mine[q] = int(counters[r * W + q])
    t0 = time.monotonic()
    for q in peers:
        while counters[q * W + r] < mine[q]:
            fail = (C["LB_ERR_ABORTED"] if status[C["LB_ABORT"]] else C["LB_ERR_LEFT"] if status[C["LB_LEFT"] + q]
                    else C["LB_ERR_TIMEOUT"] if a["timeout_ns"] and time.monotonic() - t0 > a["timeout_ns"] / 1e9
                    else 0)
            if status[C["LB_ERROR"]]:
                counters[W * W] = 1
                return
            if fail:
                counters[W * W] = 1
                status[C["LB_ERROR"]], status[C["LB_WAITER"]], status[C["LB_PEER"]] = fail, r, q
                return
            time.sleep(2e-4)


SYNC_BOUND = 5.0
_GATE = DeviceGate()  # the simulated GPU's
_syncs = threading.Condition()
_waiting = [0]  # ranks inside a sync (the simulated device is busy)
_driver = threading.Lock()  # the driver's lock: device-wide calls wait holding it, launches take it


def device_wide_synchronize() -> None:
    with _driver, _syncs:
        if not _syncs.wait_for(lambda: _waiting[0] == 0, SYNC_BOUND):
            raise AssertionError(f"a device-wide call waited {SYNC_BOUND:g} s for loopback syncs that did not finish: "
                                 "a rank queued a device-side wait for a peer that waits on the host, or whose "
                                 "launch waits for the driver's lock this call holds")


def copy(a: dict[str, Any]) -> None:
    if not word(a["flag"], 0):
        ctypes.memmove(a["dst"], word(a["table"], a["entry"]) + a["src_offset"], a["nbytes"])


def reduce(dtype: lg.DType, a: dict[str, Any]) -> None:
    if word(a["flag"], 0):
        return
    size, n = dtype.itemsize, a["n"]

    def view(ptr: int) -> np.ndarray:
        return words(ptr + a["offset"] * size, n * size, ctypes.c_uint8).view(dtype.np)
    srcs = [view(word(a["table"], q * loopback.PTRS + a["slot"])).copy() for q in range(a["world"])]
    view(a["dst"])[:] = host_reduce(srcs, OPS[a["op"]], a["world"], dtype)


class SimKernel:
    """Stands in for :class:`lowgrad.cuda.kernels.Kernel`: runs the launch at once."""

    def __init__(self, spec: Any, func: Any) -> None:
        self.spec = spec

    def launch(self, grid: int, stream: int, *args: Any) -> None:
        a, i = {}, 0
        for p in self.spec.params:
            a[p.name] = args[i] if p.count == 1 else list(args[i:i + p.count])
            i += p.count
        name = self.spec.symbol
        with _driver:  # queuing a launch takes the driver's lock; the kernel then runs without it
            pass
        if name == "loopback_sync":
            with _syncs:
                _waiting[0] += 1
            try:
                sync(a)
            finally:
                with _syncs:
                    _waiting[0] -= 1
                    _syncs.notify_all()
        elif name == "loopback_copy":
            copy(a)
        elif name == "loopback_delay":
            time.sleep(a["ns"] / 1e9)
        else:
            reduce(REDUCE_DTYPES[name], a)


class SimKernels(HostKernels):
    """The host kernels, plus what the loopback communicator asks of a CUDA kernel table."""

    def kernel(self, spec: Any) -> Any:
        return self  # the launcher only takes `.func`

    func = 0

    def grid(self, n: int, block: int) -> int:
        return 1


class SimDevice(HostDevice):
    """A host device whose kernel table also runs the loopback kernels, and whose synchronize,
    host copies, allocations and frees wait for every rank's syncs holding the driver's lock
    (as a GPU's would), each behind the device's gate."""

    def __init__(self, name: str = "sim") -> None:
        super().__init__(name)
        # every SimDevice is the one simulated GPU (its driver lock and syncs are this module's), so
        # they share one gate, as every lowgrad.Device(0) is one: a free drained late from an
        # earlier test's SimDevice passes the same gate as this test's collectives
        self.sync_gate = self.gate_type() if self.gate_type is not DeviceGate else _GATE

    gate_type: type[DeviceGate] = DeviceGate

    def _device_wide(self) -> None:
        with self.sync_gate.device_wide:
            device_wide_synchronize()

    def synchronize(self) -> None:
        self._device_wide()
        super().synchronize()

    def copy_to_host(self, out: np.ndarray, src: lg.Tensor) -> None:
        self._device_wide()
        super().copy_to_host(out, src)

    def copy_from_host(self, dst: lg.Tensor, arr: np.ndarray) -> None:
        self._device_wide()
        super().copy_from_host(dst, arr)

    def _raw_alloc(self, kind: str, nbytes: int) -> RawBlock:
        self._device_wide()
        block = super()._raw_alloc(kind, nbytes)
        return block._replace(free=self._device_wide)  # the block is numpy's; the free is the driver's wait

    @property
    def kernels(self) -> SimKernels:
        if self._kernels is None:
            self._kernels = SimKernels()
        return self._kernels


class NoGate(DeviceGate):
    """A gate that lets everything through (what the loopback did before it had one)."""

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __init__(self) -> None:
        super().__init__()
        self.device_wide = contextlib.nullcontext()  # type: ignore[assignment]


class UngatedSimDevice(SimDevice):
    gate_type = NoGate


def patch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loopback, "Kernel", SimKernel)


def run(world: int, fn: Any, timeout: float = 30, device: SimDevice | None = None) -> list[Any]:
    return lg.run_threads(world, fn, backend="cuda", share_gpu=device or SimDevice("sim"), timeout=timeout)
