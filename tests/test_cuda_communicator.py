"""The NCCL communicator's failure reason without a GPU: under run_threads its AbortEvent carries
which rank failed and why, and every call of an aborted rank raises that (the GPU half:
tests/test_cuda_communicator_gpu.py::test_run_threads_cuda_rank_failure_aborts_others)."""
from __future__ import annotations

import pytest

import lowgrad as lg
from lowgrad.core.threads import AbortEvent
from lowgrad.cuda.communicator import Communicator

REASON = "rank 1 failed: RuntimeError: boom; the communicator was aborted"


def _aborted(abort_event: object) -> Communicator:
    """A Communicator's state after abort(), without NCCL (nothing here touches the handle)."""
    c = object.__new__(Communicator)
    c.rank, c.world, c._state, c._group_depth, c._group = 0, 2, "aborted", 0, None
    c._abort_event = abort_event  # type: ignore[assignment]
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
