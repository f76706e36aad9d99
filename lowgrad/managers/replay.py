"""Gradient managers inside CUDA-graph captures: the template a capture records and its replays.

Inside a capture (``device.capture_of(stream)`` is a graph) a manager runs the protocol on a
*template* of micro-steps and leaves its host state as it was: :class:`Recording` saves the
state and collects the events recorded in the capture. When the capture ends the state is
restored and the :class:`Template` (which kinds of micro-steps were captured) goes to the graph.
Each replay checks that the template fits the manager's next micro-steps, launches, and then
advances the manager to the :class:`Replayed` state, as the eager calls would have.

The manager (:mod:`lowgrad.managers.manager`) does the capturing and replaying; this module holds
the data that passes between it and the graph, and :class:`GraphHooks`, the only way a graph
reaches a manager; nothing here imports a backend.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lowgrad.core.errors import ProtocolError
from lowgrad.managers.protocol import MicroStepState, check_step_room


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
    saved: MicroStepState
    saved_step: int
    saved_stats_m: int  # the micro-steps of the step the statistics rows hold
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
