"""The gradient-statistics kernels on the GPU against their definition (sr.reference.grad_stats):
the non-finite count and the largest |x| exact, the sum of squares within a relative 1e-5 (the
device sums in float32 per thread, in an order fixed by its launch shape), and the same bits from
run to run; the standalone kernel (kernels/grad_stats.cu) over every tail case, special values,
many tensors and counter rows; the multi-tensor add_sr with statistics, whose adds keep the plain
kernel's bits."""
from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.core.kernel_source import kernel_for
from lowgrad.sr.seedcounter import SeedCounter

pytestmark = pytest.mark.gpu

SIZES = [1, 7, 8, 9, 255, 4095, 4096, 4097, 256 * 8 + 3, 70_003, 1 << 20, 3_000_001]


def values(rng: np.random.Generator, n: int, dtype: lg.DType) -> np.ndarray:
    x = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))
    return x.astype(np.float32).astype(dtype.np)


def close_to_reference(got: np.ndarray, x: np.ndarray, what: str) -> None:
    """One (sumsq, nonfinite, maxabs) row against the reference of ``x``."""
    s, c, m = lg.reference.grad_stats(x)
    assert got[1] == c and got[2] == m, (what, got, (s, c, m))
    if np.isfinite(s):
        assert abs(got[0] - s) <= 1e-5 * s, (what, got[0], s)
    else:
        assert np.isnan(got[0]) == np.isnan(s) and (np.isnan(s) or got[0] == s), (what, got[0], s)


def measure(dev: Any, ts: list[lg.Tensor], rows: int, row: int, columns: list[int]) -> np.ndarray:
    out = dev.alloc((rows, max(columns) + 1, 3), lg.fp64, name="out")
    s = dev.stream()
    lg.ops.fill_nan(out, s)
    sink = lg.ops.stats_sink(out)
    run, finish = lg.ops.bind_grad_stats(ts, sink, columns, row), lg.ops.bind_stats_finish(sink)
    run(s.handle)
    finish(s.handle)
    s.synchronize()
    return out.numpy().copy()


