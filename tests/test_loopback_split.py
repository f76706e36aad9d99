"""``LoopbackCommunicator.split`` without a GPU (tests/loopback_sim.py interprets the loopback
kernels on host memory): the split communicators' collectives and the hierarchical strategy at
2x2, 2x4 and 4x2 equal the host backend bit for bit; bad arguments raise before anything
happens; an abort reaches the split communicators. tests/test_loopback_split_gpu.py runs the
same jobs on a GPU."""
from __future__ import annotations

import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
from loopback_sim import SimDevice, UngatedSimDevice, patch, run
from test_hierarchical import small_layout
from test_host_communicator_split import split_cycles
from test_managers import bf16_grad, drive

import lowgrad as lg
from lowgrad.buffers import release
from lowgrad.cuda import loopback

SHAPES = [(4, 2), (8, 4), (8, 2)]


@pytest.fixture(autouse=True)
def sim(monkeypatch: pytest.MonkeyPatch) -> None:
    patch(monkeypatch)


def node_sums(group: int) -> Any:
    """The job: split by node and by local index, all-reduce within each, return the results."""
    def job(c: Any) -> tuple[int, int, int, int, list[float], list[float]]:
        node, cross = c.split(c.rank // group), c.split(c.rank % group, -c.rank)  # cross: reversed order
        out = []
        for sub in (node, cross):
            t = c.device.alloc((3,), lg.fp32, name="t")
            c.device.copy_from_host(t, np.full(3, 2.0 ** c.rank, np.float32))
            sub.all_reduce(t, "sum")
            host = np.zeros(3, np.float32)
            sub.wait()
            c.device.copy_to_host(host, t)
            out.append(host.tolist())
        res = (node.rank, node.world, cross.rank, cross.world, out[0], out[1])
        node.close()
        cross.close()
        return res
    return job


def hierarchical(group: int, offload: bool, rounding: str | None = None, **options: Any) -> Any:
    layout = small_layout()

    def job(c: Any) -> dict[str, np.ndarray]:
        with lg.create_gradient_manager(layout, c, strategy="hierarchical", group_size=group, offload=offload,
                                        seed=7, rounding=rounding, **options) as gm:
            return drive(c, layout, "hierarchical", offload, 3, steps=2, gm=gm, gfun=bf16_grad)
    return job


def check_node_sums(results: list[Any], world: int, group: int) -> None:
    N = world // group
    for r, (nr, nw, cr, cw, a, b) in enumerate(results):
        n, g = divmod(r, group)
        assert (nr, nw, cr, cw) == (g, group, N - 1 - n, N)
        assert a == [sum(2.0 ** (n * group + k) for k in range(group))] * 3
        assert b == [sum(2.0 ** (k * group + g) for k in range(N))] * 3


@pytest.mark.parametrize("world,group", SHAPES)
def test_split_collectives(world: int, group: int) -> None:
    check_node_sums(run(world, node_sums(group)), world, group)


@pytest.mark.parametrize("world,group", SHAPES)
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("rounding", [None, "sr"])  # "sr": the all-to-alls summed in float32 (SumExchange)
def test_hierarchical_equals_the_host_backend(world: int, group: int, offload: bool, rounding: str | None) -> None:
    job = hierarchical(group, offload, rounding)
    for a, b in zip(run(world, job), lg.run_threads(world, job)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_bad_arguments_raise_before_anything_happens() -> None:
    def job(c: Any) -> int:
        for color, key, exc in ((-1, None, ValueError), (True, None, TypeError), (0, 1.5, TypeError)):
            with pytest.raises(exc, match="split"):
                c.split(color, key)
        with c.split(0) as sub:
            return sub.world
    assert run(2, job) == [2, 2]


def test_an_abort_reaches_the_split_communicators() -> None:
    def job(c: Any) -> None:
        sub = c.split(0)
        if c.rank == 1:
            raise RuntimeError("boom in rank 1")
        sub.barrier()

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"):
        run(2, job, timeout=60)
    assert time.monotonic() - t0 < 10


def test_split_and_close_cycles_leave_no_group_held_by_the_parent() -> None:
    """The parent's meeting holds the loopback groups split from it weakly (each holds device
    memory and streams): 50 split-and-close cycles leave none behind, and a split alive after them
    is still reached by a failing rank's abort."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"boom in rank 1 \(0 held\)"):
        run(2, split_cycles(lambda c: c.shared.meet._children), timeout=60)
    assert time.monotonic() - t0 < 10


def busy_neighbours(iterations: int) -> Any:
    """Ranks 0 and 1 all-reduce in their own group while ranks 2 and 3 allocate, copy to and
    from the device and free, over and over: device-wide calls in some threads while a
    collective is part-way queued in others (what hung an H100 when a free held the driver's
    lock against a peer's launch). Ranks 2 and 3 go on until ranks 0 and 1 are done."""
    done = threading.Event()

    def job(c: Any) -> float:
        sub = c.split(c.rank // 2)
        t = c.device.alloc((3,), lg.fp32, name="t")
        c.device.copy_from_host(t, np.full(3, 1.0 + c.rank, np.float32))
        if c.rank < 2:
            for _ in range(iterations):
                sub.all_reduce(t, "avg")
                sub.wait()
            done.set()
        while c.rank >= 2 and not done.is_set():
            u = c.device.alloc((64,), lg.fp32, name="u")
            c.device.copy_from_host(u, np.ones(64, np.float32))
            u.allocation.close()  # the free
        host = np.zeros(3, np.float32)
        c.device.copy_to_host(host, t)
        sub.close()
        return float(host[0])
    job.done = done  # type: ignore[attr-defined]  # set it to end ranks 2 and 3 when ranks 0 and 1 failed
    return job


def test_device_wide_calls_wait_for_collectives_part_way_queued() -> None:
    got = run(4, busy_neighbours(200), timeout=20)
    assert got == [1.5, 1.5, 3.0, 4.0]


def test_without_the_gate_the_stand_in_hangs_as_the_gpu_did() -> None:
    """The stand-in's driver lock is what makes the test above able to fail: the same job on a
    device without the gate stops with the stand-in's hang report (or a peer's timeout)."""
    job = busy_neighbours(200)
    try:
        with pytest.raises((AssertionError, lg.CommTimeoutError, lg.CommAbortedError)):
            run(4, job, timeout=5, device=UngatedSimDevice())
    finally:
        job.done.set()  # ranks 2 and 3, left looping by run_threads, stop
    time.sleep(0.5)
    flush_releases()  # the ungated device's frees now, while no collective runs


def rank1_copy_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's loopback copies raise (after its peers met it: part-way through queuing)."""
    real = loopback.Kernel.launch

    def launch(self: Any, grid: int, stream: int, *args: Any) -> None:
        if self.spec.symbol == "loopback_copy" and threading.current_thread().name == "lowgrad-rank1":
            raise RuntimeError("boom in rank 1's copy")
        real(self, grid, stream, *args)
    monkeypatch.setattr(loopback.Kernel, "launch", launch)


def flush_releases() -> None:
    """Free now what earlier tests left to the deferred releases: drained during a timed test, a
    free waits (as cuMemFree does) for that test's device work, the waits it measures included."""
    gc.collect()
    release.drain()


def test_a_collective_failing_part_way_closes_its_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's copy fails after its peers met it (its window open): it stops the group (rank 0's
    device-side wait for it ends at once) and every rank's window closes, so the device-wide calls
    after it (the test's own copies) do not wait."""
    rank1_copy_fails(monkeypatch)
    dev = SimDevice()
    flush_releases()

    def job(c: Any) -> None:
        t = c.device.alloc((4,), lg.fp32, name="t")
        c.all_reduce(t)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom in rank 1's copy"):
        run(2, job, timeout=10, device=dev)
    assert time.monotonic() - t0 < 5  # the failing rank stopped the group: rank 0 did not wait out its timeout
    assert dev.sync_gate.windows == 0
    dev.synchronize()


def test_a_rank_that_fails_queuing_and_goes_on_stops_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's copy fails part-way; rank 1 catches it and goes on to a device-wide call (a
    synchronize). It stopped the group before closing its window: rank 0's collective raises
    CommAbortedError at once, and rank 1's synchronize does not wait on rank 0's kernels."""
    rank1_copy_fails(monkeypatch)

    def job(c: Any) -> str:
        t = c.device.alloc((4,), lg.fp32, name="t")
        try:
            c.all_reduce(t)
            c.wait()
        except (RuntimeError, lg.CommAbortedError) as exc:
            c.device.synchronize()
            return type(exc).__name__
        return "finished"
    flush_releases()
    t0 = time.monotonic()
    assert run(2, job, timeout=20) == ["CommAbortedError", "RuntimeError"]
    assert time.monotonic() - t0 < 5


def test_a_split_queues_on_its_parent_ranks_loopback_stream() -> None:
    """A split group makes no streams: each rank's collectives of every group run on the rank's
    one loopback stream (which has a hardware queue of its own), kept alive by the child."""
    def job(c: Any) -> tuple[bool, int]:
        with c.split(c.rank % 2) as sub, sub.split(0) as subsub:
            return sub._stream_h == subsub._stream_h == c._stream_h, len(sub.shared.streams)
    assert run(4, job) == [(True, 0)] * 4


@pytest.mark.parametrize("world,group", [(4, 2), (8, 2), (8, 4)])
def test_hierarchical_int8_hop_equals_the_host_backend(world: int, group: int) -> None:
    """The 8-bit cross-node hop through the loopback's all-to-all of byte and float32 slots (the
    stand-in's kernels are the host's): the same bits as the host backend."""
    job = hierarchical(group, True, "sr", cross_node_bits=8)
    for a, b in zip(run(world, job), lg.run_threads(world, job)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
