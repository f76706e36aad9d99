"""The loopback communicator's protocol without a GPU (tests/loopback_sim.py interprets its
kernels on host memory): collectives, sends and the gradient managers at world 2..8 equal the
host backend bit for bit; disagreeing ranks, aborts, timeouts and departures raise in bounded
time; argument errors raise before anything is queued."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from loopback_cases import (
    assert_bits,
    assert_ring,
    collectives,
    late_synchronize_ring,
    layout8,
    put,
    train,
)
from loopback_sim import SimDevice, patch, run
from test_managers import STRATS, drive, small_layout

import lowgrad as lg
from lowgrad.cuda.loopback import LoopbackCommunicator, LoopbackGroup


@pytest.fixture(autouse=True)
def sim(monkeypatch: pytest.MonkeyPatch) -> None:
    patch(monkeypatch)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_collectives_equal_the_host_backend(world: int) -> None:
    assert_bits(run(world, collectives), lg.run_threads(world, collectives, backend="host"))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy,offload", STRATS)
def test_managers_equal_the_host_backend(world: int, strategy: str, offload: bool) -> None:
    layout = small_layout(zero_init=True)

    def job(c: Any) -> dict[str, np.ndarray]:
        return drive(c, layout, strategy, offload, micro=3, steps=2)
    loop, host = run(world, job), lg.run_threads(world, job, backend="host")
    for a, b in zip(loop, host):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy,offload", STRATS)
def test_engine_job_equals_the_host_backend_at_world_8(strategy: str, offload: bool) -> None:
    job = train(layout8(), strategy, offload, 3, 2)
    for a, b in zip(run(8, job), lg.run_threads(8, job, backend="host")):
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_disagreeing_ranks_raise_on_the_host() -> None:
    def job(comm: Any) -> None:
        t = put(comm, np.ones(8 * (1 + comm.rank), np.float32), lg.fp32, "t")
        comm.all_reduce(t, "sum")
        comm.wait()
    with pytest.raises(ValueError, match="ranks disagree"):
        run(2, job)

    def p2p(comm: Any) -> None:
        t = put(comm, np.ones(4 + comm.rank, np.float32), lg.fp32, "t")
        if comm.rank == 0:
            comm.send(t, 1)
        else:
            comm.recv(t, 0)
    with pytest.raises(ValueError, match="each send must match its receive"):
        run(2, p2p)


def test_a_device_synchronize_while_the_others_wait_in_a_ring_of_sends() -> None:
    """:func:`late_synchronize_ring`: the simulated synchronize raises when a rank's sync waits on a
    peer that waits on the host (on a GPU it hung until the loopback timeout; the GPU tests have
    the same case on the device)."""
    assert_ring(run(4, late_synchronize_ring, timeout=20))


def test_failures_end_in_bounded_time() -> None:
    def failing(comm: Any) -> None:
        t = put(comm, np.ones(64, np.float32), lg.fp32, "t")
        if comm.rank == 1:
            raise KeyError("engine bug")
        comm.all_reduce(t, "sum")
        comm.wait()
    t0 = time.monotonic()
    with pytest.raises(KeyError):
        run(3, failing, timeout=60)
    assert time.monotonic() - t0 < 10

    def late(comm: Any) -> str:
        if comm.rank == 0:
            t = put(comm, np.ones(8, np.float32), lg.fp32, "t")
            try:
                comm.all_reduce(t, "sum")  # waits for rank 1's thread here
                comm.wait(timeout=60)
            except lg.CommTimeoutError as exc:
                return str(exc)
            return "no error"
        time.sleep(1.5)
        return ""
    assert "waited 0.5 s for rank(s) [1]" in run(2, late, timeout=0.5)[0]

    def leaver(comm: Any) -> str:
        comm.barrier()
        if comm.rank == 1:
            comm.close()
            return ""
        t = put(comm, np.ones(8, np.float32), lg.fp32, "t")
        with pytest.raises(lg.CommAbortedError, match=r"rank\(s\) \[1\], which left"):
            comm.all_reduce(t, "sum")
            comm.wait()
        with pytest.raises(lg.CommAbortedError):
            comm.barrier()
        return "ok"
    assert run(2, leaver)[0] == "ok"


def test_a_world_beyond_the_hardware_queues_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    LoopbackGroup(SimDevice("q4"), 4)
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS=32"):
        LoopbackGroup(SimDevice("q4"), 5)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    with pytest.raises(ValueError, match="gives this process 8"):
        LoopbackGroup(SimDevice("q8"), 9)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "64")
    with pytest.raises(ValueError, match="more than 32 ranks"):
        LoopbackGroup(SimDevice("q32"), 33)


def test_bad_arguments_raise_before_anything_is_queued() -> None:
    dev = SimDevice("bad")
    with pytest.raises(ValueError, match="world"):
        LoopbackGroup(dev, 0)
    with pytest.raises(ValueError, match="world"):
        LoopbackGroup(dev, 65)
    with pytest.raises(TypeError, match="launches CUDA kernels"):
        LoopbackGroup(lg.HostDevice(), 2)
    with pytest.raises(TypeError, match="LoopbackGroup"):
        LoopbackCommunicator(0, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="share_gpu=True needs backend='cuda'"):
        lg.run_threads(2, lambda c: None, backend="host", share_gpu=True)
    with pytest.raises(TypeError, match="share_gpu"):
        lg.run_threads(2, lambda c: None, backend="cuda", share_gpu="yes")
    group = LoopbackGroup(dev, 1)
    comm = LoopbackCommunicator(0, group)
    t = dev.alloc((6,), lg.fp32, name="t")
    counters = group._counters.numpy().copy()
    with pytest.raises(TypeError, match="reduces"):
        comm.all_reduce(dev.alloc((4,), lg.fp8_e4m3, name="f8"))
    with pytest.raises(ValueError, match="peer"):
        comm.recv(t, 3)
    with pytest.raises(ValueError, match="op"):
        comm.reduce_scatter(t, op="max")
    assert np.array_equal(group._counters.numpy(), counters)  # nothing ran
    comm.close()
    with pytest.raises(lg.ClosedError):
        comm.all_reduce(t)
