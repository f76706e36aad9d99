"""The host backend: numpy allocations, eager streams, the host twins of every kernel, and the
threads-as-ranks collective. Imports the bottom layers
(``base``, ``buffers``, ``contracts``, ``runtime``) and ``sr``, never ``cuda``."""
