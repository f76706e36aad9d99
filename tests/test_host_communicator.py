"""The host backend communicator: every collective against numpy at world 1, 2, 3, 4 and 8, the
all-to-all slot semantics, and failures that must raise (never hang)."""
from __future__ import annotations

import threading
import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import lowgrad as lg
from lowgrad.contracts.communicator import (
    all_to_all_schedule,
    all_to_all_skip,
    all_to_all_source,
)
from lowgrad.host.communicator import HostCommunicator
from lowgrad.host.reduce import host_reduce
from lowgrad.runtime.threads import ThreadCollective

WORLDS = [1, 2, 3, 4, 8]


def data(rank: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed * 1000 + rank).standard_normal(n).astype(np.float32)


def tensor(comm, arr: np.ndarray, dtype=lg.fp32, kind: str = "device"):
    return lg.from_numpy(arr.astype(dtype.np), comm.device, kind=kind, name="t")


def f32_sum(arrs):
    acc = np.zeros_like(arrs[0], np.float32)
    for a in arrs:
        acc += a.astype(np.float32)
    return acc


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", ["avg", "sum"])
@pytest.mark.parametrize("dtype", [lg.fp32, lg.bf16])
def test_reduce_scatter(world, op, dtype):
    n = 6 * world

    def fn(c):
        t = tensor(c, data(c.rank, n), dtype)
        c.reduce_scatter(t, op)
        return lg.shard_view(t, c.rank, world).numpy().copy()

    out = lg.run_threads(world, fn, timeout=10)
    inputs = [data(r, n).astype(dtype.np) for r in range(world)]
    ref = f32_sum(inputs)
    if op == "avg":
        ref *= np.float32(1.0 / world)
    ref = ref.astype(dtype.np)
    for r in range(world):
        np.testing.assert_array_equal(out[r], ref[r * 6:(r + 1) * 6])


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_in_place_and_out_of_place(world):
    n = 4

    def fn(c):
        full = tensor(c, np.full(n * world, -1.0, np.float32))
        lg.shard_view(full, c.rank, world).numpy()[:] = data(c.rank, n)
        c.all_gather(full)
        shard = tensor(c, data(c.rank, n, 1), lg.bf16)
        out = c.device.alloc((n * world,), lg.bf16, name="out")
        c.all_gather(shard, out=out)
        return full.numpy().copy(), out.numpy().copy()

    res = lg.run_threads(world, fn, timeout=10)
    ref_in = np.concatenate([data(r, n) for r in range(world)])
    ref_out = np.concatenate([data(r, n, 1).astype(ml_dtypes.bfloat16) for r in range(world)])
    for full, out in res:
        np.testing.assert_array_equal(full, ref_in)
        np.testing.assert_array_equal(out, ref_out)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_all_reduce(world, op):
    n = 5

    def fn(c):
        t = tensor(c, data(c.rank, n), lg.bf16)
        c.all_reduce(t, op)
        return t.numpy().copy()

    res = lg.run_threads(world, fn, timeout=10)
    inputs = [data(r, n).astype(ml_dtypes.bfloat16) for r in range(world)]
    if op == "max":
        ref = np.max(np.stack([a.astype(np.float32) for a in inputs]), axis=0)
    else:
        ref = f32_sum(inputs) * (np.float32(1.0 / world) if op == "avg" else np.float32(1))
    for out in res:
        np.testing.assert_array_equal(out, ref.astype(ml_dtypes.bfloat16))


def test_byte_reduction_wraps_like_nccl():
    a = [np.array([200, 3], np.uint8), np.array([100, 4], np.uint8)]
    np.testing.assert_array_equal(host_reduce(a, "sum", 2, lg.byte), [44, 7])
    np.testing.assert_array_equal(host_reduce(a, "avg", 2, lg.byte), [22, 3])
    np.testing.assert_array_equal(host_reduce(a, "max", 2, lg.byte), [200, 4])


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_slots(world):
    n = 3

    def fn(c):
        # slot k of rank r holds 100*r + k (+ element index / 10)
        arr = np.concatenate([100 * c.rank + k + np.arange(n) / 10 for k in range(world)]).astype(np.float32)
        t = tensor(c, arr)
        c.all_to_all(t)
        return t.numpy().reshape(world, n).copy()

    res = lg.run_threads(world, fn, timeout=10)
    for r, slots in enumerate(res):
        skip = all_to_all_skip(r, world)
        assert skip == (r + world - 1) % world
        for s in range(world):
            if s == skip:
                continue
            src = all_to_all_source(r, world, s)
            d = (s - r) % world + 1
            assert src == (r - d) % world
            np.testing.assert_allclose(slots[s], 100 * src + r + np.arange(n) / 10, rtol=1e-6)
        received = {all_to_all_source(r, world, s) for s in range(world) if s != skip}
        assert received == set(range(world)) - {r}


