"""The numpy reference of the SR kernels: SR properties, launch-free noise, reduce_sr semantics and
argument checks."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import lowgrad
from lowgrad.sr import reference as R
from lowgrad.sr.philox import sr_noise

BF = ml_dtypes.bfloat16
MAX_BF16 = float(ml_dtypes.finfo(BF).max)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 truncation of float32 ``x`` and the next bf16 away from zero (as uint16 bits)."""
    t = (x.view(np.uint32) >> 16).astype(np.uint16)
    return t, t + np.uint16(1)


def test_result_is_one_of_the_two_neighbours() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(50_000), rng.standard_normal(50_000) * 1e-38,
                        rng.uniform(-3e38, 3e38, 10_000)]).astype(np.float32)
    out = R.round_sr(x, 42, 0, lowgrad.bf16)
    assert out.dtype == BF and out.shape == x.shape
    lo, hi = neighbours(x)
    b = bits(out)
    assert np.all((b == lo) | (b == hi))
    exact = (x.view(np.uint32) & 0xFFFF) == 0
    assert np.array_equal(b[exact], lo[exact])  # representable values never move
    assert np.array_equal(b, ((x.view(np.uint32) + sr_noise(42, 0, x.size).astype(np.uint32)) >> 16).astype(np.uint16))


def test_mean_of_many_roundings_converges() -> None:
    x = np.float32([1.0 + 1 / 3, -2.7182817, 1e-3, 3.1e-39, 123456.79, -0.3])
    reps = 4000
    acc = np.zeros(x.size)
    for seed in range(reps):
        acc += R.round_sr(x, seed * 0x9E3779B97F4A7C15 % (1 << 64), 0, lowgrad.bf16).astype(np.float64)
    lo, hi = neighbours(x)
    ulp = np.abs(hi.view(BF).astype(np.float64) - lo.view(BF).astype(np.float64))
    # the standard error of a Bernoulli mean is <= ulp / (2 sqrt(reps)); allow 5 sigma
    assert np.all(np.abs(acc / reps - x.astype(np.float64)) < 5 * ulp / (2 * np.sqrt(reps)))


