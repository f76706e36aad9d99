"""DLPack export (the legacy ``DLManagedTensor`` capsule) in plain ctypes.

The capsule keeps the lowgrad tensor (and so its memory) alive until the consumer calls the
deleter, or until the capsule itself is collected unconsumed.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST = 1, 2, 3


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


_NAME = b"dltensor"
_alive: dict[int, tuple[Any, ...]] = {}
_lock = threading.Lock()


@_Deleter
def _delete(addr: int) -> None:
    with _lock:
        _alive.pop(addr, None)


_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


@_CapsuleDestructor
def _capsule_destructor(capsule: int) -> None:
    if _api.PyCapsule_IsValid(capsule, _NAME):  # never consumed: release ourselves
        _delete(_api.PyCapsule_GetPointer(capsule, _NAME))


def to_capsule(tensor: Any, device: tuple[int, int]) -> Any:
    """A ``dltensor`` PyCapsule viewing ``tensor`` (contiguous; strides NULL)."""
    dt = tensor.dtype
    shape = (ctypes.c_int64 * max(1, tensor.ndim))(*tensor.shape)
    m = _DLManagedTensor()
    m.dl_tensor.data = tensor.ptr
    m.dl_tensor.device = _DLDevice(device[0], device[1])
    m.dl_tensor.ndim = tensor.ndim
    m.dl_tensor.dtype = _DLDataType(dt.dlpack_code, dt.itemsize * 8, 1)
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.deleter = _delete
    addr = ctypes.addressof(m)
    with _lock:
        _alive[addr] = (m, shape, tensor)
    return _api.PyCapsule_New(addr, _NAME, _capsule_destructor)
