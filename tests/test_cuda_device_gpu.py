"""GPU tests of the foundation: allocation churn, pinned mapping, interop, copies, properties,
streams/events, use after close and allocation errors. Every test needs a GPU (``gpu`` marker)
and skips cleanly without one; nothing here needs the NVRTC kernels."""
from __future__ import annotations

import gc
import re
import secrets
import time

import numpy as np
import pytest

import lowgrad as lg

pytestmark = pytest.mark.gpu

DTYPES = (lg.fp32, lg.bf16, lg.fp16, lg.fp8_e4m3, lg.byte)


def _rng() -> tuple[np.random.Generator, int]:
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def _as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


# ---- allocation churn --------------------------------------------------------------------
_DEVICE_SIZES = (1, 255, 4096, 1 << 20, (2 << 20) + 1, 3 << 20, 64 << 20, 256 << 20)
_HOST_SIZES = (1, 4096, 1 << 20, (4 << 20) + 3)


def _cycle(dev: lg.Device, rng: np.random.Generator, i: int) -> None:
    """One allocate/free cycle of a kind and size chosen by ``rng`` (close or refcount free)."""
    kind = ("device", "pinned", "write_combined")[int(rng.integers(3))]
    sizes = _DEVICE_SIZES if kind == "device" else _HOST_SIZES
    if i % 7 == 3:  # a lazy allocator commit of several tensors
        lazy = dev.lazy_allocator(kind)
        ts = [lazy.alloc(int(rng.choice(sizes)) // 2 + 1, lg.bf16, name=f"churn_lazy{j}") for j in range(3)]
        alloc = lazy.commit()
        assert all(t.ptr % 256 == 0 for t in ts)
        alloc.close()
        return
    t = dev.alloc(int(rng.choice(sizes)), lg.byte, kind=kind, name="churn")
    assert t.ptr
    if i % 2:
        t.close()
    del t  # the other half is freed by reference counting (weakref.finalize)


def test_alloc_free_cycles_return_free_memory(gpu: lg.Device) -> None:
    """1,000 mixed cycles leave cuMemGetInfo's free memory exactly where it was.

    The driver sub-allocates small blocks from 2 MiB pages and may keep its first page tables,
    so the baseline is taken after a warm-up pass of the same mix; after that the free memory
    must return to it exactly (any drift is a leak)."""
    rng, seed = _rng()
    for i in range(60):  # warm-up: every kind/size combination, lazy commits included
        _cycle(gpu, rng, i)
    gc.collect()
    gpu.synchronize()
    free0, total = gpu.mem_info()
    report0 = gpu.memory_report().total()
    for i in range(1000):
        _cycle(gpu, rng, i)
    gc.collect()
    gpu.synchronize()
    free1 = free0
    for _ in range(20):  # frees are synchronous, but give the driver a moment before failing
        free1, _ = gpu.mem_info()
        if free1 == free0:
            break
        time.sleep(0.05)
    assert free1 == free0, f"seed {seed}: free memory {free0} -> {free1} ({free1 - free0:+d} bytes)"
    assert gpu.memory_report().total() == report0
    assert gpu.memory_report().bytes("churn") == 0


# ---- pinned mapping ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["pinned", "write_combined"])
def test_pinned_written_by_device_copy_reads_on_host(gpu: lg.Device, kind: str) -> None:
    rng, seed = _rng()
    arr = rng.standard_normal(100_003).astype(np.float32)
    src = lg.from_numpy(arr, gpu, name="pin_src")
    dst = gpu.alloc(arr.shape, lg.fp32, kind=kind, name="pin_dst")
    dst.numpy()[:] = -1.0
    s = gpu.stream()
    lg.ops.copy(dst, src, stream=s)
    s.synchronize()
    view = dst.numpy()
    assert isinstance(view, np.ndarray) and view.ctypes.data == dst.ptr  # a view, not a copy
    assert np.array_equal(view, arr), f"seed {seed}"
    # and the other way: a host write to the mapped buffer is what the device copies back
    view[:] = arr * 2
    back = gpu.alloc(arr.shape, lg.fp32, name="pin_back")
    lg.ops.copy(back, dst, stream=s)
    s.synchronize()
    assert np.array_equal(back.numpy(), arr * 2)


# ---- interop -----------------------------------------------------------------------------
def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


@pytest.mark.parametrize("dtype", [lg.fp32, lg.bf16])
def test_torch_from_dlpack_shares_memory(gpu: lg.Device, dtype: lg.DType) -> None:
    torch = _torch()
    rng, seed = _rng()
    arr = (rng.standard_normal((37, 41)) + 0.5).astype(dtype.np)
    t = lg.from_numpy(arr, gpu, name="dl_torch")
    tt = torch.from_dlpack(t)
    assert tt.data_ptr() == t.ptr
    assert tt.device.type == "cuda" and tt.device.index == gpu.ordinal
    assert tuple(tt.shape) == arr.shape
    assert tt.dtype == (torch.float32 if dtype is lg.fp32 else torch.bfloat16)
    ibits = torch.int32 if dtype is lg.fp32 else torch.int16
    seen = tt.view(ibits).cpu().numpy()
    assert np.array_equal(_as_bytes(seen), _as_bytes(arr)), f"seed {seed}"
    tt.mul_(2)  # a write through torch ...
    tt[0, 0] = 7.0
    torch.cuda.synchronize()
    want = (arr.astype(np.float32) * 2).astype(dtype.np)
    want[0, 0] = 7.0
    assert np.array_equal(_as_bytes(t.numpy()), _as_bytes(want))  # ... is what lowgrad sees


def test_cupy_sees_lowgrad_memory(gpu: lg.Device) -> None:
    cupy = pytest.importorskip("cupy")
    rng, seed = _rng()
    arr = rng.standard_normal(10_007).astype(np.float32)
    t = lg.from_numpy(arr, gpu, name="cupy_view")
    for c in (cupy.asarray(t), cupy.from_dlpack(t)):
        assert c.data.ptr == t.ptr and c.dtype == np.float32 and c.shape == arr.shape
        assert np.array_equal(cupy.asnumpy(c), t.numpy()), f"seed {seed}"
    c = cupy.asarray(t)
    c *= 3
    c[5] = -1.5
    cupy.cuda.runtime.deviceSynchronize()
    want = arr * 3
    want[5] = -1.5
    assert np.array_equal(t.numpy(), want)


# ---- copies ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 1003, (1 << 20) + 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_round_trip_every_dtype_bit_exact(gpu: lg.Device, dtype: lg.DType, n: int) -> None:
    """host -> device -> pinned -> device -> host on a stream; random bytes (NaN patterns too)."""
    rng, seed = _rng()
    raw = _random_bytes(rng, n * dtype.itemsize)
    h0 = gpu.alloc(n, dtype, kind="host", name="rt_h0")
    h0.numpy().reshape(-1).view(np.uint8)[:] = raw
    d0 = gpu.alloc(n, dtype, name="rt_d0")
    p = gpu.alloc(n, dtype, kind="pinned", name="rt_p")
    d1 = gpu.alloc(n, dtype, name="rt_d1")
    h1 = gpu.alloc(n, dtype, kind="host", name="rt_h1")
    h1.numpy().reshape(-1).view(np.uint8)[:] = 0
    s = gpu.stream()
    for dst, src in ((d0, h0), (p, d0), (d1, p), (h1, d1)):
        lg.ops.copy(dst, src, stream=s)
    s.synchronize()
    assert np.array_equal(_as_bytes(p.numpy()), raw), f"seed {seed}"
    assert np.array_equal(_as_bytes(h1.numpy()), raw), f"seed {seed}"
    assert np.array_equal(_as_bytes(d1.numpy()), raw), f"seed {seed}"  # device numpy() copies
    # from_numpy / numpy() keep the dtype and the bits
    arr = raw.view(dtype.np)
    back = lg.from_numpy(arr, gpu, name="rt_fn").numpy()
    assert back.dtype == dtype.np and np.array_equal(_as_bytes(back), raw)


# ---- properties --------------------------------------------------------------------------
def test_device_properties(gpu: lg.Device) -> None:
    assert lg.Device(0) is gpu and lg.device_count() >= 1
    assert isinstance(gpu.name, str) and gpu.name.strip()
    assert gpu.sm_count > 0 and gpu.l2_bytes > 0
    assert re.fullmatch(r"sm_\d{2,3}", gpu.arch), gpu.arch
    major, minor = gpu.compute_capability
    assert gpu.arch == f"sm_{major}{minor}" and major >= 7
    free, total = gpu.mem_info()
    assert 0 < free <= total and gpu.total_memory > 0
    assert gpu.pci_bus_id
    with pytest.raises(ValueError, match="out of range"):
        lg.Device(lg.device_count())
    with pytest.raises(TypeError):
        lg.Device("0")  # type: ignore[arg-type]


# ---- streams and events ------------------------------------------------------------------
def test_stream_event_semantics(gpu: lg.Device) -> None:
    rng, seed = _rng()
    n = 64 << 20
    a = lg.from_numpy(_random_bytes(rng, n), gpu, name="ev_a")
    b = lg.from_numpy(np.zeros(n, np.uint8), gpu, name="ev_b")
    c = gpu.alloc(n, lg.byte, name="ev_c")
    s1, s2 = gpu.stream(), gpu.stream()
    e0, e1 = gpu.event(timing=True), gpu.event(timing=True)
    assert e0.record(s1) is e0
    for _ in range(200):  # ~25 GiB of copies: milliseconds of queued work
        lg.ops.copy(b, a, stream=s1)
    e1.record(s1)
    assert not s1.query() and not e1.query()  # queued work is not done yet
    s2.wait(e1)  # s2's copy must see all of s1's copies
    lg.ops.copy(c, b, stream=s2)
    s2.synchronize()
    assert e1.query() and s1.query() and s2.query()
    assert np.array_equal(c.numpy(), a.numpy()), f"seed {seed}"
    ms = e0.elapsed_ms(e1)
    assert 0 < ms < 60_000
    # Event.wait(stream) is the same ordering from the event's side
    e2 = gpu.event()
    e2.record(s2)
    e2.wait(s1)
    e2.synchronize()
    assert e2.query()
    with pytest.raises(ValueError, match="timing"):
        e0.elapsed_ms(e2)
    lo, hi = gpu.stream_priority_range
    with gpu.stream(priority=hi) as sp:
        lg.ops.copy(c, a, stream=sp)
        sp.synchronize()
    with pytest.raises(ValueError, match="priority"):
        gpu.stream(priority=max(lo, hi) + 1)
    gpu.synchronize()


def test_foreign_torch_stream_handle(gpu: lg.Device) -> None:
    torch = _torch()
    rng, seed = _rng()
    arr = _random_bytes(rng, 1 << 20)
    src = lg.from_numpy(arr, gpu, name="ts_src")
    dst = gpu.alloc(arr.size, lg.byte, name="ts_dst")
    ts = torch.cuda.Stream()
    handle = ts.cuda_stream
    assert isinstance(handle, int) and handle != 0
    assert lg.stream_handle(ts) == handle and lg.stream_handle(handle) == handle
    wrapped = lg.Stream.wrap(gpu, handle)
    assert wrapped.handle == handle and gpu.resolve_stream(handle).handle == handle
    ev = gpu.event()
    lg.ops.copy(dst, src, stream=handle)  # a raw int handle ...
    ev.record(handle)
    ts.synchronize()  # ... is torch's stream
    assert ev.query() and wrapped.query()
    assert np.array_equal(dst.numpy(), arr), f"seed {seed}"
    lg.ops.copy(dst, src, stream=ts)  # the torch stream object itself
    wrapped.synchronize()
    wrapped.close()  # forgets the handle, never destroys torch's stream
    with pytest.raises(lg.ClosedError):
        wrapped.synchronize()
    x = torch.ones(16, device="cuda")
    with torch.cuda.stream(ts):
        x.mul_(2)
    ts.synchronize()
    assert float(x.sum()) == 32.0


# ---- use after close / allocation errors -------------------------------------------------
@pytest.mark.parametrize("kind", ["device", "pinned"])
def test_use_after_close_raises(gpu: lg.Device, kind: str) -> None:
    t = gpu.alloc((8, 4), lg.bf16, kind=kind, name="closed_grad")
    other = gpu.alloc((8, 4), lg.bf16, name="closed_other")
    view = t[2:5]
    assert gpu.memory_report().bytes("closed_grad", kind) == 64
    t.close()
    t.close()  # idempotent
    assert gpu.memory_report().bytes("closed_grad") == 0 and t.closed
    for bad in (lambda: t.ptr, lambda: view.ptr, t.numpy, view.numpy, lambda: lg.ops.copy(other, t),
                lambda: lg.ops.copy(view, other[2:5]), lambda: lg.ops.fill_zero(view)):
        with pytest.raises(lg.ClosedError, match="closed_grad"):
            bad()
    s = gpu.stream()
    s.close()
    for bad in (s.synchronize, s.query):
        with pytest.raises(lg.ClosedError):
            bad()
    lazy = gpu.lazy_allocator()
    pending = lazy.alloc(16, lg.fp32, name="closed_lazy")
    with pytest.raises(lg.ClosedError, match="committed"):
        pending.ptr
    lazy.commit().close()


def test_absurd_allocation_is_value_error_before_the_driver(gpu: lg.Device,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def boom(kind: str, nbytes: int):
        calls.append(kind)
        raise AssertionError("the driver was called")

    monkeypatch.setattr(gpu, "_raw_alloc", boom)
    with pytest.raises(ValueError, match="more than"):
        gpu.alloc(gpu.total_memory + 1, lg.byte, name="absurd")
    with pytest.raises(ValueError, match="more than"):
        gpu.alloc((1 << 40, 1 << 10), lg.fp32, kind="pinned", name="absurd")
    with pytest.raises(ValueError, match="negative"):
        gpu.alloc(-1, lg.byte, name="absurd")
    lazy = gpu.lazy_allocator()
    lazy.alloc(gpu.total_memory // 2 + 1, lg.fp32, name="absurd_lazy")
    with pytest.raises(ValueError, match="more than"):
        lazy.commit()
    assert calls == []
    assert gpu.memory_report().bytes("absurd") == 0


def test_cuMemAlloc_failure_is_cuda_error(gpu: lg.Device) -> None:
    """A single request of the whole memory (allowed by the size check, impossible because the
    context itself uses some) fails in cuMemAlloc: one failing call, nothing is exhausted."""
    free0, _ = gpu.mem_info()
    with pytest.raises(lg.CudaError) as info:
        gpu.alloc(gpu.total_memory, lg.byte, name="oom")
    err = info.value
    assert err.call == "cuMemAlloc" and err.name == "CUDA_ERROR_OUT_OF_MEMORY", str(err)
    assert "cuMemAlloc" in str(err) and "CUDA_ERROR_OUT_OF_MEMORY" in str(err)
    assert gpu.memory_report().bytes("oom") == 0
    ok = gpu.alloc(1 << 20, lg.byte, name="after_oom")  # the error is not sticky
    lg.ops.copy(ok, lg.from_numpy(np.ones(1 << 20, np.uint8), gpu, name="after_oom"))
    assert ok.numpy().all()
    ok.close()
    gc.collect()
    assert gpu.mem_info()[0] >= free0 - (64 << 20)
