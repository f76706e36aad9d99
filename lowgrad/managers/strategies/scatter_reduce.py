"""The ``scatter_reduce`` strategy (ZeRO-2 for the blocks): two full-size block buffers used
alternately (layer ``l`` uses buffer ``l % 2``) and one shard per layer that accumulates with
stochastic rounding; optionally the shards live in pinned host memory (offload) and the SR
kernels work on them over PCIe.

At ``notify``, on the communication stream after the engine's work: NCCL reduce-scatter
(average) of each tensor in place, then the own slice is added into the shard (a copy on
micro-step 0; ``add_sr`` with phase-0 noise after). The buffer of layer ``l`` is handed out again
(to layer ``l - 2``) only after that exchange and accumulation finished: the engine's stream
waits on an event, never the host.

At world 1 with device shards there is nothing to exchange, and the manager works *inline*
(unless created with ``inline=False``): on micro-step 0 the engine writes straight into the
shards (no copy), after it the SR accumulation runs on the engine's stream at ``notify``.
Inline is the default because beside a transformer's backward the accumulation on a second
stream slows the step by several times its own kernel time (it competes with compute-bound
kernels for the SMs), while inline it costs its kernel time; beside an engine of memory-bound
copies the second stream is the faster one, by the kernel tails it overlaps (the measurements
are in BENCHMARKS.md). With offload the accumulation crosses PCIe and stays on the
communication stream.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowgrad import ops
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Container, Tensor, shard_view
from lowgrad.contracts.kernels import StatsSink
from lowgrad.managers.strategies.buffers import AlternatingBuffers
from lowgrad.managers.strategy import StatsTarget, Strategy, StrategyContext


class ScatterReduce(Strategy):
    name = "scatter_reduce"

    def stats_kinds(self) -> tuple[bool, str | None]:
        return True, "micro"

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        L, block = ctx.layout.num_layers, ctx.layout.block
        self.full_buffers = AlternatingBuffers(ctx)
        self.buffers = self.full_buffers.buffers
        shard_lazy = ctx.device.lazy_allocator("pinned" if ctx.offload else "device")
        self.shard_tensors = [[shard_lazy.alloc(s.shard_shape(ctx.world), ctx.dtype,
                                                "block_grad_shards") for s in block] for _ in range(L)]
        shard_lazy.commit()
        self.shard_containers = [ctx.container(ts) for ts in self.shard_tensors]
        self.own = [[shard_view(t, ctx.rank, ctx.world) for t in buf] for buf in self.buffers]
        self.acc: list[Callable[[int], None]] = []
        self.bind(None)

    def bind(self, target: StatsTarget | None) -> None:
        """Check and pack every per-layer launch once: the SR adds of the own slices into the
        shards (measuring what they add: the micro-step rows) and the local measurements."""
        ctx = self.ctx
        L, micro = ctx.layout.num_layers, target is not None and target[1].micro
        offsets = [ctx.shard_offset(s) for s in ctx.layout.block]
        lanes = [2 * i for i in range(len(ctx.layout.block))]  # phase 0

        def stats(l: int) -> tuple[StatsSink, list[int]] | None:
            return (target[0], target[1].layer_columns(l)) if micro and target is not None else None
        self.acc = [ops.bind_add_sr_multi([(sh, sh, own, off) for sh, own, off in
                                           zip(self.shard_tensors[l], self.own[l % 2], offsets)],
                                          (ctx.counter, l, lanes), stats=stats(l))
                    for l in range(L)] if ctx.layout.block else []
        self.full_buffers.bind(target)

    def events(self) -> list[Any]:
        return self.full_buffers.events()

    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Buffer ``layer % 2`` for layer ``layer``'s gradients (inline, on micro-step 0: the
        layer's shards); always overwrite (``False``), except ``zero_init`` tensors, which are
        zeroed on ``stream`` and added into. ``stream`` waits until the buffer's previous
        exchange is done."""
        full = self.full(layer) if self.ctx.inline else self.full_buffers.hand_out(layer, stream)
        self.ctx.zero_init(full.tensors(), stream)
        return full, False

    def full(self, layer: int) -> Container:
        if self.ctx.inline and self.ctx.first:
            return self.shard_containers[layer]
        return self.full_buffers.containers[layer % 2]

    def notify(self, layer: int, stream: StreamLike) -> None:
        ctx = self.ctx
        if ctx.inline:  # world 1: the gradient is the mean; micro-step 0 wrote the shards
            if not ctx.first and self.acc:
                self.acc[layer](stream_handle(stream))
            return
        ctx.join(stream)
        self.full_buffers.measure(layer)
        self.exchange(layer)
        self.full_buffers.release(layer)

    def exchange(self, layer: int) -> None:
        """Queue layer ``layer``'s exchange and accumulation on the communication stream."""
        if self.ctx.world > 1:  # the mean over one rank is the gradient itself
            self.ctx.reduce_scatter_all(self.buffers[layer % 2])
        self.add_own(layer)

    def add_own(self, layer: int) -> None:
        """Shard += own slice (phase-0 noise); a copy on micro-step 0 (by the GPU's cores: no copy
        engine queue shared with other ranks' graphs, see ops.copy_on_cores)."""
        if self.ctx.first:
            for shard, own in zip(self.shard_tensors[layer], self.own[layer % 2]):
                ops.copy_on_cores(shard, own, self.ctx.comm_handle)
        elif self.acc:
            self.acc[layer](self.ctx.comm_handle)

    def block_shard(self, layer: int) -> Container:
        """This rank's accumulated shard of layer ``layer`` (device or pinned memory)."""
        return self.shard_containers[layer]

    def shards(self) -> list[Tensor]:
        return [t for ts in self.shard_tensors for t in ts]

    def owned(self) -> list[Tensor]:
        return self.full_buffers.owned() + [t for ts in self.shard_tensors for t in ts]
