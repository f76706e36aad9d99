"""The kernel front (``lowgrad.ops``) on the host backend: every bad argument is refused before
anything is queued, leaving the destination untouched, and valid calls equal the numpy reference
bit for bit (property-based, hypothesis).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from props import (
    FAST,
    FEW,
    MEDIUM,
    U64,
    alloc_filled,
    bad_offsets,
    bad_scales,
    bad_seeds,
    bf16_arrays,
    bits,
    f32_arrays,
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
from lowgrad.sr.seedcounter import SeedCounter


def bad_sr_keywords(draw, fault: str, n: int) -> dict:
    """The bad seed, index offset or scale keyword of ``fault`` for an SR call over ``n`` elements."""
    if fault == "seed":
        return {"seed": draw(bad_seeds)}
    if fault == "offset":
        return {"index_offset": draw(bad_offsets)}
    if fault == "offset_sum":
        return {"index_offset": draw(st.integers(U64 - n + 1, U64 - 1)) if n > 1 else U64}
    if fault == "scale":
        return {"scale": draw(bad_scales)}
    return {}


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
    kw.update(bad_sr_keywords(draw, fault, n))
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
    counter = SeedCounter(dev, 1, 0)
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
        return (SeedCounter(host(), 1, 0), 0, [0] * count)
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
    rejects(lambda: ops.bind_reduce_sr(dst, src, 2, seeds=data.draw(bad_seed_source(1, dev))), dst)


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
    kw.update(bad_sr_keywords(draw, fault, m))
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
