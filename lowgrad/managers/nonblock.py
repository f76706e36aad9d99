"""The non-block half of every gradient manager: embeddings, norms and other parameters outside
the repeated layers. Their gradients are full on every rank and accumulated by the engine; at
the last micro-step every rank reduce-scatters all of them in layout order (the same
collectives on every rank), and one a rank did not produce in the step contributes zeros."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any

from lowgrad import ops
from lowgrad.core.dtypes import DType
from lowgrad.core.streams import StreamLike
from lowgrad.core.tensor import Tensor, shard_view
from lowgrad.managers.layout import Layout
from lowgrad.managers.replay import Replayable


class NonBlockGradients(Replayable):
    """The non-block gradients of :class:`lowgrad.managers.base.GradientManager` (which supplies
    the checks, the join of the engine's stream and the grouped reduce-scatter)."""

    device: Any
    layout: Layout
    dtype: DType
    rank: int
    world: int
    _nb_done: Any  # recorded on the communication stream after the non-block reduce-scatter

    @abstractmethod
    def _check_in_micro(self, what: str, stream: StreamLike) -> None: ...

    @abstractmethod
    def _check_readable(self, what: str, stream: StreamLike = None) -> None: ...

    @abstractmethod
    def _join(self, stream: StreamLike) -> None: ...

    @abstractmethod
    def reduce_scatter_all(self, tensors: list[Tensor]) -> None: ...

    def _alloc_non_block(self) -> None:
        """One device block for every non-block gradient (layout order)."""
        lazy = self.device.lazy_allocator("device")
        self._nb_full = {s.name: lazy.alloc(s.shape, self.dtype, "non_block_grad") for s in self.layout.non_block}
        self._nb_list = list(self._nb_full.values())  # layout order: the order every rank reduces them in
        self._nb_spec = {s.name: s for s in self.layout.non_block}
        if self._nb_full:
            lazy.commit()

    def non_block_full(self, name: str, stream: StreamLike) -> tuple[Tensor, bool]:
        """The full gradient of non-block parameter ``name`` and whether to add into it.

        ``zero_init`` parameters are zeroed on ``stream`` at their first fetch of a step and are
        always added into. Fetching again within a step returns ``accumulate=True``.
        """
        self._check_in_micro(f"non_block_full({name!r})", stream)
        t = self._nb(name)
        rec = self._recording
        first = self._protocol.fetch_non_block(name, rec is not None and rec.template.assume_touched)
        if first:
            self._wait(self._nb_done, stream)  # the previous step's reduce-scatter is done with it
        if first and self._nb_spec[name].zero_init:
            ops.fill_zero(t, stream)
        return t, (not first) or self._nb_spec[name].zero_init

    def notify_non_block(self, name: str, stream: StreamLike) -> None:
        """The engine finished writing non-block gradient ``name`` on ``stream``."""
        self._check_in_micro(f"notify_non_block({name!r})", stream)
        self._nb(name)
        self._protocol.notify_non_block(name)

    def _finish_non_block(self, stream: StreamLike) -> None:
        """Reduce-scatter every non-block gradient in layout order, whichever this rank produced:
        every rank issues the same collectives. One this rank never fetched in the step (so
        nothing was written into it since the previous step's reduce-scatter) is zeroed first and
        contributes zeros to the mean."""
        self._join(stream)
        for name, t in self._nb_full.items():
            if name not in self._protocol.nb_touched:
                ops.fill_zero(t, self.comm_stream)
        if self.world > 1:  # world 1: the mean is the gradient
            self.reduce_scatter_all(self._nb_list)
        self._record(self._nb_done, self.comm_stream)

    def non_block_shard(self, name: str, stream: StreamLike) -> Tensor:
        """This rank's shard of non-block gradient ``name`` (dim 0 split by world), ready on
        ``stream`` (which waits for the reduce-scatter). Valid between steps, after a completed
        step (ProtocolError otherwise); zeros where no rank produced it in the step."""
        self._check_readable(f"non_block_shard({name!r})", stream)
        t = self._nb(name)
        self._wait(self._nb_done, stream)
        return shard_view(t, self.rank, self.world)

    def _nb(self, name: str) -> Tensor:
        try:
            return self._nb_full[name]
        except KeyError:
            raise KeyError(f"no non-block parameter {name!r}; layout has {list(self._nb_full)}") from None
