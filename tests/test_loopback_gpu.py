"""The loopback communicator on the GPU: world 2..8 ranks as threads on one H200. Every
collective equals the host backend bit for bit; failures (an exception in one rank, a rank that
never arrives, ranks that disagree, a rank that leaves) surface in bounded time."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from loopback_cases import assert_bits, collectives, put

import lowgrad as lg

pytestmark = pytest.mark.gpu

WORLDS = [2, 3, 4, 8]


def both(world: int, fn: Any) -> tuple[list[Any], list[Any]]:
    """``fn(comm)`` on the loopback (one GPU) and on the host backend."""
    return (lg.run_threads(world, fn, backend="cuda", share_gpu=True, timeout=60),
            lg.run_threads(world, fn, backend="host"))


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_equal_the_host_backend_bit_for_bit(world: int) -> None:
    cuda, host = both(world, collectives)
    assert_bits(cuda, host)


def test_world_one_and_agreement_checks() -> None:
    def job(comm: Any) -> None:
        t = put(comm, np.arange(8, dtype=np.float32), lg.fp32, "t")
        comm.all_reduce(t, "sum")
        comm.wait()
        assert t.numpy().tolist() == list(range(8))
        with pytest.raises(TypeError, match="reduces"):
            comm.all_reduce(comm.device.alloc((4,), lg.fp8_e4m3, name="f8"))
    lg.run_threads(1, job, backend="cuda", share_gpu=True, timeout=30)

    def disagree(comm: Any) -> None:
        t = put(comm, np.ones(8 * (1 + comm.rank), np.float32), lg.fp32, "t")  # rank 1: twice the size
        comm.all_reduce(t, "sum")
        comm.wait()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="ranks must make the same calls"):
        lg.run_threads(2, disagree, backend="cuda", share_gpu=True, timeout=30)
    assert time.monotonic() - t0 < 10


def test_a_failing_rank_stops_the_others_in_bounded_time() -> None:
    def job(comm: Any) -> None:
        t = put(comm, np.ones(1 << 16, np.float32), lg.fp32, "t")
        if comm.rank == 2:
            raise KeyError("engine bug in rank 2")
        for _ in range(3):
            comm.all_reduce(t, "sum")
        comm.wait()
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="engine bug"):
        lg.run_threads(4, job, backend="cuda", share_gpu=True, timeout=120)
    assert time.monotonic() - t0 < 10  # the abort ends the device waits long before the timeout


def test_a_rank_that_never_arrives_times_out_and_a_rank_that_left_is_named() -> None:
    def late(comm: Any) -> str:
        t = put(comm, np.ones(64, np.float32), lg.fp32, "t")
        if comm.rank == 0:
            comm.all_reduce(t, "sum")
            try:
                comm.wait(timeout=60)  # the device-side wait (1.5 s) gives up first
            except lg.CommTimeoutError as exc:
                return str(exc)
            return "no error"
        time.sleep(4)  # rank 1 never calls the collective, and does not fail either
        return ""
    t0 = time.monotonic()
    msgs = lg.run_threads(2, late, backend="cuda", share_gpu=True, timeout=1.5)
    assert "timed out waiting for rank 1" in msgs[0] and time.monotonic() - t0 < 30

    def leaver(comm: Any) -> str:
        t = put(comm, np.ones(64, np.float32), lg.fp32, "t")
        comm.barrier()
        if comm.rank == 1:
            comm.close()
            return ""
        time.sleep(0.2)
        comm.all_reduce(t, "sum")
        with pytest.raises(lg.CommAbortedError, match="rank 1 left") as info:
            comm.wait()
        return str(info.value)
    msgs = lg.run_threads(2, leaver, backend="cuda", share_gpu=True, timeout=60)
    assert "left" in msgs[0]
