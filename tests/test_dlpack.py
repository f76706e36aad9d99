"""DLPack export on the host backend: lifetime across close(), consumers that reject a capsule,
capsules never consumed, the versioned capsule and argument checks."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.buffers import dlpack, release
from lowgrad.runtime.threads import ThreadCollective


@pytest.fixture
def host() -> lg.HostDevice:
    release.drain()
    return lg.HostDevice()


def _settled(dev: lg.HostDevice) -> int:
    """Bytes still reported after every pending release ran."""
    gc.collect()
    release.drain()
    return dev.memory_report().total()


def test_view_outlives_close(host: lg.HostDevice) -> None:
    """np.from_dlpack(t); t.close(); a.sum(): the memory stays valid (and reported) until the
    view goes, then it is freed."""
    t = host.alloc(256, lg.fp32, name="exported")
    t.numpy()[:] = np.arange(256)
    a = np.from_dlpack(t)
    t.close()
    with pytest.raises(lg.ClosedError):
        t.numpy()
    assert host.memory_report().bytes("exported") == 1024
    for _ in range(8):  # freed memory would be handed out again here
        host.alloc(256, lg.fp32, name="reuse").numpy()[:] = -7
    assert a.sum() == np.arange(256).sum()
    del a
    assert _settled(host) == 0 and dlpack.live_exports() == 0


def test_manager_close_keeps_exported_views(host: lg.HostDevice) -> None:
    layout = lg.Layout(block=[lg.ParamSpec("w", (8, 4))], non_block=[lg.ParamSpec("emb", (6, 4))], num_layers=2)
    comm = lg.HostCommunicator(0, 1, ThreadCollective(1), host)
    gm = lg.create_gradient_manager(layout, comm, strategy="scatter_reduce", dtype="fp32")
    s = host.stream()
    gm.start_micro_step(s, 0, 1)
    t, _ = gm.non_block_full("emb", s)
    view = np.from_dlpack(t)
    view[:] = 2.5
    gm.close()
    assert np.all(view == 2.5) and host.memory_report().bytes("non_block_grad") > 0
    del view, t
    assert _settled(host) == 0  # the manager object still exists; its closed buffers hold nothing


@pytest.mark.parametrize("dtype", [lg.bf16, lg.fp8_e4m3])
def test_rejected_capsule_gives_a_clean_error_and_leaks_nothing(host: lg.HostDevice, dtype: lg.DType) -> None:
    """numpy refuses bf16/fp8: its own error (not SystemError), and the lazy block is freed."""
    lazy = host.lazy_allocator()
    t = lazy.alloc((4, 4), dtype, "rejected")
    other = lazy.alloc(100, lg.fp32, "neighbour")
    lazy.commit()
    with pytest.raises((BufferError, RuntimeError, TypeError)) as info:
        np.from_dlpack(t)
    assert not isinstance(info.value, SystemError)
    del t, other, lazy, info  # the rejected capsule must not pin the block
    assert _settled(host) == 0 and dlpack.live_exports() == 0


def test_unconsumed_capsule_released_once_dropped(host: lg.HostDevice) -> None:
    t = host.alloc(8, lg.fp32, name="cap")
    cap = t.__dlpack__()
    t.close()
    assert _settled(host) == 32  # the capsule still holds the memory: it may be consumed later
    a = np.from_dlpack(_Capsule(cap, t.__dlpack_device__()))
    assert a.shape == (8,)
    del cap
    assert _settled(host) == 32  # consumed: the view holds it now
    del a
    assert _settled(host) == 0 and dlpack.live_exports() == 0
    u = host.alloc(8, lg.fp32, name="dropped")
    u.__dlpack__(max_version=(1, 0))  # made and dropped unconsumed
    u.close()
    assert _settled(host) == 0 and dlpack.live_exports() == 0


class _Capsule:
    """Hands a capsule made earlier to np.from_dlpack."""

    def __init__(self, capsule: object, device: tuple[int, int]) -> None:
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kw: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def test_versioned_capsule_is_writable_and_legacy_stays(host: lg.HostDevice) -> None:
    t = host.alloc((3, 5), lg.fp32, name="rw")
    t.numpy()[:] = 1.0
    assert "dltensor_versioned" in repr(t.__dlpack__(max_version=(1, 0)))
    assert '"dltensor"' in repr(t.__dlpack__())
    assert '"dltensor"' in repr(t.__dlpack__(max_version=(0, 8)))
    a = np.from_dlpack(t)  # numpy asks with max_version=(1, 0)
    assert a.flags.writeable and a.shape == (3, 5)
    a[1, 2] = 9.0
    assert t.numpy()[1, 2] == 9.0
    del a
    t.close()
    assert _settled(host) == 0


def test_dlpack_argument_checks(host: lg.HostDevice) -> None:
    t = host.alloc(4, lg.fp32, name="args")
    with pytest.raises(BufferError, match="copy"):
        t.__dlpack__(copy=True)
    with pytest.raises(TypeError, match="copy"):
        t.__dlpack__(copy="yes")
    with pytest.raises(BufferError, match="device"):
        t.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError, match="dl_device"):
        t.__dlpack__(dl_device="cpu")
    for bad in ((1,), [1, 0], (1, 0.5), (True, 0), "1.0", (-1, 0)):
        with pytest.raises(TypeError, match="max_version"):
            t.__dlpack__(max_version=bad)
    assert dlpack.live_exports() == 0  # nothing was built for a refused request
    assert np.from_dlpack(t, copy=False).shape == (4,)
    t.close()
    with pytest.raises(lg.ClosedError):
        t.__dlpack__()
    gc.collect()
    release.drain()
    assert dlpack.live_exports() == 0


def test_mapped_pinned_memory_is_named_as_the_consumer_asks() -> None:
    """Memory both sides address (kDLCUDAHost; PyTorch 2.11 refuses that type) is exported as
    kDLCPU or as kDLCUDA of its GPU on request, and as nothing else: a refused request leaves
    nothing behind, and the corrected retry gives the device asked for."""
    pinned = ((dlpack.KDL_CUDA_HOST, 0), (dlpack.KDL_CPU, 0), (dlpack.KDL_CUDA, 3))
    assert dlpack.check_request(pinned, None, None, None) == (False, (dlpack.KDL_CUDA_HOST, 0))
    with pytest.raises(BufferError, match="without a copy"):
        dlpack.check_request(pinned, None, (dlpack.KDL_CUDA, 0), None)  # another GPU
    assert dlpack.check_request(pinned, (1, 0), (dlpack.KDL_CUDA, 3), None) == (True, (dlpack.KDL_CUDA, 3))
    assert dlpack.check_request(pinned, None, (dlpack.KDL_CPU, 0), None) == (False, (dlpack.KDL_CPU, 0))
    with pytest.raises(BufferError, match="without a copy"):  # GPU-only memory has no CPU name
        dlpack.check_request(((dlpack.KDL_CUDA, 0),), None, (dlpack.KDL_CPU, 0), None)
    assert dlpack.live_exports() == 0
