"""What the strategies that exchange every micro-step share: two full-size block buffers used
alternately (layer ``l`` uses buffer ``l % 2``), each handed out again only after the exchange of
the layer that used it before (the engine's stream waits on an event, never the host), and the
measurement of each rank's own gradient in them before the exchange (the local statistics rows)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowgrad import ops
from lowgrad.buffers.streams import StreamLike
from lowgrad.buffers.tensor import Container, Tensor
from lowgrad.managers.strategy import StatsTarget, StrategyContext


class AlternatingBuffers:
    """``buffers[i]``: the layer's tensors of buffer ``i`` (``min(2, L)`` of them, named
    ``block_grad``); ``free[i]``: recorded on the communication stream once buffer ``i``'s
    exchange is done."""

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx
        lazy = ctx.device.lazy_allocator("device")
        self.buffers = [[lazy.alloc(s.shape, ctx.dtype, "block_grad") for s in ctx.layout.block]
                        for _ in range(min(2, ctx.layout.num_layers))]
        lazy.commit()
        self.containers = [ctx.container(buf) for buf in self.buffers]
        self.free = [ctx.device.event(name=f"buffer{i}_free") for i in range(len(self.buffers))]
        self.local: list[Callable[[int], None]] = []

    def of(self, layer: int) -> list[Tensor]:
        return self.buffers[layer % 2]

    def hand_out(self, layer: int, stream: StreamLike) -> Container:
        """Buffer ``layer % 2`` for ``stream``, once its previous exchange is done."""
        self.ctx.wait(self.free[layer % 2], stream)
        return self.containers[layer % 2]

    def bind(self, target: StatsTarget | None) -> None:
        """Each rank's own gradient, measured before the exchange changes it (world > 1)."""
        if target is None or target[1].local != "micro":
            self.local = []
            return
        sink, rows = target
        self.local = [ops.bind_grad_stats(self.of(l), sink, rows.layer_columns(l), rows.local_row, per_micro=True)
                      for l in range(self.ctx.layout.num_layers)]

    def measure(self, layer: int) -> None:
        """Queue the local measurement of ``layer`` on the communication stream (where bound)."""
        if self.local:
            self.local[layer](self.ctx.comm_handle)

    def release(self, layer: int) -> None:
        """``layer``'s exchange is queued: its buffer is free once the communication stream gets here."""
        self.ctx.record(self.free[layer % 2], self.ctx.comm_stream)

    def events(self) -> list[Any]:
        return list(self.free)

    def owned(self) -> list[Tensor]:
        return [t for buf in self.buffers for t in buf]
