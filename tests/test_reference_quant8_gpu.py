"""The 8-bit hop's kernels (kernels/quant8.cu) on the GPU equal the host backend (the numpy
reference) bit for bit: both dtypes, partial blocks, misaligned noise offsets, pinned memory,
non-finite blocks, the seed counter's rounding; and ``hierarchical`` with
``cross_node_bits=8`` through the loopback equals the host backend."""
from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest
from test_loopback_split import hierarchical

import lowgrad as lg
from lowgrad import ops
from lowgrad.sr.reference import QBLOCK

pytestmark = pytest.mark.gpu


def _values(rng: np.random.Generator, n: int, dtype: lg.DType) -> np.ndarray:
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)
    if n > 3 * QBLOCK:
        x[QBLOCK + 3], x[2 * QBLOCK + 9], x[-1] = np.nan, np.inf, 0.0
        x[3 * QBLOCK:4 * QBLOCK] = 0.0
    return x.astype(dtype.np)


def _quantize(dev: Any, x: np.ndarray, dtype: lg.DType, seed: int, offset: int, kind: str) -> tuple[Any, Any]:
    xt = dev.alloc(x.shape, dtype, kind=kind, name="x")
    dev.copy_from_host(xt, x)
    q = dev.alloc(x.shape, lg.byte, kind=kind, name="q")
    s = dev.alloc((-(-x.size // QBLOCK),), lg.fp32, kind=kind, name="s")
    ops.bind_quantize_i8_sr(q, s, xt, offset, seed)(0)
    dev.synchronize()
    return q.numpy().copy(), s.numpy().copy()


@pytest.mark.parametrize("n", [1, 127, 129, 4097, 1_000_003])
@pytest.mark.parametrize("dtype", [lg.fp32, lg.bf16], ids=["f32", "bf16"])
def test_quantize_equals_host(gpu: lg.Device, dtype: lg.DType, n: int) -> None:
    rng = np.random.default_rng(n)
    x = _values(rng, n, dtype)
    seed, offset = secrets.randbits(64), int(rng.integers(0, 1 << 40))
    for kind in ("device", "pinned"):
        got, want = _quantize(gpu, x, dtype, seed, offset, kind), _quantize(lg.HostDevice(), x, dtype, seed, offset,
                                                                               "device")
        assert np.array_equal(got[0], want[0]), f"q, n={n} seed={seed} offset={offset} {kind}"
        assert np.array_equal(got[1].view(np.uint32), want[1].view(np.uint32)), f"scales, n={n} seed={seed}"


@pytest.mark.parametrize("n", [1, 129, 1_000_003])
@pytest.mark.parametrize("dtype", [lg.fp32, lg.bf16], ids=["f32", "bf16"])
def test_dequant_reduce_equals_host(gpu: lg.Device, dtype: lg.DType, n: int) -> None:
    rng = np.random.default_rng(n + 1)
    shards, skip = 4, 1
    q = rng.integers(-127, 128, shards * n).astype(np.int8).view(np.uint8)
    s = (rng.random(shards * -(-n // QBLOCK)) * 1e-2).astype(np.float32)
    s[0] = np.nan
    dst0 = _values(rng, n, dtype)
    seed, offset = secrets.randbits(64), int(rng.integers(0, 1 << 40))
    out = []
    for dev in (gpu, lg.HostDevice()):
        d, qt, st = (dev.alloc(a.shape, dt, name=nm) for a, dt, nm in ((dst0, dtype, "d"), (q, lg.byte, "q"),
                                                                        (s, lg.fp32, "s")))
        for t, a in ((d, dst0), (qt, q), (st, s)):
            dev.copy_from_host(t, a)
        ops.bind_dequant_reduce_sr(d, qt, st, shards, skip, 0.25, offset, seed)(0)
        host = np.empty(n, dtype.np)
        dev.copy_to_host(host, d)
        out.append(host.view(np.uint16 if dtype is lg.bf16 else np.uint32))
    assert np.array_equal(*out), f"n={n} seed={seed} offset={offset}"


@pytest.mark.parametrize("world,group", [(4, 2), (8, 2)])
@pytest.mark.parametrize("rounding", ["sr", "ldsr"])
def test_hierarchical_int8_hop_equals_the_host_backend(world: int, group: int, rounding: str) -> None:
    job = hierarchical(group, True, rounding, cross_node_bits=8)
    for a, b in zip(lg.run_threads(world, job, backend="cuda", share_gpu=True, timeout=60), lg.run_threads(world, job)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
