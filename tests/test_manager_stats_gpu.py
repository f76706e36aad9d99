"""Gradient statistics of the managers on the GPU equal the host backend's (the counts, the
largest |x| and which entries are measured exactly; sums of squares within a relative 1e-5: the
device sums in float32 per thread), on every strategy at world 1 and through the loopback at world
2, with the same non-finite report; the device's bits are the same from run to run."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from test_manager_stats import M, nan_at
from test_managers import STRATS, bf16_grad, drive, small_layout

import lowgrad as lg
from lowgrad.diagnostics.report import StepStats

pytestmark = pytest.mark.gpu


def stats_of(world: int, strategy: str, offload: bool, backend: str, gfun: Any = bf16_grad) -> list[StepStats]:
    layout = small_layout(zero_init=True)

    def job(comm: Any) -> StepStats:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, stats=True, seed=5)
        for step in range(2):
            drive(comm, layout, strategy, offload, M, gm=gm, first_step=step, gfun=gfun)
        stats = gm.step_stats()
        gm.close()
        return stats
    extra = {"share_gpu": True} if backend == "cuda" and world > 1 else {}
    return lg.run_threads(world, job, backend=backend, **extra)


def same(a: StepStats, b: StepStats, exact: bool = False) -> None:
    for field in ("accumulated", "micro", "local"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), field
        if x is not None:
            assert np.array_equal(x.nonfinite, y.nonfinite) and np.array_equal(x.maxabs, y.maxabs, equal_nan=True)
            assert np.array_equal(np.isnan(x.sumsq), np.isnan(y.sumsq)), field
            if exact:
                assert np.array_equal(x.sumsq, y.sumsq, equal_nan=True), field
            else:
                ok = ~np.isnan(x.sumsq)
                assert np.allclose(x.sumsq[ok], y.sumsq[ok], rtol=1e-5, atol=0), field


@pytest.mark.parametrize("strategy,offload", STRATS)
def test_cuda_stats_equal_host_at_world_1(strategy: str, offload: bool) -> None:
    (dev,), (host,) = stats_of(1, strategy, offload, "cuda"), stats_of(1, strategy, offload, "host")
    same(dev, host)
    assert dev.first_nonfinite() is None
    (again,) = stats_of(1, strategy, offload, "cuda")
    same(dev, again, exact=True)


@pytest.mark.parametrize("strategy", ["unsharded", "scatter_reduce", "all_to_all"])
def test_cuda_stats_and_report_equal_host_at_world_2(strategy: str) -> None:
    gfun = nan_at(1, 1, 2, 0)
    dev, host = stats_of(2, strategy, False, "cuda", gfun), stats_of(2, strategy, False, "host", gfun)
    for d, h in zip(dev, host):
        same(d, h)
        assert str(d.first_nonfinite()) == str(h.first_nonfinite())
    rep = dev[0].first_nonfinite()
    assert rep is not None and (rep.parameter, rep.rank, rep.source) == ("layers.2.w1", 1, "local")


@pytest.mark.parametrize("strategy,offload", STRATS)
def test_cuda_a_reading_waits_for_nothing_and_the_next_step_waits_for_it(strategy: str, offload: bool) -> None:
    """read_stats queues its copy without a host sync: on a stream held back until the host lets
    it go, read_stats returns and the reading is not ready. A reading queued behind long work on
    another stream and resolved only after the next step's micro-steps were queued (they rewrite
    the rows) holds the old step's values, the same bits as step_stats': the next step's writes
    waited for the copy on the device."""
    layout = small_layout(zero_init=True)

    def job(comm: Any) -> None:
        from lowgrad.cuda.driver import driver
        dev, drv = comm.device, driver()
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, offload=offload, stats=True, seed=5)
        drive(comm, layout, strategy, offload, M, gm=gm, gfun=bf16_grad)
        want = gm.step_stats()
        held, gate = dev.stream(), dev.alloc((4,), lg.byte, kind="pinned", name="gate")
        flag = gate.numpy().view(np.uint32)
        flag[0] = 0
        geq = int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        (err,) = drv.cuStreamWaitValue32(held.handle, gate.ptr, 1, geq)  # held until the host writes 1
        if int(err) != 0:
            pytest.skip(f"cuStreamWaitValue32 unavailable here ({err})")
        done: list[Any] = []

        def read() -> None:  # a thread of its own: a read_stats that waited for `held` would hang here
            dev.activate()
            done.append(gm.read_stats(held))
        queue = threading.Thread(target=read)
        queue.start()
        queue.join(timeout=60)
        returned = not queue.is_alive()
        ready_while_held = returned and done[0].ready()
        flag[0] = 1  # let the stream go in any case: a read_stats that synced returns now
        queue.join()
        assert returned and not ready_while_held
        same(done[0].result(), want, exact=True)
        busy = dev.alloc((1 << 28,), lg.fp32, name="busy")  # 1 GiB
        for _ in range(20):  # milliseconds of work ahead of the copy on the other stream
            lg.ops.fill_zero(busy, held)
        reading = gm.read_stats(held)
        drive(comm, layout, strategy, offload, M, gm=gm, first_step=1, gfun=nan_at(comm.rank, 0, 1, 0))
        same(reading.result(), want, exact=True)
        assert reading.result().first_nonfinite() is None and gm.step_stats().first_nonfinite() is not None
        gm.close()
        for t in (gate, busy):
            t.close()
    lg.run_threads(1, job, backend="cuda")
