"""Gradient managers inside CUDA-graph captures: the template a capture records and its replays.

Inside a capture (``device.capture_of(stream)`` is a graph) a manager runs the protocol on a
*template* of micro-steps and leaves its host state as it was: :class:`Recording` saves the
state and collects the events recorded in the capture. When the capture ends the state is
restored and the :class:`Template` (which kinds of micro-steps were captured) goes to the graph.
Each replay checks that the template fits the manager's next micro-steps, launches, and then
advances the manager to the :class:`Replayed` state, as the eager calls would have.

The graph drives this through the methods of :class:`Replayable` (the graph's participant
protocol, :class:`lowgrad.cuda.graph.Participant`); nothing here imports a backend.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from lowgrad.core import capture
from lowgrad.core.errors import ProtocolError
from lowgrad.core.streams import StreamLike
from lowgrad.managers.protocol import MicroStepState, check_step_room


@dataclass
class Template:
    """What one capture recorded of a manager: ``count`` micro-steps from micro-step ``m0`` of
    steps of ``total``, ending ``steps`` steps; ``micro``: the micro-step at the capture's end
    (-1: between steps); ``touched``: the non-block gradients produced in the step by then;
    ``assumed``: for a template starting mid-step, those it assumed produced before it."""

    m0: int
    total: int
    count: int = 0
    steps: int = 0
    assume_touched: bool = False
    assumed: frozenset[str] | None = None
    touched: frozenset[str] = frozenset()
    micro: int = -1

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
    saved: MicroStepState
    saved_step: int
    template: Template
    events: set[Any] = field(default_factory=set)


class Replayable:
    """The capture/replay half of :class:`lowgrad.managers.base.GradientManager`."""

    _protocol: MicroStepState
    _recording: Recording | None
    step: int
    comm_stream: Any
    _comm_done: Any

    @abstractmethod
    def _check_open(self, what: str) -> None: ...

    @abstractmethod
    def _events(self) -> list[Any]:
        """The events later calls wait on (re-recorded after a capture and after each replay)."""

    @abstractmethod
    def _graph_allocations(self) -> tuple[Any, ...]:
        """The allocations a graph of this manager's micro-steps uses."""

    # ---- events: recorded and waited through these, so that a capture skips waits on work
    # recorded outside it (a replay is ordered after everything before it on its stream)
    def _record(self, event: Any, stream: StreamLike) -> None:
        event.record(stream)
        if self._recording is not None:
            self._recording.events.add(event)

    def _wait(self, event: Any, stream: StreamLike) -> None:
        rec = self._recording
        if capture.current() is None or (rec is not None and event in rec.events):
            event.wait(stream)

    # ---- capture -----------------------------------------------------------------------
    def _begin_capture(self, cap: Any, micro_step: int, total: int) -> None:
        """First micro-step of this manager in capture ``cap``: save host state, then set it so
        that micro-step ``micro_step`` of ``total`` may start (a template of any micro-step)."""
        state = self._protocol
        if state.in_micro or self._recording is not None:
            raise ProtocolError(f"start_micro_step({micro_step}) in a capture while micro-step {state.micro} is in "
                                "progress outside it")
        if not 0 <= micro_step < total:
            raise ProtocolError(f"micro-step {micro_step!r} of {total!r} cannot be captured")
        self._recording = Recording(cap, state.copy(), self.step,
                                    Template(micro_step, total, assume_touched=micro_step > 0))
        state.micro, state.total, state.nb_touched = micro_step - 1, total, set()
        cap.join(self)
        cap.keep(self._graph_allocations())

    def _end_template_micro_step(self, last: bool) -> None:
        if self._recording is not None:
            self._recording.template.micro_step_ended(self._protocol.nb_touched, last)

    def capture_closing(self, stream: int) -> None:
        """A capture is ending, maybe inside a micro-step (an error): bring the communication
        stream's captured work back into the captured stream so the capture can end cleanly."""
        if self._protocol.in_micro:
            self._record(self._comm_done, self.comm_stream)
            self._comm_done.wait(stream)

    def capture_ended(self, graph: Any, failed: bool) -> Template | None:
        """Restore the host state saved at the capture's start and make the events valid for
        eager work again; return the template (ProtocolError for a partial micro-step)."""
        rec, state = self._recording, self._protocol
        assert rec is not None, "capture_ended without a capture"
        partial, tpl = state.in_micro, rec.template
        tpl.touched, tpl.micro = frozenset(state.nb_touched), state.micro
        self._protocol, self.step, self._recording = rec.saved, rec.saved_step, None
        for e in self._events():
            e.record(self.comm_stream)
        if failed:
            return None
        if partial:
            raise ProtocolError("the capture ended inside a micro-step: capture whole micro-steps "
                                "(start_micro_step ... end_micro_step)")
        return tpl

    # ---- replay ------------------------------------------------------------------------
    def replay_check(self, template: Template) -> Replayed:
        """Whether the captured micro-steps fit this manager's next ones; the state after them."""
        self._check_open("graph replay")
        return template.fit(self._protocol, self.step)

    def replay_before(self, stream: int) -> None:
        self._comm_done.wait(stream)  # the previous micro-step's traffic, whichever stream it ended on

    def replay_launch(self, stream: int) -> int:
        return stream

    def replay_done(self, applied: Replayed, stream: int) -> None:
        state = self._protocol
        state.complete = state.complete or applied.step > self.step  # the replay ended a step
        state.micro, state.total, state.nb_touched = applied.micro, applied.total, set(applied.touched)
        self.step = applied.step
        for e in self._events():
            e.record(stream)
        self._comm_done.wait(self.comm_stream)  # later counter updates come after the replay