def test_all_to_all_schedule_is_race_free():
    for world in range(1, 9):
        for r in range(world):
            sched = all_to_all_schedule(r, world)
            assert len(sched) == world - 1
            sent, received = {r}, set()  # the own slot is consumed before the call
            for send_peer, send_slot, _recv_peer, recv_slot in sched:
                assert send_peer == send_slot
                assert send_slot not in received  # never send a slot that already holds peer data
                assert recv_slot in sent  # only ever receive into a slot already sent
                sent.add(send_slot)
                received.add(recv_slot)
            # peers pair up: what r sends at step d, (r+d) receives at step d from r
            for d, (sp, _, _, _) in enumerate(sched, 1):
                assert all_to_all_schedule(sp, world)[d - 1][2] == r


@pytest.mark.parametrize("world", [2, 3, 4])
def test_send_recv_group_both_directions(world):
    def fn(c):
        right, left = (c.rank + 1) % world, (c.rank - 1) % world
        a = tensor(c, np.full(4, c.rank, np.float32))
        b = tensor(c, np.zeros(4, np.float32))
        with c.group() as g:
            c.recv(b, left)  # scheduled before the send: must not deadlock
            c.send(a, right)
        assert g.event.query()
        c.wait(g.event)
        return b.numpy().copy()

    for r, b in enumerate(lg.run_threads(world, fn, timeout=5)):
        np.testing.assert_array_equal(b, np.full(4, (r - 1) % world, np.float32))


def test_host_gather_barrier():
    def fn(c):
        c.barrier()
        return c.host_allgather(b"r%d" % c.rank), c.host_gather(bytes(c.rank), root=2)

    res = lg.run_threads(3, fn, timeout=5)
    for r, (allg, g) in enumerate(res):
        assert allg == [b"r0", b"r1", b"r2"]
        assert g == ([b"", b"\x00", b"\x00\x00"] if r == 2 else None)


# ---- errors ---------------------------------------------------------------------------------
def test_rank_that_raises_wakes_the_others():
    def fn(c):
        if c.rank == 1:
            raise RuntimeError("boom in rank 1")
        c.barrier()

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom") as info:
        lg.run_threads(4, fn, timeout=30)
    assert time.monotonic() - t0 < 5
    assert any("rank 1" in n for n in getattr(info.value, "__notes__", ["rank 1"]))


def test_rank_that_never_arrives_times_out():
    def fn(c):
        if c.rank == 2:
            time.sleep(1.0)
            return
        t = tensor(c, np.ones(4, np.float32))
        c.all_reduce(t)

    t0 = time.monotonic()
    with pytest.raises(lg.CommTimeoutError, match=r"\[2\]"):
        lg.run_threads(3, fn, timeout=0.3)
    assert time.monotonic() - t0 < 4


def test_recv_without_send_times_out():
    def fn(c):
        if c.rank == 0:
            c.recv(tensor(c, np.zeros(2, np.float32)), 1)
        else:
            time.sleep(1.0)  # present but silent (a rank that left would be reported at once)

    with pytest.raises(lg.CommTimeoutError):
        lg.run_threads(2, fn, timeout=0.3)


@pytest.mark.parametrize("what", ["size", "dtype", "op", "call"])
def test_mismatch_between_ranks_raises_in_every_rank(what):
    seen = []

    def fn(c):
        n = 8 if (what == "size" and c.rank == 1) else 4
        dt = lg.bf16 if (what == "dtype" and c.rank == 1) else lg.fp32
        t = tensor(c, np.ones(n, np.float32), dt)
        try:
            if what == "call" and c.rank == 1:
                c.barrier()
            else:
                c.all_reduce(t, "max" if (what == "op" and c.rank == 1) else "sum")
        except ValueError as exc:
            seen.append((c.rank, str(exc)))
            raise

    with pytest.raises(ValueError, match="ranks disagree"):
        lg.run_threads(3, fn, timeout=5)
    assert sorted(r for r, _ in seen) == [0, 1, 2]
    assert len({m for _, m in seen}) == 1


