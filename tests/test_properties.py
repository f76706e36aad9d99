"""Property-based tests (hypothesis) of the SR reference, Philox, the host backend's kernels and the
argument checks of the public calls. Host only: no GPU is touched.

Every argument-checking property asserts that a bad call raises TypeError or ValueError (nothing
else, never silent success) and, where a destination exists, that it is left untouched.
"""
from __future__ import annotations

import math
import os
import tempfile

import hypothesis.configuration
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lowgrad
from lowgrad import ops
from lowgrad.managers.layout import PRESETS
from lowgrad.sr import reference as R
from lowgrad.sr import seeds
from lowgrad.sr.philox import philox4x32_10, sr_noise

BF = ml_dtypes.bfloat16
U64 = 1 << 64
BAD = (TypeError, ValueError)

# no example database, and hypothesis' caches outside the checkout: the suite writes nothing there
hypothesis.configuration.set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "lowgrad-hypothesis"))
settings.register_profile("lowgrad-properties", database=None, deadline=None)
settings.load_profile("lowgrad-properties")

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MEDIUM = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- strategies ------------------------------------------------------------------------------------
seeds_st = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**32 - 1, 2**32, 2**64 - 1]))
scales_st = st.one_of(st.floats(-4.0, 4.0, allow_nan=False, width=32),
                      st.floats(allow_nan=False, allow_infinity=False, width=32),
                      st.sampled_from([1.0, -1.0, 0.0, -0.0, 0.5, 1 / 3]))
sizes_st = st.integers(0, 40)


def offsets_st(n: int) -> st.SearchStrategy[int]:
    hi = min(U64 - n, U64 - 1)  # ops take index_offset < 2**64 even for empty tensors
    return st.one_of(st.integers(0, 100), st.integers(0, hi),
                     st.sampled_from([0, 7, 8, (1 << 35) - 3, hi]).map(lambda v: min(v, hi)))


def f32_arrays(n: int, finite: bool = True) -> st.SearchStrategy[np.ndarray]:
    els = st.floats(width=32, allow_nan=not finite, allow_infinity=not finite)
    return hnp.arrays(np.float32, n, elements=els)


def bf16_arrays(n: int, finite: bool = True) -> st.SearchStrategy[np.ndarray]:
    """bf16 from arbitrary bit patterns (subnormals, +-0, extremes), NaN/Inf excluded if finite."""
    def ok(b: int) -> bool:
        return not finite or (b & 0x7F80) != 0x7F80
    return hnp.arrays(np.uint16, n, elements=st.integers(0, 0xFFFF).filter(ok)).map(lambda u: u.view(BF))


def sr_arrays(n: int, finite: bool = True) -> st.SearchStrategy[np.ndarray]:
    return st.one_of(f32_arrays(n, finite), bf16_arrays(n, finite))


def bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64, 1: np.uint8}[x.dtype.itemsize])


def exact_f32(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return (a.astype(np.float32) + b.astype(np.float32)) * np.float32(scale)


def assert_sr_neighbour(x: np.ndarray, r: np.ndarray) -> None:
    """bf16 ``r`` is one of the two bf16 neighbours of float32 ``x`` (exact if representable)."""
    assert r.dtype == BF and r.shape == x.shape
    u = bits(x.astype(np.float32)).reshape(-1)
    rb = bits(r).reshape(-1).astype(np.uint32)
    nan = np.isnan(x.reshape(-1))
    assert np.isnan(r.reshape(-1).astype(np.float32))[nan].all()
    trunc = u >> np.uint32(16)
    exact = (u & np.uint32(0xFFFF)) == 0
    ok = np.where(exact, rb == trunc, (rb == trunc) | (rb == trunc + np.uint32(1)))
    assert ok[~nan].all(), (x.reshape(-1)[~ok & ~nan], r.reshape(-1)[~ok & ~nan])
    # in value terms: the result lies between the float32 value's bf16 neighbours, same sign
    xv, rv = x.reshape(-1)[~nan].astype(np.float64), r.reshape(-1)[~nan].astype(np.float64)
    with np.errstate(invalid="ignore"):
        assert (np.signbit(xv) == np.signbit(rv)).all()
        lo = trunc[~nan].astype(np.uint16).view(BF).astype(np.float64)
        assert (np.abs(rv) >= np.abs(lo)).all()


def host() -> lowgrad.HostDevice:
    return lowgrad.HostDevice()


def put(dev: lowgrad.HostDevice, arr: np.ndarray, name: str = "t") -> lowgrad.Tensor:
    return lowgrad.from_numpy(arr, dev, kind="host", name=name)


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


# ---- Philox ------------------------------------------------------------------------------------------
u32 = st.integers(0, 2**32 - 1)


@FAST
@given(st.data(), hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3))
def test_philox_broadcasting(data, shapes) -> None:
    (s1, s2), out_shape = shapes
    c = data.draw(hnp.arrays(np.uint32, s1 + (4,), elements=u32))
    k = data.draw(hnp.arrays(np.uint32, s2 + (2,), elements=u32))
    w = philox4x32_10(c, k)
    assert w.dtype == np.uint32 and w.shape == out_shape + (4,)
    cb = np.broadcast_to(c, out_shape + (4,)).reshape(-1, 4)
    kb = np.broadcast_to(k, out_shape + (2,)).reshape(-1, 2)
    flat = w.reshape(-1, 4)
    for i in range(cb.shape[0]):  # each element is the generator of its own (counter, key)
        assert np.array_equal(philox4x32_10(cb[i], kb[i]), flat[i])
        assert np.array_equal(philox4x32_10(cb[i].tolist(), kb[i].tolist()), flat[i])