def test_special_values() -> None:
    x = np.float32([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, MAX_BF16, -MAX_BF16,
                    0.0, 3.4028235e38, -3.4028235e38,
                    1e-45, -1e-45, 1e-40, 2.5e-39])
    x[1] = -np.abs(x[1])
    x[8] = np.uint32(0x7F7F8000).view(np.float32)  # halfway between max bf16 and Inf
    out = bits(R.round_sr(np.tile(x, 64), 7, 0, lowgrad.bf16)).reshape(64, x.size)
    assert np.all(out[:, 0] == 0x7FC0) and np.all(out[:, 1] == 0xFFC0)  # quiet NaN, sign kept
    assert np.all(out[:, 2] == 0x7F80) and np.all(out[:, 3] == 0xFF80)  # +-Inf stays
    assert np.all(out[:, 4] == 0x0000) and np.all(out[:, 5] == 0x8000)  # +-0 stays
    assert np.all(out[:, 6] == 0x7F7F) and np.all(out[:, 7] == 0xFF7F)  # max bf16 is exact
    assert set(out[:, 8]) == {0x7F7F, 0x7F80}  # rounds to max or to Inf
    assert set(out[:, 9]) <= {0x7F7F, 0x7F80} and set(out[:, 10]) <= {0xFF7F, 0xFF80}
    assert set(out[:, 11]) <= {0x0000, 0x0001} and set(out[:, 12]) <= {0x8000, 0x8001}  # denormals
    lo, hi = neighbours(x[13:])
    assert np.all((out[:, 13:] == lo) | (out[:, 13:] == hi))
    signalling = np.array([0x7F800001, 0xFF800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    assert list(bits(R.round_sr(signalling, 0, 0, lowgrad.bf16))) == [0x7FC0, 0xFFC0, 0x7FFF]


def test_fp32_output_is_exact() -> None:
    x = np.float32([1.1, np.nan, -np.inf, 1e-42, -0.0])
    out = R.round_sr(x, 3, 5, lowgrad.fp32)
    assert out.dtype == np.float32 and np.array_equal(bits(out), bits(x)) and out is not x
    a, b = np.float32([1.5, 2.25, 1e38]), np.float32([0.25, -4.0, 1e38])
    assert np.array_equal(R.add_sr(a, b, 0.5, 9, out_dtype=lowgrad.fp32), (a + b) * np.float32(0.5))


@pytest.mark.parametrize("k", [1, 3, 8, 13])
def test_noise_depends_only_on_seed_and_index(k: int) -> None:
    rng = np.random.default_rng(k)
    a = rng.standard_normal(1000).astype(np.float32)
    b = rng.standard_normal(1000).astype(BF)
    full = R.add_sr(a, b, 0.25, 1234, 0)
    assert np.array_equal(bits(R.add_sr(a[k:], b[k:], 0.25, 1234, k)), bits(full[k:]))
    dst = rng.standard_normal(1000).astype(BF)
    src = rng.standard_normal((4, 1000)).astype(np.float32)
    whole = R.reduce_sr(dst, src.reshape(-1), 4, 1, 0.5, True, 77, 0)
    part = R.reduce_sr(dst[k:], np.ascontiguousarray(src[:, k:]).reshape(-1), 4, 1, 0.5, True, 77, k)
    assert np.array_equal(bits(part), bits(whole[k:]))


def test_add_sr_float32_order() -> None:
    rng = np.random.default_rng(5)
    a = rng.standard_normal(4096).astype(BF)
    b = (rng.standard_normal(4096) * 1e-3).astype(np.float32)
    want = R.round_sr((a.astype(np.float32) + b) * np.float32(1 / 3), 11, 100, lowgrad.bf16)
    got = R.add_sr(a, b, 1 / 3, 11, 100)
    assert got.dtype == BF and np.array_equal(bits(got), bits(want))
    assert R.add_sr(a.reshape(64, 64), b, 1.0, 0).shape == (64, 64)


@pytest.mark.parametrize("out", [lowgrad.bf16, lowgrad.fp32])
@pytest.mark.parametrize("a_dt", [BF, np.float32])
def test_scale_sr_is_the_rounding_of_a_float32_product(out, a_dt) -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal(1001).astype(a_dt)
    want = R.round_sr(a.astype(np.float32) * np.float32(-0.3), 42, 7, out)
    got = R.scale_sr(a, -0.3, 42, 7, out)
    assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want))
    assert np.array_equal(bits(R.scale_sr(a[5:], -0.3, 42, 12, out)), bits(got[5:]))  # noise by index only
    with pytest.raises(ValueError, match="float32"):
        R.scale_sr(a, 1e39, 0)
    with pytest.raises(TypeError):
        R.scale_sr(a, 1.0, 0, 0, lowgrad.fp16)
    with pytest.raises(ValueError, match="index_offset"):
        R.scale_sr(a, 1.0, 0, 2**64 - 1000)


@pytest.mark.parametrize("n_shards,skip,accumulate", [(1, -1, False), (1, 0, True), (4, -1, True),
                                                      (4, 2, False), (8, 7, True), (8, 0, False)])
@pytest.mark.parametrize("dst_dt,src_dt", [(BF, BF), (BF, np.float32), (np.float32, BF), (np.float32, np.float32)])
def test_reduce_sr_matches_a_direct_loop(n_shards, skip, accumulate, dst_dt, src_dt) -> None:
    rng = np.random.default_rng(n_shards * 10 + skip)
    n = 257
    dst = rng.standard_normal(n).astype(dst_dt)
    src = rng.standard_normal(n * n_shards).astype(src_dt)
    seed, off, scale = 0xFEEDFACE, 19, 0.125
    got = R.reduce_sr(dst, src, n_shards, skip, scale, accumulate, seed, off)
    noise = sr_noise(seed, off, n)
    for i in range(0, n, 17):
        acc = np.float32(dst[i]) if accumulate else np.float32(0.0)
        for k in range(n_shards):
            if k != skip:
                acc = np.float32(acc + np.float32(src[k * n + i]))
        v = np.float32(acc * np.float32(scale))
        if dst_dt is BF:
            want = (int(np.array(v).view(np.uint32)) + int(noise[i])) >> 16
            assert int(bits(got)[i]) == want
        else:
            assert bits(got)[i] == np.array(v).view(np.uint32)
    assert got.dtype == np.dtype(dst_dt) and got.shape == dst.shape


