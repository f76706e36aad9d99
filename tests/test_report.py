"""StepStats: its checks on construction, and what it reads from the arrays: per parameter, per
layer, for the whole model (arrays built by hand, as a manager would hand them over)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lowgrad.diagnostics.report import Stats, StepStats

NAMES = ["embed", "norm", "layers.0.q", "layers.0.k", "layers.1.q", "layers.1.k"]
LAYERS = [-1, -1, 0, 0, 1, 1]


def stats(shape: tuple[int, ...], sumsq: Any = 1.0, nonfinite: Any = 0, maxabs: Any = 0.5) -> Stats:
    return Stats(np.broadcast_to(np.asarray(sumsq, np.float64), shape).copy(),
                 np.broadcast_to(np.asarray(nonfinite, np.int64), shape).copy(),
                 np.broadcast_to(np.asarray(maxabs, np.float64), shape).copy())


def step_stats(world: int = 2, m: int = 3, **kw: Any) -> StepStats:
    T = len(NAMES)
    args: dict[str, Any] = dict(names=NAMES, layers=LAYERS, accumulated=stats((world, T)),
                                micro=stats((world, m, T)), local=stats((world, m, T)) if world > 1 else None,
                                micro_batch=4 * world, local_batch=4, step_batch=4 * world * m, step=7, rank=0,
                                world=world, micro_steps=m)
    return StepStats(**{**args, **kw})


def test_by_name_per_layer_and_global() -> None:
    W, M, T = 2, 3, len(NAMES)
    acc_sq = np.arange(W * T, dtype=np.float64).reshape(W, T)
    maxabs = np.arange(W * T, dtype=np.float64).reshape(W, T)[::-1].copy()
    nonfinite = np.zeros((W, T), np.int64)
    micro_sq = np.arange(W * M * T, dtype=np.float64).reshape(W, M, T)
    s = step_stats(accumulated=Stats(acc_sq, nonfinite, maxabs), micro=stats((W, M, T), micro_sq))
    by_name = s.tensors()
    assert list(by_name) == NAMES
    q1 = by_name["layers.1.q"]
    assert q1.layer == 1 and q1.norm == pytest.approx(np.sqrt(4 + 10)) and q1.maxabs == 10.0 and q1.nonfinite == 0
    assert q1.micro_norms == pytest.approx(tuple(np.sqrt(micro_sq[0, :, 4] + micro_sq[1, :, 4])))
    layers = s.layer_summaries()
    assert list(layers) == [-1, 0, 1]
    assert layers[0].norm == pytest.approx(np.sqrt(2 + 3 + 8 + 9)) and layers[0].maxabs == 9.0
    assert layers[-1].maxabs == 7.0
    total = s.summary()
    assert total.norm == pytest.approx(np.sqrt(acc_sq.sum())) and total.maxabs == 11.0 and total.nonfinite == 0
    assert total.noise is not None and total.noise_local is not None
    # the layers' squared norms add up to the whole model's
    assert sum(v.norm ** 2 for v in layers.values()) == pytest.approx(total.norm ** 2)


def test_nonfinite_counts_and_norms() -> None:
    W, T = 2, len(NAMES)
    acc = stats((W, T), nonfinite=np.array([[0, 0, 2, 0, 0, 0], [0, 0, 1, 0, 0, 0]]))
    acc.sumsq[1, 2] = np.nan
    s = step_stats(accumulated=acc)
    assert s.tensors()["layers.0.q"].nonfinite == 3 and np.isnan(s.tensors()["layers.0.q"].norm)
    assert s.layer_summaries()[1].nonfinite == 0 and np.isfinite(s.layer_summaries()[1].norm)
    total = s.summary()
    assert total.nonfinite == 3 and np.isnan(total.norm) and total.noise is None and total.noise_local is None


def test_world_1_unsharded_and_one_micro_step() -> None:
    s = step_stats(world=1, micro=None)
    assert s.tensors()["embed"].micro_norms is None and s.summary().noise is None
    one = step_stats(world=1, m=1)
    assert one.summary().noise is None  # one micro-step: nothing to compare
    assert one.tensors()["embed"].micro_norms == (1.0,)
    unsharded = step_stats(world=4, micro=None, local=stats((4, 1, len(NAMES))), local_batch=12, m=3)
    assert unsharded.summary().noise is None and unsharded.summary().noise_local is not None


@pytest.mark.parametrize("change,error,match", [
    (dict(names=NAMES[:-1]), ValueError, "6 layers"),
    (dict(names=[*NAMES[:-1], "embed"]), ValueError, "distinct"),
    (dict(names="embed"), TypeError, "names must be a list or tuple"),
    (dict(names=7), TypeError, "names must be a list or tuple .* got int 7"),
    (dict(names=[*NAMES[:-1], 5]), TypeError, r"names\[5\] must be a str"),
    (dict(layers=[0, -1, 0, 0, 1, 1]), ValueError, "layout order"),
    (dict(layers=[-2, -1, 0, 0, 1, 1]), ValueError, "layout order"),
    (dict(layers=[-1, -1, 0, 0, 1.0, 1]), TypeError, "a layer"),
    (dict(micro_steps=0), ValueError, "micro_steps"),
    (dict(micro_steps=True), TypeError, "micro_steps"),
    (dict(rank=2), ValueError, "rank"),
    (dict(step=-1), ValueError, "step"),
    (dict(accumulated=stats((2, 5))), ValueError, "accumulated has shape"),
    (dict(micro=stats((2, 2, 6))), ValueError, "micro has shape"),
    (dict(local=stats((2, 2, 6))), ValueError, "local has shape"),
    (dict(micro=np.zeros((2, 3, 6))), TypeError, "micro must be a Stats"),
    (dict(micro_batch=3), ValueError, "micro_steps 3 x micro_batch 3"),
    (dict(local_batch=3), ValueError, "local_batch 3"),
    (dict(world=1, rank=0, micro_batch=4, step_batch=12, accumulated=stats((1, 6)), micro=stats((1, 3, 6)),
          local=stats((1, 3, 6))), ValueError, "world > 1"),
])
def test_checks(change: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        step_stats(**change)


def test_stats_checks() -> None:
    ok = np.zeros((2, 3))
    with pytest.raises(TypeError, match="sumsq must be a numpy array of float64, got float32"):
        Stats(ok.astype(np.float32), ok.astype(np.int64), ok)
    with pytest.raises(TypeError, match="nonfinite must be a numpy array of int64, got list"):
        Stats(ok, [0], ok)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="differ in shape"):
        Stats(ok, ok.astype(np.int64), np.zeros(3))
    with pytest.raises(ValueError, match="negative"):
        Stats(ok - 1, ok.astype(np.int64), ok)
    with pytest.raises(ValueError, match="maxabs"):
        Stats(ok, ok.astype(np.int64), ok + np.inf)
    Stats(ok + np.nan, ok.astype(np.int64) + 1, ok)  # NaN sums of squares are what a non-finite value gives


def test_entries_not_measured_are_left_out_of_the_noise_scale() -> None:
    """A manager cannot measure the non-block tensors per micro-step (the engine accumulates
    them): those entries are -1/NaN, and the noise scale compares only the tensors measured at
    both batch sizes, the same whether or not the unmeasured column exists."""
    W, M, T = 2, 3, len(NAMES)
    rng = np.random.default_rng(0)
    micro = stats((W, M, T), sumsq=rng.uniform(1, 2, (W, M, T)))
    acc = stats((W, T), sumsq=rng.uniform(1, 2, (W, T)))
    full = StepStats(names=NAMES, layers=LAYERS, accumulated=acc, micro=micro, local=None, micro_batch=W,
                     local_batch=1, step_batch=M * W, step=0, rank=0, world=W, micro_steps=M)
    unmeasured = micro.sumsq.copy(), micro.nonfinite.copy(), micro.maxabs.copy()
    for a, v in zip(unmeasured, (np.nan, -1, np.nan)):
        a[..., 0] = v
    part = StepStats(names=NAMES, layers=LAYERS, accumulated=acc, micro=Stats(*unmeasured), local=None,
                     micro_batch=W, local_batch=1, step_batch=M * W, step=0, rank=0, world=W, micro_steps=M)
    layer = LAYERS[0]
    assert part.layer_summaries()[layer].noise != full.layer_summaries()[layer].noise or LAYERS.count(layer) == 1
    cols = list(range(1, T))
    sub = StepStats(names=[NAMES[t] for t in cols], layers=[LAYERS[t] for t in cols],
                    accumulated=Stats(acc.sumsq[:, cols], acc.nonfinite[:, cols], acc.maxabs[:, cols]),
                    micro=Stats(micro.sumsq[..., cols], micro.nonfinite[..., cols], micro.maxabs[..., cols]),
                    local=None, micro_batch=W, local_batch=1, step_batch=M * W, step=0, rank=0, world=W,
                    micro_steps=M)
    assert part.summary().noise == sub.summary().noise and part.summary().noise is not None
    assert part.first_nonfinite() is None
    bad = micro.sumsq.copy(), micro.nonfinite.copy(), micro.maxabs.copy()
    bad[1][0, 0, 0] = -1  # "not measured" but with values
    with pytest.raises(ValueError, match="not measured"):
        Stats(*bad)


def test_layer_summaries_equal_each_group_summed_alone() -> None:
    """The per-layer summaries, computed for every layer at once, against each layer's columns
    summed on their own (within float rounding: the sums run in another order), with entries
    not measured in the first group, inside a group and in a whole last group."""
    W, M = 2, 4
    names = [f"t{i}" for i in range(9)]
    layers = [-1, -1, 0, 0, 0, 1, 1, 2, 2]
    T = len(names)
    rng = np.random.default_rng(3)
    micro, local = stats((W, M, T), rng.uniform(1, 2, (W, M, T))), stats((W, M, T), rng.uniform(1, 2, (W, M, T)))
    acc = stats((W, T), rng.uniform(1, 2, (W, T)), rng.integers(0, 2, (W, T)), rng.uniform(0, 1, (W, T)))
    for s, cols in ((micro, [0, 1, 3, 7, 8]), (local, [0, 1, 4])):
        s.sumsq[..., cols], s.nonfinite[..., cols], s.maxabs[..., cols] = np.nan, -1, np.nan
    got = StepStats(names=names, layers=layers, accumulated=acc, micro=micro, local=local, micro_batch=W,
                    local_batch=1, step_batch=M * W, step=0, rank=0, world=W, micro_steps=M)
    summaries = got.layer_summaries()
    assert list(summaries) == [-1, 0, 1, 2]
    for layer, s in summaries.items():
        cols = [t for t in range(T) if layers[t] == layer]
        alone = StepStats(names=[names[t] for t in cols], layers=[0] * len(cols),
                          accumulated=Stats(acc.sumsq[:, cols], acc.nonfinite[:, cols], acc.maxabs[:, cols]),
                          micro=Stats(*(a[..., cols] for a in (micro.sumsq, micro.nonfinite, micro.maxabs))),
                          local=Stats(*(a[..., cols] for a in (local.sumsq, local.nonfinite, local.maxabs))),
                          micro_batch=W, local_batch=1, step_batch=M * W, step=0, rank=0, world=W,
                          micro_steps=M).summary()
        assert (s.nonfinite, s.maxabs) == (alone.nonfinite, alone.maxabs), layer
        assert s.norm == pytest.approx(alone.norm, rel=1e-14), layer
        for ours, theirs in ((s.noise, alone.noise), (s.noise_local, alone.noise_local)):
            assert (ours is None) == (theirs is None), layer
            if ours is not None and theirs is not None:
                assert (ours.g2, ours.trace) == pytest.approx((theirs.g2, theirs.trace), rel=1e-12), layer
    assert summaries[-1].noise is None and summaries[2].noise is None and summaries[0].noise is not None
    assert summaries[-1].noise_local is None and summaries[1].noise_local is not None
