"""The shared device surface (``DeviceBase.alloc``) on the host backend: bad shapes, dtypes,
kinds and names raise before anything is allocated.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from props import BAD, FEW, MEDIUM, bad_dtype_names, host

import lowgrad

bad_dims = st.one_of(st.integers(max_value=-1), st.floats(), st.text(max_size=2), st.none(), st.booleans(),
                     st.just(np.float32(2.0)), st.lists(st.integers(0, 3), max_size=2))


@MEDIUM
@given(st.lists(st.integers(0, 4), max_size=3), st.data())
def test_device_alloc_rejects_bad_shapes_dtypes_kinds(shape, data) -> None:
    dev = host()
    what = data.draw(st.sampled_from(["dim", "shape", "dtype", "kind", "name"]))
    args = dict(shape=tuple(shape), dtype=lowgrad.fp32, kind="host", name="x")
    if what == "dim":
        bad = data.draw(bad_dims)
        i = data.draw(st.integers(0, len(shape)))
        args["shape"] = tuple(shape[:i]) + (bad,) + tuple(shape[i:])
    elif what == "shape":
        args["shape"] = data.draw(st.one_of(st.none(), st.floats(), st.integers(max_value=-1), st.booleans(),
                                            st.text(min_size=1, max_size=3)))
    elif what == "dtype":
        args["dtype"] = data.draw(st.one_of(bad_dtype_names, st.integers(), st.just(np.int32), st.just(complex)))
    elif what == "kind":
        args["kind"] = data.draw(st.one_of(st.text(max_size=8).filter(
            lambda s: s not in ("device", "pinned", "write_combined", "host")), st.none(), st.integers()))
    else:
        args["name"] = data.draw(st.one_of(st.just(""), st.none(), st.integers(), st.binary(max_size=2)))
    with pytest.raises(BAD):
        dev.alloc(args["shape"], args["dtype"], kind=args["kind"], name=args["name"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@FEW
@given(st.lists(st.integers(0, 4), max_size=2), st.integers(10**155, 10**400))
def test_device_alloc_huge_dims_raise_value_error(shape, huge) -> None:
    dev = host()
    with pytest.raises(BAD):
        dev.alloc(tuple(shape) + (huge, huge), lowgrad.fp32, kind="host", name="x")


def test_device_alloc_rejects_none_dtype() -> None:
    with pytest.raises(BAD):
        host().alloc((2,), None, kind="host", name="x")
