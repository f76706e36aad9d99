"""The NVRTC kernels against the host backend (the numpy reference), bit for bit.

Inputs are random (fresh seeds, printed on failure; never all zeros) over sizes that hit every
tail case of the 8-elements-per-thread kernels. Results are compared as raw bits; where NaN is
possible the NaN masks must agree and the bits of every other element must be equal. Every test
needs a GPU (``gpu`` marker) and skips cleanly without one.
"""
from __future__ import annotations

import itertools
import math
import secrets
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import lowgrad as lg
from lowgrad.base.dtypes import as_dtype

pytestmark = pytest.mark.gpu

SR = (lg.fp32, lg.bf16)
SIZES = (1, 7, 8, 9, 255, 256 * 8 + 3, 1 << 20, 3_000_001)
# index offsets: zero, small odd, large non-multiple of 8, and one whose Philox counter crosses
# from the low 32-bit word into the high one inside the tensor
OFFSETS = (0, 5, 8 * 123_457 + 3, (1 << 35) - 8 * 5 + 1)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _ids(dts: tuple[lg.DType, ...]) -> str:
    return "-".join(d.name for d in dts)


@pytest.fixture(scope="module")
def host() -> lg.HostDevice:
    return lg.HostDevice()


def _rng() -> tuple[np.random.Generator, int]:
    seed = secrets.randbits(32)
    return np.random.default_rng(seed), seed


def _values(rng: np.random.Generator, n: int, dtype: lg.DType) -> np.ndarray:
    """Random non-zero values over a wide range of exponents, in ``dtype``."""
    x = rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))
    x[x == 0] = 1.0
    return x.astype(np.float32).astype(dtype.np)


def _offset(rng: np.random.Generator) -> int:
    """A random element offset that is not a multiple of 8."""
    return 8 * int(rng.integers(0, 1 << 40)) + int(rng.integers(1, 8))


def assert_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal shapes and dtypes; equal NaN masks; equal bits everywhere else."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    g, w = got.reshape(-1), want.reshape(-1)
    gn, wn = np.isnan(g.astype(np.float64)), np.isnan(w.astype(np.float64))
    bad_nan = np.flatnonzero(gn != wn)
    assert bad_nan.size == 0, f"{what}: NaN masks differ at {bad_nan.size} elements, first {bad_nan[:5]}"
    u = _UINT[g.dtype.itemsize]
    keep = ~gn
    gb, wb = g.view(u)[keep], w.view(u)[keep]
    bad = np.flatnonzero(gb != wb)
    if bad.size:
        idx = np.flatnonzero(keep)[bad[:5]]
        raise AssertionError(f"{what}: {bad.size} of {g.size} elements differ; first at {idx.tolist()}: "
                             f"got {g[idx].astype(np.float64).tolist()} ({[hex(int(v)) for v in g.view(u)[idx]]}), "
                             f"want {w[idx].astype(np.float64).tolist()} ({[hex(int(v)) for v in w.view(u)[idx]]})")


def _put(dev: Any, arr: np.ndarray, kind: str = "device", name: str = "t") -> lg.Tensor:
    """A new tensor on ``dev`` holding ``arr``; pinned/write-combined are filled through numpy."""
    if kind == "device" or dev.backend == "host":
        return lg.from_numpy(arr, dev, name=name)
    t = dev.alloc(arr.shape, as_dtype(arr.dtype), kind=kind, name=name)
    t.numpy()[...] = arr
    return t


# ---- add_sr ------------------------------------------------------------------------------
def _run_add_sr(gpu: lg.Device, host: lg.HostDevice, a: np.ndarray, b: np.ndarray, dt_dst: lg.DType,
                scale: float, seed: int, offset: int, alias: bool = False, a_kind: str = "device",
                dst_kind: str = "device", stream: Any = "new") -> tuple[np.ndarray, np.ndarray]:
    """(device result, host result) of add_sr on the same inputs."""
    s = gpu.stream() if stream == "new" else stream
    out = []
    for dev in (gpu, host):
        ta, tb = _put(dev, a, a_kind, "a"), _put(dev, b, name="b")
        if alias:
            dst = ta
        else:
            poison = np.full(a.shape, np.nan, np.float32).astype(dt_dst.np)
            dst = _put(dev, poison, dst_kind, "dst")
        lg.ops.add_sr(dst, ta, tb, scale=scale, seed=seed, index_offset=offset, stream=s if dev is gpu else None)
        if dev is gpu:
            gpu.resolve_stream(s).synchronize()
        out.append(np.array(dst.numpy()))
    return out[0], out[1]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dts", list(itertools.product(SR, repeat=3)), ids=_ids)
def test_add_sr_matches_host(gpu: lg.Device, host: lg.HostDevice, dts: tuple[lg.DType, ...], n: int) -> None:
    dt_dst, dt_a, dt_b = dts
    rng, seed = _rng()
    a, b = _values(rng, n, dt_a), _values(rng, n, dt_b)
    runs = [(1.0, 0), (0.125, _offset(rng))] if n <= 1 << 16 else [((1.0, 0.125)[n % 2], OFFSETS[n % 4])]
    runs.append((0.125, OFFSETS[3]))  # the 32-bit counter carry, for every combination
    for scale, off in runs:
        sr_seed = secrets.randbits(64)
        got, want = _run_add_sr(gpu, host, a, b, dt_dst, scale, sr_seed, off)
        assert_bits(got, want, f"add_sr {_ids(dts)} n={n} scale={scale} offset={off} seed={sr_seed} rng={seed}")


