"""GC-safe release (lowgrad.buffers.release): finalizers only queue, safe points drain; the registry lock
survives the cyclic GC; the numpy view of host memory keeps it alive; trace.enable while other
threads log. All on the host backend."""
from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.base import trace
from lowgrad.buffers import capture, release


@pytest.fixture
def gc_storm() -> Iterator[None]:
    """Collect at (almost) every allocation while the test runs."""
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*old)


class _Obj:
    pass


@pytest.mark.timeout(60, method="thread")  # a deadlock inside a finalizer defeats the signal method
def test_gc_inside_the_registry_lock_does_not_deadlock(gc_storm: None) -> None:
    """The reported hang: the GC runs inside Registry.add's critical section and a finalizer of a
    tensor in a dead reference cycle called Registry.add again (same thread, same lock)."""
    dev = lg.HostDevice()
    ring: list[object] = [None] * 64  # cycles die old, so a full collection frees them anywhere
    for i in range(5000):
        t = dev.alloc(16, lg.fp32, name=f"c{i % 7}")
        box: list[object] = [t]
        box.append(box)
        ring[i % 64] = box
    del t, box, ring
    gc.collect()
    release.drain()
    assert dev.memory_report().total() == 0


def test_collected_object_is_queued_and_released_at_a_drain() -> None:
    calls: list[int] = []
    obj = _Obj()
    f = release.Finalizer(obj, calls.append, 1)
    assert f.alive
    before = release.pending()
    del obj  # refcount: the weakref callback runs here, inside the deallocation
    assert calls == [] and not f.alive and release.pending() == before + 1
    release.drain()
    assert calls == [1] and release.pending() == 0
    f()  # already released: nothing more
    assert calls == [1]


def test_explicit_call_runs_now_once_and_detach_forgets() -> None:
    calls: list[str] = []
    a, b = _Obj(), _Obj()
    fa, fb = release.Finalizer(a, calls.append, "a"), release.Finalizer(b, calls.append, "b")
    fa()
    fa()
    assert calls == ["a"]
    assert fb.detach() and not fb.detach()
    del a, b
    release.drain()
    assert calls == ["a"]


def test_no_drain_while_a_capture_is_open() -> None:
    """A capture in any thread (counted in capture.active) postpones every release."""
    calls: list[int] = []
    obj = _Obj()
    release.Finalizer(obj, calls.append, 7)
    del obj
    capture.active[0] += 1
    try:
        release.drain()
        assert calls == []
    finally:
        capture.active[0] -= 1
    release.drain()
    assert calls == [7]


def test_failed_release_warns_and_the_drain_goes_on() -> None:
    calls: list[int] = []

    def boom() -> None:
        raise RuntimeError("free failed")
    a, b = _Obj(), _Obj()
    release.Finalizer(a, boom)
    release.Finalizer(b, calls.append, 2)
    del a, b
    with pytest.warns(RuntimeWarning, match="free failed"):
        release.drain()
    assert calls == [2]


def test_gc_release_runs_at_the_next_allocation_and_synchronize() -> None:
    dev = lg.HostDevice()
    t = dev.alloc(100, lg.fp32, name="dropped")
    cycle: list[object] = [t]
    cycle.append(cycle)
    del t, cycle
    gc.collect()
    assert dev.memory_report().bytes("dropped") == 400  # queued, not yet run
    dev.alloc(1, lg.byte, name="next")  # an allocation is a safe point
    assert dev.memory_report().bytes("dropped") == 0
    u = dev.alloc(10, lg.fp32, name="dropped2")
    del u
    dev.synchronize()  # so is a synchronize
    assert dev.memory_report().bytes("dropped2") == 0
    v = dev.alloc(10, lg.fp32, name="dropped3")
    del v
    dev.stream().synchronize()  # and a stream's synchronize
    assert dev.memory_report().bytes("dropped3") == 0


def test_host_numpy_view_keeps_memory_after_close() -> None:
    dev = lg.HostDevice()
    t = dev.alloc(64, lg.fp32, name="viewed")
    a = t.numpy()
    a[:] = np.arange(64)
    t.close()
    with pytest.raises(lg.ClosedError):
        t.numpy()
    assert dev.memory_report().bytes("viewed") == 256  # still held by the view
    for _ in range(8):
        dev.alloc(64, lg.fp32, name="other").numpy()[:] = -1  # would reuse freed memory
    assert np.array_equal(a, np.arange(64))
    del a
    release.drain()
    assert dev.memory_report().bytes("viewed") == 0


def test_lazy_block_close_and_collect() -> None:
    dev = lg.HostDevice()
    lazy = dev.lazy_allocator("pinned")
    ts = [lazy.alloc(10, lg.bf16, f"p{i}") for i in range(3)]
    with pytest.raises(lg.ClosedError, match="before its lazy allocator was committed"):
        ts[0].ptr
    assert not ts[0].closed
    lazy.commit()
    assert dev.memory_report().total("pinned") == 60
    ts[1].close()
    assert ts[0].closed and dev.memory_report().total() == 0


@pytest.mark.timeout(60)
def test_trace_enable_while_threads_log(tmp_path: Path) -> None:
    """Switching the trace target or off while other threads write lines never raises from log."""
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            while not stop.is_set():
                trace.log("kernel", "k", grid=1)
        except BaseException as exc:  # noqa: BLE001 - what the old log raised: None.write / write to a closed file
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=writer) for _ in range(4)]
    try:
        for th in threads:
            th.start()
        for i in range(3000):
            trace.enable(str(tmp_path / f"t{i % 2}.log") if i % 3 else None)
    finally:
        stop.set()
        for th in threads:
            th.join()
        sys.setswitchinterval(old_interval)
        trace.enable(None)
    assert errors == []
    lines = (tmp_path / "t1.log").read_text().splitlines()
    assert lines and all(line.startswith("lowgrad-trace ") and line.endswith("grid=1") for line in lines)
