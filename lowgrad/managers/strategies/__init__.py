"""The strategies a gradient manager can use, one file each, registered here by one line each
(the interface they implement: :mod:`lowgrad.managers.strategy`)."""
from __future__ import annotations

from typing import Any

from lowgrad.managers.strategies.all_to_all import AllToAll
from lowgrad.managers.strategies.hierarchical import Hierarchical
from lowgrad.managers.strategies.scatter_reduce import ScatterReduce
from lowgrad.managers.strategies.unsharded import Unsharded
from lowgrad.managers.strategy import Strategy

STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (
    Unsharded,
    ScatterReduce,
    AllToAll,
    Hierarchical,
)}


def strategy_class(strategy: Any) -> type[Strategy]:
    """The strategy named ``strategy``: TypeError for a non-str, ValueError for an unknown name."""
    if not isinstance(strategy, str):  # a list or dict would fail the lookup as "unhashable"
        raise TypeError(f"strategy must be a str, one of {list(STRATEGIES)}; got {type(strategy).__name__} "
                        f"{strategy!r}")
    try:
        return STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {list(STRATEGIES)}") from None
