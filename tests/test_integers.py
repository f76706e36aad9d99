"""NumPy integers are accepted wherever lowgrad takes a Python int below the managers (the one rule
of :mod:`lowgrad.base.integers`): ranks, worlds, peers, ports, stream priorities, device ordinals,
layer counts. Bools, Python's or NumPy's, and floats stay refused."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from loopback_sim import SimDevice, patch

import lowgrad as lg
from lowgrad.base.integers import integer
from lowgrad.cuda import loopback
from lowgrad.launch.tcp_rendezvous import exchange_unique_id
from lowgrad.runtime.threads import ThreadCollective

NP_INTS = [np.int64(1), np.int32(1), np.uint8(1), np.intp(1)]
NOT_INTS = [True, False, np.True_, np.bool_(False), 1.0, np.float64(1.0), "1", None, [1]]


@pytest.mark.parametrize("value", [1, *NP_INTS])
def test_integer_takes_python_and_numpy_integers(value: Any) -> None:
    got = integer("x", value)
    assert got == 1 and type(got) is int


@pytest.mark.parametrize("value", NOT_INTS)
def test_integer_refuses_bools_floats_and_the_rest(value: Any) -> None:
    with pytest.raises(TypeError, match=f"rank must be an int, got {type(value).__name__}"):
        integer("rank", value)


def test_shard_view() -> None:
    h = lg.HostDevice()
    t = lg.from_numpy(np.arange(12, dtype=np.float32).reshape(6, 2), h, name="t")
    v = lg.shard_view(t, np.int64(1), np.int32(3))
    assert v.shape == (2, 2) and np.array_equal(v.numpy(), t.numpy()[2:4])
    for rank, world in ((0, True), (True, 2), (np.bool_(True), 2), (0, np.float64(2))):
        with pytest.raises(TypeError, match="must be an int"):
            lg.shard_view(t, rank, world)
    with pytest.raises(ValueError, match="outside"):
        lg.shard_view(t, np.int64(3), np.int32(3))


def _exchange(c: Any) -> tuple[Any, ...]:
    """Rank and world as the communicator holds them, and a send/recv and host_gather addressed
    by NumPy integers."""
    t = lg.from_numpy(np.full(2, float(c.rank), np.float32), c.device, name="t")
    peer = np.int64(1 - c.rank)
    with c.group():
        c.send(t, peer) if c.rank == 0 else c.recv(t, np.int32(0))
    gathered = c.host_gather(bytes([c.rank]), root=np.int32(1))
    return type(c.rank), type(c.world), t.numpy().tolist(), gathered


def test_run_threads_and_the_communicators() -> None:
    got = lg.run_threads(np.int64(2), _exchange)
    assert got == [(int, int, [0.0, 0.0], None), (int, int, [0.0, 0.0], [b"\x00", b"\x01"])]
    for world in (True, np.bool_(True), 2.0):
        with pytest.raises(TypeError, match="world must be an int"):
            lg.run_threads(world, _exchange)
    coll = ThreadCollective(np.int32(1))
    c = lg.HostCommunicator(np.int64(0), np.int32(1), coll, lg.HostDevice())
    assert (type(c.rank), type(c.world), coll.world) == (int, int, 1)
    with pytest.raises(TypeError, match="rank must be an int"):
        lg.HostCommunicator(np.True_, 1, ThreadCollective(1), lg.HostDevice())
    with pytest.raises(TypeError, match="world must be an int"):
        ThreadCollective(True)
    with pytest.raises(TypeError, match="send: peer must be an int"):
        c.send(lg.from_numpy(np.ones(2, np.float32), c.device), True)


def test_rendezvous_arguments() -> None:
    uid = bytes(range(128))
    assert exchange_unique_id(np.int64(0), np.int32(1), "127.0.0.1", np.int64(1), uid, 1) == uid
    with pytest.raises(TypeError, match="world must be an int"):
        exchange_unique_id(0, np.bool_(True), "127.0.0.1", 1, uid, 1)


def test_loopback_world(monkeypatch: pytest.MonkeyPatch) -> None:
    patch(monkeypatch)
    dev = SimDevice("sim")
    assert loopback.LoopbackGroup(dev, np.int64(2), 5).world == 2
    with pytest.raises(TypeError, match="loopback world must be an int"):
        loopback.LoopbackGroup(dev, True, 5)
    assert lg.run_threads(np.int32(2), lambda c: c.rank, backend="cuda", share_gpu=dev, timeout=10) == [0, 1]


def test_stream_priority_device_ordinal_and_layout() -> None:
    s = lg.HostDevice().stream(priority=np.int32(0))
    assert s.priority == 0
    with pytest.raises(TypeError, match="priority must be an int"):
        lg.HostDevice().stream(priority=np.bool_(False))
    with pytest.raises(TypeError, match="device ordinal must be an int"):
        lg.Device(True)  # type: ignore[arg-type]
    try:
        dev = lg.Device(np.int64(0))
    except lg.CudaUnavailableError:
        pass  # no GPU here: the ordinal passed the check, the driver said why
    else:
        assert dev is lg.Device(0)
    layout = lg.Layout(block=(lg.ParamSpec("w", (8, 2)),), non_block=(), num_layers=np.int64(3))
    assert type(layout.num_layers) is int and layout.total_numel == 48
    layout.check_world(np.int32(4))
    with pytest.raises(TypeError, match="num_layers must be an int"):
        lg.Layout(block=(lg.ParamSpec("w", (8, 2)),), non_block=(), num_layers=True)
    with pytest.raises(TypeError, match="world must be an int"):
        layout.check_world(np.bool_(True))