def test_recv_size_mismatch():
    def fn(c):
        if c.rank == 0:
            c.send(tensor(c, np.ones(3, np.float32)), 1)
        else:
            c.recv(tensor(c, np.ones(4, np.float32)), 0)

    with pytest.raises(ValueError, match="rank 0 sent 3 x fp32"):
        lg.run_threads(2, fn, timeout=5)


def make_comms(world: int, timeout: float = 5.0):
    coll = ThreadCollective(world, timeout)
    return [HostCommunicator(r, world, coll, lg.HostDevice()) for r in range(world)]


def test_argument_checks_raise_before_communicating():
    (c, _other) = make_comms(2)  # the peer never participates: a check that communicated would hang
    t = tensor(c, np.ones(5, np.float32))
    with pytest.raises(ValueError, match=r"'t' of shape \(5,\).*world 2"):
        c.reduce_scatter(t)
    with pytest.raises(ValueError, match="world 2"):
        c.all_gather(t)
    with pytest.raises(ValueError, match="world 2"):
        c.all_to_all(t)
    with pytest.raises(ValueError, match="op must be"):
        c.all_reduce(t, "prod")
    with pytest.raises(ValueError, match="op must be"):
        c.reduce_scatter(tensor(c, np.ones(4, np.float32)), "max")
    with pytest.raises(ValueError, match="peer 2"):
        c.send(t, 2)
    with pytest.raises(ValueError, match="peer -1"):
        c.recv(t, -1)
    foreign = lg.from_numpy(np.ones(4, np.float32), lg.HostDevice())
    with pytest.raises(ValueError, match="lives on"):
        c.all_reduce(foreign)
    with pytest.raises(TypeError):
        c.all_reduce(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="must hold"):
        c.all_gather(tensor(c, np.ones(2, np.float32)), out=tensor(c, np.ones(3, np.float32)))
    with pytest.raises(TypeError, match="dtype"):
        c.all_gather(tensor(c, np.ones(2, np.float32)), out=tensor(c, np.ones(4, np.float32), lg.bf16))
    with pytest.raises(TypeError):
        c.all_reduce(t, stream="nope")
    closed = tensor(c, np.ones(4, np.float32))
    closed.close()
    with pytest.raises(lg.ClosedError):
        c.all_reduce(closed)
    with pytest.raises(ValueError, match="inside comm.group"):
        with c.group():
            c.all_to_all(tensor(c, np.ones(4, np.float32)))
    assert not c.aborted  # nothing was scheduled: the group failed cleanly
    with pytest.raises(ValueError, match="nest"):
        with c.group():
            with c.group():
                pass


def test_world1_everything_is_local():
    (c,) = make_comms(1)
    t = tensor(c, np.arange(4, dtype=np.float32))
    c.reduce_scatter(t, "avg")
    c.all_gather(t)
    c.all_reduce(t, "max")
    c.all_to_all(t)
    np.testing.assert_array_equal(t.numpy(), np.arange(4, dtype=np.float32))
    assert c.host_allgather(b"abc") == [b"abc"]
    assert c.all_to_all_skip() == 0
    with c:
        pass
    with pytest.raises(lg.ClosedError):
        c.barrier()


def test_abort_from_another_thread_wakes_waiter():
    c0, c1 = make_comms(2, timeout=10)
    threading.Timer(0.2, c1.abort).start()
    t0 = time.monotonic()
    with pytest.raises(lg.CommAbortedError, match="rank 1 aborted"):
        c0.barrier()
    assert time.monotonic() - t0 < 3
    with pytest.raises(lg.CommAbortedError):
        c0.all_reduce(tensor(c0, np.ones(2, np.float32)))


def test_exception_inside_group_after_scheduling_aborts():
    c0, _c1 = make_comms(2)
    with pytest.raises(KeyError):
        with c0.group():
            c0.send(tensor(c0, np.ones(2, np.float32)), 1)
            raise KeyError("user error")
    assert c0.aborted


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_to_all_many_equals_one_call_per_buffer(world: int) -> None:
    """Several buffers in one schedule land exactly where separate all_to_all calls put them."""
    shapes = [(world * 3,), (world * 2, 5), (world,)]

    def fill(rank: int, i: int, shape: tuple[int, ...]) -> np.ndarray:
        return (np.arange(int(np.prod(shape)), dtype=np.float32) + 1000 * rank + 100 * i).reshape(shape)

    def job(comm: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
        dev = comm.device
        many = [lg.from_numpy(fill(comm.rank, i, s), dev, name=f"m{i}") for i, s in enumerate(shapes)]
        one = [lg.from_numpy(fill(comm.rank, i, s), dev, name=f"o{i}") for i, s in enumerate(shapes)]
        comm.all_to_all_many(many)
        for t in one:
            comm.all_to_all(t)
        return [t.numpy().copy() for t in many], [t.numpy().copy() for t in one]

    for many, one in lg.run_threads(world, job):
        for a, b in zip(many, one):
            assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="divisible"):
        lg.run_threads(2, lambda c: c.all_to_all_many([c.device.alloc(3, lg.fp32, name="odd")]))


