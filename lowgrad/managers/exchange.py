"""The exchanges the managers' sums cross, written once on the communicator contract and the SR
kernels, for the strategies and the manager's non-block gradients alike.

- :func:`reduce_scatter_all`: the communicator's in-place reduce-scatter (average) of a group of
  tensors. It rounds the mean to nearest: the host backend once, NCCL's ring at every hop.
- :class:`SumExchange`: the destructive all-to-all of each source's slots, then one ``reduce_sr``
  per destination that adds the peers' slots to what the destination holds in float32 and rounds
  once, with the seed counter's rounding: the bytes of a reduce-scatter (each rank sends
  ``(P-1)/P`` of the sources), and under ``rounding="sr"`` an unbiased sum.
- :class:`NodeGroups`: how the ranks sit on nodes (the communicators of the node and across the
  nodes).
- :class:`NonBlockExchange`: the step's mean of the non-block gradients, through the nodes'
  hierarchy where there is one, unbiased under ``"sr"`` where the strategy's sums are.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lowgrad import ops
from lowgrad.base.dtypes import byte, fp32
from lowgrad.buffers.tensor import Tensor, shard_view
from lowgrad.sr.reference import QBLOCK
from lowgrad.sr.seedcounter import SeedCounter
from lowgrad.sr.seeds import NON_BLOCK_LAYER


def reduce_scatter_all(comm: Any, tensors: Sequence[Tensor], stream: Any, event: Any, op: str = "avg") -> None:
    """In-place reduce-scatter (``op``) of every tensor over ``comm`` as one group on ``stream``
    (``event``: the group's, reused): one launch for a layer instead of one per tensor."""
    if tensors:
        with comm.group(stream, event=event):
            for t in tensors:
                comm.reduce_scatter(t, op=op, stream=stream)


class SumExchange:
    """For pairs ``(dst, src, index_offset, lane)``: ``dst = round(scale * (dst + sum over the
    peers p of slot rank of p's src))``, in float32, rounded once with the noise of ``(counter,
    layer, lane)`` at ``index_offset``; ``src`` holds ``comm.world`` slots of ``dst.numel``
    elements. The own slot of each ``src`` must already be in its ``dst`` (copied or added): the
    destructive all-to-all (:meth:`CommBase.all_to_all`) overwrites it. ``scales``: the scales
    :meth:`run` picks from (e.g. 1 in a middle micro-step, ``1/world`` in the last). Every
    launch is checked and bound once here."""

    def __init__(self, comm: Any, counter: SeedCounter, layer: int,
                 pairs: Sequence[tuple[Tensor, Tensor, int, int]], scales: Sequence[float] = (1.0,)) -> None:
        P, skip = int(comm.world), comm.all_to_all_skip()
        self.comm = comm
        self.sources = [src for _, src, _, _ in pairs]
        self.reduce = [[ops.bind_reduce_sr(dst, src, P, skip, scale, True, off, (counter, layer, lane))
                        for dst, src, off, lane in pairs] for scale in scales]

    def run(self, handle: int, stream: Any, scale: int = 0) -> None:
        """Queue the all-to-all on ``stream`` and the reductions (with ``scales[scale]``) on its raw
        ``handle``."""
        self.comm.all_to_all_many(self.sources, stream=stream)
        for reduce in self.reduce[scale]:
            reduce(handle)


class Int8Hop:
    """``hierarchical``'s pieces across the nodes in 8 bits (``cross_node_bits=8``): at the last
    micro-step each rank quantizes the pieces of the accumulator that other nodes own (int8, one
    float32 scale per ``QBLOCK`` elements, SR: :func:`lowgrad.sr.reference.quantize_i8_sr`), the
    destructive all-to-all of the int8 slots and their scales crosses the nodes, and
    ``dequant_reduce_sr`` adds the other nodes' pieces to this node's own (which never leaves) in
    float32, times ``scale``, rounded once. The bytes across the nodes: 1 + 4/QBLOCK per element
    instead of bf16's 2. Node ``n`` quantizes with the noise of element indices shifted by ``(N + 1
    + n) * numel`` (phase-0 lanes: each node its own noise); the receiver rounds with the
    cross-node exchange's (phase 1, shifted by ``N * numel``). ``pieces[layer][tensor][k]``: the
    accumulator's piece k of each block tensor; the int8 slots and scales, one set per block
    tensor, are reused by every layer (only the communication stream touches them)."""

    def __init__(self, ctx: Any, cross: Any, pieces: list[list[list[Tensor]]], n: int, g: int, G: int,
                 scale: float) -> None:
        N, block = int(cross.world), ctx.layout.block
        dev, skip = ctx.device, cross.all_to_all_skip()
        self.cross, self.ctx = cross, ctx
        self.q = [dev.alloc((N * ps[0].numel,), byte, name="cross_node_int8") for ps in pieces[0]] if pieces else []
        self.scales = [dev.alloc((N * -(-ps[0].numel // QBLOCK),), fp32, name="cross_node_scales")
                       for ps in pieces[0]] if pieces else []
        q_slots = [[shard_view(q, k, N) for k in range(N)] for q in self.q]
        s_slots = [[shard_view(sc, k, N) for k in range(N)] for sc in self.scales]
        self.quantize = [[ops.bind_quantize_i8_sr(q_slots[i][k], s_slots[i][k], ps[k],
                                                  (N + 1 + n) * s.numel + ctx.shard_offset(s, k * G + g),
                                                  (ctx.counter, layer, 2 * i))
                          for i, (s, ps) in enumerate(zip(block, layer_pieces)) for k in range(N) if k != n]
                         for layer, layer_pieces in enumerate(pieces)]
        self.reduce = [[ops.bind_dequant_reduce_sr(ps[n], self.q[i], self.scales[i], N, skip, scale,
                                                   N * s.numel + ctx.shard_offset(s), (ctx.counter, layer, 2 * i + 1))
                        for i, (s, ps) in enumerate(zip(block, layer_pieces))]
                       for layer, layer_pieces in enumerate(pieces)]
        self.pieces, self.buffers = pieces, [*self.q, *self.scales]

    def run(self, layer: int) -> None:
        """Queue layer ``layer``'s hop on the communication stream."""
        h = self.ctx.comm_handle
        for quantize in self.quantize[layer]:
            quantize(h)
        if self.buffers:
            self.cross.all_to_all_many(self.buffers, stream=self.ctx.comm_stream)
        for reduce in self.reduce[layer]:
            reduce(h)

    def owned(self) -> list[Tensor]:
        return list(self.buffers)


@dataclass(frozen=True)
class NodeGroups:
    """The ranks by node: ``size`` (G) ranks per node, ranks ``n*G .. n*G+G-1`` on node ``n`` of
    ``nodes`` (N); this rank is ``g`` of its node and its node ``n``. ``node``: the communicator
    of the node's G ranks; ``cross``: of the N ranks of index ``g``, one per node (where there is
    one node or one rank per node, the manager's communicator stands for the trivial one)."""

    node: Any
    cross: Any
    size: int
    nodes: int
    n: int
    g: int

    @classmethod
    def one_node(cls, comm: Any) -> NodeGroups:
        """Every rank of ``comm`` on one node."""
        return cls(comm, comm, int(comm.world), 1, 0, int(comm.rank))

    @property
    def crosses(self) -> bool:
        """Whether there are two levels: several nodes of several ranks."""
        return self.nodes > 1 and self.size > 1


class NonBlockExchange:
    """The step's mean of the non-block gradients, once per step: afterwards chunk ``rank`` of
    ``world`` (along dim 0) of each tensor holds the mean over every rank, the rest of it is
    unspecified.

    One node (or one rank per node): one exchange over every rank. Several nodes of several ranks:
    within the node first, over the N slices of ``1/N`` of each tensor (so that this rank holds the
    node's chunks ``k*G + g``, k < N), then across the nodes, the N chunks gathered into a scratch
    tensor, so that only ``(N-1)/N`` of ``1/G`` of each tensor leaves each rank's node. With
    ``unbiased`` each exchange is a :class:`SumExchange` (its own chunk first copied out of its
    way: no rounding), rounded once with SR noise of the non-block layer, lanes ``2 * tensor`` within
    the node (element ``i``'s index shifted by ``n * numel``, as hierarchical's accumulation) and
    ``2 * tensor + 1`` across; otherwise reduce-scatters, which round to nearest. The scratch:
    ``1/G`` of the largest tensor across nodes, ``1/world`` of it for one unbiased exchange, none
    for one reduce-scatter; the tensors go one after another through it."""

    def __init__(self, comm: Any, groups: NodeGroups, tensors: Sequence[Tensor], counter: SeedCounter,
                 unbiased: bool, stream: Any, handle: int, event: Any) -> None:
        self.stream, self.handle, self.event = stream, handle, event
        self.scratch: list[Tensor] = []
        self.steps: list[Callable[[], None]] = []
        W = int(comm.world)
        if W == 1 or not tensors:
            return
        if not groups.crosses:
            groups = NodeGroups.one_node(comm)
        self.groups = groups
        if not groups.crosses and not unbiased:  # one reduce-scatter of every tensor
            tensors = list(tensors)
            self.steps.append(lambda: reduce_scatter_all(comm, tensors, stream, event))
            return
        slots = groups.nodes if groups.crosses else 1
        lazy = comm.device.lazy_allocator("device")
        self.scratch = [lazy.alloc((slots * max(t.numel for t in tensors) // W,), tensors[0].dtype,
                                   "non_block_exchange")]
        lazy.commit()
        if groups.crosses and not unbiased:
            nodes = [v for t in tensors for v in self._slices(t)]
            self.steps.append(lambda: reduce_scatter_all(groups.node, nodes, stream, event))
        for j, t in enumerate(tensors):
            if unbiased:
                self._unbiased(j, t, counter)
            else:
                self._nearest(t)

    def _slices(self, t: Tensor) -> list[Tensor]:
        return [shard_view(t, k, self.groups.nodes).flat() for k in range(self.groups.nodes)]

    def _chunks(self, t: Tensor) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """This rank's node chunks of ``t`` (``k*G + g``), their N scratch slots and chunk ``rank``."""
        G, N, n, g = self.groups.size, self.groups.nodes, self.groups.n, self.groups.g
        c = t.numel // (G * N)
        mine = [t.flat().view((k * G + g) * c, c) for k in range(N)]
        return mine, [self.scratch[0].view(k * c, c) for k in range(N)], mine[n]

    def _nearest(self, t: Tensor) -> None:
        """Across the nodes, after the node's reduce-scatter of every tensor: the node's chunks
        into the scratch, their reduce-scatter over the N ranks, its slot ``n`` back."""
        mine, slots, own = self._chunks(t)
        cross, h, n = self.groups.cross, self.handle, self.groups.n
        gathered = self.scratch[0].view(0, len(slots) * own.numel)

        def step() -> None:
            for slot, chunk in zip(slots, mine):
                ops.copy_on_cores(slot, chunk, h)
            reduce_scatter_all(cross, [gathered], self.stream, self.event)
            ops.copy_on_cores(own, slots[n], h)
        self.steps.append(step)

    def _unbiased(self, j: int, t: Tensor, counter: SeedCounter) -> None:
        """The node's sums of this rank's chunks into the scratch slots (one SR rounding each), then
        across the nodes into chunk ``rank`` of ``t`` (another, with the scale 1/world)."""
        groups, W = self.groups, self.groups.size * self.groups.nodes
        mine, slots, own = self._chunks(t)
        numel, c, G, n, g = t.numel, own.numel, groups.size, groups.n, groups.g
        last = 1.0 if groups.crosses else 1.0 / W
        node = SumExchange(groups.node, counter, NON_BLOCK_LAYER,
                           [(slot, src, n * numel + (k * G + g) * c, 2 * j)
                            for k, (slot, src) in enumerate(zip(slots, self._slices(t)))], (last,))
        gathered = self.scratch[0].view(0, len(slots) * c)
        cross = SumExchange(groups.cross, counter, NON_BLOCK_LAYER, [(own, gathered, (n * G + g) * c, 2 * j + 1)],
                            (1.0 / W,)) if groups.crosses else None
        h, stream = self.handle, self.stream

        def step() -> None:
            for slot, chunk in zip(slots, mine):  # the own slots, before the all-to-all overwrites them
                ops.copy_on_cores(slot, chunk, h)
            node.run(h, stream)
            ops.copy_on_cores(own, slots[n], h)
            if cross is not None:
                cross.run(h, stream)
        self.steps.append(step)

    def __call__(self) -> None:
        """Queue the exchange on the communication stream."""
        for step in self.steps:
            step()

    def owned(self) -> list[Tensor]:
        """The scratch tensor (the manager frees it at close)."""
        return list(self.scratch)
