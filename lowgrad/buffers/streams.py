"""The one rule for turning a ``stream=`` argument into a raw handle, shared by every backend.

Every ``stream=`` argument in lowgrad accepts: ``None`` (the device's default stream, the CUDA
legacy default stream, handle 0), a lowgrad stream, a raw handle ``int`` (e.g.
``torch.cuda.current_stream().cuda_stream``), or an object with ``__cuda_stream__()`` (CuPy,
cuda.core) or a ``cuda_stream`` attribute (PyTorch).
"""
from __future__ import annotations

from typing import Any

from lowgrad.base.limits import U64

StreamLike = Any  # None | a lowgrad stream | int | object with __cuda_stream__ / cuda_stream



def stream_handle(s: StreamLike) -> int:
    """The raw stream handle (int) for any accepted stream argument; TypeError otherwise."""
    if type(s) is int and 0 <= s < U64:
        return s
    if s is None:
        return 0
    if type(s) is int:
        raise ValueError(f"stream handle must be an int in [0, 2**64), got {s}")
    h = getattr(s, "handle", None)
    if type(h) is not int:
        proto = getattr(s, "__cuda_stream__", None)
        if proto is not None:
            val = proto()
            h = val[1] if isinstance(val, tuple) and len(val) == 2 else None
        else:
            h = getattr(s, "cuda_stream", None)
    if type(h) is int and 0 <= h < U64:
        return h
    if type(h) is int:
        raise ValueError(f"{type(s).__name__} gives the stream handle {h}, outside [0, 2**64)")
    raise TypeError(
        f"expected a stream (None, lowgrad.Stream, int handle, or an object with __cuda_stream__() -> "
        f"(version, handle) or a cuda_stream int), got {type(s).__name__}"
    )
