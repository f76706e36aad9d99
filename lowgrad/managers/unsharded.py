"""Unsharded (ZeRO-1) manager: full gradients of every layer on every rank; the engine
accumulates into them; on the last micro-step each tensor is reduce-scattered (average) in place
and the shards are views of the full buffers."""
from __future__ import annotations

from collections.abc import Callable

from lowgrad import ops
from lowgrad.core.streams import StreamLike
from lowgrad.core.tensor import Container, Tensor, shard_view
from lowgrad.managers.manager import GradientManager


class UnshardedManager(GradientManager):
    strategy = "unsharded"
    _default_rounding = None

    def _alloc_blocks(self) -> None:
        if self.offload:
            raise ValueError("offload applies to the sharded strategies; the unsharded manager keeps full "
                             "gradients on the device")
        lazy = self.device.lazy_allocator("device")
        self._tensors = [[lazy.alloc(s.shape, self.dtype, "block_grad") for s in self.layout.block]
                      for _ in range(self.layout.num_layers)]
        lazy.commit()
        self._containers = [self._container(ts) for ts in self._tensors]
        self._local: list[Callable[[int], None]] = []

    def _bind(self) -> None:
        target = self._stats_target()
        if target is None or target[1].local != "step":
            return
        sink, rows = target
        # each rank's gradient accumulated over the step, measured before the reduce-scatter
        self._local = [ops.bind_grad_stats(self._tensors[l], sink, rows.layer_columns(l), rows.local_row)
                       for l in range(self.layout.num_layers)] if self.layout.block else []
        if self._nb_list:
            self._nb_local = ops.bind_grad_stats(self._nb_list, sink, rows.non_block_columns(), rows.local_row)

    def _stats_kinds(self) -> tuple[bool, str | None]:
        return False, "step"

    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Layer ``layer``'s full gradients and whether to add into them (False on micro-step 0).
        ``zero_init`` tensors are zeroed on ``stream`` on micro-step 0 and always added into."""
        self._check_fetch(layer, stream)
        if self._protocol.micro == 0:
            self._wait(self._comm_done, stream)  # the previous step's reduce-scatters have finished
            self._zero_init(self._tensors[layer], stream)
        return self._full(layer), self._protocol.micro > 0

    def _full(self, layer: int) -> Container:
        return self._containers[layer]

    def _exchange_block(self, layer: int, stream: StreamLike) -> None:
        if self.last_micro_step and self.world > 1:  # world 1: the mean is the gradient
            self._join(stream)
            if self._local:
                self._local[layer](self._comm_handle)
            self._reduce_scatter_all(self._tensors[layer])

    def block_shard(self, layer: int, stream: StreamLike) -> Container:
        """This rank's shards of layer ``layer`` (views of the full gradients), ready on ``stream``.
        Valid between steps, after a completed step (ProtocolError otherwise)."""
        self._check_readable(f"block_shard({layer})", stream)
        self._protocol.check_layer(layer)
        self._wait(self._comm_done, stream)
        return self._container([shard_view(t, self.rank, self.world) for t in self._tensors[layer]])

    def _block_shards(self) -> list[Tensor]:
        return [shard_view(t, self.rank, self.world) for ts in self._tensors for t in ts]

    def _owned(self) -> list[Tensor]:
        return [t for ts in self._tensors for t in ts]
