"""The TCP unique-id rendezvous as real processes on loopback, the launcher environment, and
run_threads' argument checks."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

import lowgrad as lg
from lowgrad.launch.rendezvous import launcher_env
from lowgrad.launch.tcp_rendezvous import exchange_unique_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from lowgrad.launch.tcp_rendezvous import exchange_unique_id
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
uid = bytes(range(128)) if rank == 0 else None
try:
    got = exchange_unique_id(rank, world, "127.0.0.1", port, uid, timeout=float(sys.argv[4]))
    print("OK", got.hex())
except Exception as e:
    print("ERR", type(e).__name__, e)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(rank: int, world: int, port: int, timeout: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT.format(root=ROOT), str(rank), str(world), str(port),
                             str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_deliver_rank0_id():
    port = free_port()
    client = spawn(1, 2, port, 20)  # starts first: must retry until rank 0 listens
    time.sleep(0.3)
    server = spawn(0, 2, port, 20)
    outs = [p.communicate(timeout=30)[0].strip() for p in (server, client)]
    assert outs[0] == "OK " + bytes(range(128)).hex(), outs
    assert outs[1] == outs[0]


def test_three_ranks_in_process_threads():
    import threading
    port, got = free_port(), {}

    def run(rank):
        got[rank] = exchange_unique_id(rank, 3, "127.0.0.1", port, b"\x07" * 128 if rank == 0 else None, 10)

    ts = [threading.Thread(target=run, args=(r,)) for r in (2, 1, 0)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    assert got == {0: b"\x07" * 128, 1: b"\x07" * 128, 2: b"\x07" * 128}


def test_missing_peer_times_out_on_both_sides():
    port = free_port()
    t0 = time.monotonic()
    server = spawn(0, 3, port, 1.0)  # rank 2 never comes
    client = spawn(1, 3, port, 1.0)
    out0, out1 = (p.communicate(timeout=30)[0].strip() for p in (server, client))
    assert out0.startswith("ERR CommTimeoutError") and "[2]" in out0, out0
    assert out1.startswith("OK"), out1
    assert time.monotonic() - t0 < 15
    lone = spawn(1, 2, free_port(), 0.5)  # rank 0 never listens
    out = lone.communicate(timeout=30)[0].strip()
    assert out.startswith("ERR CommTimeoutError") and "rank 1 could not get the unique id" in out, out


def test_world_mismatch_is_rejected():
    port = free_port()
    server = spawn(0, 2, port, 2)  # drops the bad hello and keeps waiting for a real rank 1
    client = spawn(1, 3, port, 10)
    out0, out1 = (p.communicate(timeout=30)[0].strip() for p in (server, client))
    assert out0.startswith("ERR CommTimeoutError") and "rank 1 with world 3, expected world 2" in out0, out0
    assert out1.startswith("ERR ValueError") and "refused rank 1 of world 3" in out1, out1


def test_rank0_needs_its_id():
    with pytest.raises(ValueError, match="128-byte"):
        exchange_unique_id(0, 2, "127.0.0.1", free_port(), None, 1)
    assert exchange_unique_id(0, 1, "127.0.0.1", 0, b"\x01" * 128, 1) == b"\x01" * 128


def test_launcher_env():
    assert launcher_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == (3, 8, 1, "torchrun")
    assert launcher_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                         "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == (1, 2, 1, "openmpi")
    assert launcher_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"}) == (5, 6, 2, "slurm")
    with pytest.raises(ValueError, match="no launcher"):
        launcher_env({})
    with pytest.raises(ValueError, match="outside"):
        launcher_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_run_threads_arguments():
    with pytest.raises(ValueError, match="world"):
        lg.run_threads(0, lambda c: None)
    with pytest.raises(ValueError, match="backend"):
        lg.run_threads(1, lambda c: None, backend="mpi")
    assert lg.run_threads(3, lambda c: (c.rank, c.world, c.device.backend)) == [(r, 3, "host") for r in range(3)]


def test_run_threads_cuda_world_above_gpu_count():
    from lowgrad.cuda import driver as _cuda
    if not _cuda.available():
        with pytest.raises(lg.CudaUnavailableError):
            lg.run_threads(2, lambda c: None, backend="cuda")
        return
    with pytest.raises(ValueError, match="GPUs"):
        lg.run_threads(lg.device_count() + 1, lambda c: None, backend="cuda")


def test_from_env_with_more_local_ranks_than_gpus_names_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowgrad.cuda import device as cuda_device
    monkeypatch.setattr(cuda_device, "device_count", lambda: 1)
    for k, v in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"local rank 1 needs GPU 1, but 1 GPU\(s\).*share_gpu=True"):
        lg.from_env(timeout=1)
