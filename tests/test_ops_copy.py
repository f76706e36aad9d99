"""``ops.copy`` refuses partially overlapping source and destination on both backends, before
anything is queued; the same memory as both is allowed and leaves it unchanged. ``ops.copy_on_cores``
(the copy by a kernel) refuses any overlap."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import lowgrad as lg


def _overlap_cases(t: Any) -> list[tuple[Any, Any]]:
    """(dst, src) pairs of one 16-element fp32 tensor that share some but not all bytes."""
    return [(t.view(0, 8), t.view(4, 8)),  # src ahead of dst
            (t.view(4, 8), t.view(0, 8)),  # dst ahead of src
            (t.view(0, 8), t.view(7, 8)),  # one element shared
            (t.view(0, 8).reshape(2, 4), t.view(2, 8).reshape(4, 2))]


def _check_refused_untouched(dev: Any, kind: str) -> None:
    want = np.arange(16, dtype=np.float32)
    t = lg.from_numpy(want, dev, kind=kind, name="buf")
    for dst, src in _overlap_cases(t):
        with pytest.raises(ValueError, match="partially overlap"):
            lg.ops.copy(dst, src)
    dev.synchronize()
    np.testing.assert_array_equal(t.numpy(), want)
    lg.ops.copy(t, t)  # the same memory: allowed, a no-op in effect
    lg.ops.copy(t.view(8, 8), t.view(0, 8))  # adjacent, disjoint: allowed
    dev.synchronize()
    np.testing.assert_array_equal(t.numpy(), np.concatenate([want[:8], want[:8]]))


@pytest.mark.parametrize("kind", ["device", "pinned", "host"])
def test_host_backend_refuses_partial_overlap(kind: str) -> None:
    _check_refused_untouched(lg.HostDevice(), kind)


def test_only_a_partial_overlap_is_refused() -> None:
    h = lg.HostDevice()
    a, b = h.alloc(8, lg.fp32, name="a"), h.alloc(8, lg.fp32, name="b")
    lg.ops.copy(a, b)  # distinct allocations never overlap
    with pytest.raises(TypeError, match="dtype"):  # same bytes, other dtype: the dtype rule answers
        lg.ops.copy(a.view(0, 8), lg.Tensor(a.allocation, 0, lg.bf16, (16,), "a16"))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["device", "pinned"])
def test_cuda_refuses_partial_overlap(gpu: Any, kind: str) -> None:
    _check_refused_untouched(gpu, kind)


def test_copy_on_cores_copies_and_refuses_before_anything_is_queued() -> None:
    """``ops.copy_on_cores``, the front of the cores' copy kernel: ``ops.copy``'s dtype, size and
    device rules, and no overlap at all (a kernel's loads and stores are not ordered)."""
    h = lg.HostDevice()
    want = np.arange(16, dtype=np.float32)
    t = lg.from_numpy(want, h, kind="device", name="buf")
    dst = h.alloc(16, lg.fp32, kind="pinned", name="dst")
    lg.ops.copy_on_cores(dst, t)
    np.testing.assert_array_equal(dst.numpy(), want)
    bad = [((t, t), ValueError, "may not overlap"), ((t.view(0, 8), t.view(4, 8)), ValueError, "may not overlap"),
           ((dst, t.bitcast(lg.bf16)[:16]), TypeError, "dtype mismatch"), ((dst.view(0, 8), t), ValueError, "size"),
           ((dst, lg.HostDevice().alloc(16, lg.fp32)), ValueError, "lives on"), ((dst, want), TypeError, "Tensor")]
    for (d, s), exc, msg in bad:
        with pytest.raises(exc, match=msg):
            lg.ops.copy_on_cores(d, s)
    np.testing.assert_array_equal(t.numpy(), want)
