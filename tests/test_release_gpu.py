"""GC-safe release on the CUDA backend: collected streams, events, graphs and communicators are
destroyed at the next drain (never inside the GC, never during a capture); exported views (DLPack,
the CUDA array interface, numpy views of pinned memory) keep device memory alive after close().
Every test needs a GPU (``gpu`` marker) and skips cleanly without one."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.buffers import dlpack, release
from lowgrad.cuda import nccl

pytestmark = pytest.mark.gpu


def _settled(dev: lg.Device, name: str) -> int:
    gc.collect()
    dev.synchronize()  # a safe point: drains
    return dev.memory_report().bytes(name)


@pytest.mark.timeout(120)
def test_collected_stream_event_graph_are_destroyed_at_a_drain(gpu: lg.Device) -> None:
    s, e = gpu.stream(), gpu.event()
    t = gpu.alloc(1024, lg.fp32, name="rel_graph")
    lg.ops.fill_zero(t, stream=s)  # compiles and loads the kernels outside the capture
    s.synchronize()
    g = lg.Graph(gpu)
    with g.capture(s):
        lg.ops.fill_zero(t, stream=s)
    fins = [s._finalizer, e._finalizer, g._finalizer]
    other = gpu.stream()
    del s, e, g
    gc.collect()
    assert all(f is not None and not f.alive for f in fins)
    assert release.pending() >= 3  # queued by the GC, nothing destroyed yet
    other.synchronize()  # a safe point
    assert release.pending() == 0
    t.close()
    assert _settled(gpu, "rel_graph") == 0


@pytest.mark.timeout(120)
def test_nothing_is_released_while_a_capture_is_open(gpu: lg.Device) -> None:
    s = gpu.stream()
    keep = gpu.alloc(256, lg.fp32, name="rel_keep")
    lg.ops.fill_zero(keep, stream=s)
    s.synchronize()
    dropped = gpu.alloc(1 << 20, lg.fp32, name="rel_dropped")
    g = lg.Graph(gpu)
    with g.capture(s):
        lg.ops.fill_zero(keep, stream=s)
        del dropped
        gc.collect()
        release.drain()  # skipped: cuMemFree must not run while the capture is open
        assert release.pending() >= 1
        assert gpu.memory_report().bytes("rel_dropped") == 4 << 20
    g.replay(s)
    assert _settled(gpu, "rel_dropped") == 0
    g.close()
    keep.close()


@pytest.mark.timeout(120)
def test_collected_communicator_is_aborted_at_a_drain(gpu: lg.Device) -> None:
    comm = lg.Communicator(0, 1, nccl.unique_id(), gpu, timeout=60)
    f = comm._finalizer
    del comm
    gc.collect()
    assert not f.alive and release.pending() >= 1
    gpu.synchronize()
    assert release.pending() == 0


def _cupy():
    return pytest.importorskip("cupy")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("way", ["dlpack", "cai"])
def test_cupy_view_outlives_close(gpu: lg.Device, way: str) -> None:
    cupy = _cupy()
    arr = np.arange(4096, dtype=np.float32)
    t = lg.from_numpy(arr, gpu, name=f"rel_cupy_{way}")
    c = cupy.from_dlpack(t) if way == "dlpack" else cupy.asarray(t)
    t.close()
    assert _settled(gpu, f"rel_cupy_{way}") == arr.nbytes  # the view holds the memory
    for _ in range(4):  # freed memory would be handed out again here
        lg.from_numpy(np.full(4096, -1, np.float32), gpu, name="rel_reuse")
    assert float(c.sum()) == float(arr.sum())
    del c
    if way == "cai":
        assert _settled(gpu, f"rel_cupy_{way}") == arr.nbytes  # the tensor object pins it (no deleter)
        del t
    assert _settled(gpu, f"rel_cupy_{way}") == 0


@pytest.mark.timeout(120)
def test_torch_view_outlives_manager_close(gpu: lg.Device) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    layout = lg.Layout(block=[lg.ParamSpec("w", (64, 32))], non_block=[lg.ParamSpec("emb", (128, 32))], num_layers=2)
    comm = lg.Communicator(0, 1, nccl.unique_id(), gpu, timeout=60)
    gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", dtype="fp32")
    s = gpu.stream()
    gm.start_micro_step(s, 0, 1)
    t, _ = gm.non_block_full("emb", s)
    view = torch.from_dlpack(t)
    view.fill_(2.5)
    torch.cuda.synchronize()
    gm.close()
    before = _settled(gpu, "non_block_grad")
    assert before > 0
    assert float(view.sum()) == 2.5 * 128 * 32
    del view, t
    assert _settled(gpu, "non_block_grad") == 0
    comm.close()


@pytest.mark.timeout(120)
def test_numpy_rejects_a_device_capsule_cleanly(gpu: lg.Device) -> None:
    t = gpu.alloc(16, lg.fp32, name="rel_np_device")
    with pytest.raises((BufferError, RuntimeError, TypeError)) as info:
        np.from_dlpack(t)  # numpy reads CPU memory only
    assert not isinstance(info.value, SystemError)
    del info
    t.close()
    assert _settled(gpu, "rel_np_device") == 0 and dlpack.live_exports() == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["pinned", "write_combined"])
def test_pinned_numpy_view_outlives_close(gpu: lg.Device, kind: str) -> None:
    t = gpu.alloc(1000, lg.fp32, kind=kind, name=f"rel_{kind}")
    a = t.numpy()
    a[:] = 3.0
    t.close()
    assert _settled(gpu, f"rel_{kind}") == 4000
    assert float(a.sum()) == 3000.0  # cuMemFreeHost has not run under the view
    del a
    assert _settled(gpu, f"rel_{kind}") == 0
