"""The loopback communicator on the GPU: world 2..8 ranks as threads on one H200. Every
collective equals the host backend bit for bit; failures (an exception in one rank, a rank that
never arrives, ranks that disagree, a rank that leaves) surface in bounded time."""
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
    race_hunt,
    train,
)
from test_managers import STRATS

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
    with pytest.raises(ValueError, match="ranks disagree"):
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


def test_a_device_synchronize_while_the_others_wait_in_a_ring_of_sends() -> None:
    """:func:`late_synchronize_ring` on the device: the synchronize returns (it once waited for the
    loopback timeout: a rare hang of the collectives test at world 8)."""
    t0 = time.monotonic()
    got = lg.run_threads(4, late_synchronize_ring, backend="cuda", share_gpu=True, timeout=10)
    assert time.monotonic() - t0 < 8
    assert_ring(got)


def test_a_rank_that_never_arrives_times_out_and_a_rank_that_left_is_named() -> None:
    def late(comm: Any) -> str:
        t = put(comm, np.ones(64, np.float32), lg.fp32, "t")
        if comm.rank == 0:
            try:
                comm.all_reduce(t, "sum")  # the threads meet first: rank 1's never comes
            except lg.CommTimeoutError as exc:
                return str(exc)
            return "no error"
        time.sleep(4)  # rank 1 never calls the collective, and does not fail either
        return ""
    t0 = time.monotonic()
    msgs = lg.run_threads(2, late, backend="cuda", share_gpu=True, timeout=1.5)
    assert "waited 1.5 s for rank(s) [1]" in msgs[0] and time.monotonic() - t0 < 30

    def leaver(comm: Any) -> str:
        t = put(comm, np.ones(64, np.float32), lg.fp32, "t")
        comm.barrier()
        if comm.rank == 1:
            comm.close()
            return ""
        time.sleep(0.2)
        with pytest.raises(lg.CommAbortedError, match="left") as info:
            comm.all_reduce(t, "sum")
        return str(info.value)
    msgs = lg.run_threads(2, leaver, backend="cuda", share_gpu=True, timeout=60)
    assert "rank(s) [1]" in msgs[0]

    def slow(comm: Any) -> str:
        """Rank 1's stream is held on the GPU past the timeout: rank 0's device-side wait gives up."""
        s = comm.device.stream()
        t = put(comm, np.ones(64, np.float32), lg.fp32, "t")
        comm.barrier()  # put() synchronizes the device: no rank may still be in it when rank 1 holds s
        if comm.rank == 1:
            race_hunt.spin(comm.device, s, 4_000_000_000)
        comm.all_reduce(t, "sum", stream=s)
        try:
            comm.wait(s, timeout=60)
        except lg.CommTimeoutError as exc:
            return str(exc)
        return "no error"
    t0 = time.monotonic()
    msgs = lg.run_threads(2, slow, backend="cuda", share_gpu=True, timeout=1.0)
    assert "rank 0 timed out waiting for rank 1" in msgs[0] and time.monotonic() - t0 < 30


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_managers_equal_the_host_backend(world: int, strategy: str, offload: bool, graphs: bool) -> None:
    """Every strategy at world 2/4/8 through the real kernels, eager or replaying CUDA graphs,
    three steps of three micro-steps: the shards equal the host backend's bit for bit."""
    layout = layout8()
    cuda = lg.run_threads(world, train(layout, strategy, offload, 3, 3, graphs), backend="cuda", share_gpu=True,
                          timeout=60)
    host = lg.run_threads(world, train(layout, strategy, offload, 3, 3), backend="host")
    for r, (a, b) in enumerate(zip(cuda, host)):
        assert a.keys() == b.keys()
        for k in a:
            assert np.array_equal(a[k], b[k]), (r, k)


def test_race_hunter_finds_no_mismatch(tmp_path: Any) -> None:
    """A short race hunt at world 4 (the long one is tools/race_hunt.py in the GPU session)."""
    out = tmp_path / "hunt.json"
    assert race_hunt.main(["--world", "4", "--seconds", "10", "--json", str(out)]) == 0
    import json
    records = json.loads(out.read_text())["records"]
    assert sum(r["runs"] for r in records) >= 4 and not any(r["mismatched_runs"] for r in records)
