"""The loopback communicator: every rank of :func:`lowgrad.run_threads` on one GPU
(``share_gpu=True``), with the interface and the semantics of the NCCL
:class:`~lowgrad.cuda.communicator.Communicator`.

It is a test and development vehicle: a one-GPU machine (or a laptop with one GPU) runs an
engine at world 2..32 through the whole CUDA path — each rank with its own streams, events and
allocations — so a missing event wait between an engine's stream, a manager's communication
stream and the copy engines shows up as a wrong result before the code meets a multi-GPU node.
All ranks share one GPU's memory bandwidth, so it says nothing about multi-GPU speed.

How ranks meet. Ranks wait for each other on the device (spinning one-thread kernels), and CUDA
feeds all the streams of a process into a few hardware queues, so a waiting kernel must never
sit in a queue ahead of the kernel it waits for. Each collective therefore runs in three phases:

1. each rank records an event on its caller's stream (its data is ready there), then the ranks'
   threads meet on the host (:class:`ThreadCollective`; their calls are compared there, the
   same ValueError on every rank when they differ, nothing queued);
2. each rank queues the collective on its own loopback stream (the group creates the ``world``
   streams together, so each has its own hardware queue): a wait for its ready event, then
   ``loopback_sync`` (publish this rank's buffer addresses in a device table, count this rank's
   arrival, wait on the device until every rank has arrived), the copies (``loopback_copy``) or
   the reduction (``loopback_reduce_*``) that read the peers' buffers through the table and
   write only this rank's memory, and ``loopback_sync`` again (every rank has finished reading
   before any rank reuses its buffers); it records its done event there;
3. the threads meet again — every rank has queued its part — and only then each caller's
   stream waits for the done event.

A device-side wait only ever waits for work queued before it, so no wait can hold back what it
waits for. From the first meeting to the second a rank holds a window of the device's gate
(:mod:`lowgrad.runtime.gate`): the driver calls that wait for the whole device while holding the
driver's lock (frees, allocations, host copies, synchronize; every rank makes them between
collectives) wait until no collective is part-way queued, and none starts queuing while one runs
(a free in one rank's thread otherwise held another rank's launch, which a third rank's queued
kernel waited for: hangs on an H100, 2026-12-06). Groups of sends and receives meet their peers
instead of every rank, pair by pair in one order of the pairs (``_flush_p2p``), which keeps
these rules. The host
never waits for the GPU inside a collective, so CUDA-graph capture works as with NCCL (the
loopback stream joins the capture through the events; each replay meets the threads before and
after its launch).

Reductions (the one order, so results equal the host backend's bit for bit): the ranks'
values are combined in rank order 0, 1, .., world-1 in float32 (float64 for fp64), ``avg``
multiplies that sum by ``float32(1/world)``, and the result is rounded once to the tensor's
dtype (round to nearest even); byte tensors wrap as uint8 (``avg``: integer division). This is
:func:`lowgrad.host.reduce.host_reduce`, computed on the GPU.

Failures surface in bounded time: the threads' meeting and each device-side wait last at most
``timeout`` seconds (then CommTimeoutError naming the missing rank), and stop at once when a
rank aborts (``abort()``, or ``run_threads`` after an exception in any rank: CommAbortedError
naming the rank, and under ``run_threads`` the exception it raised) or left (``close()``:
CommAbortedError naming it). A device-side failure is recorded in pinned memory, every later
loopback kernel does nothing, and :meth:`LoopbackCommunicator.wait` raises it. Ranks that
disagree on a collective (call, dtype, element count, op), or a send and its receive, all raise
the same ValueError before anything is queued.

Debugging aid: ``LOWGRAD_LOOPBACK_JITTER_US=N`` delays each sync on the device by a random
0..N µs (a random pause per rank and collective), to shake out missing dependencies.
"""
from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, closing, contextmanager
from typing import Any

import numpy as np

