"""Timeouts of the NCCL communicator: ``inf`` waits without a limit (never OverflowError), bad
values are refused before NCCL is touched and leave a communicator usable."""
from __future__ import annotations

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.cuda import driver as _cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda.available(), reason=_cuda.unavailable_reason() or "no GPU")]


@pytest.mark.timeout(120)
def test_infinite_timeout_waits_and_completes() -> None:
    from lowgrad.cuda import nccl

    dev = lg.Device(0)
    with lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=float("inf")) as comm:
        assert comm.timeout == float("inf")
        t = lg.from_numpy(np.arange(8, dtype=np.float32), dev, name="t")
        comm.all_reduce(t)
        comm.wait()
        comm.wait(timeout=float("inf"))
        comm.barrier()
        np.testing.assert_array_equal(t.numpy(), np.arange(8, dtype=np.float32))
    assert lg.run_threads(1, lambda c: c.timeout, backend="cuda", timeout=float("inf")) == [float("inf")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad, exc", [(float("nan"), ValueError), (-1.0, ValueError), (0, ValueError),
                                      (True, TypeError), ("5", TypeError)])
def test_bad_timeouts_are_refused_before_any_work(bad: object, exc: type) -> None:
    from lowgrad.cuda import nccl

    dev = lg.Device(0)
    with pytest.raises(exc, match="timeout"):
        lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=bad)  # type: ignore[arg-type]
    ran: list[object] = []
    with pytest.raises(exc, match="timeout"):
        lg.run_threads(1, ran.append, backend="cuda", timeout=bad)  # type: ignore[arg-type]
    assert not ran
    with lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=60) as comm:
        with pytest.raises(exc, match="timeout"):
            comm.wait(timeout=bad)  # type: ignore[arg-type]
        assert not comm.closed
        comm.barrier()  # still usable
