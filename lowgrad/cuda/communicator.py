"""The NCCL communicator of the CUDA backend.

A :class:`Communicator` is created non-blocking (``ncclCommInitRankConfig`` with
``blocking=0``) and polled with a timeout. Every collective is asynchronous: it queues NCCL
work on the given stream (``None``: the device's default stream, the CUDA legacy stream;
inside :meth:`Communicator.group`: the group's stream) and returns. :meth:`Communicator.wait`
blocks on an event or stream while watching ``ncclCommGetAsyncError``: an asynchronous error
or a timeout aborts the communicator and raises, never hangs.

Memory: tensors must be CUDA device memory (``kind="device"``) on the communicator's device.
NCCL's handling of mapped pinned host memory differs across versions and transports (copy
engine collectives, registration, NVLS), so pinned/write-combined tensors raise
``ValueError("NCCL needs device memory here")``; stage them through a device buffer.

Ranks must agree on calls, dtypes and sizes; NCCL cannot check this across ranks (a mismatch
hangs until a ``wait`` times out). The host backend checks it.

A rank that leaves (:meth:`Communicator.close`) cannot tell its peers: NCCL has no side channel
for it. A peer still waiting for a collective the departed rank never issued raises
CommTimeoutError after its ``timeout`` (or CommAbortedError at once when its ``abort_event`` is
set, as :func:`~lowgrad.run_threads` does when a rank fails: then with the reason it was given,
``rank 1 failed: RuntimeError: boom; the communicator was aborted``). A ``timeout`` of ``inf`` removes
that bound: use it only when something else watches the job.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lowgrad.core import capture, release
from lowgrad.core.communicator import Group, all_to_all_schedule
from lowgrad.core.dtypes import byte, fp8_e4m3
from lowgrad.core.errors import CommAbortedError, NcclError
from lowgrad.core.streams import StreamLike
from lowgrad.core.tensor import Tensor
from lowgrad.core.threads import AbortEvent
from lowgrad.cuda import nccl
from lowgrad.cuda.gpu_comm import GpuCommBase


class Communicator(GpuCommBase):
    """Rank ``rank`` of ``world`` on ``device`` (a :class:`lowgrad.Device`), joined by every rank
    passing the same 128-byte ``unique_id`` (:func:`lowgrad.cuda.nccl.unique_id` on one rank).

    ``timeout`` (seconds, ``inf`` for no limit) bounds initialisation, the polling of in-progress NCCL calls and
    :meth:`wait`. Setting ``abort_event`` (a ``threading.Event``) from any thread aborts a
    pending initialisation or wait (``run_threads`` uses it when another rank fails; an
    :class:`~lowgrad.core.threads.AbortEvent` also gives the reason every later call raises).
    """

    def __init__(self, rank: int, world: int, unique_id: bytes, device: Any, timeout: float | None = None,
                 abort_event: threading.Event | None = None) -> None:
        if getattr(device, "backend", None) != "cuda":
            raise TypeError(f"Communicator needs a CUDA lowgrad.Device, got {device!r} (use HostCommunicator "
                            "for the host backend)")
        self._init_base(rank, world, device, timeout)
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != nccl.UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id must be {nccl.UNIQUE_ID_BYTES} bytes (lowgrad.cuda.nccl.unique_id())")
        nccl.lib()
        self._lock = threading.Lock()
        self._abort_event = abort_event
        self._fp8 = nccl.version() >= (2, 24, 0)
        self._tmp: dict[str, Tensor] = {}
        device.activate()
        self.handle, rc = nccl.comm_init_rank(world, bytes(unique_id), rank, blocking=False)
        self._finalizer = release.Finalizer(self, _abort_handle, self.handle)  # GC: queued, not run
        try:
            self._settle("ncclCommInitRankConfig", rc, self.timeout)
        except NcclError as exc:
            if "Duplicate GPU" not in exc.last_error:
                raise
            raise NcclError(exc.call, exc.code, exc.name, exc.message + "; NCCL runs one rank per GPU: for several "
                            "ranks on one GPU use lowgrad.run_threads(..., share_gpu=True) (one process, the "
                            "loopback communicator)", exc.last_error) from None

    # ---- plumbing ----------------------------------------------------------------------
    def _check_memory(self, call: str, t: Tensor) -> None:
        if t.kind != "device":
            raise ValueError(f"{call}: tensor {t.name!r} is {t.kind} memory: NCCL needs device memory here")
        if t.dtype is fp8_e4m3 and not self._fp8:
            raise TypeError(f"{call}: fp8_e4m3 needs NCCL >= 2.24, loaded {nccl.version()}")
        capture.keep_tensors(t)  # a graph being captured holds the buffers its NCCL calls use

    def _fail(self, exc: Exception) -> Exception:
        self.abort()
        return exc

    def _settle(self, call: str, rc: int, timeout: float) -> None:
        """After a call returned ncclInProgress: poll until NCCL has taken it (or fail)."""
        if rc == nccl.IN_PROGRESS:
            self._poll(call, timeout, lambda: self._async_state(call) == nccl.SUCCESS)

    def _async_state(self, call: str) -> int:
        """``ncclCommGetAsyncError`` of the open communicator (an NCCL error aborts and raises)."""
        self._check_abort_event(call)
        with self._lock:  # abort() from another thread may release the handle
            if self._state != "open":
                raise self._failure() or CommAbortedError(f"{call}: communicator rank {self.rank} was aborted")
            state = nccl.comm_get_async_error(self.handle)
        if state not in (nccl.SUCCESS, nccl.IN_PROGRESS):
            raise self._fail(nccl.error(call, state, self.handle))
        return state

    def _watch(self, call: str) -> None:
        self._async_state(call)

    def _failure(self) -> Exception | None:
        ev = self._abort_event
        reason = ev.reason if isinstance(ev, AbortEvent) else None
        return None if reason is None else CommAbortedError(reason)

    def _check_abort_event(self, call: str) -> None:
        if self._abort_event is not None and self._abort_event.is_set():
            self.abort()
            raise self._failure() or CommAbortedError(f"{call}: communicator rank {self.rank} aborted (another rank "
                                                      "failed)")

    def _issue(self, call: str, rc: int) -> None:
        if self._group is not None:
            self._group.scheduled += 1
        if rc:
            self._settle(call, rc, self.timeout)

    # ---- collectives (asynchronous, on `stream`) ---------------------------------------
    def reduce_scatter(self, t: Tensor, op: str = "avg", stream: StreamLike = None) -> None:
        """In place: ``t`` is the full buffer; afterwards ``shard_view(t, rank, world)`` (flat
        elements ``[rank*n, (rank+1)*n)``, n = numel/world) holds the ``avg`` or ``sum``."""
        count, code = self._rs_args(t, op)
        h = self._stream(stream)
        p = t.ptr
        with self._lock:
            self._live("reduce_scatter")
            rc = nccl.reduce_scatter(p, p + self.rank * count * t.dtype.itemsize, count, t.dtype.nccl, code,
                                     self.handle, h)
        self._issue("ncclReduceScatter", rc)

    def all_gather(self, t: Tensor, out: Tensor | None = None, stream: StreamLike = None) -> None:
        """In place (``t`` full, own shard already at ``shard_view(t, rank, world)``) or from
        shard ``t`` into ``out`` (``world * t.numel`` elements, rank order)."""
        shard, full = self._ag_args(t, out)
        h = self._stream(stream)
        with self._lock:
            self._live("all_gather")
            rc = nccl.all_gather(shard.ptr, full.ptr, shard.numel, t.dtype.nccl, self.handle, h)
        self._issue("ncclAllGather", rc)

    def all_reduce(self, t: Tensor, op: str = "sum", stream: StreamLike = None) -> None:
        """In place: every rank's ``t`` becomes the ``sum``, ``avg`` or ``max`` over ranks."""
        code = self._ar_args(t, op)
        h = self._stream(stream)
        p = t.ptr
        with self._lock:
            self._live("all_reduce")
            rc = nccl.all_reduce(p, p, t.numel, t.dtype.nccl, code, self.handle, h)
        self._issue("ncclAllReduce", rc)

    def send(self, t: Tensor, peer: int, stream: StreamLike = None) -> None:
        """Send ``t`` to ``peer`` (pair it with the peer's ``recv``; inside ``group()`` when
        both sides also receive)."""
        self._p2p("send", "ncclSend", nccl.send, t, peer, stream)

    def recv(self, t: Tensor, peer: int, stream: StreamLike = None) -> None:
        """Receive ``t.numel`` elements from ``peer`` into ``t``."""
        self._p2p("recv", "ncclRecv", nccl.recv, t, peer, stream)

    def _p2p(self, call: str, nccl_call: str, fn: Callable[[int, int, int, int, int, int], int], t: Tensor,
             peer: int, stream: StreamLike) -> None:
        """send/recv: ``fn`` is :func:`nccl.send` or :func:`nccl.recv` (same signature)."""
        peer = self._p2p_args(call, t, peer)
        h = self._stream(stream)
        with self._lock:
            self._live(call)
            rc = fn(t.ptr, t.numel, t.dtype.nccl, peer, self.handle, h)
        self._issue(nccl_call, rc)

    def all_to_all_many(self, tensors: Sequence[Tensor], stream: StreamLike = None) -> None:
        """:meth:`all_to_all` of several buffers at once (a layer's gradients): the same
        ``world - 1`` steps, each one NCCL group holding every buffer's send and recv."""
        bufs = [(t.ptr, n, n * t.dtype.itemsize, t.dtype.nccl) for t, n in ((t, self._a2a_args(t)) for t in tensors)]
        h = self._stream(stream)
        for send_peer, send_slot, recv_peer, recv_slot in all_to_all_schedule(self.rank, self.world):
            with self._lock:
                self._live("all_to_all")
                nccl.group_start()
                try:
                    for base, n, nbytes, dt in bufs:
                        nccl.send(base + send_slot * nbytes, n, dt, send_peer, self.handle, h)
                        nccl.recv(base + recv_slot * nbytes, n, dt, recv_peer, self.handle, h)
                finally:
                    rc = nccl.group_end()
            if rc:
                self._settle("ncclGroupEnd", rc, self.timeout)

    # ---- groups ------------------------------------------------------------------------
    def _group_begin(self, g: Group) -> None:
        self._group_open(g)
        try:
            nccl.group_start()
        except NcclError:
            self._group, self._group_depth = None, 0
            raise

    def _group_close(self, g: Group, failed: bool) -> None:
        with self._lock:
            rc = nccl.group_end()
        if not failed:
            self._settle("ncclGroupEnd", rc, self.timeout)

    # ---- host-side helpers (blocking) --------------------------------------------------
    def _scratch(self, name: str, nbytes: int) -> Tensor:
        t = self._tmp.get(name)
        if t is None or t.nbytes < nbytes:
            if t is not None:
                t.close()
            t = self._tmp[name] = self.device.alloc((max(nbytes, 256),), byte, name=f"comm_{name}")
        return t

    def _host_buffer(self, name: str, nbytes: int) -> AbstractContextManager[Tensor]:
        """Kept between calls (a cudaFree would synchronize the device), freed by close/abort."""
        return nullcontext(self._scratch(name, nbytes).view(0, nbytes))

    def _host_gather(self, buf: Tensor) -> None:
        """On the legacy stream, which orders it after every blocking stream's work."""
        self.all_gather(buf, stream=0)
        self.wait(0)

    def barrier(self) -> None:
        """Return once every rank has reached the barrier (an all-reduce and a wait)."""
        self._check_open("barrier")
        self._check_not_grouped("barrier")
        t = self._scratch("barrier", 4).view(0, 4)
        self.all_reduce(t, "max", stream=0)
        self.wait(0)

    # ---- lifetime ----------------------------------------------------------------------
    def _live(self, call: str) -> None:
        if self._state != "open":
            self._check_open(call)

    def abort(self) -> None:
        """``ncclCommAbort`` (safe from any thread; idempotent): outstanding NCCL work stops,
        later calls and pending waits raise CommAbortedError. NCCL frees the communicator's
        device memory, which waits for work queued on the device's other streams."""
        with self._lock:  # after this no thread touches the handle again
            if self._state != "open":
                return
            self._state = "aborted"
        self._finalizer()
        self._free_scratch()

    def close(self) -> None:
        """Finalize and destroy the communicator after its queued work (bounded by ``timeout``;
        on timeout it is aborted). Idempotent. Peers are not told (see the module docstring)."""
        if self._state != "open":
            return
        self._free_scratch()
        self.device.activate()
        with self._lock:
            rc = nccl.comm_finalize(self.handle)
        self._settle("ncclCommFinalize", rc, self.timeout)
        with self._lock:
            if self._state != "open":
                return
            self._state = "closed"
            self._finalizer.detach()
            nccl.comm_destroy(self.handle)

    def _free_scratch(self) -> None:
        for t in self._tmp.values():
            t.close()
        self._tmp.clear()


def _abort_handle(handle: int) -> None:
    nccl.comm_abort(handle)
