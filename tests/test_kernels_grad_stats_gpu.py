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
from lowgrad.contracts.kernel_source import kernel_for
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


def fused_stats(dev: Any, pairs: list[tuple[np.ndarray, np.ndarray]],
                rounding: str) -> tuple[list[np.ndarray], np.ndarray]:
    """One launch of the fused SR add ``a += b`` over every pair, at micro-step 2 on ``dev``: (the
    sums, b's rows of (sum of squares, non-finite count, largest finite |x|), one per pair)."""
    s = dev.stream()
    counter = SeedCounter(dev, 3, 1, s, rounding=rounding)
    counter.next_micro(s.handle)
    counter.next_micro(s.handle)
    dsts = [lg.from_numpy(a, dev, name="shard") for a, _ in pairs]
    grads = [lg.from_numpy(b, dev, name="grad") for _, b in pairs]
    out = dev.alloc((3, len(pairs), 3), lg.fp64, name="out")
    lg.ops.fill_nan(out, s)
    sink = lg.ops.stats_sink(out, counter)
    columns = list(range(len(pairs)))
    lg.ops.bind_add_sr_multi([(d, d, g, 0) for d, g in zip(dsts, grads)], (counter, 0, [2 * i for i in columns]),
                             stats=(sink, columns))(s.handle)
    counter.next_step(s.handle)
    lg.ops.bind_stats_finish(sink)(s.handle)
    s.synchronize()
    return [d.numpy().copy() for d in dsts], out.numpy()[2].copy()


@pytest.mark.parametrize("rounding", ["sr", "ldsr"])
@pytest.mark.parametrize("dtypes", [(lg.bf16, lg.bf16), (lg.bf16, lg.fp32), (lg.fp32, lg.bf16), (lg.fp32, lg.fp32)],
                         ids=lambda d: "-".join(t.name for t in d))
def test_add_sr_multi_with_stats_groups_off_the_common_path(gpu: lg.Device, dtypes: tuple[lg.DType, lg.DType],
                                                           rounding: str) -> None:
    """The fused kernel's fast path sends b's group to its rare path (which counts non-finite
    values and finds the largest finite |x|) on the add's own finiteness test of a + b where the
    shard is bf16, else on b's sum of squares. Each case in its own tensor of one launch, its
    values in a thread's first or second group of a chunk: a NaN or Inf in the shard with b's
    largest |x| in that group (the rare path must find it), a + b that overflows, b's squares
    that overflow (a finite sum: the common path), a NaN and an Inf in b beside b's largest |x|.
    The counts and maxima are the reference's; the sum of squares within 1e-5 of it, or +Inf where
    float32 squares overflow (docs/diagnostics.md), NaN where b has a NaN; the sums' bits equal the
    host backend's. SR and LDSR (the fast path with the noise's shift)."""
    d_dt, b_dt = dtypes
    n, second = 1 << 16, 8 * 256  # whole chunks (the fast path); a thread's second group: 256 groups on
    rng = np.random.default_rng(7)
    cases: dict[str, tuple[np.ndarray, np.ndarray, int, float]] = {}  # name: (a, b, count, largest |x|)

    def case(name: str, count: int, largest: float, **at: tuple[int, float, float | None]) -> None:
        a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        for i, x, y in at.values():
            a[i] = x
            if y is not None:
                b[i] = y
        cases[name] = (a.astype(d_dt.np), b.astype(b_dt.np), count, float(np.float32(largest).astype(b_dt.np)))
    case("plain", 0, 0.0)
    case("non-finite shard", 0, 7.25, nan=(8 * 3 + 1, np.nan, None), big=(8 * 3 + 6, 0.0, 7.25),
         inf=(second + 8 * 5 + 2, np.inf, None))
    case("a + b overflows", 0, 3e38, top=(second + 8 * 7, 3e38, 3e38))
    case("b's squares overflow", 0, 2e30, top=(8 * 11 + 4, 0.0, 2e30))
    case("non-finite b", 2, 6.5, inf=(second + 8 * 13 + 6, 0.0, -np.inf), big=(second + 8 * 13 + 1, 0.0, -6.5),
         nan=(8 * 17 + 2, 0.0, np.nan))
    pairs = [(a, b) for a, b, _, _ in cases.values()]
    (dev_sums, dev_rows), (host_sums, host_rows) = fused_stats(gpu, pairs, rounding), \
        fused_stats(lg.HostDevice(), pairs, rounding)
    for (name, (_, b, count, largest)), dev, host, dev_sum, host_sum in zip(cases.items(), dev_rows, host_rows,
                                                                           dev_sums, host_sums):
        ref = lg.reference.grad_stats(b)
        if name != "plain":
            assert ref[1:] == (count, largest), (name, ref)  # the case is what it says
        assert np.array_equal(host, ref, equal_nan=True) and (dev[1], dev[2]) == ref[1:], (name, rounding, dev, ref)
        v = b.astype(np.float64)
        if np.isnan(ref[0]):
            assert np.isnan(dev[0]), (name, dev)
        elif np.any(np.abs(v) >= 2.0 ** 64):  # float32 squares overflow
            assert dev[0] == np.inf, (name, dev)
        else:
            assert abs(dev[0] - ref[0]) <= 1e-5 * ref[0], (name, dev, ref)
        nan = np.isnan(dev_sum.astype(np.float64))
        assert np.array_equal(nan, np.isnan(host_sum.astype(np.float64))), name
        assert np.array_equal(dev_sum[~nan].view(np.uint8), host_sum[~nan].view(np.uint8)), (name, rounding)


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
