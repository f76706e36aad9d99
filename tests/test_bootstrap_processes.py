"""``lowgrad.from_env`` end to end in several processes on loopback, as torchrun starts them, on a
host without a GPU: rank 0's real NCCL unique id reaches every rank through the TCP rendezvous and
each rank then fails at the communicator step; a wrong token, a rank that never starts and
``from_env``'s own error without a device. The ranks see no GPU (``CUDA_VISIBLE_DEVICES=""``) even
on a GPU host; a hang fails the test instead of blocking the run.

``from_env()`` opens ``Device(LOCAL_RANK)`` before the rendezvous, so without a GPU it stops there;
to go further the ranks pass ``device=NoGpu()`` (see ``CHILD``), which lets ``from_env`` run its
rendezvous and hand the id to ``ncclCommInitRankConfig``, which fails for want of CUDA.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
from helpers import needs_nccl

from lowgrad.cuda import nccl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "processes-" + "t" * 22
CLEARED = ("NCCL_COMM_ID", "LOWGRAD_RENDEZVOUS_TOKEN", "LOWGRAD_MASTER_PORT", "LOWGRAD_RENDEZVOUS_BIND",
           "TORCHELASTIC_USE_AGENT_STORE")
SHORT = 2.0  # seconds: the rendezvous timeout of the failure cases

# One launcher process per job: it imports lowgrad once (about 1.7 s of CPU, most of it ml_dtypes)
# and forks a process per rank, or runs the rank itself when it is given one (``fresh``).
CHILD = r"""
import json, os, sys, time, traceback
spec = json.loads(sys.argv[1])
sys.path.insert(0, spec["root"])
import lowgrad
from lowgrad.cuda import nccl


class NoGpu:
    '''Stands in for Device(LOCAL_RANK), which needs a GPU: from_env and Communicator only read
    ``backend`` and call ``activate`` before ncclCommInitRankConfig.'''
    backend = "cuda"

    def activate(self):
        pass


def run_rank(env, stub, timeout, out):
    os.environ.update(env)
    seen = {"made": None, "got": None}
    make, init = nccl.unique_id, nccl.comm_init_rank

    def spy_make():
        uid = make()
        seen["made"] = uid.hex()
        return uid

    def spy_init(world, uid, rank, blocking=False):
        seen["got"] = bytes(uid).hex()
        return init(world, uid, rank, blocking)

    nccl.unique_id, nccl.comm_init_rank = spy_make, spy_init
    t0 = time.monotonic()
    error = message = None
    try:
        lowgrad.from_env(device=NoGpu() if stub else None, timeout=timeout).close()
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    seconds = time.monotonic() - t0
    with open(os.path.join(out, "rank%s.json" % env["RANK"]), "w") as f:
        json.dump({"rank": int(env["RANK"]), **seen, "error": error, "message": message, "seconds": seconds}, f)


if len(spec["ranks"]) == 1:
    run_rank(spec["ranks"][0], spec["stub"], spec["timeout"], spec["out"])
    sys.exit()
pids = []
for env in spec["ranks"]:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            run_rank(env, spec["stub"], spec["timeout"], spec["out"])
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
"""


@dataclass(frozen=True)
class RankResult:
    """What one rank saw: the id it created (rank 0) and the id ``from_env`` handed NCCL (hex),
    the exception ``from_env`` raised, and how long the call took."""

    rank: int
    made: str | None
    got: str | None
    error: str | None
    message: str | None
    seconds: float


def free_port() -> int:
    """A TCP port free on loopback now (rank 0 binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world: int, port: int, token: str | None) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a one-node job (``--nproc-per-node world``)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if token is not None:
        env["LOWGRAD_RENDEZVOUS_TOKEN"] = token
    return env