@FAST
@given(hnp.array_shapes(min_dims=1, max_dims=2, max_side=3), hnp.array_shapes(min_dims=1, max_dims=2, max_side=3))
def test_philox_incompatible_shapes_raise(s1, s2) -> None:
    try:
        np.broadcast_shapes(s1, s2)
        compatible = True
    except ValueError:
        compatible = False
    assume(not compatible)
    with pytest.raises(ValueError):
        philox4x32_10(np.zeros(s1 + (4,), np.uint32), np.zeros(s2 + (2,), np.uint32))


@FAST
@given(st.one_of(st.integers(0, 6).filter(lambda w: w != 4), st.just(None)),
       st.one_of(st.integers(0, 6).filter(lambda w: w != 2), st.just(None)))
def test_philox_bad_widths_or_types_raise(cw, kw) -> None:
    c = np.zeros((3, 4 if cw is None else cw), np.uint32)
    k = np.zeros((3, 2 if kw is None else kw), np.uint32)
    if cw is None and kw is None:
        with pytest.raises(BAD):
            philox4x32_10(c.astype(np.float32), k)
        with pytest.raises(BAD):
            philox4x32_10(c, np.full((2,), -1))
        with pytest.raises(BAD):
            philox4x32_10(np.full((4,), 2**32), k)
        return
    with pytest.raises(BAD):
        philox4x32_10(c, k)


@FAST
@given(st.lists(u32, min_size=4, max_size=4), st.lists(u32, min_size=2, max_size=2), st.integers(1, 5))
def test_philox_same_input_same_output(c, k, reps) -> None:
    w = philox4x32_10(np.array(c, np.uint32), np.array(k, np.uint32))
    batch = philox4x32_10(np.array([c] * reps, np.uint32), np.array(k, np.uint32))
    assert w.shape == (4,)
    assert (batch == w).all()
    assert np.array_equal(philox4x32_10(np.array(c, np.uint64), np.array(k, np.int64)), w)


@FAST
@given(seeds_st, st.integers(0, 200), st.integers(0, 100))
def test_sr_noise_slices(seed, start, n) -> None:
    full = sr_noise(seed, 0, start + n)
    part = sr_noise(seed, start, n)
    assert part.dtype == np.uint16 and part.shape == (n,)
    assert np.array_equal(part, full[start:])
    cut = start + n // 2
    assert np.array_equal(np.concatenate([sr_noise(seed, start, cut - start), sr_noise(seed, cut, start + n - cut)]),
                          part)


