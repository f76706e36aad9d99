"""A manager's gradient statistics (``create_gradient_manager(..., stats=True)``): where each
measured value lives in device memory, and its host form (:class:`lowgrad.diagnostics.StepStats`).

The device tensor that :meth:`~lowgrad.managers.manager.GradientManager.stats` returns is float64
of shape ``(W, R, T, 3)``: for each rank ``R`` rows of ``T`` columns of ``(sum of squares,
non-finite count, largest finite |x|)`` (docs/diagnostics.md).

- Columns: the non-block tensors in layout order, then layer 0's block tensors, layer 1's, ...
- Rows, with ``C`` the capacity (the most micro-steps a step has had): row ``m < C`` is the
  gradient the manager consumed at micro-step ``m`` (this rank's shard of the reduced gradient:
  the sharded strategies, measured inside the accumulation kernel); row ``C + m`` this rank's own
  full gradient of micro-step ``m`` before the exchange (world > 1; the unsharded strategy: row
  ``C`` only, its gradient accumulated over the step, and its non-block gradients there too);
  row ``2C`` this rank's shard of the accumulated gradient at the end of the step (every
  column; measured by ``stats()``).
- A value that was not measured is NaN in all three fields: the non-block columns of the
  micro-step rows and of the sharded strategies' local rows (the engine accumulates those
  gradients itself), the micro-step rows of the unsharded strategy and of ``all_to_all`` at
  world > 1 (no kernel sees the reduced gradient there), the rows of micro-steps a step did not
  have, and every local row at world 1.

:meth:`~lowgrad.managers.manager.GradientManager.read_stats` copies the gathered rows into a
pinned host buffer the manager owns (:class:`HostRows`) and returns a :class:`StatsReading`, which
builds the :class:`StepStats` when asked, once the copy is done: no host sync of its own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lowgrad.core.errors import ClosedError, ProtocolError
from lowgrad.core.tensor import Tensor
from lowgrad.diagnostics.report import Stats, StepStats
from lowgrad.managers.layout import Layout

#: the three values of each (row, column): their order in the last axis
FIELDS = ("sumsq", "nonfinite", "maxabs")


@dataclass(frozen=True)
class StatsRows:
    """Where a manager's statistics live: ``capacity`` micro-steps a group (``C`` above);
    ``micro``: the micro-step rows are measured; ``local``: the local rows are, per micro-step
    (``"micro"``), once for the step (``"step"``, the unsharded strategy) or not at all (None)."""

    names: tuple[str, ...]
    layers: tuple[int, ...]
    non_block: int
    per_layer: int
    capacity: int
    micro: bool
    local: str | None

    @classmethod
    def of(cls, layout: Layout, capacity: int, micro: bool, local: str | None) -> StatsRows:
        nb = tuple(s.name for s in layout.non_block)
        names = nb + tuple(f"layers.{l}.{s.name}" for l in range(layout.num_layers) for s in layout.block)
        layers = (-1,) * len(nb) + tuple(l for l in range(layout.num_layers) for _ in layout.block)
        return cls(names, layers, len(nb), len(layout.block), capacity, micro, local)

    @property
    def rows(self) -> int:
        return 2 * self.capacity + 1

    @property
    def columns(self) -> int:
        return len(self.names)

    @property
    def local_row(self) -> int:
        return self.capacity

    @property
    def step_row(self) -> int:
        return 2 * self.capacity

    def layer_columns(self, layer: int) -> list[int]:
        """The columns of layer ``layer``'s block tensors, in layout order."""
        first = self.non_block + layer * self.per_layer
        return list(range(first, first + self.per_layer))

    def non_block_columns(self) -> list[int]:
        return list(range(self.non_block))

    def step_stats(self, host: np.ndarray, micro_steps: int, step: int, rank: int,
                   names: tuple[str, ...] | None = None) -> StepStats:
        """The :class:`StepStats` of the gathered ``(W, R, T, 3)`` values ``host`` for a step of
        ``micro_steps`` micro-steps (``step``: the step's number; ``names``: other names for the
        columns, e.g. a module's parameter names, checked by the caller). Batch sizes are
        relative: one micro-batch of one rank is 1. The arrays are copies (``host`` may be
        reused), and fit by construction: built without StepStats' checks."""
        W, C, M = host.shape[0], self.capacity, micro_steps
        sumsq, maxabs = host[..., 0].copy(), host[..., 2].copy()
        counts = host[..., 1]
        nonfinite = np.where(np.isnan(counts), -1, counts).astype(np.int64)

        def stats(rows: slice | int) -> Stats:
            return Stats._trusted(sumsq[:, rows], nonfinite[:, rows], maxabs[:, rows])
        local = None
        if W > 1 and self.local == "micro":
            local = stats(slice(C, C + M))
        elif W > 1 and self.local == "step":
            local = stats(slice(C, C + 1))
        return StepStats._trusted(names=self.names if names is None else tuple(names), layers=self.layers,
                                  accumulated=stats(2 * C), micro=stats(slice(0, M)) if self.micro else None,
                                  local=local, micro_batch=W, local_batch=M if self.local == "step" else 1,
                                  step_batch=M * W, step=step, rank=rank, world=W, micro_steps=M)


class HostRows:
    """The pinned host buffer ``tensor`` that :meth:`read_stats` copies the gathered rows into,
    the ``event`` recorded after each copy, and the :class:`StatsReading` whose rows it holds now
    (``reading``). One buffer per manager: a reading is resolved within its step (before the
    next ``read_stats``, which comes a whole step later), and its :class:`StepStats` is then the
    host's own copy; a second buffer would only serve readings left unresolved across a whole
    step, for twice the pinned memory and an alternation to get wrong."""

    __slots__ = ("tensor", "event", "reading")

    def __init__(self, tensor: Tensor, event: Any) -> None:
        self.tensor, self.event = tensor, event
        self.reading: StatsReading | None = None


class StatsReading:
    """One step's statistics on their way to the host (:meth:`GradientManager.read_stats`):
    :meth:`ready` says whether the copy has finished, :meth:`result` builds the
    :class:`StepStats` (waiting for the copy if it has not). Resolve it before the manager's next
    ``read_stats``, which reuses the host buffer: after that, an unresolved reading raises
    ProtocolError, and after the manager's ``close()`` ClosedError; a resolved one keeps its
    :class:`StepStats`."""

    __slots__ = ("_host", "_build", "_result")

    def __init__(self, host: HostRows, build: Callable[[np.ndarray], StepStats]) -> None:
        self._host: HostRows | None = host
        self._build = build
        self._result: StepStats | None = None
        host.reading = self

    def ready(self) -> bool:
        """Whether :meth:`result` would return without waiting (never blocks)."""
        if self._result is not None:
            return True
        return self._rows("ready").event.query()

    def result(self) -> StepStats:
        """The step's :class:`StepStats`: waits for the copy if it has not finished, then builds
        it from the host buffer; later calls return the same object."""
        if self._result is None:
            host = self._rows("result")
            if not host.event.query():
                host.event.synchronize()
            self._result = self._build(host.tensor.numpy())
            self._host = None  # the buffer is the manager's again
        return self._result

    def _rows(self, what: str) -> HostRows:
        host = self._host
        assert host is not None, "an unresolved reading holds its buffer"
        if host.tensor.closed:
            raise ClosedError(f"StatsReading.{what}(): the gradient manager was closed before this reading "
                              "was resolved")
        if host.reading is not self:
            raise ProtocolError(f"StatsReading.{what}(): a later read_stats() reused this reading's host buffer; "
                                "call result() before the next read_stats()")
        return host
