"""The NCCL communicator's blocking mode on the CPU: the real ``Communicator`` and ``Watchdog``
against a stand-in of the NCCL binding (``lowgrad.cuda.nccl``'s functions) and a device whose
events complete only when the test (or an abort, as NCCL's kernels exit) says so. What it checks
is lowgrad's logic around NCCL: a collective that never completes or a call stuck in the host
is aborted within the timeout and its reason reaches every later call and wait; an asynchronous
error and run_threads' AbortEvent surface; nothing completed is aborted; no thread is left. What
NCCL itself does (that ncclCommAbort ends a call blocked in the host) is the GPU tests' part
(tests/test_cuda_communicator_faults_gpu.py)."""
from __future__ import annotations

import ctypes
import gc
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers import watchdog_threads

import lowgrad as lg
from lowgrad.base.errors import NcclError
from lowgrad.buffers import capture, release
from lowgrad.cuda import communicator as cuda_comm
from lowgrad.host.device import HostDevice
from lowgrad.runtime.threads import AbortEvent

TIMEOUT = 0.5
MARGIN = 0.5  # the watchdog's round (<= 50 ms) and a loaded 2-core machine


class Event:
    """A CUDA event's stand-in: incomplete from its record until the fake NCCL completes it."""

    def __init__(self, nccl: FakeNccl) -> None:
        self.nccl, self.done = nccl, True
        nccl.events.append(self)

    def record(self, stream: Any = None) -> Event:
        self.done = self.nccl.completes
        self.nccl.records += 1
        return self

    def query(self) -> bool:
        return self.done


class Device(HostDevice):
    """The host device, seen by the communicator as a CUDA one, with stand-in events."""

    backend = "cuda"

    def __init__(self, nccl: FakeNccl) -> None:
        super().__init__("fake-gpu")
        self.nccl = nccl

    def event(self, timing: bool = False, name: str = "") -> Any:
        return Event(self.nccl)

    def relax_thread_capture_mode(self) -> None:
        """The CUDA device's hook, which the watchdog's thread runs first: noted per thread."""
        self.nccl.relaxed_threads.append(threading.current_thread())


