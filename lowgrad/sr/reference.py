"""The executable definition of lowgrad's kernels in numpy (DESIGN.md, "Stochastic rounding" and
"Kernels"); the device kernels match it bit for bit.

Float32 operation order, which the kernels follow exactly: ``add_sr`` computes
``(float(a) + float(b)) * scale``; ``reduce_sr`` starts from ``float(dst)`` (accumulate) or
``+0.0``, adds ``float(src[k])`` for ``k = 0 .. n_shards - 1`` except ``skip``, then multiplies by
``scale``. The ``check_*`` helpers validate arguments from sizes and dtypes alone, so both backends
share them.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from lowgrad.core.dtypes import DType, as_dtype, bf16, fp32
from lowgrad.sr.philox import sr_noise

SR_DTYPES: tuple[DType, ...] = (fp32, bf16)
_U64 = 1 << 64


# ---- argument checks (sizes, dtypes and ints: no arrays needed) ----------------------------------
def check_int(value: Any, what: str) -> int:
    """``value`` as a Python int; TypeError for anything else (bool included)."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


def check_sr_dtype(dtype: Any, what: str) -> DType:
    """``dtype`` (a DType, name or numpy dtype) if the SR kernels handle it (fp32, bf16)."""
    d = as_dtype(dtype)
    if d not in SR_DTYPES:
        raise TypeError(f"{what} has dtype {d.name}; expected fp32 or bf16")
    return d


def check_scale(scale: Any) -> float:
    """A finite real ``scale`` as a float (the kernels receive it as float32)."""
    if not isinstance(scale, (int, float, np.integer, np.floating)) or isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)


def check_seed(seed: Any) -> int:
    """A seed in [0, 2**64)."""
    s = check_int(seed, "seed")
    if not 0 <= s < _U64:
        raise ValueError(f"seed {s} outside [0, 2**64)")
    return s


def check_index_offset(index_offset: Any, n: int) -> int:
    """An element index offset >= 0 such that the indices of ``n`` elements stay below 2**64."""
    off = check_int(index_offset, "index_offset")
    if off < 0 or off + n > _U64:
        raise ValueError(f"index_offset {off} with {n} elements leaves [0, 2**64)")
    return off


def check_add_sr_args(n_dst: int, n_a: int, n_b: int, dst_dtype: Any, a_dtype: Any, b_dtype: Any, scale: Any,
                      seed: Any, index_offset: Any) -> tuple[float, int, int]:
    """Validate ``add_sr`` from element counts and dtypes; returns ``(scale, seed, index_offset)``."""
    for d, what in ((dst_dtype, "dst"), (a_dtype, "a"), (b_dtype, "b")):
        check_sr_dtype(d, what)
    if not n_dst == n_a == n_b:
        raise ValueError(f"add_sr size mismatch: dst {n_dst}, a {n_a}, b {n_b} elements")
    return check_scale(scale), check_seed(seed), check_index_offset(index_offset, n_dst)


def check_reduce_sr_args(n_dst: int, n_src: int, dst_dtype: Any, src_dtype: Any, n_shards: Any, skip: Any,
                         scale: Any, accumulate: Any, seed: Any,
                         index_offset: Any) -> tuple[int, int, float, bool, int, int]:
    """Validate ``reduce_sr`` from element counts and dtypes; returns
    ``(n_shards, skip, scale, accumulate, seed, index_offset)``."""
    check_sr_dtype(dst_dtype, "dst")
    check_sr_dtype(src_dtype, "src")
    shards = check_int(n_shards, "n_shards")
    if not 1 <= shards < 1 << 32:
        raise ValueError(f"n_shards must be in [1, 2**32), got {shards}")
    sk = check_int(skip, "skip")
    if not -1 <= sk < shards:
        raise ValueError(f"skip {sk} outside [-1, {shards})")
    if n_src != shards * n_dst:
        raise ValueError(f"reduce_sr: src has {n_src} elements, not n_shards ({shards}) x dst ({n_dst})")
    if not isinstance(accumulate, (bool, np.bool_)) and accumulate not in (0, 1):
        raise TypeError(f"accumulate must be a bool, got {accumulate!r}")
    return shards, sk, check_scale(scale), bool(accumulate), check_seed(seed), check_index_offset(index_offset, n_dst)


