"""The host backend: numpy allocations, eager streams, the host twins of every kernel, and the
threads-as-ranks collective. Imports ``core`` and ``sr``, never ``cuda``."""