from lowgrad.base import trace
from lowgrad.base.dtypes import bf16, byte, fp16, fp32, fp64
from lowgrad.base.errors import CommAbortedError, CommTimeoutError
from lowgrad.base.integers import integer
from lowgrad.base.timeouts import check_timeout
from lowgrad.buffers import capture
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.communicator import Group, all_to_all_schedule
from lowgrad.cuda import graph
from lowgrad.cuda.compiler import constants, kernel
from lowgrad.cuda.gpu_comm import GpuCommBase
from lowgrad.cuda.kernels import Kernel
from lowgrad.runtime.gate import DeviceGate
from lowgrad.runtime.threads import ThreadCollective

_C = constants("loopback")
PTRS = _C["LB_PTRS"]  # addresses one sync publishes per rank
MAX_WORLD = _C["LB_MAX_WORLD"]
_REDUCE = {bf16: "loopback_reduce_bf16", fp16: "loopback_reduce_fp16", fp32: "loopback_reduce_fp32",
           fp64: "loopback_reduce_fp64", byte: "loopback_reduce_byte"}
_ERRORS = {_C["LB_ERR_TIMEOUT"]: (CommTimeoutError, "timed out waiting for rank {peer}"),
           _C["LB_ERR_ABORTED"]: (CommAbortedError, "stopped: the communicator was aborted"),
           _C["LB_ERR_LEFT"]: (CommAbortedError, "stopped: rank {peer} left the communicator (close())")}
_Item = tuple[tuple[Any, ...], int, Callable[[int], None]]  # a queued collective: (signature, caller stream, work)


def hardware_queues() -> int:
    """How many hardware queues CUDA feeds this process's streams into: CUDA_DEVICE_MAX_CONNECTIONS
    (default 8, at most 32) as read now — CUDA reads it when the process creates its context."""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip()
    return min(int(value), 32) if value.isdigit() and int(value) > 0 else 8


