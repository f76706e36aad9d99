"""The NCCL communicator on real GPUs: world 1 in this process (every collective, groups,
all-to-all, host gathers, abort and timeout), and run_threads over every visible GPU checked
against the host backend."""
from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

import lowgrad as lg
from lowgrad.cuda import driver as _cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda.available(), reason=_cuda.unavailable_reason() or "no GPU")]


@pytest.fixture
def comm():
    from lowgrad.cuda import nccl
    dev = lg.Device(0)
    c = lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=60)
    yield c
    if not c.closed:
        c.close()


def dev_tensor(dev, arr, dtype=lg.fp32):
    return lg.from_numpy(np.asarray(arr).astype(dtype.np), dev, name="t")


def test_world1_collectives(comm):
    dev = comm.device
    x = np.arange(16, dtype=np.float32) - 3.5
    for op in ("avg", "sum"):
        t = dev_tensor(dev, x, lg.bf16)
        comm.reduce_scatter(t, op)
        comm.wait()
        np.testing.assert_array_equal(t.numpy(), x.astype(ml_dtypes.bfloat16))
    for op in ("sum", "avg", "max"):
        t = dev_tensor(dev, x)
        comm.all_reduce(t, op)
        comm.wait()
        np.testing.assert_array_equal(t.numpy(), x)
    t = dev_tensor(dev, x)
    comm.all_gather(t)
    out = dev.alloc((16,), lg.fp32, name="out")
    comm.all_gather(t, out=out)
    comm.all_to_all(t)  # world 1: a no-op
    comm.wait()
    np.testing.assert_array_equal(out.numpy(), x)
    np.testing.assert_array_equal(t.numpy(), x)
    assert comm.all_to_all_skip() == 0


def test_group_event_and_self_send_recv(comm):
    dev = comm.device
    s = dev.stream()
    a = dev_tensor(dev, np.arange(8, dtype=np.float32))
    b = dev_tensor(dev, np.zeros(8, np.float32))
    with comm.group(s) as g:
        comm.send(a, 0)
        comm.recv(b, 0)
    comm.wait(g.event)
    assert g.event.query()
    np.testing.assert_array_equal(b.numpy(), np.arange(8, dtype=np.float32))
    other = dev.stream()
    other.wait(g.event)
    other.synchronize()


def test_host_helpers(comm):
    comm.barrier()
    assert comm.host_allgather(b"hello") == [b"hello"]
    assert comm.host_allgather(b"") == [b""]
    assert comm.host_gather(b"x") == [b"x"]


def test_argument_checks(comm):
    dev = comm.device
    with pytest.raises(ValueError, match="device memory"):
        comm.all_reduce(dev.alloc((4,), lg.fp32, kind="pinned", name="p"))
    with pytest.raises(ValueError, match="lives on"):
        comm.all_reduce(lg.from_numpy(np.ones(4, np.float32), lg.HostDevice()))
    with pytest.raises(ValueError, match="op must be"):
        comm.reduce_scatter(dev_tensor(dev, np.ones(4)), "max")
    with pytest.raises(ValueError, match="peer 1"):
        comm.send(dev_tensor(dev, np.ones(4)), 1)


def _blocked_stream(dev):
    """A stream held by cuStreamWaitValue32 on a pinned word, and the function releasing it."""
    drv = _cuda.driver()
    word = dev.alloc((4,), lg.byte, kind="pinned", name="word")
    word.numpy()[:] = 0
    s = dev.stream()
    (err,) = drv.cuStreamWaitValue32(s.handle, word.ptr, 1, 0)
    if int(err):
        pytest.skip(f"cuStreamWaitValue32 unsupported here ({err})")

    def release():
        word.numpy().view(np.uint32)[0] = 1
    return s, release, word


def test_wait_timeout_aborts(comm):
    s, release, _keep = _blocked_stream(comm.device)
    threading.Timer(1.0, release).start()  # ncclCommAbort frees memory: it waits for the device
    try:
        t0 = time.monotonic()
        with pytest.raises(lg.CommTimeoutError):
            comm.wait(s, timeout=0.3)
        assert time.monotonic() - t0 < 5
        assert comm.aborted
        with pytest.raises(lg.CommAbortedError):
            comm.all_reduce(dev_tensor(comm.device, np.ones(4)))
    finally:
        release()
        s.synchronize()


