"""Properties of the SR reference (``lowgrad.sr.reference``): results are bf16 neighbours of the
exact float32 value, NaN/Inf propagate, fp32 output is exact, the noise depends only on seed and
global index, and reduce_sr is a float32 loop followed by one SR rounding.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from props import (
    BF,
    FAST,
    assert_sr_neighbour,
    bf16_arrays,
    bits,
    exact_f32,
    f32_arrays,
    offsets_st,
    scales_st,
    seeds_st,
    sizes_st,
    sr_arrays,
)

import lowgrad
from lowgrad.sr import reference as R


# ---- reference SR ------------------------------------------------------------------------------------
@FAST
@given(st.data(), sizes_st, scales_st, seeds_st)
def test_add_sr_bf16_is_a_neighbour_of_the_exact_value(data, n, scale, seed) -> None:
    a, b = data.draw(sr_arrays(n)), data.draw(sr_arrays(n))
    off = data.draw(offsets_st(n))
    r = R.add_sr(a, b, scale, seed, off)
    assert_sr_neighbour(exact_f32(a, b, scale), r)


@FAST
@given(st.data(), sizes_st, seeds_st)
def test_round_sr_neighbour_exact_nan_inf(data, n, seed) -> None:
    x = data.draw(f32_arrays(n, finite=False))
    off = data.draw(offsets_st(n))
    r = R.round_sr(x, seed, off, lowgrad.bf16)
    assert_sr_neighbour(x, r)
    xf = x.astype(np.float64)
    rf = r.astype(np.float64)
    assert np.array_equal(np.isnan(rf), np.isnan(xf))
    inf = np.isinf(xf)
    assert np.array_equal(rf[inf], xf[inf])
    # a bf16-representable float32 comes back bit for bit
    rep = x.astype(BF).astype(np.float32)
    keep = ~np.isnan(rep)
    assert np.array_equal(bits(R.round_sr(rep, seed, off, lowgrad.bf16).astype(np.float32))[keep], bits(rep)[keep])


@FAST
@given(st.data(), st.integers(1, 30), st.floats(2.0**-10, 2.0**10, width=32), seeds_st)
def test_add_sr_nan_and_inf_propagate(data, n, scale, seed) -> None:
    a = data.draw(sr_arrays(n))
    b = data.draw(sr_arrays(n))
    special = data.draw(hnp.arrays(np.float32, n, elements=st.sampled_from([np.nan, np.inf, -np.inf, 0.0])))
    mask = special != 0
    a = a.astype(np.float32)
    a[mask] = special[mask]
    off = data.draw(offsets_st(n))
    r = R.add_sr(a, b, scale, seed, off).astype(np.float64)
    assert np.isnan(r[np.isnan(a)]).all()
    pinf, ninf = a == np.inf, a == -np.inf
    assert (r[pinf] == np.inf).all() and (r[ninf] == -np.inf).all()
    assert_sr_neighbour(exact_f32(a, b, scale), R.add_sr(a, b, scale, seed, off))


@FAST
@given(st.data(), sizes_st, scales_st, seeds_st)
def test_add_sr_fp32_out_is_exact(data, n, scale, seed) -> None:
    a, b = data.draw(sr_arrays(n)), data.draw(sr_arrays(n))
    off = data.draw(offsets_st(n))
    r = R.add_sr(a, b, scale, seed, off, out_dtype=lowgrad.fp32)
    assert r.dtype == np.float32
    assert np.array_equal(bits(r), bits(exact_f32(a, b, scale)))


@FAST
@given(st.data(), st.integers(1, 40), scales_st, seeds_st)
def test_add_sr_depends_only_on_seed_and_global_index(data, n, scale, seed) -> None:
    a, b = data.draw(sr_arrays(n)), data.draw(sr_arrays(n))
    off = data.draw(offsets_st(n))
    k = data.draw(st.integers(0, n))
    full = R.add_sr(a, b, scale, seed, off)
    part = R.add_sr(a[k:], b[k:], scale, seed, off + k)
    assert np.array_equal(bits(part), bits(full[k:]))
    # round_sr too, and the same call twice is the same
    x = exact_f32(a, b, scale)
    assert np.array_equal(bits(R.round_sr(x[k:], seed, off + k, lowgrad.bf16)), bits(full[k:]))
    assert np.array_equal(bits(R.add_sr(a, b, scale, seed, off)), bits(full))


@FAST
@given(st.data(), st.integers(1, 20), st.integers(1, 4), seeds_st)
def test_reduce_sr_depends_only_on_global_index(data, m, n_shards, seed) -> None:
    dst = data.draw(sr_arrays(m))
    src = data.draw(hnp.arrays(dst.dtype, n_shards * m, elements=st.floats(-1e4, 1e4, width=32)))
    skip = data.draw(st.integers(-1, n_shards - 1))
    acc = data.draw(st.booleans())
    scale = data.draw(scales_st)
    off = data.draw(offsets_st(m))
    k = data.draw(st.integers(0, m))
    full = R.reduce_sr(dst, src, n_shards, skip, scale, acc, seed, off)
    part = R.reduce_sr(dst[k:], np.ascontiguousarray(src.reshape(n_shards, m)[:, k:]).reshape(-1), n_shards, skip,
                       scale, acc, seed, off + k)
    assert np.array_equal(bits(part), bits(full[k:]))


@FAST
@given(st.data(), sizes_st, seeds_st)
def test_reduce_sr_single_shard_skipped_is_identity(data, n, seed) -> None:
    dst = data.draw(bf16_arrays(n, finite=False))
    src = data.draw(bf16_arrays(n, finite=False))
    off = data.draw(offsets_st(n))
    r = R.reduce_sr(dst, src, 1, 0, 1.0, True, seed, off)
    assert r.dtype == BF
    nan = np.isnan(dst.astype(np.float32))
    assert np.isnan(r.astype(np.float32))[nan].all()
    assert np.array_equal(bits(r)[~nan], bits(dst)[~nan])
    # fp32 dst likewise
    d32 = dst.astype(np.float32)
    r32 = R.reduce_sr(d32, src.astype(np.float32), 1, 0, 1.0, True, seed, off)
    assert np.array_equal(bits(r32)[~nan], bits(d32)[~nan])


@FAST
@given(st.data(), st.integers(0, 20), st.integers(1, 5), seeds_st)
def test_reduce_sr_equals_a_float32_loop_then_round_sr(data, m, n_shards, seed) -> None:
    dst = data.draw(sr_arrays(m))
    src = data.draw(sr_arrays(n_shards * m))
    skip = data.draw(st.integers(-1, n_shards - 1))
    acc = data.draw(st.booleans())
    scale = data.draw(scales_st)
    off = data.draw(offsets_st(m))
    r = R.reduce_sr(dst, src, n_shards, skip, scale, acc, seed, off)
    want = np.empty(m, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(m):
            s = np.float32(dst[i]) if acc else np.float32(0.0)
            for k in range(n_shards):
                if k != skip:
                    s = np.float32(s + np.float32(src[k * m + i]))
            want[i] = np.float32(s * np.float32(scale))
    expect = R.round_sr(want, seed, off, dst.dtype)
    assert r.dtype == dst.dtype and r.shape == dst.shape
    assert np.array_equal(bits(r), bits(expect))
    if dst.dtype == BF:
        assert_sr_neighbour(want, r)
