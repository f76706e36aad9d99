"""The NCCL communicator without a GPU: under run_threads its AbortEvent carries which rank failed
and why, and every call of an aborted rank raises that (the GPU half:
tests/test_cuda_communicator_gpu.py::test_run_threads_cuda_rank_failure_aborts_others); the
watchdog's reason reaches every call the same way; LOWGRAD_NCCL_BLOCKING and ``blocking=`` are read
by one rule; ``split`` refuses a bad color or key before any NCCL call."""
from __future__ import annotations

from typing import Any

import pytest

import lowgrad as lg
from lowgrad.base.errors import NcclError
from lowgrad.cuda import communicator as cuda_comm
from lowgrad.cuda.communicator import Communicator, blocking_mode
from lowgrad.runtime.threads import AbortEvent
from lowgrad.runtime.watchdog import Watchdog

REASON = "rank 1 failed: RuntimeError: boom; the communicator was aborted"


def _aborted(abort_event: object) -> Communicator:
    """A Communicator's state after abort(), without NCCL (nothing here touches the handle)."""
    c = object.__new__(Communicator)
    c.rank, c.world, c._state, c._group_depth, c._group = 0, 2, "aborted", 0, None
    c._abort_event = abort_event  # type: ignore[assignment]
    c._wd = None
    return c


def test_an_aborted_rank_raises_the_reason_run_threads_gave() -> None:
    ev = AbortEvent()
    ev.abort(REASON)
    with pytest.raises(lg.CommAbortedError) as info:
        _aborted(ev)._check_open("all_reduce")
    assert str(info.value) == REASON


@pytest.mark.parametrize("ev", [None, AbortEvent()], ids=["no event", "event not set"])
def test_without_a_reason_the_message_is_the_generic_one(ev: AbortEvent | None) -> None:
    with pytest.raises(lg.CommAbortedError, match="communicator rank 0 was aborted"):
        _aborted(ev)._check_open("all_reduce")


class _Marker:
    def record(self, stream: Any) -> None:
        pass

    def query(self) -> bool:
        return False


def test_an_aborted_rank_raises_the_watchdogs_reason_in_every_call() -> None:
    c = _aborted(None)
    c._wd = Watchdog("rank 0 of 2", 5.0, [_Marker()], lambda: None, lambda exc: None, start=False)
    c._wd.fail(lg.CommTimeoutError("rank 0 of 2: a collective queued 5 s ago has not completed"))
    for _ in range(2):
        with pytest.raises(lg.CommTimeoutError, match="has not completed"):
            c._check_open("all_reduce")
    # a call that NCCL failed because the watchdog aborted it raises the watchdog's reason
    err = NcclError("ncclAllReduce", 3, "ncclInternalError", "internal error", "")
    assert isinstance(c._why(err), lg.CommTimeoutError)
    c._state = "open"
    assert c._why(err) is err  # not aborted: NCCL's own error


def test_the_run_threads_reason_wins_over_the_watchdogs() -> None:
    ev = AbortEvent()
    ev.abort(REASON)
    c = _aborted(ev)
    c._wd = Watchdog("rank 0 of 2", 5.0, [_Marker()], lambda: None, lambda exc: None, start=False)
    c._wd.fail(lg.CommTimeoutError("late"))
    with pytest.raises(lg.CommAbortedError, match="^rank 1 failed"):
        c._check_open("all_reduce")


@pytest.mark.parametrize("env, want", [(None, cuda_comm.DEFAULT_BLOCKING), ("", cuda_comm.DEFAULT_BLOCKING),
                                       ("1", True), (" 1 ", True), ("0", False), (" 0", False)])
def test_blocking_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch, env: str | None, want: bool) -> None:
    if env is None:
        monkeypatch.delenv(cuda_comm.BLOCKING_ENV, raising=False)
    else:
        monkeypatch.setenv(cuda_comm.BLOCKING_ENV, env)
    assert blocking_mode() is want
    assert blocking_mode(True) is True and blocking_mode(False) is False  # the argument wins


@pytest.mark.parametrize("env", ["yes", "2", "true"])
def test_a_bad_environment_value_is_refused(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    monkeypatch.setenv(cuda_comm.BLOCKING_ENV, env)
    with pytest.raises(ValueError, match="LOWGRAD_NCCL_BLOCKING must be 1"):
        blocking_mode()


@pytest.mark.parametrize("bad", [1, "1", 0.0])
def test_a_bad_blocking_argument_is_refused(bad: Any) -> None:
    with pytest.raises(TypeError, match="blocking must be True, False or None"):
        blocking_mode(bad)


def _open_stand_in() -> Communicator:
    """An open Communicator whose every NCCL touch fails the test."""
    c = _aborted(None)
    c._state = "open"

    def no_nccl(*_: Any) -> int:
        raise AssertionError("split reached NCCL with a bad argument")
    c._split_handle = no_nccl  # type: ignore[method-assign]
    return c


@pytest.mark.parametrize("color, key, exc, match", [
    (-1, None, ValueError, r"color must be in \[0, 2\*\*31\)"),
    (2**31, None, ValueError, r"color must be in \[0, 2\*\*31\)"),
    (True, None, TypeError, "color"),
    (1.0, None, TypeError, "color"),
    ("0", None, TypeError, "color"),
    (0, 2**31, ValueError, r"key must be in \[-2\*\*31, 2\*\*31\)"),
    (0, -2**31 - 1, ValueError, "key must be in"),
    (0, 1.5, TypeError, "key"),
    (0, False, TypeError, "key"),
])
def test_split_refuses_bad_arguments_before_any_nccl_call(color: Any, key: Any, exc: type, match: str) -> None:
    c = _open_stand_in()
    with pytest.raises(exc, match=match):
        c.split(color, key)
    assert not c.closed


def test_split_of_a_closed_or_aborted_communicator_is_refused() -> None:
    c = _open_stand_in()
    c._state = "aborted"
    with pytest.raises(lg.CommAbortedError):
        c.split(0)
    c._state = "closed"
    with pytest.raises(lg.ClosedError):
        c.split(0)