@pytest.mark.parametrize("dtype", [lg.fp32, lg.bf16], ids=lambda d: d.name)
def test_grad_stats_is_the_reference(gpu: lg.Device, dtype: lg.DType) -> None:
    """20 tensors (two launches) of every tail size, one misaligned view, columns out of order,
    NaN and Inf in some: every row matches the reference, other rows are untouched, and a second
    run gives the same bits."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    xs = [values(rng, n, dtype) for n in SIZES] + [values(rng, n, dtype) for n in (3, 17, 1000, 5, 4096 * 3, 33, 2, 1)]
    xs[2][3] = np.nan
    xs[5][0], xs[5][-1] = np.inf, -np.inf
    ts = [lg.from_numpy(x, gpu, name="x") for x in xs]
    ts[4] = lg.from_numpy(np.concatenate([values(rng, 1, dtype), xs[4]]), gpu, name="x").view(1, xs[4].size)
    columns = list(reversed(range(len(xs))))
    got = measure(gpu, ts, 3, 1, columns)
    for i, x in enumerate(xs):
        close_to_reference(got[1, columns[i]], x, f"tensor {i} n={x.size} rng={seed}")
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()
    assert np.array_equal(got, measure(gpu, ts, 3, 1, columns), equal_nan=True)  # run to run


def test_grad_stats_rows_follow_the_counter(gpu: lg.Device) -> None:
    """per_micro: the row is row + the counter's micro-step when the work runs (a captured
    launch replays into the micro-step's row), written by the finish once the step is complete;
    a micro-step whose row is past the end is not measured; after a shorter step the finish
    writes only that step's rows (the longer step's last set is not read again)."""
    rng = np.random.default_rng(1)
    xvs = [values(rng, 10_000, lg.bf16) for _ in range(4)]
    x = gpu.alloc(10_000, lg.bf16, name="x")
    out = gpu.alloc((4, 1, 3), lg.fp64, name="out")
    s = gpu.stream()  # every update of the counter and the rows on this one stream
    counter = SeedCounter(gpu, 5, 0, s)
    sink = lg.ops.stats_sink(out, counter)
    run, finish = lg.ops.bind_grad_stats([x], sink, [0], 1, per_micro=True), lg.ops.bind_stats_finish(sink)
    for micro_steps in (4, 2):  # micro-steps 0..3: rows 1, 2, 3, then 4 (past the end); then rows 1, 2
        lg.ops.fill_nan(out, s)
        for m in range(micro_steps):
            if m:
                counter.next_micro(s.handle)
            lg.ops.copy(x, lg.from_numpy(xvs[m], gpu, name="xv"), s)
            run(s.handle)
            s.synchronize()  # before the next copy's source is freed
        if micro_steps == 4:  # no step is complete yet: nothing to write
            finish(s.handle)
            s.synchronize()
            assert np.isnan(out.numpy()).all()
        counter.next_step(s.handle)
        finish(s.handle)
        s.synchronize()
        got = out.numpy()
        assert np.isnan(got[0]).all()
        for r in range(1, 4):
            if r <= micro_steps:
                close_to_reference(got[r, 0], xvs[r - 1], f"row {r} of a step of {micro_steps}")
            else:
                assert np.isnan(got[r]).all(), (micro_steps, r, got[r])


@pytest.mark.parametrize("dtypes", [(lg.bf16, lg.bf16), (lg.bf16, lg.fp32), (lg.fp32, lg.bf16), (lg.fp32, lg.fp32)],
                         ids=lambda d: "-".join(t.name for t in d))
def test_add_sr_multi_with_stats_measures_what_it_adds(gpu: lg.Device, dtypes: tuple[lg.DType, lg.DType]) -> None:
    """Three micro-steps of 20 tensors through the fused kernel: the sums keep the plain kernel's
    bits (NaN where it has NaN), row m holds micro-step m's b (m >= 1), row 0 the shard a holds
    at micro-step 1 (micro-step 0's sum), and a second run gives the same bits."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    d_dt, b_dt = dtypes
    sizes = [1, 7, 9, 4096, 256 * 8 + 3, 70_003, 1 << 18, 3, 17, 1000] * 2
    first = [values(rng, n, d_dt) for n in sizes]
    grads = [[values(rng, n, b_dt) for n in sizes] for _ in range(3)]
    grads[2][5][7] = np.nan

    def run(stats: bool) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        s = gpu.stream()  # every update of the counter and the rows on this one stream
        counter = SeedCounter(gpu, 9, 4, s, rounding="sr")
        dsts = [lg.from_numpy(x, gpu, name="shard") for x in first]
        bs = [gpu.alloc(n, b_dt, name="grad") for n in sizes]
        gs = [[lg.from_numpy(g, gpu, name="g") for g in grads[m]] for m in range(3)]
        out = gpu.alloc((3, len(sizes), 3), lg.fp64, name="out")
        lg.ops.fill_nan(out, s)
        sink = lg.ops.stats_sink(out, counter)
        add = lg.ops.bind_add_sr_multi([(d, d, b, 3 * i) for i, (d, b) in enumerate(zip(dsts, bs))],
                                       (counter, 2, [2 * i for i in range(len(sizes))]),
                                       stats=(sink, list(range(len(sizes)))) if stats else None)
        finish = lg.ops.bind_stats_finish(sink)
        after0: list[np.ndarray] = []
        for m in range(3):
            for b, g in zip(bs, gs[m]):
                lg.ops.copy(b, g, stream=s)
            if m:
                counter.next_micro(s.handle)
            add(s.handle)
            if m == 0:
                s.synchronize()
                after0 = [d.numpy().copy() for d in dsts]
        counter.next_step(s.handle)
        finish(s.handle)
        s.synchronize()
        return [d.numpy().copy() for d in dsts], after0, out.numpy().copy()
    plain, after0, _ = run(False)
    fused, _, got = run(True)
    again, _, got2 = run(True)
    for i in range(len(sizes)):
        p, f = plain[i].astype(np.float64), fused[i].astype(np.float64)
        assert np.array_equal(np.isnan(p), np.isnan(f)), (i, f"rng={seed}")
        assert np.array_equal(plain[i][~np.isnan(p)].view(np.uint8), fused[i][~np.isnan(f)].view(np.uint8)), i
        for m in (1, 2):
            close_to_reference(got[m, i], grads[m][i], f"b of micro-step {m}, tensor {i}, rng={seed}")
        close_to_reference(got[0, i], after0[i], f"a at micro-step 1, tensor {i}, rng={seed}")
    assert got[2, 5, 1] == 1 and np.isnan(got[2, 5, 0])  # micro-step 2's NaN, counted
    assert np.array_equal(got, got2, equal_nan=True) and all(
        np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(fused, again))  # run to run


def fused_stats(dev: Any, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One SR add ``a + b`` with statistics at micro-step 2 on ``dev``: (the sum, b's row of
    (sum of squares, non-finite count, largest finite |x|))."""
    s = dev.stream()
    counter = SeedCounter(dev, 3, 1, s, rounding="sr")
    counter.next_micro(s.handle)
    counter.next_micro(s.handle)
    dst, grad = lg.from_numpy(a, dev, name="shard"), lg.from_numpy(b, dev, name="grad")
    out = dev.alloc((3, 1, 3), lg.fp64, name="out")
    lg.ops.fill_nan(out, s)
    sink = lg.ops.stats_sink(out, counter)
    lg.ops.bind_add_sr_multi([(dst, dst, grad, 0)], (counter, 0, [0]), stats=(sink, [0]))(s.handle)
    counter.next_step(s.handle)
    lg.ops.bind_stats_finish(sink)(s.handle)
    s.synchronize()
    return dst.numpy().copy(), out.numpy()[2, 0].copy()


@pytest.mark.parametrize("dtypes", [(lg.bf16, lg.bf16), (lg.bf16, lg.fp32), (lg.fp32, lg.bf16), (lg.fp32, lg.fp32)],
                         ids=lambda d: "-".join(t.name for t in d))
def test_add_sr_multi_with_stats_groups_off_the_common_path(gpu: lg.Device, dtypes: tuple[lg.DType, lg.DType]) -> None:
    """The fused kernel's fast path sends a group to its rare path on the add's own finiteness test
    where the shard is bf16 (a non-finite b makes a + b non-finite), else on b's sum of squares.
    Groups that take it for another reason measure b as the common path does: a NaN or Inf in
    the shard, a sum a + b that overflows, and b's squares that overflow (sum of squares +Inf,
    nothing counted). The count and the largest |x| are the reference's, as on the host backend;
    the sum of squares is +Inf (float32 squares overflow, docs/diagnostics.md); the sums' bits
    equal the host backend's."""
    d_dt, b_dt = dtypes
    n = 1 << 16  # whole chunks: every group below goes through the fast path
    rng = np.random.default_rng(7)
    a = rng.standard_normal(n).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    a[8 * 3 + 1], a[8 * 5 + 2] = np.nan, np.inf  # non-finite shard, finite b
    a[8 * 7], b[8 * 7] = 3e38, 3e38  # a + b overflows; b's largest finite |x|
    b[8 * 11 + 4] = 2e30  # its square overflows; a + b is finite
    a, b = a.astype(d_dt.np), b.astype(b_dt.np)
    for inf_in_b in (False, True):
        b[8 * 13 + 6] = -np.inf if inf_in_b else 0.0  # counted
        (dev_sum, dev_row), (host_sum, host_row) = fused_stats(gpu, a, b), fused_stats(lg.HostDevice(), a, b)
        ref = lg.reference.grad_stats(b)
        assert ref[1:] == (int(inf_in_b), float(b[8 * 7])) and tuple(host_row) == ref
        assert (dev_row[1], dev_row[2]) == ref[1:], (inf_in_b, dev_row, ref)
        assert dev_row[0] == np.inf, (inf_in_b, dev_row)  # float32 squares of |x| >= 1.8e19 overflow
        nan = np.isnan(dev_sum.astype(np.float64))
        assert np.array_equal(nan, np.isnan(host_sum.astype(np.float64))) and nan[8 * 3 + 1]
        assert np.array_equal(dev_sum[~nan].view(np.uint8), host_sum[~nan].view(np.uint8))


@pytest.mark.parametrize("dtypes", [(lg.bf16, lg.bf16), (lg.bf16, lg.fp32)], ids=lambda d: "-".join(t.name for t in d))
def test_add_sr_multi_with_stats_keeps_the_plain_kernels_occupancy(gpu: lg.Device,
                                                                   dtypes: tuple[lg.DType, lg.DType]) -> None:
    """The statistics ride in the bf16-shard add without costing it a resident block per SM: run
    43 measured 7% on the micro-step when ptxas gave the fused kernel 96 registers (2 blocks per
    SM) instead of 80 (3, as the plain kernel)."""
    k = gpu.kernels
    d, b = dtypes
    plain, fused = (k.kernel(kernel_for(stem, d, d, b)) for stem in ("add_sr_multi", "add_sr_multi_stats"))
    assert k.resident_blocks(fused.func, fused.block) == k.resident_blocks(plain.func, plain.block) \
        >= 3 * gpu.sm_count, (k.resident_blocks(fused.func, fused.block), k.resident_blocks(plain.func, plain.block))
