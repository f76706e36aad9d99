"""Properties of Philox4x32-10 and the SR noise (``lowgrad.sr.philox``): broadcasting, bad shapes
and types, determinism, and noise windows at any offset.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from props import BAD, FAST, U64, seeds_st

from lowgrad.sr.philox import philox4x32_10, sr_noise

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
@given(hnp.array_shapes(min_dims=1, max_dims=2, max_side=3), hnp.array_shapes(min_dims=1, max_dims=2, max_side=3),
       st.data())
def test_philox_incompatible_shapes_raise(s1, s2, data) -> None:
    # make one trailing axis clash (two different sides, both > 1): generated, not filtered
    s1, s2 = list(s1), list(s2)
    k = data.draw(st.integers(1, min(len(s1), len(s2))))
    s1[-k], s2[-k] = data.draw(st.permutations([2, 3, 4]))[:2]
    s1, s2 = tuple(s1), tuple(s2)
    with pytest.raises(ValueError):
        np.broadcast_shapes(s1, s2)
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
