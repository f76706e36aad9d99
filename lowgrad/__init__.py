"""lowgrad: framework-free weight-gradient management for large models on NVIDIA GPUs.

Accumulation over micro-batches with stochastic rounding into bf16, ZeRO-style sharding, pinned
host offload and the NCCL traffic that goes with it, through the CUDA driver (cuda.bindings),
NVRTC and NCCL (ctypes). ``import lowgrad`` never needs a GPU; the CUDA backend raises
:class:`CudaUnavailableError` at first use where there is none, and :class:`HostDevice` runs
the same code on the CPU.
"""
from __future__ import annotations

from typing import Any

from . import ops
from .device import Device, device_count
from .dtypes import DType, bf16, byte, fp8_e4m3, fp16, fp32, fp64
from .errors import (CaptureError, ClosedError, CommAbortedError, CommTimeoutError, CudaError,
                     CudaUnavailableError, LowgradError, NcclError, NvrtcError)
from .host import HostDevice, HostEvent, HostStream
from .memory import LazyAllocator, MemoryReport
from .stream import Event, Stream, stream_handle
from .tensor import Container, Tensor, from_numpy, shard_view

__version__ = "0.1.0"

_LAZY = {
    "philox4x32_10": ("philox", "philox4x32_10"),
    "reference": ("reference", None),
    "compile_kernels": ("compiler", "compile_kernels"),
    "nccl": ("nccl", None),
    "Communicator": ("comm", "Communicator"),
    "HostCommunicator": ("hostcomm", "HostCommunicator"),
    "run_threads": ("bootstrap", "run_threads"),
    "from_env": ("bootstrap", "from_env"),
    "ParamSpec": ("layout", "ParamSpec"),
    "Layout": ("layout", "Layout"),
    "llama_layout": ("layout", "llama_layout"),
    "create_gradient_manager": ("managers", "create_gradient_manager"),
    "Graph": ("graph", "Graph"),
    "SeedCounter": ("seedcounter", "SeedCounter"),
    "use_seed": ("seeds", "use_seed"),
}


def __getattr__(name: str) -> Any:
    """Submodules that need NVRTC, NCCL or the managers load on first access."""
    if name not in _LAZY:
        raise AttributeError(f"module 'lowgrad' has no attribute {name!r}")
    import importlib

    mod_name, attr = _LAZY[name]
    mod = importlib.import_module(f".{mod_name}", __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


__all__ = [
    "Device", "HostDevice", "Stream", "Event", "HostStream", "HostEvent", "Tensor", "Container",
    "LazyAllocator", "MemoryReport", "DType", "fp32", "bf16", "fp16", "fp8_e4m3", "byte", "fp64",
    "from_numpy", "shard_view", "stream_handle", "device_count", "ops",
    "LowgradError", "CudaError", "CudaUnavailableError", "NvrtcError", "NcclError", "CommTimeoutError",
    "CommAbortedError", "ClosedError", "CaptureError", *_LAZY,
]
