"""The gradient-statistics kernels on the GPU against their definition (sr.reference.grad_stats),
bit for bit: the standalone kernel (kernels/grad_stats.cu) over every tail case, special values,
many tensors and counter rows; the multi-tensor add_sr with statistics, whose adds stay the bits
of the plain kernel."""
from __future__ import annotations

import secrets

import numpy as np
import pytest

import lowgrad as lg
from lowgrad.sr.seedcounter import SeedCounter

pytestmark = pytest.mark.gpu

SIZES = [1, 7, 8, 9, 255, 4095, 4096, 4097, 256 * 8 + 3, 70_003, 1 << 20, 3_000_001]


def values(rng: np.random.Generator, n: int, dtype: lg.DType) -> np.ndarray:
    x = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))
    return x.astype(np.float32).astype(dtype.np)


def rows(out: lg.Tensor) -> np.ndarray:
    return out.numpy().copy()


def want(x: np.ndarray) -> np.ndarray:
    return np.asarray(lg.reference.grad_stats(x), np.float64)


@pytest.mark.parametrize("dtype", [lg.fp32, lg.bf16], ids=lambda d: d.name)
def test_grad_stats_is_the_reference(gpu: lg.Device, dtype: lg.DType) -> None:
    """20 tensors (two launches) of every tail size, one misaligned view, columns out of order,
    NaN, Inf and huge values in some: every row is the reference's, bit for bit."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    xs = [values(rng, n, dtype) for n in SIZES] + [values(rng, n, dtype) for n in (3, 17, 1000, 5, 4096 * 3, 33, 2, 1)]
    xs[2][3] = np.nan
    xs[5][0], xs[5][-1] = np.inf, -np.inf
    xs[7][:4] = np.float32(3e38)  # squares overflow float32: the sum is inf, the count 0
    ts = [lg.from_numpy(x, gpu, name="x") for x in xs]
    ts[4] = lg.from_numpy(np.concatenate([values(rng, 1, dtype), xs[4]]), gpu, name="x").view(1, xs[4].size)
    out = gpu.alloc((3, len(xs), 3), lg.fp64, name="out")
    lg.ops.fill_nan(out)
    columns = list(reversed(range(len(xs))))
    s = gpu.stream()
    lg.ops.bind_grad_stats(ts, out, columns, 1)(s.handle)
    s.synchronize()
    got = rows(out)
    for i, x in enumerate(xs):
        assert np.array_equal(got[1, columns[i]], want(x), equal_nan=True), (i, x.size, f"rng={seed}")
    assert np.isnan(got[0]).all() and np.isnan(got[2]).all()  # other rows untouched


def test_grad_stats_rows_follow_the_counter(gpu: lg.Device) -> None:
    """With a seed counter, the row is row + its micro-step when the work runs (a captured
    launch replays into the micro-step's row); a row past the end is not written."""
    rng = np.random.default_rng(1)
    x = lg.from_numpy(values(rng, 10_000, lg.bf16), gpu, name="x")
    out = gpu.alloc((4, 1, 3), lg.fp64, name="out")
    lg.ops.fill_nan(out)
    counter = SeedCounter(gpu, 5, 0)
    s = gpu.stream()
    run = lg.ops.bind_grad_stats([x], out, [0], 1, counter=counter)
    for _ in range(4):  # micro-steps 0..3: rows 1, 2, 3, then 4 (past the end)
        run(s.handle)
        counter.next_micro(s.handle)
    s.synchronize()
    got = rows(out)
    assert np.isnan(got[0]).all()
    for r in (1, 2, 3):
        assert np.array_equal(got[r, 0], want(x.numpy()))


@pytest.mark.parametrize("dtypes", [(lg.bf16, lg.bf16), (lg.bf16, lg.fp32), (lg.fp32, lg.bf16), (lg.fp32, lg.fp32)],
                         ids=lambda d: "-".join(t.name for t in d))
def test_add_sr_multi_with_stats_equals_the_host_twin(gpu: lg.Device, dtypes: tuple[lg.DType, lg.DType]) -> None:
    """Three micro-steps of 20 tensors through the fused kernel on the GPU and on the host backend
    (whose twin computes sr.reference.grad_stats): the sums are the plain kernel's bits, and every
    row (b's statistics at each micro-step, a's at micro-step 1 in row 0) equals the host's."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    d_dt, b_dt = dtypes
    sizes = [1, 7, 9, 4096, 256 * 8 + 3, 70_003, 1 << 18, 3, 17, 1000] * 2
    first = [values(rng, n, d_dt) for n in sizes]
    grads = [[values(rng, n, b_dt) for n in sizes] for _ in range(3)]
    grads[2][5][7] = np.nan

    def run(dev: object, stats: bool) -> tuple[list[np.ndarray], np.ndarray]:
        counter = SeedCounter(dev, 9, 4, rounding="sr")
        dsts = [lg.from_numpy(x, dev, name="shard") for x in first]
        bs = [dev.alloc(n, b_dt, name="grad") for n in sizes]  # type: ignore[attr-defined]
        out = dev.alloc((3, len(sizes), 3), lg.fp64, name="out")  # type: ignore[attr-defined]
        lg.ops.fill_nan(out)
        add = lg.ops.bind_add_sr_multi([(d, d, b, 3 * i) for i, (d, b) in enumerate(zip(dsts, bs))],
                                       (counter, 2, [2 * i for i in range(len(sizes))]),
                                       stats=(out, list(range(len(sizes)))) if stats else None)
        s = dev.stream()  # type: ignore[attr-defined]
        for m in range(3):
            for b, g in zip(bs, grads[m]):
                lg.ops.copy(b, lg.from_numpy(g, dev, name="g"), stream=s)
            if m:
                counter.next_micro(s.handle)
            add(s.handle)
        s.synchronize()
        return [d.numpy().copy() for d in dsts], rows(out)
    plain, _ = run(gpu, False)
    fused, got = run(gpu, True)
    host, want_rows = run(lg.HostDevice(), True)
    for i in range(len(sizes)):
        assert np.array_equal(plain[i].view(np.uint8), fused[i].view(np.uint8)), (i, f"rng={seed}")
        assert np.array_equal(fused[i].view(np.uint8), host[i].view(np.uint8)), (i, f"rng={seed}")
    assert np.array_equal(got, want_rows, equal_nan=True), f"rng={seed}"
    assert got[2, 5, 1] == 1 and np.isnan(got[2, 5, 0])  # the NaN of micro-step 2, counted
