"""``ops.scale_sr`` (``dst = SR(a * scale)``) on the host backend: valid calls equal the numpy
reference bit for bit, aliasing ``a`` exactly included; every bad argument is refused before
anything is written (property-based, hypothesis)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from props import (
    alloc_filled,
    bad_offsets,
    bad_scales,
    bad_seeds,
    bits,
    host,
    non_sr_dtypes,
    not_tensors,
    offsets_st,
    put,
    rejects,
    scales_st,
    seeds_st,
    sr_arrays,
    sr_dtypes,
)

import lowgrad
from lowgrad import ops
from lowgrad.sr import reference as R


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(0, 33), sr_dtypes, sr_dtypes, scales_st, seeds_st, st.booleans())
def test_scale_sr_host_equals_reference(data, n, dd, ad, scale, seed, alias) -> None:
    dev = host()
    a_np = data.draw(sr_arrays(n, finite=data.draw(st.booleans()))).astype(ad.np)
    off = data.draw(offsets_st(n))
    a = put(dev, a_np, "a")
    dst = a if alias else dev.alloc((n,), dd, kind=data.draw(st.sampled_from(["host", "pinned", "device"])),
                                    name="dst")
    want = R.scale_sr(a_np, scale, seed, off, out_dtype=dst.dtype)
    ops.scale_sr(dst, a, scale=scale, seed=seed, index_offset=off)
    assert np.array_equal(bits(dst.numpy()), bits(want))
    if not alias:
        assert np.array_equal(bits(a.numpy()), bits(a_np))  # a untouched


@st.composite
def bad_scale_sr_call(draw):
    dev = host()
    fault = draw(st.sampled_from(["size", "dtype", "seed", "offset", "scale", "partial_a", "alias_dtype", "device",
                                  "not_tensor", "stream"]))
    n = draw(st.integers(2, 16))
    dts = [draw(sr_dtypes), draw(sr_dtypes)]
    kw: dict = {}  # the defaults: scale 1.0, seed 0, index_offset 0
    sizes = [n, n]
    if fault == "size":
        sizes[draw(st.integers(0, 1))] = draw(st.integers(0, 20).filter(lambda v: v != n))
    if fault == "dtype":
        dts[draw(st.integers(0, 1))] = draw(non_sr_dtypes)
    dst, a = (alloc_filled(dev, s, d, nm) for s, d, nm in zip(sizes, dts, "da"))
    if fault == "seed":
        kw["seed"] = draw(bad_seeds)
    if fault == "offset":
        kw["index_offset"] = draw(bad_offsets)
    if fault == "scale":
        kw["scale"] = draw(bad_scales)
    if fault == "partial_a":
        big = alloc_filled(dev, 2 * n, dts[0], "big")
        s = draw(st.integers(1, n - 1))
        dst, a = big[:n], big[s:s + n]
    if fault == "alias_dtype":  # the same first bytes read as another dtype: not an exact alias
        both = alloc_filled(dev, 2 * n, lowgrad.bf16, "both")
        dst, a = (both[:n], both.bitcast(lowgrad.fp32)[:n]) if draw(st.booleans()) else \
            (both.bitcast(lowgrad.fp32)[:n], both[:n])
    if fault == "device":
        a = alloc_filled(host(), n, dts[1], "other")
    if fault == "not_tensor":
        bad = draw(not_tensors)
        dst, a = (bad, a) if draw(st.booleans()) else (dst, bad)
    if fault == "stream":
        kw["stream"] = draw(st.one_of(st.integers(max_value=-1), st.text(max_size=3), st.floats()))
    return fault, dst, a, kw


@settings(max_examples=120, deadline=None)
@given(bad_scale_sr_call())
def test_scale_sr_rejects_bad_arguments(call) -> None:
    fault, dst, a, kw = call
    rejects(lambda: ops.scale_sr(dst, a, **kw), dst)
