"""The watchdog's logic on the CPU (lowgrad/runtime/watchdog.py), against stand-ins for the CUDA event
(a marker), ncclCommGetAsyncError (poll), ncclCommAbort (abort) and the clock: what is late is
aborted within the timeout and a small margin, with one reason every waiter hears; what completed
never is; no thread is left behind."""
from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from helpers import watchdog_threads

from lowgrad.base.errors import CommAbortedError, CommTimeoutError
from lowgrad.runtime.watchdog import INTERVAL_MAX, Watchdog


class Marker:
    """A CUDA event's stand-in: incomplete from its record until ``done`` is set."""

    def __init__(self) -> None:
        self.done, self.records, self.stream = True, 0, None

    def record(self, stream: Any) -> None:
        self.done, self.stream = False, stream
        self.records += 1

    def query(self) -> bool:
        return self.done


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Target:
    """The communicator's stand-in: what poll returns, and the aborts it received."""

    def __init__(self) -> None:
        self.why: Exception | None = None
        self.aborts: list[Exception] = []
        self.aborted = threading.Event()

    def poll(self) -> Exception | None:
        return self.why

    def abort(self, exc: Exception) -> None:
        self.aborts.append(exc)
        self.aborted.set()


def raise_failure(wd: Watchdog) -> None:
    """What a waiter does with the watchdog (the communicator's ``_failure``): raise its error."""
    exc = wd.error()
    if exc is not None:
        raise exc


def make(n: int = 4, timeout: float = 10.0, start: bool = False, **kw: Any) -> tuple[Watchdog, list[Marker], Target,
                                                                                     Clock]:
    markers, target, clock = [Marker() for _ in range(n)], Target(), Clock()
    if start:
        kw.setdefault("interval", 0.01)
    else:
        kw["clock"] = clock
    wd = Watchdog("rank 0 of 2", timeout, markers, target.poll, kw.pop("abort", target.abort), start=start, **kw)
    return wd, markers, target, clock


def test_a_collective_that_never_completes_is_aborted_after_the_timeout_not_before() -> None:
    wd, markers, target, clock = make(timeout=10.0)
    wd.enter()
    wd.leave(stream=7)
    assert markers[0].stream == 7 and markers[0].records == 1
    clock.now += 9.9
    wd.tick()
    assert not target.aborts and wd.error() is None
    clock.now += 0.2
    wd.tick()
    wd.tick()
    assert len(target.aborts) == 1 and isinstance(target.aborts[0], CommTimeoutError)
    assert "rank 0 of 2" in str(target.aborts[0]) and "10 s" in str(target.aborts[0])
    with pytest.raises(CommTimeoutError, match="has not completed within 10 s"):
        raise_failure(wd)


def test_a_completed_collective_is_never_aborted() -> None:
    wd, markers, target, clock = make(timeout=1.0)
    for _ in range(10):  # more calls than markers: each completes before the next
        wd.enter()
        wd.leave(stream=1)
        next(m for m in markers if not m.done).done = True
        clock.now += 5.0
        wd.tick()
    assert not target.aborts
    raise_failure(wd)


def test_only_the_oldest_outstanding_call_counts() -> None:
    wd, markers, target, clock = make(timeout=10.0)
    wd.leave(stream=1)
    clock.now += 6
    wd.leave(stream=1)
    markers[0].done = True
    clock.now += 6  # the first would be late, but it completed; the second is 6 s old
    wd.tick()
    assert not target.aborts
    clock.now += 5
    wd.tick()
    assert len(target.aborts) == 1


def test_a_call_without_a_stream_records_nothing() -> None:
    wd, markers, target, clock = make()
    wd.enter()
    wd.leave()
    clock.now += 1e6
    wd.tick()
    assert not target.aborts and all(m.records == 0 for m in markers)


