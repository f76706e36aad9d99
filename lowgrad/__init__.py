"""lowgrad: framework-free weight-gradient management for large models on NVIDIA GPUs.

Accumulation over micro-batches with stochastic rounding into bf16, ZeRO-style sharding, pinned
host offload and the NCCL traffic that goes with it, through the CUDA driver (cuda.bindings),
NVRTC and NCCL (ctypes). ``import lowgrad`` never needs a GPU; the CUDA backend raises
:class:`CudaUnavailableError` at first use where there is none, and :class:`HostDevice` runs
the same code on the CPU. The package's own documentation is in ``docs/`` of the repository.

Layers (folders): ``core`` (errors, dtypes, memory, tensors, DLPack, streams rule, capture
guards, deferred release, the backend contract, the collective base, the rendezvous), ``sr``
(Philox, per-use seeds, the numpy reference, the seed counter), ``ops`` (the kernel front),
``cuda`` and ``host`` (the two backends), ``bootstrap`` (ranks and communicators),
``managers`` (gradient managers and layouts), ``cli`` (demo, doctor).
"""
from lowgrad import ops
from lowgrad.bootstrap import from_env, run_threads
from lowgrad.core.dtypes import DType, bf16, byte, fp8_e4m3, fp16, fp32, fp64
from lowgrad.core.errors import (
                                 CaptureError,
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
from lowgrad.core.memory import MemoryReport
from lowgrad.core.streams import stream_handle
from lowgrad.core.tensor import Container, LazyAllocator, Tensor, from_numpy, shard_view
from lowgrad.core.version import __version__ as __version__
from lowgrad.cuda import nccl
from lowgrad.cuda.communicator import Communicator
from lowgrad.cuda.compiler import compile_kernels
from lowgrad.cuda.device import Device, device_count
from lowgrad.cuda.graph import Graph
from lowgrad.cuda.loopback import LoopbackCommunicator
from lowgrad.cuda.stream import Event, Stream
from lowgrad.host.communicator import HostCommunicator
from lowgrad.host.device import HostDevice, HostEvent, HostStream
from lowgrad.managers import GradientManager, create_gradient_manager
from lowgrad.managers.layout import Layout, ParamSpec, llama_layout
from lowgrad.sr import reference
from lowgrad.sr.philox import philox4x32_10
from lowgrad.sr.seedcounter import DEFAULT_ROUNDING, ROUNDINGS, SeedCounter
from lowgrad.sr.seeds import use_seed

__all__ = [
    "Device", "HostDevice", "Stream", "Event", "HostStream", "HostEvent", "Tensor", "Container",
    "LazyAllocator", "MemoryReport", "DType", "fp32", "bf16", "fp16", "fp8_e4m3", "byte", "fp64",
    "from_numpy", "shard_view", "stream_handle", "device_count", "ops", "reference", "nccl",
    "philox4x32_10", "compile_kernels", "Communicator", "LoopbackCommunicator", "HostCommunicator", "run_threads",
    "from_env",
    "ParamSpec", "Layout", "llama_layout", "create_gradient_manager", "GradientManager", "Graph",
    "SeedCounter", "ROUNDINGS", "DEFAULT_ROUNDING", "use_seed",
    "LowgradError", "CudaError", "CudaUnavailableError", "NvrtcError", "NcclError", "NcclLibraryError",
    "CommTimeoutError", "CommAbortedError", "ClosedError", "CaptureError", "ProtocolError",
    "NonFiniteGradientError",
]
