"""The micro-step state machine every gradient manager follows (host state only, no device work).

Per micro-batch the engine calls ``start_micro_step``, fetches and notifies the non-block
gradients it produces, fetches and notifies the layers from ``L-1`` down to ``0``, then
``end_micro_step``. :class:`MicroStepState` holds where the engine is in that sequence and
raises :class:`~lowgrad.base.errors.ProtocolError` for every call out of order, before the
manager queues any work.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from lowgrad.base.errors import ProtocolError
from lowgrad.base.integers import integer
from lowgrad.sr.seedcounter import LAST_STEP


def check_step(what: str, value: Any) -> int:
    """``value`` as a step number: an int in ``[0, 2**32)``."""
    step = integer(what, value)
    if not 0 <= step <= LAST_STEP:
        raise ValueError(f"{what} must be in [0, 2**32), got {step}")
    return step


def check_step_room(what: str, end_step: int) -> None:
    """``gm.step`` after the steps ``what`` starts must stay a 32-bit value: the seed counter
    never wraps (which would repeat step 0's noise) and every state can be saved and reloaded,
    so the last step that runs is 2**32 - 2."""
    if end_step > LAST_STEP:
        raise OverflowError(f"{what} would end with step {end_step}, past the 32-bit step counter (2**32 - 1): "
                            "its noise would repeat step 0's and its state could not be saved; continue from "
                            "step 0 (load_state_dict) or with another base seed")


@dataclass
class MicroStepState:
    """Where the engine is in the protocol.

    ``micro``: the current (or last finished) micro-step of the step, -1 between steps;
    ``total``: the step's micro-step count; ``in_micro``: between start and end of a micro-step;
    ``next_layer``: the layer the engine must fetch next (L-1 down to 0, -1 when all are done);
    ``fetched``: the layer fetched and not yet notified; ``nb_open``: non-block gradients
    fetched and not yet notified; ``nb_touched``: non-block gradients fetched in this step;
    ``complete``: the shards hold a completed step (readable).
    """

    num_layers: int
    micro: int = -1
    total: int = 0
    in_micro: bool = False
    next_layer: int = -1
    fetched: int | None = None
    nb_open: set[str] = field(default_factory=set)
    nb_touched: set[str] = field(default_factory=set)
    complete: bool = False

    def copy(self) -> MicroStepState:
        """An independent copy (the sets are copied too)."""
        return copy.deepcopy(self)

    @property
    def last(self) -> bool:
        """The current micro-step is the step's last one."""
        return self.micro == self.total - 1

    @property
    def next_micro(self) -> int:
        """The micro-step that may start next."""
        return self.micro + 1 if self.micro >= 0 else 0

    # ---- transitions: each checks everything first, then changes the state -------------
    def check_start(self, micro_step: int, total: int, step: int) -> None:
        """Whether ``micro_step`` of ``total`` of step ``step`` may begin now."""
        if self.in_micro:
            raise ProtocolError(f"start_micro_step({micro_step}) while micro-step {self.micro} is in progress")
        if total < 1:
            raise ProtocolError(f"total_micro_steps must be positive, got {total}")
        if micro_step != self.next_micro:
            raise ProtocolError(f"micro-step {micro_step} started, expected {self.next_micro} (step {step})")
        if micro_step > 0 and total != self.total:
            raise ProtocolError(f"total_micro_steps changed from {self.total} to {total} within step {step}")
        if micro_step >= total:
            raise ProtocolError(f"micro-step {micro_step} out of range for {total} micro-steps")

    def start(self, micro_step: int, total: int) -> None:
        """Begin ``micro_step`` of ``total`` (after :meth:`check_start`)."""
        self.in_micro, self.micro, self.total = True, micro_step, total
        self.next_layer, self.fetched = self.num_layers - 1, None
        if micro_step == 0:
            self.nb_touched = set()

    def check_in_micro(self, what: str) -> None:
        if not self.in_micro:
            raise ProtocolError(f"{what} outside a micro-step (call start_micro_step first)")

    def check_layer(self, layer: Any) -> int:
        """``layer`` as an int in ``[0, num_layers)``; TypeError/ValueError otherwise."""
        n = integer("layer", layer)
        if not 0 <= n < self.num_layers:
            raise ValueError(f"layer {layer!r} outside [0, {self.num_layers})")
        return n

    def fetch(self, layer: int) -> None:
        """``block_full(layer)``: the next layer in order, none other outstanding."""
        self.check_in_micro(f"block_full({layer})")
        self.check_layer(layer)
        if self.fetched is not None:
            raise ProtocolError(f"block_full({layer}) while layer {self.fetched} is fetched and not notified")
        if layer != self.next_layer:
            raise ProtocolError(f"block_full({layer}) out of order: layers go from L-1 down to 0, expected "
                                f"{self.next_layer}")
        self.fetched = layer

    def notify(self, layer: int) -> None:
        """``notify_block(layer)`` of the fetched layer."""
        self.check_in_micro(f"notify_block({layer})")
        self.check_layer(layer)
        if self.fetched != layer:
            raise ProtocolError(f"notify_block({layer}) for a layer that was not fetched (fetched: {self.fetched})")
        self.fetched, self.next_layer = None, layer - 1

    def fetch_non_block(self, name: str, assume_touched: bool) -> bool:
        """``non_block_full(name)``; whether this is its first fetch in the step (``assume_touched``:
        a template starting mid-step, where earlier micro-steps produced it)."""
        if name in self.nb_open:
            raise ProtocolError(f"non_block_full({name!r}) again before notify_non_block({name!r})")
        first = name not in self.nb_touched and not assume_touched
        self.nb_open.add(name)
        self.nb_touched.add(name)
        return first

    def notify_non_block(self, name: str) -> None:
        if name not in self.nb_open:
            raise ProtocolError(f"notify_non_block({name!r}) without non_block_full({name!r})")
        self.nb_open.discard(name)

    def check_end(self) -> None:
        """``end_micro_step``: every fetched layer and non-block gradient was notified."""
        self.check_in_micro("end_micro_step")
        if self.fetched is not None:
            raise ProtocolError(f"end_micro_step with layer {self.fetched} not notified")
        if self.next_layer != -1:
            raise ProtocolError(f"end_micro_step with layers {self.next_layer}..0 not notified")
        if self.nb_open:
            raise ProtocolError(f"end_micro_step with non-block gradients not notified: {sorted(self.nb_open)}")

    def end(self) -> bool:
        """Close the micro-step (after :meth:`check_end` and the manager's work); whether it ended
        the step."""
        last = self.last
        self.in_micro = False
        if last:
            self.micro, self.complete = -1, True
        return last

    # ---- reads between steps ----------------------------------------------------------
    def check_between_steps(self, what: str, step: int) -> None:
        if self.in_micro or self.micro >= 0:
            raise ProtocolError(f"{what} during step {step} (micro-step {self.micro} of {self.total}); "
                                "shards are complete only after the last micro-step ends")

    def check_readable(self, what: str, step: int) -> None:
        """Shards and the norm hold a completed step: between steps, and a step has ended since
        the manager was created or its state loaded (before that the buffers are uninitialised)."""
        self.check_between_steps(what, step)
        if not self.complete:
            raise ProtocolError(f"{what} before any step completed (the manager is new or its state was just "
                                "loaded): shards are read after the last micro-step of a step ends")


@dataclass
class HostState:
    """A manager's host state, one object that the manager and its capture share: where the
    engine is in the protocol, the step, and the micro-steps of the step the statistics rows hold.
    A capture saves a copy and restores it; a replay advances it as the eager calls would."""

    protocol: MicroStepState
    step: int
    stats_m: int = 0

    def copy(self) -> HostState:
        return HostState(self.protocol.copy(), self.step, self.stats_m)

    def restore(self, saved: HostState) -> None:
        """Become ``saved`` (in place: the manager and its capture hold this object)."""
        self.protocol, self.step, self.stats_m = saved.protocol, saved.step, saved.stats_m
