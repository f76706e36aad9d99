"""What a gradient-manager strategy is: the interface it implements (:class:`Strategy`) and the
narrow context the manager hands it (:class:`StrategyContext`).

The manager (:mod:`lowgrad.managers.manager`) keeps the protocol: the micro-step state machine
and every check, the events between the engine's stream and the communication stream, the seed
counter, the non-block gradients, the norm, the saved state, the statistics
(:mod:`lowgrad.managers.stats`) and graph capture (:mod:`lowgrad.managers.replay`). A strategy
owns the block half — where a layer's gradients are written, how they cross the ranks and where
they accumulate — and one strategy lives in one file of :mod:`lowgrad.managers.strategies`,
registered by one line there. It reaches the manager only through its context; nothing of the
manager's private state (a test walks every strategy file and checks that it touches no
``x._name`` but its own).

A strategy's life, for one rank (``ctx``: its :class:`StrategyContext`)::

    check(comm, offload, **options)  # classmethod, before the manager allocates anything:
                                     # TypeError/ValueError for a bad option, nothing changed
    s = Strategy(ctx, **options)     # allocate: full buffers, shards, their events
                                     # (a collective where it splits the communicator)
    s.bind(target)                   # pack the per-layer launches; again when the statistics are
                                     # allocated (target: where they measure, or None); assigns
                                     # its attributes, never changes one in place (see bind)
    per micro-step, per layer L-1 .. 0 (the manager has checked the call and recorded it):
        full, accumulate = s.block_full(layer, stream)  # what the engine writes the layer into
        s.notify(layer, stream)      # queue the layer's exchange and accumulation: on
                                     # ctx.comm_stream after ctx.join(stream), or inline on stream
    between steps (the manager has checked and waits for the step's traffic):
        s.block_shard(layer)         # this rank's shards of a layer: what the optimizer reads
        s.shards()                   # every block shard, layer by layer (norm, statistics, optimizer)
    s.owned()                        # the tensors close() frees; s.close() anything else it holds

``block_full`` must make ``stream`` wait (``ctx.wait``) for whatever still reads the buffer it
hands out; a buffer's previous user signals through an event the strategy records with
``ctx.record`` (so that a graph capture sees it) and lists in :meth:`Strategy.events` (so that
the manager re-records it after a capture and after each replay). Every rank issues the same
collectives in the same order: ``notify`` of layer ``l`` in micro-step ``m`` queues the same calls
on every rank. The seeds of SR kernels come from ``ctx.counter`` (the step, the micro-step and
``(layer, lane)``), never from host state, so that a captured micro-step replays with fresh noise.
"""
from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

from lowgrad import ops
from lowgrad.base.dtypes import DType
from lowgrad.buffers.streams import StreamLike
from lowgrad.buffers.tensor import Container, Tensor
from lowgrad.contracts.kernels import StatsSink
from lowgrad.managers.layout import Layout, ParamSpec
from lowgrad.managers.protocol import HostState
from lowgrad.managers.stats import StatsRows
from lowgrad.sr.seedcounter import DEFAULT_ROUNDING, SeedCounter

#: where the bound launches measure statistics: the sink their kernels write and its rows' layout
StatsTarget = tuple[StatsSink, StatsRows]


class MicroStepBytes(NamedTuple):
    """A strategy's memory traffic in one micro-step (:meth:`Strategy.micro_step_bytes`)."""

    device: int  #: read and written by its kernels (device memory, or pinned memory over PCIe)
    exchange: int  #: moved through device memory by its collective where the ranks share one GPU
    pcie: int  #: the part of ``device`` that crosses PCIe (offloaded shards)


class EventOrder(Protocol):
    """How events are recorded and waited for (the manager's :class:`~lowgrad.managers.replay.Capture`):
    inside a graph capture a wait on work recorded outside it is skipped."""

    def record(self, event: Any, stream: StreamLike) -> None: ...

    def wait(self, event: Any, stream: StreamLike) -> None: ...


