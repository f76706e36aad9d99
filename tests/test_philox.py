"""Philox4x32-10 known answers, broadcasting, argument checks, and the SR noise definition."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from props import BAD, FAST, U64, seeds_st

import lowgrad
from lowgrad.sr.philox import philox4x32_10, sr_noise

M = 0xFFFFFFFF
KAT = [  # Random123 kat_vectors: philox4x32_10
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M), (M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def scalar_philox(ctr: tuple[int, ...], key: tuple[int, ...]) -> tuple[int, ...]:
    """Philox4x32-10 on Python ints, written independently of the vectorised version."""
    c, k = list(ctr), list(key)
    for rnd in range(10):
        if rnd:
            k = [(k[0] + 0x9E3779B9) & M, (k[1] + 0xBB67AE85) & M]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M, (p0 >> 32) ^ c[3] ^ k[1], p0 & M]
    return tuple(c)


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_known_answers(ctr, key, want) -> None:
    got = philox4x32_10(np.array(ctr, np.uint32), np.array(key, np.uint32))
    assert got.dtype == np.uint32 and got.shape == (4,)
    assert tuple(int(v) for v in got) == want
    assert scalar_philox(ctr, key) == want
    assert lowgrad.philox4x32_10 is philox4x32_10


def test_batch_matches_scalar_and_broadcasts() -> None:
    rng = np.random.default_rng(1)
    ctr = rng.integers(0, 1 << 32, (6, 1, 4), dtype=np.uint64).astype(np.uint32)
    key = rng.integers(0, 1 << 32, (5, 2), dtype=np.uint64).astype(np.uint32)
    out = philox4x32_10(ctr, key)
    assert out.shape == (6, 5, 4) and out.dtype == np.uint32
    for i in range(6):
        for j in range(5):
            assert tuple(int(v) for v in out[i, j]) == scalar_philox(tuple(map(int, ctr[i, 0])), tuple(map(int, key[j])))
    one_key = philox4x32_10(ctr[:, 0], key[2])
    assert np.array_equal(one_key, out[:, 2])
    assert np.array_equal(philox4x32_10([list(KAT[2][0])] * 3, KAT[2][1]), np.array([KAT[2][2]] * 3, np.uint32))


@pytest.mark.parametrize("ctr,key,exc", [
    ([0, 0, 0], [0, 0], ValueError),
    ([0, 0, 0, 0], [0, 0, 0], ValueError),
    ([0.5, 0, 0, 0], [0, 0], TypeError),
    ([-1, 0, 0, 0], [0, 0], ValueError),
    ([1 << 32, 0, 0, 0], [0, 0], ValueError),
    ([0, 0, 0, 0], [1 << 40, 0], ValueError),
    (np.zeros((2, 4), np.uint32), np.zeros((3, 2), np.uint32), ValueError),  # shapes do not broadcast
    (0, [0, 0], ValueError),
])
def test_bad_arguments(ctr, key, exc) -> None:
    with pytest.raises(exc):
        philox4x32_10(ctr, key)


def direct_noise(seed: int, i: int) -> int:
    """r_i straight from DESIGN.md, one element at a time."""
    g, j = i // 8, i % 8
    w = scalar_philox((g & M, g >> 32, 0, 0), (seed & M, seed >> 32))
    return (w[j // 2] >> (16 * (j % 2))) & 0xFFFF


@pytest.mark.parametrize("seed,start,n", [(0, 0, 40), (12345, 3, 29), ((1 << 64) - 1, 13, 17),
                                          (0xDEADBEEF12345678, (1 << 35) + 5, 21), (7, (1 << 64) - 9, 9)])
def test_sr_noise_is_the_definition(seed: int, start: int, n: int) -> None:
    got = sr_noise(seed, start, n)
    assert got.dtype == np.uint16 and got.shape == (n,)
    assert [int(v) for v in got] == [direct_noise(seed, start + k) for k in range(n)]


def test_sr_noise_windows_agree() -> None:
    full = sr_noise(99, 0, 1000)
    for start, n in ((0, 0), (1, 7), (5, 300), (8, 16), (999, 1)):
        assert np.array_equal(sr_noise(99, start, n), full[start:start + n])
    assert not np.array_equal(sr_noise(100, 0, 1000), full)


@pytest.mark.parametrize("args,exc", [((-1, 0, 4), ValueError), ((1 << 64, 0, 4), ValueError),
                                      ((0, -1, 4), ValueError), ((0, 0, -1), ValueError),
                                      ((0, (1 << 64) - 2, 4), ValueError), ((1.0, 0, 4), TypeError),
                                      ((0, True, 4), TypeError)])
def test_sr_noise_bad_arguments(args, exc) -> None:
    with pytest.raises(exc):
        sr_noise(*args)


# ---- properties (hypothesis): Philox and the SR noise --------------------
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
