"""Integer limits shared by every layer: the widths of the values that cross into kernels, NCCL
and the driver, and the sanity bound on one host allocation."""
from __future__ import annotations

U32 = 1 << 32  # lanes, layers, steps and shard counts are unsigned 32-bit values
U64 = 1 << 64  # seeds, handles, pointers and element offsets are unsigned 64-bit values
#: bytes one pinned or plain host allocation may ask for: far beyond any machine, still catches
#: absurd sizes before the allocator sees them
HOST_ALLOC_LIMIT = 1 << 42
