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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
        columns, e.g. a module's parameter names). Batch sizes are relative: one micro-batch of
        one rank is 1."""
        W, C, M = host.shape[0], self.capacity, micro_steps

        def stats(rows: np.ndarray) -> Stats:
            return Stats(rows[..., 0].copy(), np.where(np.isnan(rows[..., 1]), -1, rows[..., 1]).astype(np.int64),
                         rows[..., 2].copy())
        local = None
        if W > 1 and self.local == "micro":
            local = stats(host[:, C:C + M])
        elif W > 1 and self.local == "step":
            local = stats(host[:, C:C + 1])
        return StepStats(names=self.names if names is None else names, layers=self.layers,
                         accumulated=stats(host[:, 2 * C]),
                         micro=stats(host[:, :M]) if self.micro else None, local=local,
                         micro_batch=W, local_batch=M if self.local == "step" else 1, step_batch=M * W,
                         step=step, rank=rank, world=W, micro_steps=M)
