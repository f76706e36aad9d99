"""The executable definition of lowgrad's kernels in numpy (docs/design.md, "Stochastic rounding" and
"Kernels"); the device kernels match it bit for bit, and the host backend runs these functions as
its kernels (an elementwise kernel's host twin is the function of its name here, see
:class:`lowgrad.contracts.kernels.Elementwise`).

Each function's docstring gives the float32 operation order, which the kernel follows exactly,
and each checks its arguments with the value rules of :mod:`lowgrad.sr.checks`, which
:mod:`lowgrad.ops` applies too.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from lowgrad.base.dtypes import bf16, fp32
from lowgrad.contracts.kernel_source import constants
from lowgrad.sr.checks import (
    check_accumulate,
    check_index_offset,
    check_scale,
    check_seed,
    check_shards,
    check_sr_dtype,
)
from lowgrad.sr.philox import sr_noise


def _array(x: Any, what: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(x).__name__}")
    check_sr_dtype(x.dtype, what)
    return x


# ---- the reference ---------------------------------------------------------------------------------
def round_sr(x_f32: np.ndarray, seed: int, index_offset: int, out_dtype: Any, shift: int = 0,
             nearest: bool = False) -> np.ndarray:
    """Round float32 ``x_f32`` to ``out_dtype``: an exact copy for fp32; for bf16 the top half of
    ``u + r`` (``u`` the float32 bits, ``r`` the noise of element ``index_offset + i`` plus
    ``shift``, mod 2**16: ``shift`` is low-discrepancy SR's, see :mod:`lowgrad.sr.seedcounter`),
    or with ``nearest`` round to nearest even (no noise); NaN as a quiet NaN with its sign.
    Returns a new array of ``x_f32``'s shape."""
    x = np.asarray(x_f32)
    if x.dtype != np.float32:
        raise TypeError(f"round_sr takes float32, got {x.dtype}")
    out = check_sr_dtype(out_dtype, "out_dtype")
    seed, index_offset = check_seed(seed), check_index_offset(index_offset, x.size)
    if not isinstance(shift, int) or isinstance(shift, bool) or not 0 <= shift < 1 << 16:
        raise ValueError(f"shift must be an int in [0, 2**16), got {shift!r}")
    if out is fp32:
        return x.copy()
    u = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    if nearest:
        r = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    else:
        r = (sr_noise(seed, index_offset, u.size).astype(np.uint32) + np.uint32(shift)) & np.uint32(0xFFFF)
    bits = (u + r) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    bits[nan] = (u[nan] >> np.uint32(16)) | np.uint32(0x0040)
    return bits.astype(np.uint16).view(bf16.np).reshape(x.shape)


def add_sr(a: np.ndarray, b: np.ndarray, scale: float, seed: int, index_offset: int = 0,
           out_dtype: Any = bf16, shift: int = 0, nearest: bool = False) -> np.ndarray:
    """``SR((float32(a) + float32(b)) * float32(scale))`` elementwise as ``out_dtype`` (fp32 or
    bf16), element ``i`` with the noise of index ``index_offset + i``; shape of ``a``;
    ``shift`` and ``nearest`` as in :func:`round_sr`."""
    a, b = _array(a, "a"), _array(b, "b")
    check_sr_dtype(out_dtype, "out_dtype")
    if a.size != b.size:
        raise ValueError(f"add_sr size mismatch: a {a.size}, b {b.size} elements")
    scale, seed, index_offset = check_scale(scale), check_seed(seed), check_index_offset(index_offset, a.size)
    with np.errstate(over="ignore", invalid="ignore"):  # IEEE results (Inf, NaN), as on the device
        v = (a.astype(np.float32).reshape(-1) + b.astype(np.float32).reshape(-1)) * np.float32(scale)
    return round_sr(v, seed, index_offset, out_dtype, shift, nearest).reshape(a.shape)


def scale_sr(a: np.ndarray, scale: float, seed: int, index_offset: int = 0, out_dtype: Any = bf16,
             shift: int = 0, nearest: bool = False) -> np.ndarray:
    """``SR(float32(a) * float32(scale))`` elementwise as ``out_dtype`` (fp32 or bf16), element
    ``i`` with the noise of index ``index_offset + i``; shape of ``a``; ``shift`` and ``nearest``
    as in :func:`round_sr`."""
    a = _array(a, "a")
    check_sr_dtype(out_dtype, "out_dtype")
    scale, seed, index_offset = check_scale(scale), check_seed(seed), check_index_offset(index_offset, a.size)
    with np.errstate(over="ignore", invalid="ignore"):
        v = a.astype(np.float32).reshape(-1) * np.float32(scale)
    return round_sr(v, seed, index_offset, out_dtype, shift, nearest).reshape(a.shape)


def check_reduce_sr_args(n_dst: int, n_src: int, dst_dtype: Any, src_dtype: Any, n_shards: Any, skip: Any,
                         scale: Any, accumulate: Any, seed: Any,
                         index_offset: Any) -> tuple[int, int, float, bool, int, int]:
    """:func:`reduce_sr`'s arguments from element counts and dtypes (also :mod:`lowgrad.ops`'
    rule for tensors); returns ``(n_shards, skip, scale, accumulate, seed, index_offset)``."""
    check_sr_dtype(dst_dtype, "dst")
    check_sr_dtype(src_dtype, "src")
    shards, sk = check_shards(n_shards, skip)
    if n_src != shards * n_dst:
        raise ValueError(f"reduce_sr: src has {n_src} elements, not n_shards ({shards}) x dst ({n_dst})")
    return (shards, sk, check_scale(scale), check_accumulate(accumulate), check_seed(seed),
            check_index_offset(index_offset, n_dst))


def reduce_sr(dst: np.ndarray, src: np.ndarray, n_shards: int, skip: int, scale: float, accumulate: bool,
              seed: int, index_offset: int = 0, shift: int = 0, nearest: bool = False) -> np.ndarray:
    """``SR(((dst if accumulate else +0) + sum_{k != skip} src[k]) * scale)`` as ``dst``'s dtype
    and shape, summed in float32 in shard order; ``src`` holds ``n_shards`` consecutive blocks of
    ``dst.size`` elements; ``shift`` and ``nearest`` as in :func:`round_sr`. ``dst`` is not
    modified."""
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
    return round_sr(acc, seed, index_offset, dst.dtype, shift, nearest).reshape(dst.shape)


# ---- the 8-bit hop (kernels/quant8.cu) -----------------------------------------------------------
#: elements per int8 block sharing one float32 scale (kernels/quant8.cu's QBLOCK)
QBLOCK = constants("quant8")["QBLOCK"]


def _hop_noise(seed: int, index_offset: int, n: int, shift: int, nearest: bool, half: int) -> np.ndarray:
    """The 16-bit noise of element indices ``index_offset ..``, as uint32: ``half`` when rounding
    to nearest, else Philox's plus ``shift`` mod 2**16."""
    if nearest:
        return np.full(n, half, np.uint32)
    return (sr_noise(seed, index_offset, n).astype(np.uint32) + np.uint32(shift)) & np.uint32(0xFFFF)


def quantize_i8_sr(x: np.ndarray, seed: int, index_offset: int = 0, shift: int = 0,
                   nearest: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``x`` (fp32 or bf16, n elements) as ``(q, scales)``: int8 ``q`` of n elements and one float32
    scale per block of :data:`QBLOCK` (the last block partial). A block's scale is ``amax / 127``
    (float32 division, ``amax`` the largest ``|x|`` of the block), NaN where the block holds a
    non-finite value; ``q_i = clamp(floor(x_i / s + r_i * 2**-16), -127, 127)`` in float32, ``r_i``
    the 16-bit noise of element ``index_offset + i`` plus ``shift`` mod 2**16 (0x8000 with
    ``nearest``: half up), and 0 where the scale is 0 or NaN. ``E[q_i] * s = x_i`` up to 2**-16 of a
    step: the hop adds no bias."""
    x = _array(x, "x").reshape(-1)
    seed, index_offset = check_seed(seed), check_index_offset(index_offset, x.size)
    n, blocks = x.size, -(-x.size // QBLOCK)
    flat = np.zeros(blocks * QBLOCK, np.float32)
    flat[:n] = x.astype(np.float32)
    v = flat.reshape(blocks, QBLOCK)
    bad = ~np.isfinite(v).all(axis=1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scales = np.where(bad, np.float32(np.nan), np.abs(v).max(axis=1) / np.float32(127)).astype(np.float32)
        u = _hop_noise(seed, index_offset, n, shift, nearest, 0x8000).astype(np.float32) * np.float32(1 / 65536)
        s = np.repeat(scales, QBLOCK)[:n]
        t = np.floor(v.reshape(-1)[:n] / s + u)
    q = np.where(s > 0, np.clip(np.nan_to_num(t), -127, 127), 0).astype(np.int8)
    return q, scales


def dequant_reduce_sr(dst: np.ndarray, q: np.ndarray, scales: np.ndarray, n_shards: int, skip: int, scale: float,
                      seed: int, index_offset: int = 0, shift: int = 0, nearest: bool = False) -> np.ndarray:
    """``SR((dst + sum_{k != skip} q[k] * scales[k]) * scale)`` as ``dst``'s dtype and shape: ``q``
    holds ``n_shards`` consecutive int8 blocks of ``dst.size`` elements and ``scales`` theirs
    (:func:`quantize_i8_sr`'s, each block's scale for :data:`QBLOCK` elements), summed in float32
    in shard order (each product and sum rounded to float32) and rounded once as
    :func:`reduce_sr` rounds. ``dst`` is not modified."""
    dst = _array(dst, "dst")
    n, blocks = dst.size, -(-dst.size // QBLOCK)
    qs = np.asarray(q).view(np.int8).reshape(n_shards, n)
    ss = np.asarray(scales, np.float32).reshape(n_shards, blocks)
    acc = dst.astype(np.float32).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(n_shards):
            if k != skip:
                acc = acc + qs[k].astype(np.float32) * np.repeat(ss[k], QBLOCK)[:n]
        acc = acc * np.float32(scale)
    return round_sr(acc, seed, index_offset, dst.dtype, shift, nearest).reshape(dst.shape)


def norm_squared(x: np.ndarray, accum: str = "float32") -> np.floating:
    """Sum of squares of ``x`` (fp32 or bf16) accumulated in ``accum`` ("float32" or "float64").
    The device's summation order differs, so the last bits may too."""
    x = _array(x, "x")
    if accum not in ("float32", "float64"):
        raise ValueError(f"accum must be 'float32' or 'float64', got {accum!r}")
    v = x.astype(accum).reshape(-1)
    return np.dtype(accum).type(np.dot(v, v))


# ---- gradient statistics (kernels/grad_stats.cu) ------------------------------------------------
def grad_stats(x: np.ndarray) -> tuple[float, float, float]:
    """``(sum of squares, non-finite count, largest finite |x|)`` of ``x`` (fp32 or bf16): the sum
    of squares of every value (NaN or Inf once one is: the norm a clip would see), here in
    float64; the largest |x| over the finite values (0 when there are none). The device sums in
    float32 per thread and float64 across warps, in an order fixed by its launch shape: its sum
    of squares is this one within a relative 1e-5; the count and the largest |x| are exact."""
    x = _array(x, "x")
    v = x.astype(np.float64).reshape(-1)
    finite = np.isfinite(v)
    with np.errstate(over="ignore", invalid="ignore"):
        sumsq = float(np.dot(v, v))
    return sumsq, float(v.size - np.count_nonzero(finite)), float(np.abs(v[finite]).max(initial=0.0))