def test_add_sr_host_is_the_reference(host: lg.HostDevice) -> None:
    """The host backend used as the oracle above is lowgrad.sr.reference itself."""
    rng, _ = _rng()
    a, b = _values(rng, 2051, lg.fp32), _values(rng, 2051, lg.bf16)
    seed, off = secrets.randbits(64), _offset(rng)
    dst = host.alloc(2051, lg.bf16, name="dst")
    lg.ops.add_sr(dst, lg.from_numpy(a, host), lg.from_numpy(b, host), scale=0.125, seed=seed, index_offset=off)
    assert_bits(dst.numpy(), lg.reference.add_sr(a, b, 0.125, seed, off, out_dtype=lg.bf16), "reference")


@pytest.mark.parametrize("n", [9, 2051, (1 << 20) + 1])
@pytest.mark.parametrize("dts", list(itertools.product(SR, repeat=2)), ids=_ids)
def test_add_sr_dst_aliases_a(gpu: lg.Device, host: lg.HostDevice, dts: tuple[lg.DType, ...], n: int) -> None:
    dt_a, dt_b = dts
    rng, seed = _rng()
    a, b = _values(rng, n, dt_a), _values(rng, n, dt_b)
    sr_seed, off = secrets.randbits(64), _offset(rng)
    got, want = _run_add_sr(gpu, host, a, b, dt_a, 0.125, sr_seed, off, alias=True, stream=None)
    assert_bits(got, want, f"add_sr alias {_ids(dts)} n={n} seed={sr_seed} offset={off} rng={seed}")


@pytest.mark.parametrize("n", [1, 7, 9, 256 * 8 + 3, 3_000_001])
@pytest.mark.parametrize("dts", list(itertools.product(SR, repeat=2)), ids=_ids)
def test_scale_sr_is_the_reference(gpu: lg.Device, dts: tuple[lg.DType, ...], n: int) -> None:
    """scale_sr, the kernel built from its contract declaration: equal to
    lowgrad.sr.reference.scale_sr bit for bit, aliased (dst is a), misaligned (a view at element
    1) and across the 32-bit Philox counter carry."""
    dt_dst, dt_a = dts
    rng, seed = _rng()
    a = _values(rng, n + 1, dt_a)
    s = gpu.stream()
    for off, start, alias in ((_offset(rng), 0, False), (OFFSETS[3], 1, False), (OFFSETS[n % 4], 0, dt_dst is dt_a)):
        sr_seed, scale = secrets.randbits(64), float(rng.choice([1.0, -0.375, 3e-20]))
        ta = lg.from_numpy(a, gpu, name="a")
        dst = ta if alias else gpu.alloc((n + 1,), dt_dst, name="dst")
        lg.ops.scale_sr(dst.view(start, n), ta.view(start, n), scale, sr_seed, off, stream=s)
        s.synchronize()
        want = lg.reference.scale_sr(a[start:start + n], scale, sr_seed, off, out_dtype=dt_dst)
        assert_bits(dst.numpy()[start:start + n], want,
                    f"scale_sr {_ids(dts)} n={n} alias={alias} start={start} offset={off} seed={sr_seed} rng={seed}")


@pytest.mark.parametrize("kind", ["pinned", "write_combined"])
@pytest.mark.parametrize("alias", [True, False])
@pytest.mark.parametrize("dt_dst", SR, ids=lambda d: d.name)
def test_add_sr_dst_in_pinned_memory(gpu: lg.Device, host: lg.HostDevice, dt_dst: lg.DType, alias: bool,
                                     kind: str) -> None:
    rng, seed = _rng()
    n = (1 << 18) + 3
    a, b = _values(rng, n, dt_dst), _values(rng, n, lg.bf16)
    sr_seed, off = secrets.randbits(64), _offset(rng)
    got, want = _run_add_sr(gpu, host, a, b, dt_dst, 1.0, sr_seed, off, alias=alias,
                            a_kind=kind if alias else "device", dst_kind=kind)
    assert_bits(got, want, f"add_sr {kind} dst alias={alias} {dt_dst.name} seed={sr_seed} rng={seed}")


