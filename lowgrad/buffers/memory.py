"""Named allocations, the per-device memory report, and the lazy allocator.

An :class:`Allocation` is one raw block (device, pinned, write-combined or plain host memory)
owned by a backend. :meth:`Allocation.close` or garbage collection, whichever comes first, ends
lowgrad's use of it (every tensor viewing it then raises on use); the memory itself is freed
once no exported view (DLPack, a host numpy view) holds it any more, at the next safe point of
:mod:`lowgrad.buffers.release`.
"""
from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from lowgrad.base.errors import ClosedError
from lowgrad.buffers import release

KINDS = ("device", "pinned", "write_combined", "host")
#: who can address each kind on a GPU backend: kind -> (device-accessible, host-accessible).
#: device: GPU only; pinned and write-combined: both (mapped, one address under unified
#: addressing); host: pageable CPU memory, CPU only. A backend reports what its allocation
#: really is (:class:`RawBlock`): on the host backend every kind is CPU memory.
KIND_ACCESS: dict[str, tuple[bool, bool]] = {
    "device": (True, False), "pinned": (True, True), "write_combined": (True, True), "host": (False, True)}
ALIGN = 256  # bytes; every tensor of a lazy commit starts on this boundary
MAX_BYTES = 1 << 48  # anything above is a mistake, not a request


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown memory kind {kind!r}; expected one of {KINDS}")
    return kind