# ---- timeouts: None = the default, positive seconds, inf = no limit; the rest rejected up front ----
@pytest.mark.timeout(30)
def test_infinite_timeout_waits_for_a_late_rank():
    def fn(c):
        if c.rank == 1:
            time.sleep(0.3)
        t = tensor(c, np.full(2, c.rank + 1.0, np.float32))
        c.all_reduce(t)
        c.wait(timeout=float("inf"))
        return t.numpy().tolist()

    assert lg.run_threads(2, fn, timeout=float("inf")) == [[3.0, 3.0]] * 2
    c0, c1 = make_comms(2, timeout=float("inf"))
    assert c0.timeout == float("inf")
    threading.Timer(0.2, c1.send, (tensor(c1, np.ones(2, np.float32)), 0)).start()
    got = tensor(c0, np.zeros(2, np.float32))
    c0.recv(got, 1)
    assert got.numpy().tolist() == [1.0, 1.0]


BAD_TIMEOUTS = [(float("nan"), ValueError), (-1.0, ValueError), (0, ValueError), (-float("inf"), ValueError),
                (True, TypeError), ("5", TypeError), ([1], TypeError)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad,exc", BAD_TIMEOUTS)
def test_bad_timeout_is_rejected_before_any_work(bad, exc):
    with pytest.raises(exc, match="timeout"):
        ThreadCollective(2, bad)
    coll = ThreadCollective(2, 5)
    with pytest.raises(exc, match="timeout"):
        HostCommunicator(0, 2, coll, lg.HostDevice(), timeout=bad)
    ran = []
    with pytest.raises(exc, match="timeout"):
        lg.run_threads(2, ran.append, timeout=bad)
    assert not ran
    (c,) = make_comms(1)
    with pytest.raises(exc, match="timeout"):
        c.wait(timeout=bad)


def test_timeout_none_is_the_default():
    from lowgrad.base.timeouts import DEFAULT_TIMEOUT, check_timeout

    assert ThreadCollective(2, None).timeout == DEFAULT_TIMEOUT
    assert make_comms(1, timeout=2)[0].timeout == 2.0  # None on the communicator: the collective's
    assert check_timeout(None, 7.0) == 7.0 and check_timeout(np.float32(0.5)) == 0.5 and check_timeout(3) == 3.0


# ---- a rank that leaves (close()) is reported to the ranks waiting for it, at once ----------------
@pytest.mark.timeout(30)
def test_peers_waiting_for_a_rank_that_closed_fail_at_once():
    def fn(c):
        if c.rank == 2:
            time.sleep(0.3)  # the others are already waiting when run_threads closes this rank
            return
        c.all_reduce(tensor(c, np.ones(4, np.float32)))

    t0 = time.monotonic()
    with pytest.raises(lg.CommAbortedError, match=r"rank\(s\) \[2\], which left the communicator"):
        lg.run_threads(3, fn, timeout=20)
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_a_rank_arriving_after_its_peer_closed_fails_at_once():
    c0, c1 = make_comms(2, timeout=20)
    c1.close()
    t0 = time.monotonic()
    with pytest.raises(lg.CommAbortedError, match=r"\[1\], which left"):
        c0.barrier()
    assert time.monotonic() - t0 < 2
    with pytest.raises(lg.CommAbortedError):  # the collective is broken for good, as after abort()
        c0.host_allgather(b"x")
    c1.close()  # idempotent
    with pytest.raises(lg.ClosedError):
        c1.barrier()


@pytest.mark.timeout(30)
def test_messages_sent_before_close_are_still_delivered():
    c0, c1 = make_comms(2, timeout=20)
    c0.send(tensor(c0, np.arange(3, dtype=np.float32)), 1)
    c0.close()
    got = tensor(c1, np.zeros(3, np.float32))
    c1.recv(got, 0)
    assert got.numpy().tolist() == [0.0, 1.0, 2.0]
    t0 = time.monotonic()
    with pytest.raises(lg.CommAbortedError, match=r"a message of rank\(s\) \[0\], which left"):
        c1.recv(got, 0)
    assert time.monotonic() - t0 < 2