@FAST
@given(seeds_st, st.integers(0, U64 - 64), st.integers(0, 40), st.integers(0, 20))
def test_sr_noise_slices_high_offsets(seed, start, n, k) -> None:
    assume(k <= n)
    full = sr_noise(seed, start, n)
    assert np.array_equal(sr_noise(seed, start + k, n - k), full[k:])
    # the definition: element i uses half (i % 8) of Philox(counter=(g lo, g hi, 0, 0)), g = i // 8
    for j, i in enumerate(range(start, start + min(n, 3))):
        g = i // 8
        w = philox4x32_10(np.array([g & 0xFFFFFFFF, g >> 32, 0, 0], np.uint32),
                          np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32))
        half = (int(w[(i % 8) // 2]) >> (16 * (i % 2))) & 0xFFFF
        assert int(full[j]) == half


# ---- argument checking ----------------------------------------------------------------------------
bad_seeds = st.one_of(st.integers(max_value=-1), st.integers(min_value=U64), st.floats(), st.booleans(),
                      st.none(), st.text(max_size=3), st.just(np.float64(1.0)))
bad_offsets = st.one_of(st.integers(max_value=-1), st.integers(min_value=U64), st.floats(), st.booleans(),
                        st.none(), st.text(max_size=3))
bad_scales = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), st.none(), st.text(max_size=3),
                       st.booleans(), st.just(complex(1, 1)))
not_tensors = st.one_of(st.none(), st.integers(), st.text(max_size=3), st.just(np.zeros(4, np.float32)),
                        st.lists(st.floats(), max_size=3))
non_sr_dtypes = st.sampled_from([lowgrad.fp16, lowgrad.fp8_e4m3, lowgrad.byte, lowgrad.fp64])
sr_dtypes = st.sampled_from([lowgrad.fp32, lowgrad.bf16])


def alloc_filled(dev, n, dtype, name="t", fill=0x5A):
    t = dev.alloc((n,), dtype, kind="host", name=name)
    t.allocation.host_bytes()[t._offset:t._offset + t.nbytes] = fill
    return t


def snapshot(*ts) -> list[bytes]:
    return [bytes(t.allocation.host_bytes()[t._offset:t._offset + t.nbytes]) for t in ts
            if isinstance(t, lowgrad.Tensor)]


def rejects(fn, *watch) -> None:
    before = snapshot(*watch)
    with pytest.raises(BAD):
        fn()
    assert snapshot(*watch) == before, "a rejected call modified its destination"


@st.composite
def bad_add_sr_call(draw):
    dev = host()
    fault = draw(st.sampled_from(["size", "dtype", "seed", "offset", "offset_sum", "scale", "overlap_b",
                                  "partial_a", "device", "not_tensor", "stream"]))
    n = draw(st.integers(2 if fault == "partial_a" else 1, 16))
    dts = [draw(sr_dtypes) for _ in range(3)]
    kw = dict(scale=1.0, seed=0, index_offset=0)
    sizes = [n, n, n]
    if fault == "size":
        i = draw(st.integers(0, 2))
        sizes[i] = draw(st.integers(0, 20).filter(lambda v: v != n))
    if fault == "dtype":
        dts[draw(st.integers(0, 2))] = draw(non_sr_dtypes)
    dst, a, b = (alloc_filled(dev, s, d, nm) for s, d, nm in zip(sizes, dts, "dab"))
    if fault == "seed":
        kw["seed"] = draw(bad_seeds)
    if fault == "offset":
        kw["index_offset"] = draw(bad_offsets)
    if fault == "offset_sum":
        kw["index_offset"] = draw(st.integers(U64 - n + 1, U64 - 1)) if n > 1 else U64
    if fault == "scale":
        kw["scale"] = draw(bad_scales)
    if fault == "overlap_b":
        big = alloc_filled(dev, 2 * n, dts[0], "big")
        s = draw(st.integers(0, n - 1))
        dst, b = big[:n], big[s:s + n]
    if fault == "partial_a":
        big = alloc_filled(dev, 2 * n, dts[0], "big")
        s = draw(st.integers(1, n - 1))
        dst, a = big[:n], big[s:s + n]
    if fault == "device":
        other = alloc_filled(host(), n, dts[1], "other")
        if draw(st.booleans()):
            a = other
        else:
            b = other
    if fault == "not_tensor":
        which = draw(st.integers(0, 2))
        bad = draw(not_tensors)
        dst, a, b = [bad if i == which else t for i, t in enumerate((dst, a, b))]
    if fault == "stream":
        kw["stream"] = draw(st.one_of(st.integers(max_value=-1), st.text(max_size=3), st.floats()))
    return fault, dst, a, b, kw


@settings(max_examples=120, deadline=None)
@given(bad_add_sr_call())
def test_ops_add_sr_rejects_bad_arguments(call) -> None:
    fault, dst, a, b, kw = call
    rejects(lambda: ops.add_sr(dst, a, b, **kw), dst)


@FEW
@given(st.integers(2, 16), st.data())
def test_ops_bind_add_sr_checks_index_range_at_bind(n, data) -> None:
    dev = host()
    dst, a, b = (alloc_filled(dev, n, lowgrad.bf16, nm) for nm in "dab")
    off = data.draw(st.integers(U64 - n + 1, U64 - 1))
    with pytest.raises(ValueError):
        ops.bind_add_sr(dst, a, b, 1.0, index_offset=off)


bad_u32 = st.one_of(st.integers(max_value=-1), st.integers(min_value=1 << 32), st.floats(), st.booleans(),
                    st.none(), st.text(max_size=3))


@st.composite
def bad_seed_source(draw, count: int, dev: lowgrad.HostDevice):
    """Seeds for ``count`` SR uses that check_seed_source must refuse."""
    counter = lowgrad.SeedCounter(dev, 1, 0)
    kind = draw(st.sampled_from(["seed", "count", "counter_type", "layer", "lane", "lanes_len", "device", "shape"]))
    if kind == "seed":
        return [draw(bad_seeds) if i == 0 else 1 for i in range(count)]
    if kind == "count":
        return draw(st.lists(st.integers(0, 9), max_size=5).filter(lambda v: len(v) != count))
    if kind == "counter_type":
        return (draw(not_tensors), 0, [0] * count)
    if kind == "layer":
        return (counter, draw(bad_u32), [0] * count)
    if kind == "lane":
        return (counter, 0, [draw(bad_u32)] * count)
    if kind == "lanes_len":
        return (counter, 0, [0] * (count + draw(st.integers(1, 3))))
    if kind == "device":
        return (lowgrad.SeedCounter(host(), 1, 0), 0, [0] * count)
    return (counter, 0)  # a tuple of the wrong shape


@FAST
@given(st.integers(1, 4), st.data())
def test_bound_sr_launches_reject_bad_seed_sources(count, data) -> None:
    """bind_add_sr_multi / bind_reduce_sr refuse bad seeds (fixed or counter-based) at bind time."""
    dev = host()
    items = [(t, t, alloc_filled(dev, 8, lowgrad.bf16, "b"), 0) for t in
             (alloc_filled(dev, 8, lowgrad.bf16, "d") for _ in range(count))]
    rejects(lambda: ops.bind_add_sr_multi(items, data.draw(bad_seed_source(count, dev))), *[it[0] for it in items])
    dst, src = alloc_filled(dev, 4, lowgrad.fp32, "d"), alloc_filled(dev, 8, lowgrad.bf16, "s")
    rejects(lambda: ops.bind_reduce_sr(dst, src, 2, seed=data.draw(bad_seed_source(1, dev))), dst)


@FEW
@given(st.one_of(st.integers(max_value=-1), st.integers(min_value=U64)), st.integers(0, 3),
       st.integers(min_value=1 << 32), st.integers(0, 3))
def test_seed_counter_rejects_out_of_range_base_and_step(bad_base, ok_step, bad_step, ok_base) -> None:
    dev = host()
    with pytest.raises(ValueError):
        lowgrad.SeedCounter(dev, bad_base, ok_step)
    with pytest.raises(ValueError):
        lowgrad.SeedCounter(dev, ok_base, bad_step)


@st.composite
def bad_reduce_sr_call(draw):
    dev = host()
    m = draw(st.integers(1, 8))
    shards = draw(st.integers(1, 4))
    dd, sd = draw(sr_dtypes), draw(sr_dtypes)
    kw = dict(n_shards=shards, skip=-1, scale=1.0, accumulate=False, seed=0, index_offset=0)
    src_n = shards * m
    fault = draw(st.sampled_from(["dtype", "n_shards", "skip", "src_size", "overlap", "seed", "offset",
                                  "offset_sum", "scale", "not_tensor", "device", "stream"]))
    if fault == "dtype":
        if draw(st.booleans()):
            dd = draw(non_sr_dtypes)
        else:
            sd = draw(non_sr_dtypes)
    if fault == "src_size":
        src_n = draw(st.integers(0, 40).filter(lambda v: v != shards * m))
    dst, src = alloc_filled(dev, m, dd, "dst"), alloc_filled(dev, src_n, sd, "src")
    if fault == "n_shards":
        kw["n_shards"] = draw(st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.none(),
                                        st.text(max_size=2)))
    if fault == "skip":
        kw["skip"] = draw(st.one_of(st.integers(max_value=-2), st.integers(min_value=shards), st.floats(),
                                    st.none(), st.text(max_size=2)))
    if fault == "overlap":
        big = alloc_filled(dev, (shards + 1) * m, dd, "big")
        s = draw(st.integers(0, shards * m - 1))
        dst, src = big[s:s + m], big[:shards * m]
    if fault == "seed":
        kw["seed"] = draw(bad_seeds)
    if fault == "offset":
        kw["index_offset"] = draw(bad_offsets)
    if fault == "offset_sum":
        kw["index_offset"] = draw(st.integers(U64 - m + 1, U64 - 1)) if m > 1 else U64
    if fault == "scale":
        kw["scale"] = draw(bad_scales)
    if fault == "not_tensor":
        bad = draw(not_tensors)
        dst, src = (bad, src) if draw(st.booleans()) else (dst, bad)
    if fault == "device":
        src = alloc_filled(host(), src_n, sd, "src2")
    if fault == "stream":
        kw["stream"] = draw(st.one_of(st.integers(max_value=-1), st.text(max_size=3), st.floats()))
    return fault, dst, src, kw


