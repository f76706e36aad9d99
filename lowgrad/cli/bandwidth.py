"""Copy-bandwidth ceilings measured on the spot (for the demo, the doctor and the benchmarks):
every performance figure lowgrad prints is a ratio to one of these."""
from __future__ import annotations

import statistics
from typing import Any

from lowgrad import ops
from lowgrad.base.dtypes import byte
from lowgrad.buffers.tensor import Tensor


def copy_seconds(dev: Any, dst: Tensor, src: Tensor, reps: int = 10) -> float:
    """Median seconds of one ``ops.copy(dst, src)`` on a fresh stream (events, one warm-up)."""
    s = dev.stream()
    e0, e1 = dev.event(timing=True), dev.event(timing=True)
    ops.copy(dst, src, stream=s)
    times = []
    for _ in range(reps):
        e0.record(s)
        ops.copy(dst, src, stream=s)
        e1.record(s)
        e1.synchronize()
        times.append(e0.elapsed_ms(e1) / 1e3)
    s.close()
    return statistics.median(times)


def copy_bandwidths(dev: Any, nbytes: int, pinned: bool = True, reps: int = 10) -> dict[str, float]:
    """Bytes/s of a device-to-device copy of ``nbytes`` (read + write counted) and, with
    ``pinned``, of pinned host -> device and device -> pinned host copies of ``nbytes // 2``."""
    a, b = dev.alloc(nbytes, byte, name="bandwidth"), dev.alloc(nbytes, byte, name="bandwidth")
    ops.fill_zero(a)
    out = {"d2d": 2 * nbytes / copy_seconds(dev, b, a, reps)}
    if pinned:
        m = nbytes // 2
        p = dev.alloc(m, byte, kind="pinned", name="bandwidth")
        out["h2d"] = m / copy_seconds(dev, a.view(0, m), p, reps)
        out["d2h"] = m / copy_seconds(dev, p, a.view(0, m), reps)
        p.close()
    a.close()
    b.close()
    return out
