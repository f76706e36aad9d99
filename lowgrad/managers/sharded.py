"""Sharded-blocks manager (ZeRO-2 for the blocks): two full-size block buffers used alternately
(layer ``l`` uses buffer ``l % 2``) and one shard per layer that accumulates with stochastic
rounding; optionally the shards live in pinned host memory (offload) and the SR kernels work on
them over PCIe.

Exchange strategies, on the manager's communication stream after the engine's ``notify_block``:

- ``scatter_reduce``: NCCL reduce-scatter (average) of each tensor in place, then the own slice
  is added into the shard (a copy on micro-step 0; ``add_sr`` with phase-0 noise after).
- ``all_to_all``: the own slice is added into the shard first (phase 0), then the destructive
  all-to-all brings every peer's slice for this rank into the other slots of the buffer, and
  ``reduce_sr`` folds them into the shard (phase 1), dividing by ``world`` on the last
  micro-step.

The buffer of layer ``l`` is handed out again (to layer ``l - 2``) only after that exchange and
accumulation finished: the engine's stream waits on an event, never the host.

At world 1 with device shards there is nothing to exchange, and the manager works *inline*
(unless created with ``inline=False``): on micro-step 0 the engine writes straight into the
shards (no copy), after it the SR accumulation runs on the engine's stream at ``notify_block``.
Inline is the default because beside a transformer's backward the accumulation on a second
stream slows the step by several times its own kernel time (it competes with compute-bound
kernels for the SMs), while inline it costs its kernel time; beside an engine of memory-bound
copies the second stream is the faster one, by the kernel tails it overlaps (the measurements
are in BENCHMARKS.md). With offload the accumulation crosses PCIe and stays on the
communication stream.
"""
from __future__ import annotations

from typing import Any

from lowgrad import ops
from lowgrad.core.kernels import StatsSink
from lowgrad.core.streams import StreamLike, stream_handle
from lowgrad.core.tensor import Container, Tensor, shard_view
from lowgrad.managers.manager import GradientManager