@settings(max_examples=120, deadline=None)
@given(bad_reduce_sr_call())
def test_ops_reduce_sr_rejects_bad_arguments(call) -> None:
    fault, dst, src, kw = call
    rejects(lambda: ops.reduce_sr(dst, src, **kw), dst)


@MEDIUM
@given(st.data())
def test_ops_fill_zero_copy_norm_reject_bad_arguments(data) -> None:
    dev = host()
    which = data.draw(st.sampled_from(["fill_not_tensor", "fill_stream", "copy_dtype", "copy_size",
                                       "copy_not_tensor", "copy_device", "norm_x_dtype", "norm_out_dtype",
                                       "norm_out_size", "norm_overlap", "norm_not_tensor"]))
    n = data.draw(st.integers(1, 8))
    x = alloc_filled(dev, n, data.draw(sr_dtypes), "x")
    if which == "fill_not_tensor":
        rejects(lambda: ops.fill_zero(data.draw(not_tensors)))
    elif which == "fill_stream":
        s = data.draw(st.one_of(st.integers(max_value=-1), st.text(max_size=3), st.floats(), st.booleans()))
        rejects(lambda: ops.fill_zero(x, stream=s), x)
    elif which == "copy_dtype":
        dt = data.draw(st.sampled_from([d for d in (lowgrad.fp32, lowgrad.bf16, lowgrad.fp16, lowgrad.byte,
                                                    lowgrad.fp8_e4m3) if d is not x.dtype]))
        src = alloc_filled(dev, n, dt, "src", 0x11)
        rejects(lambda: ops.copy(x, src), x)
    elif which == "copy_size":
        src = alloc_filled(dev, data.draw(st.integers(0, 16).filter(lambda v: v != n)), x.dtype, "src", 0x11)
        rejects(lambda: ops.copy(x, src), x)
    elif which == "copy_not_tensor":
        bad = data.draw(not_tensors)
        rejects(lambda: ops.copy(x, bad), x)
        rejects(lambda: ops.copy(bad, x), x)
    elif which == "copy_device":
        src = alloc_filled(host(), n, x.dtype, "src", 0x11)
        rejects(lambda: ops.copy(x, src), x)
    elif which == "norm_x_dtype":
        bad = alloc_filled(dev, n, data.draw(non_sr_dtypes), "bad")
        out = alloc_filled(dev, 1, lowgrad.fp32, "out")
        rejects(lambda: ops.norm_squared(bad, out), out)
    elif which == "norm_out_dtype":
        out = alloc_filled(dev, 1, data.draw(st.sampled_from([lowgrad.bf16, lowgrad.fp16, lowgrad.byte,
                                                                lowgrad.fp8_e4m3])), "out")
        rejects(lambda: ops.norm_squared(x, out), out)
    elif which == "norm_out_size":
        out = alloc_filled(dev, data.draw(st.integers(0, 5).filter(lambda v: v != 1)), lowgrad.fp32, "out")
        rejects(lambda: ops.norm_squared(x, out), out)
    elif which == "norm_overlap":
        big = alloc_filled(dev, n + 1, lowgrad.fp32, "big")
        i = data.draw(st.integers(0, n - 1))
        rejects(lambda: ops.norm_squared(big[:n], big[i:i + 1]), big)
    elif which == "norm_not_tensor":
        out = alloc_filled(dev, 1, lowgrad.fp32, "out")
        bad = data.draw(not_tensors)
        rejects(lambda: ops.norm_squared(bad, out), out)
        rejects(lambda: ops.norm_squared(x, bad), x)


