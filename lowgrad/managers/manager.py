"""The gradient manager: one class that holds the micro-step protocol (its state machine:
:mod:`lowgrad.managers.protocol`), the non-block gradients, per-use seeds, the streams and events
between the engine and the manager, the global norm, the saved state
(:mod:`lowgrad.managers.state`) and CUDA-graph capture and replay (the template's data:
:mod:`lowgrad.managers.replay`). A strategy (:mod:`lowgrad.managers.strategy`, one file each in
:mod:`lowgrad.managers.strategies`) is its collaborator for the block half: the manager checks
each call, then hands the strategy the work through its interface, and lends it a narrow
:class:`~lowgrad.managers.strategy.StrategyContext` (communicator, streams, seed counter, events,
micro-step position) and nothing else.

Protocol (``docs/protocol.md``), per micro-batch::

    gm.start_micro_step(stream, micro_step, total_micro_steps)
    t, accumulate = gm.non_block_full(name, stream); ...; gm.notify_non_block(name, stream)
    for layer in reversed(range(L)):
        dw, accumulate = gm.block_full(layer, stream); <engine writes dw>; gm.notify_block(layer, stream)
    gm.end_micro_step(stream)

then the optimizer reads ``gm.block_shard(layer, stream)`` / ``gm.non_block_shard(name, stream)``
(and ``gm.grad_norm_squared``) until the next ``start_micro_step``: only after a completed step,
``ProtocolError`` on a new manager, after ``load_state_dict`` and during a step. The non-block
gradients (embeddings, norms: parameters outside the repeated layers) are full on every rank and
accumulated by the engine; at the last micro-step every rank reduce-scatters all of them in
layout order (the same collectives on every rank), and one a rank did not fetch in the step
contributes zeros. Calls queue work on ``stream`` (the engine's) or on the manager's own
communication stream, ordered by events; none blocks the host.

Seeds: the SR kernels read the manager's :class:`~lowgrad.sr.seedcounter.SeedCounter` (device
memory) when they run; ``start_micro_step`` and the last ``end_micro_step`` queue its advance on
the communication stream (``start_micro_step``'s on the engine's stream for a manager that works
inline, whose SR kernels run there).

Graphs: micro-steps may be captured in a :class:`lowgrad.Graph`. Inside a capture (the device's
``capture_of(stream)`` is a graph) the manager runs the protocol on a *template* and leaves its
host state as it was: it saves the state and collects the events recorded in the capture. When
the capture ends the state is restored and the template (which kinds of micro-steps were captured)
goes to the graph; each replay checks the template against the manager's next micro-steps,
launches, and advances the state as the eager calls would have. The graph reaches the manager
only through the :class:`GraphHooks` it was handed at the capture (nothing here imports a backend).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lowgrad import ops
from lowgrad.base.dtypes import DType, as_dtype, bf16, fp32
from lowgrad.base.errors import ClosedError, ProtocolError
from lowgrad.base.integers import integer
from lowgrad.base.trace import nvtx_range
from lowgrad.buffers import capture
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Container, Tensor, shard_view
from lowgrad.diagnostics.report import StepStats
from lowgrad.managers.layout import Layout
from lowgrad.managers.protocol import HostState, MicroStepState, check_step, check_step_room
from lowgrad.managers.replay import Capture, CaptureContext
from lowgrad.managers.state import ManagerState
from lowgrad.managers.stats import Statistics, StatisticsContext, StatsReading
from lowgrad.managers.strategies import strategy_class
from lowgrad.managers.strategy import Strategy, StrategyContext
from lowgrad.sr.seedcounter import SeedCounter, check_rounding

GRAD_DTYPES = (bf16, fp32)


class GradientManager:
    """One rank's gradients, driven by the engine through the micro-step protocol; the arguments
    are :func:`lowgrad.create_gradient_manager`'s. Its strategy (``strategy``: the name) does the
    block half, through the interface of :class:`~lowgrad.managers.strategy.Strategy`."""

    def __init__(self, layout: Layout, comm: Any, strategy: str = "unsharded", offload: bool = False,
                 dtype: DType | str = bf16, seed: int = 0, step: int = 0, rounding: str | None = None,
                 inline: bool | None = None, stats: bool = False, **options: Any) -> None:
        cls = strategy_class(strategy)
        self.strategy = cls.name
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a lowgrad.Layout, got {type(layout).__name__}")
        self.dtype = as_dtype(dtype)
        if self.dtype not in GRAD_DTYPES:
            raise TypeError(f"gradient dtype must be bf16 or fp32, got {self.dtype.name}")
        for spec in (*layout.block, *layout.non_block):
            if spec.dtype is not None and as_dtype(spec.dtype) is not self.dtype:
                raise TypeError(f"parameter {spec.name!r} has dtype {as_dtype(spec.dtype).name}, "
                                f"but the manager's gradient dtype is {self.dtype.name}")
        ops.check_seed(seed)
        step = check_step("step", step)
        if not isinstance(offload, bool):
            raise TypeError(f"offload must be a bool, got {type(offload).__name__} {offload!r}")
        if not isinstance(stats, bool):
            raise TypeError(f"stats must be a bool, got {type(stats).__name__} {stats!r}")
        if rounding is not None and not cls.rounds():
            raise ValueError(f"rounding={rounding!r}: the {self.strategy} manager rounds nothing itself (the engine "
                             "adds into the full gradients); choose a strategy that rounds to pick a rounding")
        self.rounding = cls.default_rounding if rounding is None else check_rounding(rounding)
        self.layout, self.comm, self.offload = layout, comm, offload
        self.rank, self.world, self.device = comm.rank, comm.world, comm.device
        layout.check_world(self.world)
        options = cls.check(comm, offload, **options)
        #: the block accumulation runs on the engine's stream, not the communication stream
        self._inline = self._check_inline(cls, inline)
        self.base_seed = seed
        # the most urgent priority (numerically lowest): exchanges finish early beside backward
        self.comm_stream = self.device.stream(priority=min(self.device.stream_priority_range))
        self._comm_handle = stream_handle(self.comm_stream)
        self._engine_done = self.device.event(name="engine_done")
        self._comm_done = self.device.event(name="comm_done")
        self._nb_done = self.device.event(name="non_block_done")
        self._group_done = self.device.event(name="group_done")
        self._closed = False
        self._state = HostState(MicroStepState(layout.num_layers), step)  # shared with the capture
        self._capture = Capture(self._state, CaptureContext(
            check_open=self._check_open, events=self._events, allocations=self._graph_allocations,
            stats=self._stats_rows, copied=lambda: None if self._statistics is None else self._statistics.copied(),
            comm_stream=self.comm_stream, comm_done=self._comm_done))
        self._graph_hooks = self._capture.hooks  # what a graph calls (through the capture)
        self._counter = SeedCounter(self.device, seed, step, self.comm_stream, self.rounding or "sr")
        self._range_names = [f"lowgrad.exchange layer {l}" for l in range(layout.num_layers)]
        self._alloc_non_block()
        # lent by name; its verbs reach the capture and the protocol's state directly, not back
        # through the manager (a layer's micro-step crosses into the strategy twice, never back)
        self._ctx = StrategyContext(
            layout=layout, comm=comm, dtype=self.dtype, rounding=self.rounding, offload=offload, inline=self._inline,
            comm_stream=self.comm_stream, comm_handle=self._comm_handle, counter=self._counter,
            events=self._capture, host=self._state, group_done=self._group_done, comm_done=self._comm_done,
            engine_done=self._engine_done)
        self._strategy: Strategy = cls(self._ctx, **options)
        try:
            #: the statistics (``stats=True``), allocated at the first micro-step 0 for its step's count
            self._statistics = Statistics(StatisticsContext(
                comm=comm, layout=layout, counter=self._counter, strategy=self._strategy, shards=self.shards,
                non_block=self._nb_list, wait=self._wait, comm_done=self._comm_done, state=self._state)) \
                if stats else None
            self._norm = self.device.alloc(1, fp32, name="grad_norm")
        except BaseException:  # a failed manager is never closed: what the strategy holds (split
            self._strategy.close()  # communicators) goes now
            raise

    def _check_inline(self, cls: type[Strategy], inline: Any) -> bool:
        """``inline`` checked: where the strategy can (a manager that accumulates, world 1, device
        shards) None means True; elsewhere only None and False are accepted."""
        if inline is not None and not isinstance(inline, bool):
            raise TypeError(f"inline must be a bool or None, got {type(inline).__name__} {inline!r}")
        why = cls.inline_refusal(self.world, self.offload)
        if inline and why is not None:
            raise ValueError(f"inline=True needs a sharded strategy at world 1 with device shards: {why}")
        return why is None if inline is None else inline

    # ---- protocol ------------------------------------------------------------------------
    def start_micro_step(self, stream: StreamLike, micro_step: int, total_micro_steps: int) -> None:
        """Begin micro-step ``micro_step`` of ``total_micro_steps`` of the current step; queues the
        seed counter's advance on the communication stream after ``stream``'s work so far (inline
        managers: on ``stream``). Inside a :class:`lowgrad.Graph` capture of ``stream`` it begins a
        template instead (see :mod:`lowgrad.cuda.graph`): any micro-step may be captured, and host
        state is left as it was.

        Non-integer (bool, float) ``micro_step``/``total_micro_steps`` raise TypeError; starting
        a step when ``step`` is the last value of the 32-bit step counter raises OverflowError."""
        self._check_call("start_micro_step", stream)
        micro_step = integer("micro_step", micro_step)
        total_micro_steps = integer("total_micro_steps", total_micro_steps)
        cap = self.device.capture_of(stream)
        if self._capture.joins(cap):
            self._capture.begin(cap, micro_step, total_micro_steps)
        self._protocol.check_start(micro_step, total_micro_steps, self.step)
        if micro_step == 0 and self._capture.recording is None:  # a capture's step number is checked at replay
            check_step_room(f"start_micro_step(0) of step {self.step}", self.step + 1)
        stats = self._statistics if micro_step == 0 else None
        if stats is not None and stats.needs_rows(total_micro_steps):
            capture.forbid(f"start_micro_step(0) of {total_micro_steps} micro-steps with stats=True (its statistics "
                           "need memory for that many: run one such step before capturing)")
            stats.alloc(total_micro_steps)
        self._protocol.start(micro_step, total_micro_steps)
        if stats is not None:
            stats.start_step(stream, total_micro_steps)
        self._join(stream)
        if micro_step > 0:  # on the stream whose SR kernels read it next
            self._counter.next_micro(stream_handle(stream) if self._inline else self._comm_handle)

    def _join(self, stream: StreamLike) -> None:
        """The communication stream waits for ``stream``'s work so far (the context's join: one rule)."""
        self._ctx.join(stream)

    def _events(self) -> list[Any]:
        """The events later calls wait on (re-recorded after a capture and after each replay)."""
        return [self._comm_done, self._nb_done, *self._strategy.events()]

    @property
    def inline(self) -> bool:
        """Whether the block accumulation runs on the engine's stream (see ``inline`` of
        :func:`lowgrad.create_gradient_manager`) rather than on the communication stream."""
        return self._inline

    @property
    def in_micro_step(self) -> bool:
        """Between ``start_micro_step`` and ``end_micro_step`` (outside a graph capture)."""
        return self._protocol.in_micro

    @property
    def fetched_layer(self) -> int | None:
        """The layer fetched with ``block_full`` and not yet notified, if any."""
        return self._protocol.fetched

    @property
    def last_micro_step(self) -> bool:
        """The micro-step in progress (or the last one started) is its step's last."""
        return self._protocol.last

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: gradient manager used after close()")

    def _check_call(self, what: str, stream: StreamLike) -> int:
        """The checks every call taking a ``stream`` starts with, before it changes anything: the
        manager is open and ``stream`` is a stream (the same TypeError/ValueError on every
        backend); its raw handle."""
        self._check_open(what)
        return stream_handle(stream)

    def _check_in_micro(self, what: str, stream: StreamLike) -> None:
        self._check_call(what, stream)
        self._protocol.check_in_micro(what)

    def _check_fetch(self, layer: int, stream: StreamLike) -> None:
        """``block_full(layer)`` may run now (the state machine records the fetch)."""
        self._check_call(f"block_full({layer})", stream)
        self._protocol.fetch(layer)

    def notify_block(self, layer: int, stream: StreamLike) -> None:
        """The engine finished writing layer ``layer``'s gradients on ``stream``: queue the
        exchange and accumulation on the manager's communication stream (after ``stream``'s work
        so far), or, for a manager working :attr:`inline` (nothing to exchange), the accumulation
        on ``stream`` itself."""
        self._check_call(f"notify_block({layer})", stream)
        self._protocol.notify(layer)
        with nvtx_range(self._range_names[layer]):
            self._strategy.notify(layer, stream)

    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Layer ``layer``'s gradient buffers for the engine to write on ``stream`` and whether
        to add into them (``False``: overwrite), as the strategy hands them out; ``zero_init``
        tensors are zeroed on ``stream`` when the strategy hands out a fresh buffer and always
        added into. ``stream`` waits until the buffers are free (never the host)."""
        self._check_fetch(layer, stream)
        return self._strategy.block_full(layer, stream)

    def block_shard(self, layer: int, stream: StreamLike) -> Container:
        """This rank's accumulated shards of layer ``layer`` (device or pinned memory), ready on
        ``stream``. Valid between steps, after a completed step (ProtocolError otherwise)."""
        self._check_readable(f"block_shard({layer})", stream)
        self._protocol.check_layer(layer)
        self._wait(self._comm_done, stream)
        return self._strategy.block_shard(layer)

    def end_micro_step(self, stream: StreamLike) -> None:
        """Close the micro-step; on the last one, reduce-scatter the non-block gradients and
        advance ``step``. ``stream`` waits for all of this micro-step's gradient traffic."""
        self._check_call("end_micro_step", stream)
        self._protocol.check_end()
        last = self.last_micro_step
        if last:
            with nvtx_range("lowgrad.non_block reduce-scatter"):
                self._finish_non_block(stream)
            # after every launch that reads the micro-step: inline ones on the engine's stream,
            # which _finish_non_block joins the communication stream to (it always does)
            self._counter.next_step(self._comm_handle)
        self._record(self._comm_done, self.comm_stream)
        self._wait(self._comm_done, stream)
        self._protocol.end()
        self._capture.micro_step_ended(last)
        if last:
            self.step += 1

    def discard_step(self, stream: StreamLike, total_micro_steps: int | None = None) -> bool:
        """Give up the step in progress after a fault in the engine (an exception in its forward
        or backward, a batch it skips); True, or False where there is nothing to discard.

        The rest of the step's protocol runs from where the engine left it, with NaN written on
        ``stream`` into every gradient buffer handed out (the one fetched and not notified too):
        every collective this rank owes its peers is still issued, in order, so peers that ran
        the step normally are not left waiting. The step ends with every shard of this rank NaN,
        and NaN in the peers' shards wherever the rest of the step still carried it (every
        shard, unless the fault came in the last micro-step); so the global gradient norm
        (:meth:`grad_norm_squared`) is NaN on every rank, and every rank skips the step the same
        way (as :class:`lowgrad.torch.ShardOptimizer` does). ``step`` advances as for any ended
        step: its noise is never reused.

        Between steps no step is in progress: with ``total_micro_steps`` a whole step of that
        many micro-steps is discarded (a fault before micro-step 0 began, at world > 1 where the
        peers run the step); without it nothing changes and the last completed step stays
        readable. Where the rest of the step fails too (an aborted communicator), the manager is
        left between steps with no readable shards, and the error propagates. Not inside a graph
        capture (CaptureError)."""
        self._check_call("discard_step", stream)
        total = None if total_micro_steps is None else integer("total_micro_steps", total_micro_steps)
        capture.forbid("discard_step")
        state = self._protocol
        idle = not state.in_micro and state.micro < 0
        if total is not None:
            if total < 1:
                raise ValueError(f"discard_step: total_micro_steps must be positive, got {total}")
            if not idle and total != state.total:
                raise ProtocolError(f"discard_step(total_micro_steps={total}) during a step of {state.total}")
        if idle and total is None:
            return False
        M = state.total if total is None else total  # not idle: the two are equal (checked above)
        if idle:  # refused (the step counter's last value) with nothing changed
            self.start_micro_step(stream, 0, M)
        try:
            while True:
                if not state.in_micro:
                    self.start_micro_step(stream, state.next_micro, M)
                for name in sorted(state.nb_open):
                    self._poison([self._nb(name)], stream)
                    self.notify_non_block(name, stream)
                if state.last:  # the non-block gradients are reduced at the last micro-step only
                    for name in self._nb_full:
                        self._poison([self.non_block_full(name, stream)[0]], stream)
                        self.notify_non_block(name, stream)
                if state.fetched is not None:
                    self._poison(self._strategy.full(state.fetched).tensors(), stream)
                    self.notify_block(state.fetched, stream)
                for layer in range(state.next_layer, -1, -1):
                    self._poison(self.block_full(layer, stream)[0].tensors(), stream)
                    self.notify_block(layer, stream)
                last = state.last
                self.end_micro_step(stream)
                if last:  # the layers exchanged before the fault: this rank's part of the norm
                    self._poison(self.shards(), stream)
                    return True
        except BaseException:
            self._protocol = MicroStepState(self.layout.num_layers)
            raise

    @staticmethod
    def _poison(tensors: Iterable[Tensor], stream: StreamLike) -> None:
        for t in tensors:
            ops.fill_nan(t, stream)

    def _check_between_steps(self, what: str) -> None:
        self._check_open(what)
        self._protocol.check_between_steps(what, self.step)

    def _check_readable(self, what: str, stream: StreamLike = None) -> None:
        """Shards and the norm hold a completed step (:meth:`MicroStepState.check_readable`)."""
        self._check_call(what, stream)
        self._protocol.check_readable(what, self.step)

    # ---- the non-block gradients -----------------------------------------------------------
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
        first = self._protocol.fetch_non_block(name, self._capture.assume_touched)
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
        if self._statistics is not None and self._statistics.nb_local is not None:
            self._statistics.nb_local(self._comm_handle)
        if self.world > 1:  # world 1: the mean is the gradient
            self._ctx.reduce_scatter_all(self._nb_list)
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

    # ---- norm, memory, state --------------------------------------------------------------
    def shards(self) -> list[Tensor]:
        """Every shard this rank holds (block layers then non-block), for optimizers and norms:
        the tensors, at any time (e.g. to size optimizer state); their values follow the rules
        of :meth:`block_shard` and :meth:`non_block_shard`."""
        self._check_open("shards")
        return self._strategy.shards() + [shard_view(t, self.rank, self.world) for t in self._nb_list]

    def grad_norm_squared(self, stream: StreamLike = None) -> Tensor:
        """The squared global L2 norm of the completed step's gradient: the sum of squares over
        every shard of every rank, as a one-element fp32 tensor (shape ``(1,)``) in device memory,
        computed and all-reduced on ``stream`` without blocking the host (so it may be captured
        in a graph). Read it as a Python float with ``float(norm)`` (a host sync). The manager
        reuses the tensor: the next call overwrites it. Valid between steps, after a completed
        step (ProtocolError otherwise); a collective: every rank calls it."""
        self._check_readable("grad_norm_squared", stream)
        self._wait(self._comm_done, stream)
        shards = self.shards()
        if not shards:  # no parameters: the norm is 0, not what the tensor held before
            ops.fill_zero(self._norm, stream)
        for i, t in enumerate(shards):
            ops.norm_squared(t, self._norm, accumulate=i > 0, stream=stream)
        self.comm.all_reduce(self._norm, op="sum", stream=stream)
        return self._norm

    # ---- gradient statistics (stats=True) -------------------------------------------------
    def _stats_rows(self) -> Tensor | None:
        """The statistics rows now (a graph's template holds those it writes)."""
        return None if self._statistics is None else self._statistics.out

    def stats(self, stream: StreamLike = None) -> Tensor:
        """The completed step's gradient statistics (``stats=True``): a float64 device tensor of
        shape ``(world, rows, tensors, 3)`` holding every rank's rows, laid out as
        :mod:`lowgrad.managers.stats` says (per tensor: sum of squares, non-finite count, largest
        finite |x|; per micro-step, per rank's local gradient, and of the accumulated gradient).
        Writes the rows of the step's micro-steps from what its launches measured, computes the
        accumulated gradient's row and gathers every rank's rows on ``stream``
        without blocking the host; a collective at world > 1 (every rank calls it). The manager
        reuses the tensor, and the next step the measurements this call reads: the next call, or
        the next step, overwrites them, ordered after ``stream``'s work only when the next step
        runs on ``stream`` too (a read of the tensor on another stream is the caller's to order;
        :meth:`read_stats` orders its copy itself).
        Valid between steps, after a completed step (ProtocolError otherwise); ValueError for a
        manager made without ``stats=True``."""
        return self._check_stats("stats", stream).gather(stream)

    def read_stats(self, stream: StreamLike = None, names: tuple[str, ...] | None = None) -> StatsReading:
        """:meth:`stats`, then an asynchronous copy of the rows on ``stream`` into a pinned host
        buffer the manager owns: a :class:`~lowgrad.managers.stats.StatsReading` whose
        ``result()`` is the :class:`lowgrad.diagnostics.StepStats` (waiting for the copy only if
        it has not finished), without a host sync here. ``names``: the column names to report
        (default ``"<non-block name>"`` and ``"layers.<l>.<block name>"``). Resolve the reading
        before the next ``read_stats``, which reuses the buffer (ProtocolError from the stale
        reading's ``result()`` otherwise). The checks of :meth:`stats` and of ``names`` come
        before anything is queued; not inside a graph capture (CaptureError)."""
        return self._check_stats("read_stats", stream).read(stream, names)

    def step_stats(self, stream: StreamLike = None, names: tuple[str, ...] | None = None) -> StepStats:
        """``read_stats(stream, names).result()``: the statistics on the host at once (a sync of
        ``stream``'s work up to the copy) as a :class:`lowgrad.diagnostics.StepStats`: per
        parameter, per layer and global norms, the noise scale, the first non-finite value
        (``first_nonfinite()``)."""
        return self.read_stats(stream, names).result()

    def _check_stats(self, what: str, stream: StreamLike) -> Statistics:
        """The checks of a statistics read, before anything is queued; the statistics."""
        self._check_call(what, stream)
        if self._statistics is None:
            raise ValueError(f"{what}(): the manager was created without stats=True")
        self._protocol.check_readable(what, self.step)
        return self._statistics

    def memory_report(self) -> Any:
        """Bytes by allocation name and kind on this rank's device."""
        return self.device.memory_report()

    def state_dict(self) -> dict[str, Any]:
        """What a restart needs for bit-identical gradients: base seed and step (between steps)."""
        self._check_between_steps("state_dict")
        return ManagerState(self.strategy, self.base_seed, self.step, self.rank, self.world, self.rounding).as_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same strategy, rank, world and rounding (between steps).
        The whole state is checked before anything changes: TypeError for a non-mapping or a
        value of the wrong type, ValueError for missing or unknown keys, an unknown version, a
        value out of range or a mismatch. The shards are unreadable until the next step ends."""
        self._check_between_steps("load_state_dict")
        saved = ManagerState.parse(state)
        saved.check_fits(self.strategy, self.rank, self.world, self.rounding)
        capture.forbid("load_state_dict")
        self.base_seed, self.step, self._protocol.complete = saved.base_seed, saved.step, False
        self._counter.set(self.base_seed, self.step, self.comm_stream)

    def close(self) -> None:
        """Free every gradient buffer now (idempotent); any later call raises ClosedError."""
        if self._closed:
            return
        self._closed = True
        for t in (*self._nb_full.values(), *self._strategy.owned(), self._counter.tensor, self._norm):
            t.close()
        self._strategy.close()
        if self._statistics is not None:
            self._statistics.close()

    # ---- events: recorded and waited through the capture, which skips waits on work recorded
    # outside a capture in progress (a replay is ordered after everything before it on its stream)
    def _record(self, event: Any, stream: StreamLike) -> None:
        self._capture.record(event, stream)

    def _wait(self, event: Any, stream: StreamLike) -> None:
        self._capture.wait(event, stream)

    # ---- host state (shared with the capture) ---------------------------------------------
    @property
    def step(self) -> int:
        """The optimizer step the next micro-step 0 begins (the step counter of the SR noise)."""
        return self._state.step

    @step.setter
    def step(self, value: int) -> None:
        self._state.step = value

    @property
    def _protocol(self) -> MicroStepState:
        return self._state.protocol

    @_protocol.setter
    def _protocol(self, value: MicroStepState) -> None:
        self._state.protocol = value

    def _graph_allocations(self) -> tuple[Any, ...]:
        rows = self._stats_rows()
        stats = () if rows is None else (rows,)
        return tuple(t.allocation for t in (*self._nb_full.values(), *self._strategy.owned(), self._counter.tensor,
                                            self._norm, *stats))

    def __enter__(self) -> GradientManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
