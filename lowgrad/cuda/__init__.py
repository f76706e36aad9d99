"""The CUDA backend: driver wrapper, device, streams and events, CUDA graphs, the kernels' C ABI
read from their sources, NVRTC compiler, kernel cache, kernel launch, the NCCL binding and the
NCCL communicator. Imports the bottom layers (``base``, ``buffers``,
``contracts``, ``runtime``) and ``sr``, never ``host``."""