class LoopbackGroup:
    """What the ``world`` ranks on ``device`` share: the arrival counters and address table (device
    memory), the status words (mapped pinned memory: abort request, first error, ranks that
    left), and the threads' meeting point where ranks agree on each collective before queuing it."""

    def __init__(self, device: Any, world: int, timeout: float | None = None, streams: bool = True) -> None:
        if not callable(getattr(getattr(device, "kernels", None), "kernel", None)) or \
                not isinstance(getattr(device, "sync_gate", None), DeviceGate):
            raise TypeError(f"the loopback communicator needs a device that launches CUDA kernels and gates its "
                            f"device-wide calls (a lowgrad.Device), got {device!r}")
        world = integer("loopback world", world)
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"loopback world must be an int in [1, {MAX_WORLD}], got {world!r}")
        queues = hardware_queues()
        if streams and world > queues:
            raise ValueError(f"loopback world {world} needs a hardware queue per rank; CUDA gives this process "
                             f"{queues} (CUDA_DEVICE_MAX_CONNECTIONS, default 8, at most 32): set "
                             "CUDA_DEVICE_MAX_CONNECTIONS=32 before the process creates its CUDA context "
                             "(run_threads(share_gpu=True) sets it when unset); more than 32 ranks cannot share one "
                             "GPU")
        self.device, self.world, self.timeout = device, world, check_timeout(timeout)
        self.gate: DeviceGate = device.sync_gate
        device.activate()
        # u64 words: meetings per pair of ranks, then the device copy of "failed" (kernels/loopback.cu)
        self._counters = device.alloc((world * world + 1,), fp64, name="loopback_counters")
        # u64 addresses: [world][PTRS] for collectives, then [world][world][PTRS] for sends
        self._table = device.alloc((world * PTRS * (1 + world),), fp64, name="loopback_table")
        self._status_t = device.alloc((_C["LB_STATUS"],), fp32, kind="pinned", name="loopback_status")
        if not self._status_t.allocation.host_accessible:
            raise TypeError(f"{device!r} gives no host-accessible pinned memory for the loopback status words")
        self.status = self._status_t.numpy().view(np.uint32)  # u32 words, shared with the kernels
        self.status[:] = 0
        device.copy_from_host(self._counters, np.zeros(world * world + 1, np.float64))
        self.counters, self.table, self.status_ptr = self._counters.ptr, self._table.ptr, self._status_t.ptr
        self.flag = self.counters + 8 * world * world
        jitter = os.environ.get("LOWGRAD_LOOPBACK_JITTER_US", "")
        self.jitter_ns = int(float(jitter) * 1000) if jitter else 0
        self.meet = ThreadCollective(world, self.timeout)  # the ranks' threads meet here before queuing
        # one stream per rank, created together so that each gets its own hardware queue; a group
        # split from another has none: its ranks queue on their parent ranks' streams
        self.streams = [device.stream() for _ in range(world)] if streams else []

    def agree(self, rank: int, signature: Any, timeout: float) -> None:
        """Block until every rank has called its next collective (or replay); ValueError on
        every rank when their ``signature`` differ (nothing is queued then). After queuing its
        part, each rank calls it again with ``None`` (every rank has queued). A failed meeting
        stops the device side too."""
        try:
            self.meet.agree(rank, signature, timeout)
        except (CommAbortedError, CommTimeoutError):
            self.abort()
            raise

    def match(self, rank: int, plan: dict[int, Any], timeout: float, tag: str = "p2p") -> None:
        """Block until every peer of this rank's group of sends and receives has flushed its own;
        ``plan``: peer -> (what this rank sends it, what it receives from it), each a list of
        (dtype, elements); ValueError on both sides when a send and its receive differ. With
        plan values None, only a meeting: ``tag="pair"`` (both may queue their part for each
        other now), ``tag="queued"`` (every peer has queued its part)."""
        try:
            for peer, item in plan.items():
                self.meet.post(rank, peer, tag, item)
            theirs = {peer: self.meet.take(peer, rank, tag, timeout) for peer in plan}
        except (CommAbortedError, CommTimeoutError):
            self.abort()
            raise
        for peer, item in plan.items():
            if item is not None and theirs[peer] != item[::-1]:
                their_sends, their_recvs = theirs[peer]
                raise ValueError(f"loopback: rank {rank} sends {item[0]} to rank {peer} and receives {item[1]} from "
                                 f"it; rank {peer} receives {their_recvs} and sends {their_sends} (dtype, elements): "
                                 "each send must match its receive")

    def abort(self, reason: str = "a rank aborted the loopback communicator") -> None:
        """Stop every rank's pending and later loopback work, on the device and on the host
        (CommAbortedError saying ``reason``, unless the group failed for another reason first)."""
        self.meet.abort(reason)  # first, so that a device wait the flag stops finds the reason recorded
        self.status[_C["LB_ABORT"]] = 1

    def leave(self, rank: int) -> None:
        self.status[_C["LB_LEFT"] + rank] = 1
        self.meet.leave(rank)

    def error(self, rank: int) -> Exception | None:
        """The recorded device-side failure as the exception ``rank`` raises, or None."""
        code = int(self.status[_C["LB_ERROR"]])
        if not code:
            return None
        if code == _C["LB_ERR_ABORTED"] and (why := self.meet.error()) is not None:
            return why  # who aborted and why, rather than that a device wait was stopped
        cls, what = _ERRORS.get(code, (CommAbortedError, "failed (error {code})"))
        waiter, peer = int(self.status[_C["LB_WAITER"]]), int(self.status[_C["LB_PEER"]])
        return cls(f"loopback communicator: rank {waiter} " + what.format(peer=peer, code=code)
                   + f"; every rank's loopback work stops (seen by rank {rank})")


