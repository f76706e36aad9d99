"""The host backend's reduction: :func:`host_reduce`, what every host collective computes (the
ranks meet through :class:`lowgrad.runtime.threads.ThreadCollective`).

Reductions are computed in float32 (float64 for fp64) in rank order and rounded once to the
tensor's dtype, round-to-nearest-even; ``avg`` is that sum multiplied by ``float32(1 / world)``
(NCCL multiplies each input by 1/world before summing; for a power-of-two world the two are
identical). byte tensors reduce as uint8 with wrap-around, ``avg`` dividing the wrapped sum
(integer division), like NCCL.
"""
from __future__ import annotations

import numpy as np

from lowgrad.base.dtypes import DType


def host_reduce(arrays: list[np.ndarray], op: str, world: int, dtype: DType) -> np.ndarray:
    """The reduction of equally shaped arrays in rank order, as this module's docstring says."""
    if dtype.np.kind in "iu":
        acc = arrays[0].copy()
        for a in arrays[1:]:
            acc = np.maximum(acc, a) if op == "max" else acc + a  # wraps in the element type
        return acc if op != "avg" else acc // dtype.np.type(world)
    acc_t = np.float64 if dtype.itemsize == 8 else np.float32
    acc = arrays[0].astype(acc_t)
    for a in arrays[1:]:
        b = a.astype(acc_t)
        if op == "max":
            np.maximum(acc, b, out=acc)
        else:
            acc += b
    if op == "avg":
        acc *= acc_t(1.0 / world)
    return acc.astype(dtype.np)
