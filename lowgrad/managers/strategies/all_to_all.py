"""The ``all_to_all`` strategy: the buffers and shards of ``scatter_reduce``, another exchange.
At ``notify`` the own slice is added into the shard first (phase 0), then the destructive
all-to-all brings every peer's slice for this rank into the other slots of the buffer, and
``reduce_sr`` folds them into the shard (phase 1), dividing by ``world`` on the last micro-step.
"""
from __future__ import annotations

from collections.abc import Callable

from lowgrad import ops
from lowgrad.managers.strategies.scatter_reduce import ScatterReduce
from lowgrad.managers.strategy import MicroStepBytes, StatsTarget


class AllToAll(ScatterReduce):
    name = "all_to_all"

    @classmethod
    def micro_step_bytes(cls, block_bytes: int, world: int, first: bool, offload: bool = False) -> MicroStepBytes:
        # beside scatter_reduce's add of the own slice: reduce_sr reads the W slots and the shard
        # and writes the shard (the shard twice over PCIe), and the exchange moves (W-1)/W both ways
        base = super().micro_step_bytes(block_bytes, world, first, offload)
        if world == 1:
            return base
        return MicroStepBytes(base.device + (world + 1) * block_bytes // world,
                              2 * (world - 1) * block_bytes // world, 2 * base.pcie)

    def stats_kinds(self) -> tuple[bool, str | None]:
        # at world > 1 no kernel holds the reduced gradient of a micro-step
        return self.ctx.world == 1, "micro"

    def bind(self, target: StatsTarget | None) -> None:
        super().bind(target)
        ctx = self.ctx
        W = ctx.world
        skip = (ctx.rank + W - 1) % W
        self.red: list[list[list[Callable[[int], None]]]] = [
            [[ops.bind_reduce_sr(sh, full, W, skip, scale, True, ctx.shard_offset(spec), (ctx.counter, l, 2 * i + 1))
              for scale in (1.0, 1.0 / W)]
             for i, (sh, full, spec) in enumerate(zip(self.shard_tensors[l], self.buffers[l % 2], ctx.layout.block))]
            for l in range(ctx.layout.num_layers)] if W > 1 else []

    def exchange(self, layer: int) -> None:
        ctx = self.ctx
        self.add_own(layer)  # consumes the own slot before the exchange
        if ctx.world > 1:  # world 1: no peers, the own slice is the whole mean
            last = int(ctx.last)
            ctx.comm.all_to_all_many(self.buffers[layer % 2], stream=ctx.comm_stream)  # in W-1 steps
            for red in self.red[layer]:
                red[last](ctx.comm_handle)
