"""Starting communicators: N ranks as threads of one process (:func:`run_threads`), or one
process per GPU from the launcher's environment (:func:`from_env`: torchrun, Open MPI, Slurm;
the unique id travels through :mod:`lowgrad.launch.rendezvous`). The one module that picks a
backend by name.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from lowgrad.base.errors import CommAbortedError
from lowgrad.base.integers import integer
from lowgrad.base.timeouts import check_timeout
from lowgrad.contracts.backend import DeviceBase
from lowgrad.contracts.communicator import CommBase
from lowgrad.launch.rendezvous import launcher_env, unique_id_from_env
from lowgrad.runtime.threads import AbortEvent

_GRACE = 5.0  # seconds the other ranks get to unwind after a failure before the caller raises
# a backend's ranks: make(rank, failed) builds rank's communicator; tell(reason) fails the whole
# group with ``reason`` before the communicators are aborted, so that every rank hears it
_Factory = Callable[[int, AbortEvent], CommBase]
_Tell = Callable[[str], None]


def run_threads(world: int, fn: Callable[[Any], Any], backend: str = "host",
                timeout: float | None = None, share_gpu: Any = False) -> list[Any]:
    """Run ``fn(comm)`` on ranks ``0 .. world-1``, one thread each, and return the results in
    rank order.

    ``backend="host"``: a :class:`~lowgrad.HostDevice` and :class:`~lowgrad.HostCommunicator` per
    rank. ``backend="cuda"``: rank r drives ``Device(r)`` with a :class:`~lowgrad.Communicator`
    (one shared unique id); ``world`` above the GPU count is a ValueError. ``share_gpu=True``
    (CUDA only; or the :class:`~lowgrad.Device` to share) puts every rank on ``Device(0)`` with a
    :class:`~lowgrad.cuda.loopback.LoopbackCommunicator` instead: each rank has its own
    streams, events and allocations, and the collectives run as device copies and reduction
    kernels ordered on the device (a test and development vehicle for world > 1 on one GPU;
    results equal the host backend's bit for bit). Communicators are
    closed when ``fn`` returns. An exception in any rank aborts every other rank's
    communicator and is re-raised here (its notes name the rank); the other ranks' calls raise
    CommAbortedError saying which rank failed and why (``rank 1 failed: RuntimeError: boom; the
    communicator was aborted``). Ranks that do not
    unwind within a few seconds of the failure are left behind as daemon threads.
    ``timeout`` (seconds) bounds initialisation and every wait of the communicators. Each
    communicator says ``ranks_are_threads`` (what a per-process facility such as
    ``torch.distributed``'s process group cannot serve: ``lowgrad.torch.init_process_group``).
    """
    world = integer("world", world)
    if world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if backend not in ("host", "cuda"):
        raise ValueError(f"backend must be 'host' or 'cuda', got {backend!r}")
    if share_gpu is not False and backend != "cuda":
        raise ValueError("share_gpu=True needs backend='cuda' (host ranks share the CPU already)")
    limit = check_timeout(timeout)
    if backend == "host":
        make, tell = _host_factory(world, limit)
    else:
        make, tell = _cuda_factory(world, limit) if share_gpu is False else _loopback_factory(world, limit, share_gpu)

    failed = AbortEvent()
    comms: list[CommBase | None] = [None] * world
    results: list[Any] = [None] * world
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def fail_all(reason: str) -> None:
        tell(reason)  # first: a rank that sees ``failed`` aborts its new communicator, whose reason must lose
        failed.abort(reason)
        for c in list(comms):
            if c is not None:
                try:
                    c.abort()
                except Exception:  # noqa: BLE001 - a failing abort must not hide the original error
                    pass

    def body(rank: int) -> None:
        try:
            comm = make(rank, failed)
            comm.ranks_are_threads = True
            comms[rank] = comm
            if failed.is_set():
                comm.abort()
            results[rank] = fn(comm)
            comm.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            with lock:
                errors.append((rank, exc))
            fail_all(f"rank {rank} failed: {_describe(exc)}; the communicator was aborted")

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
    except BaseException as interrupt:
        fail_all(f"run_threads was interrupted in the calling thread ({_describe(interrupt)}); the communicator "
                 "was aborted")
        raise
    if errors:
        primary = next(((r, e) for r, e in errors if not isinstance(e, CommAbortedError)), errors[0])
        rank, exc = primary
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised in rank {rank} of {world} ({backend} backend, lowgrad.run_threads)")
        raise exc
    return results


def _describe(exc: BaseException) -> str:
    """``Type: message`` (just ``Type`` when the message is empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _host_factory(world: int, timeout: float) -> tuple[_Factory, _Tell]:
    from lowgrad.host.communicator import HostCommunicator
    from lowgrad.host.device import HostDevice
    from lowgrad.runtime.threads import ThreadCollective

    collective = ThreadCollective(world, timeout)
    return (lambda rank, _failed: HostCommunicator(rank, world, collective, HostDevice(f"host{rank}"), timeout),
            collective.abort)


def _cuda_factory(world: int, timeout: float) -> tuple[_Factory, _Tell]:
    from lowgrad.cuda import driver, nccl
    from lowgrad.cuda.communicator import Communicator
    from lowgrad.cuda.device import Device, device_count

    driver.driver()  # CudaUnavailableError with the reason, not "0 GPUs visible"
    count = device_count()
    if world > count:
        raise ValueError(f"run_threads(world={world}, backend='cuda') needs {world} GPUs, {count} visible")
    uid = nccl.unique_id()

    def make(rank: int, failed: AbortEvent) -> CommBase:
        dev = Device(rank)
        dev.activate()
        return Communicator(rank, world, uid, dev, timeout, abort_event=failed)
    # NCCL ranks share nothing else: ``failed`` aborts their waits and carries the reason
    return make, lambda _reason: None


def _loopback_factory(world: int, timeout: float, share: Any) -> tuple[_Factory, _Tell]:
    from lowgrad.cuda.device import Device
    from lowgrad.cuda.loopback import LoopbackCommunicator, LoopbackGroup

    dev: DeviceBase
    if share is True:
        # one hardware queue per stream: ranks that wait on each other on the device must not
        # queue behind each other (read when the CUDA context is created)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
        dev = Device(0)
    elif isinstance(share, DeviceBase):
        dev = share
    else:
        raise TypeError(f"share_gpu must be True, False or a lowgrad Device, got {share!r}")
    group = LoopbackGroup(dev, world, timeout)

    def make(rank: int, _failed: AbortEvent) -> CommBase:
        dev.activate()
        return LoopbackCommunicator(rank, group, timeout)
    return make, group.abort


def from_env(device: Any = None, timeout: float | None = None) -> Any:
    """A :class:`~lowgrad.Communicator` for this process from the launcher's environment.

    ``device`` defaults to ``Device(local_rank)``; the unique id comes from
    :func:`unique_id_from_env`. ``timeout`` (seconds) bounds the rendezvous and every wait.
    """
    from lowgrad.cuda import nccl
    from lowgrad.cuda.communicator import Communicator
    from lowgrad.cuda.device import Device, device_count

    rank, world, local, _ = launcher_env()
    limit = check_timeout(timeout)
    if device is None:
        count = device_count()
        if 0 < count <= local:  # (no GPU at all: Device says why, CudaUnavailableError)
            raise ValueError(f"from_env: local rank {local} needs GPU {local}, but {count} GPU(s) are visible; NCCL "
                             "runs one rank per GPU (start at most one process per GPU, or run every rank of one "
                             "process on one GPU with run_threads(..., share_gpu=True))")
        device = Device(local)
    device.activate()
    uid = unique_id_from_env(nccl.unique_id, limit)
    return Communicator(rank, world, uid, device, limit)
