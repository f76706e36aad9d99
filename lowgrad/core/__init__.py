"""The bottom layer, backend-neutral: errors, dtypes, integer limits, memory and tensors, DLPack,
the stream-argument rule, capture guards, deferred release, the backend and kernel-table contracts,
the communicator contract, timeouts, the kernel sources' reader
and the threads' rendezvous. Imports nothing else of lowgrad."""
