"""The rendezvous that delivers rank 0's 128-byte NCCL unique id to the other processes of a job:
the launcher's environment (torchrun, Open MPI, Slurm), mpi4py, ``NCCL_COMM_ID``, or an
authenticated TCP exchange on ``MASTER_ADDR`` (:mod:`lowgrad.launch.tcp_rendezvous`,
``docs/rendezvous.md``). Backend-neutral: the id is opaque bytes here.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from lowgrad.base.timeouts import check_timeout
from lowgrad.launch.tcp_rendezvous import check_host, exchange_unique_id, token_key


def launcher_env(environ: Mapping[str, str] | None = None) -> tuple[int, int, int, str]:
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


def unique_id_from_env(make_id: Callable[[], bytes], timeout: float | None = None,
                       environ: Mapping[str, str] | None = None) -> bytes:
    """The job's 128-byte unique id on this rank, from the launcher's environment.

    ``make_id`` creates an id (``nccl.unique_id``). With ``NCCL_COMM_ID`` set, NCCL derives the
    id from that address alone, so every rank calls ``make_id`` and nothing is exchanged.
    Otherwise rank 0 calls it and the id reaches the others by mpi4py's ``bcast`` under Open MPI
    when mpi4py is installed, else by :func:`exchange_unique_id` on ``MASTER_ADDR`` and
    ``LOWGRAD_MASTER_PORT`` (default ``MASTER_PORT``, or ``MASTER_PORT + 1`` under torchrun's
    agent store, which holds ``MASTER_PORT``), authenticated with ``LOWGRAD_RENDEZVOUS_TOKEN``
    when set, listening on ``LOWGRAD_RENDEZVOUS_BIND`` when set. ``timeout`` in seconds.

    The variables the chosen way uses are checked before ``make_id`` runs (NCCL's opens rank 0's
    bootstrap socket) and before any socket of the exchange: one that cannot be used (not an
    integer, out of range, bytes that are not UTF-8, a host name too long for DNS) is a
    ValueError naming it.
    """
    env = os.environ if environ is None else environ
    rank, world, _, launcher = launcher_env(env)
    limit = check_timeout(timeout)
    token = env.get("LOWGRAD_RENDEZVOUS_TOKEN") or None
    if env.get("NCCL_COMM_ID"):
        if token is not None:
            raise ValueError("NCCL_COMM_ID and LOWGRAD_RENDEZVOUS_TOKEN are both set: with NCCL_COMM_ID, NCCL's "
                             "bootstrap uses a fixed public id that no token protects; unset one of them")
        return make_id()
    if world == 1:
        return make_id()
    mpi = _mpi_world(rank, world) if launcher == "openmpi" else None
    if mpi is not None:
        return mpi.bcast(make_id() if rank == 0 else None, root=0)
    addr, port = _master_endpoint(env)
    key = token_key("LOWGRAD_RENDEZVOUS_TOKEN", token)
    bind = env.get("LOWGRAD_RENDEZVOUS_BIND") or None
    bind = None if bind is None else check_host("LOWGRAD_RENDEZVOUS_BIND", bind)
    own = make_id() if rank == 0 else None
    return exchange_unique_id(rank, world, addr, port, own, limit, token=key, bind=bind)


def _mpi_world(rank: int, world: int) -> Any:
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (rank, world):
        raise ValueError(f"mpi4py's COMM_WORLD is rank {comm.Get_rank()} of {comm.Get_size()}, the launcher "
                         f"says rank {rank} of {world}")
    return comm


def _master_endpoint(env: Mapping[str, str]) -> tuple[str, int]:
    """(rank 0's address, the rendezvous port) from the environment, each checked."""
    if "MASTER_ADDR" not in env or not ("MASTER_PORT" in env or "LOWGRAD_MASTER_PORT" in env):
        raise ValueError("the unique-id rendezvous needs MASTER_ADDR and MASTER_PORT (or LOWGRAD_MASTER_PORT)")
    addr = check_host("MASTER_ADDR", env["MASTER_ADDR"])
    name = "LOWGRAD_MASTER_PORT" if "LOWGRAD_MASTER_PORT" in env else "MASTER_PORT"
    try:
        port = int(env[name])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None
    if not 0 < port < 65536:
        raise ValueError(f"{name} must be in [1, 65535], got {port}")
    if name == "MASTER_PORT" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        if port == 65535:
            raise ValueError("MASTER_PORT is 65535: under torchrun's agent store, which holds MASTER_PORT, lowgrad "
                             "takes MASTER_PORT + 1; use a lower MASTER_PORT or set LOWGRAD_MASTER_PORT")
        port += 1
    return addr, port