_SUPPORTED_NP = {d.np for d in (lowgrad.fp32, lowgrad.bf16, lowgrad.fp16, lowgrad.fp8_e4m3, lowgrad.byte,
                                 lowgrad.fp64)}


def _not_a_dtype_name(s: str) -> bool:
    """``s`` names no supported dtype, neither as a lowgrad name nor as a numpy spelling ("f4", "d")."""
    if s in ("fp32", "bf16", "fp16", "fp8_e4m3", "byte", "fp64"):
        return False
    try:
        return np.dtype(s) not in _SUPPORTED_NP
    except SyntaxError:
        return False  # numpy's parser error: covered by test_as_dtype_rejects_unparsable_strings
    except Exception:  # noqa: BLE001
        return True


bad_dtype_names = st.text(max_size=4).filter(_not_a_dtype_name)


@FEW
@given(st.sampled_from([",", "01", "1)", "0(", "(2", "f4,"]))
def test_as_dtype_rejects_unparsable_strings(s) -> None:
    with pytest.raises(BAD):
        host().alloc((2,), s, kind="host", name="x")


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
    with pytest.raises(ValueError):
        lowgrad.shard_view(dev.alloc((), lowgrad.fp32, kind="host"), 0, 1)


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


@MEDIUM
@given(st.data())
def test_paramspec_layout_reject_bad_fields(data) -> None:
    what = data.draw(st.sampled_from(["name", "shape", "dim", "zero_init", "dtype", "block", "non_block",
                                      "num_layers", "duplicate"]))
    good = lowgrad.ParamSpec("w", (4, 2))
    with pytest.raises(BAD):
        if what == "name":
            lowgrad.ParamSpec(data.draw(st.one_of(st.just(""), st.none(), st.integers(), st.binary(max_size=2))),
                              (2,))
        elif what == "shape":
            lowgrad.ParamSpec("w", data.draw(st.one_of(st.just(()), st.none(), st.integers(), st.floats(),
                                                       st.text(max_size=3), st.just([]))))
        elif what == "dim":
            shape = data.draw(st.lists(st.integers(1, 4), max_size=2))
            bad = data.draw(st.one_of(st.integers(max_value=0), st.floats(), st.booleans(), st.none(),
                                      st.text(max_size=2)))
            lowgrad.ParamSpec("w", tuple(shape) + (bad,))
        elif what == "zero_init":
            lowgrad.ParamSpec("w", (2,), zero_init=data.draw(st.one_of(st.integers(), st.none(), st.text(max_size=2))))
        elif what == "dtype":
            lowgrad.ParamSpec("w", (2,), dtype=data.draw(st.one_of(bad_dtype_names, st.integers(),
                                                                   st.just(complex))))
        elif what == "block":
            lowgrad.Layout(block=data.draw(st.one_of(st.none(), st.just(good), st.text(max_size=2),
                                                     st.lists(st.integers(), min_size=1, max_size=2))),
                           non_block=[], num_layers=1)
        elif what == "non_block":
            lowgrad.Layout(block=[good], non_block=data.draw(st.one_of(st.integers(), st.just([None]),
                                                                       st.just([good, "x"]))), num_layers=1)
        elif what == "num_layers":
            lowgrad.Layout(block=[good], non_block=[], num_layers=data.draw(st.one_of(
                st.integers(max_value=0), st.floats(), st.booleans(), st.none(), st.text(max_size=2))))
        else:
            lowgrad.Layout(block=[good, lowgrad.ParamSpec("w", (2,))], non_block=[], num_layers=1)


