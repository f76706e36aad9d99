"""Shared pieces of the property-based tests (hypothesis): settings profiles, strategies of values
and of bad arguments, and small host-backend helpers. Host only: no GPU is touched.

Every argument-checking property asserts that a bad call raises TypeError or ValueError (nothing
else, never silent success) and, where a destination exists, that it is left untouched
(:func:`rejects`).
"""
from __future__ import annotations

import math
import os
import tempfile

import hypothesis.configuration
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lowgrad

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
    hi = U64 - 1 - n  # ops take index_offset < 2**64 even for the empty tail of n elements
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
    t.allocation.host_bytes()[t.offset:t.offset + t.nbytes] = fill
    return t


def snapshot(*ts) -> list[bytes]:
    return [bytes(t.allocation.host_bytes()[t.offset:t.offset + t.nbytes]) for t in ts
            if isinstance(t, lowgrad.Tensor)]


def rejects(fn, *watch) -> None:
    before = snapshot(*watch)
    with pytest.raises(BAD):
        fn()
    assert snapshot(*watch) == before, "a rejected call modified its destination"


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
