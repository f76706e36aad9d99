"""The NCCL communicator's blocking mode and its watchdog on real GPUs.

One GPU: both modes run the collectives, ``split`` makes a working child closed on its own, the
watchdog's thread ends with the communicator. Two GPUs (skipped with fewer): two processes
launched as torchrun would (``from_env`` through ``NCCL_COMM_ID``), where rank 1 never issues its
collective (at the first call, when NCCL's connection setup blocks rank 0 in the host, and
later, when rank 0's work spins on the device while its host synchronizes), raises mid-step,
or is killed with SIGKILL (also while rank 0 has a group open): rank 0 raises a lowgrad error
within the timeout (and a small margin) and its process exits cleanly, in both modes (in the
blocking mode rank 0 waits with a plain device synchronize, which only the watchdog can bound).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from helpers import watchdog_threads

import lowgrad as lg
from lowgrad.cuda import driver as _cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda.available(), reason=_cuda.unavailable_reason() or "no GPU")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 5.0  # seconds: the communicators' timeout in the two-process cases
MARGIN = 5.0  # seconds past it that the peer may take to raise (the watchdog's round, the abort)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_world1_collectives_in_both_modes_and_no_thread_left(blocking: bool) -> None:
    from lowgrad.cuda import nccl

    dev = lg.Device(0)
    with lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=60, blocking=blocking) as comm:
        assert comm.blocking is blocking
        assert bool(watchdog_threads()) is blocking
        t = lg.from_numpy(np.arange(8, dtype=np.float32), dev, name="t")
        s = dev.stream()
        for _ in range(3):
            comm.all_reduce(t, "sum", s)
            comm.reduce_scatter(t, "sum", s)
            comm.all_gather(t, stream=s)
            with comm.group(s):
                comm.send(t, 0)
                comm.recv(t, 0)
        comm.wait(s)
        np.testing.assert_array_equal(t.numpy(), np.arange(8, dtype=np.float32))
    assert not watchdog_threads()


@pytest.mark.timeout(120)
def test_the_environment_picks_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowgrad.cuda import nccl

    dev = lg.Device(0)
    for env, want in (("0", False), ("1", True)):
        monkeypatch.setenv("LOWGRAD_NCCL_BLOCKING", env)
        with lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=60) as comm:
            assert comm.blocking is want
            comm.barrier()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_split_makes_a_working_child_closed_on_its_own(blocking: bool) -> None:
    from lowgrad.cuda import nccl

    dev = lg.Device(0)
    comm = lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=60, blocking=blocking)
    try:
        with pytest.raises(ValueError, match="color"):
            comm.split(-1)
        child = comm.split(3)
        assert (child.rank, child.world, child.device, child.timeout, child.blocking) == (0, 1, dev, 60, blocking)
        t = lg.from_numpy(np.full(4, 2.0, np.float32), dev, name="t")
        child.all_reduce(t, "sum")
        child.wait()
        child.close()
        child.close()  # idempotent
        with pytest.raises(lg.ClosedError):
            child.all_reduce(t)
        comm.all_reduce(t, "max")  # the parent is untouched
        comm.wait()
        np.testing.assert_array_equal(t.numpy(), np.full(4, 2.0, np.float32))
        grandchild, doomed = comm.split(0, key=5), comm.split(1)
        grandchild.close()
        comm.abort()  # what was split from it is aborted with it (every backend); a closed child is left alone
        with pytest.raises(lg.CommAbortedError):
            doomed.barrier()
        doomed.close()
        survivor_parent = lg.Communicator(0, 1, nccl.unique_id(), dev, timeout=60, blocking=blocking)
        survivor = survivor_parent.split(2)
        survivor_parent.close()  # a child outlives its parent's close (its own resources: splitShare 0)
        survivor.barrier()
        survivor.close()
    finally:
        comm.close()
    assert not watchdog_threads()


# ---- two processes ---------------------------------------------------------------------------
SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import numpy as np
import lowgrad as lg
case, rank = {case!r}, int(os.environ["RANK"])
comm = lg.from_env(timeout={timeout!r})
dev = comm.device
t = lg.from_numpy(np.ones(1 << 20, np.float32), dev, name="t")
if case != "never_first":  # a healthy step first: connections are set up
    comm.all_reduce(t)
    comm.wait()
print("READY", rank, comm.blocking, flush=True)
if rank == 1:
    if case.startswith("never"):
        time.sleep({timeout!r} + {margin!r} + 60)  # never issues; the test ends it once rank 0 is done
        comm.abort()
        sys.exit(0)
    if case == "raise":
        raise RuntimeError("rank 1 raised mid-step")
    os.kill(os.getpid(), signal.SIGKILL)
t0 = time.monotonic()
try:
    if case == "sigkill_in_group":  # the peer dies while this rank's group is open: the abort waits for its end
        with comm.group():
            comm.send(t, 1)
            time.sleep(2.0)
            comm.recv(t, 1)
    for _ in range(3):
        comm.all_reduce(t)
    if comm.blocking:
        dev.synchronize()  # not comm.wait: only the watchdog bounds this
    else:
        comm.wait()  # the non-blocking mode's bound (a device sync would hang there)
    comm.all_reduce(t)
    comm.wait()
    print("NO-ERROR", flush=True)
except lg.LowgradError as exc:
    print("RAISED", type(exc).__name__, round(time.monotonic() - t0, 3), str(exc)[:300].replace("\\n", " "),
          flush=True)
comm.close()
print("CLOSED", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("blocking", ["1", "0"], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("case", ["never_first", "never_later", "raise", "sigkill", "sigkill_in_group"])
def test_a_failing_peer_makes_the_other_rank_raise_within_the_timeout(case: str, blocking: str) -> None:
    if lg.device_count() < 2:
        pytest.skip("needs two GPUs")
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NCCL_COMM_ID": f"127.0.0.1:{port}",
               "LOWGRAD_NCCL_BLOCKING": blocking}
        env.pop("LOWGRAD_RENDEZVOUS_TOKEN", None)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        code = SCRIPT.format(root=ROOT, case=case, timeout=TIMEOUT, margin=MARGIN)
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        out0, err0 = procs[0].communicate(timeout=120)
    finally:  # rank 1 has done its part (a silent one would sleep on)
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 0, (out0, err0)
    lines = out0.split("\n")
    assert any(x.startswith("READY 0 " + str(blocking == "1")) for x in lines), (out0, err0)
    raised = [x for x in lines if x.startswith("RAISED")]
    assert raised, (out0, err0)
    _, kind, elapsed, *_ = raised[0].split(" ")
    assert kind in ("CommTimeoutError", "CommAbortedError", "NcclError"), raised[0]
    if case.startswith("never"):
        assert kind == "CommTimeoutError", raised[0]
    assert float(elapsed) < TIMEOUT + MARGIN, raised[0]
    assert "CLOSED" in lines, (out0, err0)
