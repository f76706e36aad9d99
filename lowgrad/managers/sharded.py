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
"""
from __future__ import annotations

from .. import ops
from ..stream import StreamLike
from ..tensor import Container, Tensor, shard_view
from .base import GradientManager


class ShardedManager(GradientManager):
    strategy = "scatter_reduce"

    def _alloc_blocks(self) -> None:
        L = self.layout.num_layers
        lazy = self.device.lazy_allocator("device")
        self._buffers = [[lazy.alloc(s.shape, self.dtype, "block_grad") for s in self.layout.block]
                         for _ in range(min(2, L))]
        lazy.commit()
        shard_lazy = self.device.lazy_allocator("pinned" if self.offload else "device")
        self._shards = [[shard_lazy.alloc((s.shape[0] // self.world,) + s.shape[1:], self.dtype,
                                          "block_grad_shards") for s in self.layout.block] for _ in range(L)]
        shard_lazy.commit()
        self._offsets = [self.shard_offset(s) for s in self.layout.block]
        self._free = [self.device.event(name=f"buffer{i}_free") for i in range(len(self._buffers))]
        self._ready = [self.device.event(name=f"layer{l}_shard") for l in range(L)]

    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Buffer ``layer % 2`` for layer ``layer``'s gradients; always overwrite (``False``),
        except ``zero_init`` tensors, which are zeroed on ``stream`` and added into. ``stream``
        waits until the buffer's previous exchange is done."""
        self._check_fetch(layer)
        buf = self._buffers[layer % 2]
        self._free[layer % 2].wait(stream)
        self._zero_init(buf, stream)
        return self._container(buf), False

    def _exchange_block(self, layer: int) -> None:
        buf, shards, s = self._buffers[layer % 2], self._shards[layer], self.comm_stream
        first = self._micro == 0
        for i, (full, shard) in enumerate(zip(buf, shards)):
            self._exchange_tensor(layer, i, full, shard, first, s)
        self._free[layer % 2].record(s)
        self._ready[layer].record(s)

    def _exchange_tensor(self, layer: int, i: int, full: Tensor, shard: Tensor, first: bool, s: StreamLike) -> None:
        if self.world > 1:  # the mean over one rank is the gradient itself
            self.comm.reduce_scatter(full, op="avg", stream=s)
        self._add_own(layer, i, full, shard, first, s)

    def _add_own(self, layer: int, i: int, full: Tensor, shard: Tensor, first: bool, s: StreamLike) -> None:
        own = shard_view(full, self.rank, self.world)
        if first:
            ops.copy(shard, own, stream=s)
        else:
            ops.add_sr(shard, shard, own, 1.0, self.seed(layer, i, 0), self._offsets[i], stream=s)

    def block_shard(self, layer: int, stream: StreamLike) -> Container:
        """This rank's accumulated shard of layer ``layer`` (device or pinned memory), ready on
        ``stream``. Valid between steps."""
        self._check_between_steps(f"block_shard({layer})")
        self._check_layer(layer)
        self._ready[layer].wait(stream)
        return self._container(self._shards[layer])

    def shards(self) -> list[Tensor]:
        nb = [shard_view(t, self.rank, self.world) for t in self._nb_full.values()]
        return [t for ts in self._shards for t in ts] + nb

    def _owned(self) -> list[Tensor]:
        return [t for ts in (*self._buffers, *self._shards) for t in ts]


class AllToAllManager(ShardedManager):
    strategy = "all_to_all"

    def _exchange_tensor(self, layer: int, i: int, full: Tensor, shard: Tensor, first: bool, s: StreamLike) -> None:
        self._add_own(layer, i, full, shard, first, s)
        if self.world == 1:
            return  # no peers: the own slice is the whole mean
        self.comm.all_to_all(full, stream=s)
        scale = 1.0 / self.world if self.last_micro_step else 1.0
        ops.reduce_sr(shard, full, self.world, (self.rank + self.world - 1) % self.world, scale, True,
                      self.seed(layer, i, 1), self._offsets[i], stream=s)
