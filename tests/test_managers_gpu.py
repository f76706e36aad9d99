"""Gradient managers on the GPU at world 1: every strategy's shards equal the host backend's bit
for bit (noise is launch-independent), offload works against pinned memory, and the memory report
matches the sharded strategies' memory formula. Protocol cases on the CUDA path: non-block
gradients produced by some ranks only (at every GPU of the machine, up to 4), reads before a
completed step, the last step."""
from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from test_managers import STRATS, drive, odd_layout, small_layout
from test_protocol import (
    Fetch,
    disjoint,
    expected,
    nb_layout,
    one_step,
    run_engine,
    scattered,
)

import lowgrad as lg
from lowgrad.buffers import release
from lowgrad.managers import ProtocolError
from lowgrad.sr.seedcounter import COUNTER_DTYPE, LAST_STEP

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("micro", [1, 3])
def test_cuda_shards_equal_host_bit_for_bit(strategy: str, offload: bool, micro: int) -> None:
    layout = small_layout(zero_init=True)
    (dev,) = lg.run_threads(1, lambda c: drive(c, layout, strategy, offload, micro, steps=2), backend="cuda")
    (host,) = lg.run_threads(1, lambda c: drive(c, layout, strategy, offload, micro, steps=2), backend="host")
    assert dev.keys() == host.keys()
    for key in dev:
        assert np.array_equal(dev[key], host[key]), (strategy, offload, key)


@pytest.mark.parametrize("strategy", ["scatter_reduce", "all_to_all"])
@pytest.mark.parametrize("inline", [True, False])
def test_cuda_inline_and_communication_stream_paths_equal_host(strategy: str, inline: bool) -> None:
    """World 1, device shards: accumulating on the engine's stream (the default there) and on the
    communication stream give the host backend's bits."""
    layout = small_layout(zero_init=True)

    def run(comm: Any) -> dict[str, np.ndarray]:
        gm = lg.create_gradient_manager(layout, comm, strategy=strategy, inline=inline, seed=3)
        assert gm.inline is inline
        return drive(comm, layout, strategy, False, 3, steps=2, gm=gm)
    (dev,) = lg.run_threads(1, run, backend="cuda")
    (host,) = lg.run_threads(1, run, backend="host")
    assert dev.keys() == host.keys()
    for key in dev:
        assert np.array_equal(dev[key], host[key]), (strategy, inline, key)


@pytest.mark.parametrize("offload", [False, True])
def test_cuda_memory_report_matches_formula(offload: bool) -> None:
    layout = lg.llama_layout("tiny")

    def job(c: Any) -> tuple[dict, bool]:
        # the report is the device's: what earlier tests left for the garbage collector counts until
        # it is collected and released, so collect it first and take the manager's part as a difference
        gc.collect()
        release.drain()
        before = c.device.memory_report().as_dict()
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce", offload=offload)
        shard_kind = gm.shards()[0].kind  # the tensors; their values are read after a step
        after = gm.memory_report().as_dict()
        gm.close()
        rep = {kind: {name: n - before.get(kind, {}).get(name, 0) for name, n in names.items()}
               for kind, names in after.items()}
        return rep, shard_kind == ("pinned" if offload else "device")

    ((rep, kind_ok),) = lg.run_threads(1, job, backend="cuda")
    block, nb, L = 2 * layout.block_numel, 2 * layout.non_block_numel, layout.num_layers
    dev = rep["device"]
    assert kind_ok
    assert dev["block_grad"] == 2 * block and dev["non_block_grad"] == nb
    assert rep["pinned" if offload else "device"]["block_grad_shards"] == L * block
    assert dev["grad_norm"] == 4 and dev["seed_counter"] == 24


