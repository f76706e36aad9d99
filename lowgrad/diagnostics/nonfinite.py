"""Where a step's gradient first went non-finite: the parameter, the micro-step and the rank, as
one line for a log ("step 812 skipped: model.layers.17.mlp.down_proj.weight non-finite at
micro-step 3 on rank 5").

The counts come at up to three levels of a step, and the report takes the earliest level that has
one, because each later level inherits the earlier one's NaN from every rank:

- ``local``: each rank's own gradient before any exchange; it names the rank whose backward
  produced the value;
- ``micro``: the reduced gradient of each micro-step (a rank's shard of it): every rank sees a
  bad value there, so the rank only says which shard holds it;
- ``step``: the accumulated gradient at the end of the step (a rank's part of it).

Within a level, "first" is the smallest micro-step, then the lowest rank, then the layout order
of the tensors. Micro-steps count from 0.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import NDArray

Source = Literal["local", "micro", "step"]


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


@dataclass(frozen=True)
class NonFiniteReport:
    """The first non-finite value of a step. ``micro_step`` is None where the level does not tell
    micro-steps apart (the accumulated gradient; a local gradient accumulated over the whole
    step); ``count`` is how many values of that tensor were non-finite there; ``tensors`` and
    ``ranks`` how many tensors and ranks had any at that level (this one included); ``world`` the
    number of ranks (at world 1 the message names no rank)."""

    step: int
    parameter: str
    layer: int
    source: Source
    micro_step: int | None
    rank: int
    count: int
    tensors: int
    ranks: int
    world: int = 1

    def __str__(self) -> str:
        where = {
            "local": f"at micro-step {self.micro_step} on rank {self.rank}" if self.micro_step is not None
            else f"in rank {self.rank}'s local gradient",
            "micro": f"at micro-step {self.micro_step} after the exchange (rank {self.rank}'s shard)" if self.world > 1
            else f"at micro-step {self.micro_step}",
            "step": f"in the accumulated gradient (rank {self.rank}'s part)" if self.world > 1
            else "in the accumulated gradient",
        }[self.source]
        text = f"step {self.step} skipped: {self.parameter} non-finite {where}, {_count(self.count, 'value')}"
        others = []
        if self.tensors > 1:
            others.append(_count(self.tensors - 1, "other tensor"))
        if self.ranks > 1:
            others.append(_count(self.ranks - 1, "other rank"))
        return text + (f"; non-finite too: {' and '.join(others)}" if others else "")


def first_nonfinite(step: int, names: Sequence[str], layers: Sequence[int], micro_steps: int,
                    local: NDArray[np.int64] | None, micro: NDArray[np.int64] | None,
                    accumulated: NDArray[np.int64]) -> NonFiniteReport | None:
    """The report for the non-finite counts of one step (``local`` and ``micro`` [W, M, T] or
    None, ``accumulated`` [W, T]; a ``local`` of one column where ``micro_steps`` > 1 is
    accumulated over the step), or None when every count is zero. The arrays are checked by the
    caller (:class:`lowgrad.diagnostics.report.StepStats`)."""
    levels: list[tuple[Source, NDArray[np.int64], bool]] = []
    if local is not None:
        levels.append(("local", local, local.shape[1] == micro_steps))
    if micro is not None:
        levels.append(("micro", micro, True))
    levels.append(("step", accumulated[:, None, :], False))
    for source, counts, by_micro in levels:
        bad = np.argwhere(counts.transpose(1, 0, 2) > 0)  # rows (m, r, t) in the order "first" means
        if len(bad):
            m, r, t = (int(i) for i in bad[0])
            return NonFiniteReport(step, names[t], layers[t], source, m if by_micro else None, r,
                                   int(counts[r, m, t]), len(np.unique(bad[:, 2])), len(np.unique(bad[:, 1])),
                                   counts.shape[0])
    return None