def test_reduce_sr_zero_start_and_does_not_modify_dst() -> None:
    dst = np.float32([5.0, -1.0])
    before = dst.copy()
    src = np.float32([-0.0, -0.0, 1.0, 2.0])
    out = R.reduce_sr(dst, src, 2, 1, 1.0, False, 0)
    assert bits(out)[0] == 0 and out[1] == 0.0  # +0.0 + -0.0 = +0.0
    assert np.array_equal(dst, before)
    assert np.array_equal(R.reduce_sr(dst, src, 2, -1, 1.0, True, 0), np.float32([6.0, 1.0]))


def test_norm_squared() -> None:
    x = np.arange(1000, dtype=np.float32) / 100
    want = float(np.sum(x.astype(np.float64) ** 2))
    assert R.norm_squared(x).dtype == np.float32 and R.norm_squared(x, "float64").dtype == np.float64
    assert abs(float(R.norm_squared(x)) - want) < 1e-5 * want
    assert float(R.norm_squared(x.astype(BF), "float64")) == float(np.sum(x.astype(BF).astype(np.float64) ** 2))
    assert float(R.norm_squared(np.zeros(0, np.float32))) == 0.0
    with pytest.raises(ValueError):
        R.norm_squared(x, "float16")
    with pytest.raises(TypeError):
        R.norm_squared(x.astype(np.float16))


F, B = np.float32, BF
GOOD_ADD = dict(a=np.zeros(8, F), b=np.zeros(8, B), scale=1.0, seed=1, index_offset=0, out_dtype=lowgrad.bf16)


@pytest.mark.parametrize("change,exc", [
    (dict(a=np.zeros(8, np.float16)), TypeError),
    (dict(b=np.zeros(8, np.int32)), TypeError),
    (dict(a=[0.0] * 8), TypeError),
    (dict(b=np.zeros(9, B)), ValueError),
    (dict(out_dtype=lowgrad.fp16), TypeError),
    (dict(out_dtype="int8"), TypeError),
    (dict(scale=float("nan")), ValueError),
    (dict(scale=float("inf")), ValueError),
    (dict(scale="1"), TypeError),
    (dict(scale=True), TypeError),
    (dict(seed=-1), ValueError),
    (dict(seed=1 << 64), ValueError),
    (dict(seed=1.0), TypeError),
    (dict(index_offset=-1), ValueError),
    (dict(index_offset=(1 << 64) - 4), ValueError),
    (dict(index_offset=2.0), TypeError),
])
def test_add_sr_bad_arguments(change, exc) -> None:
    with pytest.raises(exc):
        R.add_sr(**{**GOOD_ADD, **change})


GOOD_REDUCE = dict(dst=np.zeros(4, B), src=np.zeros(12, F), n_shards=3, skip=-1, scale=0.5, accumulate=True, seed=3,
                   index_offset=8)


@pytest.mark.parametrize("change,exc", [
    (dict(dst=np.zeros(4, np.float64)), TypeError),
    (dict(src=np.zeros(12, np.float16)), TypeError),
    (dict(src=np.zeros(11, F)), ValueError),
    (dict(n_shards=0), ValueError),
    (dict(n_shards=2), ValueError),
    (dict(n_shards=3.0), TypeError),
    (dict(skip=3), ValueError),
    (dict(skip=-2), ValueError),
    (dict(skip=None), TypeError),
    (dict(accumulate="yes"), TypeError),
    (dict(accumulate=2), TypeError),
    (dict(scale=float("-inf")), ValueError),
    (dict(seed=-5), ValueError),
    (dict(index_offset=-8), ValueError),
])
def test_reduce_sr_bad_arguments(change, exc) -> None:
    with pytest.raises(exc):
        R.reduce_sr(**{**GOOD_REDUCE, **change})


def test_check_helpers_take_sizes_and_dtypes() -> None:
    assert R.check_reduce_sr_args(4, 8, lowgrad.bf16, lowgrad.bf16, 2, 1, 1.0, 1, 0, 0) == (2, 1, 1.0, True, 0, 0)
    with pytest.raises(ValueError, match="size mismatch"):
        R.add_sr(np.zeros(5, np.float32), np.zeros(4, np.float32), 1.0, 0)
    with pytest.raises(TypeError):
        R.check_reduce_sr_args(4, 8, lowgrad.fp8_e4m3, lowgrad.bf16, 2, 1, 1.0, 1, 0, 0)
    with pytest.raises(TypeError):
        R.round_sr(np.zeros(3, np.float64), 0, 0, lowgrad.bf16)
