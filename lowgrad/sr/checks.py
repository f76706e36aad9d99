"""The value rules of the SR kernels' arguments, written once: :mod:`lowgrad.ops` (tensors on
either backend) and :mod:`lowgrad.sr.reference` (numpy arrays) both call these, so one value is
accepted or refused the same way everywhere. Checks look at ints, floats, dtypes and element
counts only; they return the value in the form the kernels take. A kernel's own rules (sizes,
shard counts) are with its reference function.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from lowgrad.base.dtypes import DType, as_dtype, bf16, fp32
from lowgrad.base.limits import U32, U64

SR_DTYPES: tuple[DType, ...] = (fp32, bf16)  # dtypes the SR kernels read and write
F32_MAX = float(np.finfo(np.float32).max)  # the kernels multiply by scale in float32


def check_int(value: Any, what: str) -> int:
    """``value`` (a Python or numpy integer, not a bool) as a Python int; TypeError otherwise."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


def check_sr_dtype(dtype: Any, what: str) -> DType:
    """``dtype`` (a DType, name or numpy dtype) if the SR kernels handle it (fp32, bf16)."""
    d = as_dtype(dtype)
    if d not in SR_DTYPES:
        raise TypeError(f"{what} has dtype {d.name}; expected one of {', '.join(s.name for s in SR_DTYPES)}")
    return d


def check_scale(scale: Any) -> float:
    """A real ``scale`` that float32 holds finitely (the kernels multiply in float32), as a float."""
    if not isinstance(scale, (int, float, np.integer, np.floating)) or isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not (math.isfinite(scale) and abs(float(scale)) <= F32_MAX):
        raise ValueError(f"scale must be finite in float32, got {scale!r}")
    return float(scale)


def check_seed(seed: Any) -> int:
    """A 64-bit seed: an int in [0, 2**64)."""
    s = check_int(seed, "seed")
    if not 0 <= s < U64:
        raise ValueError(f"seed {s} outside [0, 2**64)")
    return s


def check_index_offset(index_offset: Any, n: int) -> int:
    """The noise index of element 0 of ``n`` elements: every index ``index_offset + i`` fits
    64 bits, and ``index_offset`` itself does even when ``n`` is 0."""
    off = check_int(index_offset, "index_offset")
    if not (0 <= off < U64 and off + n <= U64):
        raise ValueError(f"index_offset {off} outside [0, 2**64 - {n}] for {n} elements")
    return off


def check_accumulate(accumulate: Any) -> bool:
    """A bool (``numpy.bool_``, or the int 0 or 1, accepted)."""
    if not (isinstance(accumulate, (bool, np.bool_)) or (type(accumulate) is int and accumulate in (0, 1))):
        raise TypeError(f"accumulate must be a bool, got {accumulate!r}")
    return bool(accumulate)


def check_u32(value: Any, what: str) -> int:
    """An int in [0, 2**32) (a seed counter's layer or lane)."""
    v = check_int(value, what)
    if not 0 <= v < U32:
        raise ValueError(f"{what} must be an int in [0, 2**32), got {value!r}")
    return v


def check_shards(n_shards: Any, skip: Any) -> tuple[int, int]:
    """``n_shards`` in [1, 2**32) and ``skip`` a shard index or -1 (reduce_sr, dequant_reduce_sr)."""
    shards = check_int(n_shards, "n_shards")
    if not 1 <= shards < U32:
        raise ValueError(f"n_shards must be in [1, 2**32), got {shards}")
    sk = check_int(skip, "skip")
    if not -1 <= sk < shards:
        raise ValueError(f"skip {sk} outside [-1, {shards})")
    return shards, sk