TINY = dict(PRESETS["tiny"])
INT_KEYS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "vocab_size"]


@MEDIUM
@given(st.data())
def test_llama_layout_rejects_bad_configs(data) -> None:
    cfg = dict(TINY)
    what = data.draw(st.sampled_from(["int_value", "missing", "flag", "bias", "divisible", "kind"]))
    if what == "int_value":
        cfg[data.draw(st.sampled_from(INT_KEYS + ["head_dim"]))] = data.draw(st.one_of(
            st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=2), st.lists(st.integers(),
                                                                                           max_size=1)))
    elif what == "missing":
        del cfg[data.draw(st.sampled_from([k for k in INT_KEYS if k != "num_key_value_heads"]))]
    elif what == "flag":
        cfg[data.draw(st.sampled_from(["tie_word_embeddings", "attention_bias"]))] = data.draw(st.one_of(
            st.integers(), st.none(), st.text(max_size=2), st.floats()))
    elif what == "bias":
        del cfg["model_type"]
        if data.draw(st.booleans()):
            cfg["model_type"] = data.draw(st.one_of(st.text(max_size=5).filter(lambda s: s not in ("qwen2", "llama")),
                                                    st.integers(), st.none(), st.lists(st.integers(), max_size=1)))
    elif what == "divisible":
        cfg["num_key_value_heads"] = 3  # 4 heads not divisible by 3
        if data.draw(st.booleans()):
            cfg["num_key_value_heads"], cfg["hidden_size"] = 2, 66  # 66 % 4 != 0 and no head_dim
    else:
        cfg = data.draw(st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=3),
                                  st.text(alphabet="xyz/", min_size=1, max_size=20).map(lambda s: "/nonexist/" + s)))
    with pytest.raises(BAD):
        lowgrad.llama_layout(cfg)