def run_job(world: int, *, started: Iterable[int] | None = None, stub: bool = True, timeout: float = 30.0,
            token: str | None = TOKEN, tokens: dict[int, str] | None = None,
            fresh: bool = False) -> dict[int, RankResult]:
    """Start ranks ``started`` (default all) of a ``world``-rank job, rank 0 last, each calling
    ``lowgrad.from_env(timeout=timeout)``, and return what each saw. ``tokens`` overrides
    ``token`` per rank; ``fresh``: one new interpreter per rank instead of forks of one launcher;
    ``stub``: pass ``device=NoGpu()``. Fails if the processes do not end within the timeout plus
    a margin for starting them."""
    ranks = sorted(range(world) if started is None else started, reverse=True)
    port = free_port()
    specs = [torchrun_env(r, world, port, (tokens or {}).get(r, token)) for r in ranks]
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    base["CUDA_VISIBLE_DEVICES"] = ""  # no rank reaches a GPU, on a GPU host too
    groups = [specs[i:i + 1] for i in range(len(specs))] if fresh else [specs]
    limit = timeout + 20.0
    with tempfile.TemporaryDirectory() as out:
        args = [json.dumps({"root": ROOT, "ranks": g, "stub": stub, "timeout": timeout, "out": out}) for g in groups]
        procs = [subprocess.Popen([sys.executable, "-c", CHILD, a], env=base, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True) for a in args]
        try:
            logs = [p.communicate(timeout=limit)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # the launcher's session: it and its forked ranks
            logs = [p.communicate()[0] for p in procs]
            pytest.fail(f"ranks {ranks} did not finish within {limit:g} s: {logs}")
        results = {}
        for name in os.listdir(out):
            with open(os.path.join(out, name)) as f:
                r = RankResult(**json.load(f))
            results[r.rank] = r
    assert sorted(results) == sorted(ranks), f"no result from some ranks: {logs}"
    for r in sorted(results.values(), key=lambda r: r.rank):  # shown with -s or on failure
        print(f"rank {r.rank}: {r.error} after {r.seconds:.2f} s, id {r.got or r.made}")
    return results


def assert_proceeded(results: dict[int, RankResult], ranks: Iterable[int], uid: str) -> None:
    """``ranks`` got ``uid`` from the rendezvous and failed at ncclCommInitRankConfig (no CUDA)."""
    for r in ranks:
        res = results[r]
        assert res.got == uid, (r, results)
        assert res.error == "NcclError" and res.message is not None, (r, results)
        assert "ncclCommInitRankConfig failed: ncclUnhandledCudaError" in res.message, (r, results)


def assert_timed_out(res: RankResult, timeout: float, *needles: str) -> None:
    """``res`` is a CommTimeoutError raised after ``timeout`` seconds (not sooner, not much later)
    whose message holds ``needles``."""
    assert res.error == "CommTimeoutError" and res.message is not None, res
    assert all(n in res.message for n in needles), res
    assert timeout - 0.05 <= res.seconds < timeout + 3.0, res


@needs_nccl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, fresh", [(2, True), (4, False), (8, False)], ids=["2-fresh", "4", "8"])
def test_every_rank_gets_rank0s_id_then_stops_at_the_communicator(world: int, fresh: bool) -> None:
    results = run_job(world, fresh=fresh)
    uid = results[0].made
    assert uid is not None and len(bytes.fromhex(uid)) == nccl.UNIQUE_ID_BYTES and uid.strip("0"), results
    assert all(results[r].made is None for r in range(1, world)), results  # only rank 0 creates the id
    assert_proceeded(results, range(world), uid)
    assert max(res.seconds for res in results.values()) < 15.0, results


@pytest.mark.timeout(60)
def test_from_env_without_a_gpu_fails_at_the_device_before_the_rendezvous() -> None:
    results = run_job(2, stub=False, fresh=True, timeout=60.0)
    for res in results.values():
        assert res.error == "CudaUnavailableError" and res.message is not None, results
        assert res.message.startswith("CUDA unavailable"), results
        assert res.made is None and res.got is None, results  # no id created, nobody waited for one
        assert res.seconds < 10.0, results  # at once, not after the 60 s rendezvous timeout


@needs_nccl
@pytest.mark.timeout(60)
def test_a_rank_with_another_token_is_refused_and_the_others_get_the_id() -> None:
    results = run_job(4, tokens={2: "another-" + "s" * 24}, timeout=SHORT)
    bad = results[2]
    assert bad.error == "PermissionError" and bad.got is None, results
    assert "authentication failed (LOWGRAD_RENDEZVOUS_TOKEN differs" in (bad.message or ""), results
    assert bad.seconds < SHORT, results  # refused at once, not at the timeout
    assert_proceeded(results, (1, 3), results[0].made or "")
    assert_timed_out(results[0], SHORT, "rank(s) [2] never joined", "failed authentication (claimed rank 2)")
    assert results[0].got is None  # rank 0 raised before ncclCommInitRankConfig


@needs_nccl
@pytest.mark.timeout(60)
def test_a_rank_that_never_starts_times_out_rank0() -> None:
    results = run_job(4, started=(0, 1, 3), timeout=SHORT)
    assert_timed_out(results[0], SHORT, "rank(s) [2] never joined")
    assert_proceeded(results, (1, 3), results[0].made or "")  # served before rank 0 gave up


@needs_nccl
@pytest.mark.timeout(60)
def test_without_rank0_every_rank_times_out() -> None:
    results = run_job(4, started=(1, 2, 3), timeout=SHORT)
    for r, res in results.items():
        assert_timed_out(res, SHORT, f"rank {r} could not get the unique id from rank 0 at 127.0.0.1:")
        assert res.got is None and res.made is None