class FakeNccl:
    """What lowgrad.cuda.communicator calls of lowgrad.cuda.nccl, with knobs, behaving as NCCL
    documents its communicators (not only its happy path):

    - a call on a *non-blocking* communicator (init, split, finalize, a collective, a group's
      end) may return ncclInProgress: here every one does, and the communicator's
      ``ncclCommGetAsyncError`` answers ncclInProgress ``polls`` more times before ncclSuccess;
    - until then any other call on it (ncclCommAbort excepted) fails as NCCL fails it:
      ncclInvalidArgument, last error "Attempt to use communicator before the previous operation
      returned ncclSuccess";
    - a split of a non-blocking communicator returns ncclSuccess while it is still in progress
      (NCCL 2.28 does: its group's ncclInProgress is not passed on), and hands out its child only
      once it has completed: the ``ncclComm_t`` cell stays NULL until the parent's state is
      ncclSuccess (a non-blocking child then initialises for ``polls`` more polls of its own),
      and a call on a NULL communicator fails ("comm argument is NULL");
    - a call on a communicator already destroyed or aborted is a use after free: the test fails.
    A blocking communicator's calls return complete (ncclSuccess)."""

    SUCCESS, IN_PROGRESS, UNIQUE_ID_BYTES = 0, 7, 128

    def __init__(self, world: int = 2, rank: int = 0, polls: int = 2) -> None:
        self.world, self.rank, self.polls = world, rank, polls
        self.completes = True  # the device work of each call completes at once
        self.block_host = False  # the next collective blocks the host until an abort
        self.async_error = 0
        self.events: list[Event] = []
        self.records = 0
        self.calls: list[tuple[str, Any]] = []
        self.relaxed_threads: list[threading.Thread] = []
        self.freed_queries = 0
        self.watchdogs_at_abort: list[int] = []  # watchdog threads alive at each ncclCommAbort
        self.aborted: set[int] = set()
        self.destroyed: set[int] = set()
        self.abort_flag = threading.Event()
        self.blocking: dict[int, bool] = {}  # handle -> made blocking
        self.pending: dict[int, int] = {}  # handle -> polls that still answer ncclInProgress
        self.on_done: dict[int, Any] = {}  # handle -> what completes with its pending operation
        self.grouped: set[int] = set()  # communicators with calls in the open group
        self.group_depth = 0
        self._next = 100
        self.lock = threading.Lock()

    def _handle(self, blocking: bool) -> int:
        self._next += 1
        self.blocking[self._next] = blocking
        return self._next

    def _use(self, call: str, comm: int) -> None:
        """NCCL's checks at the start of a call on ``comm``."""
        if not comm:
            raise NcclError(call, 4, "ncclInvalidArgument", "invalid argument", f"{call} : comm argument is NULL")
        assert comm not in self.destroyed, f"{call} on a destroyed communicator (a use after free)"
        assert comm not in self.aborted or call == "ncclGroupEnd", f"{call} on an aborted communicator"
        if self.pending.get(comm):
            raise NcclError(call, 4, "ncclInvalidArgument", "invalid argument",
                            "Attempt to use communicator before the previous operation returned ncclSuccess")

    def _start(self, comm: int, then: Any = None) -> int:
        """The operation just issued on ``comm``: complete now (blocking) or in progress."""
        if self.blocking[comm]:
            if then is not None:
                then()
            return self.SUCCESS
        self.pending[comm] = self.polls
        if then is not None:
            self.on_done[comm] = then
        return self.IN_PROGRESS

    # the binding's surface
    def lib(self) -> None:
        return None

    def version(self) -> tuple[int, int, int]:
        return (2, 28, 9)

    def error(self, call: str, code: int, comm: int | None = None) -> NcclError:
        return NcclError(call, code, f"code{code}", "stand-in error", "")

    def comm_init_rank(self, world: int, uid: bytes, rank: int, blocking: bool = False) -> tuple[int, int]:
        h = self._handle(blocking)
        self.calls.append(("init", (h, blocking)))
        return h, self._start(h)

    def comm_split(self, comm: int, color: int, key: int, blocking: bool) -> tuple[ctypes.c_void_p, int]:
        self._use("ncclCommSplit", comm)
        h = self._handle(blocking)
        self.calls.append(("split", (comm, h, color, key, blocking)))
        cell = ctypes.c_void_p()

        def hand_out() -> None:
            cell.value = h
            if not blocking:
                self.pending[h] = self.polls  # the child's own initialisation
        self._start(comm, hand_out)
        return cell, self.SUCCESS  # NCCL 2.28 on an H100: ncclSuccess, the split still in progress

    def comm_rank_world(self, comm: int) -> tuple[int, int]:
        self._use("ncclCommUserRank", comm)
        return self.rank, self.world

    def comm_get_async_error(self, comm: int) -> int:
        if not comm:
            raise NcclError("ncclCommGetAsyncError", 4, "ncclInvalidArgument", "invalid argument",
                            "CommGetAsyncError : comm argument is NULL")
        if comm in self.aborted or comm in self.destroyed:
            self.freed_queries += 1  # a use after free on a real NCCL
        with self.lock:  # the watchdog's thread polls too
            left = self.pending.get(comm, 0)
            if left:
                self.pending[comm] = left - 1
                if left == 1 and comm in self.on_done:
                    self.on_done.pop(comm)()
                return self.IN_PROGRESS
        return self.async_error

    def comm_finalize(self, comm: int) -> int:
        self._use("ncclCommFinalize", comm)
        self.calls.append(("finalize", comm))
        return self._start(comm)

    def comm_destroy(self, comm: int) -> None:
        self._use("ncclCommDestroy", comm)
        self.calls.append(("destroy", comm))
        self.destroyed.add(comm)

    def comm_abort(self, comm: int) -> None:
        assert comm not in self.destroyed, "ncclCommAbort on a destroyed communicator (a use after free)"
        self.calls.append(("abort", comm))
        self.watchdogs_at_abort.append(len([t for t in watchdog_threads() if t is not threading.current_thread()]))
        self.aborted.add(comm)
        self.pending.pop(comm, None)
        self.abort_flag.set()
        for e in self.events:  # NCCL's kernels exit
            e.done = True

    def group_start(self) -> None:
        self.calls.append(("ncclGroupStart", None))
        self.group_depth += 1

    def group_end(self) -> int:
        self.group_depth -= 1
        comms, self.grouped = self.grouped, set()
        rc = self._collective("ncclGroupEnd", None)
        for comm in comms:  # a group of non-blocking communicators is in progress on each
            if comm not in self.aborted and self._start(comm):
                rc = self.IN_PROGRESS
        return rc

    def _collective(self, name: str, comm: int | None) -> int:
        if comm is not None:
            self._use(name, comm)
        self.calls.append((name, comm))
        if self.block_host:  # NCCL's lazy connection setup, waiting for a peer: only an abort ends it
            self.block_host = False
            if not self.abort_flag.wait(30):
                raise AssertionError("the blocked call was never aborted")
            raise NcclError(name, 3, "ncclInternalError", "aborted", "")
        if comm is None:
            return self.SUCCESS
        if self.group_depth:  # queued into the open group: its end launches it
            self.grouped.add(comm)
            return self.SUCCESS
        return self._start(comm)

    def all_reduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> int:
        return self._collective("ncclAllReduce", comm)

    def reduce_scatter(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> int:
        return self._collective("ncclReduceScatter", comm)

    def all_gather(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> int:
        return self._collective("ncclAllGather", comm)

    def send(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> int:
        return self._collective("ncclSend", comm)

    def recv(self, buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> int:
        return self._collective("ncclRecv", comm)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNccl:
    f = FakeNccl()
    monkeypatch.setattr(cuda_comm, "nccl", f)
    return f


def make(fake: FakeNccl, blocking: bool = True, world: int = 2, **kw: Any) -> tuple[Any, Device, Any]:
    fake.world = world
    dev = Device(fake)
    comm = cuda_comm.Communicator(0, world, bytes(128), dev, timeout=TIMEOUT, blocking=blocking, **kw)
    t = lg.from_numpy(np.ones(8, np.float32), dev, name="t")
    return comm, dev, t


def wait_until(cond: Any, limit: float = 10.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "condition not reached"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_blocking_init_splits_the_polled_communicator_and_retires_it(fake: FakeNccl) -> None:
    comm, _, _ = make(fake)
    (_, (parent, blocking)), (_, (comm_of, child, color, key, child_blocking)) = fake.calls[:2]
    assert not blocking and comm_of == parent and child_blocking and (color, key) == (0, 0)
    assert fake.calls[2:] == [("finalize", parent), ("destroy", parent)]
    assert comm.handle == child and comm.blocking and len(watchdog_threads()) == 1
    comm.close()
    assert fake.calls[-2:] == [("finalize", child), ("destroy", child)] and not fake.aborted
    assert not watchdog_threads()
    comm.close()  # twice: nothing more
    assert fake.calls[-1] == ("destroy", child)


def test_nonblocking_mode_has_no_watchdog_and_polls(fake: FakeNccl) -> None:
    comm, _, t = make(fake, blocking=False)
    assert not watchdog_threads() and [c[0] for c in fake.calls] == ["init"]
    comm.all_reduce(t)
    comm.wait()
    assert fake.records == 0
    comm.close()


def test_the_stand_in_refuses_what_nccl_refuses(fake: FakeNccl) -> None:
    """The stand-in itself: a call before the previous one completed, a NULL communicator, a
    split's child before its parent completed, as NCCL 2.28 answered on an H100."""
    h, rc = fake.comm_init_rank(2, bytes(128), 0)
    assert rc == fake.IN_PROGRESS
    with pytest.raises(NcclError, match="before the previous operation returned ncclSuccess"):
        fake.comm_finalize(h)
    while fake.comm_get_async_error(h) == fake.IN_PROGRESS:
        pass
    cell, rc = fake.comm_split(h, 0, 0, False)
    assert rc == fake.SUCCESS and cell.value is None  # as NCCL 2.28: "success", still in progress
    with pytest.raises(NcclError, match="comm argument is NULL"):
        fake.comm_rank_world(cell.value or 0)
    while fake.comm_get_async_error(h) == fake.IN_PROGRESS:
        pass
    assert cell.value and fake.comm_get_async_error(cell.value) == fake.IN_PROGRESS  # its own init


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_every_call_waits_for_the_previous_one_to_complete(fake: FakeNccl, blocking: bool) -> None:
    """Non-blocking: each collective, group and split returns ncclInProgress and the next call
    comes only once the communicator reports ncclSuccess; a split's child is used only once it
    exists and is ready; close finalizes, waits, then destroys (each step refused otherwise)."""
    comm, _, t = make(fake, blocking=blocking)
    traffic(comm, t, 3)
    for _ in range(3):
        comm.all_to_all_many([t])
    fake.rank, fake.world = 0, 1
    child = comm.split(4)
    assert child.handle and not fake.pending.get(child.handle)
    child.all_reduce(t)
    child.close()
    comm.barrier()
    comm.close()
    assert fake.destroyed >= {comm.handle, child.handle} and not fake.aborted


def test_a_split_that_never_completes_times_out_and_keeps_nccls_cell(fake: FakeNccl) -> None:
    comm, _, _ = make(fake, blocking=False)
    fake.polls = 10**9
    cells = len(cuda_comm._ABANDONED_CELLS)
    t0 = time.monotonic()
    with pytest.raises(lg.CommTimeoutError, match="ncclCommSplit"):
        comm.split(1)
    assert TIMEOUT <= time.monotonic() - t0 < TIMEOUT + MARGIN
    assert comm.aborted and fake.aborted == {comm.handle}
    assert len(cuda_comm._ABANDONED_CELLS) == cells + 1  # NCCL's thread may still write it
    comm.close()


def test_a_collective_that_never_completes_is_aborted_within_the_timeout(fake: FakeNccl) -> None:
    comm, _, t = make(fake)
    fake.completes = False  # a peer that never issues its half
    t0 = time.monotonic()
    comm.all_reduce(t)  # returns: the work is queued
    assert fake.records == 1
    wait_until(lambda: comm.aborted)
    assert TIMEOUT <= time.monotonic() - t0 < TIMEOUT + MARGIN
    assert fake.aborted == {comm.handle}
    for call in (lambda: comm.all_reduce(t), lambda: comm.wait(), comm.barrier):
        with pytest.raises(lg.CommTimeoutError, match="has not completed within 0.5 s"):
            call()
    comm.close()
    assert not watchdog_threads()


def traffic(comm: Any, t: Any, rounds: int) -> None:
    """``rounds`` of an all-reduce, a reduce-scatter and a group of a send and a receive."""
    for _ in range(rounds):
        comm.all_reduce(t)
        comm.reduce_scatter(t)
        with comm.group():
            comm.send(t, 1)
            comm.recv(t, 1)


def test_a_completed_collective_is_never_aborted(fake: FakeNccl) -> None:
    comm, _, t = make(fake)
    traffic(comm, t, 5)
    time.sleep(TIMEOUT + MARGIN)
    assert not comm.aborted and not fake.aborted
    comm.all_reduce(t)
    comm.close()
    assert not fake.aborted


def test_a_call_blocked_in_the_host_is_aborted_and_raises_the_reason(fake: FakeNccl) -> None:
    comm, _, t = make(fake)
    fake.block_host = True
    t0 = time.monotonic()
    with pytest.raises(lg.CommTimeoutError, match="blocked the host for more than 0.5 s"):
        comm.all_reduce(t)  # holds the communicator's lock while NCCL blocks: the abort cannot wait for it
    assert TIMEOUT <= time.monotonic() - t0 < TIMEOUT + MARGIN + cuda_comm._LOCK_WAIT
    assert comm.aborted
    with pytest.raises(lg.CommTimeoutError, match="blocked the host"):
        comm.wait()
    comm.close()
    assert not watchdog_threads()


def test_an_asynchronous_error_surfaces(fake: FakeNccl) -> None:
    comm, _, t = make(fake)
    fake.async_error = 6  # ncclRemoteError: a peer died
    wait_until(lambda: comm.aborted, TIMEOUT + MARGIN)
    with pytest.raises(NcclError, match="ncclCommGetAsyncError"):
        comm.all_reduce(t)
    comm.close()


def test_the_abort_event_and_its_reason_reach_the_calls(fake: FakeNccl) -> None:
    ev = AbortEvent()
    comm, _, t = make(fake, abort_event=ev)
    ev.abort("rank 1 failed: RuntimeError: boom; the communicator was aborted")
    wait_until(lambda: comm.aborted, 1.0)
    with pytest.raises(lg.CommAbortedError, match="^rank 1 failed: RuntimeError: boom"):
        comm.all_reduce(t)
    comm.close()


def test_world_one_records_no_marker(fake: FakeNccl) -> None:
    comm, _, t = make(fake, world=1)
    fake.completes = False
    for _ in range(3):
        comm.all_reduce(t)
    assert fake.records == 0
    time.sleep(TIMEOUT + MARGIN)
    assert not comm.aborted
    comm.close()


def test_abort_from_another_thread_ends_the_watchdog(fake: FakeNccl) -> None:
    comm, _, t = make(fake)
    threading.Thread(target=comm.abort).start()
    wait_until(lambda: not watchdog_threads())
    comm.abort()
    with pytest.raises(lg.CommAbortedError):
        comm.all_reduce(t)
    comm.close()


def test_split_makes_a_child_with_its_own_watchdog(fake: FakeNccl) -> None:
    comm, dev, t = make(fake)
    with pytest.raises(ValueError, match="color"):
        comm.split(-1)
    n = len(fake.calls)
    fake.rank, fake.world = 0, 1
    child = comm.split(5, key=3)
    (_, (parent, h, color, key, blocking)), = fake.calls[n:]
    assert (parent, color, key, blocking) == (comm.handle, 5, 3, True)
    assert (child.handle, child.rank, child.world, child.device, child.timeout) == (h, 0, 1, dev, TIMEOUT)
    assert len(watchdog_threads()) == 2
    child.close()
    assert len(watchdog_threads()) == 1 and not comm.closed
    comm.all_reduce(t)
    comm.close()
    assert not watchdog_threads()


def test_an_abort_of_the_parent_reaches_what_was_split_from_it(fake: FakeNccl) -> None:
    """As on the host backend and the loopback: a failure that aborts a communicator aborts its
    split children too (their handles, their watchdogs), whoever aborted it."""
    comm, _, t = make(fake)
    fake.rank, fake.world = 0, 1
    child, other = comm.split(1), comm.split(2)
    other.close()  # a closed child is left alone
    comm.abort()
    assert child.handle in fake.aborted and other.handle not in fake.aborted
    with pytest.raises(lg.CommAbortedError):
        child.all_reduce(t)
    wait_until(lambda: not watchdog_threads())


def test_a_communicator_collected_unclosed_ends_its_watchdog(fake: FakeNccl) -> None:
    comm, _, _ = make(fake)
    handle = comm.handle
    del comm
    gc.collect()
    release.drain()  # the queued release: the watchdog is told to end, the handle aborted
    assert handle in fake.aborted
    wait_until(lambda: not watchdog_threads())


def test_an_exception_right_after_the_c_call_closes_the_host_bracket(fake: FakeNccl) -> None:
    """A KeyboardInterrupt landing right after NCCL returned must not leave the call 'blocked in
    the host' for the watchdog (which would abort a healthy communicator later)."""
    comm, _, t = make(fake)
    real = fake.all_reduce

    def interrupted(*a: Any) -> int:
        real(*a)
        raise KeyboardInterrupt
    fake.all_reduce = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        comm.all_reduce(t)
    fake.all_reduce = real  # type: ignore[method-assign]
    time.sleep(TIMEOUT + MARGIN)
    assert not comm.aborted and not fake.aborted
    comm.all_reduce(t)
    comm.close()


def test_an_abort_while_a_group_is_open_waits_for_its_group_end(fake: FakeNccl) -> None:
    """ncclGroupEnd of a group that holds calls of a freed communicator is a use after free: the
    watchdog only marks the communicator, the group's end runs ncclGroupEnd, then ncclCommAbort,
    and raises the reason."""
    comm, _, t = make(fake)
    with pytest.raises(NcclError, match="ncclCommGetAsyncError"):
        with comm.group():
            comm.send(t, 1)
            fake.async_error = 6  # a peer dies while this thread's group is open
            wait_until(lambda: comm.aborted, TIMEOUT + MARGIN)
            assert not fake.aborted  # marked only
            comm.recv(t, 1)  # raises the reason
    assert [c[0] for c in fake.calls[-4:]] == ["ncclGroupStart", "ncclSend", "ncclGroupEnd", "abort"]
    assert fake.aborted == {comm.handle}
    comm.close()
    assert not watchdog_threads()


def test_an_abort_marked_in_a_group_that_exits_cleanly_raises_there(fake: FakeNccl) -> None:
    comm, _, t = make(fake)
    with pytest.raises(lg.CommAbortedError):
        with comm.group():
            comm.send(t, 1)
            comm.abort()  # the issuing thread's own abort: the same deferral
            assert not fake.aborted
    assert [c[0] for c in fake.calls[-3:]] == ["ncclSend", "ncclGroupEnd", "abort"]
    comm.close()


def test_a_group_block_that_fails_after_a_marked_abort_keeps_its_exception(fake: FakeNccl) -> None:
    comm, _, t = make(fake)
    with pytest.raises(RuntimeError, match="^mine$"):
        with comm.group():
            comm.send(t, 1)
            comm.abort()
            raise RuntimeError("mine")
    assert [c[0] for c in fake.calls[-3:]] == ["ncclSend", "ncclGroupEnd", "abort"] and comm.aborted
    comm.close()


def test_a_group_end_that_blocks_after_a_marked_abort_is_aborted_at_once(fake: FakeNccl) -> None:
    """The deferred abort still bounds the group's ncclGroupEnd: when it blocks the host (a
    connection to the dead peer), ncclCommAbort comes after the lock wait and ends it."""
    comm, _, t = make(fake)
    t0 = time.monotonic()
    with pytest.raises(NcclError):
        with comm.group():
            comm.send(t, 1)
            fake.async_error = 6
            wait_until(lambda: comm.aborted, TIMEOUT + MARGIN)
            fake.block_host = True  # the group's end waits for the peer until an abort
    assert time.monotonic() - t0 < TIMEOUT + MARGIN + 2 * cuda_comm._LOCK_WAIT + 1
    assert fake.aborted == {comm.handle} and fake.calls[-1][0] == "abort"
    comm.close()
    assert not watchdog_threads()


def test_the_release_at_exit_stops_the_watchdog_before_the_abort(fake: FakeNccl) -> None:
    """At exit (release._at_exit) the queued release of a communicator still alive marks it
    aborted and joins its watchdog before ncclCommAbort: no query of the freed handle after."""
    comm, _, t = make(fake)
    f = comm._finalizer
    assert release._live.pop(f, False) is None  # what _at_exit does for what is still alive
    release._queue.put(f)
    release.drain()
    assert fake.aborted == {comm.handle} and fake.watchdogs_at_abort == [0]
    assert comm.aborted and not watchdog_threads()
    with pytest.raises(lg.CommAbortedError):
        comm.all_reduce(t)
    time.sleep(0.1)
    assert fake.freed_queries == 0
    comm.close()


def test_what_was_split_is_aborted_before_the_parent(fake: FakeNccl) -> None:
    """ncclCommAbort waits for work on the device's other streams: a child's kernel spinning on a
    dead peer would hold the parent's abort, so the children's handles go first."""
    comm, _, _ = make(fake)
    fake.rank, fake.world = 0, 1
    child = comm.split(1)
    comm.abort()
    assert [c[1] for c in fake.calls if c[0] == "abort"] == [child.handle, comm.handle]
    wait_until(lambda: not watchdog_threads())


def test_the_watchdog_thread_runs_the_devices_capture_mode_hook(fake: FakeNccl) -> None:
    comm, _, _ = make(fake)
    wait_until(lambda: fake.relaxed_threads)
    assert fake.relaxed_threads == [comm._wd._thread]
    comm.close()


class _Graph:
    """A lowgrad.Graph's stand-in for capture.begin: what a capture asks of it."""

    stream_handle = 0

    def keep(self, allocations: Any) -> None:
        pass


def test_another_threads_capture_does_not_stop_the_markers(fake: FakeNccl) -> None:
    """Ranks as threads of one process: rank 0's CUDA-graph capture must not stop the watchdog
    following rank 1's eager calls; this thread's own capture does (the replays run later)."""
    comm, _, t = make(fake)
    started, done = threading.Event(), threading.Event()

    def other_rank() -> None:
        g = _Graph()
        capture.begin(g)
        started.set()
        done.wait(10)
        capture.end(g)
    th = threading.Thread(target=other_rank)
    th.start()
    try:
        assert started.wait(10)
        before = fake.records
        comm.all_reduce(t)
        assert fake.records == before + 1
        g = _Graph()
        capture.begin(g)
        try:
            comm.all_reduce(t)
        finally:
            capture.end(g)
        assert fake.records == before + 1
    finally:
        done.set()
        th.join()
    comm.close()
