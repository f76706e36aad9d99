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

:class:`Statistics` is the manager's collaborator that keeps all of it: it allocates the rows
(again when a step has more micro-steps), binds the measuring launches (the strategy's through
its ``bind``), fills, finishes, gathers and copies them; the manager checks each call first.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from lowgrad import ops
from lowgrad.base.dtypes import fp64
from lowgrad.base.errors import ClosedError, ProtocolError
from lowgrad.buffers import capture
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.kernels import StatsSink
from lowgrad.diagnostics.report import Stats, StepStats, check_names
from lowgrad.managers.layout import Layout
from lowgrad.managers.protocol import HostState

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


@dataclass(eq=False, kw_only=True)
class StatisticsContext:
    """What a manager lends its :class:`Statistics`: the rank's communicator (and device), the
    layout, the seed counter (the sink's micro-step), the strategy (``stats_kinds`` and ``bind``),
    every shard (``shards()``: block then non-block) and the full non-block gradients, the
    manager's ``wait(event, stream)``, its end-of-micro-step event and its host state."""

    comm: Any
    layout: Layout
    counter: Any
    strategy: Any
    shards: Callable[[], list[Tensor]]
    non_block: list[Tensor]
    wait: Callable[[Any, StreamLike], None]
    comm_done: Any
    state: HostState


class Statistics:
    """A manager's gradient statistics (``stats=True``): the rows (``out``), their gather at
    world > 1, the sinks the launches measure into, the non-block local pass (``nb_local``, where
    the strategy measures the step's local gradient) and the pinned copy ``host``. Allocated at
    the first micro-step 0 for its step's micro-step count, and again when a step has more."""

    def __init__(self, ctx: StatisticsContext) -> None:
        self.ctx = ctx
        self.out: Tensor | None = None
        self.gathered: Tensor | None = None
        self.rows: StatsRows | None = None
        self.sink: StatsSink | None = None  # where the micro-steps' launches put theirs
        self.finish: Callable[[int], None] | None = None  # writes their rows, once per step (stats())
        self.step_pass: Callable[[int], None] | None = None  # the accumulated gradient's row (stats())
        self.step_sink: StatsSink | None = None
        self.nb_local: Callable[[int], None] | None = None  # the non-block local pass, where measured
        self.host: HostRows | None = None  # read_stats' pinned copy of the gathered rows

    def needs_rows(self, total: int) -> bool:
        """A step of ``total`` micro-steps needs (more) rows."""
        return self.rows is None or total > self.rows.capacity

    def alloc(self, capacity: int) -> None:
        """Rows for steps of up to ``capacity`` micro-steps, and every launch that writes them
        bound again; on a failure (out of memory) everything stays as it was."""
        ctx = self.ctx
        device, world, layout = ctx.comm.device, ctx.comm.world, ctx.layout
        micro, local = ctx.strategy.stats_kinds()
        rows = StatsRows.of(layout, capacity, micro, local if world > 1 else None)
        shape = (rows.rows, rows.columns, len(FIELDS))
        out = device.alloc(shape, fp64, name="grad_stats")
        gathered = device.alloc((world, *shape), fp64, name="grad_stats_gathered") if world > 1 else None
        host = HostRows(device.alloc((world, *shape), fp64, kind="pinned", name="grad_stats_host"),
                        device.event(name="grad_stats_copied"))
        columns = [c for l in range(layout.num_layers) for c in rows.layer_columns(l)] + rows.non_block_columns()
        step_sink = ops.stats_sink(out)
        measure = ops.bind_grad_stats(ctx.shards(), step_sink, columns, rows.step_row)
        write = ops.bind_stats_finish(step_sink)

        def step_pass(h: int) -> None:
            measure(h)
            write(h)
        # the old rows are dropped, not closed: a graph captured before holds them (its replays are
        # refused from now on: Capture.replay_check), and an unresolved reading its host buffer
        before, strategy_before = self.__dict__.copy(), ctx.strategy.__dict__.copy()
        self.out, self.gathered, self.rows = out, gathered, rows
        self.step_pass, self.step_sink, self.host = step_pass, step_sink, host
        try:
            self.sink = ops.stats_sink(out, ctx.counter, rows.capacity)
            ctx.strategy.bind((self.sink, rows))  # the strategy's launches register in the sink
            if rows.local == "step" and ctx.non_block:  # the non-block gradients too, accumulated over the step
                self.nb_local = ops.bind_grad_stats(ctx.non_block, self.sink, rows.non_block_columns(),
                                                    rows.local_row)
            self.finish = ops.bind_stats_finish(self.sink)  # what they measure in a step, into rows (stats())
        except BaseException:  # e.g. out of memory for the slots: the manager keeps what it had
            # every attribute as before: the rows, the sink whose slots hold the completed step's
            # measurements (stats() still finishes them), and each launch bound to it (a graph
            # captured before still writes where that finish reads)
            self.__dict__.update(before)
            ctx.strategy.__dict__.update(strategy_before)
            raise

    def start_step(self, stream: StreamLike, total: int) -> None:
        """Micro-step 0 of a step of ``total``: every value NaN (not measured yet), on ``stream``."""
        if self.out is not None:
            self.ctx.state.stats_m = total
            self.after_host_copy(stream)
            ops.fill_nan(self.out, stream)

    def gather(self, stream: StreamLike) -> Tensor:
        """Queue the accumulated gradient's row and the gather on ``stream``: the rows of every rank."""
        out, ctx = self.out, self.ctx
        assert out is not None, "a completed step allocated the statistics"
        ctx.wait(ctx.comm_done, stream)
        self.after_host_copy(stream)
        h = stream_handle(stream)
        if self.finish is not None:  # the micro-step rows, from what the step's launches measured
            self.finish(h)
        if self.step_pass is not None:
            self.step_pass(h)
        if self.gathered is None:
            return out.reshape(1, *out.shape)
        ctx.comm.all_gather(out, out=self.gathered, stream=stream)
        return self.gathered.reshape(ctx.comm.world, *out.shape)

    def read(self, stream: StreamLike, names: tuple[str, ...] | None) -> StatsReading:
        """:meth:`gather`, then the rows' copy into the pinned buffer; ``names`` checked first."""
        rows, host = self.rows, self.host
        assert rows is not None and host is not None, "a completed step allocated the statistics"
        if names is not None:
            names = check_names("read_stats: names", names, rows.columns)
        capture.forbid("read_stats (a copy to the host)")
        ops.copy(host.tensor, self.gather(stream), stream)
        host.event.record(stream)
        state = self.ctx.state
        return StatsReading(host, partial(rows.step_stats, micro_steps=state.stats_m, step=state.step - 1,
                                          rank=self.ctx.comm.rank, names=names))

    def after_host_copy(self, stream: StreamLike) -> None:
        """``stream``'s next writes of the rows wait until the last read_stats copied them out (it
        may have run on another stream). The first write of a step is start_micro_step(0)'s fill:
        the step's later ones follow it, on its stream or on the communication stream joined to
        it (a replay waits in :meth:`Capture.replay_before <lowgrad.managers.replay.Capture.replay_before>`)."""
        if self.host is not None:
            self.ctx.wait(self.host.event, stream)

    def copied(self) -> Any:
        """The event of the rows' last copy to the host (None: no rows yet)."""
        return None if self.host is None else self.host.event

    def close(self) -> None:
        for t in (self.out, self.gathered, None if self.host is None else self.host.tensor):
            if t is not None:
                t.close()
        for sink in (self.sink, self.step_sink):  # what the bound launches allocated for their statistics
            if sink is not None:
                for t in sink.owned:
                    t.close()
