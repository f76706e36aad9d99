"""The communicator contract (:class:`CommBase`) every backend implements, and what they share:
argument checks, reduction-op names, the all-to-all schedule, and the methods written once on top
of the backend primitives.

Every check here runs before any communication is queued, so a bad argument raises
``ValueError``/``TypeError`` and leaves the communicator usable.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cache
from typing import Any

from lowgrad.base.errors import ClosedError, CommAbortedError
from lowgrad.base.integers import integer
from lowgrad.base.timeouts import check_timeout
from lowgrad.buffers.streams import StreamLike
from lowgrad.buffers.tensor import Tensor

# reduction op name -> ncclRedOp_t (the host backend uses the same names)
OPS = {"sum": 0, "max": 2, "avg": 4}
REDUCE_SCATTER_OPS = ("avg", "sum")
ALL_REDUCE_OPS = ("sum", "avg", "max")


def check_op(call: str, op: str, allowed: tuple[str, ...]) -> int:
    """The ncclRedOp_t code of ``op``; ValueError when ``call`` does not support it."""
    if op not in allowed:
        raise ValueError(f"{call}: op must be one of {allowed}, got {op!r}")
    return OPS[op]


def check_tensor(comm: CommBase, call: str, t: Any, what: str = "t", divisible: bool = False) -> None:
    """``t`` is a live tensor on ``comm.device`` in memory the backend can communicate, and (with
    ``divisible``) its element count splits into ``comm.world`` equal slots."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{call}: {what} must be a lowgrad Tensor, got {type(t).__name__}")
    if t.closed:
        raise ClosedError(f"{call}: tensor {t.name!r} used after close()")
    if t.device is not comm.device:
        raise ValueError(f"{call}: tensor {t.name!r} lives on {t.device!r}, not on this communicator's "
                         f"device {comm.device!r}")
    comm._check_memory(call, t)
    if divisible and t.numel % comm.world:
        raise ValueError(f"{call}: tensor {t.name!r} of shape {t.shape} has {t.numel} elements, not "
                         f"divisible by world {comm.world}")


def check_peer(comm: CommBase, call: str, peer: Any) -> int:
    """``peer`` (a Python or NumPy integer) as a rank of ``comm``."""
    peer = integer(f"{call}: peer", peer)
    if not 0 <= peer < comm.world:
        raise ValueError(f"{call}: peer {peer!r} outside [0, {comm.world})")
    return peer


def check_same(call: str, a: Tensor, b: Tensor) -> None:
    if a.dtype is not b.dtype:
        raise TypeError(f"{call}: dtype mismatch: {a.name!r} is {a.dtype.name}, {b.name!r} is {b.dtype.name}")


@cache
def all_to_all_schedule(rank: int, world: int) -> tuple[tuple[int, int, int, int], ...]:
    """The destructive all-to-all as ``world - 1`` sequential steps of one send and one recv:
    ``(send_peer, send_slot, recv_peer, recv_slot)`` for d = 1 .. world-1.

    At step d rank r sends slot (r+d)%W to rank (r+d)%W and receives rank (r-d)%W's slot r into
    slot (r+d-1)%W. The slot received into at step d was sent at step d-1 (at d=1 it is the own
    slot, consumed before the call), so steps run in order on one stream are race-free.
    """
    return tuple(((rank + d) % world, (rank + d) % world, (rank - d) % world, (rank + d - 1) % world)
                 for d in range(1, world))


def all_to_all_skip(rank: int, world: int) -> int:
    """The slot that holds no peer's contribution after :meth:`CommBase.all_to_all`."""
    return (rank + world - 1) % world


def all_to_all_source(rank: int, world: int, slot: int) -> int:
    """The rank whose slot ``rank`` lands in ``slot`` of rank ``rank`` (``slot != skip``)."""
    if slot == all_to_all_skip(rank, world):
        raise ValueError(f"slot {slot} is the skip slot of rank {rank} at world {world}")
    return (rank - ((slot - rank) % world) - 1) % world


#: split colors and keys are C ints in NCCL (ncclCommSplit): every backend takes the same range
SPLIT_LIMIT = 2**31


