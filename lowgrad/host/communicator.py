"""The host backend's communicator: ``world`` threads of one process exchanging numpy memory
through a shared :class:`ThreadCollective` rendezvous, with the semantics of the NCCL
:class:`~lowgrad.cuda.communicator.Communicator`.

Streams are eager: every call has completed when it returns (``group()`` runs its calls at
exit, sends first, so grouped send/recv pairs cannot deadlock). Reductions follow
:func:`~lowgrad.host.reduce.host_reduce`.

Failures never hang: a rank that raises or aborts wakes the others with
:class:`~lowgrad.base.errors.CommAbortedError` saying which rank it was and, under
:func:`~lowgrad.run_threads`, the exception it raised; a rank that left (``close()``) makes every
rank that waits for it, then or later, raise CommAbortedError naming it at once (what it sent
before leaving is still delivered); a rank that does not arrive within the timeout (``inf``: no
limit) gives :class:`~lowgrad.base.errors.CommTimeoutError` in every waiting rank. Ranks that
disagree on a collective (call, dtype, size, op) all raise the same ``ValueError``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lowgrad.base import trace
from lowgrad.base.timeouts import check_timeout
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.communicator import CommBase, Group, all_to_all_schedule
from lowgrad.host.device import HostDevice
from lowgrad.host.reduce import host_reduce
from lowgrad.runtime.threads import ThreadCollective


class HostCommunicator(CommBase):
    """Rank ``rank`` of ``world`` threads sharing ``collective``; tensors live on ``device`` (a
    :class:`~lowgrad.HostDevice`, a new one when omitted). ``timeout`` (seconds, ``inf`` for no
    limit) bounds every rendezvous (default: the collective's)."""

    meets_peers_on_host = True

    def __init__(self, rank: int, world: int, collective: ThreadCollective, device: HostDevice | None = None,
                 timeout: float | None = None) -> None:
        if not isinstance(collective, ThreadCollective):
            raise TypeError(f"collective must be a ThreadCollective, got {type(collective).__name__}")
        if collective.world != world:
            raise ValueError(f"world {world} does not match the ThreadCollective's world {collective.world}")
        device = HostDevice() if device is None else device
        if getattr(device, "backend", None) != "host":
            raise TypeError(f"HostCommunicator needs a HostDevice, got {device!r}")
        self._init_base(rank, world, device, check_timeout(timeout, collective.timeout))
        self.collective = collective
        self._queue: list[tuple[bool, Any]] = []

    # ---- plumbing ----------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        err = None if self._state == "closed" else self.collective.error()
        if err is not None:  # the reason the collective failed, not just "aborted"
            self._state = "aborted"
            raise err
        super()._check_open(call)

    def _run(self, fn: Any, is_send: bool = False) -> None:
        if self._group is not None:
            self._queue.append((is_send, fn))
            self._group.scheduled += 1
        else:
            fn()

    def _trace(self, call: str, t: Tensor, count: int, stream: int, **fields: Any) -> None:
        """The trace line of a collective on ``t``: ``count`` elements per rank, as NCCL's lines."""
        trace.log("collective", call, rank=self.rank, tensor=t.name, count=count, dtype=t.dtype.name,
                  stream=hex(stream), **fields)

    def _sync(self) -> None:
        self.collective.exchange(self.rank, None, self.timeout)

    # ---- collectives -------------------------------------------------------------------
    def reduce_scatter(self, t: Tensor, op: str = "avg", stream: StreamLike = None) -> None:
        """In place: ``t`` is the full buffer on every rank; afterwards ``shard_view(t, rank,
        world)`` (flat elements ``[rank*n, (rank+1)*n)``, n = numel/world) holds the reduction."""
        count, _ = self._rs_args(t, op)
        h = stream_handle(stream)
        if trace.ENABLED:
            self._trace("reduce_scatter", t, count, h, op=op)

        def run() -> None:
            flat = t.numpy().reshape(-1)
            views = self.collective.agree(self.rank, ("reduce_scatter", t.dtype.name, t.numel, op), self.timeout,
                                          flat)
            sl = slice(self.rank * count, (self.rank + 1) * count)
            flat[sl] = host_reduce([v[sl] for v in views], op, self.world, t.dtype)
            self._sync()  # peers have read their slices of this buffer
        self._run(run)

    def all_gather(self, t: Tensor, out: Tensor | None = None, stream: StreamLike = None) -> None:
        """In place (``t`` full, own shard already in place) or from shard ``t`` into ``out``
        (``world * t.numel`` elements, rank order)."""
        shard, full = self._ag_args(t, out)
        h = stream_handle(stream)
        if trace.ENABLED:
            self._trace("all_gather", shard, shard.numel, h)

        def run() -> None:
            views = self.collective.agree(self.rank, ("all_gather", shard.dtype.name, shard.numel), self.timeout,
                                          shard.numpy().reshape(-1))
            f, n = full.numpy().reshape(-1), shard.numel
            for k, v in enumerate(views):
                if k != self.rank or out is not None:
                    f[k * n:(k + 1) * n] = v
            self._sync()
        self._run(run)

    def all_reduce(self, t: Tensor, op: str = "sum", stream: StreamLike = None) -> None:
        """In place: every rank's ``t`` becomes the reduction (``sum``, ``avg`` or ``max``)."""
        self._ar_args(t, op)
        h = stream_handle(stream)
        if trace.ENABLED:
            self._trace("all_reduce", t, t.numel, h, op=op)

        def run() -> None:
            flat = t.numpy().reshape(-1)
            views = self.collective.agree(self.rank, ("all_reduce", t.dtype.name, t.numel, op), self.timeout, flat)
            res = host_reduce(views, op, self.world, t.dtype)
            self._sync()  # every rank has read the inputs before any overwrites its own
            flat[:] = res
        self._run(run)

    def send(self, t: Tensor, peer: int, stream: StreamLike = None) -> None:
        """Send a copy of ``t`` to ``peer`` (never blocks; completes at once)."""
        peer = self._p2p_args("send", t, peer)
        h = stream_handle(stream)
        if trace.ENABLED:
            self._trace("send", t, t.numel, h, peer=peer)
        self._run(lambda: self.collective.post(self.rank, peer, "p2p", (t.dtype.name, t.numel, t.numpy().copy())),
                  is_send=True)

    def recv(self, t: Tensor, peer: int, stream: StreamLike = None) -> None:
        """Receive the next tensor ``peer`` sent to this rank into ``t`` (same dtype and size,
        else ValueError here); waits at most ``timeout`` seconds."""
        peer = self._p2p_args("recv", t, peer)
        h = stream_handle(stream)
        if trace.ENABLED:
            self._trace("recv", t, t.numel, h, peer=peer)

        def run() -> None:
            dt, n, data = self.collective.take(peer, self.rank, "p2p", self.timeout)
            if (dt, n) != (t.dtype.name, t.numel):
                raise ValueError(f"recv: rank {peer} sent {n} x {dt}, tensor {t.name!r} expects "
                                 f"{t.numel} x {t.dtype.name}")
            t.numpy().reshape(-1)[:] = data.reshape(-1)
        self._run(run)

    def all_to_all_many(self, tensors: Sequence[Tensor], stream: StreamLike = None) -> None:
        """:meth:`all_to_all` of several buffers in the same ``world - 1`` steps."""
        ns = [self._a2a_args(t) for t in tensors]
        h = stream_handle(stream)
        if trace.ENABLED:
            for t, n in zip(tensors, ns):
                self._trace("all_to_all", t, n, h)
        flats = [t.numpy().reshape(-1) for t in tensors]
        self.collective.agree(self.rank, ("all_to_all", *((t.dtype.name, t.numel) for t in tensors)), self.timeout)
        for send_peer, send_slot, recv_peer, recv_slot in all_to_all_schedule(self.rank, self.world):
            for flat, n in zip(flats, ns):
                self.collective.post(self.rank, send_peer, "a2a", flat[send_slot * n:(send_slot + 1) * n].copy())
            for flat, n in zip(flats, ns):
                got = self.collective.take(recv_peer, self.rank, "a2a", self.timeout)
                flat[recv_slot * n:(recv_slot + 1) * n] = got

    def host_allgather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` in rank order, on every rank."""
        self._check_open("host_allgather")
        self._check_not_grouped("host_allgather")
        return self.collective.agree(self.rank, ("host_allgather",), self.timeout,
                                     self._check_bytes("host_allgather", data))

    def barrier(self) -> None:
        """Return once every rank has called barrier."""
        self._check_open("barrier")
        self._check_not_grouped("barrier")
        self.collective.agree(self.rank, ("barrier",), self.timeout)

    def wait(self, what: Any = None, timeout: float | None = None) -> None:
        """Host work is complete when queued; raises if the communicator was aborted (``timeout``
        is checked as on the NCCL communicator, then unused)."""
        check_timeout(timeout, self.timeout)
        self._check_open("wait")

    def _split(self, color: int, key: int) -> HostCommunicator:
        """The ranks of ``color`` get a new :class:`ThreadCollective` of their own (their meetings
        and mailboxes are apart from this one's), with this communicator's timeout and device."""
        timeout = self.timeout
        rank, collective = self.collective.split(self.rank, color, key, timeout,
                                                 lambda size: ThreadCollective(size, timeout))
        return HostCommunicator(rank, collective.world, collective, self.device, timeout)

    # ---- groups ------------------------------------------------------------------------
    def _group_begin(self, g: Group) -> None:
        self._group_open(g)
        self._queue = []

    def _group_close(self, g: Group, failed: bool) -> None:
        """The host runs a group's calls here, sends first (so the paired receives find them);
        the group's event is then already complete."""
        queue, self._queue = self._queue, []
        if not failed:
            for fn in [fn for s, fn in queue if s] + [fn for s, fn in queue if not s]:
                fn()

    # ---- lifetime ----------------------------------------------------------------------
    def abort(self) -> None:
        """Abort this rank and wake every other rank of the collective with CommAbortedError."""
        if self._state == "open":
            self._state = "aborted"
            self.collective.abort(f"rank {self.rank} aborted the host communicator")

    def close(self) -> None:
        """Leave the communicator (idempotent); later calls raise ClosedError. Peers that wait
        for this rank, now or later, raise CommAbortedError naming it instead of timing out;
        what it sent before is still delivered."""
        if self._state == "open":
            self._state = "closed"
            self.collective.leave(self.rank)
