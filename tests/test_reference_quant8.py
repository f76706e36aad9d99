"""The 8-bit hop's definition (``lowgrad.sr.reference.quantize_i8_sr`` / ``dequant_reduce_sr``,
kernels/quant8.cu) against an independent numpy formulation, its unbiasedness, its special values,
and ``lowgrad.ops``' checks of the bound launches (refused before anything is queued)."""
from __future__ import annotations

import numpy as np
import pytest

import lowgrad as lg
from lowgrad import ops
from lowgrad.sr import reference as ref
from lowgrad.sr.philox import sr_noise

QB = ref.QBLOCK


def independent_quantize(x: np.ndarray, seed: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """Block by block, element by element, in float32 (no vectorised tricks of the reference)."""
    x32 = x.astype(np.float32)
    r = sr_noise(seed, offset, x.size)
    q = np.zeros(x.size, np.int8)
    scales = []
    for b in range(0, x.size, QB):
        blk = x32[b:b + QB]
        s = np.float32(np.nan) if not np.isfinite(blk).all() else np.float32(np.abs(blk).max()) / np.float32(127)
        scales.append(s)
        for j, v in enumerate(blk):
            if s > 0:
                t = np.floor(np.float32(v / s) + np.float32(int(r[b + j]) / 65536.0))
                q[b + j] = int(min(max(t, -127), 127))
    return q, np.array(scales, np.float32)


@pytest.mark.parametrize("n,dtype", [(1, np.float32), (127, np.float32), (128, lg.bf16.np), (300, lg.bf16.np),
                                     (1000, np.float32)])
def test_quantize_equals_an_independent_formulation(n: int, dtype: type) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(dtype)
    q, s = ref.quantize_i8_sr(x, 42, 7)
    want_q, want_s = independent_quantize(x, 42, 7)
    assert np.array_equal(s.view(np.uint32), want_s.view(np.uint32)) and np.array_equal(q, want_q)


def test_the_hop_is_unbiased() -> None:
    """The mean over 4000 seeds of the dequantised values equals x within 4 standard errors,
    element by element, ties and near-ties of the int8 grid included."""
    x = np.concatenate([np.linspace(-1, 1, 100), [0.5 + 1 / 254, 1 / 254, -3 / 254, 1.0]]).astype(np.float32)
    vals = []
    for seed in range(4000):
        q, s = ref.quantize_i8_sr(x, seed, 0)
        vals.append(q.astype(np.float64) * np.repeat(s, QB)[:x.size])
    v = np.array(vals)
    se = v.std(axis=0) / np.sqrt(len(v)) + 1e-12
    assert np.all(np.abs(v.mean(axis=0) - x) < 4 * se + 1e-7)


def test_special_blocks() -> None:
    x = np.zeros(3 * QB, np.float32)
    x[QB + 5] = np.nan  # block 1 non-finite: its scale NaN, its q 0
    x[2 * QB:] = 2.0
    x[2 * QB + 1] = np.inf
    q, s = ref.quantize_i8_sr(x, 1, 0)
    assert s[0] == 0 and np.isnan(s[1]) and np.isnan(s[2]) and not q.any()
    out = ref.dequant_reduce_sr(np.ones(3 * QB, np.float32), np.stack([q, q]).reshape(-1), np.stack([s, s]).reshape(-1),
                                2, 1, 1.0, 3)
    assert np.all(out[:QB] == 1) and np.isnan(out[QB:]).all()  # a non-finite block makes the sum NaN


def test_dequant_reduce_equals_an_independent_sum() -> None:
    rng = np.random.default_rng(3)
    n, shards, skip = 300, 4, 2
    dst = rng.standard_normal(n).astype(lg.bf16.np)
    qs, ss = zip(*(ref.quantize_i8_sr(rng.standard_normal(n).astype(np.float32), 10 + k, 0) for k in range(shards)))
    got = ref.dequant_reduce_sr(dst, np.concatenate(qs), np.concatenate(ss), shards, skip, 0.25, 99, 5)
    acc = dst.astype(np.float32)
    for k in range(shards):
        if k != skip:
            acc = (acc + (qs[k].astype(np.float32) * np.repeat(ss[k], QB)[:n]).astype(np.float32)).astype(np.float32)
    want = ref.round_sr((acc * np.float32(0.25)).astype(np.float32), 99, 5, lg.bf16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_ops_refuse_bad_arguments_before_anything_is_queued() -> None:
    dev = lg.HostDevice()
    x = lg.from_numpy(np.ones(300, np.float32), dev, name="x")
    q = dev.alloc((300,), lg.byte, name="q")
    s = dev.alloc((3,), lg.fp32, name="s")
    q.numpy()[:] = 7
    bad = [(lambda: ops.bind_quantize_i8_sr(q, dev.alloc((2,), lg.fp32), x), ValueError, "one scale per"),
           (lambda: ops.bind_quantize_i8_sr(s, s, x), TypeError, "byte"),
           (lambda: ops.bind_quantize_i8_sr(q, s, x, index_offset=-1), ValueError, "index_offset"),
           (lambda: ops.bind_dequant_reduce_sr(x, q, s, 2), ValueError, "2 slot"),
           (lambda: ops.bind_dequant_reduce_sr(x, q, s, 1, skip=1), ValueError, "skip"),
           (lambda: ops.bind_dequant_reduce_sr(x, q, s, 1, scale=float("nan")), ValueError, "scale")]
    for call, exc, match in bad:
        with pytest.raises(exc, match=match):
            call()
    assert (q.numpy() == 7).all() and (x.numpy() == 1).all()
    ops.bind_quantize_i8_sr(q, s, x, seeds=5)(0)  # the corrected call runs
    assert (q.numpy().view(np.int8) == 127).all() and np.allclose(s.numpy(), 1 / 127)