def test_cuda_grad_norm_matches_host() -> None:
    layout = small_layout()

    def job(c: Any) -> float:
        gm = lg.create_gradient_manager(layout, c, strategy="scatter_reduce")
        drive(c, layout, "scatter_reduce", False, 2, gm=gm)
        v = float(gm.grad_norm_squared().numpy()[0])
        gm.close()
        return v

    (d,) = lg.run_threads(1, job, backend="cuda")
    (h,) = lg.run_threads(1, job, backend="host")
    assert d == pytest.approx(h, rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("strategy,offload", STRATS)
def test_cuda_zero_d_and_zero_size_parameters_equal_host(world: int, strategy: str, offload: bool) -> None:
    """0-d (world 1) and zero-size parameters on the GPU (world 2: one GPU each, or the loopback
    communicator on one): no zero-size grid is launched (CUDA refuses those), no zero-count
    collective hangs, and the shards, the norm and the statistics equal the host backend's; a
    manager of no parameters has norm 0."""
    layout = odd_layout(world)

    def job(c: Any) -> tuple[dict[str, np.ndarray], float, np.ndarray, float]:
        gm = lg.create_gradient_manager(layout, c, strategy=strategy, offload=offload, stats=True, seed=5)
        got = drive(c, layout, strategy, offload, 3, steps=2, gm=gm)
        norm, rows = float(gm.grad_norm_squared().numpy()[0]), gm.stats().numpy().copy()
        gm.close()
        empty = lg.Layout(block=(), non_block=(), num_layers=2)
        gm = lg.create_gradient_manager(empty, c, strategy=strategy, offload=offload)
        drive(c, empty, strategy, offload, 2, gm=gm)
        zero = float(gm.grad_norm_squared().numpy()[0])
        gm.close()
        return got, norm, rows, zero

    share = world > lg.device_count()
    dev = lg.run_threads(world, job, backend="cuda", share_gpu=share, timeout=120)
    host = lg.run_threads(world, job, backend="host")
    for (d, dn, drows, dz), (h, hn, hrows, hz) in zip(dev, host):
        assert d.keys() == h.keys() and all(np.array_equal(d[k], h[k]) for k in d)
        assert dn == pytest.approx(hn, rel=1e-5) and dz == hz == 0.0
        assert np.allclose(drows, hrows, rtol=1e-5, equal_nan=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,offload", STRATS)
@pytest.mark.parametrize("fetch", [disjoint, scattered], ids=["disjoint", "scattered"])
def test_cuda_every_rank_reduces_every_non_block_gradient(strategy: str, offload: bool, fetch: Fetch) -> None:
    """Ranks (one per GPU, world 4, 2 or 1) producing different non-block gradients: the same
    NCCL collectives on every rank (no hang), exact means with zeros for unproduced ones."""
    world = max(w for w in (1, 2, 4) if w <= lg.device_count())
    layout, M, steps = nb_layout(), 3, 2
    results = lg.run_threads(world, lambda c: run_engine(c, layout, strategy, offload, M, steps, fetch),
                             backend="cuda", timeout=60)
    for rank, per_step in enumerate(results):
        for step, got in enumerate(per_step):
            for key, want in expected(layout, world, rank, M, step, fetch).items():
                np.testing.assert_array_equal(got[key], want, err_msg=f"rank {rank} step {step} {key}")


@pytest.mark.timeout(120)
def test_cuda_reads_need_a_completed_step_and_the_last_step_is_refused() -> None:
    layout = small_layout()

    def job(c: Any) -> tuple[int, ...]:
        gm = lg.create_gradient_manager(layout, c, strategy="all_to_all", seed=2, step=LAST_STEP - 1)
        s = c.device.stream()
        for read in (lambda: gm.block_shard(0, s), lambda: gm.non_block_shard("emb", s),
                     lambda: gm.grad_norm_squared(s)):
            with pytest.raises(ProtocolError, match="before any step completed"):
                read()
        one_step(gm, 2, s)
        gm.block_shard(0, s)
        with pytest.raises(OverflowError):
            gm.start_micro_step(s, 0, 1)
        s.synchronize()
        # base, step, micro
        counter = tuple(int(x) for x in gm._counter.tensor.numpy().view(COUNTER_DTYPE)[0].tolist()[:3])
        gm.close()
        with pytest.raises(lg.ClosedError):
            gm.block_shard(0, s)
        return counter

    assert lg.run_threads(1, job, backend="cuda") == [(2, LAST_STEP, 0)]


@pytest.mark.parametrize("rounding", ["sr", "ldsr", "rn"])
@pytest.mark.parametrize("strategy,offload", [s for s in STRATS if s[0] != "unsharded"])
def test_cuda_roundings_equal_host_bit_for_bit(strategy: str, offload: bool, rounding: str) -> None:
    """Each rounding mode through the device kernels (counter-driven SR, low-discrepancy SR, round
    to nearest), three micro-steps, two steps: the shards equal the host backend's bit for bit."""
    layout = small_layout(zero_init=True)

    def job(c: Any) -> dict[str, np.ndarray]:
        gm = lg.create_gradient_manager(layout, c, strategy=strategy, offload=offload, rounding=rounding, seed=5)
        return drive(c, layout, strategy, offload, 3, steps=2, gm=gm)
    (dev,) = lg.run_threads(1, job, backend="cuda")
    (host,) = lg.run_threads(1, job, backend="host")
    for key in host:
        assert np.array_equal(dev[key], host[key]), (strategy, offload, rounding, key)
