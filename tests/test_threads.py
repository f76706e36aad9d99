"""Ranks as threads (lowgrad.runtime.threads): the agreement on each collective and the AbortEvent
that carries run_threads' reason to ranks that share nothing else."""
from __future__ import annotations

import threading
from typing import Any

from lowgrad.runtime.threads import AbortEvent, ThreadCollective


def _on_two_ranks(fn: Any) -> list[Any]:
    """``fn(rank)`` on ranks 0 and 1 at once; what each returned or raised."""
    out: list[Any] = [None, None]

    def body(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[rank] = exc
    threads = [threading.Thread(target=body, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_agree_returns_every_payload_when_the_ranks_agree() -> None:
    tc = ThreadCollective(2, 5)
    assert _on_two_ranks(lambda r: tc.agree(r, ("all_reduce", "fp32", 8, "sum"), 5, payload=r * 10)) == [[0, 10]] * 2


def test_agree_raises_the_same_error_on_every_rank_when_they_differ() -> None:
    tc = ThreadCollective(2, 5)
    out = _on_two_ranks(lambda r: tc.agree(r, ("all_reduce", "fp32", 8 + r, "sum"), 5))
    assert all(isinstance(e, ValueError) for e in out) and str(out[0]) == str(out[1])
    assert "ranks disagree" in str(out[0]) and "rank 1: ('all_reduce', 'fp32', 9, 'sum')" in str(out[0])
    assert _on_two_ranks(lambda r: tc.agree(r, ("barrier",), 5)) == [[None, None]] * 2  # still usable


def test_abort_event_keeps_the_first_reason() -> None:
    ev = AbortEvent()
    assert not ev.is_set() and ev.reason is None
    ev.abort("rank 1 failed: RuntimeError: boom; the communicator was aborted")
    ev.abort("rank 0 failed: CommAbortedError; the communicator was aborted")
    assert ev.is_set() and ev.reason == "rank 1 failed: RuntimeError: boom; the communicator was aborted"
    assert isinstance(ev, threading.Event)  # what a Communicator's abort_event is documented as

