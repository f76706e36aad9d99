"""Per-use stochastic-rounding seeds.

Every rounding event gets its own 64-bit seed ``w0 | w1 << 32`` of
``Philox4x32-10(counter=(step, micro_step, layer, 2 * tensor + phase), key=(base_lo, base_hi))``
(DESIGN "Per-use seeds"). ``tensor`` is the parameter's position in ``Layout.block``; ``phase``
is 0 for the add into the shard and 1 for reducing the peers' slices into it (all-to-all).

Non-block parameters have no layer: they use ``layer = NON_BLOCK_LAYER`` (0xFFFFFFFF, never a
block layer index in practice) and ``tensor`` = their position in ``Layout.non_block``.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

from lowgrad.base.limits import U32, U64

NON_BLOCK_LAYER = 0xFFFFFFFF


def _check_int(name: str, value: object, limit: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    v = int(value)
    if not 0 <= v < limit:
        raise ValueError(f"{name} must be in [0, {limit:#x}), got {v}")
    return v


def use_seed(base_seed: int, step: int, micro_step: int, layer: int, tensor: int, phase: int) -> int:
    """The 64-bit seed of one rounding event (see the module docstring).

    ``base_seed`` must be in [0, 2**64); ``step``, ``micro_step``, ``layer`` and ``2 * tensor +
    phase`` must each fit in 32 bits; ``phase`` is 0 or 1. Out-of-range values raise ValueError,
    non-integers TypeError. For a non-block parameter pass ``layer=NON_BLOCK_LAYER`` and its
    index in ``Layout.non_block`` as ``tensor``.
    """
    return int(use_seeds(base_seed, step, micro_step, layer, tensor, phase))


def use_seeds(base_seed: int, step: npt.ArrayLike, micro_step: npt.ArrayLike, layer: npt.ArrayLike,
              tensor: npt.ArrayLike, phase: npt.ArrayLike) -> np.ndarray:
    """Vectorised :func:`use_seed`: the counter arguments broadcast against each other (e.g. a
    whole micro-step's ``layer[:, None]`` by ``tensor[None, :]``); returns a uint64 array of
    their broadcast shape. Same range checks as :func:`use_seed`."""
    from lowgrad.sr.philox import philox4x32_10

    base = _check_int("base_seed", base_seed, U64)
    words = []
    for name, value in (("step", step), ("micro_step", micro_step), ("layer", layer),
                        ("tensor", tensor), ("phase", phase)):
        a = np.asarray(value, dtype=object)  # exact range checks whatever the integer type
        for v in a.flat:
            _check_int(name, v, U32)
        words.append(a)
    step_a, micro_a, layer_a, tensor_a, phase_a = words
    if any(p not in (0, 1) for p in phase_a.flat):
        raise ValueError(f"phase must be 0 or 1, got {phase!r}")
    word3 = np.asarray(2 * tensor_a + phase_a, dtype=object)
    if any(w >= U32 for w in word3.flat):
        raise ValueError(f"2 * tensor + phase must be < {U32:#x}, got tensor={tensor!r}, phase={phase!r}")
    counter = np.stack(np.broadcast_arrays(step_a, micro_a, layer_a, word3), axis=-1).astype(np.uint32)
    key = np.array([base & 0xFFFFFFFF, base >> 32], dtype=np.uint32)
    w = philox4x32_10(counter, key)
    return w[..., 0].astype(np.uint64) | (w[..., 1].astype(np.uint64) << np.uint64(32))
