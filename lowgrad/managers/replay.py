"""Gradient managers inside CUDA-graph captures: the template a capture records and its replays.

Inside a capture (``device.capture_of(stream)`` is a graph) a manager runs the protocol on a
*template* of micro-steps and leaves its host state as it was: :class:`Recording` saves the
state and collects the events recorded in the capture. When the capture ends the state is
restored and the :class:`Template` (which kinds of micro-steps were captured) goes to the graph.
Each replay checks that the template fits the manager's next micro-steps, launches, and then
advances the manager to the :class:`Replayed` state, as the eager calls would have.

:class:`Capture` is the manager's collaborator that does it: it shares the manager's
:class:`~lowgrad.managers.protocol.HostState` and is lent the few things of the manager it
needs (:class:`CaptureContext`); :class:`GraphHooks` (its methods) is the only way a graph reaches
a manager. Nothing here imports a backend.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lowgrad.base.errors import ProtocolError
from lowgrad.buffers import capture
from lowgrad.buffers.streams import StreamLike
from lowgrad.managers.protocol import HostState, MicroStepState, check_step_room


@dataclass
class Template:
    """What one capture recorded of a manager: ``count`` micro-steps from micro-step ``m0`` of
    steps of ``total``, ending ``steps`` steps; ``micro``: the micro-step at the capture's end
    (-1: between steps); ``touched``: the non-block gradients produced in the step by then;
    ``assumed``: for a template starting mid-step, those it assumed produced before it;
    ``stats``: the statistics rows its launches write (None: the manager measures none)."""

    m0: int
    total: int
    count: int = 0
    steps: int = 0
    assume_touched: bool = False
    assumed: frozenset[str] | None = None
    touched: frozenset[str] = frozenset()
    micro: int = -1
    stats: Any = None

    def micro_step_ended(self, touched: set[str], last: bool) -> None:
        if self.assume_touched:  # a template starting mid-step assumed these were produced before
            self.assumed, self.assume_touched = frozenset(touched), False
        self.count += 1
        self.steps += int(last)

    def fit(self, state: MicroStepState, step: int) -> Replayed:
        """The state after replaying on ``state`` at ``step``; ProtocolError when it does not fit."""
        if state.in_micro:
            raise ProtocolError(f"graph replay while micro-step {state.micro} is in progress")
        m, M = state.next_micro, self.total
        if m > 0 and state.total != M:
            raise ProtocolError(f"graph captured for steps of {M} micro-steps, but this step has {state.total}")

        def kind(i: int) -> tuple[bool, bool]:
            return i % M == 0, i % M == M - 1
        if any(kind(self.m0 + i) != kind(m + i) for i in range(self.count)):
            raise ProtocolError(f"graph captured from micro-step {self.m0} of {M} ({self.count} micro-steps) "
                                f"cannot replay as micro-step {m}: first, middle and last micro-steps differ")
        if m > 0 and self.assumed is not None and self.assumed != state.nb_touched:
            raise ProtocolError(f"graph assumes non-block gradients {sorted(self.assumed)} were produced earlier "
                                f"in the step; this step produced {sorted(state.nb_touched)}")
        micro = -1 if self.micro < 0 else (m + self.count - 1) % M
        check_step_room("graph replay", step + self.steps + int(micro >= 0))
        return Replayed(micro, M, step + self.steps, self.touched)


@dataclass(frozen=True)
class Replayed:
    """A manager's state after a replay: micro-step, micro-steps per step, step, non-block
    gradients produced in the step."""

    micro: int
    total: int
    step: int
    touched: frozenset[str]


@dataclass
class Recording:
    """A capture in progress: the graph, the host state before it, the template so far, and the
    events recorded inside it (only those may be waited on inside it)."""

    graph: Any
    saved: HostState
    template: Template
    events: set[Any] = field(default_factory=set)


@dataclass(frozen=True, eq=False)
class GraphHooks:
    """What a :class:`lowgrad.Graph` calls on a manager that recorded itself in its capture (the
    graph's participant protocol, :class:`lowgrad.cuda.graph.Participant`): the manager's own
    private methods, so that none of this is part of the manager's public protocol. Hashed by
    identity (a graph keys its participants by it)."""

    replay_check: Callable[[Template], Replayed]
    replay_before: Callable[[int], None]
    replay_launch: Callable[[int], int]
    replay_done: Callable[[Replayed, int], None]
    capture_closing: Callable[[int], None]
    capture_ended: Callable[[Any, bool], Template | None]


@dataclass(eq=False, kw_only=True)
class CaptureContext:
    """What a :class:`Capture` is lent by its manager: ``check_open(what)``; ``events()``, the
    events later calls wait on (re-recorded after a capture and after each replay);
    ``allocations()``, what a graph must keep alive; ``stats()``, the statistics rows now (None:
    none) and ``copied()``, the event of their last copy to the host (None: none); the
    communication stream and its end-of-micro-step event ``comm_done``."""

    check_open: Callable[[str], None]
    events: Callable[[], list[Any]]
    allocations: Callable[[], tuple[Any, ...]]
    stats: Callable[[], Any]
    copied: Callable[[], Any]
    comm_stream: Any
    comm_done: Any


class Capture:
    """A manager's graph capture and replay: inside a capture the manager runs the protocol on a
    template and :meth:`begin` / :meth:`ended` save and restore ``state``; a replay checks the
    template against ``state`` and advances it. :meth:`record` and :meth:`wait` are how the
    manager records and waits for its events, so that a capture skips waits on work recorded
    outside it (a replay is ordered after everything before it on its stream)."""

    def __init__(self, state: HostState, ctx: CaptureContext) -> None:
        self.state, self.ctx = state, ctx
        self.recording: Recording | None = None  # a capture in progress
        self.hooks = GraphHooks(self.replay_check, self.replay_before, self.replay_launch, self.replay_done,
                                self.capture_closing, self.capture_ended)

    # ---- events --------------------------------------------------------------------------
    def record(self, event: Any, stream: StreamLike) -> None:
        event.record(stream)
        if self.recording is not None:
            self.recording.events.add(event)

    def wait(self, event: Any, stream: StreamLike) -> None:
        rec = self.recording
        if capture.current() is None or (rec is not None and event in rec.events):
            event.wait(stream)

    # ---- the manager's side --------------------------------------------------------------
    def joins(self, cap: Any) -> bool:
        """``cap`` (the capture of the stream a micro-step starts on) is one this manager has
        not joined yet."""
        return cap is not None and (self.recording is None or cap is not self.recording.graph)

    @property
    def assume_touched(self) -> bool:
        """A template starting mid-step: the non-block gradients count as produced before it."""
        return self.recording is not None and self.recording.template.assume_touched

    def begin(self, cap: Any, micro_step: int, total: int) -> None:
        """First micro-step of this manager in capture ``cap``: save host state, then set it so
        that micro-step ``micro_step`` of ``total`` may start (a template of any micro-step)."""
        state = self.state.protocol
        if state.in_micro or self.recording is not None:
            raise ProtocolError(f"start_micro_step({micro_step}) in a capture while micro-step {state.micro} is in "
                                "progress outside it")
        if not 0 <= micro_step < total:
            raise ProtocolError(f"micro-step {micro_step!r} of {total!r} cannot be captured")
        self.recording = Recording(cap, self.state.copy(), Template(micro_step, total, assume_touched=micro_step > 0,
                                                                    stats=self.ctx.stats()))
        state.micro, state.total, state.nb_touched = micro_step - 1, total, set()
        cap.join(self.hooks)
        cap.keep(self.ctx.allocations())

    def micro_step_ended(self, last: bool) -> None:
        if self.recording is not None:
            self.recording.template.micro_step_ended(self.state.protocol.nb_touched, last)

    # ---- what GraphHooks hands the graph --------------------------------------------------
    def capture_closing(self, stream: int) -> None:
        """A capture is ending, maybe inside a micro-step (an error): bring the communication
        stream's captured work back into the captured stream so the capture can end cleanly."""
        if self.state.protocol.in_micro:
            self.record(self.ctx.comm_done, self.ctx.comm_stream)
            self.ctx.comm_done.wait(stream)

    def capture_ended(self, graph: Any, failed: bool) -> Template | None:
        """Restore the host state saved at the capture's start and make the events valid for
        eager work again; return the template (ProtocolError for a partial micro-step)."""
        rec, state = self.recording, self.state.protocol
        assert rec is not None, "capture_ended without a capture"
        partial, tpl = state.in_micro, rec.template
        tpl.touched, tpl.micro = frozenset(state.nb_touched), state.micro
        self.state.restore(rec.saved)
        self.recording = None
        for e in self.ctx.events():
            e.record(self.ctx.comm_stream)
        if failed:
            return None
        if partial:
            raise ProtocolError("the capture ended inside a micro-step: capture whole micro-steps "
                                "(start_micro_step ... end_micro_step)")
        return tpl

    def replay_check(self, template: Template) -> Replayed:
        """Whether the captured micro-steps fit this manager's next ones; the state after them."""
        self.ctx.check_open("graph replay")
        if template.stats is not self.ctx.stats():  # the rows grew for a step of more micro-steps since
            raise ProtocolError("graph replay: the graph was captured before the gradient statistics' rows grew "
                                "for a step of more micro-steps; capture it again")
        return template.fit(self.state.protocol, self.state.step)

    def replay_before(self, stream: int) -> None:
        self.ctx.comm_done.wait(stream)  # the previous micro-step's traffic, whichever stream it ended on
        copied = self.ctx.copied()
        if copied is not None:  # a replayed micro-step 0 refills the rows
            copied.wait(stream)

    @staticmethod
    def replay_launch(stream: int) -> int:
        return stream

    @staticmethod
    def replay_failed(stream: int) -> None:
        """Nothing to undo: replay_before only queued waits, and the host state moves in replay_done."""

    def replay_done(self, applied: Replayed, stream: int) -> None:
        host, state = self.state, self.state.protocol
        state.complete = state.complete or applied.step > host.step  # the replay ended a step
        state.micro, state.total, state.nb_touched = applied.micro, applied.total, set(applied.touched)
        host.step, host.stats_m = applied.step, applied.total
        for e in self.ctx.events():
            e.record(stream)
        self.ctx.comm_done.wait(self.ctx.comm_stream)  # later counter updates come after the replay