def check_split(comm: CommBase, color: Any, key: Any) -> tuple[int, int]:
    """The arguments of :meth:`CommBase.split` checked before anything happens: ``color`` an int
    in ``[0, 2**31)``, ``key`` None (this rank) or an int in ``[-2**31, 2**31)``; the communicator
    open and outside a group."""
    comm._check_open("split")
    comm._check_not_grouped("split")
    color = integer("split color", color)
    if not 0 <= color < SPLIT_LIMIT:
        raise ValueError(f"split: color must be in [0, 2**31), got {color}")
    key = comm.rank if key is None else integer("split key", key)
    if not -SPLIT_LIMIT <= key < SPLIT_LIMIT:
        raise ValueError(f"split: key must be in [-2**31, 2**31), got {key}")
    return color, key


class CommBase(ABC):
    """The communicator contract both backends implement (NCCL: :class:`lowgrad.Communicator`;
    host: :class:`lowgrad.HostCommunicator`).

    ``rank`` of ``world`` on ``device``; ``timeout``: seconds (``inf``: no limit) that bound every
    blocking call. Tensors passed to the collectives live on ``device`` in memory the backend
    can communicate, and every rank makes the same calls with the same dtypes and element
    counts in the same order. Collectives are asynchronous: they queue work on ``stream``
    (``None``: the device's default stream; inside :meth:`group`, the group's stream) and
    return; the host backend completes them before returning. Every argument is checked before
    anything is queued (ValueError/TypeError; the communicator stays usable); after
    :meth:`abort` every call raises :class:`~lowgrad.base.errors.CommAbortedError`, after
    :meth:`close` :class:`~lowgrad.base.errors.ClosedError`.
    """

    rank: int
    world: int
    device: Any
    timeout: float
    #: True where a collective call blocks the calling host thread until every peer has made
    #: it (the host backend, the loopback): ranks must not issue them from one shared thread.
    meets_peers_on_host: bool = False
    #: True where the ranks are threads of this one process (:func:`lowgrad.run_threads` sets it on
    #: every communicator it makes; :meth:`split` passes it on): a facility that a process has
    #: once (``torch.distributed``'s default process group) cannot give each rank its own.
    ranks_are_threads: bool = False

    def _init_base(self, rank: int, world: int, device: Any, timeout: float | None) -> None:
        world, rank = integer("world", world), integer("rank", rank)
        if world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank!r} outside [0, {world})")
        self.rank, self.world, self.device, self.timeout = rank, world, device, check_timeout(timeout)
        self._state = "open"  # "open" | "aborted" | "closed"
        self._group_depth = 0
        self._group: Group | None = None

    # ---- state -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._state != "open"

    @property
    def aborted(self) -> bool:
        return self._state == "aborted"

    def _check_open(self, call: str) -> None:
        if self._state == "closed":
            raise ClosedError(f"{call}: communicator used after close()")
        if self._state == "aborted":
            raise CommAbortedError(f"{call}: communicator rank {self.rank} was aborted")

    def _check_not_grouped(self, call: str) -> None:
        if self._group_depth:
            raise ValueError(f"{call} cannot run inside comm.group(): it needs the results of its "
                             "own transfers (run it outside the group)")

    def _group_open(self, g: Group) -> None:
        """Shared bookkeeping of :meth:`Group.__enter__`."""
        self._check_open("group")
        if self._group_depth:
            raise ValueError("comm.group() does not nest")
        self._group_depth = 1
        self._group = g

    def _check_memory(self, call: str, t: Tensor) -> None:  # noqa: B027 - a hook whose default accepts all
        """Backend hook: reject memory kinds the backend cannot communicate."""

    # ---- argument prologues (shared; return what the backend call needs) ---------------
    def _rs_args(self, t: Tensor, op: str) -> tuple[int, int]:
        self._check_open("reduce_scatter")
        code = check_op("reduce_scatter", op, REDUCE_SCATTER_OPS)
        check_tensor(self, "reduce_scatter", t, divisible=True)
        return t.numel // self.world, code

    def _ag_args(self, t: Tensor, out: Tensor | None) -> tuple[Tensor, Tensor]:
        """(shard, full) for in-place (``out`` None, ``t`` full) or out-of-place all-gather."""
        self._check_open("all_gather")
        if out is None:
            check_tensor(self, "all_gather", t, divisible=True)
            n = t.numel // self.world
            return t.flat().view(self.rank * n, n), t
        check_tensor(self, "all_gather", t, "shard")
        check_tensor(self, "all_gather", out, "out")
        check_same("all_gather", t, out)
        if out.numel != t.numel * self.world:
            raise ValueError(f"all_gather: out {out.name!r} of shape {out.shape} must hold world ({self.world}) x "
                             f"shard {t.name!r} of shape {t.shape} = {t.numel * self.world} elements")
        return t, out

    def _ar_args(self, t: Tensor, op: str) -> int:
        self._check_open("all_reduce")
        code = check_op("all_reduce", op, ALL_REDUCE_OPS)
        check_tensor(self, "all_reduce", t)
        return code

    def _p2p_args(self, call: str, t: Tensor, peer: int) -> int:
        self._check_open(call)
        check_tensor(self, call, t)
        return check_peer(self, call, peer)

    def _a2a_args(self, t: Tensor) -> int:
        self._check_open("all_to_all")
        self._check_not_grouped("all_to_all")
        check_tensor(self, "all_to_all", t, divisible=True)
        return t.numel // self.world

    @staticmethod
    def _check_bytes(call: str, data: Any) -> bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"{call}: data must be bytes, got {type(data).__name__}")
        return bytes(data)

    # ---- the collectives each backend implements -----------------------------------------
    @abstractmethod
    def reduce_scatter(self, t: Tensor, op: str = "avg", stream: StreamLike = None) -> None:
        """In place: ``t`` is the full buffer (numel divisible by ``world``) on every rank;
        afterwards ``shard_view(t, rank, world)`` (flat elements ``[rank*n, (rank+1)*n)``,
        n = numel/world) holds the ``avg`` or ``sum`` over ranks; the rest of ``t`` is unspecified."""

    @abstractmethod
    def all_gather(self, t: Tensor, out: Tensor | None = None, stream: StreamLike = None) -> None:
        """In place (``out`` None: ``t`` full, the own shard already at ``shard_view(t, rank,
        world)``) or from shard ``t`` into ``out`` (``world * t.numel`` elements, same dtype, rank
        order)."""

    @abstractmethod
    def all_reduce(self, t: Tensor, op: str = "sum", stream: StreamLike = None) -> None:
        """In place: every rank's ``t`` becomes the ``sum``, ``avg`` or ``max`` over ranks."""

    @abstractmethod
    def send(self, t: Tensor, peer: int, stream: StreamLike = None) -> None:
        """Send ``t`` to rank ``peer``, paired with the peer's :meth:`recv` of the same dtype and
        size (inside :meth:`group` when both sides also receive)."""

    @abstractmethod
    def recv(self, t: Tensor, peer: int, stream: StreamLike = None) -> None:
        """Receive ``t.numel`` elements from rank ``peer`` into ``t``."""

    def all_to_all(self, t: Tensor, stream: StreamLike = None) -> None:
        """The destructive all-to-all: slot k (numel/world elements) of ``t`` goes to rank k;
        afterwards slot (rank+d-1)%world holds rank (rank-d)%world's slot ``rank`` and slot
        :meth:`all_to_all_skip` holds no peer data. The own slot must be consumed before.
        ``world - 1`` send/recv steps in order on ``stream`` (:func:`all_to_all_schedule`); not
        allowed inside :meth:`group`."""
        self.all_to_all_many((t,), stream)

    @abstractmethod
    def all_to_all_many(self, tensors: Sequence[Tensor], stream: StreamLike = None) -> None:
        """:meth:`all_to_all` of several buffers (a layer's gradients) in the same ``world - 1``
        steps, each step moving every buffer's slot."""

    def group(self, stream: StreamLike = None, event: Any = None) -> Group:
        """A grouped transaction on ``stream``: ``with comm.group(s) as g: comm.send(..);
        comm.recv(..)`` launches the calls together at exit, then records ``g.event`` on ``s``
        (``event``: reuse this event instead of creating one, for hot paths). See :class:`Group`."""
        return Group(self, self.device.resolve_stream(stream), event or self.device.event())

    @abstractmethod
    def _group_begin(self, g: Group) -> None:
        """Open ``g`` (:meth:`_group_open` and the backend's start of a transaction)."""

    def _group_end(self, g: Group, failed: bool) -> None:
        """Close ``g``: the backend runs (or, when the block ``failed``, drops) what was scheduled,
        then ``g.event`` is recorded on ``g.stream``; a block that failed after scheduling
        something aborts (its peers may already have the other half of the transaction)."""
        self._group, self._group_depth = None, 0
        self._group_close(g, failed)
        if failed:
            if g.scheduled:
                self.abort()
            return
        g.event.record(g.stream)

    @abstractmethod
    def _group_close(self, g: Group, failed: bool) -> None:
        """Backend hook of :meth:`_group_end`: end the transaction ``g`` opened, running what it
        scheduled, or only closing it when the block ``failed``."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank has called barrier (bounded by ``timeout``)."""

    @abstractmethod
    def wait(self, what: Any = None, timeout: float | None = None) -> None:
        """Block until ``what`` (an event, a stream, a raw stream handle; None: the default
        stream) has completed, watching for communication errors: an asynchronous error or
        ``timeout`` seconds (default: the communicator's) abort the communicator and raise."""

    def split(self, color: int, key: int | None = None) -> CommBase:
        """A new communicator for each ``color``: a collective over every rank of this one
        (each calls it once, in the same order as its other collectives); the ranks that pass
        the same ``color`` form one new communicator of the same backend on the same device,
        their new ranks in the order of (``key``, rank here); ``key`` defaults to this rank (the
        parent's order). ``color``: an int in ``[0, 2**31)``; ``key``: an int in
        ``[-2**31, 2**31)``; TypeError/ValueError before anything happens. The new communicator
        has its own ``close`` and this one's timeout; an abort of this one (a failed rank's, the
        watchdog's, :meth:`abort`) aborts it too, so a failure reaches every communicator split
        from the one it aborted."""
        color, key = check_split(self, color, key)
        child = self._split(color, key)
        child.ranks_are_threads = self.ranks_are_threads
        return child

    @abstractmethod
    def _split(self, color: int, key: int) -> CommBase:
        """Backend hook of :meth:`split`, its arguments checked."""

    # ---- written once on the backend primitives ----------------------------------------
    def all_to_all_skip(self) -> int:
        """This rank's slot without a peer contribution after :meth:`all_to_all`."""
        return all_to_all_skip(self.rank, self.world)

    def host_gather(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """Every rank's ``data`` in rank order on ``root``; None on the other ranks. Blocking."""
        root = check_peer(self, "host_gather", root)
        out = self.host_allgather(data)
        return out if self.rank == root else None

    @abstractmethod
    def host_allgather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (small bytes) in rank order, on every rank. Blocking."""

    @abstractmethod
    def abort(self) -> None:
        """Abort (from any thread; idempotent): outstanding work stops, pending and later calls
        raise CommAbortedError; peers blocked on this rank are woken where the backend can."""

    @abstractmethod
    def close(self) -> None:
        """Release the communicator after its queued work (idempotent); later calls raise
        ClosedError."""

    def __enter__(self) -> CommBase:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None and self._state == "open":
            self.abort()
        else:
            self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world={self.world}, device={self.device!r}, {self._state})"


class Group:
    """The context manager :meth:`comm.group` returns: calls inside the ``with`` block are
    scheduled and execute together when it exits; then ``event`` is recorded on the group's
    ``stream`` (wait on it with ``stream.wait(g.event)`` or ``comm.wait(g.event)``). Groups do
    not nest. An exception escaping the block after something was scheduled aborts the
    communicator: a partially scheduled transaction cannot be taken back from the peers."""

    __slots__ = ("comm", "stream", "event", "scheduled")

    def __init__(self, comm: Any, stream: Any, event: Any) -> None:
        self.comm, self.stream, self.event, self.scheduled = comm, stream, event, 0

    def __enter__(self) -> Group:
        self.comm._group_begin(self)
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.comm._group_end(self, failed=exc_type is not None)
