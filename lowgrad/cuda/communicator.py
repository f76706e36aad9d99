"""The NCCL communicator of the CUDA backend.

Two modes, chosen per communicator (``blocking=``; default: ``LOWGRAD_NCCL_BLOCKING``, ``0``
when unset):

- **non-blocking** (the default, :data:`DEFAULT_BLOCKING`; ``blocking=False``,
  ``LOWGRAD_NCCL_BLOCKING=0``): every call that returns ``ncclInProgress`` is polled until NCCL
  has taken it (sleeps from 20 us, doubling), in the calling thread; no watchdog. The default
  because it is the mode proven on hardware: the GPU suite passed in it on the H200 before issue
  33, and on an H100 (2026-12-06) both modes ran the suite with the same few, explained failures
  (later runs that day, in this mode: every NCCL test passed);
  the blocking mode has never run at world 2 on two GPUs (docs/design.md says what would make it
  the default).
- **blocking** (opt-in, ``blocking=True``, ``LOWGRAD_NCCL_BLOCKING=1``; PyTorch's
  ProcessGroupNCCL's choice): NCCL calls return once their work is queued, with no thread and no
  poll per call. NCCL's ``ncclGroupEnd`` hands every launch that involves a peer of a
  *non-blocking* communicator to a new thread and returns ``ncclInProgress``, which the caller
  must then poll: a thread creation and a sleeping poll per collective at world >= 2. Instead a
  :class:`~lowgrad.runtime.watchdog.Watchdog` thread per communicator bounds what the issuing
  thread no longer watches: the work each call queued (a CUDA event recorded after it, from a
  ring made once; at world 1 no peer can leave a call unfinished, so none is recorded), a call
  blocked in the host (NCCL's lazy connection setup at the first call with a peer),
  ``ncclCommGetAsyncError`` and the ``abort_event``. When ``timeout`` passes, it calls
  ``ncclCommAbort`` (which also ends a call stuck in the host) and every later call raises its
  reason. Initialisation stays bounded by ``timeout``: the communicator is made non-blocking and
  polled, then split (``ncclCommSplit``) into the blocking one it uses.

On a non-blocking communicator NCCL may answer any call (init, split, finalize, a collective, a
group's end) with ``ncclInProgress``, and a split even with ncclSuccess while it still runs (NCCL
2.28); the communicator refuses every other call until ``ncclCommGetAsyncError`` reports
ncclSuccess, and a split's child exists only from then on. So every such point is polled to
ncclSuccess (bounded by ``timeout`` and the ``abort_event``) before the next call.

Every collective is asynchronous: it queues NCCL work on the given stream (``None``: the device's
default stream, the CUDA legacy stream; inside :meth:`Communicator.group`: the group's stream)
and returns. :meth:`Communicator.wait` blocks on an event or stream while watching
``ncclCommGetAsyncError``: an asynchronous error or a timeout aborts the communicator and
raises, never hangs.

Memory: tensors must be CUDA device memory (``kind="device"``) on the communicator's device.
NCCL's handling of mapped pinned host memory differs across versions and transports (copy
engine collectives, registration, NVLS), so pinned/write-combined tensors raise
``ValueError("NCCL needs device memory here")``; stage them through a device buffer.

Ranks must agree on calls, dtypes and sizes; NCCL cannot check this across ranks (a mismatch
hangs until the watchdog or a ``wait`` times out). The host backend checks it.

A rank that leaves (:meth:`Communicator.close`) cannot tell its peers: NCCL has no side channel
for it. A peer still waiting for a collective the departed rank never issued raises
CommTimeoutError after its ``timeout`` (or CommAbortedError at once when its ``abort_event`` is
set, as :func:`~lowgrad.run_threads` does when a rank fails: then with the reason it was given,
``rank 1 failed: RuntimeError: boom; the communicator was aborted``). A ``timeout`` of ``inf`` removes
that bound: use it only when something else watches the job.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

from lowgrad.base.dtypes import byte, fp8_e4m3
from lowgrad.base.errors import CommAbortedError, NcclError
from lowgrad.buffers import capture, release
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.communicator import Group, all_to_all_schedule
from lowgrad.cuda import nccl
from lowgrad.cuda.gpu_comm import GpuCommBase
from lowgrad.runtime.threads import AbortEvent
from lowgrad.runtime.watchdog import Watchdog

BLOCKING_ENV = "LOWGRAD_NCCL_BLOCKING"
DEFAULT_BLOCKING = False  # the mode last proven on hardware (the module docstring)
_RING = 256  # events per communicator: calls whose completion the watchdog can tell apart
# seconds an abort waits for the communicator's lock: a call holding it longer is blocked in the
# host inside NCCL (connection setup), and only ncclCommAbort, which cannot wait for it, ends it
_LOCK_WAIT = 0.2
# the ncclComm_t cells of non-blocking splits given up before NCCL filled them (a timeout, an
# abort): NCCL's thread may still write one, so each is kept for the process's life (8 bytes)
_ABANDONED_CELLS: list[Any] = []


def blocking_mode(blocking: Any = None) -> bool:
    """``blocking`` (a bool), or with None ``LOWGRAD_NCCL_BLOCKING``: ``1`` or ``0``, unset (or
    empty) :data:`DEFAULT_BLOCKING`; anything else is a ValueError (a TypeError for a non-bool
    argument)."""
    if blocking is None:
        env = os.environ.get(BLOCKING_ENV, "").strip()
        if env not in ("", "0", "1"):
            raise ValueError(f"{BLOCKING_ENV} must be 1 (blocking NCCL calls and a watchdog) or 0 (non-blocking, "
                             f"polled), got {env!r}")
        return DEFAULT_BLOCKING if env == "" else env == "1"
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True, False or None ({BLOCKING_ENV}), got {blocking!r}")
    return blocking


class Communicator(GpuCommBase):
    """Rank ``rank`` of ``world`` on ``device`` (a :class:`lowgrad.Device`), joined by every rank
    passing the same 128-byte ``unique_id`` (:func:`lowgrad.cuda.nccl.unique_id` on one rank).

    ``timeout`` (seconds, ``inf`` for no limit) bounds initialisation, every call's work (the
    watchdog; in non-blocking mode the polling of in-progress NCCL calls) and :meth:`wait`.
    Setting ``abort_event`` (a ``threading.Event``) from any thread aborts a pending
    initialisation or wait (``run_threads`` uses it when another rank fails; an
    :class:`~lowgrad.runtime.threads.AbortEvent` also gives the reason every later call raises).
    ``blocking``: see the module docstring (None: ``LOWGRAD_NCCL_BLOCKING``, non-blocking when unset).
    """

    def __init__(self, rank: int, world: int, unique_id: bytes, device: Any, timeout: float | None = None,
                 abort_event: threading.Event | None = None, blocking: bool | None = None) -> None:
        if getattr(device, "backend", None) != "cuda":
            raise TypeError(f"Communicator needs a CUDA lowgrad.Device, got {device!r} (use HostCommunicator "
                            "for the host backend)")
        mode = blocking_mode(blocking)
        self._init_base(rank, world, device, timeout)
        if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != nccl.UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id must be {nccl.UNIQUE_ID_BYTES} bytes (lowgrad.cuda.nccl.unique_id())")
        nccl.lib()
        self._prepare(abort_event, mode)
        device.activate()
        # always made non-blocking: only a polled initialisation is bounded by the timeout (a
        # blocking one gives no handle to abort until it returns)
        handle, rc = nccl.comm_init_rank(world, bytes(unique_id), rank, blocking=False)
        self._adopt(handle)
        try:
            self._settle("ncclCommInitRankConfig", rc, self.timeout)
        except NcclError as exc:
            if "Duplicate GPU" not in exc.last_error:
                raise
            raise NcclError(exc.call, exc.code, exc.name, exc.message + "; NCCL runs one rank per GPU: for several "
                            "ranks on one GPU use lowgrad.run_threads(..., share_gpu=True) (one process, the "
                            "loopback communicator)", exc.last_error) from None
        if mode:
            try:
                self._become_blocking()
            except BaseException:
                self.abort()
                raise

    def _prepare(self, abort_event: threading.Event | None, blocking: bool) -> None:
        """The state every communicator (made or split) starts with, before its handle."""
        self.blocking = blocking
        self._lock = threading.Lock()
        self._abort_event = abort_event
        self._fp8 = nccl.version() >= (2, 24, 0)
        self._tmp: dict[str, Tensor] = {}
        self._wd: Watchdog | None = None
        self._children: weakref.WeakSet[Communicator] = weakref.WeakSet()  # what split made: aborted with it
        # an NCCL group of this communicator is open on the issuing thread (ncclGroupStart
        # returned, ncclGroupEnd not called yet); an abort meanwhile is only marked
        # (``_abort_deferred``) and the group's end aborts the handle after ncclGroupEnd
        self._grouped = False
        self._abort_deferred = False
        self._call = _HostCall(self)

    def _adopt(self, handle: int) -> None:
        """Own ``handle`` (its release is queued when the communicator is collected unclosed)."""
        with self._lock:
            old = getattr(self, "_finalizer", None)
            self.handle = handle
            self._finalizer = release.Finalizer(self, _release, weakref.ref(self), handle, self._wd)
        if old is not None:
            old.detach()

    def _start_watchdog(self) -> None:
        """The watchdog thread (blocking mode); it holds the communicator only weakly."""
        streams = self.world > 1  # at world 1 no peer can leave a call's work unfinished
        markers = [self.device.event(name=f"nccl_watch{i}") for i in range(_RING if streams else 1)]
        ref = weakref.ref(self)
        self._wd = Watchdog(f"NCCL communicator rank {self.rank} of {self.world}", self.timeout, markers,
                            partial(_health_of, ref), partial(_abort_of, ref),
                            on_start=self.device.relax_thread_capture_mode)
        self._call.watch(self._wd, streams)
        with self._lock:
            self._finalizer.detach()
            self._finalizer = release.Finalizer(self, _release, ref, self.handle, self._wd)

    def _become_blocking(self) -> None:
        """Replace the non-blocking handle by a blocking split of it (every rank, same color);
        the watchdog bounds the split, which blocks the host until every rank has called it."""
        self._start_watchdog()
        parent = self.handle
        child = self._split_handle(0, self.rank)
        self._adopt(child)
        self._retire(parent)

    def _split_handle(self, color: int, key: int) -> int:
        """``ncclCommSplit`` of this communicator's handle into a child of this mode, settled.
        On a non-blocking handle the split runs on NCCL's thread even when the call returned
        ncclSuccess (NCCL 2.28 does: its group's ncclInProgress is not passed on): the handle
        refuses every call until its asynchronous state is ncclSuccess, and NCCL hands out the
        child only then. So the handle is polled first (bounded by the timeout and the abort
        event; a blocking one answers ncclSuccess at once), then the child until it is ready."""
        with self._lock:
            self._live("split")
            with self._call(None):
                cell, _ = nccl.comm_split(self.handle, color, key, self.blocking)
        handle = 0
        try:
            self._until_ready("ncclCommSplit", self.timeout)  # whatever the split returned
            handle = cell.value or 0
            if not handle:
                raise NcclError("ncclCommSplit", 3, "ncclInternalError", "the split completed without a communicator",
                                "")
            self._poll("ncclCommSplit", self.timeout, partial(_settled, "ncclCommSplit", handle))
        except BaseException:
            if handle:
                nccl.comm_abort(handle)
            else:
                _ABANDONED_CELLS.append(cell)  # NCCL's thread may still write it
            raise
        return handle

    def _retire(self, handle: int) -> None:
        """Finalize and destroy the non-blocking ``handle`` this communicator was split from (its
        split has completed, so it has no work left): ncclCommFinalize may return ncclInProgress,
        and the handle is destroyed only once its state is ncclSuccess; aborted when that fails
        or takes longer than the timeout."""
        try:
            rc = nccl.comm_finalize(handle)
            if rc == nccl.IN_PROGRESS:
                self._poll("ncclCommFinalize", self.timeout, partial(_settled, "ncclCommFinalize", handle))
        except BaseException:
            nccl.comm_abort(handle)
            raise
        nccl.comm_destroy(handle)

    def _split(self, color: int, key: int) -> Communicator:
        """:meth:`CommBase.split` on NCCL (arguments checked there): ``ncclCommSplit``. The
        child has this device, timeout, mode and ``abort_event``, its own watchdog, and is closed
        independently of this one; an abort of this one aborts it too."""
        capture.forbid("Communicator.split")
        self.device.activate()
        child = Communicator.__new__(Communicator)
        child._init_base(0, 1, self.device, self.timeout)
        child._prepare(self._abort_event, self.blocking)
        handle = self._split_handle(color, key)
        child._adopt(handle)
        child.rank, child.world = nccl.comm_rank_world(handle)
        if child.blocking:
            child._start_watchdog()
        self._children.add(child)
        return child

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
            self._until_ready(call, timeout)

    def _until_ready(self, call: str, timeout: float) -> None:
        """Poll until the communicator's asynchronous state is ncclSuccess (or fail)."""
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
        if reason is not None:
            return CommAbortedError(reason)
        wd = self._wd
        return None if wd is None else wd.error()

    def _why(self, exc: NcclError) -> Exception:
        """What a failed NCCL call raises: the watchdog's reason when it aborted the call."""
        return self._failure() or exc if self._state == "aborted" else exc

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
            with self._call(h):
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
            with self._call(h):
                rc = nccl.all_gather(shard.ptr, full.ptr, shard.numel, t.dtype.nccl, self.handle, h)
        self._issue("ncclAllGather", rc)

    def all_reduce(self, t: Tensor, op: str = "sum", stream: StreamLike = None) -> None:
        """In place: every rank's ``t`` becomes the ``sum``, ``avg`` or ``max`` over ranks."""
        code = self._ar_args(t, op)
        h = self._stream(stream)
        p = t.ptr
        with self._lock:
            self._live("all_reduce")
            with self._call(h):
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
            with self._call(h):
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
                self._grouped = True  # an abort meanwhile waits for the lock: these calls only queue
                try:
                    for base, n, nbytes, dt in bufs:
                        nccl.send(base + send_slot * nbytes, n, dt, send_peer, self.handle, h)
                        nccl.recv(base + recv_slot * nbytes, n, dt, recv_peer, self.handle, h)
                finally:
                    rc = self._launch_group(h)
            if rc:
                self._settle("ncclGroupEnd", rc, self.timeout)

    # ---- groups ------------------------------------------------------------------------
    def _group_begin(self, g: Group) -> None:
        self._group_open(g)
        try:
            with self._lock:
                self._live("group")
                nccl.group_start()
                self._grouped = True
        except BaseException:
            self._group, self._group_depth = None, 0
            raise

    def _group_close(self, g: Group, failed: bool) -> None:
        """``ncclGroupEnd`` (every ncclGroupStart is matched, also after a failure or an abort).
        An abort that came while the group was open was only marked (:meth:`_mark_aborted`):
        the handle is aborted here, after ncclGroupEnd, and the group raises its reason. That
        ncclGroupEnd is bounded as any call: when it blocks the host for ``_LOCK_WAIT`` (a
        connection to a dead peer) the abort comes at once from a timer thread, which ends it.
        Until the group ends the handle is not aborted: a host sync inside the group, on work that
        waits for a dead peer, is not ended by the watchdog."""
        timer = None
        try:
            with self._lock:
                if self._abort_deferred:
                    self._abort_deferred = False
                    timer = threading.Timer(_LOCK_WAIT, self._finalizer)
                    timer.start()
                rc = self._launch_group(None if failed or timer is not None else stream_handle(g.stream))
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()  # a timer's abort in progress ends before this one returns
                self._finalizer()  # _release: ncclCommAbort (idempotent)
        if timer is not None:
            if not failed:  # a block that failed keeps its own exception (often this reason already)
                self._check_open("group")  # the reason of the abort
        elif not failed:
            self._settle("ncclGroupEnd", rc, self.timeout)

    def _launch_group(self, stream: int | None) -> int:
        """``ncclGroupEnd`` under the lock, watched (its work queued on ``stream``; None: none).
        From here an abort no longer waits for the group: this call may block the host."""
        self._grouped = False
        with self._call(stream):
            rc = nccl.group_end()
        return rc

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
        later calls and pending waits raise CommAbortedError (the watchdog's reason when it was
        the watchdog). A call blocked in the host inside NCCL returns. NCCL frees the
        communicator's device memory, which waits for work queued on the device's other streams
        (so what was split from it is aborted first). While the issuing thread has a
        :meth:`group` open, the handle is aborted at the group's end, after its ncclGroupEnd."""
        self._abort()
        self._free_scratch()
        self._stop_watchdog()

    def _abort(self) -> None:
        """Mark the communicator aborted and abort the handle (:func:`_release`), or with a
        group open leave the handle to the group's end; what was split from it is aborted
        first either way (every backend aborts it with its parent)."""
        now = self._mark_aborted()
        if now:
            self._finalizer()
        elif now is not None:
            for child in list(self._children):
                child._abort()

    def _mark_aborted(self) -> bool | None:
        """Set the state to aborted (after this no thread starts a call on the handle): None when
        it was not open, False when the handle's abort is left to the open group's end, True
        when it is due now. The lock is waited for only briefly: a call that holds it longer is
        blocked inside NCCL, and the abort is what ends it (NCCL's abort flag), except while
        that call only queues into an open group (ncclSend/ncclRecv there never block)."""
        locked = self._lock.acquire(timeout=_LOCK_WAIT)
        while not locked and self._grouped:
            locked = self._lock.acquire(timeout=_LOCK_WAIT)
        try:
            if self._state != "open":
                return None
            self._state = "aborted"
            self._abort_deferred = locked and self._grouped  # no NCCL call in progress: the group ends it
            return not self._abort_deferred
        finally:
            if locked:
                self._lock.release()

    def close(self) -> None:
        """Finalize and destroy the communicator after its queued work (bounded by ``timeout``;
        on timeout it is aborted), and end its watchdog. Idempotent. Peers are not told (see the
        module docstring)."""
        try:
            if self._state != "open":
                return
            self.device.activate()
            with self._lock:
                with self._call(None):
                    rc = nccl.comm_finalize(self.handle)
            self._settle("ncclCommFinalize", rc, self.timeout)
            with self._lock:
                if self._state != "open":
                    return
                self._state = "closed"
                self._finalizer.detach()
                nccl.comm_destroy(self.handle)
        finally:
            self._free_scratch()
            self._stop_watchdog()

    def _stop_watchdog(self) -> None:
        wd = self._wd
        if wd is not None:
            wd.close()

    def _free_scratch(self) -> None:
        for t in self._tmp.values():
            t.close()
        self._tmp.clear()


def _release(ref: weakref.ref[Communicator], handle: int, wd: Watchdog | None) -> None:
    """The handle's release: an abort's, queued when the communicator is collected, or at exit
    for one still alive (normal code, never the finalizer itself). In this order: the
    communicator, when alive, is marked aborted (no thread starts a call on the handle after
    it) and what was split from it is aborted (``ncclCommAbort`` waits for work on the
    device's other streams: a child's kernel spinning on a dead peer would hold it); the
    watchdog is stopped and joined (from its own thread, in its abort, it only stops: it makes
    no NCCL call after that); then ``ncclCommAbort``."""
    comm = ref()
    if comm is not None:
        comm._mark_aborted()
        for child in list(comm._children):
            child._abort()
    if wd is not None:
        wd.close()
    nccl.comm_abort(handle)


class _HostCall:
    """``with comm._call(stream):`` around one NCCL call, under the communicator's lock (so one
    object per communicator, made once, serves every call: the hot path allocates nothing, where a
    ``contextlib.contextmanager`` would make a generator per call). In blocking mode the watchdog's
    host bracket opens before the call and closes after it however it ends, a KeyboardInterrupt
    right after the C call returned included; an NcclError becomes the watchdog's reason when it
    aborted the call. It holds the communicator weakly: one collected unclosed is released
    without waiting for the cycle GC."""

    __slots__ = ("_comm", "_stream", "_wd", "_streams")

    def __init__(self, comm: Communicator) -> None:
        self._comm = weakref.ref(comm)
        self._stream: int | None = None
        self._wd: Watchdog | None = None  # non-blocking mode: nothing to bracket
        self._streams = False

    def watch(self, wd: Watchdog, streams: bool) -> None:
        """Bracket the calls for ``wd``; with ``streams``, also watch the work each call queued."""
        self._wd, self._streams = wd, streams

    def __call__(self, stream: int | None) -> _HostCall:
        self._stream = stream
        return self

    def __enter__(self) -> None:
        wd = self._wd
        if wd is not None:
            wd.enter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        wd = self._wd
        if wd is not None:
            # the work is watched on the stream unless the call failed, at world 1, inside a group
            # (nothing is queued before its end) or captured into a CUDA graph by this thread (its
            # replays run later, and :meth:`Communicator.wait` bounds them); another thread's
            # capture changes nothing here
            if exc_type is None and self._streams and (not capture.active[0] or capture.current() is None) and \
                    self._comm()._group is None:  # type: ignore[union-attr]  # the caller holds it
                wd.leave(self._stream)
            else:
                wd.leave(None)
        if isinstance(exc, NcclError):
            comm = self._comm()
            why = comm._why(exc)  # type: ignore[union-attr]
            if why is not exc:
                raise why from None


def _settled(call: str, handle: int) -> bool:
    """One poll of a handle no communicator uses yet (a split child, the retired parent)."""
    state = nccl.comm_get_async_error(handle)
    if state not in (nccl.SUCCESS, nccl.IN_PROGRESS):
        raise nccl.error(call, state, handle)
    return state == nccl.SUCCESS


# ---- the watchdog's view of a communicator (weak: a communicator collected unclosed ends it) --
def _health_of(ref: weakref.ref[Communicator]) -> Exception | None:
    """One look from the watchdog's thread: the abort event, NCCL's asynchronous error."""
    comm = ref()
    if comm is None:
        return None
    comm.device.activate()  # the events the watchdog queries belong to the device's context
    ev = comm._abort_event
    if ev is not None and ev.is_set():
        return comm._failure() or CommAbortedError(f"communicator rank {comm.rank} aborted (another rank failed)")
    if not comm._lock.acquire(blocking=False):
        return None  # a call is inside NCCL: next round (one blocked there is the host bracket's)
    try:
        if comm._state != "open":
            return None
        state = nccl.comm_get_async_error(comm.handle)
        if state in (nccl.SUCCESS, nccl.IN_PROGRESS):
            return None
        return nccl.error("ncclCommGetAsyncError", state, comm.handle)
    finally:
        comm._lock.release()


def _abort_of(ref: weakref.ref[Communicator], _exc: Exception) -> None:
    """The watchdog's abort: the handle only (the scratch buffers go at close or collection: a
    free here would race the issuing thread's use of them)."""
    comm = ref()
    if comm is not None:
        comm._abort()
