"""What every gradient manager shares: the micro-step protocol and its misuse checks, per-use
seeds, the streams and events between the engine and the manager, non-block gradients, the
global norm and the saved state.

Protocol (DESIGN.md, "Gradient managers"), per micro-batch::

    gm.start_micro_step(stream, micro_step, total_micro_steps)
    t, accumulate = gm.non_block_full(name, stream); ...; gm.notify_non_block(name, stream)
    for layer in reversed(range(L)):
        dw, accumulate = gm.block_full(layer, stream); <engine writes dw>; gm.notify_block(layer, stream)
    gm.end_micro_step(stream)

then the optimizer reads ``gm.block_shard(layer, stream)`` / ``gm.non_block_shard(name, stream)``
(and ``gm.grad_norm_squared``) until the next ``start_micro_step``: only after a completed step,
``ProtocolError`` on a new manager, after ``load_state_dict`` and during a step. At the last
micro-step every rank reduces every non-block gradient in layout order (the same collectives on
every rank); one a rank did not fetch in the step contributes zeros.
Calls queue work on ``stream`` (the engine's) or on the manager's own communication stream,
ordered by events; none blocks the host.

Seeds: the SR kernels read the manager's :class:`~lowgrad.sr.seedcounter.SeedCounter` (device
memory) when they run; ``start_micro_step`` and the last ``end_micro_step`` queue its advance on
the communication stream. Micro-steps may be captured in a :class:`lowgrad.Graph`: inside a
capture the manager records a template and leaves its state alone; each replay checks the
template against the next micro-step and advances the state (see :mod:`lowgrad.cuda.graph`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np

from lowgrad import ops
from lowgrad.core import capture
from lowgrad.core.dtypes import DType, as_dtype, bf16, fp32
from lowgrad.core.errors import ClosedError, ProtocolError
from lowgrad.core.streams import StreamLike, stream_handle
from lowgrad.core.tensor import Container, Tensor, shard_view
from lowgrad.core.trace import nvtx_range
from lowgrad.managers.layout import Layout, ParamSpec
from lowgrad.sr.seedcounter import LAST_STEP, SeedCounter

GRAD_DTYPES = (bf16, fp32)
#: the version :meth:`GradientManager.state_dict` writes (a state without one is version 1)
STATE_VERSION = 1
_STATE_KEYS = frozenset({"version", "strategy", "base_seed", "step", "rank", "world"})


def _integer(what: str, value: Any) -> int:
    """``value`` as an int; TypeError for anything but a Python or NumPy integer (bools and
    floats included, even integral ones)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_step(what: str, value: Any) -> int:
    step = _integer(what, value)
    if not 0 <= step <= LAST_STEP:
        raise ValueError(f"{what} must be in [0, 2**32), got {step}")
    return step


