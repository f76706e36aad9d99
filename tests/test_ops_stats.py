"""The gradient-statistics fronts of ``lowgrad.ops`` (``stats_sink``, ``bind_grad_stats``,
``bind_stats_finish``, ``bind_add_sr_multi(..., stats=)``) on the host backend: every bad argument
is refused with a clear exception, a corrected retry works,
NaN and Inf are counted, and a launch run twice writes the same row."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import lowgrad as lg
from lowgrad import ops
from lowgrad.sr.seedcounter import SeedCounter


@pytest.fixture
def dev() -> lg.HostDevice:
    return lg.HostDevice()


def rows(dev: lg.HostDevice, shape: tuple[int, ...] = (3, 4, 3)) -> lg.Tensor:
    out = dev.alloc(shape, lg.fp64, name="out")
    ops.fill_nan(out)
    return out


def test_stats_sink_refuses_what_cannot_hold_rows(dev: lg.HostDevice) -> None:
    bads: list[tuple[Any, type]] = [("rows", TypeError), (dev.alloc((3, 4, 3), lg.fp32, name="x"), TypeError),
                       (dev.alloc((3, 4), lg.fp64, name="x"), TypeError), (dev.alloc((3, 4, 2), lg.fp64, name="x"),
                                                                            TypeError)]
    for bad, error in bads:
        with pytest.raises(error, match="out"):
            ops.stats_sink(bad)
    with pytest.raises(ValueError, match="at least one row"):
        ops.stats_sink(dev.alloc((0, 4, 3), lg.fp64, name="x"), micro_steps=2)
    with pytest.raises(TypeError, match="SeedCounter"):
        ops.stats_sink(rows(dev), counter=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SeedCounter"):
        ops.stats_sink(rows(dev), counter=SeedCounter(lg.HostDevice(), 1, 0))  # another device's


def test_bad_grad_stats_arguments_are_refused_and_a_retry_works(dev: lg.HostDevice) -> None:
    out = rows(dev)
    sink = ops.stats_sink(out)
    xs = [lg.from_numpy(np.array([3.0, -4.0, np.nan, np.inf], np.float32), dev, name="x"),
          lg.from_numpy(np.array([1.0, 2.0], np.float32), dev, name="y")]
    bad: list[tuple[dict[str, Any], type, str]] = [
        (dict(tensors=[]), ValueError, "non-empty"),
        (dict(sink=out), TypeError, "stats_sink"),
        (dict(tensors=[xs[0], dev.alloc(2, lg.bf16, name="z")]), TypeError, "every tensor"),
        (dict(tensors=[xs[0], dev.alloc(2, lg.fp16, name="z")]), TypeError, "dtype"),
        (dict(columns=[0]), ValueError, "one column per tensor"),
        (dict(columns=[0, 4]), ValueError, "column 4 outside"),
        (dict(columns=[0, 1.0]), TypeError, "column"),
        (dict(row=3), ValueError, "row 3 outside"),
        (dict(row=True), TypeError, "row"),
        (dict(per_micro=1), TypeError, "per_micro"),
        (dict(per_micro=True), ValueError, "seed counter"),
    ]
    good: dict[str, Any] = dict(tensors=xs, sink=sink, columns=[2, 0], row=1, per_micro=False)
    for change, error, match in bad:
        with pytest.raises(error, match=match):
            ops.bind_grad_stats(**(good | change))
    run, finish = ops.bind_grad_stats(**good), ops.bind_stats_finish(sink)
    for _ in range(2):  # twice: the same row, the same values
        run(0)
        finish(0)
        got = out.numpy()
        assert np.isnan(got[1, 2, 0]) and got[1, 2, 1:].tolist() == [2.0, 4.0]  # NaN in the sum, 2 counted
        assert got[1, 0].tolist() == [5.0, 0.0, 2.0]
        assert np.isnan(got[0]).all() and np.isnan(got[2]).all() and np.isnan(got[1, [1, 3]]).all()


def test_bad_stats_target_of_the_multi_add_is_refused_before_binding(dev: lg.HostDevice) -> None:
    counter = SeedCounter(dev, 1, 0)
    out = rows(dev)
    sink = ops.stats_sink(out, counter)
    shard = lg.from_numpy(np.zeros(4, np.float32), dev, name="shard")
    grad = lg.from_numpy(np.array([1.0, 2.0, 3.0, 4.0], np.float32), dev, name="grad")
    items = [(shard, shard, grad, 0)]
    for stats, seeds, error, match in (
            ((out, [0]), (counter, 0, [0]), TypeError, "sink"),
            ((sink, [0]), [7], ValueError, "SeedCounter"),
            ((ops.stats_sink(out, SeedCounter(dev, 2, 0)), [0]), (counter, 0, [0]), ValueError, "SeedCounter"),
            ((sink, [5]), (counter, 0, [0]), ValueError, "column 5"),
            ((sink, [0, 1]), (counter, 0, [0]), ValueError, "one column per tensor")):
        with pytest.raises(error, match=match):
            ops.bind_add_sr_multi(items, seeds, stats=stats)  # type: ignore[arg-type]
    add = ops.bind_add_sr_multi(items, (counter, 0, [0]), stats=(sink, [3]))
    add(0)  # micro-step 0: the add runs, no statistics (its row is measured from micro-step 1 on)
    assert shard.numpy().tolist() == [1.0, 2.0, 3.0, 4.0] and np.isnan(out.numpy()).all()
    counter.next_micro(0)
    add(0)
    finish = ops.bind_stats_finish(sink)
    finish(0)  # the step is not complete: nothing to write yet
    assert np.isnan(out.numpy()).all()
    counter.next_step(0)
    finish(0)
    assert out.numpy()[1, 3].tolist() == [30.0, 0.0, 4.0]  # b of micro-step 1
    assert out.numpy()[0, 3].tolist() == [30.0, 0.0, 4.0]  # a at micro-step 1: micro-step 0's sum


def test_the_finish_writes_the_micro_steps_of_the_last_completed_step_only(dev: lg.HostDevice) -> None:
    """A step of 3 micro-steps, then one of 2 and one of 1: each finish writes the rows its step
    measured and leaves the others (a longer step's row 2 is not written again after a shorter
    one; a step of one micro-step runs no add); micro_steps bounds what a launch measures."""
    counter = SeedCounter(dev, 1, 0)
    out = rows(dev, (4, 1, 3))
    sink = ops.stats_sink(out, counter, micro_steps=3)
    shard = lg.from_numpy(np.zeros(2, np.float32), dev, name="shard")
    grad = lg.from_numpy(np.zeros(2, np.float32), dev, name="grad")
    add = ops.bind_add_sr_multi([(shard, shard, grad, 0)], (counter, 0, [0]), stats=(sink, [0]))
    finish = ops.bind_stats_finish(sink)
    for micro_steps, values in ((4, (1.0, 2.0, 3.0, 4.0)), (2, (5.0, 6.0)), (1, (7.0,))):
        ops.fill_nan(out)
        shard.numpy()[:] = values[0]
        for m in range(1, micro_steps):
            counter.next_micro(0)
            grad.numpy()[:] = values[m]
            add(0)
        counter.next_step(0)
        finish(0)
        sums = out.numpy()[:, 0, 0]
        want = [2 * v * v for v in values][:3] if micro_steps > 1 else []
        assert sums[:len(want)].tolist() == want and np.isnan(sums[len(want):]).all(), (micro_steps, sums)
    with pytest.raises(ValueError, match="micro_steps"):
        ops.stats_sink(out, counter, micro_steps=0)
    with pytest.raises(TypeError, match="micro_steps"):
        ops.stats_sink(out, counter, micro_steps=2.0)  # type: ignore[arg-type]


def test_bind_stats_finish_needs_a_sink(dev: lg.HostDevice) -> None:
    with pytest.raises(TypeError, match="stats_sink"):
        ops.bind_stats_finish(rows(dev))  # type: ignore[arg-type]
