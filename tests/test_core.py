"""CPU tests of the foundation: errors, memory kinds, lazy allocator, report, tensors, streams."""
from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest

import lowgrad as lg
import lowgrad.cuda.driver
from lowgrad.core.memory import ALIGN


@pytest.fixture
def host() -> lg.HostDevice:
    return lg.HostDevice()


def test_import_without_driver_and_clear_unavailable_error() -> None:
    code = "import lowgrad; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
    if lg.cuda.driver.unavailable_reason() is not None:
        with pytest.raises(lg.CudaUnavailableError, match="CUDA unavailable"):
            lg.Device(0)


def test_error_messages_name_call_code_and_message() -> None:
    e = lg.CudaError("cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory")
    assert "cuMemAlloc" in str(e) and "CUDA_ERROR_OUT_OF_MEMORY" in str(e) and "out of memory" in str(e)
    n = lg.NcclError("ncclAllReduce", 4, "ncclInvalidArgument", "invalid argument", "count is 0")
    assert "ncclAllReduce" in str(n) and "count is 0" in str(n)
    assert issubclass(lg.CudaUnavailableError, lg.LowgradError)


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
    gc.collect()  # the finalizer only queues the release (lowgrad.core.release) ...
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


def test_tensor_views_and_shard_view(host: lg.HostDevice) -> None:
    t = host.alloc((8, 3), lg.fp32, name="w")
    t.numpy()[:] = np.arange(24, dtype=np.float32).reshape(8, 3)
    s = lg.shard_view(t, 2, 4)
    assert s.shape == (2, 3) and np.array_equal(s.numpy(), np.arange(12, 18).reshape(2, 3))
    assert np.array_equal(t[3].numpy(), [9, 10, 11]) and t[-1].numpy()[0] == 21
    assert t.reshape(4, 6).shape == (4, 6) and t.flat().shape == (24,)
    with pytest.raises(ValueError, match=r"'w'.*\(8, 3\).*world 3"):
        lg.shard_view(t, 0, 3)
    with pytest.raises(ValueError):
        lg.shard_view(t, 4, 4)
    with pytest.raises(ValueError):
        t[::2]
    with pytest.raises(ValueError):
        t.reshape(5, 5)
    with pytest.raises(IndexError):
        t[8]


def test_copy_errors(host: lg.HostDevice) -> None:
    a = host.alloc(8, lg.fp32, name="a")
    with pytest.raises(TypeError, match="dtype"):
        lg.ops.copy(host.alloc(8, lg.bf16, name="b"), a)
    with pytest.raises(ValueError, match="size"):
        lg.ops.copy(host.alloc(9, lg.fp32, name="c"), a)
    with pytest.raises(ValueError, match="lives on"):
        lg.ops.copy(lg.HostDevice().alloc(8, lg.fp32, name="d"), a)
    with pytest.raises(TypeError):
        lg.ops.copy(a, np.zeros(8, np.float32))


def test_stream_arguments() -> None:
    class TorchLike:
        cuda_stream = 1234

    class CupyLike:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 99)

    assert lg.stream_handle(None) == 0 and lg.stream_handle(77) == 77
    assert lg.stream_handle(TorchLike()) == 1234 and lg.stream_handle(CupyLike()) == 99
    for bad in ("stream", 1.5, object(), [1]):
        with pytest.raises(TypeError, match="stream"):
            lg.stream_handle(bad)
    with pytest.raises(ValueError):
        lg.stream_handle(-3)
    h = lg.HostDevice()
    with pytest.raises(TypeError):
        lg.ops.fill_zero(h.alloc(4, lg.fp32, name="z"), stream="default")


def test_host_events_and_streams() -> None:
    h = lg.HostDevice()
    s = h.stream(priority=0)
    e0, e1 = h.event(timing=True), h.event(timing=True)
    e0.record(s)
    e1.record(s)
    assert e0.query() and s.query() and e0.elapsed_ms(e1) >= 0
    with pytest.raises(ValueError):
        h.event().elapsed_ms(h.event())


def test_container() -> None:
    h = lg.HostDevice()
    a, b = h.alloc(2, lg.fp32, name="a"), h.alloc(3, lg.fp32, name="b")
    c = lg.Container([("a", a), ("empty", None), ("b", b)])
    assert c["b"] is b and c["empty"] is None and c[0] is a and len(c) == 3
    assert [n for n, _ in c.items()] == ["a", "b"]
    with pytest.raises(KeyError, match="nope"):
        c["nope"]
    with pytest.raises(ValueError):
        lg.Container([("a", a), ("a", b)])


def test_from_numpy_round_trip_every_dtype() -> None:
    import ml_dtypes

    h = lg.HostDevice()
    rng = np.random.default_rng(1)
    for npd in (np.float32, ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn, np.uint8):
        arr = rng.standard_normal((5, 3)).astype(npd) if npd is not np.uint8 else rng.integers(0, 255, (5, 3), np.uint8)
        t = lg.from_numpy(arr, h, kind="device", name="rt")
        assert np.array_equal(t.numpy().view(np.uint8), arr.view(np.uint8))


def test_bitcast_and_host_dlpack() -> None:
    h = lg.HostDevice()
    t = h.alloc((3, 4), lg.bf16, name="w")
    t.numpy()[:] = 1.5
    u = t.bitcast(lg.byte)
    assert u.shape == (3, 8) and u.ptr == t.ptr
    assert np.array_equal(u.numpy().view(lg.bf16.np), t.numpy())
    assert t.bitcast("fp16").shape == (3, 4) and t.bitcast(lg.fp32).shape == (3, 2)
    with pytest.raises(ValueError, match="bitcast"):
        h.alloc(3, lg.bf16, name="odd").bitcast(lg.fp32)
    assert t.__dlpack_device__() == (1, 0)  # host backend tensors are CPU memory for DLPack
    arr = np.from_dlpack(h.alloc(5, lg.fp32, name="dl"))
    assert arr.shape == (5,)
    with pytest.raises(AttributeError):
        t.__cuda_array_interface__
