"""The saved state of a gradient manager: what a restart needs for bit-identical gradients."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lowgrad import ops
from lowgrad.base.integers import integer
from lowgrad.managers.protocol import check_step
from lowgrad.managers.strategies import strategy_class
from lowgrad.sr.seedcounter import check_rounding

#: the version :meth:`GradientManager.state_dict` writes (a state without one is version 1)
STATE_VERSION = 1
_KEYS = frozenset({"version", "strategy", "base_seed", "step", "rank", "world", "rounding"})
# a state saved before rounding modes existed has no "rounding": it rounded with SR if its strategy
# rounds at all (the registry says); a strategy that rounds nothing writes none either (as_dict)
_OPTIONAL = frozenset({"version", "rounding"})
_LEGACY_ROUNDING = "sr"


@dataclass(frozen=True)
class ManagerState:
    """Base seed and step of a manager of ``strategy`` at ``rank`` of ``world`` that rounds with
    ``rounding`` (None: the manager rounds nothing itself), between steps."""

    strategy: str
    base_seed: int
    step: int
    rank: int
    world: int
    rounding: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The plain dict :meth:`GradientManager.state_dict` returns (with ``version``)."""
        d = {"version": STATE_VERSION, **asdict(self)}
        if d["rounding"] is None:  # a strategy that rounds nothing: nothing to restore
            del d["rounding"]
        return d

    @classmethod
    def parse(cls, state: Any) -> ManagerState:
        """A valid state from a :meth:`as_dict` mapping: TypeError for a non-mapping or a value of
        the wrong type, ValueError for missing or unknown keys, an unknown version or a value out
        of range."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping from state_dict(), got {type(state).__name__}")
        keys = set(state)
        missing, unknown = _KEYS - _OPTIONAL - keys, keys - _KEYS
        if missing or unknown:
            raise ValueError(f"state keys: missing {sorted(missing)}, unknown {sorted(map(repr, unknown))}")
        version = state.get("version", STATE_VERSION)
        if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)) \
                or version != STATE_VERSION:
            raise ValueError(f"state version {version!r} is not supported (this lowgrad reads version {STATE_VERSION})")
        if not isinstance(state["strategy"], str):
            raise TypeError(f"state strategy must be a str, got {type(state['strategy']).__name__}")
        world, rank = integer("state world", state["world"]), integer("state rank", state["rank"])
        base_seed = integer("state base_seed", state["base_seed"])
        ops.check_seed(base_seed)
        step = check_step("state step", state["step"])
        rounding = state["rounding"] if "rounding" in state else _rounding_of(state["strategy"])
        if rounding is not None:
            check_rounding(rounding)
        return cls(state["strategy"], base_seed, step, rank, world, rounding)

    def check_fits(self, strategy: str, rank: int, world: int, rounding: str | None) -> None:
        """ValueError unless the state was saved by a manager of this strategy, rank, world and
        rounding."""
        for key, value, mine in (("strategy", self.strategy, strategy), ("world", self.world, world),
                                 ("rank", self.rank, rank), ("rounding", self.rounding, rounding)):
            if value != mine:
                raise ValueError(f"state {key} {value!r} does not match this manager's {mine!r}")

    def portable(self) -> dict[str, Any]:
        """The state without ``rank`` and ``world``: what a checkpoint keeps, the same on every
        rank, loadable at any world (:meth:`at`)."""
        d = self.as_dict()
        del d["rank"], d["world"]
        return d

    @classmethod
    def at(cls, portable: Any, rank: int, world: int) -> ManagerState:
        """A :meth:`portable` state (or a whole :meth:`as_dict`) checked and placed at ``rank`` of
        ``world``: the same base seed and step, so the SR noise that follows is that of a run
        started at this world from the same state."""
        if not isinstance(portable, Mapping):
            raise TypeError(f"state must be a mapping from state_dict(), got {type(portable).__name__}")
        return cls.parse({**portable, "rank": rank, "world": world})


def _rounding_of(strategy: str) -> str | None:
    """The rounding of a saved state without one: None where the strategy rounds nothing, else SR
    (what every rounding strategy did before rounding modes); ValueError for a strategy this
    lowgrad does not have (what it rounded is unknown)."""
    return _LEGACY_ROUNDING if strategy_class(strategy).rounds() else None


def resume_state(portable: Any, manager: Any) -> ManagerState:
    """A :meth:`ManagerState.portable` state (a checkpoint's) checked for ``manager`` (the same
    strategy and rounding; any world) and placed at its rank and world: TypeError or ValueError
    as :meth:`ManagerState.parse` and :meth:`ManagerState.check_fits` say."""
    saved = ManagerState.at(portable, manager.rank, manager.world)
    saved.check_fits(manager.strategy, manager.rank, manager.world, manager.rounding)
    return saved
