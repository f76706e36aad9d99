"""The CUDA backend's device: one :class:`Device` per GPU ordinal, on that GPU's primary
context (so pointers and streams are shared with PyTorch, CuPy or JAX in the same process)."""
from __future__ import annotations

import threading
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from lowgrad.base.integers import integer
from lowgrad.base.limits import HOST_ALLOC_LIMIT
from lowgrad.buffers import capture, release
from lowgrad.buffers.memory import KIND_ACCESS, RawBlock, aligned_host_buffer, host_array
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.backend import DeviceBase
from lowgrad.cuda import driver as _cuda
from lowgrad.cuda.stream import Event, Stream
from lowgrad.runtime.gate import DeviceGate

if TYPE_CHECKING:
    from lowgrad.cuda.kernels import CudaKernels

_CU_MEMHOSTALLOC_PORTABLE, _CU_MEMHOSTALLOC_DEVICEMAP, _CU_MEMHOSTALLOC_WRITECOMBINED = 1, 2, 4

_tls = threading.local()
_devices: dict[int, Device] = {}
_devices_lock = threading.Lock()


class Device(DeviceBase):
    """GPU ``ordinal`` through its primary context. ``Device(0) is Device(0)``.

    Properties: ``name``, ``compute_capability`` ((major, minor)), ``arch`` ("sm_90"),
    ``sm_count``, ``total_memory`` (bytes), ``l2_bytes``, ``pci_bus_id``.
    """

    backend = "cuda"
    stream_type = Stream

    def __new__(cls, ordinal: int = 0) -> Device:
        ordinal = integer("device ordinal", ordinal)
        with _devices_lock:
            dev = _devices.get(ordinal)
            if dev is None:
                dev = super().__new__(cls)
                dev._open(ordinal)
                _devices[ordinal] = dev
            return dev

    def __init__(self, ordinal: int = 0) -> None:  # state is set once in _open
        pass

    def _open(self, ordinal: int) -> None:
        DeviceBase.__init__(self)
        drv = _cuda.driver()
        count = _cuda.check("cuDeviceGetCount", drv.cuDeviceGetCount())
        if not 0 <= ordinal < count:
            raise ValueError(f"device ordinal {ordinal} out of range: {count} GPU(s) visible")
        self.ordinal = ordinal
        self._dev = _cuda.check("cuDeviceGet", drv.cuDeviceGet(ordinal))
        self._ctx = _cuda.check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(self._dev))
        self.context_handle = int(self._ctx)
        self.activate()
        self.default_stream = Stream.wrap(self, 0)
        self._kernels: CudaKernels | None = None
        #: allocations, frees, synchronous copies and synchronize wait for the whole device: they
        #: pass this gate, which keeps them out of a loopback collective queued part by part
        self.sync_gate = DeviceGate()

    # ---- context -----------------------------------------------------------------------
    def activate(self) -> None:
        """Make this device's primary context current on the calling thread (cheap when it is)."""
        if getattr(_tls, "ctx", None) != self.context_handle:
            _cuda.check("cuCtxSetCurrent", _cuda.driver().cuCtxSetCurrent(self._ctx))
            _tls.ctx = self.context_handle

    def relax_thread_capture_mode(self) -> None:
        """Put the calling thread in CUDA's relaxed stream-capture mode, for a thread that only
        watches (a communicator's watchdog): in the default (global) mode its ``cuEventQuery``
        would invalidate a global-mode capture on another thread (``torch.cuda.graph``'s default),
        as PyTorch's NCCL watchdog found (pytorch#104555, #105182)."""
        drv = _cuda.driver()
        _cuda.check("cuThreadExchangeStreamCaptureMode",
                    drv.cuThreadExchangeStreamCaptureMode(drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))

    def synchronize(self) -> None:
        """Block the host until all work on this device is done."""
        capture.forbid("Device.synchronize (a host sync)")
        self.activate()
        with self.sync_gate.device_wide:
            _cuda.check("cuCtxSynchronize", _cuda.driver().cuCtxSynchronize())
        release.drain()

    # ---- properties --------------------------------------------------------------------
    def attribute(self, name: str) -> int:
        """``cuDeviceGetAttribute`` by the enum's suffix, e.g. ``"MULTIPROCESSOR_COUNT"``."""
        drv = _cuda.driver()
        attr = getattr(drv.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name)
        return int(_cuda.check("cuDeviceGetAttribute", drv.cuDeviceGetAttribute(attr, self._dev)))

    @cached_property
    def name(self) -> str:
        raw = _cuda.check("cuDeviceGetName", _cuda.driver().cuDeviceGetName(256, self._dev))
        return raw.split(b"\0", 1)[0].decode()

    @cached_property
    def compute_capability(self) -> tuple[int, int]:
        return (self.attribute("COMPUTE_CAPABILITY_MAJOR"), self.attribute("COMPUTE_CAPABILITY_MINOR"))

    @property
    def arch(self) -> str:
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @cached_property
    def sm_count(self) -> int:
        return self.attribute("MULTIPROCESSOR_COUNT")

    @cached_property
    def total_memory(self) -> int:
        return int(_cuda.check("cuDeviceTotalMem", _cuda.driver().cuDeviceTotalMem(self._dev)))

    @cached_property
    def l2_bytes(self) -> int:
        return self.attribute("L2_CACHE_SIZE")

    @cached_property
    def pci_bus_id(self) -> str:
        raw = _cuda.check("cuDeviceGetPCIBusId", _cuda.driver().cuDeviceGetPCIBusId(64, self._dev))
        return raw.split(b"\0", 1)[0].decode()

    @cached_property
    def stream_priority_range(self) -> tuple[int, int]:
        """(least, greatest) priority; lower numbers are higher priorities."""
        self.activate()
        lo, hi = _cuda.check("cuCtxGetStreamPriorityRange", _cuda.driver().cuCtxGetStreamPriorityRange())
        return int(lo), int(hi)

    def capture_of(self, stream: StreamLike) -> Any:
        """The :class:`lowgrad.Graph` capturing ``stream`` on this thread, None when nothing
        captures it; CaptureError when something else captures it (see :func:`graph.capture_of`)."""
        from lowgrad.cuda.graph import capture_of

        return capture_of(stream)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes (``cuMemGetInfo``)."""
        self.activate()
        free, total = _cuda.check("cuMemGetInfo", _cuda.driver().cuMemGetInfo())
        return int(free), int(total)

    # ---- streams and events ------------------------------------------------------------
    def stream(self, priority: int = 0) -> Stream:
        """A new non-blocking stream (lower ``priority`` numbers run first)."""
        return Stream(self, priority)

    def event(self, timing: bool = False, name: str = "") -> Event:
        """A new event; ``timing=True`` allows ``elapsed_ms``."""
        return Event(self, timing, name)

    def _wrap_stream(self, handle: int) -> Stream:
        return Stream.wrap(self, handle)

    @property
    def kernels(self) -> CudaKernels:
        """This device's compiled kernels (compiled or loaded from the cache at first use)."""
        if self._kernels is None:
            capture.forbid("compiling and loading lowgrad's kernels (first kernel use on this device)")
            from lowgrad.cuda.kernels import CudaKernels
            self._kernels = CudaKernels(self)
        return self._kernels

    # ---- memory ------------------------------------------------------------------------
    #: the device-accessible kinds (pageable host memory is not mapped)
    kernel_kinds = frozenset(kind for kind, (on_device, _) in KIND_ACCESS.items() if on_device)

    def memory_limit(self, kind: str) -> int:
        return self.total_memory if kind == "device" else HOST_ALLOC_LIMIT

    def _raw_alloc(self, kind: str, nbytes: int) -> RawBlock:
        """device: ``cuMemAlloc``; pinned/write-combined: mapped ``cuMemHostAlloc``; host:
        pageable numpy memory. Access follows :data:`~lowgrad.buffers.memory.KIND_ACCESS`."""
        drv = _cuda.driver()
        self.activate()
        size, on_device = max(nbytes, 1), KIND_ACCESS[kind][0]
        if kind == "host":
            ptr, view = aligned_host_buffer(nbytes)
            return RawBlock(ptr, _noop, view, on_device)
        if kind == "device":
            with self.sync_gate.device_wide:
                ptr = int(_cuda.check("cuMemAlloc", drv.cuMemAlloc(size)))
            return RawBlock(ptr, _Free(self, drv.cuMemFree, ptr), None, on_device)
        flags = _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP
        if kind == "write_combined":
            flags |= _CU_MEMHOSTALLOC_WRITECOMBINED
        with self.sync_gate.device_wide:
            host = int(_cuda.check("cuMemHostAlloc", drv.cuMemHostAlloc(size, flags)))
            dptr = int(_cuda.check("cuMemHostGetDevicePointer", drv.cuMemHostGetDevicePointer(host, 0)))
            if dptr != host:
                drv.cuMemFreeHost(host)
                raise ValueError("pinned memory needs unified addressing (device pointer != host pointer)")
        return RawBlock(host, _Free(self, drv.cuMemFreeHost, host), host_array(host, nbytes), on_device)

    def _copy(self, dst: Tensor, src: Tensor, stream: int) -> None:
        if dst.nbytes:
            _cuda.check("cuMemcpyAsync", _cuda.driver().cuMemcpyAsync(dst.ptr, src.ptr, dst.nbytes, stream))

    def copy_to_host(self, out: np.ndarray, src: Tensor) -> None:
        capture.forbid(f"reading {src.name!r} to the host (a host sync)")
        self.synchronize()
        if src.nbytes:
            with self.sync_gate.device_wide:
                _cuda.check("cuMemcpyDtoH", _cuda.driver().cuMemcpyDtoH(out.ctypes.data, src.ptr, src.nbytes))

    def copy_from_host(self, dst: Tensor, arr: np.ndarray) -> None:
        capture.forbid(f"writing {dst.name!r} from the host (a host sync)")
        self.synchronize()
        if dst.nbytes:
            with self.sync_gate.device_wide:
                _cuda.check("cuMemcpyHtoD", _cuda.driver().cuMemcpyHtoD(dst.ptr, arr.ctypes.data, dst.nbytes))
                # from pageable memory the call returns once the bytes are staged, before the DMA
                # has landed (CUDA's documented sync behaviour): a kernel queued next on a
                # non-blocking stream could read the old bytes (the likely cause of two reduce_sr
                # mismatches on an H100 with two test processes sharing it, 2026-12-06)
                _cuda.check("cuCtxSynchronize", _cuda.driver().cuCtxSynchronize())

    def __repr__(self) -> str:
        return f"Device({self.ordinal})"

    def __reduce__(self) -> tuple[type, tuple[int | None]]:
        return (Device, (self.ordinal,))


class _Free:
    """Frees one driver allocation with the device's context pushed (safe from any thread)."""

    __slots__ = ("device", "fn", "ptr")

    def __init__(self, device: Device, fn: Any, ptr: int) -> None:
        self.device, self.fn, self.ptr = device, fn, ptr

    def __call__(self) -> None:
        drv = _cuda.driver()
        drv.cuCtxPushCurrent(self.device._ctx)
        try:
            with self.device.sync_gate.device_wide:  # a free waits for the device (lowgrad.runtime.gate)
                self.fn(self.ptr)
        finally:
            drv.cuCtxPopCurrent()


def _noop() -> None:
    return None


def device_count() -> int:
    """Number of visible GPUs; 0 where there is no usable driver or no GPU (``Device(0)`` then
    raises CudaUnavailableError with the reason)."""
    if not _cuda.available():
        return 0
    return int(_cuda.check("cuDeviceGetCount", _cuda.driver().cuDeviceGetCount()))


__all__ = ["Device", "device_count", "stream_handle", "StreamLike"]
