"""``from_env`` end to end on real GPUs: two processes with torchrun variables build NCCL
communicators through the authenticated TCP rendezvous, or through ``NCCL_COMM_ID`` without
any exchange, and agree in a host all-gather. Needs two visible GPUs."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import lowgrad as lg
from lowgrad.cuda import driver as _cuda

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda.available(), reason=_cuda.unavailable_reason() or "no GPU")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import lowgrad as lg
comm = lg.from_env(timeout=120)
print("OK", comm.rank, comm.world, b"".join(comm.host_allgather(bytes([comm.rank + 7]))).hex(), flush=True)
comm.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["token", "nccl_comm_id"])
def test_from_env_two_processes(mode):
    if lg.device_count() < 2:
        pytest.skip("needs two GPUs")
    port = free_port()
    procs = []
    for rank in (1, 0):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        if mode == "token":
            env["LOWGRAD_RENDEZVOUS_TOKEN"] = "gpu-test-" + "k" * 24
            env.pop("NCCL_COMM_ID", None)
        else:
            env["NCCL_COMM_ID"] = f"127.0.0.1:{port}"
            env.pop("LOWGRAD_RENDEZVOUS_TOKEN", None)
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=ROOT)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = sorted(o[0].strip() for o in outs)
    assert lines == ["OK 0 2 0708", "OK 1 2 0708"], outs
