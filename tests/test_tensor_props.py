"""Tensors: ``shard_view`` is the rank-th slice and refuses bad worlds, ranks and non-tensors.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from props import BAD, FEW, MEDIUM, host, not_tensors, put

import lowgrad


@MEDIUM
@given(st.integers(1, 12), st.integers(1, 5), st.data())
def test_shard_view_rejects_bad_world_and_rank(rows, world, data) -> None:
    dev = host()
    t = dev.alloc((rows, 3), lowgrad.fp32, kind="host", name="x")
    what = data.draw(st.sampled_from(["indivisible", "rank", "world"]))
    if what == "indivisible":
        w = data.draw(st.integers(2, 13).filter(lambda w: rows % w))
        r = data.draw(st.integers(0, w - 1))
        with pytest.raises(ValueError) as ei:
            lowgrad.shard_view(t, r, w)
        assert "x" in str(ei.value) and str(w) in str(ei.value)
        return
    if what == "rank":
        r = data.draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=world), st.floats(), st.none(),
                                st.text(max_size=2)))
        w = world
    else:
        w = data.draw(st.one_of(st.integers(max_value=0), st.floats(), st.none(), st.text(max_size=2)))
        r = 0
    with pytest.raises(BAD):
        lowgrad.shard_view(t, r, w)


@MEDIUM
@given(st.integers(1, 4).flatmap(lambda w: st.tuples(st.just(w), st.integers(0, w - 1), st.integers(0, 3))))
def test_shard_view_valid_is_the_rank_th_slice(args) -> None:
    world, rank, per = args
    dev = host()
    arr = np.arange(world * per * 2, dtype=np.float32).reshape(world * per, 2)
    t = put(dev, arr)
    v = lowgrad.shard_view(t, rank, world)
    assert v.shape == (per, 2)
    assert np.array_equal(v.numpy(), arr[rank * per:(rank + 1) * per])
    scalar = dev.alloc((), lowgrad.fp32, kind="host")  # a 0-d tensor is its own one slice, at world 1 only
    assert lowgrad.shard_view(scalar, 0, 1) is scalar
    with pytest.raises(ValueError, match="0-d"):
        lowgrad.shard_view(scalar, 0, 2)


@FEW
@given(st.one_of(not_tensors, st.booleans()))
def test_shard_view_rejects_non_tensors_and_bools(bad) -> None:
    dev = host()
    t = dev.alloc((4,), lowgrad.fp32, kind="host", name="x")
    if isinstance(bad, bool):
        with pytest.raises(BAD):
            lowgrad.shard_view(t, 0, bad)
    else:
        with pytest.raises(BAD):
            lowgrad.shard_view(bad, 0, 1)
