"""Starting communicators: N ranks as threads of one process (:func:`run_threads`), or one
process per GPU from the launcher's environment (:func:`from_env`: torchrun, Open MPI, Slurm).
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from .collective import DEFAULT_TIMEOUT, CommBase, check_timeout
from .errors import CommAbortedError, CommTimeoutError

_GRACE = 5.0  # seconds the other ranks get to unwind after a failure before the caller raises
_MAGIC = b"LGUID\x00\x01\x00"
_HELLO = struct.Struct("<8sii")  # magic, rank, world


def run_threads(world: int, fn: Callable[[Any], Any], backend: str = "host",
                timeout: float | None = None) -> list[Any]:
    """Run ``fn(comm)`` on ranks ``0 .. world-1``, one thread each, and return the results in
    rank order.

    ``backend="host"``: a :class:`~lowgrad.HostDevice` and :class:`~lowgrad.HostCommunicator` per
    rank. ``backend="cuda"``: rank r drives ``Device(r)`` with a :class:`~lowgrad.Communicator`
    (one shared unique id); ``world`` above the GPU count is a ValueError. Communicators are
    closed when ``fn`` returns. An exception in any rank aborts every other rank's
    communicator and is re-raised here (its notes name the rank); ranks that do not unwind
    within a few seconds of the failure are left behind as daemon threads.
    ``timeout`` (seconds) bounds initialisation and every wait of the communicators.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if backend not in ("host", "cuda"):
        raise ValueError(f"backend must be 'host' or 'cuda', got {backend!r}")
    limit = check_timeout(timeout)
    make = _host_factory(world, limit) if backend == "host" else _cuda_factory(world, limit)

    failed = threading.Event()
    comms: list[CommBase | None] = [None] * world
    results: list[Any] = [None] * world
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def fail_all() -> None:
        failed.set()
        for c in list(comms):
            if c is not None:
                try:
                    c.abort()
                except Exception:  # a failing abort must not hide the original error
                    pass

    def body(rank: int) -> None:
        try:
            comm = make(rank, failed)
            comms[rank] = comm
            if failed.is_set():
                comm.abort()
            results[rank] = fn(comm)
            comm.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            with lock:
                errors.append((rank, exc))
            fail_all()

    threads = [threading.Thread(target=body, args=(r,), name=f"lowgrad-rank{r}", daemon=True)
               for r in range(world)]
    for t in threads:
        t.start()
    try:
        give_up = None
        while any(t.is_alive() for t in threads):
            if failed.is_set():
                give_up = give_up or time.monotonic() + _GRACE
                if time.monotonic() > give_up:
                    break
            for t in threads:
                t.join(0.02)
    except BaseException:
        fail_all()
        raise
    if errors:
        primary = next(((r, e) for r, e in errors if not isinstance(e, CommAbortedError)), errors[0])
        rank, exc = primary
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised in rank {rank} of {world} ({backend} backend, lowgrad.run_threads)")
        raise exc
    return results


def _host_factory(world: int, timeout: float) -> Callable[[int, threading.Event], CommBase]:
    from .host import HostDevice
    from .hostcomm import HostCollective, HostCommunicator

    collective = HostCollective(world, timeout)
    return lambda rank, _failed: HostCommunicator(rank, world, collective, HostDevice(f"host{rank}"), timeout)


def _cuda_factory(world: int, timeout: float) -> Callable[[int, threading.Event], CommBase]:
    from . import nccl
    from .comm import Communicator
    from .device import Device, device_count

    count = device_count()
    if world > count:
        raise ValueError(f"run_threads(world={world}, backend='cuda') needs {world} GPUs, {count} visible")
    uid = nccl.unique_id()

    def make(rank: int, failed: threading.Event) -> CommBase:
        dev = Device(rank)
        dev.activate()
        return Communicator(rank, world, uid, dev, timeout, abort_event=failed)
    return make


