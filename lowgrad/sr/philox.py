"""Philox4x32-10 (Random123) in numpy, and the stochastic-rounding noise defined on it.

docs/design.md, "Stochastic rounding": element ``i`` of a tensor rounds with the 16-bit noise ``r_j``
(``g = i // 8``, ``j = i % 8``) of ``w = Philox4x32-10(counter=(g & 0xffffffff, g >> 32, 0, 0),
key=(seed_lo, seed_hi))``: the low half of ``w[j // 2]`` for even ``j``, the high half for odd ``j``.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

from lowgrad.base.limits import U64

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)  # round multipliers of ctr[0], ctr[2]
W0, W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)  # key increments
_MASK = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def _words(x: npt.ArrayLike, width: int, what: str) -> np.ndarray:
    """``x`` as a uint32 array whose last axis has ``width`` entries (values checked to fit)."""
    a = np.asarray(x)
    if a.dtype.kind not in "ui" and not (
            a.dtype == object and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in a.flat)):
        raise TypeError(f"{what} must hold integers, got dtype {a.dtype}")
    if a.ndim == 0 or a.shape[-1] != width:
        raise ValueError(f"{what} must have shape (..., {width}), got {a.shape}")
    if a.dtype != np.uint32 and a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise ValueError(f"{what} values must fit in 32 bits")
    return a.astype(np.uint32)


def philox4x32_10(counter: npt.ArrayLike, key: npt.ArrayLike) -> np.ndarray:
    """Philox4x32-10 of uint32 ``counter`` (..., 4) under ``key`` (..., 2); leading axes
    broadcast; returns uint32 (..., 4). Reproduces Random123's known-answer vectors."""
    c, k = _words(counter, 4, "counter"), _words(key, 2, "key")
    shape = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    c0, c1, c2, c3 = (np.broadcast_to(c[..., i], shape).astype(np.uint64) for i in range(4))
    k0, k1 = (np.broadcast_to(k[..., i], shape).astype(np.uint64) for i in range(2))
    for rnd in range(10):
        if rnd:
            k0 = (k0 + W0) & _MASK
            k1 = (k1 + W1) & _MASK
        p0 = c0 * M0  # exact: both factors < 2**32
        p1 = c2 * M1
        c0, c1, c2, c3 = (p1 >> _SHIFT) ^ c1 ^ k0, p1 & _MASK, (p0 >> _SHIFT) ^ c3 ^ k1, p0 & _MASK
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def sr_noise(seed: int, start: int, n: int) -> np.ndarray:
    """The 16-bit SR noise ``r_i`` of element indices ``start .. start + n - 1`` (uint16, shape (n,))."""
    for v, what in ((seed, "seed"), (start, "start"), (n, "n")):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise TypeError(f"{what} must be an int, got {type(v).__name__}")
    seed, start, n = int(seed), int(start), int(n)
    if not 0 <= seed < U64:
        raise ValueError(f"seed {seed} outside [0, 2**64)")
    if n < 0 or start < 0 or start + n > U64:
        raise ValueError(f"element indices [{start}, {start + n}) outside [0, 2**64)")
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    g = np.arange(start // 8, (start + n - 1) // 8 + 1, dtype=np.uint64)
    counter = np.stack([g & _MASK, g >> _SHIFT, np.zeros_like(g), np.zeros_like(g)], axis=-1)
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32)
    halves = philox4x32_10(counter.astype(np.uint32), key).astype("<u4").view("<u2").reshape(-1)
    return halves[start % 8:start % 8 + n].astype(np.uint16)
