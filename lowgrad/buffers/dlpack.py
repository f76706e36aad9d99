"""DLPack export in plain ctypes: the versioned ``DLManagedTensorVersioned`` capsule
(``"dltensor_versioned"``, DLPack 1.x, writable) for a consumer that passes ``max_version`` >=
(1, 0), the legacy ``DLManagedTensor`` capsule (``"dltensor"``) otherwise.

Lifetime: an export holds the tensor's raw block (:class:`lowgrad.buffers.memory.Memory`), not the
tensor, so ``close()`` of the tensor or of its manager ends lowgrad's use at once while the memory
stays valid until the consumer calls the deleter. The deleter only drops that reference; when it
was the last one, the block's finalizer queues the free (:mod:`lowgrad.buffers.release`).

The capsules have no destructor: a capsule destructor runs while the consumer's exception may be
pending (numpy refusing bf16), and Python code cannot run there without replacing that exception
by a ``SystemError``. Instead every drain of :mod:`lowgrad.buffers.release` looks at the capsules not yet
consumed: a consumed one (renamed ``used_...`` by the consumer) is forgotten, one that nobody but
lowgrad refers to any more was dropped unconsumed and its export is released. CPython only (the
check reads reference counts).
"""
from __future__ import annotations

import ctypes
import itertools
import sys
from typing import Any

from lowgrad.buffers import release

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3
VERSION = (1, 1)  # the newest DLPack this module writes (1.1 adds the fp8 type codes)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_LEGACY, _VERSIONED = b"dltensor", b"dltensor_versioned"
# Keyed by an export number that is never reused (struct addresses are): a late pop can never
# remove a newer export.
_exports: dict[int, tuple[Any, ...]] = {}  # export -> (struct, shape, Memory) while the export lives
_unconsumed: dict[int, tuple[Any, bytes]] = {}  # export -> (capsule, its name) until consumed
_numbers = itertools.count(1)


@_Deleter  # type: ignore[untyped-decorator]  # a ctypes C callback: typeshed calls it with (*Any) -> Any
def _delete_legacy(addr: int) -> None:
    """The consumer's release (any thread, maybe inside the GC): one atomic dict pop, no lock."""
    _exports.pop(_DLManagedTensor.from_address(addr).manager_ctx, None)


@_Deleter  # type: ignore[untyped-decorator]  # as above
def _delete_versioned(addr: int) -> None:
    """As :func:`_delete_legacy`, for the versioned struct."""
    _exports.pop(_DLManagedTensorVersioned.from_address(addr).manager_ctx, None)


_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _refs(entry: tuple[Any, bytes]) -> int:
    return sys.getrefcount(entry[0])


_ALONE = _refs((object(), b""))  # the count of a capsule referred to by its entry only


def _poll() -> None:
    """Forget consumed capsules; release the exports of capsules dropped unconsumed (a drain
    calls this, from normal code)."""
    if not _unconsumed:
        return
    for number, entry in _unconsumed.copy().items():
        if not _api.PyCapsule_IsValid(entry[0], entry[1]):  # renamed: the consumer owns the deleter
            _unconsumed.pop(number, None)
        elif _refs(entry) <= _ALONE:  # nobody else can consume it any more
            _unconsumed.pop(number, None)
            _exports.pop(number, None)


release.add_poller(_poll)


def check_request(devices: tuple[tuple[int, int], ...], max_version: Any, dl_device: Any,
                  copy: Any) -> tuple[bool, tuple[int, int]]:
    """Validate ``__dlpack__``'s arguments for memory that DLPack can name as any of ``devices``
    (the first is its own: mapped pinned memory is ``kDLCUDAHost``, also addressable as ``kDLCPU``
    and, through unified addressing, as ``kDLCUDA`` of its GPU; PyTorch 2.11 refuses
    ``kDLCUDAHost``): (versioned capsule?, the device to name in it, ``dl_device`` when given).
    BufferError for what cannot be done without a copy, TypeError/ValueError for malformed
    arguments."""
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"__dlpack__ copy must be None or a bool, got {copy!r}")
    if copy:
        raise BufferError("lowgrad tensors are exported without copying (copy=True unsupported)")
    device = devices[0]
    if dl_device is not None:
        if not (isinstance(dl_device, tuple) and len(dl_device) == 2):
            raise TypeError(f"__dlpack__ dl_device must be a (device_type, device_id) tuple, got {dl_device!r}")
        if tuple(dl_device) not in devices:
            raise BufferError(f"cannot export to DLPack device {dl_device} without a copy; the tensor is on {device}")
        device = tuple(dl_device)
    if max_version is None:
        return False, device
    if not (isinstance(max_version, tuple) and len(max_version) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in max_version)):
        raise TypeError(f"__dlpack__ max_version must be a (major, minor) tuple of ints, got {max_version!r}")
    return max_version[0] >= 1, device


def to_capsule(tensor: Any, device: tuple[int, int], max_version: tuple[int, int] | None) -> Any:
    """A capsule viewing ``tensor`` (contiguous; strides NULL): versioned (writable, version
    ``min(max_version, VERSION)``) when ``max_version`` is given, else legacy."""
    mem = tensor.allocation.memory  # ClosedError before anything is built
    dt = tensor.dtype
    shape = (ctypes.c_int64 * max(1, tensor.ndim))(*tensor.shape)
    m: Any
    if max_version is None:
        m, name = _DLManagedTensor(), _LEGACY
        m.deleter = _delete_legacy
    else:
        m, name = _DLManagedTensorVersioned(), _VERSIONED
        m.deleter = _delete_versioned
        m.version = _DLPackVersion(*min(tuple(max_version), VERSION))
        m.flags = 0  # writable, not a copy
    t = m.dl_tensor
    t.data = tensor.ptr
    t.device = _DLDevice(device[0], device[1])
    t.ndim = tensor.ndim
    t.dtype = _DLDataType(dt.dlpack_code, dt.itemsize * 8, 1)
    t.shape = shape
    t.strides = None
    t.byte_offset = 0
    number = m.manager_ctx = next(_numbers)
    _exports[number] = (m, shape, mem)
    capsule = _api.PyCapsule_New(ctypes.addressof(m), name, None)
    _unconsumed[number] = (capsule, name)
    return capsule


def live_exports() -> int:
    """Exports whose memory is still held (not yet released by their consumer)."""
    return len(_exports)