# ---- one process per GPU --------------------------------------------------------------------
def launcher_env(environ: dict[str, str] | None = None) -> tuple[int, int, int, str]:
    """(rank, world, local_rank, launcher) from torchrun, Open MPI or Slurm variables."""
    env = os.environ if environ is None else environ
    for launcher, keys in (("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK")),
                           ("openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")),
                           ("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))):
        if keys[0] in env and keys[1] in env:
            try:
                rank, world = int(env[keys[0]]), int(env[keys[1]])
                local = int(env.get(keys[2], rank))
            except ValueError:
                raise ValueError(f"{launcher} variables {keys} must be integers") from None
            if not 0 <= rank < world:
                raise ValueError(f"{launcher}: rank {rank} outside [0, {world})")
            return rank, world, local, launcher
    raise ValueError("no launcher environment found: expected torchrun (RANK, WORLD_SIZE, LOCAL_RANK), "
                     "Open MPI (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK) or Slurm (SLURM_PROCID/NTASKS/LOCALID)")


def from_env(device: Any = None, timeout: float | None = None) -> Any:
    """A :class:`~lowgrad.Communicator` for this process from the launcher's environment.

    ``device`` defaults to ``Device(local_rank)``. Rank 0's unique id reaches the others by
    mpi4py's ``bcast`` under Open MPI when mpi4py is installed, else by :func:`exchange_unique_id`
    on ``MASTER_ADDR`` and ``LOWGRAD_MASTER_PORT`` (default ``MASTER_PORT``, or
    ``MASTER_PORT + 1`` under torchrun's agent store, which holds ``MASTER_PORT``).
    """
    from . import nccl
    from .comm import Communicator
    from .device import Device

    rank, world, local, launcher = launcher_env()
    limit = check_timeout(timeout)
    device = Device(local) if device is None else device
    device.activate()
    own = nccl.unique_id() if rank == 0 else None
    mpi = _mpi_world() if launcher == "openmpi" and world > 1 else None
    if world == 1:
        uid = own
    elif mpi is not None:
        uid = mpi.bcast(own, root=0)
    else:
        addr, port = _master_endpoint()
        uid = exchange_unique_id(rank, world, addr, port, own, limit)
    return Communicator(rank, world, uid, device, limit)  # type: ignore[arg-type]


def _mpi_world() -> Any:
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


def _master_endpoint() -> tuple[str, int]:
    env = os.environ
    if "MASTER_ADDR" not in env or not ("MASTER_PORT" in env or "LOWGRAD_MASTER_PORT" in env):
        raise ValueError("the unique-id rendezvous needs MASTER_ADDR and MASTER_PORT (or LOWGRAD_MASTER_PORT)")
    if "LOWGRAD_MASTER_PORT" in env:
        port = int(env["LOWGRAD_MASTER_PORT"])
    else:
        port = int(env["MASTER_PORT"]) + (1 if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0)
    return env["MASTER_ADDR"], port


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return buf


def exchange_unique_id(rank: int, world: int, addr: str, port: int, uid: bytes | None,
                       timeout: float = DEFAULT_TIMEOUT) -> bytes:
    """Deliver rank 0's 128-byte ``uid`` to every rank over TCP and return it.

    Rank 0 listens on ``port`` (all interfaces) and answers each connecting rank with the id,
    returning once all ``world - 1`` peers were served; the others connect to ``addr:port``
    (retrying until rank 0 listens). Anything missing after ``timeout`` seconds raises
    CommTimeoutError; a peer with another ``world`` is a ValueError.
    """
    deadline = time.monotonic() + timeout
    if rank == 0:
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != 128:
            raise ValueError("rank 0 must pass its 128-byte unique id")
        if world > 1:
            _serve_id(world, port, bytes(uid), deadline, timeout)
        return bytes(uid)
    return _fetch_id(rank, world, addr, port, deadline, timeout)


def _serve_id(world: int, port: int, uid: bytes, deadline: float, timeout: float) -> None:
    served: set[int] = set()
    with socket.create_server(("", port), backlog=max(world, 16)) as srv:
        while len(served) < world - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, world)) - served)
                raise CommTimeoutError(f"rendezvous: rank 0 waited {timeout:g} s on port {port}; rank(s) {missing} "
                                       "never connected")
            srv.settimeout(left)
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(max(min(left, 10.0), 0.1))
                try:
                    magic, r, w = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
                except (OSError, ConnectionError, struct.error):
                    continue  # a stray or broken connection
                if magic != _MAGIC:
                    continue
                if w != world or not 0 < r < world or r in served:
                    conn.sendall(b"\x01" + bytes(128))
                    raise ValueError(f"rendezvous: rank {r} joined with world {w}; rank 0 expects world {world}"
                                     + (" (rank already joined)" if r in served else ""))
                conn.sendall(b"\x00" + uid)
                served.add(r)


def _fetch_id(rank: int, world: int, addr: str, port: int, deadline: float, timeout: float) -> bytes:
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeoutError(f"rendezvous: rank {rank} could not get the unique id from rank 0 at "
                                   f"{addr}:{port} within {timeout:g} s ({last})")
        try:
            with socket.create_connection((addr, port), timeout=min(left, 5.0)) as s:
                s.settimeout(max(left, 0.1))
                s.sendall(_HELLO.pack(_MAGIC, rank, world))
                reply = _recv_exact(s, 129)
        except (OSError, ConnectionError) as exc:
            last = exc
            time.sleep(min(0.1, max(left, 0)))
            continue
        if reply[0] != 0:
            raise ValueError(f"rendezvous: rank 0 at {addr}:{port} rejected rank {rank} with world {world}")
        return reply[1:]
