"""Philox4x32-10 known answers, broadcasting, argument checks, and the SR noise definition."""
from __future__ import annotations

import numpy as np
import pytest

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
            want = scalar_philox(tuple(map(int, ctr[i, 0])), tuple(map(int, key[j])))
            assert tuple(int(v) for v in out[i, j]) == want
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
    """r_i straight from the definition (docs/design.md), one element at a time."""
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
