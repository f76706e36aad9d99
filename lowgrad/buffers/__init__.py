"""Memory and what views it: raw allocations and the memory report, typed tensors and their
containers, DLPack export, deferred release for finalizers, the stream-argument rule and the
CUDA-graph capture guards. Imports ``base`` only."""