def test_a_full_ring_folds_into_the_newest_marker_and_refreshes_its_time() -> None:
    """A call folded into the newest marker is never aborted before its own timeout: the marker
    takes the folded call's time (it completes only after that call's work)."""
    wd, markers, target, clock = make(n=2, timeout=10.0)
    wd.leave(stream=1)
    clock.now += 1
    wd.leave(stream=1)
    clock.now += 8
    wd.leave(stream=2)  # full: the second marker is recorded again, its time now t=109
    assert markers[1].records == 2 and markers[1].stream == 2 and markers[0].records == 1
    markers[0].done = True
    clock.now += 2.5  # 11.5 s after the second call, 2.5 s after the folded one: within its time
    wd.tick()
    assert not target.aborts
    clock.now += 7.6  # 10.1 s after the folded call
    wd.tick()
    assert len(target.aborts) == 1


def test_on_start_runs_first_on_the_watchdogs_thread_and_its_failure_is_the_reason() -> None:
    ran: list[threading.Thread] = []
    wd, _, target, _ = make(timeout=float("inf"), start=True, on_start=lambda: ran.append(threading.current_thread()))
    deadline = time.monotonic() + 10
    while not ran and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ran == [wd._thread] and ran[0] is not threading.current_thread()
    wd.close()

    def refuse() -> None:
        raise RuntimeError("cuThreadExchangeStreamCaptureMode failed")
    wd, _, target, _ = make(timeout=float("inf"), start=True, on_start=refuse)
    assert target.aborted.wait(10)
    with pytest.raises(RuntimeError, match="cuThreadExchangeStreamCaptureMode"):
        raise_failure(wd)
    wd.close()
    assert not watchdog_threads()


def test_a_call_blocked_in_the_host_is_aborted_and_abort_unblocks_it() -> None:
    """NCCL's lazy connection setup blocks inside the call until the peer arrives; ncclCommAbort
    from the watchdog's thread is what lets it return."""
    target = Target()
    wd = Watchdog("rank 1 of 2", 0.3, [Marker()], target.poll, target.abort, interval=0.01)
    returned: list[float] = []

    def blocked_call() -> None:
        wd.enter()
        target.aborted.wait(10)  # the call returns once aborted
        wd.leave(stream=3)
        returned.append(time.monotonic())

    t0 = time.monotonic()
    caller = threading.Thread(target=blocked_call)
    caller.start()
    caller.join(10)
    assert returned and 0.3 <= returned[0] - t0 < 0.3 + 0.25
    assert isinstance(target.aborts[0], CommTimeoutError) and "blocked the host" in str(target.aborts[0])
    wd.close()


def test_the_thread_aborts_within_timeout_and_margin_and_every_waiter_hears_the_reason() -> None:
    timeout = 0.4
    wd, _, target, _ = make(timeout=timeout, start=True, interval=None)
    assert wd.interval <= INTERVAL_MAX
    heard: dict[int, tuple[type, str, float]] = {}

    def waiter(i: int) -> None:
        while True:
            try:
                raise_failure(wd)
            except Exception as exc:  # noqa: BLE001 - what the waiter heard
                heard[i] = (type(exc), str(exc), time.monotonic())
                return
            time.sleep(0.002)

    waiters = [threading.Thread(target=waiter, args=(i,)) for i in range(4)]
    for w in waiters:
        w.start()
    t0 = time.monotonic()
    wd.leave(stream=1)
    for w in waiters:
        w.join(10)
    assert len(heard) == 4
    assert len({(tp, msg) for tp, msg, _ in heard.values()}) == 1  # one reason, for everyone
    tp, msg, _ = heard[0]
    assert tp is CommTimeoutError and "never issued it" in msg
    late = max(t for _, _, t in heard.values()) - t0
    assert timeout <= late < timeout + INTERVAL_MAX + 0.2
    assert len(target.aborts) == 1
    wd.close()
    assert not watchdog_threads()


def test_poll_failure_is_the_reason_and_abort_runs_once() -> None:
    wd, _, target, _ = make()
    target.why = CommAbortedError("rank 1 failed: RuntimeError: boom; the communicator was aborted")
    for _ in range(3):
        wd.tick()
    assert len(target.aborts) == 1
    for _ in range(2):
        with pytest.raises(CommAbortedError, match="^rank 1 failed: RuntimeError: boom"):
            raise_failure(wd)


