"""CPU tests of lowgrad.buffers.memory: memory kinds, bad sizes, close and GC, the lazy allocator and the report."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import lowgrad as lg
import lowgrad.cuda.driver
from lowgrad.buffers.memory import ALIGN


@pytest.fixture
def host() -> lg.HostDevice:
    return lg.HostDevice()


@pytest.mark.parametrize("kind", ["device", "pinned", "write_combined", "host"])
@pytest.mark.parametrize("dtype", [lg.fp32, lg.bf16, lg.fp16, lg.fp8_e4m3, lg.byte])
def test_alloc_every_kind_and_dtype(host: lg.HostDevice, kind: str, dtype: lg.DType) -> None:
    t = host.alloc((6, 5), dtype, kind=kind, name="x")
    assert t.shape == (6, 5) and t.numel == 30 and t.nbytes == 30 * dtype.itemsize and t.kind == kind
    assert t.ptr % ALIGN == 0
    rng = np.random.default_rng(0)
    vals = rng.integers(0, 256, t.nbytes, dtype=np.uint8)
    t.numpy().reshape(-1).view(np.uint8)[:] = vals
    out = host.alloc((6, 5), dtype, kind="device", name="y")
    lg.ops.copy(out, t)
    assert np.array_equal(out.numpy().reshape(-1).view(np.uint8), vals)


def test_bad_allocations(host: lg.HostDevice) -> None:
    with pytest.raises(ValueError, match="negative"):
        host.alloc((-1, 4), lg.fp32, name="neg")
    with pytest.raises(ValueError, match="more than"):
        host.alloc((1 << 40, 1 << 10), lg.fp32, name="absurd")
    with pytest.raises(TypeError):
        host.alloc((2.5,), lg.fp32, name="float_dim")
    with pytest.raises(ValueError, match="kind"):
        host.alloc(4, lg.fp32, kind="managed", name="m")
    with pytest.raises(TypeError, match="dtype"):
        host.alloc(4, "int7", name="d")
    with pytest.raises(TypeError, match="name"):
        host.alloc(4, lg.fp32, name="")


def test_use_after_close_raises_and_report_returns_to_zero(host: lg.HostDevice) -> None:
    t = host.alloc((4, 4), lg.bf16, name="block_grad")
    view = t[1:3]
    assert host.memory_report().bytes("block_grad") == 32
    t.close()
    t.close()  # idempotent
    assert host.memory_report().total() == 0
    for bad in (lambda: t.ptr, lambda: view.ptr, lambda: view.numpy()):
        with pytest.raises(lg.ClosedError, match="block_grad"):
            bad()
    with pytest.raises(lg.ClosedError):
        lg.ops.fill_zero(view)


def test_gc_frees(host: lg.HostDevice) -> None:
    t = host.alloc(1000, lg.fp32, name="tmp")
    assert host.memory_report().bytes("tmp") == 4000
    del t
    gc.collect()  # the finalizer only queues the release (lowgrad.buffers.release) ...
    host.synchronize()  # ... a safe point runs it
    assert host.memory_report().bytes("tmp") == 0


def test_lazy_allocator_alignment_offsets_and_report(host: lg.HostDevice) -> None:
    lazy = host.lazy_allocator("pinned")
    shapes = [(3,), (5, 7), (1,), (129,)]
    ts = [lazy.alloc(s, lg.bf16, name=f"t{i}") for i, s in enumerate(shapes)]
    ts.append(lazy.alloc((2, 2), lg.fp32, name="t0"))
    with pytest.raises(lg.ClosedError, match="committed"):
        ts[0].ptr
    expected, off = [], 0
    for t in ts:
        expected.append(off)
        off = (off + t.nbytes + ALIGN - 1) // ALIGN * ALIGN
    assert lazy.nbytes == off
    a = lazy.commit()
    base = ts[0].ptr
    assert base % ALIGN == 0
    assert [t.ptr - base for t in ts] == expected
    rep = host.memory_report()
    assert rep.as_dict()["pinned"] == {"t0": 6 + 16, "t1": 70, "t2": 2, "t3": 258}
    assert rep.total("pinned") == 6 + 16 + 70 + 2 + 258
    assert "t1" in str(rep) and "pinned" in str(rep)
    with pytest.raises(ValueError, match="committed"):
        lazy.commit()
    a.close()
    assert host.memory_report().total() == 0
