"""The ``unsharded`` strategy (ZeRO-1): full gradients of every layer on every rank; the engine
accumulates into them; on the last micro-step each tensor is reduce-scattered (average) in place
and the shards are views of the full buffers."""
from __future__ import annotations

from collections.abc import Callable

from lowgrad import ops
from lowgrad.buffers.streams import StreamLike
from lowgrad.buffers.tensor import Container, Tensor, shard_view
from lowgrad.managers.strategy import StatsTarget, Strategy, StrategyContext


class Unsharded(Strategy):
    name = "unsharded"
    default_rounding = None
    sharded = False
    offloads = False

    def stats_kinds(self) -> tuple[bool, str | None]:
        return False, "step"

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        lazy = ctx.device.lazy_allocator("device")
        self.tensors = [[lazy.alloc(s.shape, ctx.dtype, "block_grad") for s in ctx.layout.block]
                        for _ in range(ctx.layout.num_layers)]
        lazy.commit()
        self.containers = [ctx.container(ts) for ts in self.tensors]
        self.local: list[Callable[[int], None]] = []

    def bind(self, target: StatsTarget | None) -> None:
        if target is None or target[1].local != "step" or not self.ctx.layout.block:
            return
        sink, rows = target
        # each rank's gradient accumulated over the step, measured before the reduce-scatter
        self.local = [ops.bind_grad_stats(self.tensors[l], sink, rows.layer_columns(l), rows.local_row)
                      for l in range(self.ctx.layout.num_layers)]

    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Layer ``layer``'s full gradients and whether to add into them (False on micro-step 0).
        ``zero_init`` tensors are zeroed on ``stream`` on micro-step 0 and always added into."""
        ctx = self.ctx
        if ctx.first:
            ctx.wait(ctx.comm_done, stream)  # the previous step's reduce-scatters have finished
            ctx.zero_init(self.tensors[layer], stream)
        return self.full(layer), not ctx.first

    def full(self, layer: int) -> Container:
        return self.containers[layer]

    def notify(self, layer: int, stream: StreamLike) -> None:
        ctx = self.ctx
        if ctx.last and ctx.world > 1:  # world 1: the mean is the gradient
            ctx.join(stream)
            if self.local:
                self.local[layer](ctx.comm_handle)
            ctx.reduce_scatter_all(self.tensors[layer])

    def block_shard(self, layer: int) -> Container:
        """This rank's shards of layer ``layer``: views of the full gradients."""
        return self.ctx.container([shard_view(t, self.ctx.rank, self.ctx.world) for t in self.tensors[layer]])

    def shards(self) -> list[Tensor]:
        return [shard_view(t, self.ctx.rank, self.ctx.world) for ts in self.tensors for t in ts]

    def owned(self) -> list[Tensor]:
        return [t for ts in self.tensors for t in ts]