def test_an_error_with_its_own_constructor_reaches_each_waiter_as_its_own_instance() -> None:
    from lowgrad.base.errors import NcclError

    wd, _, _, _ = make()
    wd.fail(NcclError("ncclCommGetAsyncError", 6, "ncclRemoteError", "remote process exited", "peer gone"))
    got = [wd.error() for _ in range(2)]
    assert got[0] is not got[1]
    for e in got:
        assert isinstance(e, NcclError) and (e.code, e.name, e.last_error) == (6, "ncclRemoteError", "peer gone")
        assert str(e) == ("ncclCommGetAsyncError failed: ncclRemoteError (6): remote process exited "
                          "(last error: peer gone)")


def test_a_raising_poll_is_a_failure() -> None:
    wd, _, target, _ = make()

    def bad_poll() -> None:
        raise RuntimeError("ncclCommGetAsyncError: remote error")
    wd._poll = bad_poll  # type: ignore[method-assign]
    wd.tick()
    with pytest.raises(RuntimeError, match="remote error"):
        raise_failure(wd)
    assert len(target.aborts) == 1


def test_the_first_failure_wins() -> None:
    wd, _, target, _ = make()
    assert wd.fail(CommAbortedError("first"))
    assert not wd.fail(CommTimeoutError("second"))
    with pytest.raises(CommAbortedError, match="^first$"):
        raise_failure(wd)
    assert [str(e) for e in target.aborts] == ["first"]


def test_an_exception_in_abort_is_noted_and_the_failure_still_reaches_waiters() -> None:
    calls: list[Exception] = []

    def bad_abort(exc: Exception) -> None:
        calls.append(exc)
        raise OSError("ncclCommAbort failed")

    wd, _, _, _ = make(timeout=0.2, start=True, abort=bad_abort)
    wd.leave(stream=1)
    deadline = time.monotonic() + 10
    while wd.error() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(CommTimeoutError, match=r"aborting raised OSError: ncclCommAbort failed"):
        raise_failure(wd)
    assert len(calls) == 1
    wd._thread.join(5)  # type: ignore[union-attr]
    assert not wd._thread.is_alive()  # type: ignore[union-attr]  # aborted: the thread ended itself
    wd.close()


def test_close_twice_and_from_the_abort_callback_leaves_no_thread() -> None:
    holder: list[Watchdog] = []
    wd, _, _, _ = make(timeout=0.1, start=True, abort=lambda exc: holder[0].close())
    holder.append(wd)
    wd.leave(stream=1)
    deadline = time.monotonic() + 10
    while wd.error() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wd.error() is not None
    wd.close()
    wd.close()
    assert not watchdog_threads()


def test_close_of_a_healthy_watchdog_ends_its_thread_at_once() -> None:
    wd, _, target, _ = make(timeout=float("inf"), start=True)
    assert watchdog_threads()
    t0 = time.monotonic()
    wd.close()
    assert time.monotonic() - t0 < 1 and not watchdog_threads() and not target.aborts
    wd.close()


def test_an_infinite_timeout_never_times_out_but_still_polls() -> None:
    wd, _, target, clock = make(timeout=float("inf"))
    wd.enter()
    wd.leave(stream=1)
    wd.enter()
    clock.now += 1e12
    wd.tick()
    assert not target.aborts
    target.why = CommAbortedError("stop")
    wd.tick()
    assert len(target.aborts) == 1


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (float("nan"), ValueError), ("1", TypeError)])
def test_bad_arguments_are_refused(bad: Any, exc: type) -> None:
    with pytest.raises(exc, match="timeout"):
        Watchdog("x", bad, [Marker()], lambda: None, lambda e: None, start=False)
    with pytest.raises(ValueError, match="marker"):
        Watchdog("x", 1.0, [], lambda: None, lambda e: None, start=False)