@dataclass(eq=False, kw_only=True)
class StrategyContext:
    """What the manager lends a strategy, by name: the rank's communicator (``comm``; ``rank``,
    ``world``, ``device`` from it), the ``layout``, the gradient ``dtype`` and ``rounding``, the
    user's ``offload`` and the manager's ``inline`` decision (accumulate on the engine's stream:
    from :meth:`Strategy.inline_refusal` and the user's ``inline``), the communication stream
    (``comm_stream``, its raw handle ``comm_handle``), the seed ``counter``, and the events the
    manager owns: ``comm_done`` (recorded on the communication stream at the end of every
    micro-step), ``group_done`` (a group of collectives on the communication stream reuses it)
    and ``engine_done`` (:meth:`join`'s).

    The verbs a strategy calls, and their contract (none calls back into the manager: a layer's
    micro-step crosses from the manager to its strategy twice, ``block_full`` and ``notify``, and
    never back; ``tests/test_strategy.py`` counts):

    - :meth:`record` / :meth:`wait`: record an event on a stream, make a stream wait for one;
      always through these, never ``event.record`` / ``event.wait``, so that a graph capture
      skips waits on work recorded outside it;
    - :meth:`join`: the communication stream waits for a stream's work so far (before ``notify``
      queues the exchange of what the engine wrote there);
    - :attr:`micro`, :attr:`first`, :attr:`last`: the micro-step in progress, read from the
      protocol's state (never kept: a failed discard replaces it);
    - :meth:`container`, :meth:`zero_init`, :meth:`shard_offset`, :meth:`reduce_scatter_all`:
      a layer's tensors named by the layout, zeroed where the layout says, the noise index of a
      slice, one grouped reduce-scatter of a layer."""

    layout: Layout
    comm: Any
    dtype: DType
    rounding: str | None
    offload: bool
    inline: bool
    comm_stream: Any
    comm_handle: int
    counter: SeedCounter
    events: EventOrder
    host: HostState  # the protocol's state is host.protocol (replaced after a failed discard)
    group_done: Any
    comm_done: Any
    engine_done: Any

    def record(self, event: Any, stream: StreamLike) -> None:
        """Record ``event`` on ``stream`` (a capture in progress notes it)."""
        self.events.record(event, stream)

    def wait(self, event: Any, stream: StreamLike) -> None:
        """``stream`` waits for ``event`` (inside a capture: only for an event recorded in it)."""
        self.events.wait(event, stream)

    def join(self, stream: StreamLike) -> None:
        """The communication stream waits for ``stream``'s work so far."""
        self.record(self.engine_done, stream)
        self.wait(self.engine_done, self.comm_stream)

    @property
    def rank(self) -> int:
        return int(self.comm.rank)

    @property
    def world(self) -> int:
        return int(self.comm.world)

    @property
    def device(self) -> Any:
        return self.comm.device

    @property
    def micro(self) -> int:
        """The micro-step in progress (or the last one started)."""
        return self.host.protocol.micro

    @property
    def first(self) -> bool:
        """The micro-step in progress is its step's first."""
        return self.host.protocol.micro == 0

    @property
    def last(self) -> bool:
        """The micro-step in progress is its step's last."""
        return self.host.protocol.last

    def container(self, tensors: list[Tensor]) -> Container:
        """A layer's tensors named as the layout's block parameters."""
        return Container([(s.name, t) for s, t in zip(self.layout.block, tensors)])

    def zero_init(self, tensors: Iterable[Tensor], stream: StreamLike) -> None:
        """Zero on ``stream`` the layer's tensors whose parameter is ``zero_init`` (the engine adds
        into those)."""
        for s, t in zip(self.layout.block, tensors):
            if s.zero_init:
                ops.fill_zero(t, stream)

    def shard_offset(self, spec: ParamSpec, index: int | None = None, parts: int | None = None) -> int:
        """Element offset of slice ``index`` of ``parts`` (default: this rank's of ``world``) within
        the full tensor: the index of the SR noise of its first element."""
        index, parts = (self.rank if index is None else index), (self.world if parts is None else parts)
        return index * (spec.numel // parts)

    def reduce_scatter_all(self, tensors: list[Tensor], comm: Any = None, op: str = "avg") -> None:
        """In-place reduce-scatter (``op``, average by default) of every tensor over ``comm`` (the
        manager's by default), as one group on the communication stream: one launch for a layer
        instead of one per tensor."""
        comm = self.comm if comm is None else comm
        if tensors:
            with comm.group(self.comm_stream, event=self.group_done):
                for t in tensors:
                    comm.reduce_scatter(t, op=op, stream=self.comm_stream)


class Strategy(ABC):
    """One way of exchanging and accumulating the block gradients (the module docstring has the
    life of one). What callers ask of the class, never of its name (the demo, the tools, the
    shared tests and the saved state read these):

    - ``name``: the ``strategy=`` it answers to;
    - ``default_rounding``: the rounding of a manager created without one; None: the strategy
      rounds nothing itself and accepts no ``rounding`` (:meth:`rounds`);
    - ``sharded``: True where the block gradients accumulate in this rank's 1/W shards; False
      where every rank keeps the full gradients and its shards are views of them;
    - ``offloads``: True where ``offload=True`` puts its shards in pinned host memory; False
      refuses ``offload`` (:meth:`check`);
    - :meth:`option_names`: the options of its own (``group_size``), from :meth:`check`;
    - :meth:`micro_step_bytes`: a model of its memory traffic per micro-step (the copy-bandwidth
      floors of ``lowgrad demo`` and ``tools/bench_manager.py``)."""

    name: ClassVar[str]
    default_rounding: ClassVar[str | None] = DEFAULT_ROUNDING
    sharded: ClassVar[bool] = True
    offloads: ClassVar[bool] = True

    @classmethod
    def rounds(cls) -> bool:
        """Whether the strategy rounds its accumulation (takes ``rounding``, saves it in its state)."""
        return cls.default_rounding is not None

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The strategy's own options: the keyword parameters of its :meth:`check`."""
        params = inspect.signature(cls.check).parameters.values()
        return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY
                     or p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ("comm", "offload"))

    @classmethod
    def micro_step_bytes(cls, block_bytes: int, world: int, first: bool, offload: bool = False) -> MicroStepBytes:
        """The bytes the strategy's own kernels move in one micro-step (``first``: micro-step 0)
        for ``block_bytes`` of block gradients at ``world``: a model, not a measurement. The
        default is a sharded strategy's (micro-step 0 copies this rank's 1/W slice into its shard:
        read and write; later ones read the shard and the slice and write the shard), with the
        exchange a reduce-scatter of the whole buffer, and offloaded shards read and written over
        PCIe; a strategy that shards nothing moves nothing itself (the engine accumulates)."""
        if not cls.sharded:
            return MicroStepBytes(0, 0, 0)
        shard = block_bytes // world
        return MicroStepBytes((2 if first else 3) * shard, block_bytes + shard if world > 1 else 0,
                              2 * shard if offload else 0)

    @classmethod
    def check(cls, comm: Any, offload: bool, **options: Any) -> dict[str, Any]:
        """Check ``offload`` and the strategy's own options before anything is allocated; the
        options the constructor takes. A strategy without options refuses every one; one that
        does not offload refuses ``offload=True``."""
        if offload and not cls.offloads:
            raise ValueError(f"offload applies to the strategies that keep their shards apart; the {cls.name} "
                             "manager keeps full gradients on the device")
        if options:
            raise TypeError(f"the {cls.name} strategy takes no options; got {sorted(options)}")
        return {}

    @classmethod
    def inline_refusal(cls, world: int, offload: bool) -> str | None:
        """Why the accumulation cannot run on the engine's stream here (None: it can)."""
        if not cls.rounds():
            return f"the {cls.name} manager accumulates nothing itself"
        if world > 1:
            return f"world is {world}: the accumulation follows the exchange"
        if offload:
            return "offloaded shards are accumulated over PCIe, beside the engine's work"
        return None

    def stats_kinds(self) -> tuple[bool, str | None]:
        """Which rows the strategy measures at world > 1 (:class:`StatsRows`' ``micro``: the
        reduced gradient of each micro-step; ``local``: each rank's own gradient per micro-step
        (``"micro"``), once per step (``"step"``) or never (None)); at world 1 the manager
        never measures the local rows."""
        return False, None

    @abstractmethod
    def __init__(self, ctx: StrategyContext, **options: Any) -> None:
        """Allocate the block gradients (full buffers, shards) and their events."""

    def bind(self, target: StatsTarget | None) -> None:  # noqa: B027 - a hook whose default binds nothing
        """Check and pack the per-layer launches once (again when the statistics are allocated:
        ``target`` says where they measure).

        Bind by *assigning* attributes (``self.launches = [...]``), never by changing one in
        place (``self.launches.append``, ``self.launches[l] = ...``): when the statistics'
        allocation fails half-way (out of memory), the manager puts back the strategy's
        ``__dict__`` as it was before this call (a shallow copy: the old objects, not copies of
        them), so the launches bound before stay whole and a graph captured before still writes
        where they did (``Statistics.alloc``)."""

    @abstractmethod
    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Layer ``layer``'s buffers for the engine and whether to add into them; ``stream``
        waits until they are free."""

    @abstractmethod
    def full(self, layer: int) -> Container:
        """The buffers :meth:`block_full` hands out for ``layer`` in the current micro-step."""

    @abstractmethod
    def notify(self, layer: int, stream: StreamLike) -> None:
        """Queue layer ``layer``'s exchange and accumulation of what the engine wrote on ``stream``."""

    @abstractmethod
    def block_shard(self, layer: int) -> Container:
        """This rank's shards of layer ``layer`` (the manager has waited for the step's traffic)."""

    @abstractmethod
    def shards(self) -> list[Tensor]:
        """This rank's block shards, layer by layer in layout order."""

    @abstractmethod
    def owned(self) -> list[Tensor]:
        """The block tensors this strategy allocated (the manager frees them at close)."""

    def events(self) -> list[Any]:
        """The strategy's events later calls wait on (re-recorded after a capture and a replay)."""
        return []

    def close(self) -> None:  # noqa: B027 - a hook for what a strategy holds beyond its tensors
        """Release what the strategy holds beyond :meth:`owned` (a split communicator)."""
