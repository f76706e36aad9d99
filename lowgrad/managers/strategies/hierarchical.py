"""The ``hierarchical`` strategy, for runs over several nodes: the ranks are grouped by node
(``group_size`` G = GPUs per node, ranks ``n*G .. n*G+G-1`` on node ``n``; N = world / G nodes);
every micro-step reduces within the node only, over the fast link, and the step's node sums cross
the nodes once, at the last micro-step. The shape of FSDP2's HSDP, ZeRO++'s hierarchical qgZ and
Megatron's distributed-optimizer instances, with the accumulation in bf16 with SR.

Buffers: two full-size block buffers used alternately (as ``scatter_reduce``); per layer and
tensor an accumulator of 1/G of the tensor (device or pinned memory with offload), made of N
pieces: piece ``k`` accumulates chunk ``k*G + g`` of W (``g`` this rank's index in its node).

At ``notify``, on the communication stream after the engine's work:

1. within the node (the communicator split by node), over the N contiguous slices of 1/N of the
   tensor, so that this rank gets chunks ``k*G + g`` of the node's ranks for every k (the bytes of
   one reduce-scatter, ``(G-1)/G`` of the tensor):

   - ``rounding="ldsr"`` or ``"rn"``: one group of N in-place reduce-scatters (average over G),
     then the N chunks are added into the accumulator's pieces (a copy on micro-step 0,
     ``add_sr`` with phase-0 noise after);
   - ``rounding="sr"``: this rank's own chunks are added first (the same copy or add), then the
     destructive all-to-all of the slices brings the node's peers' chunks, and ``reduce_sr`` adds
     them to each piece in float32 and rounds once (phase 1; a
     :class:`~lowgrad.managers.exchange.SumExchange`): the pieces hold the node's sums, unbiased;

   node ``n`` rounds with the noise of the chunk's element indices in the full tensor shifted by
   ``n * numel``: each node's own noise, so that the nodes' rounding errors average out;
2. on the last micro-step only, across the nodes (the communicator split by local index ``g``:
   the N ranks of the same index), piece ``n`` (this rank's node) becomes chunk ``n*G + g`` = chunk
   ``rank`` of the mean over all W ranks, the shard every other strategy gives this rank:

   - ``"ldsr"``, ``"rn"``: an in-place reduce-scatter (average over N) of the accumulator (with
     offload staged through the free part of the layer's device buffer: NCCL reduces device
     memory only), rounded to nearest;
   - ``"sr"``: the accumulator staged into the layer's device buffer, its destructive all-to-all,
     and the other nodes' pieces added into piece ``n`` in float32, scaled by 1/W and rounded once
     with SR (the noise of the element indices shifted by ``N * numel``, no node's).

   With ``cross_node_bits=8`` (opt-in) the pieces cross in 8 bits instead, whatever the rounding
   (:class:`~lowgrad.managers.exchange.Int8Hop`): int8 with a float32 scale per 128 elements,
   quantized with SR, summed in float32 on the receiver with piece ``n``, rounded once; 0.52 of
   the bytes.

Under ``"sr"`` every exchange thus adds in float32 and rounds once with fresh noise: the step's sum
is unbiased (tools/exchange_bias.py; docs/accuracy.md, "What the exchange adds"). The non-block
gradients go through the same two levels once per step, and ShardOptimizer's parameter
all-gather through them the other way (:meth:`groups`).

Why reduce-scatter across nodes rather than all-reduce keeping 1/G: per step each rank sends
``(N-1)/N * B/G`` bytes over the inter-node link (B the layer's gradient bytes) where an
all-reduce sends twice that, and the shard the optimizer reads is 1/W (its state 1/W, the same
shards and norms as the other strategies) rather than 1/G. The accumulator (1/G, N times a 1/W
shard) is the memory hierarchical pays for crossing the nodes once per step instead of once per
micro-step: the blocks' inter-node bytes per rank and step are ``M (W-1)/W B/G`` for
``scatter_reduce``'s ring over all W ranks (M micro-steps) and ``(N-1)/N B/G`` here, fewer by
``M (W-1)/W N/(N-1)``: 14x at M = 8, W = 8, G = 4 (counted on the host backend through a wrapped
communicator: tests/test_predict_scaling.py), and the inter-node collective spans N ranks instead
of W.

``group_size``: None reads the launcher's ranks per node (torchrun's ``LOCAL_WORLD_SIZE``,
Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE``, Slurm's ``SLURM_NTASKS_PER_NODE``), or ``world`` (one
node) where none is set; it must divide the world. Creating the manager is a collective here
(the two splits): every rank creates it. The accumulation follows the node's exchange, so it
never runs inline. Statistics: each rank's own gradient per micro-step (the local rows) and the
step's shards; the micro-step rows (the mean over all ranks of one micro-step) only on one node
under ``"ldsr"``/``"rn"``, where the accumulation's adds see that mean (NaN otherwise: no kernel
holds it).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from lowgrad import ops
from lowgrad.base.integers import integer
from lowgrad.buffers.streams import StreamLike
from lowgrad.buffers.tensor import Container, Tensor, shard_view
from lowgrad.managers.exchange import Int8Hop, NodeGroups, SumExchange
from lowgrad.managers.strategies.buffers import AlternatingBuffers
from lowgrad.managers.strategy import StatsTarget, Strategy, StrategyContext
from lowgrad.sr.reference import QBLOCK

#: the launchers' ranks per node, in the order they are read
LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def local_world_size(world: int) -> int:
    """The launcher's ranks per node, or ``world`` where no launcher variable is set."""
    for var in LOCAL_SIZE_VARIABLES:
        value = os.environ.get(var, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"hierarchical: {var}={value!r} is not a positive int (pass group_size)")
            return int(value)
    return world


