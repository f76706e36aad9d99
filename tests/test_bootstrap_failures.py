"""When one rank of ``run_threads`` fails, its peers are told which rank failed and why (host
backend, and the loopback through its CPU simulation), and ``run_threads`` raises the failing
rank's own exception with a note naming the rank."""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from loopback_sim import patch, run

import lowgrad as lg


def _failing_job(culprit: int, exc: BaseException, seen: dict[int, BaseException], late: bool = False) -> Any:
    """``fn`` for run_threads: rank ``culprit`` raises ``exc``; the others make a collective (after
    their communicator was aborted, when ``late``) and record what it raised."""
    def fn(c: Any) -> None:
        if c.rank == culprit:
            raise exc
        if late:
            while not c.aborted:
                time.sleep(0.005)
        try:
            c.all_reduce(lg.from_numpy(np.ones(4, np.float32), c.device, name="t"))
            c.wait()
        except lg.CommAbortedError as err:
            seen[c.rank] = err
            raise
    return fn


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [False, True], ids=["waiting", "after the abort"])
def test_peers_hear_which_rank_failed_and_why(late: bool) -> None:
    seen: dict[int, BaseException] = {}
    with pytest.raises(RuntimeError) as info:
        lg.run_threads(2, _failing_job(1, RuntimeError("boom"), seen, late), timeout=30)
    assert str(info.value) == "boom"  # the failing rank's own exception
    assert "raised in rank 1 of 2 (host backend, lowgrad.run_threads)" in info.value.__notes__
    assert str(seen[0]) == "rank 1 failed: RuntimeError: boom; the communicator was aborted"


@pytest.mark.timeout(60)
def test_every_peer_hears_the_failure_that_started_it() -> None:
    seen: dict[int, BaseException] = {}
    with pytest.raises(ValueError):
        lg.run_threads(4, _failing_job(2, ValueError(), seen), timeout=30)
    assert sorted(seen) == [0, 1, 3]
    assert {str(e) for e in seen.values()} == {"rank 2 failed: ValueError; the communicator was aborted"}


def test_an_explicit_abort_names_its_rank() -> None:
    def fn(c: Any) -> str:
        if c.rank == 0:
            c.abort()
            return ""
        with pytest.raises(lg.CommAbortedError) as info:
            c.barrier()
        return str(info.value)
    assert lg.run_threads(2, fn, timeout=30)[1] == "rank 0 aborted the host communicator"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("late", [False, True], ids=["waiting", "after the abort"])
def test_loopback_peers_hear_which_rank_failed_and_why(monkeypatch: pytest.MonkeyPatch, late: bool) -> None:
    patch(monkeypatch)
    seen: dict[int, BaseException] = {}
    with pytest.raises(KeyError) as info:
        run(3, _failing_job(1, KeyError("engine bug"), seen, late), timeout=30)
    assert "raised in rank 1 of 3 (cuda backend, lowgrad.run_threads)" in info.value.__notes__
    assert sorted(seen) == [0, 2]
    assert {str(e) for e in seen.values()} == {"rank 1 failed: KeyError: 'engine bug'; the communicator was aborted"}


def test_loopback_explicit_abort_names_its_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    patch(monkeypatch)
    aborted = threading.Event()

    def fn(c: Any) -> str:
        if c.rank == 1:
            c.abort()
            aborted.set()
            return ""
        aborted.wait(10)
        with pytest.raises(lg.CommAbortedError) as info:
            c.barrier()
        return str(info.value)
    assert run(2, fn)[0] == "rank 1 aborted the loopback communicator"
