"""The CUDA driver through ``cuda.bindings``: lazy initialisation and return-code checking.

Importing this module never touches the driver; :func:`driver` initialises it at first use and
raises :class:`~lowgrad.base.errors.CudaUnavailableError` where there is no driver or no GPU.
Works with cuda-bindings 12.x and 13.x.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

from lowgrad.base.errors import CudaError, CudaUnavailableError

_lock = threading.Lock()
_driver: Any = None
_unavailable: str | None = None


def driver() -> Any:
    """The initialised ``cuda.bindings.driver`` module (cuInit done once per process)."""
    global _driver, _unavailable
    if _driver is not None:
        return _driver
    with _lock:
        if _driver is not None:
            return _driver
        if _unavailable is not None:
            raise CudaUnavailableError(_unavailable)
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:  # cuda-python missing or too old
            _unavailable = f"CUDA unavailable: cannot import cuda.bindings.driver ({exc})"
            raise CudaUnavailableError(_unavailable) from exc
        try:
            (err,) = drv.cuInit(0)
        except Exception as exc:  # the binding raises when libcuda.so cannot be loaded
            _unavailable = f"CUDA unavailable: no NVIDIA driver could be loaded ({exc})"
            raise CudaUnavailableError(_unavailable) from exc
        if int(err) != 0:
            _unavailable = f"CUDA unavailable: cuInit failed with {_name(drv, err)}: {_message(drv, err)}"
            raise CudaUnavailableError(_unavailable)
        err, count = drv.cuDeviceGetCount()
        if int(err) != 0 or count == 0:
            _unavailable = "CUDA unavailable: the driver loaded but reports no GPU"
            raise CudaUnavailableError(_unavailable)
        _driver = drv
        return drv


_c_functions: dict[str, Any] = {}


def c_function(name: str, *argtypes: Any) -> Any:
    """``name`` from libcuda (already loaded by :func:`driver`) as a typed ctypes function
    returning the CUresult as an int: the hot paths (launches, event record/wait, graph launch)
    call these with int handles instead of going through the binding's argument conversion."""
    f = _c_functions.get(name)
    if f is None:
        driver()
        f = ctypes.CDLL("libcuda.so.1")[name]
        f.argtypes, f.restype = list(argtypes), ctypes.c_int
        _c_functions[name] = f
    return f


def available() -> bool:
    """True when a driver and at least one GPU can be used (initialises the driver)."""
    try:
        driver()
    except CudaUnavailableError:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why CUDA cannot be used, or None when it can."""
    try:
        driver()
    except CudaUnavailableError as exc:
        return str(exc)
    return None


def _name(drv: Any, err: Any) -> str:
    e, s = drv.cuGetErrorName(err)
    return s.decode() if int(e) == 0 and s else f"CUresult {int(err)}"


def _message(drv: Any, err: Any) -> str:
    e, s = drv.cuGetErrorString(err)
    return s.decode() if int(e) == 0 and s else "unknown error"


def fail(call: str, err: Any) -> CudaError:
    """The exception for a failed driver call ``call`` with CUresult ``err``."""
    drv = _driver
    return CudaError(call, int(err), _name(drv, err), _message(drv, err))


def check(call: str, result: Any) -> Any:
    """Check a cuda.bindings result tuple ``(CUresult, *values)``; return the value(s)."""
    err = result[0]
    if err:  # CUresult is an IntEnum: CUDA_SUCCESS is 0
        raise fail(call, err)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def check_rc(call: str, err: Any) -> None:
    """Check a bare CUresult (calls that return only the status)."""
    if err:
        raise fail(call, err)
