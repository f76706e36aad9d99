"""CPU tests of lowgrad.buffers.tensor: views, shard_view, containers, numpy round trips, bitcast,
DLPack on the host, copies."""
from __future__ import annotations

import numpy as np
import pytest

import lowgrad as lg
import lowgrad.cuda.driver


@pytest.fixture
def host() -> lg.HostDevice:
    return lg.HostDevice()


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