@pytest.mark.parametrize("start", [1, 3])
@pytest.mark.parametrize("dts", list(itertools.product(SR, repeat=3)), ids=_ids)
def test_add_sr_misaligned_views(gpu: lg.Device, host: lg.HostDevice, dts: tuple[lg.DType, ...],
                                 start: int) -> None:
    """Views at element ``start`` (not 16-byte aligned); neighbours of dst stay untouched."""
    dt_dst, dt_a, dt_b = dts
    rng, seed = _rng()
    n, pad = 4099, start + 5
    a, b = _values(rng, n + pad, dt_a), _values(rng, n + pad, dt_b)
    dst0 = _values(rng, n + pad, dt_dst)
    ta, tb, tdst = (lg.from_numpy(x, gpu, name=nm) for x, nm in ((a, "a"), (b, "b"), (dst0, "dst")))
    sr_seed, off = secrets.randbits(64), _offset(rng)
    s = gpu.stream()
    lg.ops.add_sr(tdst.view(start, n), ta.view(start + 1, n), tb.view(start, n), scale=0.125, seed=sr_seed,
                  index_offset=off, stream=s)
    s.synchronize()
    got = tdst.numpy()
    want = lg.reference.add_sr(a[start + 1:start + 1 + n], b[start:start + n], 0.125, sr_seed, off,
                               out_dtype=dt_dst)
    ctx = f"misaligned add_sr {_ids(dts)} start={start} seed={sr_seed} rng={seed}"
    assert_bits(got[start:start + n], want, ctx)
    assert_bits(got[:start], dst0[:start], ctx + " (before)")
    assert_bits(got[start + n:], dst0[start + n:], ctx + " (after)")
    # aliasing a misaligned view
    ta2 = lg.from_numpy(a, gpu, name="a2")
    if dt_a is dt_dst:
        lg.ops.add_sr(ta2.view(start, n), ta2.view(start, n), tb.view(start, n), seed=sr_seed, index_offset=off,
                      stream=s)
        s.synchronize()
        want = lg.reference.add_sr(a[start:start + n], b[start:start + n], 1.0, sr_seed, off, out_dtype=dt_dst)
        got = ta2.numpy()
        assert_bits(got[start:start + n], want, ctx + " (alias)")
        assert_bits(got[:start], a[:start], ctx + " (alias, before)")


_BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
_F32_SPECIAL = np.array([
    np.nan, -np.nan, np.inf, -np.inf, np.finfo(np.float32).max, -np.finfo(np.float32).max, _BF16_MAX, -_BF16_MAX,
    np.nextafter(np.float32(_BF16_MAX), np.float32(np.inf)), 3.3961776e38, -3.3961776e38,  # rounds to bf16 max or Inf
    np.finfo(np.float32).tiny, -np.finfo(np.float32).tiny, 1e-40, -1e-42, 1.4e-45, -1.4e-45,  # denormals
    float(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_subnormal), 0.0, -0.0, 1.0, -1.0, 1.0 + 2 ** -8,
    1.0 + 2 ** -23, 65504.0,
], np.float32)


