"""The ``stream=`` rule (``lowgrad.stream_handle``): what is accepted, what is refused, and that
kernels refuse a bad stream before touching their destination.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from props import BAD, FEW, MEDIUM, U64, alloc_filled, host, rejects

import lowgrad
from lowgrad import ops

non_streams = st.one_of(st.text(), st.floats(), st.binary(max_size=4), st.booleans(), st.complex_numbers(),
                        st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(),
                                                                              max_size=2),
                        st.from_type(object).filter(lambda x: x is not None and type(x) is not int),
                        st.from_type(type), st.just(np.int64(3)), st.just(object()))


@settings(max_examples=80, deadline=None)
@given(non_streams)
def test_stream_handle_rejects_non_streams(s) -> None:
    assume(getattr(s, "handle", None) is None and getattr(s, "cuda_stream", None) is None
           and not hasattr(s, "__cuda_stream__"))
    with pytest.raises(BAD):
        lowgrad.stream_handle(s)
    dev = host()
    t = alloc_filled(dev, 2, lowgrad.bf16)
    rejects(lambda: ops.add_sr(t, t, alloc_filled(dev, 2, lowgrad.bf16, "b"), stream=s), t)
    rejects(lambda: ops.fill_zero(t, stream=s), t)


@MEDIUM
@given(st.integers(0, 2**63))
def test_stream_handle_accepts_stream_likes(h) -> None:
    class CuPyLike:
        def __cuda_stream__(self):
            return (0, h)

    class TorchLike:
        cuda_stream = h

    assert lowgrad.stream_handle(h) == h
    assert lowgrad.stream_handle(CuPyLike()) == h
    assert lowgrad.stream_handle(TorchLike()) == h
    assert lowgrad.stream_handle(None) == 0
    assert lowgrad.stream_handle(host().default_stream) == 0
    with pytest.raises(ValueError):
        lowgrad.stream_handle(-1 - h)


class _Proto:
    def __init__(self, v):
        self.v = v

    def __cuda_stream__(self):
        return self.v


class _Attr:
    def __init__(self, v):
        self.cuda_stream = v


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.integers(max_value=-1).map(_Attr),
                 st.one_of(st.integers(max_value=-1), st.floats(), st.just(()), st.just((0,)),
                           st.tuples(st.integers(0, 2), st.integers(max_value=-1)), st.text(max_size=2),
                           st.none()).map(_Proto)))
def test_stream_handle_rejects_malformed_stream_likes(s) -> None:
    try:
        h = lowgrad.stream_handle(s)
    except BAD:
        return
    assert type(h) is int and 0 <= h < U64, h


@FEW
@given(st.integers(min_value=U64))
def test_stream_handle_rejects_huge_int(h) -> None:
    with pytest.raises(ValueError):
        lowgrad.stream_handle(h)