class GradientManager(ABC):
    """Base of the managers; subclasses implement the block half (``_alloc_blocks``,
    ``block_full``, ``_exchange_block``, ``block_shard``)."""

    strategy = ""

    def __init__(self, layout: Layout, comm: Any, dtype: DType | str = bf16, seed: int = 0, step: int = 0,
                 offload: bool = False) -> None:
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
        step = _check_step("step", step)
        if not isinstance(offload, bool):
            raise TypeError(f"offload must be a bool, got {type(offload).__name__} {offload!r}")
        self.layout, self.comm, self.offload = layout, comm, offload
        self.rank, self.world, self.device = comm.rank, comm.world, comm.device
        layout.check_world(self.world)
        self.base_seed, self.step = seed, step
        self.comm_stream = self.device.stream(priority=self.device_priority_high())
        self._comm_handle = stream_handle(self.comm_stream)
        self._engine_done = self.device.event(name="engine_done")
        self._comm_done = self.device.event(name="comm_done")
        self._nb_done = self.device.event(name="non_block_done")
        self._group_done = self.device.event(name="group_done")
        # protocol state; _complete: the shards hold a completed step's gradients
        self._closed = False
        self._complete = False
        self._in_micro = False
        self._micro = -1
        self._total = 0
        self._next_layer = -1
        self._fetched: int | None = None
        self._nb_open: set[str] = set()
        self._nb_touched: set[str] = set()
        # CUDA-graph capture (lowgrad.cuda.graph): the Graph capturing this manager's micro-steps, the
        # events recorded in it, the host state before it, and the template of what it captured
        self._capture: Any = None
        self._captured: set[Any] = set()
        self._saved: tuple[Any, ...] = ()
        self._template: dict[str, Any] = {}
        self._counter = SeedCounter(self.device, seed, step, self.comm_stream)
        self._range_names = [f"lowgrad.exchange layer {l}" for l in range(layout.num_layers)]
        self._alloc_non_block()
        self._alloc_blocks()
        self._norm = self.device.alloc(1, fp32, name="grad_norm")

    def device_priority_high(self) -> int:
        rng = self.device.stream_priority_range
        return min(rng)

    # ---- allocation ----------------------------------------------------------------------
    def _alloc_non_block(self) -> None:
        lazy = self.device.lazy_allocator("device")
        self._nb_full = {s.name: lazy.alloc(s.shape, self.dtype, "non_block_grad") for s in self.layout.non_block}
        self._nb_list = list(self._nb_full.values())  # layout order: the order every rank reduces them in
        self._nb_spec = {s.name: s for s in self.layout.non_block}
        if self._nb_full:
            lazy.commit()

    @abstractmethod
    def _alloc_blocks(self) -> None:
        """Allocate the block gradients (full buffers, shards) and their events."""

    # ---- protocol ------------------------------------------------------------------------
    def start_micro_step(self, stream: StreamLike, micro_step: int, total_micro_steps: int) -> None:
        """Begin micro-step ``micro_step`` of ``total_micro_steps`` of the current step; queues the
        seed counter's advance on the communication stream after ``stream``'s work so far. Inside
        a :class:`lowgrad.Graph` capture of ``stream`` it begins a template instead (see
        :mod:`lowgrad.cuda.graph`): any micro-step may be captured, and host state is left as it was.

        Non-integer (bool, float) ``micro_step``/``total_micro_steps`` raise TypeError; starting
        a step when ``step`` is the last value of the 32-bit step counter raises OverflowError."""
        self._check_open("start_micro_step")
        micro_step = _integer("micro_step", micro_step)
        total_micro_steps = _integer("total_micro_steps", total_micro_steps)
        cap = self.device.capture_of(stream)
        if cap is not None and cap is not self._capture:
            self._begin_capture(cap, micro_step, total_micro_steps)
        if self._in_micro:
            raise ProtocolError(f"start_micro_step({micro_step}) while micro-step {self._micro} is in progress")
        if total_micro_steps < 1:
            raise ProtocolError(f"total_micro_steps must be positive, got {total_micro_steps}")
        expected = self._micro + 1 if self._micro >= 0 else 0
        if micro_step != expected:
            raise ProtocolError(f"micro-step {micro_step} started, expected {expected} (step {self.step})")
        if micro_step > 0 and total_micro_steps != self._total:
            raise ProtocolError(f"total_micro_steps changed from {self._total} to {total_micro_steps} "
                                f"within step {self.step}")
        if micro_step >= total_micro_steps:
            raise ProtocolError(f"micro-step {micro_step} out of range for {total_micro_steps} micro-steps")
        if micro_step == 0 and self._capture is None:  # a capture's step number is checked at replay
            self._check_step_room(f"start_micro_step(0) of step {self.step}", self.step + 1)
        self._in_micro, self._micro, self._total = True, micro_step, total_micro_steps
        self._next_layer, self._fetched = self.layout.num_layers - 1, None
        if micro_step == 0:
            self._nb_touched = set()
        self._join(stream)
        if micro_step > 0:
            self._counter.next_micro(self._comm_handle)

    def _join(self, stream: StreamLike) -> None:
        """The communication stream waits for ``stream``'s work so far."""
        self._record(self._engine_done, stream)
        self._wait(self._engine_done, self.comm_stream)

    # ---- events: recorded and waited through these, so that a capture skips waits on work
    # recorded outside it (a replay is ordered after everything before it on its stream)
    def _record(self, event: Any, stream: StreamLike) -> None:
        event.record(stream)
        if self._capture is not None:
            self._captured.add(event)

    def _wait(self, event: Any, stream: StreamLike) -> None:
        if event in self._captured or capture.current() is None:
            event.wait(stream)

    def _events(self) -> list[Any]:
        """The events later calls wait on (re-recorded after a capture and after each replay)."""
        return [self._comm_done, self._nb_done]

    @property
    def last_micro_step(self) -> bool:
        return self._micro == self._total - 1

    @staticmethod
    def _check_step_room(what: str, end_step: int) -> None:
        """``gm.step`` after the steps ``what`` starts must stay a 32-bit value: the seed counter
        never wraps (which would repeat step 0's noise) and every state can be saved and reloaded,
        so the last step that runs is 2**32 - 2."""
        if end_step > LAST_STEP:
            raise OverflowError(f"{what} would end with step {end_step}, past the 32-bit step counter (2**32 - 1): "
                                "its noise would repeat step 0's and its state could not be saved; continue from "
                                "step 0 (load_state_dict) or with another base seed")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: gradient manager used after close()")

    def _check_in_micro(self, what: str) -> None:
        self._check_open(what)
        if not self._in_micro:
            raise ProtocolError(f"{what} outside a micro-step (call start_micro_step first)")

    def _check_fetch(self, layer: int) -> None:
        self._check_in_micro(f"block_full({layer})")
        self._check_layer(layer)
        if self._fetched is not None:
            raise ProtocolError(f"block_full({layer}) while layer {self._fetched} is fetched and not notified")
        if layer != self._next_layer:
            raise ProtocolError(f"block_full({layer}) out of order: layers go from L-1 down to 0, expected "
                                f"{self._next_layer}")
        self._fetched = layer

    def _check_notify(self, layer: int) -> None:
        self._check_in_micro(f"notify_block({layer})")
        self._check_layer(layer)
        if self._fetched != layer:
            raise ProtocolError(f"notify_block({layer}) for a layer that was not fetched (fetched: {self._fetched})")
        self._fetched, self._next_layer = None, layer - 1

    def _check_layer(self, layer: int) -> None:
        if not 0 <= _integer("layer", layer) < self.layout.num_layers:
            raise ValueError(f"layer {layer!r} outside [0, {self.layout.num_layers})")

    def notify_block(self, layer: int, stream: StreamLike) -> None:
        """The engine finished writing layer ``layer``'s gradients on ``stream``: queue the
        exchange and accumulation on the manager's communication stream."""
        self._check_notify(layer)
        with nvtx_range(self._range_names[layer]):
            self._join(stream)
            self._exchange_block(layer)

    @abstractmethod
    def block_full(self, layer: int, stream: StreamLike) -> tuple[Container, bool]:
        """Layer ``layer``'s gradient buffers for the engine and whether to add into them."""

    @abstractmethod
    def block_shard(self, layer: int, stream: StreamLike) -> Container:
        """This rank's shards of layer ``layer``, ready on ``stream`` (between steps)."""

    @abstractmethod
    def _exchange_block(self, layer: int) -> None:
        """Queue layer ``layer``'s exchange/accumulation on ``self.comm_stream``."""

    def end_micro_step(self, stream: StreamLike) -> None:
        """Close the micro-step; on the last one, reduce-scatter the non-block gradients and
        advance ``step``. ``stream`` waits for all of this micro-step's gradient traffic."""
        self._check_in_micro("end_micro_step")
        if self._fetched is not None or self._next_layer != -1:
            raise ProtocolError(f"end_micro_step with layers {self._next_layer}..0 not notified"
                                if self._fetched is None else f"end_micro_step with layer {self._fetched} not notified")
        if self._nb_open:
            raise ProtocolError(f"end_micro_step with non-block gradients not notified: {sorted(self._nb_open)}")
        last = self.last_micro_step
        if last:
            with nvtx_range("lowgrad.non_block reduce-scatter"):
                self._finish_non_block(stream)
            self._counter.next_step(self._comm_handle)
        self._record(self._comm_done, self.comm_stream)
        self._wait(self._comm_done, stream)
        self._in_micro = False
        if self._capture is not None:
            self._end_template_micro_step(last)
        if last:
            self.step += 1
            self._micro = -1
            self._complete = True

    # ---- non-block parameters (full on every rank, reduce-scattered on the last micro-step)
    def non_block_full(self, name: str, stream: StreamLike) -> tuple[Tensor, bool]:
        """The full gradient of non-block parameter ``name`` and whether to add into it.

        ``zero_init`` parameters are zeroed on ``stream`` at their first fetch of a step and are
        always added into. Fetching again within a step returns ``accumulate=True``.
        """
        self._check_in_micro(f"non_block_full({name!r})")
        t = self._nb(name)
        if name in self._nb_open:
            raise ProtocolError(f"non_block_full({name!r}) again before notify_non_block({name!r})")
        first = name not in self._nb_touched and not self._template.get("assume_touched")
        if first:
            self._wait(self._nb_done, stream)  # the previous step's reduce-scatter is done with it
        if first and self._nb_spec[name].zero_init:
            ops.fill_zero(t, stream)
        self._nb_open.add(name)
        self._nb_touched.add(name)
        return t, (not first) or self._nb_spec[name].zero_init

    def notify_non_block(self, name: str, stream: StreamLike) -> None:
        """The engine finished writing non-block gradient ``name`` on ``stream``."""
        self._check_in_micro(f"notify_non_block({name!r})")
        self._nb(name)
        if name not in self._nb_open:
            raise ProtocolError(f"notify_non_block({name!r}) without non_block_full({name!r})")
        self._nb_open.discard(name)

    def _finish_non_block(self, stream: StreamLike) -> None:
        """Reduce-scatter every non-block gradient in layout order, whichever this rank produced:
        every rank issues the same collectives. One this rank never fetched in the step (so
        nothing was written into it since the previous step's reduce-scatter) is zeroed first and
        contributes zeros to the mean."""
        self._join(stream)
        for name, t in self._nb_full.items():
            if name not in self._nb_touched:
                ops.fill_zero(t, self.comm_stream)
        if self.world > 1:  # world 1: the mean is the gradient
            self.reduce_scatter_all(self._nb_list)
        self._record(self._nb_done, self.comm_stream)

    def reduce_scatter_all(self, tensors: list[Tensor]) -> None:
        """In-place average reduce-scatter of every tensor, as one NCCL group on the
        communication stream (one launch for a layer instead of one per tensor)."""
        if tensors:
            with self.comm.group(self.comm_stream, event=self._group_done):
                for t in tensors:
                    self.comm.reduce_scatter(t, op="avg", stream=self.comm_stream)

    def non_block_shard(self, name: str, stream: StreamLike) -> Tensor:
        """This rank's shard of non-block gradient ``name`` (dim 0 split by world), ready on
        ``stream`` (which waits for the reduce-scatter). Valid between steps, after a completed
        step (ProtocolError otherwise); zeros where no rank produced it in the step."""
        self._check_readable(f"non_block_shard({name!r})")
        t = self._nb(name)
        self._wait(self._nb_done, stream)
        return shard_view(t, self.rank, self.world)

    def _nb(self, name: str) -> Tensor:
        try:
            return self._nb_full[name]
        except KeyError:
            raise KeyError(f"no non-block parameter {name!r}; layout has {list(self._nb_full)}") from None

    def _check_between_steps(self, what: str) -> None:
        self._check_open(what)
        if self._in_micro or self._micro >= 0:
            raise ProtocolError(f"{what} during step {self.step} (micro-step {self._micro} of {self._total}); "
                                "shards are complete only after the last micro-step ends")

    def _check_readable(self, what: str) -> None:
        """Shards and the norm hold a completed step: between steps, and a step has ended since
        the manager was created or its state loaded (before that the buffers are uninitialised)."""
        self._check_between_steps(what)
        if not self._complete:
            raise ProtocolError(f"{what} before any step completed (the manager is new or its state was just "
                                "loaded): shards are read after the last micro-step of a step ends")

    # ---- containers ----------------------------------------------------------------------
    def _container(self, tensors: list[Tensor]) -> Container:
        return Container([(s.name, t) for s, t in zip(self.layout.block, tensors)])

    def _zero_init(self, tensors: list[Tensor], stream: StreamLike) -> None:
        for s, t in zip(self.layout.block, tensors):
            if s.zero_init:
                ops.fill_zero(t, stream)

    def shard_offset(self, spec: ParamSpec) -> int:
        """Element offset of this rank's shard within the full tensor (for the SR noise index)."""
        return self.rank * (spec.numel // self.world)

    # ---- norm, memory, state --------------------------------------------------------------
    def shards(self) -> list[Tensor]:
        """Every shard this rank holds (block layers then non-block), for optimizers and norms:
        the tensors, at any time (e.g. to size optimizer state); their values follow the rules
        of :meth:`block_shard` and :meth:`non_block_shard`."""
        self._check_open("shards")
        return self._block_shards() + [shard_view(t, self.rank, self.world) for t in self._nb_list]

    @abstractmethod
    def _block_shards(self) -> list[Tensor]:
        """This rank's block shards, layer by layer in layout order."""

    def grad_norm_squared(self, stream: StreamLike = None) -> Tensor:
        """Sum of squares over every shard of every rank (fp32 scalar on the device, all-reduced),
        queued on ``stream``. Valid between steps, after a completed step (ProtocolError
        otherwise); a collective: every rank calls it. Read it with ``.numpy()``."""
        self._check_readable("grad_norm_squared")
        self._wait(self._comm_done, stream)
        for i, t in enumerate(self.shards()):
            ops.norm_squared(t, self._norm, accumulate=i > 0, stream=stream)
        self.comm.all_reduce(self._norm, op="sum", stream=stream)
        return self._norm

    def memory_report(self) -> Any:
        """Bytes by allocation name and kind on this rank's device."""
        return self.device.memory_report()

    def state_dict(self) -> dict[str, Any]:
        """What a restart needs for bit-identical gradients: base seed and step (between steps)."""
        self._check_between_steps("state_dict")
        return {"version": STATE_VERSION, "strategy": self.strategy, "base_seed": self.base_seed,
                "step": self.step, "rank": self.rank, "world": self.world}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same strategy, rank and world (between steps).
        The whole state is checked before anything changes: TypeError for a non-mapping or a
        value of the wrong type, ValueError for missing or unknown keys, an unknown version, a
        value out of range or a mismatch. The shards are unreadable until the next step ends."""
        self._check_between_steps("load_state_dict")
        base_seed, step = self._parse_state(state)
        capture.forbid("load_state_dict")
        self.base_seed, self.step, self._complete = base_seed, step, False
        self._counter.set(self.base_seed, self.step, self.comm_stream)

    def _parse_state(self, state: Any) -> tuple[int, int]:
        """The (base seed, step) of a valid :meth:`state_dict` for this manager."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping from state_dict(), got {type(state).__name__}")
        keys = set(state)
        missing, unknown = _STATE_KEYS - {"version"} - keys, keys - _STATE_KEYS
        if missing or unknown:
            raise ValueError(f"state keys: missing {sorted(missing)}, unknown {sorted(map(repr, unknown))}")
        version = state.get("version", STATE_VERSION)
        if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)) \
                or version != STATE_VERSION:
            raise ValueError(f"state version {version!r} is not supported (this lowgrad reads version {STATE_VERSION})")
        if not isinstance(state["strategy"], str):
            raise TypeError(f"state strategy must be a str, got {type(state['strategy']).__name__}")
        world, rank = _integer("state world", state["world"]), _integer("state rank", state["rank"])
        base_seed = _integer("state base_seed", state["base_seed"])
        ops.check_seed(base_seed)
        step = _check_step("state step", state["step"])
        for key, value in (("strategy", state["strategy"]), ("world", world), ("rank", rank)):
            if value != getattr(self, key):
                raise ValueError(f"state {key} {value!r} does not match this manager's {getattr(self, key)!r}")
        return base_seed, step

    def close(self) -> None:
        """Free every gradient buffer now (idempotent); any later call raises ClosedError."""
        if self._closed:
            return
        self._closed = True
        for t in (*self._nb_full.values(), *self._owned(), self._counter.tensor, self._norm):
            t.close()

    @abstractmethod
    def _owned(self) -> list[Tensor]:
        """The block tensors this manager allocated."""

    # ---- CUDA-graph capture and replay (lowgrad.cuda.graph calls these) ---------------------------
    def _begin_capture(self, cap: Any, micro_step: int, total: int) -> None:
        """First micro-step of this manager in capture ``cap``: save host state, then set it so
        that micro-step ``micro_step`` of ``total`` may start (a template of any micro-step)."""
        if self._in_micro or self._capture is not None:
            raise ProtocolError(f"start_micro_step({micro_step}) in a capture while micro-step {self._micro} is in "
                                "progress outside it")
        if not (isinstance(micro_step, int) and isinstance(total, int) and 0 <= micro_step < total):
            raise ProtocolError(f"micro-step {micro_step!r} of {total!r} cannot be captured")
        self._saved = (self._micro, self._total, self.step, set(self._nb_touched), self._complete)
        self._capture, self._captured = cap, set()
        self._micro, self._total = micro_step - 1, total
        self._nb_touched = set()
        self._template = {"m0": micro_step, "total": total, "count": 0, "steps": 0, "assumed": None,
                          "assume_touched": micro_step > 0}
        cap.join(self)
        cap.keep(tuple(t._alloc for t in (*self._nb_full.values(), *self._owned(), self._counter.tensor,
                                          self._norm)))

    def _end_template_micro_step(self, last: bool) -> None:
        tpl = self._template
        if tpl["assume_touched"]:  # a template starting mid-step assumed these were produced before
            tpl["assumed"], tpl["assume_touched"] = frozenset(self._nb_touched), False
        tpl["count"] += 1
        tpl["steps"] += int(last)

    def capture_closing(self, stream: int) -> None:
        """A capture is ending, maybe inside a micro-step (an error): bring the communication
        stream's captured work back into the captured stream so the capture can end cleanly."""
        if self._in_micro:
            self._record(self._comm_done, self.comm_stream)
            self._comm_done.wait(stream)

    def capture_ended(self, graph: Any, failed: bool) -> Any:
        """Restore the host state saved at the capture's start and make the events valid for
        eager work again; return the template (ProtocolError for a partial micro-step)."""
        partial, tpl = self._in_micro, dict(self._template)
        tpl["touched"], tpl["micro"] = frozenset(self._nb_touched), self._micro
        self._micro, self._total, self.step, self._nb_touched, self._complete = self._saved
        self._in_micro, self._fetched, self._nb_open = False, None, set()
        self._capture, self._captured, self._template = None, set(), {}
        for e in self._events():
            e.record(self.comm_stream)
        if failed:
            return None
        if partial:
            raise ProtocolError("the capture ended inside a micro-step: capture whole micro-steps "
                                "(start_micro_step ... end_micro_step)")
        return tpl

    def replay_check(self, tpl: dict[str, Any]) -> tuple[int, int, int, set[str]]:
        """Whether the captured micro-steps fit this manager's next ones; the state after them."""
        self._check_open("graph replay")
        if self._in_micro:
            raise ProtocolError(f"graph replay while micro-step {self._micro} is in progress")
        m, M = (self._micro + 1 if self._micro >= 0 else 0), tpl["total"]
        if m > 0 and self._total != M:
            raise ProtocolError(f"graph captured for steps of {M} micro-steps, but this step has {self._total}")

        def kind(i: int) -> tuple[bool, bool]:
            return i % M == 0, i % M == M - 1
        if any(kind(tpl["m0"] + i) != kind(m + i) for i in range(tpl["count"])):
            raise ProtocolError(f"graph captured from micro-step {tpl['m0']} of {M} ({tpl['count']} micro-steps) "
                                f"cannot replay as micro-step {m}: first, middle and last micro-steps differ")
        if m > 0 and tpl["assumed"] is not None and tpl["assumed"] != self._nb_touched:
            raise ProtocolError(f"graph assumes non-block gradients {sorted(tpl['assumed'])} were produced earlier "
                                f"in the step; this step produced {sorted(self._nb_touched)}")
        micro = -1 if tpl["micro"] < 0 else (m + tpl["count"] - 1) % M
        self._check_step_room("graph replay", self.step + tpl["steps"] + int(micro >= 0))
        return micro, M, self.step + tpl["steps"], set(tpl["touched"])

    def replay_before(self, stream: int) -> None:
        self._comm_done.wait(stream)  # the previous micro-step's traffic, whichever stream it ended on

    def replay_done(self, state: tuple[int, int, int, set[str]], stream: int) -> None:
        self._complete = self._complete or state[2] > self.step  # the replay ended a step
        self._micro, self._total, self.step, self._nb_touched = state
        for e in self._events():
            e.record(stream)
        self._comm_done.wait(self.comm_stream)  # later counter updates come after the replay

    def __enter__(self) -> GradientManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