class LoopbackCommunicator(GpuCommBase):
    """Rank ``rank`` of ``group.world`` ranks sharing one GPU through ``group`` (a
    :class:`LoopbackGroup`); ``timeout`` (seconds, ``inf``: no limit; default the group's)
    bounds each device-side wait for a peer and :meth:`wait`."""

    meets_peers_on_host = True
    _label = " (loopback)"

    def __init__(self, rank: int, group: LoopbackGroup, timeout: float | None = None,
                 stream: Any = None) -> None:
        if not isinstance(group, LoopbackGroup):
            raise TypeError(f"group must be a LoopbackGroup, got {type(group).__name__}")
        self._init_base(rank, group.world, group.device, check_timeout(timeout, group.timeout))
        self.shared = group
        kernels = group.device.kernels
        self._kernels: dict[str, Kernel] = {}
        for name in ("loopback_sync", "loopback_copy", "loopback_delay", *_REDUCE.values()):
            spec = kernel(name)
            self._kernels[name] = Kernel(spec, kernels.kernel(spec).func)  # own argument buffers
        self._grid = kernels.grid
        self._scale = (float(np.float32(1.0 / self.world)), 1.0 / self.world)  # avg: float32(1/W), fp64: 1/W
        self._timeout_ns = 0 if self.timeout == float("inf") else int(self.timeout * 1e9)
        self._rng = random.Random(rank)
        self._everyone = (1 << self.world) - 1
        self._queue: list[_Item] = []  # a group's collectives: (signature, caller stream, work)
        self._p2p: list[tuple[bool, Tensor, int, int]] = []  # a group's (is_send, tensor, peer, stream)
        # where this rank's loopback work runs: its group's stream, or (split) its parent rank's,
        # held here so that it outlives the parent group
        self._loop_stream = group.streams[rank] if stream is None else stream
        self._stream_h = stream_handle(self._loop_stream)
        self._ready: list[Any] = []  # an event per caller stream of one collective (or group)
        self._done = group.device.event(name=f"loopback_done{rank}")  # after this rank's last collective
        self._done_recorded = False
        self._captured = 0  # meetings recorded by the capture in progress
        self._replay_caller: list[int] = []  # the stream a replay in progress was launched for

    # ---- plumbing ----------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        super()._check_open(call)
        err = self.shared.error(self.rank)
        if err is not None:
            self._state = "aborted"
            raise err

    def _failure(self) -> Exception | None:
        return self.shared.meet.error()

    def _watch(self, call: str) -> None:
        self._check_open(call)

    def _check_memory(self, call: str, t: Tensor) -> None:
        if t.kind not in self.device.kernel_kinds:
            raise ValueError(f"{call}: tensor {t.name!r} is {t.kind} memory, which the GPU cannot access")
        capture.keep_tensors(t)  # a graph being captured holds the buffers its kernels use

    def _run(self, call: str, signature: tuple[Any, ...], h: int, work: Callable[[int], None],
             t: Tensor | None = None, count: int = 0, **fields: Any) -> None:
        """Run ``work`` (which queues the collective on the stream it is given) now, or at the
        group's end, in the three phases of the module's docstring."""
        if trace.ENABLED and t is not None:
            trace.log("collective", call, rank=self.rank, tensor=t.name, count=count, dtype=t.dtype.name,
                      stream=hex(h), loopback=True, **fields)
        if self._group is not None:
            self._group.scheduled += 1
            self._queue.append(((call, *signature), h, work))
        else:
            self._collectives([((call, *signature), h, work)])

    def _collectives(self, items: list[_Item]) -> None:
        streams = self._ready_on([h for _, h, _ in items])
        self.shared.agree(self.rank, tuple(sig for sig, _, _ in items), self.timeout)
        with self._window():
            self._start(streams)
            for _, _, work in items:
                work(self._stream_h)
            self._finish(streams)

    @contextmanager
    def _window(self) -> Iterator[None]:
        """This rank's window of the device gate around queuing its part of what its peers met it
        for; a failure inside stops the group first (:meth:`_failed_queuing`)."""
        self.shared.gate.open()
        try:
            yield
        except BaseException:
            self._failed_queuing()
            raise
        finally:
            self.shared.gate.close()

    def _failed_queuing(self) -> None:
        """This rank failed part-way through queuing a collective its peers met it for: their
        device-side waits for it could never end, so the group stops (before the window closes, so
        that no device-wide call waits on those kernels until the timeout)."""
        self._state = "aborted"
        self.shared.abort(f"rank {self.rank} failed while queuing a collective")

    def _ready_on(self, handles: list[int]) -> list[int]:
        """Phase 1: record a ready event on each distinct caller stream; returns those streams."""
        streams = list(dict.fromkeys(handles))
        while len(self._ready) < len(streams):
            self._ready.append(self.device.event(name=f"loopback_ready{self.rank}"))
        for ev, h in zip(self._ready, streams):
            ev.record(h)
        return streams

    def _start(self, streams: list[int]) -> None:
        """Phase 2 begins (the threads have met): the loopback stream waits for the callers'
        streams (joining their capture, if any)."""
        self._join_capture(streams[0])
        for ev, _ in zip(self._ready, streams):
            ev.wait(self._stream_h)

    def _finish(self, streams: list[int], peers: dict[int, None] | None = None) -> None:
        """Phase 3: record the done event, meet every rank (or only ``peers``) again — they have
        queued their part too — then the callers' streams wait for it."""
        self._done.record(self._stream_h)
        self._done_recorded = True
        if peers is None:
            self.shared.agree(self.rank, None, self.timeout)
        else:
            self.shared.match(self.rank, peers, self.timeout, tag="queued")
        for h in streams:
            self._done.wait(h)

    def _join_capture(self, h: int) -> None:
        """When this thread captures a lowgrad.Graph and ``h`` is in the capture: take part in
        its replays (each replay meets the other ranks' threads, as an eager collective does)."""
        g = capture.current()
        if g is not None and graph.is_capturing(h):
            g.join(self)
            self._captured += 1

    def _split(self, color: int, key: int) -> LoopbackCommunicator:
        """The ranks of ``color`` get a new :class:`LoopbackGroup` of their own on this device
        (its counters, table and status words, made by its new rank 0 and handed to the others
        through the threads' meeting), with this communicator's timeout. An abort of this group
        reaches it. Not inside a graph capture (it allocates).

        Each rank queues the new group's collectives on its own loopback stream, the one of this
        communicator: every loopback stream of the process then has a hardware queue of its own
        (a group's streams are created together), where streams made for each split group shared
        queues with other groups' streams, and a waiting kernel at the head of a shared queue can
        hold back the kernel it waits for. One stream per rank adds no wait: a rank passes a
        collective's second meeting only once all its peers have queued it, so the collectives on
        a rank's stream never wait for one queued behind them."""
        capture.forbid("split (it allocates a loopback group)")
        group, timeout = self.shared, self.timeout
        try:
            rank, child = group.meet.split(self.rank, color, key, timeout,
                                           lambda size: LoopbackGroup(group.device, size, timeout, streams=False))
        except (CommAbortedError, CommTimeoutError):
            group.abort()
            raise
        return LoopbackCommunicator(rank, child, timeout, stream=self._loop_stream)

    # ---- the Graph participant protocol (lowgrad.cuda.graph.Participant) ---------------
    def capture_closing(self, stream: int) -> None:
        """Nothing to join: every loopback kernel ran on the captured stream."""

    def capture_ended(self, graph: Any, failed: bool) -> int:
        """The template: how many meetings the capture holds."""
        count, self._captured = self._captured, 0
        return count

    def replay_check(self, template: int) -> int:
        self._check_open("graph replay")
        return template

    def replay_before(self, stream: int) -> None:
        """The ranks' threads meet before any of them launches a replay (calls compared); the
        device gate's window opens until :meth:`replay_done` or :meth:`replay_failed`."""
        self.shared.agree(self.rank, ("graph replay",), self.timeout)
        self.shared.gate.open()

    def replay_launch(self, stream: int) -> int:
        """Replays launch on this rank's loopback stream (its own hardware queue, so one rank's
        waiting graph never holds back another's), after the caller's ``stream``."""
        self._replay_caller = self._ready_on([stream])
        self._ready[0].wait(self._stream_h)
        return self._stream_h

    def replay_done(self, applied: int, stream: int) -> None:
        """... and meet again after every rank has launched it, before the caller's stream
        waits for it."""
        try:
            self._finish(self._replay_caller)
        except BaseException:
            self._failed_queuing()
            raise
        finally:
            self.shared.gate.close()

    def replay_failed(self, stream: int) -> None:
        """The launch failed after :meth:`replay_before`: the group stops, then the window closes."""
        self._failed_queuing()
        self.shared.gate.close()

    def _sync(self, h: int, ptrs: Sequence[int] = (), entries: Sequence[int] | None = None,
              peers: int | None = None) -> None:
        """Meet ``peers`` (a bit mask; default every rank) on the device after publishing
        ``ptrs`` at table ``entries`` (default: this rank's collective row)."""
        g = self.shared
        if g.jitter_ns:
            self._kernels["loopback_delay"].launch(1, h, self._rng.randrange(g.jitter_ns + 1))
        if entries is None:
            entries = range(self.rank * PTRS, self.rank * PTRS + len(ptrs))
        pad = (0,) * (PTRS - len(ptrs))
        self._kernels["loopback_sync"].launch(1, h, g.counters, g.table, g.status_ptr, *ptrs, *pad, *entries, *pad,
                                              self._everyone if peers is None else peers, len(ptrs), self.rank,
                                              self.world, self._timeout_ns)

    def _copy(self, h: int, dst: int, entry: int, src_offset: int, nbytes: int) -> None:
        """Copy ``nbytes`` from the address published at table ``entry`` (+ ``src_offset``) to ``dst``."""
        if nbytes:
            g = self.shared
            self._kernels["loopback_copy"].launch(self._grid(-(-nbytes // 16), 256), h, g.table, g.flag, dst,
                                                  src_offset, nbytes, entry)

    def _reduce(self, h: int, t: Tensor, slot: int, offset: int, n: int, code: int) -> None:
        if n:
            g = self.shared
            self._kernels[_REDUCE[t.dtype]].launch(self._grid(n, 256), h, g.table, g.flag, t.ptr, offset, n,
                                                   slot, self.world, code, self._scale[t.dtype is fp64])

    def _reducible(self, call: str, t: Tensor) -> None:
        if t.dtype not in _REDUCE:
            raise TypeError(f"{call}: the loopback communicator reduces {sorted(d.name for d in _REDUCE)}, "
                            f"not {t.dtype.name}")

    # ---- collectives (asynchronous, on `stream`) ---------------------------------------
    def reduce_scatter(self, t: Tensor, op: str = "avg", stream: StreamLike = None) -> None:
        """In place: ``t`` is the full buffer; afterwards ``shard_view(t, rank, world)`` (flat
        elements ``[rank*n, (rank+1)*n)``, n = numel/world) holds the ``avg`` or ``sum``."""
        count, code = self._rs_args(t, op)
        self._reducible("reduce_scatter", t)

        def work(h: int) -> None:
            self._sync(h, (t.ptr,))
            self._reduce(h, t, 0, self.rank * count, count, code)
            self._sync(h)
        self._run("reduce_scatter", (t.dtype.name, t.numel, op), self._stream(stream), work, t, count, op=op)

    def all_gather(self, t: Tensor, out: Tensor | None = None, stream: StreamLike = None) -> None:
        """In place (``t`` full, own shard already at ``shard_view(t, rank, world)``) or from
        shard ``t`` into ``out`` (``world * t.numel`` elements, rank order)."""
        shard, full = self._ag_args(t, out)
        nbytes = shard.nbytes

        def work(h: int) -> None:
            self._sync(h, (shard.ptr,))
            for q in range(self.world):
                if q != self.rank or out is not None:
                    self._copy(h, full.ptr + q * nbytes, q * PTRS, 0, nbytes)
            self._sync(h)
        self._run("all_gather", (shard.dtype.name, shard.numel), self._stream(stream), work, shard, shard.numel)

    def all_reduce(self, t: Tensor, op: str = "sum", stream: StreamLike = None) -> None:
        """In place: every rank's ``t`` becomes the ``sum``, ``avg`` or ``max`` over ranks (each
        rank reduces its part of the elements, then gathers the others' parts)."""
        code = self._ar_args(t, op)
        self._reducible("all_reduce", t)
        n, W, size = t.numel, self.world, t.dtype.itemsize
        bounds = [n * r // W for r in range(W + 1)]

        def work(h: int) -> None:
            self._sync(h, (t.ptr,))
            lo, hi = bounds[self.rank], bounds[self.rank + 1]
            self._reduce(h, t, 0, lo, hi - lo, code)
            self._sync(h)
            for q in range(W):
                if q != self.rank:
                    self._copy(h, t.ptr + bounds[q] * size, q * PTRS, bounds[q] * size,
                               (bounds[q + 1] - bounds[q]) * size)
            self._sync(h)
        self._run("all_reduce", (t.dtype.name, t.numel, op), self._stream(stream), work, t, t.numel, op=op)

    def send(self, t: Tensor, peer: int, stream: StreamLike = None) -> None:
        """Send ``t`` to ``peer`` (paired with the peer's :meth:`recv`; inside :meth:`group`
        when both sides also receive). Up to PTRS sends to one peer per group."""
        self._point("send", True, t, peer, stream)

    def recv(self, t: Tensor, peer: int, stream: StreamLike = None) -> None:
        """Receive ``t.numel`` elements from ``peer`` into ``t`` (same dtype and size as the
        matching send, else ValueError on the later of the two ranks)."""
        self._point("recv", False, t, peer, stream)

    def _point(self, call: str, is_send: bool, t: Tensor, peer: int, stream: StreamLike) -> None:
        peer = self._p2p_args(call, t, peer)
        same = sum(1 for s, _, p, _ in self._p2p if s == is_send and p == peer)
        if same >= PTRS:
            raise ValueError(f"{call}: at most {PTRS} {call}s to one peer in one group")
        h = self._stream(stream)
        if trace.ENABLED:
            trace.log("collective", call, rank=self.rank, tensor=t.name, count=t.numel, dtype=t.dtype.name,
                      stream=hex(h), peer=peer, loopback=True)
        self._p2p.append((is_send, t, peer, h))
        if self._group is not None:
            self._group.scheduled += 1
        else:
            self._flush_p2p()

    def _flush_p2p(self) -> None:
        """A group's sends and receives. First one meeting with every peer involved (each send
        checked against its receive; nothing is queued before it passed). Then one peer at a
        time, the pairs in one order on every rank (lower rank, then higher): meet that peer
        again, queue a sync that publishes this rank's sends to it, the copies of its sends into
        this rank's receives and a second sync (it has read). Last the ranks meet once more (every
        peer has queued its part).

        Meeting pair by pair keeps the module's rule for groups of sends and receives: a rank
        queues a device-side wait for a peer only once that peer has nothing left to wait for on
        the host before it queues its own part. (One meeting with all peers did not: in a ring,
        rank r+1 could queue its wait for rank r while r still waited on the host for r-1, and a
        device-wide synchronize in r-1 then waited on a kernel that could not finish.) The pair
        order is one total order of the pairs, so the meetings never wait in a cycle. The device
        gate's window is per pair, from its meeting to a second one once both have queued: a
        window spanning the whole flush waited for peers that waited for their other peers,
        one of which waited at the gate for that window (a cycle)."""
        ops, self._p2p = self._p2p, []
        if not ops:
            return
        r, W, h, base = self.rank, self.world, self._stream_h, self.world * PTRS
        by_peer: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
        for is_send, t, peer, _ in ops:
            by_peer.setdefault(peer, ([], []))[0 if is_send else 1].append(t)
        streams = self._ready_on([h for *_, h in ops])
        self.shared.match(r, {peer: tuple([(t.dtype.name, t.numel) for t in ts] for ts in pair)
                              for peer, pair in by_peer.items()}, self.timeout)
        self._start(streams)
        for peer in sorted(by_peer, key=lambda q: (min(q, r), max(q, r))):
            sends, recvs = by_peer[peer]
            self.shared.match(r, {peer: None}, self.timeout, tag="pair")
            with self._window():  # per pair: a rank's window waits only for a peer in its own
                self._sync(h, [t.ptr for t in sends], [base + (r * W + peer) * PTRS + i for i in range(len(sends))],
                           1 << peer)
                for i, t in enumerate(recvs):
                    self._copy(h, t.ptr, base + (peer * W + r) * PTRS + i, 0, t.nbytes)
                self._sync(h, peers=1 << peer)
                self.shared.match(r, {peer: None}, self.timeout, tag="pair queued")
        self._finish(streams, dict.fromkeys(by_peer))

    def all_to_all_many(self, tensors: Sequence[Tensor], stream: StreamLike = None) -> None:
        """:meth:`all_to_all` of several buffers in the same ``world - 1`` steps (each step a
        sync, then this rank pulls its slot of every buffer from the step's peer)."""
        ns = [self._a2a_args(t) for t in tensors]
        h = self._stream(stream)
        W, r = self.world, self.rank
        for c in range(0, len(tensors), PTRS):  # a sync publishes up to PTRS addresses
            part = list(zip(tensors[c:c + PTRS], ns[c:c + PTRS]))

            def work(h: int, part: list[tuple[Tensor, int]] = part) -> None:
                self._sync(h, [t.ptr for t, _ in part])
                for d, (_, _, recv_peer, recv_slot) in enumerate(all_to_all_schedule(r, W)):
                    if d:
                        self._sync(h, [t.ptr for t, _ in part])
                    for i, (t, n) in enumerate(part):
                        slot_bytes = n * t.dtype.itemsize
                        self._copy(h, t.ptr + recv_slot * slot_bytes, recv_peer * PTRS + i, r * slot_bytes, slot_bytes)
                self._sync(h)
            self._run("all_to_all", tuple((t.dtype.name, t.numel) for t, _ in part), h, work, part[0][0],
                      part[0][1], buffers=len(part))

    # ---- groups ------------------------------------------------------------------------
    def _group_begin(self, g: Group) -> None:
        self._group_open(g)
        self._queue = []

    def _group_close(self, g: Group, failed: bool) -> None:
        """Queue the group's collectives in call order (each one sync-work-sync), then its sends
        and receives; the group's stream waits for them."""
        queue, self._queue = self._queue, []
        if failed:
            self._p2p = []
            return
        if queue:
            self._collectives(queue)
        self._flush_p2p()
        if g.scheduled:
            self._done.wait(g.stream)

    # ---- host-side helpers (blocking) --------------------------------------------------
    def _host_buffer(self, name: str, nbytes: int) -> AbstractContextManager[Tensor]:
        """Allocated per call and freed by this rank's thread: abort() may come from another rank's
        thread, which must not free memory this rank still copies into."""
        return closing(self.device.alloc((nbytes,), byte, name="loopback_host_allgather"))

    def _host_gather(self, buf: Tensor) -> None:
        """On this rank's loopback stream: the legacy stream would wait for the other ranks' streams."""
        self.all_gather(buf, stream=self._stream_h)
        self.wait(self._done)

    def barrier(self) -> None:
        """Return once every rank has reached the barrier (a device sync and a wait)."""
        self._check_open("barrier")
        self._check_not_grouped("barrier")
        self._run("barrier", (), self._stream_h, self._sync)
        self.wait(self._done)

    # ---- lifetime ----------------------------------------------------------------------
    def abort(self) -> None:
        """Stop every rank's loopback work (safe from any thread; idempotent): pending device
        waits end, later calls and waits raise CommAbortedError."""
        if self._state == "open":
            self._state = "aborted"
            self.shared.abort(f"rank {self.rank} aborted the loopback communicator")

    def close(self) -> None:
        """Wait (bounded by ``timeout``) until this rank's queued collectives have run, then leave:
        peers that wait for this rank from now on raise CommAbortedError naming it."""
        if self._state != "open":
            return
        try:
            if self._done_recorded:
                self.wait(self._done)
        finally:
            if self._state == "open":
                self._state = "closed"
                self.shared.leave(self.rank)