class Hierarchical(Strategy):
    name = "hierarchical"

    @classmethod
    def check(cls, comm: Any, offload: bool, group_size: Any = None, cross_node_bits: Any = 16,
              **options: Any) -> dict[str, Any]:
        super().check(comm, offload, **options)
        world = int(comm.world)
        G = local_world_size(world) if group_size is None else integer("group_size", group_size)
        if G < 1 or world % G:
            raise ValueError(f"hierarchical: group_size {G} must be a positive divisor of world {world}")
        bits = integer("cross_node_bits", cross_node_bits)
        if bits not in (8, 16):
            raise ValueError(f"hierarchical: cross_node_bits must be 16 (the accumulator's bf16) or 8 (int8 with a "
                             f"float32 scale per {QBLOCK} elements, rounded stochastically), got {bits}")
        return {"group_size": G, "cross_node_bits": bits}

    @classmethod
    def inline_refusal(cls, world: int, offload: bool) -> str | None:
        return "the hierarchical accumulation follows the node's exchange, on the communication stream"

    def stats_kinds(self) -> tuple[bool, str | None]:
        # the micro-step rows: the mean over every rank of a micro-step, only held on one node
        # where the node's exchange rounds it before the accumulation adds it
        return self.N == 1 and not (self.unbiased and self.G > 1), "micro"

    def unbiased_exchange(self) -> bool:
        return self.unbiased

    def groups(self) -> NodeGroups:
        return NodeGroups(self.node, self.cross, self.G, self.N, self.n, self.g)

    def __init__(self, ctx: StrategyContext, group_size: int, cross_node_bits: int = 16) -> None:
        self.ctx = ctx
        G, W, rank = group_size, ctx.world, ctx.rank
        self.G, self.N = G, W // G
        self.n, self.g = divmod(rank, G)
        #: every exchange adds in float32 and rounds once with SR (SumExchange), or reduce-scatters
        self.unbiased = ctx.rounding == "sr"
        #: the pieces cross the nodes in int8 (Int8Hop) instead of bf16
        self.bits = cross_node_bits
        # collectives over every rank, in the same order on each; one node (G = W) or one rank
        # per node (G = 1) is the manager's communicator itself
        self.split: list[Any] = []
        try:
            for color in ((self.n, self.g) if 1 < G < W else ()):
                self.split.append(ctx.comm.split(color))
            self.node, self.cross = self.split if self.split else (ctx.comm, ctx.comm)
            self.allocate(group_size)
        except BaseException:  # nothing left behind: a failed manager is not closed
            self.close()
            raise
        self.add: list[Callable[[int], None]] = []
        self.bind(None)

    def allocate(self, G: int) -> None:
        """The buffers, the accumulators and the views the exchange works on."""
        ctx, N = self.ctx, self.N
        L, block = ctx.layout.num_layers, ctx.layout.block
        self.full_buffers = AlternatingBuffers(ctx)
        self.buffers = self.full_buffers.buffers
        acc_lazy = ctx.device.lazy_allocator("pinned" if ctx.offload else "device")
        self.acc = [[acc_lazy.alloc(s.shard_shape(G), ctx.dtype, "block_grad_node_shards")
                     for s in block] for _ in range(L)]
        acc_lazy.commit()
        # the N slices of 1/N of each tensor the node reduces, and this rank's chunk of each
        self.slices = [[[shard_view(t, k, N) for k in range(N)] for t in buf] for buf in self.buffers]
        self.node_slices = [[v for vs in buf for v in vs] for buf in self.slices]  # notify's, built once
        self.own = [[[shard_view(v, self.g, G) for v in vs] for vs in buf] for buf in self.slices]
        self.pieces = [[[shard_view(a, k, N) for k in range(N)] for a in acc] for acc in self.acc]
        self.stage = [[shard_view(t, 0, G) for t in buf] for buf in self.buffers]  # offload: 1/G of device memory
        self.stage_own = [[shard_view(st, self.n, N) for st in stage] for stage in self.stage]  # piece n of each
        self.final = [ctx.container([p[self.n] for p in pieces]) for pieces in self.pieces]
        self.node_sums, self.cross_sums = (self.sum_exchanges() if self.unbiased else ([], []))
        self.hop = Int8Hop(ctx, self.cross, self.pieces, self.n, self.g, G, 1.0 / (ctx.world if self.unbiased else N)) \
            if self.bits == 8 and N > 1 else None

    def sum_exchanges(self) -> tuple[list[SumExchange], list[SumExchange]]:
        """Per layer, the unbiased exchanges (phase 1): within the node, the peers' chunks ``k*G +
        g`` of each slice into piece k (node n's noise, as the adds'; scaled by 1/W on the last
        micro-step where there is one node); across the nodes, the staged pieces of the other
        nodes into piece n, scaled by 1/W, with the noise of the element indices shifted by
        ``N * numel`` (no node's index)."""
        ctx, G, N, W = self.ctx, self.G, self.N, self.ctx.world
        L, block = ctx.layout.num_layers, ctx.layout.block
        node = [SumExchange(self.node, ctx.counter, l,
                            [(p, v, self.n * s.numel + ctx.shard_offset(s, k * G + self.g), 2 * i + 1)
                             for i, (s, ps, vs) in enumerate(zip(block, self.pieces[l], self.slices[l % 2]))
                             for k, (p, v) in enumerate(zip(ps, vs))], (1.0, 1.0 / W))
                for l in range(L)] if G > 1 else []
        cross = [SumExchange(self.cross, ctx.counter, l,
                             [(ps[self.n], st, N * s.numel + ctx.shard_offset(s), 2 * i + 1)
                              for i, (s, ps, st) in enumerate(zip(block, self.pieces[l], self.stage[l % 2]))],
                             (1.0 / W,))
                 for l in range(L)] if N > 1 else []
        return node, cross

    def bind(self, target: StatsTarget | None) -> None:
        """The SR adds of the node's chunks into the accumulator pieces and the local
        measurements. Node ``n`` rounds element ``i`` of a tensor of ``numel`` elements with the
        noise of index ``n * numel + i`` (docs/design.md, "Per-use seeds"): the N nodes accumulate
        the same chunks, and with one noise their rounding errors would add up coherently across
        the nodes instead of averaging out; node 0 keeps the index of ``scatter_reduce``."""
        ctx, G, N = self.ctx, self.G, self.N
        micro = self.stats_kinds()[0] and target is not None and target[1].micro
        lanes = [2 * i for i, _ in enumerate(ctx.layout.block) for _ in range(N)]  # phase 0

        def items(l: int) -> list[tuple[Tensor, Tensor, Tensor, int]]:
            return [(p, p, own, self.n * s.numel + ctx.shard_offset(s, k * G + self.g))
                    for s, ps, owns in zip(ctx.layout.block, self.pieces[l], self.own[l % 2])
                    for k, (p, own) in enumerate(zip(ps, owns))]
        L = ctx.layout.num_layers
        self.add = [ops.bind_add_sr_multi(items(l), (ctx.counter, l, lanes),
                                          stats=(target[0], target[1].layer_columns(l)) if micro and target else None)
                    for l in range(L)] if ctx.layout.block else []
        self.full_buffers.bind(target)

    def events(self) -> list[Any]:
        return self.full_buffers.events()

    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Buffer ``layer % 2``, once its previous exchange is done; always overwritten, but
        ``zero_init`` tensors (zeroed on ``stream``, added into)."""
        full = self.full_buffers.hand_out(layer, stream)
        self.ctx.zero_init(full.tensors(), stream)
        return full, False

    def full(self, layer: int) -> Container:
        return self.full_buffers.containers[layer % 2]

    def notify(self, layer: int, stream: StreamLike) -> None:
        ctx = self.ctx
        ctx.join(stream)
        b = layer % 2
        self.full_buffers.measure(layer)
        if self.unbiased:  # the own chunks first: the all-to-all overwrites them
            self.add_own(layer)
            if self.node_sums:  # one rank per node: its gradient is the node's sum
                self.node_sums[layer].run(ctx.comm_handle, ctx.comm_stream, int(ctx.last and self.N == 1))
        else:
            if self.G > 1:  # one rank per node: its gradient is the node's mean
                ctx.reduce_scatter_all(self.node_slices[b], comm=self.node)
            self.add_own(layer)
        if ctx.last and self.N > 1:  # one node: the node's mean is the mean
            self.cross_nodes(layer)
        self.full_buffers.release(layer)

    def add_own(self, layer: int) -> None:
        """This rank's chunks ``k*G + g`` of the buffer into the accumulator's pieces: a copy on
        micro-step 0, SR adds (phase 0) after."""
        h, b = self.ctx.comm_handle, layer % 2
        if self.ctx.first:
            for ps, owns in zip(self.pieces[layer], self.own[b]):
                for p, own in zip(ps, owns):
                    ops.copy_on_cores(p, own, h)
        elif self.add:
            self.add[layer](h)

    def cross_nodes(self, layer: int) -> None:
        """Piece ``n`` of the accumulator := the mean over the nodes of piece ``n``."""
        ctx, b = self.ctx, layer % 2
        if self.hop is not None:
            self.hop.run(layer)
            return
        if not ctx.offload and not self.unbiased:
            ctx.reduce_scatter_all(self.acc[layer], comm=self.cross)
            return
        h = ctx.comm_handle  # the buffer's node slices were consumed by the adds above: reuse it
        for stage, acc in zip(self.stage[b], self.acc[layer]):
            ops.copy_on_cores(stage, acc, h)
        if self.unbiased:  # piece n stays in place: the sum goes into it
            self.cross_sums[layer].run(h, ctx.comm_stream)
            return
        ctx.reduce_scatter_all(self.stage[b], comm=self.cross)
        for own, piece in zip(self.stage_own[b], self.final[layer].tensors()):
            ops.copy_on_cores(piece, own, h)

    def block_shard(self, layer: int) -> Container:
        """Chunk ``rank`` of W of each tensor: piece ``n`` of the accumulator."""
        return self.final[layer]

    def shards(self) -> list[Tensor]:
        return [t for c in self.final for t in c.tensors()]

    def owned(self) -> list[Tensor]:
        return self.full_buffers.owned() + [t for ts in self.acc for t in ts] + \
            (self.hop.owned() if self.hop is not None else [])

    def close(self) -> None:
        for comm in self.split:
            comm.close()