def test_abort_from_another_thread(comm):
    s, release, _keep = _blocked_stream(comm.device)
    threading.Timer(1.5, release).start()
    try:
        threading.Timer(0.3, comm.abort).start()
        t0 = time.monotonic()
        with pytest.raises(lg.CommAbortedError):
            comm.wait(s)
        assert time.monotonic() - t0 < 10
    finally:
        release()
        s.synchronize()


def test_run_threads_matches_host_backend():
    world = lg.device_count()
    n = 64 * world

    def fn(c):
        rng = np.random.default_rng(c.rank)
        x = rng.standard_normal(n).astype(np.float32)
        kind = "device" if c.device.backend == "cuda" else "host"
        out = {}
        for name, dtype in (("fp32", lg.fp32), ("bf16", lg.bf16)):
            t = lg.from_numpy(x.astype(dtype.np), c.device, kind=kind, name="t")
            c.reduce_scatter(t, "avg")
            c.all_gather(t)
            u = lg.from_numpy(x.astype(dtype.np), c.device, kind=kind, name="u")
            c.all_reduce(u, "sum")
            a = lg.from_numpy(x.astype(dtype.np), c.device, kind=kind, name="a")
            c.all_to_all(a)
            c.wait()
            c.device.synchronize()
            out[name] = (t.numpy().astype(np.float32), u.numpy().astype(np.float32),
                         a.numpy().astype(np.float32))
        return out, c.host_allgather(bytes([c.rank]))

    gpu = lg.run_threads(world, fn, backend="cuda", timeout=120)
    host = lg.run_threads(world, fn, backend="host", timeout=60)
    for r in range(world):
        assert gpu[r][1] == host[r][1] == [bytes([k]) for k in range(world)]
        for name, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
            for g, h in zip(gpu[r][0][name], host[r][0][name]):
                np.testing.assert_allclose(g, h, rtol=tol, atol=tol)
        # all-to-all moves bits: exact
        np.testing.assert_array_equal(gpu[r][0]["fp32"][2], host[r][0]["fp32"][2])


def test_run_threads_cuda_rank_failure_aborts_others():
    world = lg.device_count()
    seen = {}

    def fn(c):
        if c.rank == world - 1:
            raise RuntimeError("rank failure")
        try:
            c.barrier()
        except lg.CommAbortedError as exc:
            seen[c.rank] = str(exc)
            raise

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank failure"):
        lg.run_threads(world, fn, backend="cuda", timeout=60)
    assert time.monotonic() - t0 < 30
    # the peers hear which rank failed and why, as on the host backend and the loopback
    assert seen == {r: f"rank {world - 1} failed: RuntimeError: rank failure; the communicator was aborted"
                    for r in range(world - 1)}


def _exchange_capture_mode(mode):
    """cuThreadExchangeStreamCaptureMode: set ``mode`` on this thread, return the one it had."""
    drv = _cuda.driver()
    return _cuda.check("cuThreadExchangeStreamCaptureMode", drv.cuThreadExchangeStreamCaptureMode(mode))


def test_the_watchdog_thread_runs_in_relaxed_capture_mode(monkeypatch):
    """A global-mode capture on another thread (torch.cuda.graph's default) is invalidated by a
    cuEventQuery from a thread in the global mode: the watchdog's thread puts itself in the
    relaxed mode first, and this thread's mode is left alone."""
    drv = _cuda.driver()
    modes = drv.CUstreamCaptureMode
    dev = lg.Device(0)
    seen = []
    real = dev.relax_thread_capture_mode

    def spy():
        real()
        mode = _exchange_capture_mode(modes.CU_STREAM_CAPTURE_MODE_RELAXED)  # read it back (and keep it)
        seen.append((threading.current_thread(), mode))
    monkeypatch.setattr(dev, "relax_thread_capture_mode", spy)
    from lowgrad.cuda import nccl
    c = lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=60, blocking=True)
    try:
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen and seen[0][0] is c._wd._thread and seen[0][1] == modes.CU_STREAM_CAPTURE_MODE_RELAXED
        mine = _exchange_capture_mode(modes.CU_STREAM_CAPTURE_MODE_GLOBAL)
        assert mine == modes.CU_STREAM_CAPTURE_MODE_GLOBAL  # this thread's mode is its own
    finally:
        c.close()
