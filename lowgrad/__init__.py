"""lowgrad: framework-free weight-gradient management for large models on NVIDIA GPUs.

Accumulation over micro-batches with stochastic rounding into bf16, ZeRO-style sharding, pinned
host offload and the NCCL traffic that goes with it, through the CUDA driver (cuda.bindings),
NVRTC and NCCL (ctypes). ``import lowgrad`` never needs a GPU; the CUDA backend raises
:class:`CudaUnavailableError` at first use where there is none, and :class:`HostDevice` runs
the same code on the CPU. The package's own documentation is in ``docs/`` of the repository;
``__all__`` is the list of stable names in ``docs/design.md``.

``import lowgrad`` loads the element types, the exceptions and the tensor types; every other name
is imported at its first use (PEP 562), so a program that uses only the host backend never loads
the CUDA one, and one that never makes a manager never loads the managers.
"""
from importlib import import_module
from typing import Any

from lowgrad.base import trace as _trace  # noqa: F401 - applies LOWGRAD_TRACE at import (docs/cli.md)
from lowgrad.base.dtypes import DType, bf16, byte, fp8_e4m3, fp16, fp32, fp64
from lowgrad.base.errors import (
    CaptureError,
    CheckpointError,
    ClosedError,
    CommAbortedError,
    CommTimeoutError,
    CudaError,
    CudaUnavailableError,
    LowgradError,
    NcclError,
    NcclLibraryError,
    NonFiniteGradientError,
    NvrtcError,
    ProtocolError,
)
from lowgrad.base.version import __version__ as __version__
from lowgrad.buffers.memory import MemoryReport
from lowgrad.buffers.streams import stream_handle
from lowgrad.buffers.tensor import Container, LazyAllocator, Tensor, from_numpy, shard_view

#: every public name imported at first use -> the module that defines it (a name equal to the
#: module's last part is the module itself: ``lowgrad.ops``, ``lowgrad.nccl``, ``lowgrad.reference``)
_LAZY: dict[str, str] = {
    "Device": "lowgrad.cuda.device", "device_count": "lowgrad.cuda.device", "Stream": "lowgrad.cuda.stream",
    "Event": "lowgrad.cuda.stream", "Graph": "lowgrad.cuda.graph", "Communicator": "lowgrad.cuda.communicator",
    "compile_kernels": "lowgrad.cuda.compiler", "nccl": "lowgrad.cuda.nccl",
    "HostDevice": "lowgrad.host.device", "HostCommunicator": "lowgrad.host.communicator",
    "run_threads": "lowgrad.launch.bootstrap", "from_env": "lowgrad.launch.bootstrap",
    "ParamSpec": "lowgrad.managers.layout", "Layout": "lowgrad.managers.layout",
    "llama_layout": "lowgrad.managers.layout", "create_gradient_manager": "lowgrad.managers",
    "GradientManager": "lowgrad.managers.manager",
    "ops": "lowgrad.ops", "reference": "lowgrad.sr.reference", "philox4x32_10": "lowgrad.sr.philox",
    "use_seed": "lowgrad.sr.seeds", "ROUNDINGS": "lowgrad.sr.seedcounter",
    "DEFAULT_ROUNDING": "lowgrad.sr.seedcounter",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lowgrad' has no attribute {name!r}")
    mod = import_module(module)
    value = mod if module.rpartition(".")[2] == name else getattr(mod, name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    # devices and memory
    "Device", "HostDevice", "device_count", "Stream", "Event", "stream_handle", "MemoryReport", "LazyAllocator",
    # tensors and element types
    "Tensor", "Container", "from_numpy", "shard_view", "DType", "fp32", "bf16", "fp16", "fp8_e4m3", "byte", "fp64",
    # rounding and kernels
    "philox4x32_10", "use_seed", "reference", "ops", "compile_kernels", "ROUNDINGS", "DEFAULT_ROUNDING",
    # communication
    "nccl", "Communicator", "HostCommunicator", "run_threads", "from_env",
    # models and managers
    "ParamSpec", "Layout", "llama_layout", "create_gradient_manager", "GradientManager", "Graph",
    # exceptions
    "LowgradError", "CudaError", "CudaUnavailableError", "NvrtcError", "NcclError", "NcclLibraryError",
    "CommTimeoutError", "CommAbortedError", "ClosedError", "CaptureError", "ProtocolError",
    "NonFiniteGradientError", "CheckpointError",
]