@FEW
@given(st.integers(300, 5000))
def test_llama_layout_long_name_raises_value_error(n) -> None:
    with pytest.raises(BAD):
        lowgrad.llama_layout("x" * n)


@MEDIUM
@given(st.data())
def test_use_seed_rejects_out_of_range(data) -> None:
    args = dict(base_seed=0, step=0, micro_step=0, layer=0, tensor=0, phase=0)
    key = data.draw(st.sampled_from(list(args)))
    limit = U64 if key == "base_seed" else (2 if key == "phase" else 1 << 32)
    if key == "tensor":
        limit = 1 << 31  # 2 * tensor + phase must fit 32 bits
    args[key] = data.draw(st.one_of(st.integers(max_value=-1), st.integers(min_value=limit), st.floats(),
                                    st.booleans(), st.none(), st.text(max_size=2)))
    with pytest.raises(BAD):
        seeds.use_seed(**args)


@MEDIUM
@given(st.integers(0, U64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(0, 2**31 - 1), st.integers(0, 1))
def test_use_seed_valid_is_philox(base, step, micro, layer, tensor, phase) -> None:
    s = seeds.use_seed(base, step, micro, layer, tensor, phase)
    w = philox4x32_10(np.array([step, micro, layer, 2 * tensor + phase], np.uint32),
                      np.array([base & 0xFFFFFFFF, base >> 32], np.uint32))
    assert type(s) is int and s == int(w[0]) | int(w[1]) << 32


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


bad_ops = st.one_of(st.text(max_size=5), st.none(), st.integers(), st.floats())


@FEW
@given(st.data())
def test_host_comm_rejects_bad_ops_and_sizes(data) -> None:
    rs_op = data.draw(bad_ops.filter(lambda o: o not in ("avg", "sum")))
    ar_op = data.draw(bad_ops.filter(lambda o: o not in ("sum", "avg", "max")))
    n = data.draw(st.integers(1, 9))
    odd = data.draw(st.integers(0, 4).map(lambda k: 2 * k + 1))
    dt = data.draw(st.sampled_from([lowgrad.fp32, lowgrad.bf16, lowgrad.byte]))

    def world1(comm):
        t = alloc_filled(comm.device, n, dt, "t", 1)
        errs = []
        for fn in (lambda: comm.reduce_scatter(t, op=rs_op), lambda: comm.all_reduce(t, op=ar_op),
                   lambda: comm.all_gather(t, out=alloc_filled(comm.device, n + 1, dt, "out")),
                   lambda: comm.all_gather(t, out=alloc_filled(comm.device, n, lowgrad.fp16, "out")),
                   lambda: comm.reduce_scatter(alloc_filled(host(), n, dt, "other")),
                   lambda: comm.all_reduce(np.zeros(n))):
            try:
                fn()
                errs.append(None)
            except Exception as e:  # noqa: BLE001 - recorded and checked by the caller
                errs.append(type(e))
        comm.all_reduce(t, op="sum")  # still usable after rejected calls
        return errs, bytes(t.numpy().view(np.uint8))

    [(errs, after)] = lowgrad.run_threads(1, world1, timeout=20)
    assert all(e in BAD for e in errs), errs
    assert after == bytes([1]) * (n * dt.itemsize)

    def world2(comm):
        t = alloc_filled(comm.device, odd, dt, "t", 1)
        errs = []
        for fn in (lambda: comm.reduce_scatter(t), lambda: comm.all_gather(t), lambda: comm.all_to_all(t),
                   lambda: comm.reduce_scatter(t, op=rs_op)):
            try:
                fn()
                errs.append(None)
            except Exception as e:  # noqa: BLE001
                errs.append(type(e))
        even = alloc_filled(comm.device, 2, lowgrad.fp32, "e", 0)
        even.numpy()[:] = comm.rank + 1
        comm.reduce_scatter(even, op="sum")
        return errs, float(even.numpy()[comm.rank])

    res = lowgrad.run_threads(2, world2, timeout=20)
    for errs, v in res:
        assert all(e in BAD for e in errs), errs
        assert v == 3.0


# ---- the host backend equals the reference ----------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(0, 33), sr_dtypes, sr_dtypes, sr_dtypes, scales_st, seeds_st, st.booleans())
def test_ops_add_sr_host_equals_reference(data, n, dd, ad, bd, scale, seed, alias) -> None:
    dev = host()
    a_np = data.draw(sr_arrays(n, finite=data.draw(st.booleans()))).astype(ad.np)
    b_np = data.draw(sr_arrays(n)).astype(bd.np)
    off = data.draw(offsets_st(n))
    a, b = put(dev, a_np, "a"), put(dev, b_np, "b")
    dst = a if alias else dev.alloc((n,), dd, kind=data.draw(st.sampled_from(["host", "pinned", "device"])),
                                    name="dst")
    want = R.add_sr(a_np, b_np, scale, seed, off, out_dtype=dst.dtype)
    ops.add_sr(dst, a, b, scale=scale, seed=seed, index_offset=off)
    assert np.array_equal(bits(dst.numpy()), bits(want))
    assert np.array_equal(bits(b.numpy()), bits(b_np))  # b untouched


@MEDIUM
@given(st.data(), st.integers(1, 4), st.integers(1, 6), seeds_st, scales_st)
def test_ops_add_sr_on_shards_equals_full(data, world, rows, seed, scale) -> None:
    dev = host()
    n = world * rows
    a_np, b_np = data.draw(bf16_arrays(n)), data.draw(f32_arrays(n))
    off = data.draw(offsets_st(n))
    full = R.add_sr(a_np, b_np, scale, seed, off)
    a, b = put(dev, a_np, "a"), put(dev, b_np, "b")
    for r in range(world):
        ops.add_sr(lowgrad.shard_view(a, r, world), lowgrad.shard_view(a, r, world), lowgrad.shard_view(b, r, world),
                   scale, seed, off + r * rows)
    assert np.array_equal(bits(a.numpy()), bits(full))


@MEDIUM
@given(st.data(), st.integers(0, 10), st.integers(1, 4), seeds_st)
def test_ops_reduce_sr_host_equals_reference(data, m, shards, seed) -> None:
    dev = host()
    dd, sd = data.draw(sr_dtypes), data.draw(sr_dtypes)
    d_np = data.draw(sr_arrays(m)).astype(dd.np)
    s_np = data.draw(sr_arrays(shards * m)).astype(sd.np)
    skip = data.draw(st.integers(-1, shards - 1))
    acc = data.draw(st.booleans())
    scale = data.draw(scales_st)
    off = data.draw(offsets_st(m))
    dst, src = put(dev, d_np, "dst"), put(dev, s_np, "src")
    want = R.reduce_sr(d_np, s_np, shards, skip, scale, acc, seed, off)
    ops.reduce_sr(dst, src, shards, skip=skip, scale=scale, accumulate=acc, seed=seed, index_offset=off)
    assert np.array_equal(bits(dst.numpy()), bits(want))
    assert np.array_equal(bits(src.numpy()), bits(s_np))


@MEDIUM
@given(st.data(), st.integers(0, 20), sr_dtypes, st.sampled_from([lowgrad.fp32, lowgrad.fp64]), st.booleans())
def test_ops_fill_copy_norm_host(data, n, dt, out_dt, acc) -> None:
    dev = host()
    x_np = data.draw(sr_arrays(n)).astype(dt.np)
    x = put(dev, x_np, "x")
    y = dev.alloc((n,), dt, kind="pinned", name="y")
    ops.copy(y, x)
    assert np.array_equal(bits(y.numpy()), bits(x_np))
    out = put(dev, np.array([2.0], out_dt.np), "out")
    with np.errstate(over="ignore", invalid="ignore"):
        ops.norm_squared(x, out, accumulate=acc)
        want = R.norm_squared(x_np, accum=out_dt.np.name) + (out_dt.np.type(2.0) if acc else 0)
    assert np.array_equal(out.numpy(), np.array([want], out_dt.np), equal_nan=True)
    ops.fill_zero(y)
    assert not y.numpy().view(np.uint8).any()
