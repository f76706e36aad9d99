"""Per-use seeds: derivation against an independent scalar Philox, distinctness, range errors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from lowgrad.sr.seeds import NON_BLOCK_LAYER, use_seed, use_seeds

M = 0xFFFFFFFF


def philox_ref(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Scalar Random123 Philox4x32-10, written independently of lowgrad.sr.philox."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M, (p0 >> 32) ^ c3 ^ k1, p0 & M
        k0, k1 = (k0 + 0x9E3779B9) & M, (k1 + 0xBB67AE85) & M
    return c0, c1, c2, c3


def test_reference_philox_known_answers():
    assert philox_ref((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox_ref((M, M, M, M), (M, M)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox_ref((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


@pytest.mark.parametrize("base, step, micro, layer, tensor, phase", [
    (0, 0, 0, 0, 0, 0),
    (1234, 7, 3, 11, 5, 1),
    (0xDEADBEEF_CAFEF00D, 123456, 15, NON_BLOCK_LAYER, 2, 0),
    ((1 << 64) - 1, M, M, M, (1 << 31) - 1, 1),
])
def test_use_seed_matches_direct_philox(base, step, micro, layer, tensor, phase):
    w = philox_ref((step, micro, layer, 2 * tensor + phase), (base & M, base >> 32))
    expected = w[0] | w[1] << 32
    got = use_seed(base, step, micro, layer, tensor, phase)
    assert type(got) is int and got == expected


def test_use_seed_accepts_numpy_ints():
    assert use_seed(np.uint64(5), np.int32(1), np.uint8(2), np.int64(3), np.uint16(4), np.int8(1)) == \
        use_seed(5, 1, 2, 3, 4, 1)


def test_seeds_distinct_across_all_coordinates():
    grid = list(itertools.product(range(3), range(3), [0, 1, 2, NON_BLOCK_LAYER], range(4), (0, 1)))
    seeds = {use_seed(42, *g) for g in grid}
    assert len(seeds) == len(grid)
    assert use_seed(42, 0, 0, 0, 0, 0) != use_seed(43, 0, 0, 0, 0, 0)
    assert use_seed(42, 0, 0, 0, 0, 0) != use_seed(42 + (1 << 32), 0, 0, 0, 0, 0)  # key high word counts


def test_use_seeds_vectorised_matches_scalar():
    layers = np.arange(5)[:, None, None]
    tensors = np.arange(12)[None, :, None]
    phases = np.array([0, 1])[None, None, :]
    out = use_seeds(99, 4, 2, layers, tensors, phases)
    assert out.dtype == np.uint64 and out.shape == (5, 12, 2)
    for layer, tensor, phase in itertools.product(range(5), range(12), range(2)):
        assert int(out[layer, tensor, phase]) == use_seed(99, 4, 2, layer, tensor, phase)
    assert use_seeds(1, 0, 0, [], 0, 0).shape == (0,)


@pytest.mark.parametrize("args", [
    (-1, 0, 0, 0, 0, 0),
    (1 << 64, 0, 0, 0, 0, 0),
    (0, -1, 0, 0, 0, 0),
    (0, 1 << 32, 0, 0, 0, 0),
    (0, 0, 1 << 32, 0, 0, 0),
    (0, 0, 0, 1 << 32, 0, 0),
    (0, 0, 0, 0, -1, 0),
    (0, 0, 0, 0, 1 << 31, 0),  # 2 * tensor overflows the counter word
    (0, 0, 0, 0, 0, 2),
    (0, 0, 0, 0, 0, -1),
    (0, 1 << 70, 0, 0, 0, 0),
])
def test_range_errors(args):
    with pytest.raises(ValueError):
        use_seed(*args)


@pytest.mark.parametrize("args", [
    (0.0, 0, 0, 0, 0, 0),
    (0, 1.5, 0, 0, 0, 0),
    (0, 0, "1", 0, 0, 0),
    (0, 0, 0, 0, 0, True),
    (None, 0, 0, 0, 0, 0),
])
def test_type_errors(args):
    with pytest.raises(TypeError):
        use_seed(*args)


def test_use_seeds_range_errors():
    with pytest.raises(ValueError):
        use_seeds(0, 0, 0, np.array([0, 1 << 32], dtype=np.uint64), 0, 0)
    with pytest.raises(ValueError):
        use_seeds(0, 0, 0, 0, [0, 1], [0, 2])
    with pytest.raises(TypeError):
        use_seeds(0, 0, 0, np.array([0.0, 1.0]), 0, 0)