def _array(x: Any, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(x).__name__}")
    check_sr_dtype(x.dtype, what)
    return x


# ---- the reference ---------------------------------------------------------------------------------
def round_sr(x_f32: np.ndarray, seed: int, index_offset: int, out_dtype: Any) -> np.ndarray:
    """Round float32 ``x_f32`` to ``out_dtype``: an exact copy for fp32; for bf16 the top half of
    ``u + r`` (``u`` the float32 bits, ``r`` the noise of element ``index_offset + i``), NaN as a
    quiet NaN with its sign. Returns a new array of ``x_f32``'s shape."""
    x = np.asarray(x_f32)
    if x.dtype != np.float32:
        raise TypeError(f"round_sr takes float32, got {x.dtype}")
    out = check_sr_dtype(out_dtype, "out_dtype")
    seed, index_offset = check_seed(seed), check_index_offset(index_offset, x.size)
    if out is fp32:
        return x.copy()
    u = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    bits = (u + sr_noise(seed, index_offset, u.size).astype(np.uint32)) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    bits[nan] = (u[nan] >> np.uint32(16)) | np.uint32(0x0040)
    return bits.astype(np.uint16).view(bf16.np).reshape(x.shape)


def add_sr(a: np.ndarray, b: np.ndarray, scale: float, seed: int, index_offset: int = 0,
           out_dtype: Any = bf16) -> np.ndarray:
    """``SR((float32(a) + float32(b)) * float32(scale))`` elementwise as ``out_dtype`` (fp32 or
    bf16), element ``i`` with the noise of index ``index_offset + i``; shape of ``a``."""
    a, b = _array(a, "a"), _array(b, "b")
    scale, seed, index_offset = check_add_sr_args(a.size, a.size, b.size, out_dtype, a.dtype, b.dtype, scale,
                                                  seed, index_offset)
    with np.errstate(over="ignore", invalid="ignore"):  # IEEE results (Inf, NaN), as on the device
        v = (a.astype(np.float32).reshape(-1) + b.astype(np.float32).reshape(-1)) * np.float32(scale)
    return round_sr(v, seed, index_offset, out_dtype).reshape(a.shape)


def reduce_sr(dst: np.ndarray, src: np.ndarray, n_shards: int, skip: int, scale: float, accumulate: bool,
              seed: int, index_offset: int = 0) -> np.ndarray:
    """``SR(((dst if accumulate else +0) + sum_{k != skip} src[k]) * scale)`` as ``dst``'s dtype
    and shape, summed in float32 in shard order; ``src`` holds ``n_shards`` consecutive blocks of
    ``dst.size`` elements. ``dst`` is not modified."""
    dst, src = _array(dst, "dst"), _array(src, "src")
    n_shards, skip, scale, accumulate, seed, index_offset = check_reduce_sr_args(
        dst.size, src.size, dst.dtype, src.dtype, n_shards, skip, scale, accumulate, seed, index_offset)
    acc = dst.astype(np.float32).reshape(-1) if accumulate else np.zeros(dst.size, dtype=np.float32)
    blocks = src.reshape(n_shards, dst.size)
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(n_shards):
            if k != skip:
                acc += blocks[k].astype(np.float32)
        acc *= np.float32(scale)
    return round_sr(acc, seed, index_offset, dst.dtype).reshape(dst.shape)


def norm_squared(x: np.ndarray, accum: str = "float32") -> np.floating:
    """Sum of squares of ``x`` (fp32 or bf16) accumulated in ``accum`` ("float32" or "float64").
    The device's summation order differs, so the last bits may too."""
    x = _array(x, "x")
    if accum not in ("float32", "float64"):
        raise ValueError(f"accum must be 'float32' or 'float64', got {accum!r}")
    v = x.astype(accum).reshape(-1)
    return np.dtype(accum).type(np.dot(v, v))