class ShardedManager(GradientManager):
    strategy = "scatter_reduce"

    def _alloc_blocks(self) -> None:
        L = self.layout.num_layers
        lazy = self.device.lazy_allocator("device")
        self._buffers = [[lazy.alloc(s.shape, self.dtype, "block_grad") for s in self.layout.block]
                         for _ in range(min(2, L))]
        lazy.commit()
        self._containers = [self._container(buf) for buf in self._buffers]
        shard_lazy = self.device.lazy_allocator("pinned" if self.offload else "device")
        self._shards = [[shard_lazy.alloc(s.shard_shape(self.world), self.dtype, "block_grad_shards")
                         for s in self.layout.block] for _ in range(L)]
        shard_lazy.commit()
        self._free = [self.device.event(name=f"buffer{i}_free") for i in range(len(self._buffers))]
        self._shard_containers = [self._container(ts) for ts in self._shards]
        self._bind()

    def _bind(self) -> None:
        """Check and pack every per-layer launch once: own slices, SR adds (and reductions)."""
        self._offsets = offsets = [self._shard_offset(s) for s in self.layout.block]
        self._own = [[shard_view(t, self.rank, self.world) for t in buf] for buf in self._buffers]
        lanes = [2 * i for i in range(len(self.layout.block))]  # phase 0
        target = self._stats_target()
        micro = target is not None and target[1].micro
        local = target is not None and target[1].local == "micro"

        def stats(l: int) -> tuple[StatsSink, list[int]] | None:
            return (target[0], target[1].layer_columns(l)) if micro and target is not None else None
        self._acc = [ops.bind_add_sr_multi([(sh, sh, own, off) for sh, own, off in
                                            zip(self._shards[l], self._own[l % 2], offsets)], (self._counter, l, lanes),
                                           stats=stats(l))
                     for l in range(self.layout.num_layers)] if self.layout.block else []
        # each rank's own gradient, measured before the exchange changes it (world > 1)
        self._local = [ops.bind_grad_stats(self._buffers[l % 2], target[0], target[1].layer_columns(l),
                                           target[1].local_row, per_micro=True)
                       for l in range(self.layout.num_layers)] if local and target is not None else []

    def _stats_kinds(self) -> tuple[bool, str | None]:
        # all_to_all at world > 1 never holds the reduced gradient of a micro-step
        return self.world == 1 or self.strategy == "scatter_reduce", "micro"

    def _events(self) -> list[Any]:
        return [*super()._events(), *self._free]

    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Buffer ``layer % 2`` for layer ``layer``'s gradients (inline, on micro-step 0: the
        layer's shards); always overwrite (``False``), except ``zero_init`` tensors, which are
        zeroed on ``stream`` and added into. ``stream`` waits until the buffer's previous
        exchange is done."""
        self._check_fetch(layer, stream)
        if not self._inline:
            self._wait(self._free[layer % 2], stream)
        full = self._full(layer)
        self._zero_init(full.tensors(), stream)
        return full, False

    def _full(self, layer: int) -> Container:
        if self._inline and self._protocol.micro == 0:
            return self._shard_containers[layer]
        return self._containers[layer % 2]

    def _exchange_block(self, layer: int, stream: StreamLike) -> None:
        if self._inline:  # world 1: the gradient is the mean; micro-step 0 wrote the shards
            if self._protocol.micro > 0 and self._acc:
                self._acc[layer](stream_handle(stream))
            return
        self._join(stream)
        self._exchange(layer)
        self._record(self._free[layer % 2], self.comm_stream)

    def _exchange(self, layer: int) -> None:
        """The strategy: queue layer ``layer``'s exchange and accumulation on the communication stream."""
        if self._local:
            self._local[layer](self._comm_handle)
        if self.world > 1:  # the mean over one rank is the gradient itself
            self._reduce_scatter_all(self._buffers[layer % 2])
        self._add_own(layer, self._protocol.micro == 0)

    def _add_own(self, layer: int, first: bool) -> None:
        """Shard += own slice (phase-0 noise); a copy on micro-step 0 (by the GPU's cores: no copy
        engine queue shared with other ranks' graphs, see ops.copy_on_cores)."""
        if first:
            for shard, own in zip(self._shards[layer], self._own[layer % 2]):
                ops.copy_on_cores(shard, own, self._comm_handle)
        elif self._acc:
            self._acc[layer](self._comm_handle)

    def block_shard(self, layer: int, stream: StreamLike) -> Container:
        """This rank's accumulated shard of layer ``layer`` (device or pinned memory), ready on
        ``stream``. Valid between steps, after a completed step (ProtocolError otherwise)."""
        self._check_readable(f"block_shard({layer})", stream)
        self._protocol.check_layer(layer)
        self._wait(self._comm_done, stream)
        return self._shard_containers[layer]

    def _block_shards(self) -> list[Tensor]:
        return [t for ts in self._shards for t in ts]

    def _owned(self) -> list[Tensor]:
        return [t for ts in (*self._buffers, *self._shards) for t in ts]


class AllToAllManager(ShardedManager):
    strategy = "all_to_all"

    def _bind(self) -> None:
        super()._bind()
        W, skip, offsets = self.world, (self.rank + self.world - 1) % self.world, self._offsets
        self._red = [[[ops.bind_reduce_sr(sh, full, W, skip, scale, True, off, (self._counter, l, 2 * i + 1))
                       for scale in (1.0, 1.0 / W)]
                      for i, (sh, full, off) in enumerate(zip(self._shards[l], self._buffers[l % 2], offsets))]
                     for l in range(self.layout.num_layers)] if W > 1 else []

    def _exchange(self, layer: int) -> None:
        if self._local:
            self._local[layer](self._comm_handle)
        self._add_own(layer, self._protocol.micro == 0)  # consumes the own slot before the exchange
        if self.world > 1:  # world 1: no peers, the own slice is the whole mean
            h, last = self._comm_handle, int(self.last_micro_step)
            self.comm.all_to_all_many(self._buffers[layer % 2], stream=self.comm_stream)  # in W-1 steps
            for red in self._red[layer]:
                red[last](h)