def check_nbytes(nbytes: int, limit: int, what: str) -> int:
    """Reject negative, non-integer or absurd sizes (``limit``: what the memory kind can hold)."""
    if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool):
        raise TypeError(f"{what}: size must be an int, got {type(nbytes).__name__}")
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"{what}: negative size {nbytes}")
    if nbytes > min(limit, MAX_BYTES):
        raise ValueError(f"{what}: {nbytes} bytes is more than this memory kind can hold ({limit} bytes)")
    return nbytes


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Registry:
    """Live bytes per (name, kind) of one device; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str], int] = {}

    def add(self, parts: dict[str, int], kind: str, sign: int) -> None:
        with self._lock:
            for name, n in parts.items():
                key = (name, kind)
                v = self._bytes.get(key, 0) + sign * n
                if v:
                    self._bytes[key] = v
                else:
                    self._bytes.pop(key, None)

    def report(self) -> MemoryReport:
        with self._lock:
            return MemoryReport(dict(self._bytes))


class MemoryReport:
    """Bytes by allocation name and kind. ``as_dict()`` for programs, ``str()`` for people."""

    def __init__(self, by_name_kind: dict[tuple[str, str], int]) -> None:
        self.by_name_kind = by_name_kind

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{kind: {name: bytes}}``."""
        out: dict[str, dict[str, int]] = {}
        for (name, kind), n in sorted(self.by_name_kind.items()):
            out.setdefault(kind, {})[name] = n
        return out

    def total(self, kind: str | None = None) -> int:
        """Total bytes, of one kind or of all kinds."""
        return sum(n for (_, k), n in self.by_name_kind.items() if kind is None or k == kind)

    def bytes(self, name: str, kind: str | None = None) -> int:
        """Bytes under ``name`` (of one kind, or summed over kinds)."""
        return sum(n for (nm, k), n in self.by_name_kind.items() if nm == name and (kind is None or k == kind))

    def __str__(self) -> str:
        rows = [f"{'name':<28} {'kind':<15} {'MiB':>12}"]
        for (name, kind), n in sorted(self.by_name_kind.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            rows.append(f"{name:<28} {kind:<15} {n / 2**20:>12.3f}")
        for kind in KINDS:
            t = self.total(kind)
            if t:
                rows.append(f"{'total':<28} {kind:<15} {t / 2**20:>12.3f}")
        return "\n".join(rows)


class RawBlock(NamedTuple):
    """What a backend's raw allocation returns: ``ptr`` (the address kernels and copies use),
    ``free`` (releases the block, exactly once), ``host`` (a writable uint8 numpy view when the
    CPU can address the block, else None) and ``device_accessible`` (the GPU's kernels can
    address it)."""

    ptr: int
    free: Callable[[], None]
    host: np.ndarray | None
    device_accessible: bool


class Memory:
    """The raw block behind an :class:`Allocation`: it lives while the allocation is open or an
    exported view (DLPack capsule, :meth:`Allocation.host_bytes` array) refers to it. When the
    last reference goes, its :class:`~lowgrad.buffers.release.Finalizer` queues the free and the report
    update (:mod:`lowgrad.buffers.release`). It holds nothing that refers back to it, so reference
    counting (not the cyclic GC) frees it."""

    __slots__ = ("ptr", "nbytes", "host", "_release", "__weakref__")
    _release: release.Finalizer  # set by Allocation.bind; refers to this block weakly only

    def __init__(self, ptr: int, nbytes: int, host: np.ndarray | None) -> None:
        self.ptr, self.nbytes, self.host = ptr, nbytes, host  # host: a uint8 view, or None

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """The whole block as writable uint8 (host-visible memory); an array made from it keeps
        this block alive."""
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


class Allocation:
    """One raw block of memory. ``ptr`` is the device-visible address (for pinned memory the
    mapped device pointer, equal to the host address under unified addressing).

    ``parts`` maps tensor names to the bytes they occupy, for the report. A lazy allocation has
    ``ptr is None`` until :meth:`LazyAllocator.commit`. ``device_accessible`` and
    ``host_accessible`` say who can address the block, as the backend reported it at binding
    (both False before); they decide DLPack's device type and the CUDA array interface.
    """

    __slots__ = ("device", "kind", "nbytes", "parts", "device_accessible", "host_accessible", "_ptr", "_host",
                 "_mem", "_bound", "__weakref__")

    def __init__(self, device: Any, kind: str, nbytes: int, parts: dict[str, int]) -> None:
        self.device, self.kind, self.nbytes, self.parts = device, kind, nbytes, parts
        self.device_accessible = self.host_accessible = False
        self._ptr: int | None = None
        self._host: np.ndarray | None = None
        self._mem: Memory | None = None
        self._bound = False

    def bind(self, block: RawBlock) -> None:
        """Attach the raw block; its ``free`` releases it exactly once, after :meth:`close` (or
        collection) and the release of every exported view."""
        mem = Memory(block.ptr, self.nbytes, block.host)
        mem._release = release.Finalizer(mem, _release, block.free, self.device.registry, self.parts, self.kind)
        self._mem, self._ptr, self._host, self._bound = mem, block.ptr, block.host, True
        self.device_accessible, self.host_accessible = block.device_accessible, block.host is not None
        self.device.registry.add(self.parts, self.kind, +1)

    @property
    def bound(self) -> bool:
        """The raw block was attached (a lazy allocation: after its commit), even if closed since."""
        return self._bound

    @property
    def ptr(self) -> int:
        p = self._ptr
        if p is None:
            raise ClosedError(self._state_message())
        return p

    @property
    def closed(self) -> bool:
        return self._bound and self._ptr is None

    @property
    def memory(self) -> Memory:
        """The raw block (an exporter holds it to keep the memory alive); raises when closed."""
        m = self._mem
        if m is None:
            raise ClosedError(self._state_message())
        return m

    def host_bytes(self) -> np.ndarray:
        """A writable uint8 numpy view of the whole block (host-visible kinds only); the view keeps
        the memory alive after :meth:`close`."""
        mem = self.memory
        if mem.host is None:
            raise ValueError(f"{self.kind} memory is not host-visible")
        return np.asarray(mem)

    def close(self) -> None:
        """End lowgrad's use of the block now (tensors raise ClosedError); idempotent. The memory
        is freed here unless an exported view still holds it, then when the last one goes."""
        self._ptr = self._host = None
        self._mem = None  # the last reference: the Memory's finalizer queues the free
        release.drain()

    def _state_message(self) -> str:
        names = ", ".join(self.parts) or "?"
        if not self._bound:
            return f"tensor {names!r} used before its lazy allocator was committed"
        return f"tensor {names!r} used after its memory was freed (close())"


def _release(free: Callable[[], None], registry: Registry, parts: dict[str, int], kind: str) -> None:
    """Run by :func:`lowgrad.buffers.release.drain`: free the block, then update the report."""
    free()
    registry.add(parts, kind, -1)


def aligned_host_buffer(nbytes: int) -> tuple[int, np.ndarray]:
    """Plain (pageable) host memory of ``nbytes`` starting on an ALIGN boundary: (address, view);
    the view keeps the numpy buffer alive."""
    buf = np.empty(nbytes + ALIGN, np.uint8)
    start = (-buf.ctypes.data) % ALIGN
    return buf.ctypes.data + start, buf[start:start + nbytes]


def host_array(ptr: int, nbytes: int) -> np.ndarray:
    """A writable uint8 numpy array over raw host memory at ``ptr`` (no copy, no ownership)."""
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