def _with_specials(rng: np.random.Generator, n: int, dtype: lg.DType) -> np.ndarray:
    x = _values(rng, n, lg.fp32)
    idx = rng.choice(n, size=n // 3, replace=False)
    x[idx] = rng.choice(_F32_SPECIAL, size=idx.size)
    x[:_F32_SPECIAL.size] = _F32_SPECIAL  # each special at least once, deterministic place
    return x.astype(dtype.np)


@pytest.mark.parametrize("scale", [1.0, 0.125])
@pytest.mark.parametrize("dts", list(itertools.product(SR, repeat=3)), ids=_ids)
def test_add_sr_special_values(gpu: lg.Device, host: lg.HostDevice, dts: tuple[lg.DType, ...],
                               scale: float) -> None:
    dt_dst, dt_a, dt_b = dts
    rng, seed = _rng()
    n = 10_007
    a, b = _with_specials(rng, n, dt_a), _with_specials(rng, n, dt_b)
    b[:_F32_SPECIAL.size] = b[:_F32_SPECIAL.size][::-1]  # pair specials with other specials
    sr_seed, off = secrets.randbits(64), _offset(rng)
    got, want = _run_add_sr(gpu, host, a, b, dt_dst, scale, sr_seed, off)
    assert_bits(got, want, f"add_sr specials {_ids(dts)} scale={scale} seed={sr_seed} rng={seed}")


def test_add_sr_noise_is_launch_independent(gpu: lg.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any grid size, and a split into two offset halves, give the same bits as one launch."""
    rng, seed = _rng()
    n = (1 << 20) + 11
    a, b = _values(rng, n, lg.fp32), _values(rng, n, lg.bf16)
    ta, tb = lg.from_numpy(a, gpu, name="a"), lg.from_numpy(b, gpu, name="b")
    sr_seed, off = secrets.randbits(64), _offset(rng)
    want = lg.reference.add_sr(a, b, 1.0, sr_seed, off, out_dtype=lg.bf16)
    dst = gpu.alloc(n, lg.bf16, name="dst")
    for grid in (1, 7, gpu.sm_count, gpu.sm_count * 64):
        monkeypatch.setattr(gpu.kernels, "max_grid", grid)
        lg.ops.fill_zero(dst)
        lg.ops.add_sr(dst, ta, tb, seed=sr_seed, index_offset=off)
        assert_bits(dst.numpy(), want, f"max_grid={grid} seed={sr_seed} rng={seed}")
    monkeypatch.undo()
    h = 333_337
    lg.ops.fill_zero(dst)
    lg.ops.add_sr(dst.view(0, h), ta.view(0, h), tb.view(0, h), seed=sr_seed, index_offset=off)
    lg.ops.add_sr(dst.view(h, n - h), ta.view(h, n - h), tb.view(h, n - h), seed=sr_seed, index_offset=off + h)
    assert_bits(dst.numpy(), want, f"split seed={sr_seed} rng={seed}")


# ---- reduce_sr ---------------------------------------------------------------------------
def _run_reduce_sr(gpu: lg.Device, host: lg.HostDevice, dst0: np.ndarray, src: np.ndarray, n_shards: int,
                   skip: int, scale: float, accumulate: bool, seed: int, offset: int,
                   dst_kind: str = "device") -> tuple[np.ndarray, np.ndarray]:
    s = gpu.stream()
    out = []
    for dev in (gpu, host):
        dst, tsrc = _put(dev, dst0, dst_kind, "dst"), _put(dev, src, name="src")
        lg.ops.reduce_sr(dst, tsrc, n_shards, skip=skip, scale=scale, accumulate=accumulate, seed=seed,
                         index_offset=offset, stream=s if dev is gpu else None)
        if dev is gpu:
            s.synchronize()
        out.append(np.array(dst.numpy()))
    return out[0], out[1]


def _dst0(rng: np.random.Generator, n: int, dtype: lg.DType, accumulate: bool) -> np.ndarray:
    """The initial dst: values to accumulate into, or NaN poison that must be ignored."""
    if accumulate:
        return _values(rng, n, dtype)
    return np.full(n, np.nan, np.float32).astype(dtype.np)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("n_shards", [1, 2, 3, 8])
@pytest.mark.parametrize("dts", list(itertools.product(SR, repeat=2)), ids=_ids)
def test_reduce_sr_matches_host(gpu: lg.Device, host: lg.HostDevice, dts: tuple[lg.DType, ...], n_shards: int,
                                accumulate: bool) -> None:
    dt_dst, dt_src = dts
    rng, seed = _rng()
    n = 256 * 8 + 3
    src = _values(rng, n * n_shards, dt_src)
    for skip, scale in itertools.product(sorted({-1, n_shards // 2, n_shards - 1}), (1.0, 0.125)):
        dst0 = _dst0(rng, n, dt_dst, accumulate)
        sr_seed, off = secrets.randbits(64), _offset(rng)
        got, want = _run_reduce_sr(gpu, host, dst0, src, n_shards, skip, scale, accumulate, sr_seed, off)
        assert_bits(got, want, f"reduce_sr {_ids(dts)} shards={n_shards} skip={skip} scale={scale} "
                               f"acc={accumulate} seed={sr_seed} offset={off} rng={seed}")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dts", list(itertools.product(SR, repeat=2)), ids=_ids)
def test_reduce_sr_sizes(gpu: lg.Device, host: lg.HostDevice, dts: tuple[lg.DType, ...], n: int) -> None:
    dt_dst, dt_src = dts
    rng, seed = _rng()
    src = _values(rng, 3 * n, dt_src)
    for accumulate, off in ((True, OFFSETS[n % 4]), (False, OFFSETS[3])):
        dst0 = _dst0(rng, n, dt_dst, accumulate)
        sr_seed = secrets.randbits(64)
        got, want = _run_reduce_sr(gpu, host, dst0, src, 3, 1, 0.125, accumulate, sr_seed, off)
        assert_bits(got, want, f"reduce_sr {_ids(dts)} n={n} acc={accumulate} seed={sr_seed} offset={off} rng={seed}")


@pytest.mark.parametrize("dts", list(itertools.product(SR, repeat=2)), ids=_ids)
def test_reduce_sr_special_values_pinned_and_misaligned(gpu: lg.Device, host: lg.HostDevice,
                                                        dts: tuple[lg.DType, ...]) -> None:
    dt_dst, dt_src = dts
    rng, seed = _rng()
    n, k = 10_007, 3
    src = _with_specials(rng, n * k, dt_src)
    dst0 = _with_specials(rng, n, dt_dst)
    sr_seed, off = secrets.randbits(64), _offset(rng)
    for kind in ("device", "pinned"):
        got, want = _run_reduce_sr(gpu, host, dst0, src, k, -1, 0.125, True, sr_seed, off, dst_kind=kind)
        assert_bits(got, want, f"reduce_sr specials {kind} {_ids(dts)} seed={sr_seed} rng={seed}")
    # views at odd element offsets (breaking 16-byte alignment); dst's neighbours untouched
    m = n - 7
    tdst, tsrc = lg.from_numpy(dst0, gpu, name="dst"), lg.from_numpy(src, gpu, name="src")
    s = gpu.stream()
    lg.ops.reduce_sr(tdst.view(1, m), tsrc.view(3, k * m), k, skip=2, scale=1.0, accumulate=True, seed=sr_seed,
                     index_offset=off, stream=s)
    s.synchronize()
    got = tdst.numpy()
    want = lg.reference.reduce_sr(dst0[1:1 + m], src[3:3 + k * m], k, 2, 1.0, True, sr_seed, off)
    assert_bits(got[1:1 + m], want, f"reduce_sr misaligned seed={sr_seed} rng={seed}")
    assert_bits(got[:1], dst0[:1], "reduce_sr misaligned (before)")
    assert_bits(got[1 + m:], dst0[1 + m:], "reduce_sr misaligned (after)")


# ---- Philox ------------------------------------------------------------------------------
_KAT = [  # Random123 kat_vectors: counter, key, expected
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def _device_philox(gpu: lg.Device, ctr: np.ndarray, key: np.ndarray) -> np.ndarray:
    n = ctr.shape[0]
    tc = lg.from_numpy(np.ascontiguousarray(ctr, np.uint32).view(np.uint8), gpu, name="philox_ctr")
    tk = lg.from_numpy(np.ascontiguousarray(key, np.uint32).view(np.uint8), gpu, name="philox_key")
    out = gpu.alloc(n * 16, lg.byte, name="philox_out")
    s = gpu.stream()
    gpu.kernels.philox(tc, tk, out, s.handle)
    s.synchronize()
    return out.numpy().view(np.uint32).reshape(n, 4)


def test_philox_known_answers_on_device(gpu: lg.Device) -> None:
    ctr = np.array([c for c, _, _ in _KAT], np.uint32)
    key = np.array([k for _, k, _ in _KAT], np.uint32)
    want = np.array([w for _, _, w in _KAT], np.uint32)
    assert np.array_equal(_device_philox(gpu, ctr, key), want)
    assert np.array_equal(lg.philox4x32_10(ctr, key), want)


@pytest.mark.parametrize("n", [1, 7, 1000, 100_003])
def test_philox_device_matches_host(gpu: lg.Device, n: int) -> None:
    rng, seed = _rng()
    ctr = rng.integers(0, 1 << 32, (n, 4), dtype=np.uint32)
    key = rng.integers(0, 1 << 32, (n, 2), dtype=np.uint32)
    got = _device_philox(gpu, ctr, key)
    want = lg.philox4x32_10(ctr, key)
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, f"rng={seed}: {bad.size} rows differ, first {bad[:5]}"


# ---- fill_zero ---------------------------------------------------------------------------
_FILL_CASES = [(0, 3), (1, 0), (1, 1), (3, 5), (7, 1), (15, 3), (17, 13), (255, 1), (4097, 7), ((1 << 20) + 3, 5),
               (3_000_001, 1)]


@pytest.mark.parametrize("kind", ["device", "pinned"])
@pytest.mark.parametrize("dtype", [lg.byte, lg.bf16, lg.fp32], ids=lambda d: d.name)
@pytest.mark.parametrize("n,start", _FILL_CASES)
def test_fill_zero_only_the_target(gpu: lg.Device, dtype: lg.DType, kind: str, n: int, start: int) -> None:
    total = start + n + 77
    poison = np.full(total * dtype.itemsize, 0xFF, np.uint8)
    buf = _put(gpu, poison, kind, "fill_buf")
    t = lg.Tensor(buf.allocation, 0, dtype, (total,), "fill_buf")  # the same bytes, typed
    s = gpu.stream()
    lg.ops.fill_zero(t.view(start, n), stream=s)
    s.synchronize()
    got = buf.numpy().reshape(-1)
    lo, hi = start * dtype.itemsize, (start + n) * dtype.itemsize
    assert not got[lo:hi].any(), f"{np.count_nonzero(got[lo:hi])} target bytes not zeroed"
    assert (got[:lo] == 0xFF).all() and (got[hi:] == 0xFF).all(), "a neighbour byte was written"


@pytest.mark.parametrize("kind", ["device", "pinned"])
@pytest.mark.parametrize("dtype", [lg.bf16, lg.fp32], ids=lambda d: d.name)
@pytest.mark.parametrize("n,start", _FILL_CASES)
def test_fill_nan_only_the_target(gpu: lg.Device, dtype: lg.DType, kind: str, n: int, start: int) -> None:
    total = start + n + 77
    buf = _put(gpu, np.full(total * dtype.itemsize, 0x11, np.uint8), kind, "nan_buf")
    t = lg.Tensor(buf.allocation, 0, dtype, (total,), "nan_buf")
    s = gpu.stream()
    lg.ops.fill_nan(t.view(start, n), stream=s)
    s.synchronize()
    got = buf.numpy().reshape(-1)
    lo, hi = start * dtype.itemsize, (start + n) * dtype.itemsize
    assert (got[lo:hi] == 0xFF).all(), "a target byte is not 0xFF"
    assert np.isnan(got[lo:hi].view(dtype.np).astype(np.float32)).all()
    assert (got[:lo] == 0x11).all() and (got[hi:] == 0x11).all(), "a neighbour byte was written"


# ---- norm_squared ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 255, 2051, 1_000_000, 3_000_001])
@pytest.mark.parametrize("out_dt", [lg.fp32, lg.fp64], ids=lambda d: d.name)
@pytest.mark.parametrize("x_dt", SR, ids=lambda d: d.name)
def test_norm_squared(gpu: lg.Device, x_dt: lg.DType, out_dt: lg.DType, n: int) -> None:
    rng, seed = _rng()
    x = rng.standard_normal(n).astype(np.float32).astype(x_dt.np)
    x[x == 0] = 1
    ref = float(np.sum(np.square(x.astype(np.float64))))
    tol = 1e-5 if out_dt is lg.fp32 else 1e-12
    tx = lg.from_numpy(x, gpu, name="x")
    out = lg.from_numpy(np.full(1, np.nan, out_dt.np), gpu, name="norm")  # overwritten, not added to
    s = gpu.stream()
    lg.ops.norm_squared(tx, out, stream=s)
    s.synchronize()
    v = out.numpy()
    assert v.dtype == out_dt.np and v.shape == (1,)
    assert abs(float(v[0]) - ref) <= tol * ref, f"n={n} rng={seed}: {float(v[0])!r} vs {ref!r}"
    for _ in range(3):  # deterministic: the same bits every time
        lg.ops.norm_squared(tx, out, stream=s)
        s.synchronize()
        assert out.numpy().view(_UINT[out_dt.itemsize])[0] == v.view(_UINT[out_dt.itemsize])[0]
    start = 12.5
    acc = lg.from_numpy(np.full(1, start, out_dt.np), gpu, name="norm_acc")
    lg.ops.norm_squared(tx, acc, accumulate=True, stream=s)
    lg.ops.norm_squared(tx, acc, accumulate=True, stream=s)
    s.synchronize()
    want = start + 2 * ref
    assert abs(float(acc.numpy()[0]) - want) <= 2 * tol * want, f"accumulate n={n} rng={seed}"


def test_norm_squared_pinned_misaligned_empty(gpu: lg.Device) -> None:
    rng, seed = _rng()
    n = 100_003
    x = rng.standard_normal(n + 1).astype(np.float32)
    ref = float(np.sum(np.square(x[1:].astype(np.float64))))
    tx = _put(gpu, x, "pinned", "x")
    out = gpu.alloc(1, lg.fp64, kind="pinned", name="norm")
    lg.ops.norm_squared(tx.view(1, n), out)
    gpu.synchronize()
    assert abs(float(out.numpy()[0]) - ref) <= 1e-12 * ref, f"rng={seed}"
    empty = gpu.alloc(0, lg.fp32, name="empty")
    for out_dt in (lg.fp32, lg.fp64):
        o = lg.from_numpy(np.full(1, 3.0, out_dt.np), gpu, name="norm")
        lg.ops.norm_squared(empty, o, accumulate=True)
        assert float(o.numpy()[0]) == 3.0
        lg.ops.norm_squared(empty, o)
        assert float(o.numpy()[0]) == 0.0


def test_norms_of_threads_sharing_a_stream_do_not_mix(gpu: lg.Device) -> None:
    """Ranks as threads of one process on one GPU (the loopback) queue their norms on the same
    stream (the legacy stream, ``stream=None``): each norm is its own tensor's, never a mix of
    partial sums (the two stages share a per-stream workspace; at aa19078 a world-2 manager's
    grad_norm_squared came out 10-20 % low)."""
    import threading
    rng, seed = _rng()
    xs = [rng.standard_normal(300_001).astype(np.float32) * (k + 1) for k in range(4)]
    refs = [float(np.sum(np.square(x.astype(np.float64)))) for x in xs]
    txs = [lg.from_numpy(x, gpu, name=f"x{k}") for k, x in enumerate(xs)]
    outs = [gpu.alloc(1, lg.fp64, name=f"norm{k}") for k in range(4)]
    bad: list[str] = []
    start = threading.Barrier(4)

    def rank(k: int) -> None:
        try:
            gpu.activate()  # the device's context, current on this thread
            start.wait()
            for i in range(200):
                lg.ops.norm_squared(txs[k], outs[k], accumulate=i > 0)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            bad.append(f"thread {k} raised {exc!r}")
    threads = [threading.Thread(target=rank, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gpu.synchronize()
    for k in range(4):
        got, want = float(outs[k].numpy()[0]), 200 * refs[k]
        if abs(got - want) > 1e-9 * want:
            bad.append(f"thread {k}: {got!r} vs {want!r}")
    assert not bad, f"rng={seed}: {bad}"


def test_launches_look_nothing_up_after_the_first(gpu: lg.Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch's hot path takes its kernels from caches: after one norm_squared and one add_sr
    per dtype pair, the kernel tables and the kernel directory are never read again (a 0.5B
    model's gradient norm once spent ~0.2 ms of host time per tensor there)."""
    from lowgrad.cuda import compiler
    from lowgrad.cuda import kernels as cuda_kernels
    x = lg.from_numpy(np.ones(1000, np.float32), gpu, name="x")
    y = lg.from_numpy(np.ones(1000, np.float32), gpu, name="y")
    out = gpu.alloc(1, lg.fp32, name="norm")
    lg.ops.norm_squared(x, out)
    lg.ops.add_sr(x, x, y, seed=1)

    def looked_up(*_: Any) -> None:
        raise AssertionError("a kernel lookup in the launch path")
    monkeypatch.setattr(cuda_kernels, "kernel_for", looked_up)
    monkeypatch.setattr(compiler, "kernel_specs", looked_up)
    assert compiler.kernel_dir.cache_info().currsize == 1  # located once per process
    for _ in range(3):
        lg.ops.norm_squared(x, out, accumulate=True)
        lg.ops.add_sr(x, x, y, seed=2)
    gpu.synchronize()
    assert float(out.numpy()[0]) > 0


# ---- bad arguments -----------------------------------------------------------------------
def test_bad_arguments_raise_before_launch(gpu: lg.Device, host: lg.HostDevice,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[str] = []

    def forbid(name: str) -> Callable[..., None]:
        def f(*args: Any, **kw: Any) -> None:
            launched.append(name)
        return f

    for name in ("add_sr", "reduce_sr", "fill", "norm_squared"):
        monkeypatch.setattr(gpu.kernels, name, forbid(name))
    a, b = gpu.alloc(16, lg.bf16, name="a"), gpu.alloc(16, lg.bf16, name="b")
    f32 = gpu.alloc(16, lg.fp32, name="f32")
    big = gpu.alloc(32, lg.bf16, name="big")
    src = gpu.alloc(48, lg.bf16, name="src")
    h = gpu.alloc(16, lg.bf16, kind="host", name="pageable")
    other = host.alloc(16, lg.bf16, name="other_device")
    out = gpu.alloc(1, lg.fp32, name="out")
    ops = lg.ops
    cases: list[tuple[type[Exception], Callable[[], None]]] = [
        (TypeError, lambda: ops.add_sr(gpu.alloc(16, lg.fp16, name="h16"), a, b)),
        (TypeError, lambda: ops.add_sr(a, np.zeros(16, np.float32), b)),  # type: ignore[arg-type]
        (ValueError, lambda: ops.add_sr(a, b, gpu.alloc(17, lg.bf16, name="b17"))),
        (ValueError, lambda: ops.add_sr(b, a, b)),  # dst overlaps b
        (ValueError, lambda: ops.add_sr(big.view(1, 16), big.view(0, 16), b)),  # partial alias of a
        (ValueError, lambda: ops.add_sr(h, a, b)),  # pageable host memory
        (ValueError, lambda: ops.add_sr(a, other, b)),  # another device
        (ValueError, lambda: ops.add_sr(a, a, b, seed=-1)),
        (ValueError, lambda: ops.add_sr(a, a, b, seed=1 << 64)),
        (TypeError, lambda: ops.add_sr(a, a, b, seed=1.5)),  # type: ignore[arg-type]
        (ValueError, lambda: ops.add_sr(a, a, b, index_offset=-1)),
        (ValueError, lambda: ops.add_sr(a, a, b, scale=math.nan)),
        (ValueError, lambda: ops.add_sr(a, a, b, scale=math.inf)),
        (TypeError, lambda: ops.add_sr(a, a, b, stream="default")),
        (ValueError, lambda: ops.reduce_sr(a, src, 0)),
        (TypeError, lambda: ops.reduce_sr(a, src, True)),  # type: ignore[arg-type]
        (ValueError, lambda: ops.reduce_sr(a, src, 3, skip=3)),
        (ValueError, lambda: ops.reduce_sr(a, src, 3, skip=-2)),
        (ValueError, lambda: ops.reduce_sr(a, src, 2)),  # src is not n_shards x dst
        (ValueError, lambda: ops.reduce_sr(src.view(0, 16), src, 3)),  # dst inside src
        (TypeError, lambda: ops.reduce_sr(a, gpu.alloc(48, lg.fp16, name="s16"), 3)),
        (ValueError, lambda: ops.reduce_sr(h, src, 3)),
        (ValueError, lambda: ops.reduce_sr(a, src, 3, scale=math.nan)),
        (TypeError, lambda: ops.fill_zero(np.zeros(4))),  # type: ignore[arg-type]
        (ValueError, lambda: ops.fill_zero(h)),
        (TypeError, lambda: ops.fill_zero(a, stream=1.5)),
        (TypeError, lambda: ops.fill_nan(np.zeros(4))),  # type: ignore[arg-type]
        (TypeError, lambda: ops.fill_nan(gpu.alloc(4, lg.byte, name="bytes"))),  # no NaN in a byte
        (ValueError, lambda: ops.fill_nan(h)),
        (TypeError, lambda: ops.fill_nan(a, stream=1.5)),
        (ValueError, lambda: ops.norm_squared(a, gpu.alloc(2, lg.fp32, name="out2"))),
        (TypeError, lambda: ops.norm_squared(a, gpu.alloc(1, lg.bf16, name="outb"))),
        (TypeError, lambda: ops.norm_squared(gpu.alloc(4, lg.fp16, name="x16"), out)),
        (ValueError, lambda: ops.norm_squared(f32, f32.view(3, 1))),  # out inside x
        (ValueError, lambda: ops.norm_squared(h, out)),
        (ValueError, lambda: ops.norm_squared(other, out)),
        (TypeError, lambda: ops.copy(a, f32)),
        (ValueError, lambda: ops.copy(a, big)),
        (ValueError, lambda: ops.copy(a, other)),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
    assert launched == [], f"kernels were reached for bad arguments: {launched}"


def test_closed_tensor_raises_before_launch(gpu: lg.Device) -> None:
    a, b = gpu.alloc(16, lg.bf16, name="a"), gpu.alloc(16, lg.bf16, name="b")
    dead = gpu.alloc(16, lg.bf16, name="dead")
    dead.close()
    src = gpu.alloc(48, lg.bf16, name="src")
    out = gpu.alloc(1, lg.fp32, name="out")
    for call in (lambda: lg.ops.add_sr(dead, a, b), lambda: lg.ops.add_sr(a, a, dead),
                 lambda: lg.ops.reduce_sr(dead, src, 3), lambda: lg.ops.fill_zero(dead),
                 lambda: lg.ops.norm_squared(dead, out)):
        with pytest.raises(lg.ClosedError, match="dead"):
            call()
    gpu.synchronize()  # nothing bad was queued


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("dtypes", [(lg.bf16, lg.bf16), (lg.bf16, lg.fp32), (lg.fp32, lg.bf16), (lg.fp32, lg.fp32)],
                         ids=_ids)
def test_add_sr_multi_equals_separate_launches(gpu: lg.Device, host: lg.HostDevice,
                                               dtypes: tuple[lg.DType, lg.DType], scale: float) -> None:
    """20 tensors (two launches of up to 16) of mixed sizes, one misaligned view, own offsets and
    seeds, every third tensor with NaN, Inf, overflow and denormals among its values: the
    multi-tensor kernel gives the reference's bits for every tensor. Scale 1 with offsets that are
    multiples of 8 takes the kernel's fast path (one NaN test per group), the rest the general one."""
    rng, seed = _rng()
    d_dt, b_dt = dtypes
    sizes = [1, 7, 9, 4096, 256 * 8 + 3, 70_003, 1 << 20, 3, 17, 1000] * 2
    items, want, outs = [], [], []
    s = gpu.stream()
    seeds = [int(rng.integers(0, 1 << 63)) for _ in sizes]
    for i, n in enumerate(sizes):
        special = i % 3 == 1 and n >= 64  # room for every special value
        a = _with_specials(rng, n + 1, d_dt) if special else _values(rng, n + 1, d_dt)
        b = _with_specials(rng, n, b_dt) if special else _values(rng, n, b_dt)
        off = (_offset(rng) if i % 2 else 8 * int(rng.integers(0, 1 << 40))) if i % 5 else 0
        dst = _put(gpu, a, name="multi_a").view(1, n) if i == 4 else _put(gpu, a[:n], name="multi_a")
        items.append((dst, dst, _put(gpu, b, name="multi_b"), off))
        ref = lg.reference.add_sr(a[1:] if i == 4 else a[:n], b, scale, seeds[i], off, out_dtype=d_dt)
        want.append(ref)
        outs.append(dst)
    run = lg.ops.bind_add_sr_multi(items, seeds, scale)
    run(s.handle)
    s.synchronize()
    for i, (dst, ref) in enumerate(zip(outs, want)):
        assert_bits(dst.numpy(), ref, f"multi tensor {i} n={sizes[i]} rng={seed}")


def test_every_entry_point_read_from_the_sources_loads_with_its_block(gpu: lg.Device) -> None:
    """The table lowgrad/contracts/kernel_source.py reads from kernels/*.cu names functions the cubins hold, and
    each one's block (from __launch_bounds__) is what the driver allows per block."""
    from cuda.bindings import driver as drv

    from lowgrad.cuda.compiler import kernel_specs

    attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
    for symbol, spec in kernel_specs().items():
        k = gpu.kernels.kernel(spec)
        err, limit = drv.cuFuncGetAttribute(attr, drv.CUfunction(k.func))
        assert int(err) == 0 and limit == spec.block, symbol


def test_add_sr_multi_blocks_override_gives_the_same_bits(gpu: lg.Device) -> None:
    """CUDA's tuning knob (the multi-tensor grid) changes the launch shape, never the result."""
    rng, seed = _rng()
    sizes = [5, 4096 * 3 + 1, 70_003, 1 << 16] * 5  # 20 tensors: two launches
    a = [_values(rng, n, lg.bf16) for n in sizes]
    b = [_values(rng, n, lg.fp32) for n in sizes]
    seeds = [int(rng.integers(0, 1 << 63)) for _ in sizes]
    results = []
    for blocks in (None, 1, 3, 1000):
        items = [(d, d, _put(gpu, y, name="multi_b"), 8 * i + 1)
                 for i, (d, y) in enumerate(zip((_put(gpu, x, name="multi_a") for x in a), b))]
        gpu.kernels.bind_add_sr_multi(items, 0.5, (None, 0, seeds), blocks=blocks)(0)
        gpu.synchronize()
        results.append([d.numpy().copy() for d, *_ in items])
    for got in results[1:]:
        for i, (x, y) in enumerate(zip(results[0], got)):
            assert_bits(x, y, f"tensor {i} rng={seed}")


@pytest.mark.parametrize("kind", ["device", "pinned"])
@pytest.mark.parametrize("n,offsets", [(1, (0, 0)), (4097, (0, 0)), (4097, (3, 7)), (1 << 20, (16, 0)), (33, (1, 1))])
def test_core_copy_moves_every_byte(gpu: lg.Device, kind: str, n: int, offsets: tuple[int, int]) -> None:
    """ops.copy_on_cores (Kernels.copy: the managers' copy by the GPU's cores) at odd sizes and misaligned ends,
    into device or pinned memory; the bytes around the destination stay untouched."""
    rng = np.random.default_rng(n)
    do, so = offsets
    src_host = rng.integers(0, 256, n + so, dtype=np.uint8)
    src = lg.from_numpy(src_host, gpu, name="copy_src")
    dst = gpu.alloc((n + do + 5,), lg.byte, kind=kind, name="copy_dst")
    gpu.copy_from_host(dst, np.full(n + do + 5, 0xAB, np.uint8))
    s = gpu.stream()
    lg.ops.copy_on_cores(dst.view(do, n), src.view(so, n), s.handle)
    s.synchronize()
    out = dst.numpy()
    assert out[do:do + n].tobytes() == src_host[so:].tobytes()
    assert (out[:do] == 0xAB).all() and (out[do + n:] == 0xAB).all()
