"""first_nonfinite: which level, micro-step, rank and tensor a step's first non-finite value is
reported at, at world 1, 2 and 4, and the one line it prints."""
from __future__ import annotations

import numpy as np
import pytest

from lowgrad.diagnostics.nonfinite import NonFiniteReport
from lowgrad.diagnostics.report import Stats, StepStats

NAMES = ["embed", "model.layers.0.q", "model.layers.0.k", "model.layers.1.q"]
LAYERS = [-1, 0, 0, 1]
T = len(NAMES)


def _stats(counts: np.ndarray) -> Stats:
    sumsq = np.where(counts > 0, np.nan, 1.0)
    return Stats(sumsq, counts.astype(np.int64), np.zeros(counts.shape))


def _step(world: int, m: int, bad: dict[str, list[tuple[int, ...]]], local_columns: int | None = None,
          micro: bool = True) -> StepStats:
    """A step whose ``bad`` maps a level to the (rank, [micro-step,] tensor) cells with one non-finite value."""
    cols = m if local_columns is None else local_columns
    shapes = {"local": (world, cols, T), "micro": (world, m, T), "step": (world, T)}
    counts = {k: np.zeros(v, np.int64) for k, v in shapes.items()}
    for level, cells in bad.items():
        for cell in cells:
            counts[level][cell] += 1
    return StepStats(names=NAMES, layers=LAYERS, accumulated=_stats(counts["step"]),
                     micro=_stats(counts["micro"]) if micro else None,
                     local=_stats(counts["local"]) if world > 1 else None,
                     micro_batch=2 * world, local_batch=2 * m // cols, step_batch=2 * world * m, step=812, rank=0,
                     world=world, micro_steps=m)


def test_clean_step_has_no_report() -> None:
    for world in (1, 2, 4):
        assert _step(world, 3, {}).first_nonfinite() is None


@pytest.mark.parametrize("world", [2, 4])
def test_local_names_the_rank_and_the_earliest_micro_step(world: int) -> None:
    r = world - 1
    s = _step(world, 4, {"local": [(r, 3, 0), (r, 2, 3), (r, 2, 3), (1, 3, 1)],  # earliest m=2 wins over rank 1
                         "micro": [(0, 0, 0)],  # reduced: later level, ignored while local has one
                         "step": [(0, 1)]})
    rep = s.first_nonfinite()
    assert rep == NonFiniteReport(step=812, parameter="model.layers.1.q", layer=1, source="local", micro_step=2,
                                  rank=r, count=2, tensors=3, ranks=2 if r != 1 else 1, world=world)
    assert str(rep).startswith(f"step 812 skipped: model.layers.1.q non-finite at micro-step 2 on rank {r}, 2 values")


def test_order_within_a_level_is_micro_step_then_rank_then_layout() -> None:
    s = _step(4, 2, {"local": [(3, 0, 2), (2, 0, 3), (2, 0, 1), (0, 1, 0)]})
    rep = s.first_nonfinite()
    assert rep is not None and (rep.micro_step, rep.rank, rep.parameter) == (0, 2, "model.layers.0.q")
    assert (rep.tensors, rep.ranks) == (4, 3)
    assert str(rep).endswith("; non-finite too: 3 other tensors and 2 other ranks")


def test_micro_then_step_when_earlier_levels_are_clean() -> None:
    micro = _step(2, 3, {"micro": [(1, 1, 2)], "step": [(0, 0)]}).first_nonfinite()
    assert micro is not None and (micro.source, micro.micro_step, micro.rank) == ("micro", 1, 1)
    assert str(micro) == ("step 812 skipped: model.layers.0.k non-finite at micro-step 1 after the exchange "
                          "(rank 1's shard), 1 value")
    alone = _step(1, 3, {"micro": [(0, 1, 2)], "step": [(0, 0)]}).first_nonfinite()  # world 1: no exchange, no rank
    assert str(alone) == "step 812 skipped: model.layers.0.k non-finite at micro-step 1, 1 value"
    acc = _step(1, 3, {"step": [(0, 2)]}, micro=False).first_nonfinite()
    assert str(acc) == "step 812 skipped: model.layers.0.k non-finite in the accumulated gradient, 1 value"
    step = _step(2, 3, {"step": [(1, 3), (0, 3)]}, micro=False).first_nonfinite()
    assert step is not None and (step.source, step.micro_step, step.rank, step.ranks) == ("step", None, 0, 2)
    assert str(step) == ("step 812 skipped: model.layers.1.q non-finite in the accumulated gradient (rank 0's part), "
                         "1 value; non-finite too: 1 other rank")


def test_local_accumulated_over_the_step_has_no_micro_step() -> None:
    """The unsharded strategy: each rank's local gradient accumulated over the step, no micro level."""
    rep = _step(2, 4, {"local": [(1, 0, 0)], "step": [(0, 0)]}, local_columns=1, micro=False).first_nonfinite()
    assert rep is not None and (rep.source, rep.micro_step, rep.rank) == ("local", None, 1)
    assert str(rep) == "step 812 skipped: embed non-finite in rank 1's local gradient, 1 value"
    one = _step(2, 1, {"local": [(1, 0, 0)]}, local_columns=1, micro=False).first_nonfinite()
    assert one is not None and one.micro_step == 0  # one micro-step: the column is that micro-step
